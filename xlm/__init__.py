"""xlm: an LLM inference and serving engine built JAX/XLA-first."""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from xlm import envs
from xlm.jax_version import check_jax_version

__version__ = "0.1.0"

check_jax_version()  # a clear message for an unsupported jax, before anything imports it

# xlm reads configs, tokenizers and chat templates through transformers, which need no
# PyTorch: its advisory warnings are off unless set, before anything imports it.
envs.quiet_transformers_advisories()

# Public names resolved lazily, so `import xlm` stays cheap and never touches a device.
_LAZY = {
    "LLM": "xlm.entrypoints.llm",
    "SamplingParams": "xlm.sampling_params",
    "StructuredOutputsParams": "xlm.structured_output.params",
    "RequestOutput": "xlm.outputs",
    "CompletionOutput": "xlm.outputs",
    "PoolingParams": "xlm.pooling_params",
    "PoolingRequestOutput": "xlm.outputs",
    "EmbeddingRequestOutput": "xlm.outputs",
    "LoRARequest": "xlm.lora.request",
    "platforms": "xlm.platforms",
}

if TYPE_CHECKING:
    from xlm import platforms
    from xlm.entrypoints.llm import LLM
    from xlm.lora.request import LoRARequest
    from xlm.outputs import (
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
    )
    from xlm.pooling_params import PoolingParams
    from xlm.sampling_params import SamplingParams
    from xlm.structured_output.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = import_module(_LAZY[name])
        value = module if module.__name__ == f"xlm.{name}" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'xlm' has no attribute {name!r}")


__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "platforms",
    "__version__",
]
