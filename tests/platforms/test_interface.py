"""The Platform interface: device queries answer from the platform's own JAX backend, the
free memory is the limit less what is in use, and each family answers only its own is_*
(the built-in families' constants: tests/platforms/test_cpu.py and the rest)."""

from __future__ import annotations

import jax
import pytest

from xlm.platforms.interface import Platform, PlatformEnum, UnspecifiedPlatform


class _Host(Platform):
    _enum = PlatformEnum.CPU
    device_name = device_type = "host"
    jax_platform = "cpu"


class _WithStats(_Host):
    def __init__(self, stats):
        self.stats = stats

    def get_device_memory_stats(self, device_id=0):
        return self.stats


def test_device_queries_use_the_platforms_backend():
    host = _Host()
    devices = jax.local_devices(backend="cpu")
    assert host.devices() == devices and host.device_count() == len(devices)
    assert host.get_device_name() == devices[0].device_kind
    assert host.get_device_memory_stats() == (devices[0].memory_stats() or {})


def test_free_memory_is_the_limit_less_what_is_in_use():
    full = _WithStats({"bytes_limit": 1000, "bytes_in_use": 300})
    assert full.get_device_total_memory() == 1000 and full.get_device_free_memory() == 700
    assert _WithStats({"bytes_limit": 1000}).get_device_free_memory() == 1000
    unknown = _WithStats({})
    assert unknown.get_device_total_memory() is None and unknown.get_device_free_memory() is None


@pytest.mark.parametrize("member", list(PlatformEnum))
def test_each_family_answers_only_its_own_predicate(member):
    platform = type("P", (Platform,), {"_enum": member, "device_name": "p"})()
    answers = {
        PlatformEnum.TPU: platform.is_tpu(),
        PlatformEnum.CUDA: platform.is_cuda(),
        PlatformEnum.ROCM: platform.is_rocm(),
        PlatformEnum.CPU: platform.is_cpu(),
        PlatformEnum.OOT: platform.is_out_of_tree(),
    }
    assert {m for m, yes in answers.items() if yes} == ({member} - {PlatformEnum.UNSPECIFIED})


def test_the_unspecified_platform_and_a_default_backend():
    platform = UnspecifiedPlatform()
    assert repr(platform) == "UnspecifiedPlatform(device_name='unspecified')"
    before = jax.config.jax_platforms
    platform.pin_jax_backend()  # no backend of its own: JAX's settings are left alone
    assert jax.config.jax_platforms == before
