"""Native CPU kernels called from jitted programs through XLA's FFI.

The C++ sources are compiled into one shared library by `build.build_library`, at one of
two times:
- at install: the package build (setup.py's build_ext, best effort) leaves
  `prebuilt_<key>*.so` beside the sources, named by `build.library_key` (the sources,
  headers and flags, the XLA FFI C API version of the jaxlib headers it was compiled
  against, this CPU since it is built with -march=native). The runtime computes the key
  with its own jaxlib and loads that library only when the keys match, with no compiler
  run (XLM_CPU_KERNELS_PREBUILT=0 ignores it);
- otherwise on first use, with the system compiler (CXX, else c++ or g++), into a cache
  entry under XLM_CACHE_ROOT keyed on the same key plus jax's version and the compiler's.

The library is loaded with ctypes and registered as an FFI target once per process.
Without a compiler, when the build fails, or with XLM_CPU_KERNELS=0, `available()` is
False, one line is logged and the ops fall back to their plain-jnp path.

`start_build()` begins that work in a background thread (the ops call it when they are
built, the loader when it starts), so the compiler runs while the weights load;
`available()` waits for it. Whether a program traced now calls the kernels is
`available()`: it blocks until the build has succeeded or failed, so its answer never
changes within a process.

A compiled program that contains the call needs the target registered before it is
loaded, including one from the persistent executable cache (which skips tracing): call
`available()` first (the loader does before it returns a model); otherwise deserializing
fails with "No FFI handler registered". The target's name carries a hash of the C++
source, so a program saved by another build fails to load (and is recompiled) rather than
calling this one.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention.kv_quant import row_head_dim
from xlm import disk_cache, envs
from xlm.logger import init_logger
from xlm.ops.cpu_kernels import build
from xlm.quantization import Q8_STRIP_COLS, Q8_STRIP_ROWS, from_q8_strips, q8_strips_fit

logger = init_logger(__name__)

# kernel -> (its C++ source, the handler symbol it defines); one library holds them all.
_KERNELS = {
    "int8": ("quant_matmul.cc", "XlmInt8Matmul"),
    "int4": ("quant_matmul.cc", "XlmInt4Matmul"),
    "q8": ("quant_matmul.cc", "XlmQ8Matmul"),
    "q8_linear": ("quant_matmul.cc", "XlmQ8Linear"),
    "float": ("float_matmul.cc", "XlmFloatMatmul"),
    "paged_attention": ("paged_attention.cc", "XlmPagedAttention"),
}
_LIBRARY = "xlm_cpu_kernels.so"
# Where the package build leaves its library (build.find_prebuilt).
PREBUILT_DIR = build.HERE

_lock = threading.Lock()
_start_lock = threading.Lock()
_available: bool | None = None
_builder: threading.Thread | None = None
_library: ctypes.CDLL | None = None  # kept referenced: XLA holds pointers into it
_targets: dict[str, str] = {}  # kernel -> its registered FFI target name


def available() -> bool:
    """Whether the kernels are built, loaded and registered (building them if needed)."""
    global _available
    if _available is None:
        with _lock:
            if _available is None:
                _available = _load()
    return _available


def vector_bits() -> int:
    """The widest vectors the loaded library's loops use: 512 (AVX-512: this CPU has it and
    XLM_CPU_KERNELS_ISA is native), 256 (AVX2), 0 (the portable loops only, or no kernels)."""
    if not available():
        return 0
    return int(_library.xlm_cpu_kernels_vector_bits())


def start_build() -> None:
    """Start building and registering the kernels in a background thread, unless done or
    under way; `available()` waits for it."""
    global _builder
    with _start_lock:
        if _available is None and _builder is None:
            _builder = threading.Thread(target=available, name="xlm-cpu-kernels", daemon=True)
            _builder.start()


def _load() -> bool:
    global _library, _targets
    if not envs.XLM_CPU_KERNELS:
        logger.info("XLM_CPU_KERNELS=0: CPU kernels are off; ops use their jnp path.")
        return False
    if envs.XLM_CPU_SPIN_US < 0:  # read by the library itself; checked here
        raise ValueError(f"XLM_CPU_SPIN_US must be >= 0 (0: off); got {envs.XLM_CPU_SPIN_US}")
    try:  # a bad value is the user's error, not a failed build to fall back from
        build.flags(envs.XLM_CPU_KERNELS_ISA)
    except build.BuildError as e:
        raise ValueError(str(e)) from e
    try:
        sources, headers = build.read_texts()
        path = _library_path()
        library = ctypes.CDLL(str(path))
        targets = {}
        for kind, (file, symbol) in _KERNELS.items():
            handler = getattr(library, symbol)
            # The name carries its source's hash: a saved program that calls an older
            # build (whose arguments may differ) fails to load and is recompiled.
            text = sources[file] + "".join(headers.values())
            digest = hashlib.sha256(text.encode()).hexdigest()[:12]
            targets[kind] = f"xlm_{kind}_{digest}"
            jax.ffi.register_ffi_target(targets[kind], jax.ffi.pycapsule(handler), platform="cpu")
    except (build.BuildError, OSError, AttributeError, RuntimeError, ValueError) as e:
        logger.warning("xlm CPU kernels are unavailable, ops use their jnp path: %s", e)
        return False
    _library, _targets = library, targets
    return True


def _library_path() -> Path:
    """The package build's library when its key is this runtime's, else one compiled into
    the cache if not there yet."""
    include_dir = jax.ffi.include_dir()
    key = build.library_key(include_dir, envs.XLM_CPU_KERNELS_ISA)
    if envs.XLM_CPU_KERNELS_PREBUILT:
        prebuilt = build.find_prebuilt(PREBUILT_DIR, key)
        if prebuilt is not None:
            logger.debug("Using the CPU kernels built at install: %s", prebuilt)
            return prebuilt
    compiler, version = build.find_compiler(envs.cxx_compiler())
    entry = f"xlm-{cache_key(key, compiler, version)}"
    directory = Path(envs.XLM_CACHE_ROOT) / "cpu_kernels" / entry
    if disk_cache.check_directory(directory):
        return directory / _LIBRARY
    disk_cache.make_private_dir(directory.parent)
    # A process building the same library (the API server's beside its engine's, replicas
    # starting together) is waited for rather than compiled beside.
    with open(directory.parent / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not disk_cache.check_directory(directory):
            logger.info("Compiling xlm CPU kernels into %s", directory)
            with disk_cache.atomic_directory(directory) as tmp:
                build.build_library(tmp / _LIBRARY, include_dir, compiler, envs.XLM_CPU_KERNELS_ISA)
    return directory / _LIBRARY


def cache_key(key: str, compiler: str, version: str) -> str:
    """The cache entry's key: the library's, jax's version and the compiler's."""
    return disk_cache.cache_key(key, jax.__version__, compiler, version, length=24)


def _check_workers(max_workers: int) -> None:
    if max_workers < 0:
        raise ValueError(f"max_workers must be >= 0 (0: all threads); got {max_workers}")


def _check_strips(w: jax.Array, scale: jax.Array) -> tuple[int, int, int]:
    """(k, n, G) of an int8 kernel and its scales in strips (xlm.quantization.
    q8_kernel_strips), checked."""
    s, b, c, r = w.shape
    k, n = b * r, s * c
    if (
        w.dtype != jnp.int8
        or (c, r) != (Q8_STRIP_COLS, Q8_STRIP_ROWS)
        or scale.ndim != 3
        or scale.shape[0] != s
        or scale.shape[2] != c
        or not q8_strips_fit(k, n, scale.shape[1])
    ):
        raise ValueError(
            f"w in strips must be int8 [n / {Q8_STRIP_COLS}, k / {Q8_STRIP_ROWS}, "
            f"{Q8_STRIP_COLS}, {Q8_STRIP_ROWS}] and scale [n / {Q8_STRIP_COLS}, G, "
            f"{Q8_STRIP_COLS}] with groups of a multiple of {Q8_STRIP_ROWS} rows; got "
            f"{w.dtype} {list(w.shape)} and {list(scale.shape)}"
        )
    return k, n, scale.shape[1]


def _check_int8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array) -> None:
    if w.ndim == 4:  # in strips
        k = _check_strips(w, scale)[0]
        if x.ndim < 1 or x.shape[-1] != k:
            raise ValueError(f"x must be [..., k] with k={k} (w in strips); got {x.shape}")
        return
    if w.ndim != 2 or w.dtype != jnp.int8:
        raise ValueError(
            f"w must be int8 [k, n] or in strips [n / 32, k / 4, 32, 4]; got {w.dtype} "
            f"{list(w.shape)}"
        )
    k, n = w.shape
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., k] with k={k} (w is {list(w.shape)}); got {x.shape}")
    if scale.ndim != 2 or scale.shape[1] != n or scale.shape[0] < 1 or k % scale.shape[0]:
        raise ValueError(
            f"scale must be [G, n] with n={n} and G dividing k={k}; got {list(scale.shape)}"
        )


def int8_matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """The plain-jnp weight-only int8 matmul: x @ w with w's groups of rows scaled."""
    _check_int8_matmul(x, w, scale)
    if w.ndim == 4:
        w, scale = from_q8_strips(w, scale)
    groups, n = scale.shape
    k = w.shape[0]
    wf = w.astype(jnp.float32)
    if groups == 1:
        y = (x.astype(jnp.float32) @ wf) * scale[0]
    else:
        xg = x.astype(jnp.float32).reshape(*x.shape[:-1], groups, k // groups)
        partial = jnp.einsum("...gi,gin->...gn", xg, wf.reshape(groups, k // groups, n))
        y = jnp.sum(partial * scale, axis=-2)
    return y.astype(x.dtype)


def int8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *, max_workers: int = 0) -> jax.Array:
    """y[..., j] = sum_g scale[g, j] * sum_{i in group g} x[..., i] * w[i, j].

    x float [..., k], w int8 [k, n], scale float [G, n] (groups of k // G rows; G == 1 is
    per output channel), or w and scale in strips (4-D and 3-D, xlm.quantization.
    q8_kernel_strips: each 32-column strip read as one sequential stream). Runs the native
    kernel inside jit on up to `max_workers` threads of XLA's intra-op pool (0: all); the
    jnp reference when the kernel is unavailable.
    """
    _check_int8_matmul(x, w, scale)
    _check_workers(max_workers)
    if not available():
        return int8_matmul_reference(x, w, scale)
    return _call("int8", x, x.shape[-1], (w, scale.astype(jnp.float32)), max_workers)


def _call(kind: str, x: jax.Array, k: int, weights: tuple, max_workers: int) -> jax.Array:
    w = weights[0]
    n = w.shape[0] * Q8_STRIP_COLS if w.ndim == 4 else w.shape[1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    call = jax.ffi.ffi_call(
        _targets[kind],
        jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
        vmap_method="sequential",
    )
    y = call(x2, *weights, max_workers=np.int64(max_workers))
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)


def _check_int4_matmul(
    x: jax.Array, w: jax.Array, scale: jax.Array, minimum: jax.Array | None
) -> None:
    if w.ndim != 2 or w.dtype != jnp.uint8:
        raise ValueError(f"w must be packed int4, uint8 [k / 2, n]; got {w.dtype} {list(w.shape)}")
    k, n = 2 * w.shape[0], w.shape[1]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., k] with k={k} (w is {list(w.shape)}); got {x.shape}")
    if scale.ndim != 2 or scale.shape[1] != n or scale.shape[0] < 1 or k % (2 * scale.shape[0]):
        raise ValueError(
            f"scale must be [G, n] with n={n} and G dividing k={k} into even groups; got "
            f"{list(scale.shape)}"
        )
    if minimum is not None and minimum.shape != scale.shape:
        raise ValueError(f"minimum must be shaped like scale {scale.shape}; got {minimum.shape}")


def int4_matmul_reference(
    x: jax.Array, w: jax.Array, scale: jax.Array, minimum: jax.Array | None = None
) -> jax.Array:
    """The plain-jnp packed int4 matmul: the codes unpacked, int8_matmul_reference, plus
    each group's input sum times its minimum."""
    _check_int4_matmul(x, w, scale, minimum)
    codes = jnp.stack([w & 15, w >> 4], axis=1).reshape(2 * w.shape[0], w.shape[1])
    y = int8_matmul_reference(x, codes.astype(jnp.int8), scale).astype(jnp.float32)
    if minimum is not None:
        xg = x.astype(jnp.float32).reshape(*x.shape[:-1], scale.shape[0], -1)
        y = y + xg.sum(-1) @ minimum.astype(jnp.float32)
    return y.astype(x.dtype)


def int4_matmul(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array,
    minimum: jax.Array | None = None,
    *,
    max_workers: int = 0,
) -> jax.Array:
    """y = x @ (codes * scale + minimum) per group, w the packed int4 codes, uint8
    [k / 2, n]: code [2i, j] in the low nibble of byte [i, j], [2i + 1, j] in the high one
    (in [0, 15]); scale and minimum [G, n] (None: zeros), groups of an even number of rows.
    Each byte is read once and unpacked in registers."""
    _check_int4_matmul(x, w, scale, minimum)
    _check_workers(max_workers)
    if not available():
        return int4_matmul_reference(x, w, scale, minimum)
    minimum = jnp.zeros(scale.shape, jnp.float32) if minimum is None else minimum
    weights = (w, scale.astype(jnp.float32), minimum.astype(jnp.float32))
    return _call("int4", x, 2 * w.shape[0], weights, max_workers)


def _check_q8_matmul(
    xq: jax.Array, xscale: jax.Array | None, w: jax.Array, scale: jax.Array
) -> int:
    """Checks a q8 problem (xscale None: float x, quantized by the kernel); its groups G."""
    _check_int8_matmul(xq, w, scale)
    groups = scale.shape[1 if w.ndim == 4 else 0]
    if xscale is None:
        if not jnp.issubdtype(xq.dtype, jnp.floating):
            raise ValueError(f"x must be float [..., k]; got {xq.dtype} {list(xq.shape)}")
    elif xq.dtype != jnp.int8 or xscale.shape != (*xq.shape[:-1], groups):
        raise ValueError(
            f"xq must be int8 [..., k] and xscale [..., G] with G={groups} (scale's); got "
            f"{xq.dtype} {list(xq.shape)} and {list(xscale.shape)}"
        )
    return groups


def quantize_activations(x: jax.Array, groups: int = 1) -> tuple[jax.Array, jax.Array]:
    """(int8 x [m, k], float32 scale [m, groups]) per token and each of `groups` equal runs
    of its inputs, symmetric (xlm.quantization's rule; `q8_linear`'s kernel does the same
    float32 steps itself)."""
    m, k = x.shape
    blocks = x.astype(jnp.float32).reshape(m, groups, k // groups)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(blocks / scale[:, :, None]), -127, 127).astype(jnp.int8)
    return q.reshape(m, k), scale


def q8_matmul_reference(
    xq: jax.Array, xscale: jax.Array, w: jax.Array, scale: jax.Array
) -> jax.Array:
    """The plain-jnp int8 x int8 matmul: each group's int32 sums times both its scales."""
    _check_q8_matmul(xq, xscale, w, scale)
    if w.ndim == 4:
        w, scale = from_q8_strips(w, scale)
    groups, n = scale.shape
    k = w.shape[0]
    xg = xq.reshape(*xq.shape[:-1], groups, k // groups)
    sums = jnp.einsum(
        "...gi,gin->...gn", xg, w.reshape(groups, k // groups, n), preferred_element_type=jnp.int32
    )
    return jnp.sum(sums.astype(jnp.float32) * xscale[..., None] * scale, axis=-2)


def q8_matmul(
    xq: jax.Array,
    xscale: jax.Array,
    w: jax.Array,
    scale: jax.Array,
    *,
    max_workers: int = 0,
    scalar: bool = False,
    bands: bool = True,
) -> jax.Array:
    """y[..., j] = sum_g xscale[..., g] * scale[g, j] * sum_{i in group g} xq[..., i] * w[i, j]
    in float32: int8 activations [..., k] with a scale per row and group (Q8_0's blocks),
    int8 w [k, n], scale [G, n]; each group's products summed exactly in int32 (AVX2
    maddubs/madd where the library was built with AVX2 and each group's rows are a multiple
    of 4; `scalar`: the portable loops, as without AVX2). At one row, over wide column
    chunks (a tied LM head), the AVX2 path reads w in bands of 4 rows swept across the
    columns instead of 16-column tiles (`bands=False`: the tiles, for tests and A/B; the
    results are the same). w and scale may be in strips (4-D and 3-D,
    xlm.quantization.q8_kernel_strips): each 32-column strip read as one stream, at every row
    count, with the same results as [k, n]. The jnp reference when the kernel is
    unavailable."""
    groups = _check_q8_matmul(xq, xscale, w, scale)
    _check_workers(max_workers)
    if not available():
        return q8_matmul_reference(xq, xscale, w, scale)
    lead, k = xq.shape[:-1], xq.shape[-1]
    xs = xscale.reshape(-1, groups).astype(jnp.float32)
    return _q8_call("q8", (xq.reshape(-1, k), xs), w, scale, max_workers, scalar, bands, lead)


def q8_linear(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array,
    *,
    max_workers: int = 0,
    scalar: bool = False,
    bands: bool = True,
) -> jax.Array:
    """`q8_matmul` of float activations x [..., k]: the kernel quantizes each row and group
    of the weight's G first (`quantize_activations`' rule, the same codes and scales bit for
    bit), so a w8a8 projection is one call in the program. The jnp reference (quantize,
    then `q8_matmul_reference`) when the kernel is unavailable."""
    groups = _check_q8_matmul(x, None, w, scale)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    _check_workers(max_workers)
    if not available():
        y = q8_matmul_reference(*quantize_activations(x2, groups), w, scale)
        return y.reshape(*lead, -1)
    return _q8_call("q8_linear", (x2,), w, scale, max_workers, scalar, bands, lead)


def _q8_call(
    kind: str,
    x_args: tuple[jax.Array, ...],
    w: jax.Array,
    scale: jax.Array,
    max_workers: int,
    scalar: bool,
    bands: bool,
    lead: tuple[int, ...],
) -> jax.Array:
    """The q8 FFI target `kind` on x's arguments ([rows, ...] each), w and scale."""
    n = w.shape[0] * Q8_STRIP_COLS if w.ndim == 4 else w.shape[1]
    call = jax.ffi.ffi_call(
        _targets[kind],
        jax.ShapeDtypeStruct((x_args[0].shape[0], n), jnp.float32),
        vmap_method="sequential",
    )
    y = call(
        *x_args,
        w,
        scale.astype(jnp.float32),
        max_workers=np.int64(max_workers),
        scalar=np.int64(scalar),
        bands=np.int64(bands),
    )
    return y.reshape(*lead, n)


# Weight element types the float kernel reads (widened to float32 in registers).
FLOAT_MATMUL_DTYPES = tuple(jnp.dtype(d) for d in ("float32", "float16", "bfloat16"))


def _check_float_matmul(x: jax.Array, w: jax.Array, transposed: bool) -> None:
    if w.ndim != 2 or jnp.dtype(w.dtype) not in FLOAT_MATMUL_DTYPES:
        raise ValueError(
            f"w must be 2-D of {[d.name for d in FLOAT_MATMUL_DTYPES]}; got {w.dtype} "
            f"{list(w.shape)}"
        )
    k = w.shape[1] if transposed else w.shape[0]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., k] with k={k} (w is {list(w.shape)}); got {x.shape}")


def float_matmul_reference(x: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
    """The plain-jnp float matmul: x @ w (w.T when `transposed`), w widened, in float32."""
    _check_float_matmul(x, w, transposed)
    spec = "...k,nk->...n" if transposed else "...k,kn->...n"
    return jnp.einsum(
        spec,
        x.astype(jnp.float32),
        w.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def float_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    transposed: bool = False,
    max_workers: int = 0,
    scalar: bool = False,
) -> jax.Array:
    """x [..., k] @ w [k, n] (`transposed`: w [n, k]) -> float32 [..., n], w float32,
    float16 or bfloat16 read once and widened in registers, sums in float32: the few-rows
    (decode) kernel. `scalar`: the portable loops, as without AVX2/FMA/F16C. The jnp
    reference when the kernel is unavailable."""
    _check_float_matmul(x, w, transposed)
    _check_workers(max_workers)
    if not available():
        return float_matmul_reference(x, w, transposed=transposed)
    k = x.shape[-1]
    n = w.shape[0] if transposed else w.shape[1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    call = jax.ffi.ffi_call(
        _targets["float"],
        jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
        vmap_method="sequential",
    )
    y = call(
        x2,
        w,
        max_workers=np.int64(max_workers),
        scalar=np.int64(scalar),
        transposed=np.int64(transposed),
    )
    return y.reshape(*x.shape[:-1], n)


# Cache element types the attention kernel reads.
PAGED_ATTENTION_CACHE_DTYPES = tuple(
    jnp.dtype(d) for d in ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8")
)


def paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_workers: int = 0,
) -> jax.Array:
    """Ragged paged attention (pallas_kernels.ragged_paged_attention's definition) in one
    native call: q float32 [T, Hq, D] over kv_cache [2, blocks, block_size, Hkv, row] ->
    [T, Hq, D]; rows past the real requests are zero. The cache is float32 (read in
    place), bfloat16 or float8 (row = D), or int8 rows with their scale (row = D + 4,
    pallas_kernels.ragged_paged_attention.kv_quant), widened as read. Needs
    `available()`."""
    if q.ndim != 3 or kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"q must be [T, Hq, D] and kv_cache [2, blocks, block_size, Hkv, D]; got "
            f"{list(q.shape)} and {list(kv_cache.shape)}"
        )
    if q.dtype != jnp.float32 or jnp.dtype(kv_cache.dtype) not in PAGED_ATTENTION_CACHE_DTYPES:
        raise ValueError(
            f"q must be float32 and kv_cache one of "
            f"{[d.name for d in PAGED_ATTENTION_CACHE_DTYPES]}; got {q.dtype} and "
            f"{kv_cache.dtype}"
        )
    if row_head_dim(kv_cache.shape[4], kv_cache.dtype) != q.shape[2] or (
        q.shape[1] % kv_cache.shape[3]
    ):
        raise ValueError(
            f"q {list(q.shape)} and kv_cache {list(kv_cache.shape)} disagree on head_dim, "
            "or the query heads are not a multiple of the KV heads"
        )
    if not available():
        raise RuntimeError("the xlm CPU kernels are unavailable (see the log for why)")
    call = jax.ffi.ffi_call(
        _targets["paged_attention"],
        jax.ShapeDtypeStruct(q.shape, jnp.float32),
        vmap_method="sequential",
    )
    return call(
        q,
        kv_cache,
        block_tables.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
        jnp.reshape(num_seqs, (1,)).astype(jnp.int32),
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
        max_workers=np.int64(max_workers),
    )
