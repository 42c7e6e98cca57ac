"""Every XLM_* environment variable, read in one place.

Values are read on attribute access (``xlm.envs.XLM_PLUGINS``), so tests and
subprocesses that change the environment see the change.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _get_plugins() -> list[str] | None:
    value = os.environ.get("XLM_PLUGINS")
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def _get_float(name: str, default: float | None) -> Callable[[], float | None]:
    def read() -> float | None:
        value = os.environ.get(name)
        if value is None or value == "":
            return default
        try:
            return float(value)
        except ValueError as e:
            raise ValueError(f"{name}={value!r} is not a number") from e

    return read


def _get_bool(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        value = os.environ.get(name)
        if value is None or value == "":
            return default
        return value.strip().lower() in ("1", "true", "yes", "on")

    return read


def _default_cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xlm")


_VARIABLES: dict[str, Callable[[], Any]] = {
    # Comma list of plugin names to load; unset loads all, empty loads none.
    "XLM_PLUGINS": _get_plugins,
    # Level of the "xlm" logger.
    "XLM_LOGGING_LEVEL": lambda: os.environ.get("XLM_LOGGING_LEVEL", "INFO").upper(),
    # Whether xlm configures its own log handler.
    "XLM_CONFIGURE_LOGGING": _get_bool("XLM_CONFIGURE_LOGGING", True),
    # KV cache size on CPU, in GiB (None: the CacheConfig default).
    "XLM_CPU_KVCACHE_SPACE": _get_float("XLM_CPU_KVCACHE_SPACE", None),
    # Root of xlm's caches (compilation cache, converted models).
    "XLM_CACHE_ROOT": lambda: os.environ.get("XLM_CACHE_ROOT", _default_cache_root()),
    # Cache of compiled step programs, reused by the next start ("" disables it).
    "XLM_COMPILATION_CACHE_DIR": lambda: os.environ.get(
        "XLM_COMPILATION_CACHE_DIR", os.path.join(_get_cache_root(), "compiled_programs")
    ),
    # Force a platform by name (cpu, cuda, rocm, tpu), skipping detection.
    "XLM_TARGET_PLATFORM": lambda: os.environ.get("XLM_TARGET_PLATFORM") or None,
    # Turn tqdm progress bars off everywhere.
    "XLM_DISABLE_PROGRESS_BARS": _get_bool("XLM_DISABLE_PROGRESS_BARS", False),
    # 1: import xlm with a jax outside the supported range (xlm.jax_version).
    "XLM_SKIP_JAX_VERSION_CHECK": _get_bool("XLM_SKIP_JAX_VERSION_CHECK", False),
    # Use xlm's native CPU kernels (built with the system C++ compiler on first use);
    # 0 keeps every op on its plain-jnp path.
    "XLM_CPU_KERNELS": _get_bool("XLM_CPU_KERNELS", True),
    # Load the CPU kernel library the package build made (when its key matches this
    # runtime's); 0 always uses the one built at run time (into XLM_CACHE_ROOT).
    "XLM_CPU_KERNELS_PREBUILT": _get_bool("XLM_CPU_KERNELS_PREBUILT", True),
    # The widest vector instructions the CPU kernels use: native (this CPU's, AVX-512
    # where it has it) or avx2 (AVX-512 off; xlm/ops/cpu_kernels/build.py's ISA_FLAGS).
    "XLM_CPU_KERNELS_ISA": lambda: os.environ.get("XLM_CPU_KERNELS_ISA") or "native",
    # Microseconds the CPU kernels' own helper threads spin after a small (decode) call
    # before sleeping (xlm/ops/cpu_kernels/column_split.h; the library reads it itself at
    # its first split); 0: every split wakes XLA's intra-op pool instead.
    "XLM_CPU_SPIN_US": _get_float("XLM_CPU_SPIN_US", 200.0),
    # Microseconds the CPU kernels run on the calling thread alone after a split waited
    # on a descheduled helper, at first; doubled while such waits go on, at most 100 ms
    # (column_split.h's SplitBackoff, which reads it itself at its first wait).
    "XLM_CPU_SPLIT_BACKOFF_US": _get_float("XLM_CPU_SPLIT_BACKOFF_US", 2000.0),
    # Directory holding the ipc:// socket files of the engine's ZeroMQ sockets.
    "XLM_RPC_BASE_PATH": lambda: os.environ.get("XLM_RPC_BASE_PATH", "/tmp"),
    # Seconds the engine-core client waits for the engine process to start.
    "XLM_ENGINE_READY_TIMEOUT_S": _get_float("XLM_ENGINE_READY_TIMEOUT_S", 600.0),
    # API key the server requires on /v1/* when --api-key is not given.
    "XLM_API_KEY": lambda: os.environ.get("XLM_API_KEY") or None,
    # Seconds between periodic stat log lines of the server (0 disables).
    "XLM_LOG_STATS_INTERVAL": _get_float("XLM_LOG_STATS_INTERVAL", 10.0),
    # Fallbacks of the multi-host options (--tensor-parallel-size, ... on the CLI).
    "XLM_TENSOR_PARALLEL_SIZE": lambda: _get_int("XLM_TENSOR_PARALLEL_SIZE"),
    "XLM_DISTRIBUTED_EXECUTOR_BACKEND": lambda: (
        os.environ.get("XLM_DISTRIBUTED_EXECUTOR_BACKEND") or None
    ),
    "XLM_COORDINATOR_ADDRESS": lambda: os.environ.get("XLM_COORDINATOR_ADDRESS") or None,
    "XLM_NUM_PROCESSES": lambda: _get_int("XLM_NUM_PROCESSES"),
    "XLM_PROCESS_ID": lambda: _get_int("XLM_PROCESS_ID"),
    # Multi-host: a process silent this many seconds is dead (the others then exit).
    "XLM_MULTIHOST_HEARTBEAT_TIMEOUT_S": _get_float("XLM_MULTIHOST_HEARTBEAT_TIMEOUT_S", 10.0),
    # Multi-host: port of the leader's step channel (default: coordinator port + 1; the
    # heartbeat channel uses the next one).
    "XLM_MULTIHOST_PORT": lambda: _get_int("XLM_MULTIHOST_PORT"),
}


def _get_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"{name}={value!r} is not an integer") from e


def tpu_worker_id() -> int | None:
    """The worker index a TPU VM's runtime sets (TPU_WORKER_ID, or CLOUD_TPU_TASK_ID)."""
    for name in ("TPU_WORKER_ID", "CLOUD_TPU_TASK_ID"):
        value = _get_int(name)
        if value is not None:
            return value
    return None


