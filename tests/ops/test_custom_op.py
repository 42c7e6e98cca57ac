"""CustomOp enable rules, per-platform dispatch and out-of-tree substitution."""

import pytest

from xlm.config import CompilationConfig, ModelConfig, XlmConfig, set_current_xlm_config
from xlm.ops import PagedAttention, RMSNorm, RotaryEmbedding, SiluAndMul
from xlm.ops.custom_op import CustomOp
from xlm.platforms.cpu import CpuPlatform
from xlm.platforms.cuda import CudaPlatform
from xlm.platforms.interface import Platform, PlatformEnum, UnspecifiedPlatform
from xlm.platforms.rocm import RocmPlatform
from xlm.platforms.tpu import TpuPlatform


class OotPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "oot"
    device_type = "oot"


def enabled(op_cls, custom_ops):
    return op_cls.enabled(CompilationConfig(custom_ops=custom_ops))


@pytest.mark.parametrize(
    ("custom_ops", "norm", "attention"),
    [
        ([], False, True),  # defaults: norms stay native, attention uses its kernel
        (["all"], True, True),
        (["none"], False, False),
        (["all", "-rms_norm"], False, True),
        (["none", "+rms_norm"], True, False),
        (["+rms_norm", "-paged_attention"], True, False),
    ],
)
def test_enable_rules(custom_ops, norm, attention):
    assert enabled(RMSNorm, custom_ops) is norm
    assert enabled(PagedAttention, custom_ops) is attention
    assert enabled(SiluAndMul, custom_ops) is ("all" in custom_ops)
    assert enabled(RotaryEmbedding, custom_ops) is ("all" in custom_ops)


def test_all_with_none_is_an_error():
    with pytest.raises(ValueError, match="custom_ops"):
        CompilationConfig(custom_ops=["all", "none"])


@pytest.mark.parametrize("bad", ["rms_norm", "+", "*rms_norm"])
def test_malformed_entries_are_errors(bad):
    with pytest.raises(ValueError, match="custom_ops"):
        CompilationConfig(custom_ops=[bad])


def test_unknown_op_name_is_an_error():
    with pytest.raises(ValueError, match=r"'\+flash_norm' names an unknown op.*rms_norm"):
        enabled(RMSNorm, ["+flash_norm"])


class Probe(CustomOp):
    """An op whose every forward says which one it is."""

    default_enabled = True
    name = "probe"

    def forward_native(self):
        return "native"

    def forward_cuda(self):
        return "cuda"

    def forward_tpu(self):
        return "tpu"

    def forward_cpu(self):
        return "cpu"

    def forward_oot(self):
        return "oot"


class NativeOnly(CustomOp):
    default_enabled = True
    name = "native_only"

    def forward_native(self):
        return "native"


@pytest.mark.parametrize(
    ("platform_cls", "expected"),
    [
        (TpuPlatform, "tpu"),
        (CudaPlatform, "cuda"),
        (RocmPlatform, "cuda"),  # forward_rocm falls back to forward_cuda
        (CpuPlatform, "cpu"),
        (OotPlatform, "oot"),
        (UnspecifiedPlatform, "native"),
    ],
)
def test_dispatch_follows_platform(on_platform, platform_cls, expected):
    on_platform(platform_cls)
    assert Probe()() == expected
    # Every platform path of an op without kernels falls back to the native one.
    assert NativeOnly()() == "native"


def test_disabled_op_stays_native_unless_enforced(on_platform, monkeypatch):
    on_platform(CudaPlatform)
    monkeypatch.setitem(CustomOp.op_registry, "probe", Probe)
    config = XlmConfig(
        ModelConfig(model="m"), compilation_config=CompilationConfig(custom_ops=["-probe"])
    )
    with set_current_xlm_config(config):
        assert Probe()() == "native"
        assert Probe(enforce_enable=True)() == "cuda"
    assert Probe()() == "cuda"  # outside the config context: defaults


def test_register_oot_substitutes_the_constructed_class(monkeypatch):
    monkeypatch.setattr(CustomOp, "op_registry_oot", {})

    @CustomOp.register_oot("silu_and_mul")
    class MySiluAndMul(SiluAndMul):
        def forward_oot(self, x):
            return x

    op = SiluAndMul()
    assert type(op) is MySiluAndMul
    # Constructing the replacement itself, or an unrelated op, is unaffected.
    assert type(MySiluAndMul()) is MySiluAndMul
    assert type(RMSNorm(4)) is RMSNorm


def test_register_rejects_duplicate_names():
    with pytest.raises(ValueError, match="already registered"):
        CustomOp.register("rms_norm")(type("Dup", (CustomOp,), {}))
