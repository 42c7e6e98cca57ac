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
    """delta [T, out] = (x [T, in] @ A[:, slot_t]) @ B[slot_t] for each token t.

    `parts` checkpoint projections fused in one (gate | up) each own a rank block of A
    and B and only their own columns of B (laid out per shard: `shards`, the
    fused_shards layout of xlm.distributed.tensor_parallel); B's product runs per part,
    over its own columns only, which halves the work of a fused gate | up.
    """

    def __init__(self, parts: int = 1, shards: int = 1, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.parts, self.shards = parts, shards

    def forward_native(
        self, x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array
    ) -> jax.Array:
        in_features, num_slots, rank = a.shape
        parts, out = self.parts, b.shape[-1]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, in_features)
        xa = jnp.dot(x2, a.reshape(in_features, num_slots * rank))
        mine = slots.reshape(-1)[:, None] == jnp.arange(1, num_slots + 1, dtype=slots.dtype)
        r = rank // parts
        xa = xa.reshape(-1, num_slots, parts, r) * mine[:, :, None, None].astype(xa.dtype)
        if parts == 1:
            delta = jnp.dot(xa.reshape(-1, num_slots * r), b.reshape(num_slots * r, out))
            return delta.reshape(*lead, out)
        width = out // (self.shards * parts)
        b6 = b.reshape(num_slots, parts, r, self.shards, parts, width)
        pieces = [
            jnp.dot(
                xa[:, :, p].reshape(-1, num_slots * r),
                b6[:, p, :, :, p, :].reshape(num_slots * r, self.shards * width),
            ).reshape(-1, self.shards, 1, width)
            for p in range(parts)
        ]
        return jnp.concatenate(pieces, axis=2).reshape(*lead, out)
