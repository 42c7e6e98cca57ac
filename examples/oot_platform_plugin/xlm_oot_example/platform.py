"""The example out-of-tree platform: JAX's CPU backend under another name."""

from xlm.config import XlmConfig
from xlm.platforms.interface import Platform, PlatformEnum


class ExampleOotPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "oot_example"
    device_type = "oot_example"
    jax_platform = "cpu"
    supports_fast_bf16 = False

    def check_and_update_config(self, config: XlmConfig) -> None:
        # This platform ships its own RMSNorm kernel: use it unless the user said no.
        custom_ops = config.compilation_config.custom_ops
        if "-rms_norm" not in custom_ops and "+rms_norm" not in custom_ops:
            custom_ops.append("+rms_norm")