# The coordinator's port where only its host is known (a TPU VM's worker list, a
# LeaderWorkerSet's leader address): JAX_COORDINATOR_PORT, else JAX's own default.
DEFAULT_COORDINATOR_PORT = 8476


# What pod_environment reads, platforms' names (not xlm's).
POD_VARIABLES = (
    "LWS_WORKER_INDEX",
    "LWS_GROUP_SIZE",
    "LWS_LEADER_ADDRESS",
    "TPU_WORKER_ID",
    "CLOUD_TPU_TASK_ID",
    "TPU_WORKER_HOSTNAMES",
    "JOB_COMPLETION_INDEX",
    "JAX_COORDINATOR_PORT",
)


@dataclass(frozen=True)
class PodEnvironment:
    """A multi-host process group as its platform describes it (None: not described)."""

    process_id: int | None = None
    num_processes: int | None = None
    coordinator_address: str | None = None
    source: str | None = None  # "lws", "tpu-vm" or "indexed-job"


def pod_environment() -> PodEnvironment:
    """This host's place in a pod from what a LeaderWorkerSet (LWS_WORKER_INDEX,
    LWS_GROUP_SIZE, LWS_LEADER_ADDRESS), a TPU VM (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES) or
    a Kubernetes Indexed Job (JOB_COMPLETION_INDEX) sets, first found wins. The
    coordinator is process 0's host at JAX_COORDINATOR_PORT (default 8476); an Indexed
    Job names neither the count nor the hosts (set XLM_NUM_PROCESSES and
    XLM_COORDINATOR_ADDRESS in its manifest)."""
    port = _get_int("JAX_COORDINATOR_PORT") or DEFAULT_COORDINATOR_PORT
    index = _get_int("LWS_WORKER_INDEX")
    if index is not None:
        leader = os.environ.get("LWS_LEADER_ADDRESS") or None
        return PodEnvironment(
            process_id=index,
            num_processes=_get_int("LWS_GROUP_SIZE"),
            coordinator_address=f"{leader}:{port}" if leader else None,
            source="lws",
        )
    worker = tpu_worker_id()
    if worker is not None:
        hosts = [h.strip() for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",")]
        hosts = [h for h in hosts if h]
        return PodEnvironment(
            process_id=worker,
            num_processes=len(hosts) or None,
            coordinator_address=f"{hosts[0]}:{port}" if hosts else None,
            source="tpu-vm",
        )
    index = _get_int("JOB_COMPLETION_INDEX")
    if index is not None:
        return PodEnvironment(process_id=index, source="indexed-job")
    return PodEnvironment()


