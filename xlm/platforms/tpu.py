"""Google TPU platform (libtpu)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xlm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from xlm.config import XlmConfig


class TpuPlatform(Platform):
    _enum = PlatformEnum.TPU
    device_name = "tpu"
    device_type = "tpu"
    jax_platform = "tpu"

    def check_and_update_config(self, config: XlmConfig) -> None:
        # TPU kernels tile pages in sublanes of 8 rows; small pages waste DMA work.
        if config.cache_config.block_size < 16:
            config.cache_config.block_size = 16
