"""The LoRA-augmented projection: each token adds its adapter's x @ A @ B to x @ W.

A model built with a LoRAConfig gives every projection (``Linear``) the stacked adapter
weights of ``max_loras`` device slots, padded to rank ``Rt`` (``max_lora_rank`` times
the projections fused into it: gate | up is two): A is ``[in, slots, Rt]``, B is
``[slots, Rt, out]``, B already scaled by the adapter's alpha / r. Which slot each token
uses (0: none) reaches the op through ``token_slots``, set by the runner around the model
call inside the traced step: the model's signature stays that of a base model.

The native path is two dots over all slots at once, ``x @ A[in, slots*Rt]``, masked to
each token's slot, then ``@ B[slots*Rt, out]``: dense static shapes for any mix of
adapters (no gather of per-token matrices), zero recompiles. Its cost grows with
``slots * Rt``; platform kernels (BGMV-style gathers for the decode rows) take the same
arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from xlm.ops.custom_op import CustomOp

_TOKEN_SLOTS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "xlm_lora_token_slots", default=None
)


@contextlib.contextmanager
def token_slots(slots: jax.Array | None) -> Iterator[None]:
    """Every LoRA projection traced inside reads `slots` ([T] int32, 0: no adapter)."""
    token = _TOKEN_SLOTS.set(slots)
    try:
        yield
    finally:
        _TOKEN_SLOTS.reset(token)


def current_token_slots() -> jax.Array | None:
    return _TOKEN_SLOTS.get()


@CustomOp.register("lora")
class LoRA(CustomOp):
    """delta [T, out] = (x [T, in] @ A[:, slot_t]) @ B[slot_t] for each token t."""

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)

    def forward_native(
        self, x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array
    ) -> jax.Array:
        in_features, num_slots, rank = a.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, in_features)
        xa = jnp.dot(x2, a.reshape(in_features, num_slots * rank))
        mine = slots.reshape(-1)[:, None] == jnp.arange(1, num_slots + 1, dtype=slots.dtype)
        xa = (xa.reshape(-1, num_slots, rank) * mine[..., None].astype(xa.dtype)).reshape(
            -1, num_slots * rank
        )
        delta = jnp.dot(xa, b.reshape(num_slots * rank, b.shape[-1]))
        return delta.reshape(*lead, b.shape[-1])
