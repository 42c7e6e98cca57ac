"""Ragged paged attention: jnp reference, Pallas Triton and Mosaic GPU kernels (NVIDIA), Pallas
Mosaic kernel (TPU).

The kernels' modules are imported on first use of their names: importing Pallas and its
Triton and Mosaic front ends takes ~0.1 s, which a CPU run (the reference path) never needs.
"""

from __future__ import annotations

import importlib
from typing import Any

from .gpu_choice import choose_gpu_kernel
from .kv_quant import cache_row_width, dequantize, is_int8, quantize
from .reference import kv_cache_shape, ragged_paged_attention_reference, write_kv

_LAZY = {
    "ragged_paged_attention_gpu": ".gpu",
    "ragged_paged_attention_mosaic_gpu": ".mosaic_gpu",
    "kv_cache_shape_tpu": ".tpu",
    "ragged_paged_attention_tpu": ".tpu",
    "write_kv_tpu": ".tpu",
    "tpu_row_width": ".tpu",
}

__all__ = [
    "cache_row_width",
    "choose_gpu_kernel",
    "dequantize",
    "is_int8",
    "kv_cache_shape",
    "kv_cache_shape_tpu",
    "quantize",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_mosaic_gpu",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "tpu_row_width",
    "write_kv",
    "write_kv_tpu",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
