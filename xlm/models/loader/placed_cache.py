"""A GGUF's weights saved as the model holds them: the placed cache.

On a CPU without a mesh, a GGUF model's parameters are saved after its first start
exactly as they were placed (q/k/v and gate/up fused, kernels in their stored layout,
quantized codes and scales where `--quantization` made them), so a warm start copies each
from one memory-mapped file into host memory the device takes as it is: no dequantizing,
transposing or fusing. Elsewhere (a mesh, an accelerator) the dequantized GGUF in the
checkpoint's own layout serves (`_dequantized_gguf_dir`), since the placed layout is
one device's.

An entry is keyed by the GGUF file (path, size, mtime), the model's parameter signature
(paths, shapes, stored dtypes and layouts: another dtype, quantization or adapter layout
is another entry) and the source of the code that decides the values (the models, the
loader, the quantization); a newer source replaces its stale entries. Written and checked through
xlm.disk_cache (atomic, a manifest of sizes), plus the safetensors header; the LoRA
slots are not saved (placed as zeros, as a load from the GGUF does).
"""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path
from typing import Any

import jax
import numpy as np

from xlm import disk_cache, envs, platforms
from xlm.logger import init_logger
from xlm.models.loader.safetensors_format import iter_safetensors_file, write_safetensors

logger = init_logger(__name__)

FILE = "model.safetensors"


def applies(mesh: Any) -> bool:
    """Whether a load keeps (and reads) a placed cache: one CPU device, no mesh."""
    return mesh is None and platforms.current_platform.is_cpu()


@cache
def _layout_source() -> str:
    """The source that decides placed values: the models (their loader included), the
    quantization and the tensor-parallel layout."""
    xlm_dir = Path(__file__).resolve().parents[2]
    fingerprint = disk_cache.source_fingerprint(
        xlm_dir / "models", xlm_dir / "quantization.py", xlm_dir / "distributed"
    )
    return disk_cache.cache_key(fingerprint, length=12)


def signature(stored: dict[str, tuple[tuple[int, ...], Any, str]]) -> str:
    """A key over the parameters' paths, physical shapes, stored dtypes and layouts
    (xlm.models.loader.placement.stored_layout)."""
    text = repr(
        sorted((p, (shape, str(dtype), layout)) for p, (shape, dtype, layout) in stored.items())
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry_dir(gguf_path: str, params: str) -> tuple[str, str]:
    """(the entry's directory, the prefix its stale source versions share)."""
    path = os.path.abspath(gguf_path)
    stat = os.stat(path)
    prefix = disk_cache.cache_key(path, stat.st_size, stat.st_mtime_ns, params)
    root = os.path.join(envs.XLM_CACHE_ROOT, "gguf_placed")
    return os.path.join(root, f"{prefix}-{_layout_source()}"), prefix


def read(directory: str) -> dict[str, np.ndarray] | None:
    """The saved parameters (memory-mapped), or None when the entry is absent or broken
    (a broken one is discarded)."""
    if not disk_cache.check_directory(directory):
        return None
    try:
        return dict(iter_safetensors_file(os.path.join(directory, FILE)))
    except (OSError, ValueError, KeyError) as e:
        logger.warning("Discarding the unreadable placed-weights cache %s (%s).", directory, e)
        disk_cache.discard(directory)
        return None


def write(directory: str, stale_prefix: str, arrays: dict[str, jax.Array]) -> None:
    """Save `arrays` (the placed parameters) as the entry, and drop the entries of other
    source versions of the same GGUF and parameters."""
    host = {path: np.asarray(value) for path, value in arrays.items()}
    logger.info("Saving the placed weights in %s.", directory)
    with disk_cache.atomic_directory(directory) as tmp:
        write_safetensors(os.path.join(tmp, FILE), host)
    root, name = os.path.split(directory)
    for other in os.listdir(root):
        if other.startswith(stale_prefix + "-") and other != name:
            disk_cache.discard(os.path.join(root, other))
