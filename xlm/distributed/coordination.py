"""Meeting points of the processes of a multihost engine, through JAX's coordination
service (a key-value store and barriers; no devices, no collectives)."""

from __future__ import annotations

# Processes may be minutes apart after loading and compiling (a slow host, a loaded CI
# machine), while the first collective's Gloo/NCCL set-up waits far less.
READY_TIMEOUT_MS = 30 * 60 * 1000


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def barrier(name: str) -> None:
    """Wait for every process at `name`."""
    _client().wait_at_barrier(f"xlm/{name}", READY_TIMEOUT_MS)


def agree_min(name: str, value: int) -> int:
    """The smallest `value` over all processes (single process: `value`)."""
    import jax

    if jax.process_count() == 1:
        return value
    client = _client()
    client.key_value_set(f"xlm/{name}/{jax.process_index()}", str(value))
    values = [
        int(client.blocking_key_value_get(f"xlm/{name}/{i}", READY_TIMEOUT_MS))
        for i in range(jax.process_count())
    ]
    return min(values)
