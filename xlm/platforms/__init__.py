"""Platform detection: `current_platform`, resolved lazily on first access and cached.

Detectors are cheap: they look for installed PJRT plugin packages and device files and
never initialize a JAX backend.
"""

from __future__ import annotations

import glob
import importlib.util
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from xlm import envs, plugins
from xlm.logger import init_logger
from xlm.platforms.interface import Platform, PlatformEnum, UnspecifiedPlatform

if TYPE_CHECKING:
    current_platform: Platform

logger = init_logger(__name__)

__all__ = [
    "Platform",
    "PlatformEnum",
    "UnspecifiedPlatform",
    "current_platform",
    "resolve_current_platform_cls_qualname",
    "builtin_platform_plugins",
]


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _has_module_prefix(prefix: str) -> bool:
    return any(m.name.startswith(prefix) for m in pkgutil.iter_modules())


def _jax_may_start(backend: str) -> bool:
    """Whether JAX_PLATFORMS (when set) lets JAX start `backend`: an accelerator it leaves
    out is not this process's platform, so JAX_PLATFORMS=cpu on a GPU machine runs on the
    CPU (the first GPU run found "cuda" detected where JAX had only "cpu")."""
    allowed = {p.strip() for p in envs.jax_platforms().split(",") if p.strip()}
    if "gpu" in allowed:  # JAX's name for either GPU backend
        allowed |= {"cuda", "rocm"}
    return not allowed or backend in allowed


def _tpu_present() -> str | None:
    if not _jax_may_start("tpu"):
        return None
    if not (_has_module("libtpu") or _has_module_prefix("libtpu")):
        return None
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return "libtpu installed and TPU device files present"
    return None


def _cuda_present() -> str | None:
    if not _jax_may_start("cuda"):
        return None
    plugin = _has_module_prefix("jax_cuda") or _has_module("jax_plugins.xla_cuda12")
    if plugin and (glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/nvidiactl")):
        return "JAX CUDA plugin installed and NVIDIA device files present"
    return None


def _rocm_present() -> str | None:
    if not _jax_may_start("rocm"):
        return None
    if _has_module_prefix("jax_rocm") and glob.glob("/dev/kfd"):
        return "JAX ROCm plugin installed and /dev/kfd present"
    return None


BUILTIN_PLATFORMS = {
    "tpu": "xlm.platforms.tpu.TpuPlatform",
    "cuda": "xlm.platforms.cuda.CudaPlatform",
    "rocm": "xlm.platforms.rocm.RocmPlatform",
    "cpu": "xlm.platforms.cpu.CpuPlatform",
}


def tpu_platform_plugin() -> str | None:
    return BUILTIN_PLATFORMS["tpu"] if _tpu_present() else None


def cuda_platform_plugin() -> str | None:
    return BUILTIN_PLATFORMS["cuda"] if _cuda_present() else None


def rocm_platform_plugin() -> str | None:
    return BUILTIN_PLATFORMS["rocm"] if _rocm_present() else None


def cpu_platform_plugin() -> str | None:
    # CPU is the platform of a machine with jaxlib and no accelerator.
    if not _has_module("jaxlib"):
        return None
    if _tpu_present() or _cuda_present() or _rocm_present():
        return None
    return BUILTIN_PLATFORMS["cpu"]


builtin_platform_plugins: dict[str, Callable[[], str | None]] = {
    "tpu": tpu_platform_plugin,
    "cuda": cuda_platform_plugin,
    "rocm": rocm_platform_plugin,
    "cpu": cpu_platform_plugin,
}

_UNSPECIFIED = "xlm.platforms.interface.UnspecifiedPlatform"


def resolve_current_platform_cls_qualname() -> str:
    """Apply the resolution rules and return the chosen Platform class's qualified name."""
    forced = envs.XLM_TARGET_PLATFORM
    if forced is not None:
        if forced not in BUILTIN_PLATFORMS:
            raise ValueError(
                f"XLM_TARGET_PLATFORM={forced!r} is invalid: allowed {sorted(BUILTIN_PLATFORMS)}"
            )
        logger.info("Platform %s forced by XLM_TARGET_PLATFORM.", forced)
        return BUILTIN_PLATFORMS[forced]

    activated_oot: dict[str, str] = {}
    for name, detector in plugins.load_plugins_by_group(plugins.PLATFORM_PLUGINS_GROUP).items():
        try:
            qualname = detector()
        except Exception:
            logger.exception("Platform plugin %s failed while detecting; skipping it.", name)
            continue
        if qualname is not None:
            activated_oot[name] = qualname
    if len(activated_oot) > 1:
        raise RuntimeError(
            f"Only one out-of-tree platform plugin can be activated, but these are: "
            f"{sorted(activated_oot)}. Use XLM_PLUGINS to choose one."
        )
    if activated_oot:
        ((name, qualname),) = activated_oot.items()
        logger.info("Platform plugin %s (out-of-tree) is activated: %s.", name, qualname)
        return qualname

    activated = {
        name: q
        for name, detector in builtin_platform_plugins.items()
        if (q := detector()) is not None
    }
    if len(activated) > 1:
        raise RuntimeError(
            f"Only one built-in platform can be activated, but these are: {sorted(activated)}. "
            f"Set XLM_TARGET_PLATFORM to choose one."
        )
    if activated:
        ((name, qualname),) = activated.items()
        logger.info("Automatically detected platform %s.", name)
        return qualname
    logger.info("No platform detected; xlm is running on UnspecifiedPlatform.")
    return _UNSPECIFIED


def resolve_obj_by_qualname(qualname: str) -> Any:
    """Import `pkg.module.Name` (or `pkg.module:Name`) and return the object."""
    module_name, _, obj_name = qualname.replace(":", ".").rpartition(".")
    module = importlib.import_module(module_name)
    return getattr(module, obj_name)


_current_platform: Platform | None = None


def __getattr__(name: str) -> Any:
    global _current_platform
    if name == "current_platform":
        if _current_platform is None:
            qualname = resolve_current_platform_cls_qualname()
            platform = resolve_obj_by_qualname(qualname)()
            if envs.XLM_TARGET_PLATFORM is not None or _cpu_without_jax_platforms(qualname):
                # A forced platform must also be the one JAX runs on (else a CUDA machine
                # told to use the CPU would still put every array on the GPU). A detected
                # CPU means no accelerator is present: JAX would still start every
                # installed plugin's backend (libtpu logs errors on a host without a TPU).
                platform.pin_jax_backend()
            _current_platform = platform
        return _current_platform
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _cpu_without_jax_platforms(qualname: str) -> bool:
    """Whether the built-in CPU platform was detected and JAX_PLATFORMS chooses nothing."""
    if qualname != BUILTIN_PLATFORMS["cpu"]:
        return False
    import jax

    return not jax.config.jax_platforms


def swap_current_platform(platform: Platform | None) -> Platform | None:
    """Make `platform` the current one and return the one it replaces (a compile target's
    platform while a plan builds its programs: xlm.platforms.target.compiling_for)."""
    global _current_platform
    previous, _current_platform = _current_platform, platform
    return previous


def _reset_current_platform() -> None:
    """Forget the resolved platform (tests only)."""
    global _current_platform
    _current_platform = None
