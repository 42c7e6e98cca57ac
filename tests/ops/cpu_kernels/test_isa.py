"""XLM_CPU_KERNELS_ISA: the native build uses the widest vectors this CPU has, and the AVX2
loops (what a CPU without AVX-512 runs) still match the references on a CPU that has it."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from tests.ops.cpu_kernels import run_python
from xlm.ops import cpu_kernels
from xlm.ops.cpu_kernels import build


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def test_the_native_build_uses_the_widest_vectors_this_cpu_has() -> None:
    if not cpu_kernels.available():
        pytest.skip("the CPU kernels could not be built here")
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    want = 512 if "avx512f" in flags else 256 if {"avx2", "fma", "f16c"} <= flags else 0
    assert cpu_kernels.vector_bits() == want


AVX2_LOOPS = """
    import numpy as np
    from xlm.ops import cpu_kernels

    assert cpu_kernels.vector_bits() == 256, cpu_kernels.vector_bits()
    rng = np.random.default_rng(0)
    # Float weights: the streaming loops (1-8 rows) and the packed tiles (9, 23, 64: groups
    # of 5 + 4, 6 x 3 + 5, 6 x 10 + 4); int8 [k, n]: the decode tiles (1, 3) and the GEMM
    # (20).
    for m in (1, 3, 9, 23, 64):
        for dtype in ("float32", "float16", "bfloat16"):
            for transposed in (False, True):
                x = rng.standard_normal((m, 577)).astype(np.float32)
                w = rng.standard_normal((70, 577) if transposed else (577, 70))
                w = np.asarray(w, dtype=np.float32).astype(dtype)
                got = np.asarray(cpu_kernels.float_matmul(x, w, transposed=transposed))
                ref = cpu_kernels.float_matmul_reference(x, w, transposed=transposed)
                np.testing.assert_allclose(got, np.asarray(ref), rtol=1e-4, atol=1e-4)
    # int8 in strips (n 192): the half-strip passes (1, 3) and the GEMM's packing (20).
    from xlm.quantization import q8_kernel_strips, q8_scale_strips
    for m in (1, 3, 20):
        for n, strips in ((200, False), (192, True)):
            x = rng.standard_normal((m, 576)).astype(np.float32)
            w = rng.integers(-128, 128, (576, n), dtype=np.int8)
            scale = rng.uniform(0.001, 0.02, (18, n)).astype(np.float32)
            ref = np.asarray(cpu_kernels.int8_matmul_reference(x, w, scale))
            if strips:
                w, scale = q8_kernel_strips(w).copy(), q8_scale_strips(scale).copy()
            got = np.asarray(cpu_kernels.int8_matmul(x, w, scale))
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    print("ok")
"""


def test_the_avx2_loops_match_the_references_on_an_avx512_cpu(tmp_path) -> None:
    """On a CPU with AVX-512 the default build never runs the 8-lane loops the AVX-512
    ones replace; built with XLM_CPU_KERNELS_ISA=avx2 (its own cache entry) they must
    still give the references' results."""
    if "avx512f" not in cpu_flags() or not cpu_kernels.available():
        pytest.skip("no AVX-512 here: the default build is the AVX2 one, tested everywhere")
    proc = run_python(AVX2_LOOPS, tmp_path, XLM_CPU_KERNELS_ISA="avx2")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_an_unknown_isa_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(build.BuildError, match="XLM_CPU_KERNELS_ISA must be one of"):
        build.flags("avx9")
    assert build.library_key(jax.ffi.include_dir(), "avx2") != build.library_key(
        jax.ffi.include_dir()
    )
    code = "from xlm.ops import cpu_kernels; cpu_kernels.available()"
    proc = run_python(code, tmp_path, XLM_CPU_KERNELS_ISA="avx9")
    assert proc.returncode != 0
    assert "ValueError: XLM_CPU_KERNELS_ISA must be one of ['avx2', 'native']" in proc.stderr
