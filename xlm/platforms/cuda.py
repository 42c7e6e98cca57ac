"""NVIDIA GPU platform (JAX's CUDA PJRT plugin)."""

from xlm.platforms.interface import Platform, PlatformEnum


class CudaPlatform(Platform):
    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    jax_platform = "cuda"
