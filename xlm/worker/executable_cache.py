"""Compiled step programs saved to disk, so a warm start skips tracing and lowering.

JAX's persistent compilation cache skips XLA compilation but still traces and lowers
every program to compute its key (about a second each for a 30-layer model). This cache
keys the serialized executable by what determines it: the engine fingerprint (config,
shapes), the program's typed key, xlm's version, a hash of xlm's own source, the
jax/jaxlib versions and the devices, so an edited xlm never loads a stale program.
Files are written and validated through xlm.disk_cache (atomic, checksummed, 0700); a
file name starts with the source version, so the entries of other versions are what gets
evicted once the directory outgrows its cap.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import jax

from xlm import disk_cache
from xlm.logger import init_logger

logger = init_logger(__name__)

# Directory size past which entries of other source versions are deleted.
DEFAULT_MAX_BYTES = 4 << 30


@functools.cache
def source_fingerprint() -> str:
    """Hash of every Python file of xlm and pallas_kernels."""
    import pallas_kernels
    import xlm

    return disk_cache.source_fingerprint(
        Path(xlm.__file__).parent, Path(pallas_kernels.__file__).parent
    )


class ExecutableCache:
    """Load and store serialized compiled programs under one directory."""

    def __init__(
        self,
        directory: str | None,
        fingerprint: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        kind_fingerprints: dict[str, str] | None = None,
    ) -> None:
        """`fingerprint`: what besides a key decides a program; `kind_fingerprints`: that
        of the kinds of program it does not describe (a sampler's, shared by engines of
        other models), by kind."""
        self.directory = directory
        # Everything but the engine config: what a file name's version prefix stands for.
        self.version = disk_cache.cache_key(
            source_fingerprint(),
            jax.__version__,
            getattr(jax.lib, "__version__", ""),
            ",".join(d.device_kind for d in jax.devices()),
            length=12,
        )
        self._base = self._digest(fingerprint)
        self._kind_bases = {k: self._digest(f) for k, f in (kind_fingerprints or {}).items()}
        if directory:
            try:
                disk_cache.make_private_dir(directory)
                disk_cache.evict(directory, self.version, max_bytes)
            except OSError as e:
                logger.warning("Compiled-program cache %s is unusable: %s", directory, e)
                self.directory = None

    def _digest(self, fingerprint: str) -> str:
        return hashlib.sha256(f"{self.version}|{fingerprint}".encode()).hexdigest()

    def path(self, key: Any, layout: Any = None) -> str:
        """The file of a program's key (any object with a `kind` and a stable repr) and
        its input layout (belt and braces: the engine fingerprint and key decide it)."""
        kind = getattr(key.kind, "value", key.kind)
        base = self._kind_bases.get(kind, self._base)
        digest = hashlib.sha256(f"{base}|{key!r}|{layout!r}".encode()).hexdigest()[:40]
        return os.path.join(self.directory, f"{self.version}-{kind}-{digest}.xla")

    def has(self, key: Any, layout: Any = None) -> bool:
        """Whether a saved program of this key exists (it may still fail to load)."""
        return bool(self.directory) and os.path.exists(self.path(key, layout))

    def load(
        self, key: Any, in_tree: Any, out_tree: Any, layout: Any = None, devices: Any = None
    ) -> Any | None:
        """The saved program, or None when absent or unreadable (then it is recompiled).
        `devices`: the mesh's, in order, that it runs on (None: all of the backend's, which
        misplaces a program of a mesh over some of them)."""
        if not self.directory:
            return None
        path = self.path(key, layout)
        payload = disk_cache.read_entry(path)
        if payload is None:
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            return deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        except Exception as e:  # an incompatible file: compile instead, and replace it
            logger.warning("Ignoring unreadable cached program %s: %s", path, e)
            disk_cache.discard(path)
            return None

    def store(self, key: Any, compiled: Any, layout: Any = None) -> None:
        """Save a compiled program (best effort: a failure only costs a later compile)."""
        if not self.directory:
            return
        from jax.experimental.serialize_executable import serialize

        try:
            payload, _, _ = serialize(compiled)
            disk_cache.write_entry(self.path(key, layout), payload)
        except Exception as e:
            logger.warning("Could not save a compiled %s program: %s", key, e)
