"""Compiled programs of the step: typed keys, AOT lowering, warm-up, the saved-program
cache and the zero-compile guard.

Shapes come only from buckets (``xlm.worker.buckets``): XLA compiles one program per
bucket, all during warm-up. The runner asks for a
program by a ``ProgramKey`` (kind and bucket size, plus the mesh it runs on); every
compile after warm-up is counted (``num_compilations``) and logged, since it is a bug.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from xlm import envs
from xlm.config import XlmConfig
from xlm.logger import init_logger
from xlm.metrics import startup
from xlm.worker.executable_cache import ExecutableCache

logger = init_logger(__name__)


class ProgramKind(enum.Enum):
    MODEL = "model"  # forward over the ragged batch: KV caches, padded logits, hidden
    SAMPLER = "sampler"  # one token (and logprobs) per row of logits
    PROMPT_LOGPROBS = "prompt_logprobs"  # logprobs of prompt tokens from hidden states
    POOLER = "pooler"  # one vector per request from the hidden states (pooling runner)


@dataclass(frozen=True)
class MeshSpec:
    """Where a program runs: mesh axis sizes and the number of processes (single device:
    no axes, one process). Part of every key and of the fingerprint, so programs compiled
    for one mesh are never reused on another."""

    axes: tuple[tuple[str, int], ...] = ()
    num_processes: int = 1

    @classmethod
    def of(cls, mesh: jax.sharding.Mesh | None) -> MeshSpec:
        """The spec of a device mesh (None: one device, one process)."""
        if mesh is None:
            return cls()
        processes = len({d.process_index for d in mesh.devices.flat})
        return cls(tuple(mesh.shape.items()), processes)


@dataclass(frozen=True)
class ProgramKey:
    """Which compiled program: its kind, its bucket size, and its mesh.

    ``size`` is the token bucket for MODEL and the row count for SAMPLER and
    PROMPT_LOGPROBS.
    """

    kind: ProgramKind
    size: int
    mesh: MeshSpec = MeshSpec()


@dataclass
class ProgramSpec:
    """How to compile a program: its jitted function, example arguments (arrays or
    ShapeDtypeStructs), the static layout passed last (None: none), and its output pytree
    (to load a saved program without tracing)."""

    fn: Any
    args: tuple
    static: Any
    out_tree: Any
    # The device mesh to trace under (ops that shard_map their kernels read it).
    mesh: Any = None

    def lower(self) -> Any:
        if self.mesh is not None:
            with jax.set_mesh(self.mesh):
                return self._lower()
        return self._lower()

    def _lower(self) -> Any:
        if self.static is None:
            return self.fn.lower(*self.args)
        return self.fn.lower(*self.args, self.static)

    def in_tree(self) -> Any:
        return jax.tree_util.tree_structure((self.args, {}))


def engine_fingerprint(
    config: XlmConfig, num_blocks: int, kv_dtype: Any, mesh: MeshSpec = MeshSpec()
) -> str:
    """What besides a program's key decides the compiled programs."""
    model = config.model_config
    return repr(
        (
            model.model,
            model.runner,  # a pooling program returns no logits: another output tree
            model.dtype,
            model.hf_config.to_json_string(),
            # The step shapes (async scheduling, policy and chunking change no program).
            config.scheduler_config.max_num_batched_tokens,
            config.scheduler_config.max_num_seqs,
            config.scheduler_config.max_model_len,
            config.cache_config.block_size,
            config.cache_config.kv_cache_groups,
            num_blocks,
            str(jnp.dtype(kv_dtype)),
            config.compilation_config.custom_ops,
            config.parallel_config,
            mesh,
        )
    )


def executable_cache_dir(config: XlmConfig) -> str | None:
    """Where compiled programs are saved, or None when the cache is off.

    This replaces JAX's persistent compilation cache for the step programs: that cache
    still traces and lowers each program (~1 s each), and on XLA:CPU an executable it
    loaded cannot be serialized again (the reloaded copy fails with "Function ... not
    found"), so the two must not be mixed.
    """
    cache_dir = envs.XLM_COMPILATION_CACHE_DIR
    if not config.compilation_config.enable_compilation_cache or not cache_dir:
        return None
    if config.parallel_config.is_multihost:
        # A multi-process program loaded back from disk gave wrong tokens on XLA:CPU
        # (Gloo); every process compiles until that is understood.
        return None
    return cache_dir


class Compiler:
    """Compiled programs by key: compiled (or loaded) at warm-up, counted after."""

    def __init__(self, cache: ExecutableCache) -> None:
        self._cache = cache
        self._programs: dict[ProgramKey, tuple[Any, Any]] = {}  # key -> (static, program)
        # Programs compiled or loaded so far; after warm-up it must not move.
        self.num_compilations = 0

    def get(self, key: ProgramKey, spec: Callable[[], ProgramSpec], static: Any = None) -> Any:
        """The program for `key` (`spec` builds it on a miss: a bug after warm-up).

        `static` is the layout of this call's packed inputs; it must be the one the
        program was compiled for (a bucket determines its layout).
        """
        entry = self._programs.get(key)
        if entry is None:
            logger.warning("Compiling a %s program for new shapes during serving.", key)
            program = spec().lower().compile()
            self._programs[key] = (static, program)
            self.num_compilations += 1
            return program
        if entry[0] != static:
            raise RuntimeError(f"{key} was compiled for another input layout")
        return entry[1]

    def warmup(self, specs: dict[ProgramKey, ProgramSpec]) -> None:
        """Load saved programs, compile the others in parallel threads, and save them."""
        start = time.perf_counter()
        lowered: dict[ProgramKey, Any] = {}
        loaded = 0
        for key, spec in specs.items():
            if key in self._programs:
                continue
            program = self._cache.load(key, spec.in_tree(), spec.out_tree, spec.static)
            if program is not None:
                self._programs[key] = (spec.static, program)
                loaded += 1
            else:
                lowered[key] = spec.lower()
        keys = list(lowered)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = [pool.submit(lowered[k].compile) for k in keys]
            for key, future in zip(
                keys, tqdm(futures, desc="Compiling", disable=envs.XLM_DISABLE_PROGRESS_BARS)
            ):
                program = future.result()
                self._programs[key] = (specs[key].static, program)
                self._cache.store(key, program, specs[key].static)
        self.num_compilations += len(keys) + loaded
        startup.note("programs", f"{len(keys)} compiled, {loaded} loaded")
        logger.info(
            "Compiled %d programs, loaded %d saved ones, in %.1f s.",
            len(keys),
            loaded,
            time.perf_counter() - start,
        )
