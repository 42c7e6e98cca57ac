"""ModelRegistry: Hugging Face `architectures` names -> xlm model classes, imported lazily."""

from __future__ import annotations

import importlib
from typing import Any

from xlm.logger import init_logger

logger = init_logger(__name__)

_BUILTIN_MODELS: dict[str, str] = {
    "Gemma2ForCausalLM": "xlm.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "xlm.models.gemma2:Gemma3ForCausalLM",
    "GPT2LMHeadModel": "xlm.models.gpt2:GPT2LMHeadModel",
    "LlamaForCausalLM": "xlm.models.llama:LlamaForCausalLM",
    "LlavaForConditionalGeneration": "xlm.models.llava:LlavaForConditionalGeneration",
    "MistralForCausalLM": "xlm.models.mistral:MistralForCausalLM",
    "MixtralForCausalLM": "xlm.models.mixtral:MixtralForCausalLM",
    "OPTForCausalLM": "xlm.models.opt:OPTForCausalLM",
    "Phi3ForCausalLM": "xlm.models.phi3:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "xlm.models.qwen2:Qwen2ForCausalLM",
    "Qwen2VLForConditionalGeneration": "xlm.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": (
        "xlm.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration"
    ),
    "Qwen3ForCausalLM": "xlm.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "xlm.models.qwen3_moe:Qwen3MoeForCausalLM",
}


class _ModelRegistry:
    """Architecture name -> model class or its "module:Class" qualname."""

    def __init__(self) -> None:
        self.models: dict[str, type | str] = dict(_BUILTIN_MODELS)

    def register_model(self, architecture: str, model_cls: type | str) -> None:
        """Register (or override) the class serving `architecture`."""
        if isinstance(model_cls, str) and ":" not in model_cls:
            raise ValueError(
                f"model class {model_cls!r} for {architecture!r} must be a class or a "
                "'module.path:ClassName' string"
            )
        if architecture in self.models:
            logger.warning("Model architecture %s is already registered; overriding.", architecture)
        self.models[architecture] = model_cls

    def get_supported_archs(self) -> list[str]:
        """Every architecture name that resolves."""
        return sorted(self.models)

    def load_model_cls(self, architecture: str) -> type:
        """The class registered for `architecture` (importing it on first use)."""
        entry = self.models[architecture]
        if isinstance(entry, str):
            module_name, _, cls_name = entry.partition(":")
            entry = getattr(importlib.import_module(module_name), cls_name)
            self.models[architecture] = entry
        return entry

    def resolve(self, hf_config: Any) -> tuple[type, str]:
        """(model class, architecture name) for a transformers config."""
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(
                f"The model config (model_type={getattr(hf_config, 'model_type', None)!r}) "
                "has no 'architectures' field, so xlm cannot pick a model class. Add e.g. "
                '"architectures": ["LlamaForCausalLM"] to config.json. Supported '
                f"architectures: {', '.join(self.get_supported_archs())}"
            )
        for arch in archs:
            if arch in self.models:
                return self.load_model_cls(arch), arch
        for arch in archs:  # a headless base model or a classifier: its family's LM class
            lm = base_model_lm(arch) or seq_cls_lm(arch)
            if lm is not None and lm in self.models:
                return self.load_model_cls(lm), arch
        raise ValueError(
            f"Model architectures {archs} are not supported by xlm. Supported architectures: "
            f"{', '.join(self.get_supported_archs())}. A plugin can add one with "
            "ModelRegistry.register_model(name, cls)."
        )


ModelRegistry = _ModelRegistry()


def base_model_lm(architecture: str) -> str | None:
    """`Qwen3Model` -> `Qwen3ForCausalLM`: a headless checkpoint (embedders such as
    e5-mistral) runs on its family's class as a pooler; None for other names."""
    if architecture.endswith("Model") and not architecture.endswith(
        ("LMHeadModel", "PreTrainedModel")
    ):
        return architecture[: -len("Model")] + "ForCausalLM"
    return None


def seq_cls_lm(architecture: str) -> str | None:
    """`Qwen2ForSequenceClassification` -> `Qwen2ForCausalLM`: a classifier runs on its
    family's class with a score head (xlm.models.classifier); None for other names."""
    suffix = "ForSequenceClassification"
    if not architecture.endswith(suffix):
        return None
    family = architecture[: -len(suffix)]
    return family + ("LMHeadModel" if family == "GPT2" else "ForCausalLM")


def register_model(architecture: str, model_cls: type | str) -> None:
    """Register an out-of-tree model class (or "module:Class") for an HF architecture."""
    ModelRegistry.register_model(architecture, model_cls)