def cxx_compiler() -> str | None:
    """The C++ compiler the environment names (CXX), or None to use the default."""
    return os.environ.get("CXX") or None


def xla_flags() -> str:
    """XLA's flags from the environment (XLA_FLAGS), "" when unset."""
    return os.environ.get("XLA_FLAGS", "")


def jax_platforms() -> str:
    """The platforms JAX is told to use (JAX_PLATFORMS), "" when unset."""
    return os.environ.get("JAX_PLATFORMS", "")


def hf_hub_offline() -> bool | None:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1/ON/YES/TRUE), None when unset."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return None
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def hf_hub_cache() -> str | None:
    """The hub cache directory HF_HUB_CACHE names, else HF_HOME/hub, else None."""
    cache = os.environ.get("HF_HUB_CACHE")
    if cache:
        return os.path.expanduser(cache)
    home = os.environ.get("HF_HOME")
    if home:
        return os.path.join(os.path.expanduser(home), "hub")
    return None


def quiet_transformers_advisories() -> None:
    """Turn transformers' advisory warnings off unless the user set them
    (TRANSFORMERS_NO_ADVISORY_WARNINGS): without PyTorch, transformers advises at import
    that "PyTorch was not found", a misleading line on every normal xlm run."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def set_variables(variables: dict[str, str]) -> None:
    """Set these variables in this process's environment (a data-parallel rank's device
    visibility, applied in its engine process before JAX starts)."""
    os.environ.update(variables)


def allow_deviceless_libtpu() -> None:
    """Let libtpu start without a TPU host (deviceless compiles need none) unless the user
    set these: no TPU accelerator type to look for (it warns otherwise), and several
    processes at once (libtpu's machine-wide lock is for processes that own chips)."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def gpu_memory_fraction() -> float:
    """The share of a GPU's memory JAX gives a process (XLA_PYTHON_CLIENT_MEM_FRACTION,
    JAX's default 0.75)."""
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


def cuda_visible_devices() -> list[str] | None:
    """The GPU ids CUDA_VISIBLE_DEVICES names, or None when it is unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [x.strip() for x in value.split(",") if x.strip()]


def _get_cache_root() -> str:
    return _VARIABLES["XLM_CACHE_ROOT"]()


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(_VARIABLES)


def is_set(name: str) -> bool:
    """Whether the environment sets this XLM_* variable."""
    if name not in _VARIABLES:
        raise ValueError(f"unknown xlm environment variable {name!r}; known: {sorted(_VARIABLES)}")
    return name in os.environ
