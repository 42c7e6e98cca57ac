"""Sequence classification: any decoder family's backbone plus a `score` head.

vLLM's `as_seq_cls_model` for xlm: `XForSequenceClassification` checkpoints (and a causal
LM run with `--convert classify`) load into their family's causal-LM class with the
language-model head dropped and a bias-free `score` linear layer [hidden, num_labels]
added, as transformers' `LlamaForSequenceClassification` has it. The pooling runner
applies the head to every token's hidden state (`pooler_head`, [T, num_labels]: a handful
of columns), so the pooler's last-token pooling picks the last token's label logits; the
activation (sigmoid for one label, softmax for several) is applied on the host
(`xlm.worker.pooler.classify_activation`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlm.models.layers import Linear
from xlm.models.pooling_config import num_labels_of
from xlm.models.weights import WeightTarget


class _SequenceClassifier:
    """Mixed in before a causal-LM class: no LM head, a `score` head instead."""

    def __init__(self, hf_config: Any, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        super().__init__(hf_config, dtype=dtype, rngs=rngs)
        if getattr(self, "lm_head", None) is not None:
            self.lm_head = None  # never computed: the classifier's checkpoint has none
        self.score = Linear(
            hf_config.hidden_size,
            num_labels_of(hf_config),
            dtype=dtype,
            rngs=rngs,
            lora=False,
            quantize=False,
        )

    def pooler_head(self, hidden_states: jax.Array) -> jax.Array:
        """hidden_states [T, H] -> label logits [T, num_labels] in float32."""
        return self.score(hidden_states).astype(jnp.float32)

    def hf_weight_targets(
        self, name: str, param_shapes: dict[str, tuple[int, ...]]
    ) -> list[WeightTarget]:
        if name == "lm_head.weight":  # a causal LM run with --convert classify
            return [WeightTarget.skip()]
        if name == "score.weight":
            return [WeightTarget("score.kernel", transpose=True)]
        return super().hf_weight_targets(name, param_shapes)


@functools.cache
def as_seq_cls_model(model_cls: type) -> type:
    """`model_cls` (a causal LM) as a sequence classifier: `LlamaForCausalLM` ->
    `LlamaForSequenceClassification` (one class per family, made once)."""
    name = model_cls.__name__.removesuffix("ForCausalLM").removesuffix("LMHeadModel")
    return type(
        f"{name}ForSequenceClassification",
        (_SequenceClassifier, model_cls),
        {"__module__": __name__, "__doc__": f"{name} backbone with a score head."},
    )
