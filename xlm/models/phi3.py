"""Phi-3 (and Phi-3.5/Phi-4-mini text): Llama-shaped with fused qkv and gate_up projections
in the checkpoint, LongRoPE ("longrope"/"su") scaling, an optional sliding window."""

from __future__ import annotations

from typing import Any

from xlm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Phi3DecoderLayer(LlamaDecoderLayer):
    """Llama block with one qkv_proj (q, k, v rows in that order in the checkpoint)."""

    fused_qkv = True

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM; its gate_up_proj (gate rows, then up) loads into GatedMLP as is."""

    decoder_layer_cls = Phi3DecoderLayer
