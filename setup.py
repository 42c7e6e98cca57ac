"""Build the CPU kernel library into the package at install, best effort.

Everything else is declared in pyproject.toml. The library (xlm.ops.cpu_kernels) is named
by its key (xlm/ops/cpu_kernels/build.py's library_key), which the runtime checks before
loading it; without jax in the build environment, a compiler, or on any build failure the
install goes on without it and the runtime builds the library on first use, as before.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
PACKAGE = "xlm.ops.cpu_kernels"


def _load_build():
    """xlm/ops/cpu_kernels/build.py, loaded by path (importing xlm needs its dependencies)."""
    path = HERE / "xlm" / "ops" / "cpu_kernels" / "build.py"
    spec = importlib.util.spec_from_file_location("_xlm_cpu_kernels_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _include_dir() -> str | None:
    try:
        import jax.ffi

        return jax.ffi.include_dir()
    except Exception:  # no jax here: the runtime builds the library
        return None


class BuildCpuKernels(build_ext):
    """Builds the kernel library with xlm's own compile command; failures are warnings."""

    def build_extension(self, ext: Extension) -> None:
        build = _load_build()
        output = Path(self.get_ext_fullpath(ext.name))
        output.parent.mkdir(parents=True, exist_ok=True)
        try:
            compiler, _ = build.find_compiler(os.environ.get("CXX") or None)
            build.build_library(output, ext.include_dirs[0], compiler)
        except (build.BuildError, OSError) as e:
            print(f"warning: xlm CPU kernels not built at install (built on first use): {e}")


def _extensions() -> list[Extension]:
    include_dir = _include_dir()
    if include_dir is None:
        return []
    build = _load_build()
    try:
        key = build.library_key(include_dir)
    except (build.BuildError, OSError) as e:
        print(f"warning: xlm CPU kernels not built at install (built on first use): {e}")
        return []
    # No sources: BuildCpuKernels compiles build.SOURCES itself; optional: never fatal.
    name = f"{PACKAGE}.{build.PREBUILT_PREFIX}{key}"
    return [Extension(name, sources=[], include_dirs=[include_dir], optional=True)]


if __name__ == "__main__":  # as the build backend runs it (the tests import the hook)
    setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildCpuKernels})
