"""AMD GPU platform (JAX's ROCm PJRT plugin); ops fall back to their CUDA paths."""

from xlm.platforms.interface import Platform, PlatformEnum


class RocmPlatform(Platform):
    _enum = PlatformEnum.ROCM
    device_name = "rocm"
    device_type = "rocm"
    jax_platform = "rocm"
