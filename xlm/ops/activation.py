"""Gated activations."""

import jax

from xlm.ops.custom_op import CustomOp


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """silu(x[..., :d]) * x[..., d:] for x of last dimension 2d."""

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)

    def forward_native(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1] // 2
        return jax.nn.silu(x[..., :d]) * x[..., d:]
