"""Mistral: Llama with a sliding window on every layer when the config sets one."""

from __future__ import annotations

from typing import Any

from xlm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class MistralDecoderLayer(LlamaDecoderLayer):
    """Mistral block: attention limited to config.sliding_window tokens when set."""

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral causal LM."""

    decoder_layer_cls = MistralDecoderLayer
