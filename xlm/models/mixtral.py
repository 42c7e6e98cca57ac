"""Mixtral: Mistral attention with top-2 routed experts on every layer.

The experts run on the sort-based `ragged_dot` path of Qwen3-MoE (`SparseMoeBlock`);
Mixtral always renormalizes the top-k router weights.
"""

from __future__ import annotations

import re
from typing import Any

from flax import nnx

from xlm.models.llama import LlamaForCausalLM
from xlm.models.mistral import MistralDecoderLayer
from xlm.models.qwen3_moe import SparseMoeBlock
from xlm.models.weights import WeightTarget, column_part


class MixtralDecoderLayer(MistralDecoderLayer):
    """Mistral block whose MLP is a sparse mixture of experts."""

    def make_mlp(self, config: Any, layer_idx: int, *, dtype: Any, rngs: nnx.Rngs) -> nnx.Module:
        return SparseMoeBlock(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            True,
            dtype=dtype,
            rngs=rngs,
        )


# Hub checkpoints: experts.{e}.w1 (gate), w3 (up), w2 (down), [out, in] each.
_PER_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_ROUTER = re.compile(r"(.*)\.block_sparse_moe\.gate\.weight")
# transformers 5 in memory: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I].
_FUSED = re.compile(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)")


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral causal LM."""

    decoder_layer_cls = MixtralDecoderLayer

    def hf_weight_targets(
        self, name: str, param_shapes: dict[str, tuple[int, ...]]
    ) -> list[WeightTarget]:
        if m := _PER_EXPERT.fullmatch(name):
            mlp, expert, w = f"{m.group(1)}.mlp", int(m.group(2)), m.group(3)
            if w == "w2":
                return [WeightTarget(f"{mlp}.down_proj", (expert,), transpose=True)]
            path = f"{mlp}.gate_up_proj"
            cols = column_part(param_shapes[path][1:], int(w == "w3"), 2)
            return [WeightTarget(path, (expert, *cols), transpose=True)]
        if m := _ROUTER.fullmatch(name):
            return [WeightTarget(f"{m.group(1)}.mlp.gate.kernel", transpose=True)]
        if m := _FUSED.fullmatch(name):
            return [WeightTarget(f"{m.group(1)}.mlp.{m.group(2)}", transpose=True)]
        if name.endswith(".mlp.gate.weight"):  # transformers 5's router name
            return [WeightTarget(name[: -len("weight")] + "kernel", transpose=True)]
        return super().hf_weight_targets(name, param_shapes)
