"""The native weight-only int8 and packed int4 matmuls (xlm.ops.cpu_kernels) against a
float64 reference."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.ops.cpu_kernels import run_python
from xlm.ops import cpu_kernels
from xlm.quantization import (
    from_q8_strips,
    q8_kernel_strips,
    q8_scale_strips,
    quantize_activations,
)

rng = np.random.default_rng(0)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if not cpu_kernels.available():
        pytest.skip("the CPU kernel could not be built here (no C++ compiler?)")


def reference(x: np.ndarray, w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    groups = scale.shape[0]
    k, n = w.shape
    xg = x.astype(np.float64).reshape(x.shape[0], groups, k // groups)
    wg = w.astype(np.float64).reshape(groups, k // groups, n)
    return np.einsum("mgi,gin,gn->mn", xg, wg, scale.astype(np.float64))


def assert_close(y: jax.Array, x: np.ndarray, w: np.ndarray, scale: np.ndarray) -> None:
    # float32 accumulation error scales with the sum of the terms' magnitudes.
    magnitude = reference(np.abs(x), np.abs(w.astype(np.int32)), np.abs(scale))
    err = np.abs(np.asarray(y, np.float64) - reference(x, w, scale))
    assert y.dtype == jnp.float32 and y.shape == (x.shape[0], w.shape[1])
    assert np.all(err <= 1e-6 * magnitude + 1e-30), float(np.max(err / (magnitude + 1e-30)))


def make(m: int, k: int, n: int, groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.integers(-128, 128, (k, n), dtype=np.int8)  # negatives and -128 included
    scale = rng.uniform(0.001, 0.02, (groups, n)).astype(np.float32)
    return x, w, scale


CASES = [
    (k, n, groups)
    for k, n in [(576, 1536), (100, 37), (1536, 576)]
    for groups in sorted({1, k // 32 if k % 32 == 0 else 1})
] + [(100, 37, 4), (48, 200, 48)]  # groups of 25 rows; groups of one row


@pytest.mark.parametrize("m", [1, 2, 5, 64, 130])
@pytest.mark.parametrize("k,n,groups", CASES)
def test_matches_reference_under_jit(m: int, k: int, n: int, groups: int) -> None:
    x, w, scale = make(m, k, n, groups)
    assert_close(jax.jit(cpu_kernels.int8_matmul)(x, w, scale), x, w, scale)


@pytest.mark.parametrize("max_workers", [1, 2])
@pytest.mark.parametrize(
    "m,k,n,groups",
    [(3, 576, 3072, 1), (20, 576, 1000, 18), (2, 1024, 4100, 32)],  # the last: page chunks
)
def test_thread_count_does_not_change_the_result(m, k, n, groups, max_workers: int) -> None:
    x, w, scale = make(m, k, n, groups)  # each large enough to be split across threads
    y = cpu_kernels.int8_matmul(x, w, scale, max_workers=max_workers)
    assert_close(y, x, w, scale)


def test_all_minus_128_weights_are_exact() -> None:
    k, n = 96, 40
    x = np.ones((2, k), np.float32)
    w = np.full((k, n), -128, np.int8)
    scale = np.full((3, n), 0.5, np.float32)
    y = np.asarray(cpu_kernels.int8_matmul(x, w, scale))
    np.testing.assert_array_equal(y, np.full((2, n), -128 * 0.5 * k, np.float32))


def test_leading_dims_and_dtype_follow_x() -> None:
    x, w, scale = make(6, 64, 24, 2)
    y = cpu_kernels.int8_matmul(jnp.asarray(x).reshape(2, 3, 64), w, scale)
    assert y.shape == (2, 3, 24)
    assert_close(y.reshape(6, 24), x, w, scale)


def test_matches_the_jnp_reference_path() -> None:
    x, w, scale = make(5, 576, 192, 18)
    expected = cpu_kernels.int8_matmul_reference(x, w, scale)
    np.testing.assert_allclose(
        np.asarray(cpu_kernels.int8_matmul(x, w, scale)), np.asarray(expected), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    "x_shape,w_shape,w_dtype,scale_shape,match",
    [
        ((2, 100), (99, 37), np.int8, (1, 37), "x must be"),
        ((2, 100), (100, 37), np.int8, (3, 37), "scale must be"),
        ((2, 100), (100, 37), np.int8, (1, 36), "scale must be"),
        ((2, 100), (100, 37), np.int16, (1, 37), "w must be int8"),
    ],
)
def test_bad_shapes_raise_before_tracing(x_shape, w_shape, w_dtype, scale_shape, match) -> None:
    x = np.zeros(x_shape, np.float32)
    with pytest.raises(ValueError, match=match):
        cpu_kernels.int8_matmul(x, np.zeros(w_shape, w_dtype), np.zeros(scale_shape, np.float32))


def test_handler_rejects_inconsistent_shapes() -> None:
    """The C++ handler checks shapes itself (a program may call the target directly)."""
    call = jax.ffi.ffi_call(
        cpu_kernels._targets["int8"], jax.ShapeDtypeStruct((2, 37), jnp.float32)
    )
    x = np.zeros((2, 100), np.float32)
    with pytest.raises(Exception, match=r"disagree on k.*w \[99, 37\]"):
        jax.block_until_ready(
            call(x, np.zeros((99, 37), np.int8), np.ones((1, 37), np.float32), max_workers=0)
        )
    with pytest.raises(Exception, match=r"G >= 1 dividing k.*scale \[3, 37\]"):
        jax.block_until_ready(
            call(x, np.zeros((100, 37), np.int8), np.ones((3, 37), np.float32), max_workers=0)
        )


def test_int4_handler_rejects_inconsistent_shapes() -> None:
    call = jax.ffi.ffi_call(
        cpu_kernels._targets["int4"], jax.ShapeDtypeStruct((2, 37), jnp.float32)
    )
    x = np.zeros((2, 100), np.float32)
    ones = np.ones((2, 37), np.float32)
    with pytest.raises(Exception, match=r"w \[k / 2, n\] disagree on k.*w \[100, 37\]"):
        jax.block_until_ready(call(x, np.zeros((100, 37), np.uint8), ones, ones, max_workers=0))
    with pytest.raises(Exception, match=r"even groups.*scale \[4, 37\]"):  # groups of 25
        four = np.ones((4, 37), np.float32)
        jax.block_until_ready(call(x, np.zeros((50, 37), np.uint8), four, four, max_workers=0))
    with pytest.raises(Exception, match=r"minimum must be shaped like scale"):
        jax.block_until_ready(call(x, np.zeros((50, 37), np.uint8), ones, ones[:1], max_workers=0))


FALLBACK = """
    import numpy as np
    from xlm.ops import cpu_kernels
    assert not cpu_kernels.available()
    x = np.ones((2, 64), np.float32)
    w = np.full((64, 8), -3, np.int8)
    y = cpu_kernels.int8_matmul(x, w, np.full((2, 8), 0.5, np.float32))
    np.testing.assert_allclose(np.asarray(y), np.full((2, 8), -96.0))
    import jax.numpy as jnp
    from xlm.ops import FloatMatmul
    op = FloatMatmul(enforce_enable=True)
    for rows in (1, 20):  # half weights: XLA's convert + dot
        y = op(jnp.ones((rows, 64)), jnp.full((64, 8), 0.5, jnp.bfloat16))
        np.testing.assert_allclose(np.asarray(y), np.full((rows, 8), 32.0))
    # w8a8 kernels stored in strips (the loader's CPU layout) run the native path.
    from xlm.ops.quant_matmul import QuantMatmul
    from xlm.quantization import q8_kernel_strips, q8_scale_strips
    w8 = (np.arange(64 * 32).reshape(64, 32) % 7 - 3).astype(np.int8)
    s8 = np.linspace(0.1, 0.5, 2 * 32, dtype=np.float32).reshape(2, 32)
    op = QuantMatmul("int8", enforce_enable=True)
    x = np.linspace(-1, 1, 3 * 64, dtype=np.float32).reshape(3, 64)
    want = np.asarray(op.forward_native(x, w8, s8))
    got = op(x, jnp.asarray(q8_kernel_strips(w8)), jnp.asarray(q8_scale_strips(s8)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    # q8_linear (float x, quantized by the kernel) is quantize + the jnp reference.
    ws8, ss8 = jnp.asarray(q8_kernel_strips(w8)), jnp.asarray(q8_scale_strips(s8))
    y = cpu_kernels.q8_linear(x, ws8, ss8)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    print("fallback ok")
"""


def test_missing_compiler_falls_back_with_one_warning(tmp_path) -> None:
    proc = run_python(FALLBACK, tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    assert proc.returncode == 0, proc.stderr
    assert "fallback ok" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "CPU kernels are unavailable" in line]
    assert len(warnings) == 1 and "no-such-compiler" in warnings[0], proc.stderr


def test_failing_build_falls_back(tmp_path) -> None:
    compiler = tmp_path / "broken-c++"
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && echo broken 1.0 && exit 0\nexit 1\n')
    compiler.chmod(0o755)
    proc = run_python(FALLBACK, tmp_path, CXX=str(compiler))
    assert proc.returncode == 0, proc.stderr
    assert "failed" in proc.stderr
    assert not list((tmp_path / "cache").rglob("*.so"))  # no partial entry left behind


def test_disabled_by_environment(tmp_path) -> None:
    proc = run_python(FALLBACK, tmp_path, XLM_CPU_KERNELS="0")
    assert proc.returncode == 0, proc.stderr
    assert "CPU kernels are unavailable" not in proc.stderr


PREBUILT = """
    import os, pathlib
    from xlm.ops import cpu_kernels
    cpu_kernels.PREBUILT_DIR = pathlib.Path(os.environ["PREBUILT"])
    print("available", cpu_kernels.available())
"""


def _prebuilt(tmp_path, key: str) -> Path:
    """This process's library copied into a package-like folder under `key`."""
    folder = tmp_path / "package"
    folder.mkdir()
    shutil.copy(cpu_kernels._library._name, folder / f"prebuilt_{key}.cpython-311-x.so")
    return folder


def test_a_prebuilt_library_with_this_runtimes_key_loads_without_a_compiler(tmp_path) -> None:
    key = cpu_kernels.build.library_key(jax.ffi.include_dir())
    folder = _prebuilt(tmp_path, key)
    env = dict(PREBUILT=str(folder), XLM_CPU_KERNELS_PREBUILT="1", XLM_LOGGING_LEVEL="INFO")
    proc = run_python(PREBUILT, tmp_path, CXX=str(tmp_path / "no-such-compiler"), **env)
    assert proc.returncode == 0, proc.stderr
    assert "available True" in proc.stdout, proc.stderr
    assert "Compiling" not in proc.stderr
    assert not (tmp_path / "cache").exists()  # nothing built into the cache


def test_a_prebuilt_library_with_another_key_is_ignored(tmp_path) -> None:
    folder = _prebuilt(tmp_path, "0" * 24)
    env = dict(PREBUILT=str(folder), XLM_CPU_KERNELS_PREBUILT="1")
    proc = run_python(PREBUILT, tmp_path, CXX=str(tmp_path / "no-such-compiler"), **env)
    assert proc.returncode == 0, proc.stderr
    # It went on to build (and had no compiler) rather than load the other key's library.
    assert "available False" in proc.stdout
    assert "no-such-compiler" in proc.stderr


FIRST = """
    import os, pathlib
    from xlm.ops import cpu_kernels
    cpu_kernels.start_build()
    cpu_kernels.start_build()  # already under way: no second build
    print("started", flush=True)  # the compiler waits for the test's gate meanwhile
    assert cpu_kernels.available()
    print("built", len(list(pathlib.Path(os.environ["XLM_CACHE_ROOT"]).rglob("*.so"))))
"""


def _gated_compiler(tmp_path) -> tuple[Path, Path, Path]:
    """A compiler that marks each compile in marks/ and waits for `gate` before it runs."""
    gate, marks, compiler = tmp_path / "gate", tmp_path / "marks", tmp_path / "gated-c++"
    marks.mkdir()
    real = shutil.which("c++") or shutil.which("g++")
    compiler.write_text(
        f'#!/bin/sh\n[ "$1" = --version ] && exec {real} --version\ntouch {marks}/$$\n'
        f'while [ ! -e {gate} ]; do sleep 0.05; done\nexec {real} "$@"\n'
    )
    compiler.chmod(0o755)
    return compiler, gate, marks


SECOND = """
    from xlm.ops import cpu_kernels
    print("start", flush=True)
    assert cpu_kernels.available()
"""


def test_background_build_and_a_concurrent_process_build_the_library_once(tmp_path) -> None:
    """start_build() returns while the compiler runs (twice: one build) and available()
    waits for the library; a second process started meanwhile waits for the first one's
    build instead of compiling beside it. One build serves both checks."""
    compiler, gate, marks = _gated_compiler(tmp_path)
    env = {
        **os.environ,
        "XLM_CACHE_ROOT": str(tmp_path / "cache"),
        "CXX": str(compiler),
        "XLM_LOGGING_LEVEL": "INFO",
        "XLM_CPU_KERNELS_PREBUILT": "0",
    }
    kw = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sources = len({file for file, _ in cpu_kernels._KERNELS.values()})
    first = subprocess.Popen([sys.executable, "-c", textwrap.dedent(FIRST)], **kw)
    procs = [first]
    # Should start_build() wait for the compiler, the gate opens late and the check fails.
    late_gate = threading.Timer(600, gate.touch)
    late_gate.start()
    try:
        for _ in range(6000):  # until the first one compiles (and holds the build)
            if len(list(marks.iterdir())) >= sources or first.poll() is not None:
                break
            time.sleep(0.05)
        assert first.stdout.readline() == "started\n"
        assert not gate.exists(), "start_build() waited for the compiler"
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(SECOND)], **kw))
        second = procs[1]
        assert second.stdout.readline() == "start\n"
        for _ in range(100):  # give the second one time to start a compile of its own
            if len(list(marks.iterdir())) > sources:
                break
            time.sleep(0.05)
        gate.touch()
        outs = [p.communicate(timeout=600) for p in procs]  # a C++ -O3 build, on a busy machine
    finally:
        late_gate.cancel()
        gate.touch()
        for p in procs:
            p.kill()
    logs = [err for _, err in outs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "built 1" in outs[0][0], outs[0]
    assert sum(log.count("Compiling xlm CPU kernels") for log in logs) == 1, logs
    assert len(list(marks.iterdir())) == sources + 1  # each source and the link, once


SAVED_PROGRAM = """
    import pickle, sys
    import numpy as np
    import jax
    from jax.experimental.serialize_executable import deserialize_and_load, serialize
    from xlm.ops import cpu_kernels
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 100)).astype(np.float32)
    w = rng.integers(-128, 128, (100, 37)).astype(np.int8)
    s = rng.uniform(0.01, 0.1, (4, 37)).astype(np.float32)
    path = sys.argv[1]
    if sys.argv[2] == "save":
        compiled = jax.jit(cpu_kernels.int8_matmul).lower(x, w, s).compile()
        with open(path, "wb") as f:
            pickle.dump((serialize(compiled), np.asarray(compiled(x, w, s))), f)
    else:
        with open(path, "rb") as f:
            (payload, in_tree, out_tree), expected = pickle.load(f)
        assert cpu_kernels.available()  # registers the target, before loading
        y = deserialize_and_load(payload, in_tree, out_tree)(x, w, s)
        np.testing.assert_array_equal(np.asarray(y), expected)
        print("loaded ok")
"""


def test_saved_program_runs_in_a_fresh_process(tmp_path) -> None:
    """A program from the persistent executable cache needs only `available()` first."""
    saved = str(tmp_path / "program.pkl")
    for mode in ("save", "load"):
        # The session's cache root, where this process built the library already.
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(SAVED_PROGRAM), saved, mode],
            env={**os.environ, "XLM_LOGGING_LEVEL": "INFO"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert "Compiling xlm CPU kernels" not in proc.stderr  # the cached build is reused
    assert "loaded ok" in proc.stdout


def make_int4(m: int, k: int, n: int, groups: int) -> tuple:
    x = rng.standard_normal((m, k)).astype(np.float32)
    packed = rng.integers(0, 256, (k // 2, n), dtype=np.uint8)  # every nibble value
    scale = rng.uniform(0.001, 0.02, (groups, n)).astype(np.float32)
    minimum = rng.uniform(-0.1, 0.0, (groups, n)).astype(np.float32)
    return x, packed, scale, minimum


def int4_reference(x, packed, scale, minimum) -> np.ndarray:
    codes = np.stack([packed & 15, packed >> 4], axis=1).reshape(-1, packed.shape[1])
    groups = scale.shape[0]
    xg = x.astype(np.float64).reshape(x.shape[0], groups, -1)
    return reference(x, codes, scale) + xg.sum(-1) @ minimum.astype(np.float64)


# Odd widths (37 columns: a partial vector; 50-row groups), per channel, the GEMM path's
# k blocks (1536 rows) and rows of 4 to 6 (the decode and GEMM register tiles' tails).
INT4_CASES = [(100, 37, 1), (100, 37, 2), (96, 200, 3), (1536, 72, 12)]


@pytest.mark.parametrize("m", [1, 3, 6, 21])
@pytest.mark.parametrize("k,n,groups", INT4_CASES)
def test_int4_matches_reference_under_jit(m: int, k: int, n: int, groups: int) -> None:
    x, packed, scale, minimum = make_int4(m, k, n, groups)
    y = np.asarray(jax.jit(cpu_kernels.int4_matmul)(x, packed, scale, minimum), np.float64)
    want = int4_reference(x, packed, scale, minimum)
    magnitude = int4_reference(np.abs(x), packed, scale, np.abs(minimum))
    assert y.shape == (m, n)
    assert np.all(np.abs(y - want) <= 1e-6 * magnitude + 1e-30)


@pytest.mark.parametrize("max_workers", [1, 2])
def test_int4_thread_count_does_not_change_the_result(max_workers: int) -> None:
    x, packed, scale, minimum = make_int4(3, 576, 3072, 9)  # split across threads
    y = np.asarray(cpu_kernels.int4_matmul(x, packed, scale, minimum, max_workers=max_workers))
    want = int4_reference(x, packed, scale, minimum)
    magnitude = int4_reference(np.abs(x), packed, scale, np.abs(minimum))
    assert np.all(np.abs(y - want) <= 1e-6 * magnitude + 1e-30)


def test_int4_rejects_odd_groups() -> None:
    x, packed, scale, minimum = make_int4(1, 96, 8, 1)
    with pytest.raises(ValueError, match="even groups"):
        cpu_kernels.int4_matmul(x, packed, scale[:1].repeat(32, 0), minimum[:1].repeat(32, 0))


# int8 x int8 (w8a8): x's codes with a scale per row and group of w.
def q8_reference(xq, xscale, w, scale) -> np.ndarray:
    groups = scale.shape[0]
    k, n = w.shape
    xg = xq.astype(np.int64).reshape(xq.shape[0], groups, k // groups)
    sums = np.einsum("mgi,gin->mgn", xg, w.astype(np.int64).reshape(groups, k // groups, n))
    return np.einsum("mgn,mg,gn->mn", sums.astype(np.float64), xscale, scale.astype(np.float64))


def make_q8(m: int, k: int, n: int, groups: int) -> tuple[np.ndarray, ...]:
    xq = rng.integers(-127, 128, (m, k), dtype=np.int8)
    xscale = rng.uniform(0.001, 0.02, (m, groups)).astype(np.float32)
    _, w, scale = make(m, k, n, groups)  # w's -128 included
    return xq, xscale, w, scale


# Groups of 32 (w8a8 from float weights) and per channel (per-token checkpoints), column
# tails (n % 16), groups of 25 rows (not a multiple of 4: the portable loops), page chunks.
Q8_CASES = [
    (1, 576, 1536, 18),
    (3, 576, 1536, 1),
    (4, 64, 50, 2),
    (5, 100, 37, 4),
    (16, 96, 200, 3),
    (2, 1024, 4100, 32),
]


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("m,k,n,groups", Q8_CASES)
def test_q8_matches_reference_under_jit(m, k, n, groups, scalar) -> None:
    xq, xscale, w, scale = make_q8(m, k, n, groups)
    want = q8_reference(xq, xscale, w, scale)
    kernel = jax.jit(lambda *a: cpu_kernels.q8_matmul(*a, scalar=scalar))
    got = np.asarray(kernel(xq, xscale, w, scale), np.float64)
    # Each group's sum is exact (int32): only the float32 scaling and group sums round.
    magnitude = q8_reference(np.abs(xq), xscale, np.abs(w.astype(np.int32)), scale)
    assert np.all(np.abs(got - want) <= 1e-6 * magnitude + 1e-30)
    jnp_ref = np.asarray(cpu_kernels.q8_matmul_reference(xq, xscale, w, scale), np.float64)
    assert np.all(np.abs(jnp_ref - want) <= 1e-6 * magnitude + 1e-30)


@pytest.mark.parametrize("max_workers", [1, 2])
def test_q8_avx2_and_portable_paths_agree_exactly(max_workers: int) -> None:
    """The AVX2 path's int32 sums and float steps are the portable loops' own."""
    xq, xscale, w, scale = make_q8(3, 576, 1600, 18)

    def run(scalar: bool) -> np.ndarray:
        return np.asarray(
            cpu_kernels.q8_matmul(xq, xscale, w, scale, scalar=scalar, max_workers=max_workers)
        )

    np.testing.assert_array_equal(run(False), run(True))


@pytest.mark.parametrize("max_workers", [1, 2])
@pytest.mark.parametrize("k,n,groups", [(576, 4100, 18), (96, 2080, 1), (64, 16416, 2)])
def test_q8_one_row_bands_equal_the_tiles(max_workers: int, k: int, n: int, groups: int) -> None:
    """One row over wide chunks (a tied LM head) reads w in bands of 4 rows: the same int32
    sums and float steps as the tiles, column tails included."""
    xq, xscale, w, scale = make_q8(1, k, n, groups)

    def run(bands: bool) -> np.ndarray:
        return np.asarray(
            cpu_kernels.q8_matmul(xq, xscale, w, scale, bands=bands, max_workers=max_workers)
        )

    got = run(True)
    np.testing.assert_array_equal(got, run(False))
    want = q8_reference(xq, xscale, w, scale)
    magnitude = q8_reference(np.abs(xq), xscale, np.abs(w.astype(np.int32)), scale)
    assert np.all(np.abs(got - want) <= 1e-6 * magnitude + 1e-30)


def test_q8_rejects_scales_that_do_not_match() -> None:
    xq, xscale, w, scale = make_q8(2, 64, 16, 2)
    with pytest.raises(ValueError, match=r"xscale \[\.\.\., G\] with G=2"):
        cpu_kernels.q8_matmul(xq, xscale[:, :1], w, scale)
    with pytest.raises(ValueError, match="xq must be int8"):
        cpu_kernels.q8_matmul(xq.astype(np.float32), xscale, w, scale)


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize(
    "m,k,n,groups",
    # Blocks of 32 (whole vectors), per token, 25 and 8 rows (tails), 3 groups of 32.
    [(1, 576, 960, 18), (3, 576, 1536, 1), (4, 100, 40, 4), (2, 64, 64, 8), (5, 96, 64, 3)],
)
def test_q8_linear_quantizes_as_the_definition(m, k, n, groups, scalar) -> None:
    """q8_linear quantizes float x inside the kernel with xlm.quantization's rule bit for
    bit (an all-zero block keeps scale 1, exact halves round to even, +-127 clips), so it
    equals q8_matmul of the numpy codes exactly, in [k, n] and in strips."""
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    x[0, : k // groups] = 0.0  # an all-zero block
    gs = k // groups
    x[-1, :gs] = np.float32(0.01)
    x[-1, 0] = np.float32(1.27)  # scale 0.01: codes 1 and 127, ...
    x[-1, 1:5] = np.float32([0.005, 0.015, -0.025, 0.035])  # ... and halves (to even)
    xq, xs = quantize_activations(x, groups)
    _, w, scale = make(m, k, n, groups)
    want = np.asarray(cpu_kernels.q8_matmul(xq, xs, w, scale, scalar=scalar))
    kernel = jax.jit(lambda *a: cpu_kernels.q8_linear(*a, scalar=scalar))
    np.testing.assert_array_equal(np.asarray(kernel(x, w, scale)), want)
    if gs % 4 == 0 and n % 32 == 0:
        got = cpu_kernels.q8_linear(x.reshape(1, m, k), *strips_of(w, scale), scalar=scalar)
        np.testing.assert_array_equal(np.asarray(got)[0], want)
    # The jnp reference (the kernel-less path): same codes; XLA may round amax / 127 to
    # within an ulp of the division.
    ref = np.asarray(
        cpu_kernels.q8_matmul_reference(*cpu_kernels.quantize_activations(x, groups), w, scale)
    )
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_q8_linear_rejects_what_it_cannot_run() -> None:
    _, w, scale = make(1, 64, 16, 2)
    with pytest.raises(ValueError, match="x must be float"):
        cpu_kernels.q8_linear(np.zeros((1, 64), np.int8), w, scale)
    with pytest.raises(ValueError, match="x must be"):
        cpu_kernels.q8_linear(np.zeros((1, 60), np.float32), w, scale)
    call = jax.ffi.ffi_call(
        cpu_kernels._targets["q8_linear"], jax.ShapeDtypeStruct((1, 16), jnp.float32)
    )
    attrs = dict(max_workers=np.int64(0), scalar=np.int64(0), bands=np.int64(1))
    with pytest.raises(Exception, match=r"xlm_q8_linear: want x \[m, k\]"):
        call(np.zeros((1, 60), np.float32), w, scale, **attrs).block_until_ready()


def _spin_case() -> tuple[np.ndarray, ...]:
    """One row through a projection big enough to split over two threads."""
    case = np.random.default_rng(5)
    x = case.standard_normal((1, 576)).astype(np.float32)
    w = case.integers(-128, 128, (576, 960), dtype=np.int8)
    scale = case.uniform(0.001, 0.02, (18, 960)).astype(np.float32)
    return x, q8_kernel_strips(w), q8_scale_strips(scale)


SPIN_OFF = """
    import sys
    import numpy as np
    from xlm.ops import cpu_kernels
    sys.path.insert(0, {tests!r})
    from test_cpu_quant_kernel import _spin_case
    assert cpu_kernels.available()
    np.save({out!r}, np.asarray(cpu_kernels.q8_linear(*_spin_case(), max_workers=2)))
"""


def test_spinning_helpers_change_no_result(tmp_path) -> None:
    """Small calls split over the kernels' own spinning helpers (column_split.h), others
    and XLM_CPU_SPIN_US=0 over XLA's pool: the same chunks, the same results bit for bit,
    also with calls from several threads at once (one holds the helpers, the others take
    the pool)."""
    x, ws, ss = _spin_case()
    kernel = jax.jit(lambda a: cpu_kernels.q8_linear(a, ws, ss, max_workers=2))
    want = np.asarray(kernel(x))
    code = SPIN_OFF.format(tests=str(Path(__file__).parent), out=str(tmp_path / "y.npy"))
    from xlm import envs

    proc = run_python(code, tmp_path, XLM_CPU_SPIN_US="0", XLM_CACHE_ROOT=str(envs.XLM_CACHE_ROOT))
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), want)
    inputs = [x * (1 + t) for t in range(4)]
    expected = [np.asarray(kernel(a)) for a in inputs]
    errors: list[str] = []

    def calls(t: int) -> None:
        for _ in range(25):
            got = np.asarray(kernel(inputs[t]))
            if not np.array_equal(got, expected[t]):
                errors.append(f"thread {t}")

    threads = [threading.Thread(target=calls, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


# Weights in strips (xlm.quantization.q8_kernel_strips: the loader's w8a8 layout on CPU).
def strips_of(w: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.ascontiguousarray(q8_kernel_strips(w)),
        np.ascontiguousarray(q8_scale_strips(scale)),
    )


@pytest.mark.parametrize("max_workers", [1, 2])
@pytest.mark.parametrize(
    "m,k,n,groups",
    [(1, 576, 960, 18), (1, 96, 4128, 1), (2, 64, 96, 2), (5, 128, 64, 4), (16, 1536, 576, 48)]
    + [(40, 64, 160, 2), (3, 100, 32, 25)],
)
def test_q8_strips_equal_the_tiles(m, k, n, groups, max_workers) -> None:
    """Strips give [k, n]'s tiles' results bit for bit at every row count (one row: the
    32-column register path; more: the tiles over half strips), and the portable loops
    read strips too. Groups of 25 rows (not whole 4-row blocks) cannot be stored so."""
    xq, xscale, w, scale = make_q8(m, k, n, groups)
    if (k // groups) % 4:
        with pytest.raises(ValueError, match="groups of a multiple of 4 rows"):
            cpu_kernels.q8_matmul(xq, xscale, *strips_of(w, scale))
        return
    ws, ss = strips_of(w, scale)
    tiles = np.asarray(cpu_kernels.q8_matmul(xq, xscale, w, scale, bands=False))
    kernel = jax.jit(lambda *a: cpu_kernels.q8_matmul(*a, max_workers=max_workers))
    got = np.asarray(kernel(xq, xscale, ws, ss))
    np.testing.assert_array_equal(got, tiles)
    scalar = cpu_kernels.q8_matmul(xq, xscale, ws, ss, scalar=True, max_workers=max_workers)
    np.testing.assert_array_equal(np.asarray(scalar), tiles)
    want = q8_reference(xq, xscale, w, scale)
    magnitude = q8_reference(np.abs(xq), xscale, np.abs(w.astype(np.int32)), scale)
    assert np.all(np.abs(got - want) <= 1e-6 * magnitude + 1e-30)
    jnp_ref = np.asarray(cpu_kernels.q8_matmul_reference(xq, xscale, ws, ss), np.float64)
    assert np.all(np.abs(jnp_ref - want) <= 1e-6 * magnitude + 1e-30)


def test_q8_strips_layout_round_trips() -> None:
    """Element [s, b, c, r] of the strips is w[4b + r, 32s + c]; scale [s, g, c] is
    scale[g, 32s + c]; from_q8_strips gives both back."""
    _, w, scale = make(1, 8, 64, 2)
    ws, ss = strips_of(w, scale)
    assert ws.shape == (2, 2, 32, 4) and ss.shape == (2, 2, 32)
    for s, b, c, r in [(0, 0, 0, 0), (1, 1, 3, 2), (1, 0, 31, 3), (0, 1, 17, 1)]:
        assert ws[s, b, c, r] == w[4 * b + r, 32 * s + c]
    assert ss[1, 1, 5] == scale[1, 37]
    back_w, back_s = from_q8_strips(ws, ss)
    np.testing.assert_array_equal(back_w, w)
    np.testing.assert_array_equal(back_s, scale)


def test_q8_handler_rejects_inconsistent_strips() -> None:
    """The C++ handler checks strips' shapes itself (a program may call the target)."""
    call = jax.ffi.ffi_call(cpu_kernels._targets["q8"], jax.ShapeDtypeStruct((1, 64), jnp.float32))
    xq, xs = np.zeros((1, 64), np.int8), np.ones((1, 2), np.float32)
    attrs = dict(max_workers=np.int64(0), scalar=np.int64(0), bands=np.int64(1))
    good_w, good_s = np.zeros((2, 16, 32, 4), np.int8), np.ones((2, 2, 32), np.float32)
    for w, s in [(good_w[:, :15], good_s), (good_w, good_s[:1]), (good_w, good_s[:, :, :16])]:
        with pytest.raises(Exception, match=r"in strips w \[n / 32, k / 4, 32, 4\]"):
            jax.block_until_ready(call(xq, xs, w, s, **attrs))
    jax.block_until_ready(call(xq, xs, good_w, good_s, **attrs))


@pytest.mark.parametrize("max_workers", [1, 2])
@pytest.mark.parametrize(
    "m,k,n,groups",
    [(1, 576, 960, 1), (1, 1536, 576, 1), (1, 576, 960, 18), (2, 64, 96, 16), (3, 128, 64, 2)]
    + [(4, 576, 192, 1), (5, 96, 4128, 3), (15, 64, 96, 2), (16, 576, 192, 1), (70, 256, 160, 8)],
)
def test_int8_strips_match_the_reference(m, k, n, groups, max_workers) -> None:
    """Weight-only int8 (float x) on weights in strips: the strip passes below 16 rows
    (AVX-512: up to 3 rows of x a pass; AVX2: half strips, one row), the GEMM's packing from
    strips at 16 and more; within float32 rounding of the float64 definition, as [k, n]."""
    x, w, scale = make(m, k, n, groups)
    ws, ss = strips_of(w, scale)
    kernel = jax.jit(lambda *a: cpu_kernels.int8_matmul(*a, max_workers=max_workers))
    assert_close(kernel(x, ws, ss), x, w, scale)
    jnp_ref = cpu_kernels.int8_matmul_reference(x, ws, ss)
    assert_close(jnp_ref, x, w, scale)


def test_int8_handler_rejects_inconsistent_strips() -> None:
    call = jax.ffi.ffi_call(
        cpu_kernels._targets["int8"], jax.ShapeDtypeStruct((1, 64), jnp.float32)
    )
    x = np.zeros((1, 64), np.float32)
    good_w, good_s = np.zeros((2, 16, 32, 4), np.int8), np.ones((2, 2, 32), np.float32)
    for w, s in [(good_w[:, :15], good_s), (good_w, good_s[:1]), (good_w, good_s[:, :, :16])]:
        with pytest.raises(Exception, match=r"in strips w \[n / 32, k / 4, 32, 4\]"):
            jax.block_until_ready(call(x, w, s, max_workers=np.int64(0)))
    jax.block_until_ready(call(x, good_w, good_s, max_workers=np.int64(0)))
    _, w, scale = make(1, 100, 32, 4)  # groups of 25 rows: not whole 4-row blocks
    with pytest.raises(ValueError, match="groups of a multiple of 4 rows"):
        cpu_kernels.int8_matmul(np.zeros((1, 100), np.float32), *strips_of(w, scale))
