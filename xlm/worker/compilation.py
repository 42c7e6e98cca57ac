"""Compiled programs of the step: typed keys, AOT lowering, start-up and background
compilation, the saved-program cache and the zero-compile guard.

Shapes come only from buckets (``xlm.worker.buckets``): XLA compiles one program per
bucket. The runner asks for a program by a ``ProgramKey`` (kind and bucket size, plus the
mesh it runs on). At start-up only the programs the first work needs are made ready; the
rest are compiled on a background thread while requests are served, a step whose bucket
is not ready yet running in the next larger ready one (docs/engine.md, "Start-up").
Once every program is ready, a compile is a bug: counted (``num_compilations``), logged.
"""

from __future__ import annotations

import atexit
import enum
import json
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from xlm import envs, platforms
from xlm.config import XlmConfig
from xlm.logger import init_logger
from xlm.multimodal.processor_config import resolve_processor_config
from xlm.ops import FloatMatmul, cpu_kernels
from xlm.worker.buckets import Buckets
from xlm.worker.executable_cache import ExecutableCache

logger = init_logger(__name__)


class ProgramKind(enum.Enum):
    MODEL = "model"  # forward over the ragged batch: KV caches, padded logits, hidden
    SAMPLER = "sampler"  # one token (and logprobs) per row of logits
    PROMPT_LOGPROBS = "prompt_logprobs"  # logprobs of prompt tokens from hidden states
    POOLER = "pooler"  # one vector per request from the hidden states (pooling runner)
    ENCODER = "encoder"  # images -> embeddings in the encoder cache's pool (by image count)


@dataclass(frozen=True)
class MeshSpec:
    """Where a program runs: mesh axis sizes, processes and device ids in mesh order
    (single device: none of them). Part of every key, so programs compiled for one mesh
    (or one set of devices) are never reused on another."""

    axes: tuple[tuple[str, int], ...] = ()
    num_processes: int = 1
    device_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, mesh: jax.sharding.Mesh | None) -> MeshSpec:
        """The spec of a device mesh (None: one device, one process)."""
        if mesh is None:
            return cls()
        devices = list(mesh.devices.flat)
        processes = len({d.process_index for d in devices})
        return cls(tuple(mesh.shape.items()), processes, tuple(d.id for d in devices))


@dataclass(frozen=True)
class ProgramKey:
    """Which compiled program: its kind, its bucket size (MODEL's token bucket, the rows of
    SAMPLER and PROMPT_LOGPROBS), and its mesh."""

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
            model.quantization,  # the kernels' element types and their scales
            model.quant_layout,
            model.hf_config.to_json_string(),
            # The image processor's config sizes the encoder's buckets and its pool
            # (mm_processor_kwargs and the max_pixels cap change them, not the checkpoint).
            json.dumps(resolve_processor_config(config), sort_keys=True, default=str),
            # The step shapes (async scheduling, policy and chunking change no program).
            config.scheduler_config.max_num_batched_tokens,
            config.scheduler_config.max_num_seqs,
            config.scheduler_config.max_model_len,
            # Speculative decoding's rows (logit rows per step, the sampler's largest).
            None
            if config.speculative_config is None
            else config.speculative_config.rows_needed(config.scheduler_config.max_num_seqs),
            config.cache_config.block_size,
            config.cache_config.kv_cache_groups,
            num_blocks,
            str(jnp.dtype(kv_dtype)),
            config.compilation_config.custom_ops,
            config.lora_config,  # adapter slots are parameters of every program
            config.parallel_config,
            mesh,
            _cpu_kernels_in_use(),
            FloatMatmul.float32_kernel,  # whether float32 projections call the kernel
            _xla_options(),
        )
    )


def sampler_fingerprint(config: XlmConfig, vocab_size: int, max_rows: int, sampler: Any) -> str:
    """What besides its key and layout decides a sampler: not the model (it reads only
    logits), so engines of any model with this vocabulary share their saved samplers."""
    return repr(("sampler", vocab_size, max_rows, sampler, config.parallel_config, _xla_options()))


