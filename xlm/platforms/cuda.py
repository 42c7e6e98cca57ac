"""NVIDIA GPU platform (JAX's CUDA PJRT plugin)."""

from xlm import envs
from xlm.platforms.interface import Platform, PlatformEnum

# The step programs run as CUDA graphs, their `lax.cond`s (the sampler's feature switches,
# the few-rows logits) included as conditional nodes: XLA's default leaves conditionals
# out, and each one then copies its predicate to the host and waits for the GPU there, so
# the host cannot queue the next kernels ahead. Measured on an H200 (benchmarks/RESULTS.md,
# "GPU"): one-request decode of a Llama-3.1-8B shape 10.2 ms per token with XLA's default,
# 10.6 with graphs off, 6.8 with these.
COMMAND_BUFFER_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE",
    "xla_gpu_graph_min_graph_size": 1,
}


class CudaPlatform(Platform):
    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    jax_platform = "cuda"

    def compiler_options(self) -> dict[str, object]:
        """COMMAND_BUFFER_OPTIONS, but any of them the user's XLA_FLAGS set (theirs win)."""
        flags = envs.xla_flags()
        return {k: v for k, v in COMMAND_BUFFER_OPTIONS.items() if f"--{k}=" not in flags}

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
