"""An out-of-tree RMSNorm whose forward_oot computes the norm another way."""

import jax
import jax.numpy as jnp

from xlm.ops.custom_op import CustomOp
from xlm.ops.layernorm import RMSNorm

# How many times forward_oot was traced: proof, for tests, that this code ran.
FORWARD_OOT_CALLS = 0


@CustomOp.register_oot("rms_norm")
class ExampleRMSNorm(RMSNorm):
    """RMSNorm through the vector 2-norm: rms(x) = |x|_2 / sqrt(d)."""

    def forward_oot(self, x: jax.Array, residual: jax.Array | None = None):
        global FORWARD_OOT_CALLS
        FORWARD_OOT_CALLS += 1
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.astype(jnp.float32)
        d = x.shape[-1]
        norm = jnp.linalg.norm(xf, axis=-1, keepdims=True)
        rms = jnp.sqrt(norm * norm / d + self.eps)
        out = (xf / rms * (self.weight[...] + self.weight_offset)).astype(x.dtype)
        return out if residual is None else (out, residual)
