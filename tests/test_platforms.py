"""Platform resolution rules, tested on the resolver with controlled detectors."""

import pytest

import xlm.platforms as platforms
from xlm.platforms import resolve_current_platform_cls_qualname

CPU = platforms.BUILTIN_PLATFORMS["cpu"]
CUDA = platforms.BUILTIN_PLATFORMS["cuda"]


@pytest.fixture
def detectors(monkeypatch):
    """Set which built-in and out-of-tree detectors activate."""

    def configure(builtin: dict, oot: dict):
        monkeypatch.setattr(platforms, "builtin_platform_plugins", builtin)
        monkeypatch.setattr("xlm.plugins.load_plugins_by_group", lambda group: dict(oot))

    monkeypatch.delenv("XLM_TARGET_PLATFORM", raising=False)
    return configure


def test_single_builtin_is_chosen(detectors):
    detectors({"cpu": lambda: CPU, "cuda": lambda: None}, {})
    assert resolve_current_platform_cls_qualname() == CPU


def test_two_builtins_is_an_error_naming_them(detectors):
    detectors({"cpu": lambda: CPU, "cuda": lambda: CUDA}, {})
    with pytest.raises(RuntimeError, match=r"built-in.*\['cpu', 'cuda'\]"):
        resolve_current_platform_cls_qualname()


def test_none_activated_gives_unspecified(detectors):
    detectors({"cpu": lambda: None}, {})
    assert resolve_current_platform_cls_qualname().endswith("UnspecifiedPlatform")


def test_out_of_tree_wins_over_builtin(detectors):
    detectors({"cpu": lambda: CPU}, {"mine": lambda: "pkg.MyPlatform"})
    assert resolve_current_platform_cls_qualname() == "pkg.MyPlatform"


def test_inactive_out_of_tree_falls_back_to_builtin(detectors):
    detectors({"cpu": lambda: CPU}, {"mine": lambda: None})
    assert resolve_current_platform_cls_qualname() == CPU


def test_two_out_of_tree_is_an_error_naming_them(detectors):
    detectors({"cpu": lambda: CPU}, {"a": lambda: "pkg.A", "b": lambda: "pkg.B"})
    with pytest.raises(RuntimeError, match=r"out-of-tree.*\['a', 'b'\]"):
        resolve_current_platform_cls_qualname()


def test_failing_detector_is_skipped(detectors):
    def broken():
        raise OSError("no device")

    detectors({"cpu": lambda: CPU}, {"broken": broken})
    assert resolve_current_platform_cls_qualname() == CPU


def test_forced_platform(detectors, monkeypatch):
    detectors({"cpu": lambda: CPU, "cuda": lambda: CUDA}, {"a": lambda: "pkg.A"})
    monkeypatch.setenv("XLM_TARGET_PLATFORM", "cuda")
    assert resolve_current_platform_cls_qualname() == CUDA
    monkeypatch.setenv("XLM_TARGET_PLATFORM", "quantum")
    with pytest.raises(ValueError, match="XLM_TARGET_PLATFORM='quantum'"):
        resolve_current_platform_cls_qualname()


def test_current_platform_is_lazy_and_cached(detectors, monkeypatch):
    calls = []

    def cpu():
        calls.append(1)
        return CPU

    detectors({"cpu": cpu}, {})
    monkeypatch.setattr(platforms, "_current_platform", None)
    first = platforms.current_platform
    second = platforms.current_platform
    assert first is second and first.is_cpu() and len(calls) == 1
    platforms._reset_current_platform()


def test_cpu_detector_on_this_machine():
    assert platforms.cpu_platform_plugin() == CPU
    assert platforms.cuda_platform_plugin() is None
    assert platforms.tpu_platform_plugin() is None


@pytest.mark.parametrize(
    ("jax_platforms", "expected"), [("cpu", CPU), ("", CUDA), ("cuda,cpu", CUDA), ("gpu", CUDA)]
)
def test_jax_platforms_decides_whether_a_present_gpu_is_the_platform(
    monkeypatch, jax_platforms, expected
):
    """A GPU machine (plugin and device files present) with JAX_PLATFORMS=cpu runs on the
    CPU: the first GPU run found "cuda" chosen while JAX could start only "cpu"."""
    monkeypatch.setattr(platforms, "_has_module_prefix", lambda prefix: prefix == "jax_cuda")
    monkeypatch.setattr(platforms, "_has_module", lambda name: name == "jaxlib")
    monkeypatch.setattr(
        platforms.glob, "glob", lambda pattern: [pattern] if "nvidia" in pattern else []
    )
    monkeypatch.setenv("JAX_PLATFORMS", jax_platforms)
    monkeypatch.delenv("XLM_TARGET_PLATFORM", raising=False)
    monkeypatch.setattr("xlm.plugins.load_plugins_by_group", lambda group: {})
    assert resolve_current_platform_cls_qualname() == expected
