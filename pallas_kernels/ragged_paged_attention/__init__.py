"""Ragged paged attention: jnp reference, Pallas Triton (GPU) and Pallas Mosaic (TPU) kernels."""

from .gpu import ragged_paged_attention_gpu
from .reference import kv_cache_shape, ragged_paged_attention_reference, write_kv
from .tpu import kv_cache_shape_tpu, ragged_paged_attention_tpu, write_kv_tpu

__all__ = [
    "kv_cache_shape",
    "kv_cache_shape_tpu",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "write_kv",
    "write_kv_tpu",
]