def program_cache(
    config: XlmConfig, engine: tuple[int, Any, Any], sampler: tuple[int, int, Any], saved: bool
) -> ExecutableCache:
    """A runner's saved programs, keyed by the engine's fingerprint (`engine`: KV blocks,
    KV dtype, mesh), its samplers by theirs (`sampler`: vocabulary, largest row bucket,
    sampler config); `saved=False` (an abstract runner): none read or written."""
    return ExecutableCache(
        executable_cache_dir(config) if saved else None,
        engine_fingerprint(config, *engine),
        kind_fingerprints={ProgramKind.SAMPLER.value: sampler_fingerprint(config, *sampler)},
    )


def _xla_options() -> list[str]:
    """XLA's options but the device count (the mesh's): other flags, another program."""
    return re.sub(r"--xla_force_host_platform_device_count=\S*", "", envs.xla_flags()).split()


def _cpu_kernels_in_use() -> bool | None:
    """Whether CPU programs call the native kernels (None off CPU): it changes programs."""
    if not platforms.current_platform.is_cpu():
        return None
    return cpu_kernels.available()


def executable_cache_dir(config: XlmConfig) -> str | None:
    """Where compiled programs are saved, or None when the cache is off. It replaces JAX's
    persistent cache for the step programs (docs/engine.md, "Compiled programs are cached
    by xlm": that one still traces and lowers each; its loaded CPU executables cannot be
    saved again)."""
    cache_dir = envs.XLM_COMPILATION_CACHE_DIR
    if not config.compilation_config.enable_compilation_cache or not cache_dir:
        return None
    if config.parallel_config.is_multihost:
        # A multi-process program loaded back from disk gave wrong tokens on XLA:CPU
        # (Gloo); every process compiles until that is understood.
        return None
    return cache_dir


def _shutdown_at_exit(ref: weakref.ref) -> None:
    compiler = ref()
    if compiler is not None:
        compiler.shutdown()


