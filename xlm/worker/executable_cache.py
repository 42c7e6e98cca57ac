"""Compiled step programs saved to disk, so a warm start skips tracing and lowering.

JAX's persistent compilation cache skips XLA compilation but still traces and lowers
every program to compute its key (about a second each for a 30-layer model). This cache
keys the serialized executable by what determines it: the engine config, the program's
input layout, the jax/jaxlib versions, the devices, and a hash of xlm's own source, so an
edited xlm never loads a stale program.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import jax

from xlm.logger import init_logger

logger = init_logger(__name__)


@functools.cache
def source_fingerprint() -> str:
    """Hash of every Python file of xlm and pallas_kernels."""
    import pallas_kernels
    import xlm

    digest = hashlib.sha256()
    for package in (xlm, pallas_kernels):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class ExecutableCache:
    """Load and store serialized compiled programs under one directory."""

    def __init__(self, directory: str | None, fingerprint: str) -> None:
        self.directory = directory
        base = "|".join(
            [
                fingerprint,
                source_fingerprint(),
                jax.__version__,
                jax.lib.__version__ if hasattr(jax.lib, "__version__") else "",
                ",".join(d.device_kind for d in jax.devices()),
            ]
        )
        self._base = hashlib.sha256(base.encode()).hexdigest()
        if directory:
            os.makedirs(directory, exist_ok=True)

    def _path(self, kind: str, layout: Any) -> str:
        key = hashlib.sha256(f"{self._base}|{kind}|{layout!r}".encode()).hexdigest()[:40]
        return os.path.join(self.directory, f"{kind}-{key}.xla")

    def load(self, kind: str, layout: Any, in_tree: Any, out_tree: Any) -> Any | None:
        """The saved program, or None when absent or unreadable."""
        if not self.directory:
            return None
        path = self._path(kind, layout)
        if not os.path.exists(path):
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            with open(path, "rb") as f:
                return deserialize_and_load(f.read(), in_tree, out_tree)
        except Exception as e:  # a corrupt or incompatible file: compile instead
            logger.warning("Ignoring unreadable cached program %s: %s", path, e)
            return None

    def store(self, kind: str, layout: Any, compiled: Any) -> None:
        """Save a compiled program (best effort: a failure only costs a later compile)."""
        if not self.directory:
            return
        from jax.experimental.serialize_executable import serialize

        try:
            payload, _, _ = serialize(compiled)
            fd, tmp = tempfile.mkstemp(dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            os.replace(tmp, self._path(kind, layout))
        except Exception as e:
            logger.warning("Could not save a compiled %s program: %s", kind, e)
