"""The CPU kernel library's build (xlm.ops.cpu_kernels.build) and the install-time hook
(setup.py's build_ext) that uses it: the key follows the FFI API version, and the hook
leaves a library under the runtime's key that loads and defines every kernel."""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
from pathlib import Path

import jax
import pytest

from xlm.ops import cpu_kernels
from xlm.ops.cpu_kernels import build

ROOT = Path(__file__).resolve().parents[3]


def _fake_headers(tmp_path: Path, major: int, minor: int) -> Path:
    api = tmp_path / f"inc-{major}-{minor}" / "xla" / "ffi" / "api"
    api.mkdir(parents=True)
    (api / "c_api.h").write_text(
        f"#define XLA_FFI_API_MAJOR {major}  // comment\n#define XLA_FFI_API_MINOR {minor}\n"
    )
    return api.parents[2]


def test_ffi_api_version_is_read_from_the_headers(tmp_path) -> None:
    assert build.ffi_api_version(_fake_headers(tmp_path, 1, 7)) == "1.7"
    real = (Path(jax.ffi.include_dir()) / "xla/ffi/api/c_api.h").read_text()
    assert f"#define XLA_FFI_API_MINOR {build.ffi_api_version(jax.ffi.include_dir())[2:]}" in real
    (tmp_path / "empty/xla/ffi/api").mkdir(parents=True)
    (tmp_path / "empty/xla/ffi/api/c_api.h").write_text("// no version\n")
    with pytest.raises(build.BuildError, match="XLA_FFI_API_MAJOR"):
        build.ffi_api_version(tmp_path / "empty")


def test_the_key_follows_the_ffi_api_version_not_the_header_path(tmp_path) -> None:
    a = build.library_key(_fake_headers(tmp_path, 0, 3))
    b = build.library_key(_fake_headers(tmp_path, 0, 4))
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "inc-0-3", copy)
    assert a != b
    assert build.library_key(copy) == a


def test_find_prebuilt_matches_the_key_only(tmp_path) -> None:
    (tmp_path / f"{build.PREBUILT_PREFIX}aaaa.cpython-311-x86_64-linux-gnu.so").touch()
    assert build.find_prebuilt(tmp_path, "aaaa").name.startswith("prebuilt_aaaa.")
    assert build.find_prebuilt(tmp_path, "bbbb") is None


def _setup_module():
    spec = importlib.util.spec_from_file_location("xlm_setup_under_test", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the hook, runs no setup()
    return module


def test_the_install_hook_builds_a_loadable_library_under_the_runtime_key(tmp_path) -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    from setuptools.dist import Distribution

    setup = _setup_module()
    dist = Distribution({"name": "xlm", "ext_modules": setup._extensions()})
    command = setup.BuildCpuKernels(dist)
    command.build_lib = str(tmp_path)
    command.build_temp = str(tmp_path / "temp")
    command.ensure_finalized()
    command.run()
    key = build.library_key(jax.ffi.include_dir())
    library = build.find_prebuilt(tmp_path / "xlm" / "ops" / "cpu_kernels", key)
    assert library is not None, sorted(p.name for p in tmp_path.rglob("*"))
    loaded = ctypes.CDLL(str(library))
    for _, symbol in cpu_kernels._KERNELS.values():
        assert getattr(loaded, symbol)
    # Nothing but the library is left beside it (no objects, no build directory).
    assert sorted(p.name for p in library.parent.iterdir()) == [library.name]


def test_a_failed_install_build_is_a_warning_not_an_error(tmp_path, monkeypatch, capsys) -> None:
    from setuptools.dist import Distribution

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    setup = _setup_module()
    command = setup.BuildCpuKernels(Distribution({"ext_modules": setup._extensions()}))
    command.build_lib = str(tmp_path / "lib")
    command.build_temp = str(tmp_path / "temp")
    command.ensure_finalized()
    command.run()
    assert "not built at install" in capsys.readouterr().out
    assert not list((tmp_path / "lib").rglob("*.so"))
