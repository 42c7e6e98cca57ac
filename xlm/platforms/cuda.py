"""NVIDIA GPU platform (JAX's CUDA PJRT plugin)."""

from xlm import envs
from xlm.platforms.interface import Platform, PlatformEnum


class CudaPlatform(Platform):
    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    jax_platform = "cuda"

    def data_parallel_env(self, rank: int, tp: int) -> dict[str, str]:
        """A rank's process sees GPUs [rank * tp, (rank + 1) * tp) of the visible ones only
        (JAX would otherwise reserve memory on every GPU in every rank)."""
        # Unset: GPUs 0, 1, ... (asking JAX here would start the GPU backend in the front end).
        ids = envs.cuda_visible_devices()
        if ids is None:
            return {
                "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(rank * tp, (rank + 1) * tp))
            }
        group = ids[rank * tp : (rank + 1) * tp]
        if len(group) < tp:
            raise ValueError(
                f"data-parallel rank {rank} needs GPUs {rank * tp}..{(rank + 1) * tp - 1}; "
                f"{len(ids)} visible: data_parallel_size * tensor_parallel_size must fit"
            )
        return {"CUDA_VISIBLE_DEVICES": ",".join(group)}
