"""Qwen3: Llama with per-head RMSNorm on queries and keys before rotary."""

from __future__ import annotations

from typing import Any

from xlm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, layer_sliding_window


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Qwen3 block: q/k norm, optional attention bias, sliding window per layer_types."""

    qk_norm = True

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return layer_sliding_window(config, layer_idx)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense causal LM."""

    decoder_layer_cls = Qwen3DecoderLayer