class ProgramStore:
    """Compiled programs by key, made ready at start-up, in the background, or on first use.

    The engine registers every program it may run (``register``), then makes ready the
    ones its first work needs (``require``: saved ones loaded, the others compiled in
    parallel threads). ``start_background`` makes the rest ready on one thread, one at a
    time: saved programs first (they load in well under a second), then the others
    compiled in the order given. A program the runner needs before its turn is taken out
    of the queue (``require``) or moved to its front (``prefer``). Once every registered
    program is ready, ``num_compilations`` must not move: a later compile is a bug.
    """

    def __init__(self, cache: ExecutableCache) -> None:
        self._cache = cache
        self._programs: dict[ProgramKey, tuple[Any, Any]] = {}  # key -> (static, program)
        self._specs: dict[ProgramKey, ProgramSpec] = {}
        self._saved: set[ProgramKey] = set()  # registered keys with a saved file, not loaded
        self._busy: dict[ProgramKey, threading.Event] = {}  # being compiled or loaded
        self._queue: list[ProgramKey] = []  # the background thread's order
        self._lock = threading.Lock()
        # Tracing (lowering) is done by one thread at a time; compiles run in parallel.
        self._trace_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Programs compiled or loaded so far; once all are ready it must not move.
        self.num_compilations = 0
        self.num_compiled = 0
        self.num_loaded = 0

    # ---- what is ready ---------------------------------------------------------------
    def register(self, specs: dict[ProgramKey, ProgramSpec]) -> None:
        """The programs serving may need (compiled only when required or in the background)."""
        with self._lock:
            for key, spec in specs.items():
                self._specs.setdefault(key, spec)
                if key not in self._programs and self._cache.has(key, spec.static):
                    self._saved.add(key)

    @property
    def num_registered(self) -> int:
        return len(self._specs)

    @property
    def num_ready(self) -> int:
        """Registered programs in memory, ready to run."""
        return sum(1 for key in self._specs if key in self._programs)

    @property
    def all_ready(self) -> bool:
        return self.num_ready == len(self._specs)

    def is_ready(self, key: ProgramKey) -> bool:
        """Whether `key` runs without a compile: in memory, or saved (loaded on first use)."""
        return key in self._programs or key in self._saved

    # ---- making programs ready -------------------------------------------------------
    def require(self, keys: list[ProgramKey]) -> None:
        """Make `keys` ready now (loaded or compiled here, in parallel), or wait for the
        background thread where it is already working on one."""
        mine, waits = [], []
        with self._lock:
            for key in dict.fromkeys(keys):
                if key in self._programs:
                    continue
                if key in self._busy:
                    waits.append(self._busy[key])
                    continue
                self._busy[key] = threading.Event()
                if key in self._queue:
                    self._queue.remove(key)
                mine.append(key)
        self._make_ready(mine)
        for event in waits:
            event.wait()
        missing = [key for key in keys if key not in self._programs]
        if missing:
            raise RuntimeError(f"programs {missing} failed to compile (see the log above)")

    def warmup(self, specs: dict[ProgramKey, ProgramSpec]) -> None:
        """Register `specs` and make every one ready before returning."""
        self.register(specs)
        self.require(list(specs))

    def _make_ready(self, keys: list[ProgramKey]) -> None:
        """Load the saved ones of `keys` in parallel threads while the others are lowered
        here, model programs first, each compiling on a thread as soon as it is lowered
        (so are saved ones that failed to load), and saved. Every key leaves the busy set,
        ready or not."""
        if not keys:
            return
        start, loaded, futures = time.perf_counter(), 0, {}
        try:
            workers = min(len(keys), os.cpu_count() or 1)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                loads = {key: pool.submit(self._load, key) for key in keys if key in self._saved}
                for key in sorted(keys, key=lambda k: k.kind != ProgramKind.MODEL):
                    if key not in loads:
                        futures[key] = pool.submit(self._lower(key).compile)
                for key, future in loads.items():
                    program = future.result()  # None: unreadable, with a warning
                    if program is None:
                        futures[key] = pool.submit(self._lower(key).compile)
                    else:
                        self._install(key, program, compiled=False)
                        loaded += 1
                progress = tqdm(
                    futures.items(),
                    desc="Compiling",
                    disable=envs.XLM_DISABLE_PROGRESS_BARS or len(futures) < 2,
                )
                for key, future in progress:
                    program = future.result()
                    self._cache.store(key, program, self._specs[key].static)
                    self._install(key, program, compiled=True)
        finally:
            with self._lock:
                for key in keys:  # failed ones: waiters wake and find them missing
                    event = self._busy.pop(key, None)
                    if event is not None:
                        event.set()
        logger.debug(
            "%d programs compiled, %d loaded in %.1f s: %s",
            len(futures),
            loaded,
            time.perf_counter() - start,
            ", ".join(f"{k.kind.value}[{k.size}]" for k in keys),
        )

    def _load(self, key: ProgramKey) -> Any | None:
        spec = self._specs[key]
        devices = None if spec.mesh is None else list(spec.mesh.devices.flat)
        return self._cache.load(key, spec.in_tree(), spec.out_tree, spec.static, devices)

    def _lower(self, key: ProgramKey) -> Any:
        with self._trace_lock:
            return self._specs[key].lower()

    def _install(self, key: ProgramKey, program: Any, compiled: bool) -> None:
        with self._lock:
            self._programs[key] = (self._specs[key].static, program)
            self._saved.discard(key)
            self.num_compilations += 1
            if compiled:
                self.num_compiled += 1
            else:
                self.num_loaded += 1
            event = self._busy.pop(key, None)
        if event is not None:
            event.set()

    # ---- the background thread -------------------------------------------------------
    def start_background(self, order: list[ProgramKey]) -> None:
        """Make every registered program not ready yet ready on a background thread:
        saved ones first, then the others in `order` (then any left, in key order)."""
        with self._lock:
            if self._thread is not None or self._stopping:
                return
            rest = [k for k in order if k in self._specs] + [
                k for k in self._specs if k not in order
            ]
            rest = [k for k in dict.fromkeys(rest) if k not in self._programs]
            self._queue = [k for k in rest if k in self._saved] + [
                k for k in rest if k not in self._saved
            ]
            if not self._queue:
                return
            self._thread = threading.Thread(
                target=self._background, name="xlm-compile", daemon=True
            )
        # A process that exits while XLA compiles on a daemon thread aborts ("terminate
        # called ..."): at exit, stop after the program being compiled.
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        self._thread.start()

    def prefer(self, keys: list[ProgramKey]) -> None:
        """Move `keys` to the front of the background queue (a step needed them)."""
        with self._lock:
            front = [k for k in keys if k in self._queue]
            if front:
                self._queue = front + [k for k in self._queue if k not in front]

    def _background(self) -> None:
        start = time.perf_counter()
        while True:
            with self._lock:
                key = None
                while self._queue and not self._stopping:
                    candidate = self._queue.pop(0)
                    if candidate not in self._programs and candidate not in self._busy:
                        key = candidate
                        self._busy[key] = threading.Event()
                        break
            if key is None:
                break
            try:
                self._make_ready([key])
            except RuntimeError as e:
                # The interpreter exits (a script returned while programs compiled): its
                # thread pools take no more work; nothing is lost.
                if "interpreter shutdown" in str(e):
                    return
                logger.exception("Background compilation of the %s program failed", key)
            except Exception:  # the program is compiled on first use instead
                logger.exception("Background compilation of the %s program failed", key)
        if not self._stopping:
            logger.info(
                "All %d programs ready (%d compiled, %d loaded; background %.1f s).",
                self.num_ready,
                self.num_compiled,
                self.num_loaded,
                time.perf_counter() - start,
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background thread; whether every registered program is ready."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self.all_ready

    def shutdown(self) -> None:
        """Stop the background thread after the program it is on (a compile cannot be cut
        short, and a process that exits during one aborts)."""
        with self._lock:
            self._stopping = True
            self._queue.clear()
        if self._thread is not None:
            self._thread.join()

    # ---- the runner's calls ----------------------------------------------------------
    def get(self, key: ProgramKey, spec: Callable[[], ProgramSpec], static: Any = None) -> Any:
        """The program for `key`: made ready here if it is not (first use of a registered
        program), or compiled from `spec` (a shape nothing registered: a bug, logged).

        `static` is the layout of this call's packed inputs; it must be the one the
        program was compiled for (a bucket determines its layout).
        """
        entry = self._programs.get(key)
        if entry is None:
            if key in self._specs:
                self.require([key])
            else:
                logger.warning("Compiling a %s program for new shapes during serving.", key)
                with self._lock:
                    self._specs[key] = spec()
                self.require([key])
            entry = self._programs[key]
        if entry[0] != static:
            raise RuntimeError(f"{key} was compiled for another input layout")
        return entry[1]

    def summary(self) -> str:
        """Programs ready, for the start-up line: '3 of 17 ready: 2 compiled, 1 loaded'."""
        return (
            f"{self.num_ready} of {self.num_registered} ready: {self.num_compiled} compiled, "
            f"{self.num_loaded} loaded"
        )


class BucketReadiness:
    """Which token bucket a step runs in, from which of the programs are ready, and the
    start-up mode (``startup_programs``) that decides when the others are made ready."""

    def __init__(
        self,
        store: ProgramStore,
        buckets: Buckets,
        keys: dict[int, list[ProgramKey]],
        others: list[ProgramStore] | None = None,
    ) -> None:
        self.store = store
        # Stores whose programs count with this one's (a draft model's).
        self.others = others or []
        self.buckets = buckets
        # The programs a step of each token bucket runs (model and sampler, or pooler): a
        # table, not the runner's method, so this holds no reference back to the runner.
        self.keys = keys
        self.startup_programs = "all"

    @property
    def stores(self) -> list[ProgramStore]:
        return [self.store, *self.others]

    @property
    def num_compilations(self) -> int:
        """Programs compiled or loaded so far, the other stores' included."""
        return sum(s.num_compilations for s in self.stores)

    def programs_ready(self) -> tuple[int, int]:
        """(ready, registered) programs, the other stores' included."""
        return sum(s.num_ready for s in self.stores), sum(s.num_registered for s in self.stores)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background compilation; whether every program is ready."""
        return all([s.wait(timeout) for s in self.stores])

    def shutdown(self) -> None:
        """Stop the background compilation (the other stores' too)."""
        for store in self.stores:
            store.shutdown()

    def bucket_keys(self, bucket: int) -> list[ProgramKey]:
        return self.keys[bucket]

    def step_keys(self, bucket: int, real_rows: int) -> list[ProgramKey]:
        """A step's programs: its bucket's model (or pooler) and its rows' one sampler."""
        rows = self.buckets.sampler_rows(self.buckets.logit_rows_for_tokens(bucket), real_rows)
        return [k for k in self.keys[bucket] if k.kind != ProgramKind.SAMPLER or k.size == rows]

    def ready_bucket(self, num_tokens: int, real_rows: int) -> int:
        """The token bucket a step of `num_tokens` and `real_rows` logit rows runs in: its
        own when its programs are ready, else the next larger ready one (more padding, the
        same tokens out) while its own moves to the front of the background queue; when
        none is, its own step's programs are made ready now ("first-use", "used")."""
        exact = self.buckets.token_bucket(num_tokens)
        store = self.store
        if store.all_ready:
            return exact
        # "used" compiles nothing in the background, so a step padded into a larger ready
        # bucket would leave its own never ready and every later step of its size padded
        # too (on an H200, a 64-request decode ran in the 2048-token bucket: 64 ms a step).
        # There only a step of the smallest buckets takes a larger ready one, up to the first
        # fine bucket; any other compiles its own now.
        largest = self.buckets.token_buckets[-1]
        if self.startup_programs == "used":
            largest = max(exact, self.buckets.first_fine_bucket)
        ready = [
            b
            for b in self.buckets.token_buckets
            if exact <= b <= largest
            and all(store.is_ready(k) for k in self.step_keys(b, real_rows))
        ]
        if ready and ready[0] != exact:
            store.prefer(self.bucket_keys(exact))
        # Saved programs load in parallel, others compile (only when none was ready).
        chosen = ready[0] if ready else exact
        store.require(self.step_keys(chosen, real_rows))
        if self.startup_programs != "used":  # after the first step's programs (once)
            store.start_background(self.background_order())
        return chosen

    def background_order(self) -> list[ProgramKey]:
        """Smallest token bucket first, each with its sampler (or pooler): every model
        program compiles in about the same time, and a missing small bucket costs the
        most (a decode step padded from 1 token to 2048 runs ~70x longer on CPU:
        docs/engine.md, "Start-up"); the store then takes the rest (prompt logprobs)."""
        return [k for b in self.buckets.token_buckets for k in self.bucket_keys(b)]

    def warmup(self, specs: dict[ProgramKey, ProgramSpec], startup_programs: str) -> None:
        """Make programs ready before serving: every one ("all"), the largest and first fine
        bucket's with the rest compiled in the background ("largest"), or none until the
        first step, whose bucket is compiled then and the rest in the background
        ("first-use") or each when a step first needs it ("used")."""
        self.startup_programs = startup_programs
        if startup_programs == "all":
            self.store.warmup(specs)
            return
        self.store.register(specs)
        if startup_programs == "largest":
            self.store.require([k for b in self.buckets.serving_buckets() for k in self.keys[b]])
            self.store.start_background(self.background_order())
