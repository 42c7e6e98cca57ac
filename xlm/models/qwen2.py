"""Qwen2: Llama with q/k/v biases and per-layer sliding windows (layer_types)."""

from __future__ import annotations

from typing import Any

from xlm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, layer_sliding_window


class Qwen2DecoderLayer(LlamaDecoderLayer):
    """Qwen2 block: biased q/k/v, unbiased o, sliding window where layer_types says."""

    def attention_biases(self, config: Any) -> tuple[bool, bool]:
        return True, False

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return layer_sliding_window(config, layer_idx)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM."""

    decoder_layer_cls = Qwen2DecoderLayer
