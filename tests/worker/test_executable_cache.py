"""The compiled-program cache: typed keys, versioned 0700 files, damaged files recompiled."""

import os
import stat

import jax
import jax.numpy as jnp
import numpy as np

from xlm import disk_cache
from xlm.worker.compilation import MeshSpec, ProgramKey, ProgramKind
from xlm.worker.executable_cache import ExecutableCache


def _program():
    fn = jax.jit(lambda x: (x * 2 + 1,))
    args = (jax.ShapeDtypeStruct((8,), jnp.float32),)
    in_tree = jax.tree_util.tree_structure((args, {}))
    out_tree = jax.tree_util.tree_structure((0,))
    return fn.lower(*args).compile(), in_tree, out_tree


def test_store_load_and_rebuild_damaged(tmp_path):
    directory = tmp_path / "programs"
    cache = ExecutableCache(str(directory), "engine-a")
    compiled, in_tree, out_tree = _program()
    key = ProgramKey(ProgramKind.MODEL, 8)
    assert cache.load(key, in_tree, out_tree) is None
    cache.store(key, compiled)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    path = cache.path(key)
    assert os.path.basename(path).startswith(f"{cache.version}-model-")
    assert os.listdir(directory) == [os.path.basename(path)]  # no temporary files
    x = np.arange(8, dtype=np.float32)
    (out,) = cache.load(key, in_tree, out_tree)(x)
    np.testing.assert_array_equal(np.asarray(out), x * 2 + 1)
    # Another key, mesh or engine: another file.
    assert cache.path(ProgramKey(ProgramKind.MODEL, 16)) != path
    assert cache.path(ProgramKey(ProgramKind.MODEL, 8, MeshSpec((("tp", 2),)))) != path
    assert ExecutableCache(str(directory), "engine-b").path(key) != path
    # A truncated file is dropped (the caller compiles and stores again), not fatal.
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert cache.load(key, in_tree, out_tree) is None
    assert not os.path.exists(path)
    cache.store(key, compiled)
    assert cache.load(key, in_tree, out_tree) is not None


def test_a_kind_with_its_own_fingerprint_is_shared_across_engines(tmp_path):
    samplers = {"sampler": "vocab-256"}
    a = ExecutableCache(str(tmp_path), "engine-a", kind_fingerprints=samplers)
    b = ExecutableCache(str(tmp_path), "engine-b", kind_fingerprints=samplers)
    sampler, model = ProgramKey(ProgramKind.SAMPLER, 8), ProgramKey(ProgramKind.MODEL, 8)
    assert a.path(sampler) == b.path(sampler)
    assert a.path(model) != b.path(model)
    other_vocab = ExecutableCache(str(tmp_path), "engine-a", kind_fingerprints={"sampler": "v"})
    assert other_vocab.path(sampler) != a.path(sampler)
    assert other_vocab.path(model) == a.path(model)


def test_version_prefix_follows_xlm_version(tmp_path, monkeypatch):
    import xlm

    a = ExecutableCache(str(tmp_path), "engine").version
    monkeypatch.setattr(xlm, "__version__", xlm.__version__ + ".post1")
    assert ExecutableCache(str(tmp_path), "engine").version != a


def test_other_versions_evicted_beyond_cap(tmp_path):
    stale = tmp_path / "0123456789ab-model-old.xla"
    disk_cache.write_entry(stale, b"x" * 1000)
    cache = ExecutableCache(str(tmp_path), "engine", max_bytes=10)
    assert not stale.exists()
    compiled, *_ = _program()
    key = ProgramKey(ProgramKind.SAMPLER, 4)
    cache.store(key, compiled)
    ExecutableCache(str(tmp_path), "engine", max_bytes=10)  # the current version stays
    assert os.listdir(tmp_path) == [os.path.basename(cache.path(key))]


def test_engine_fingerprint_follows_cpu_kernel_availability(monkeypatch, tiny_checkpoint):
    """A program traced on the CPU kernels' jnp path is not loaded where the kernels are
    available (nor the other way round): the two run different code."""
    from xlm.engine.arg_utils import EngineArgs
    from xlm.ops import cpu_kernels
    from xlm.worker.compilation import engine_fingerprint

    config = EngineArgs(model=tiny_checkpoint("llama")).create_config()
    monkeypatch.setattr(cpu_kernels, "available", lambda: True)
    with_kernels = engine_fingerprint(config, 16, jnp.float32)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert engine_fingerprint(config, 16, jnp.float32) != with_kernels


def test_engine_fingerprint_follows_xla_flags_but_not_the_device_count(
    monkeypatch, tiny_checkpoint
):
    """A program compiled under other XLA options (the test suite's optimisation level, a
    user's flags) is not loaded; the fake device count is the mesh's business."""
    from xlm.engine.arg_utils import EngineArgs
    from xlm.worker.compilation import engine_fingerprint

    config = EngineArgs(model=tiny_checkpoint("llama")).create_config()
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    level0 = engine_fingerprint(config, 16, jnp.float32)
    monkeypatch.setenv("XLA_FLAGS", "")
    default = engine_fingerprint(config, 16, jnp.float32)
    assert default != level0
    flags = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert engine_fingerprint(config, 16, jnp.float32) == level0


def test_engine_fingerprint_follows_the_image_processor_config(tiny_qwen_vl):
    """Programs saved under another max_pixels (mm_processor_kwargs, the engine's cap) have
    other encoder buckets and another pool: they are not loaded."""
    from xlm.engine.arg_utils import EngineArgs
    from xlm.worker.compilation import engine_fingerprint

    fingerprints = {
        engine_fingerprint(
            EngineArgs(model=tiny_qwen_vl, mm_processor_kwargs=kwargs).create_config(),
            16,
            jnp.float32,
        )
        for kwargs in (None, {"max_pixels": 1024}, '{"max_pixels": 2048}')
    }
    assert len(fingerprints) == 3


_PARTIAL_MESH_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from xlm.worker.compilation import MeshSpec, ProgramKey, ProgramKind
from xlm.worker.executable_cache import ExecutableCache

devices = jax.devices()[:2]  # a mesh over 2 of the process's 4 devices
mesh = Mesh(np.array(devices), ("model",))
spec = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
fn = jax.jit(lambda x: (x * 2 + 1,))
args = (spec,)
in_tree, out_tree = jax.tree_util.tree_structure((args, {})), jax.tree_util.tree_structure((0,))
key = ProgramKey(ProgramKind.SAMPLER, 8, MeshSpec.of(mesh))
assert key.mesh.device_ids == (0, 1), key.mesh
cache = ExecutableCache(sys.argv[1], "engine")
cache.store(key, fn.lower(*args).compile())
x = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, PartitionSpec()))
(out,) = cache.load(key, in_tree, out_tree, devices=devices)(x)
np.testing.assert_array_equal(np.asarray(out), np.arange(8) * 2 + 1)
print("ok")
"""


def test_a_program_of_a_mesh_over_some_devices_loads_onto_those(tmp_path):
    """A program saved from a mesh over 2 of 4 devices runs on those 2 when loaded (JAX's
    loader places it on every device of the backend unless told), and its key names them."""
    import subprocess
    import sys

    from tests.conftest import fake_devices_env

    proc = subprocess.run(
        [sys.executable, "-c", _PARTIAL_MESH_SCRIPT, str(tmp_path)],
        env=fake_devices_env(4, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    other = MeshSpec((("model", 2),), 1, (2, 3))
    assert ProgramKey(ProgramKind.SAMPLER, 8, other) != ProgramKey(
        ProgramKind.SAMPLER, 8, MeshSpec((("model", 2),), 1, (0, 1))
    )
