"""Compiling the CPU kernel library: one build used at install and at run time.

The package build (setup.py's build_ext) calls `build_library` to put a library beside the
sources, named by `library_key`; the runtime (xlm.ops.cpu_kernels) loads that library when
its key is the one it computes itself, else calls `build_library` into XLM_CACHE_ROOT.
The key covers what the library's binary depends on: the sources and headers, the flags,
the XLA FFI C API version of the headers it is compiled against (a jaxlib whose FFI API
differs from the build environment's gets a fresh build) and this CPU (the library is
built with -march=native).

Standard library only: setup.py loads this file by path, in a build environment that has
jax (for the FFI headers) but not xlm's other dependencies.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
# The C++ sources, one library holds them all; and the headers they include.
SOURCES = ("quant_matmul.cc", "float_matmul.cc", "paged_attention.cc")
HEADERS = ("column_split.h", "ffi_shapes.h", "row_groups.h")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17")
# The widest vector instructions the library may use, by XLM_CPU_KERNELS_ISA's value (the
# runtime passes it from xlm.envs; the package build uses "native"). "native": what this
# CPU has (AVX-512 where it has it); "avx2": AVX-512 off (the AVX2 loops, as on a CPU
# without it: how they are tested on one that has it, and a choice where AVX-512 clocks
# the cores down).
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",)}
# The installed library's name: PREBUILT_PREFIX + key (+ the interpreter's extension suffix).
PREBUILT_PREFIX = "prebuilt_"


class BuildError(Exception):
    """Why the library cannot be built."""


def flags(isa: str = "native") -> tuple[str, ...]:
    """The compiler flags: FLAGS and `isa`'s (ISA_FLAGS)."""
    if isa not in ISA_FLAGS:
        raise BuildError(f"XLM_CPU_KERNELS_ISA must be one of {sorted(ISA_FLAGS)}; got {isa!r}")
    return FLAGS + ISA_FLAGS[isa]


@functools.cache
def read_texts() -> tuple[dict[str, str], dict[str, str]]:
    """The sources' and headers' text, by file name (read once per process: the key, the
    targets' names and a build all use them)."""
    return (
        {name: (HERE / name).read_text() for name in SOURCES},
        {name: (HERE / name).read_text() for name in HEADERS},
    )


def ffi_api_version(include_dir: str | Path) -> str:
    """The XLA FFI C API's "major.minor" in the headers under `include_dir`."""
    text = (Path(include_dir) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    parts = [re.search(rf"#define XLA_FFI_API_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR")]
    if not all(parts):
        raise BuildError(f"no XLA_FFI_API_MAJOR/MINOR in {include_dir}'s c_api.h")
    return ".".join(m.group(1) for m in parts)


def cpu_fingerprint() -> str:
    """This CPU's vendor, model and feature flags (what -march=native builds for)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"
    wanted = ("vendor_id", "cpu family", "model", "model name", "flags", "Features", "CPU part")
    fields = []
    for line in first.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in wanted:
            fields.append(f"{name.strip()}={value.strip()}")
    return f"{platform.machine()}|" + "|".join(fields)


def library_key(include_dir: str | Path, isa: str = "native") -> str:
    """The key of a library built here from these sources against `include_dir`'s FFI,
    for `isa` (ISA_FLAGS)."""
    sources, headers = read_texts()
    texts = [sources[n] for n in sorted(sources)] + [headers[n] for n in sorted(headers)]
    parts = (*texts, flags(isa), ffi_api_version(include_dir), cpu_fingerprint())
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:24]


def find_compiler(name: str | None = None) -> tuple[str, str]:
    """The C++ compiler (`name`, else c++ or g++ on PATH) and its `--version` text."""
    name = name or shutil.which("c++") or shutil.which("g++")
    if not name:
        raise BuildError("no C++ compiler found (set CXX or install c++/g++)")
    try:
        proc = subprocess.run(
            [*shlex.split(name), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"C++ compiler {name!r} does not run: {e}") from e
    if proc.returncode != 0:
        raise BuildError(f"{name} --version exited with {proc.returncode}: {proc.stderr}")
    return name, proc.stdout


def build_library(
    output: str | Path, include_dir: str | Path, compiler: str, isa: str = "native"
) -> None:
    """Compile the sources against the FFI headers in `include_dir` into the shared
    library `output`: in a temporary directory beside it, the library moved into place
    only when every step succeeded."""
    output = Path(output)
    sources, headers = read_texts()
    with tempfile.TemporaryDirectory(prefix=".build-", dir=output.parent) as name:
        work = Path(name)
        for file, text in headers.items():  # found beside the sources that include them
            (work / file).write_text(text)
        argv = [*shlex.split(compiler), *flags(isa)]
        objects, compiles = [], []
        # One compiler per source, at once: each takes seconds, mostly in the FFI headers.
        for file, text in sources.items():
            (work / file).write_text(text)
            objects.append(str(work / f"{file}.o"))
            # -isystem: the FFI headers warn under -Wall; they are not ours to fix.
            cmd = [*argv, "-isystem", str(include_dir), "-c", str(work / file)]
            compiles.append(_start(cmd + ["-o", objects[-1]]))
        try:
            for cmd, proc in compiles:
                _finish(cmd, proc)
        finally:
            for _, proc in compiles:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        _finish(*_start([*argv, *objects, "-o", str(work / output.name)]))
        os.replace(work / output.name, output)


def _start(cmd: list[str]) -> tuple[list[str], subprocess.Popen]:
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise BuildError(f"{shlex.join(cmd)} did not run: {e}") from e
    return cmd, proc


def _finish(cmd: list[str], proc: subprocess.Popen) -> None:
    try:
        _, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired as e:
        proc.kill()
        proc.communicate()
        raise BuildError(f"{shlex.join(cmd)} timed out") from e
    if proc.returncode != 0:
        raise BuildError(f"{shlex.join(cmd)} failed:\n{stderr[-4000:]}")


def find_prebuilt(directory: str | Path, key: str) -> Path | None:
    """The library the package build left in `directory` under `key`, if there is one."""
    for path in sorted(Path(directory).glob(f"{PREBUILT_PREFIX}{key}*.so")):
        return path
    return None
