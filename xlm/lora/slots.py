"""Adapters on the device: ``max_loras`` fixed slots filled least-recently-used first.

The runner asks for the slots of a step's adapters (``slots_for``); an adapter not on the
device is written into a free slot, or over the least recently used one no request of
this step needs (the scheduler never puts more adapters in a step than there are slots).
Writing a slot replaces every LoRA array of the model state with one jitted update of
fixed shapes (no step program recompiles: the arrays keep their shapes and shardings);
a step already dispatched keeps reading the arrays it was given.

Adapters on the host: up to ``max_cpu_loras`` read adapters, least recently used
dropped first (read again from their directory when needed); an adapter in a device slot
or used by a live request is never dropped. ``remove`` while requests use an adapter
defers until the last of them ends.

Which adapter sits in which slot depends only on the steps' adapters (keyed by the whole
LoRARequest: an id named again with another directory is another adapter), never on
``add`` or ``remove``: every process of a multi-host engine sees the same steps, so
they all write the same slots in the same order (``remove`` runs on the leader only).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from xlm.config import LoRAConfig
from xlm.core.outputs import SchedulerOutput
from xlm.distributed.mesh import put_replicated
from xlm.distributed.tensor_parallel import to_physical
from xlm.logger import init_logger
from xlm.lora.adapter import LoRASpec, LoRAWeights, load_adapter
from xlm.lora.request import LoRARequest

logger = init_logger(__name__)


def _write(a_leaves: list[jax.Array], b_leaves: list[jax.Array], index: jax.Array, a_vals, b_vals):
    """Slot `index` (0-based) of every A [in, slots, Rt] and B [slots, Rt, out] set."""
    a_out = [a.at[:, index].set(v.astype(a.dtype)) for a, v in zip(a_leaves, a_vals)]
    b_out = [b.at[index].set(v.astype(b.dtype)) for b, v in zip(b_leaves, b_vals)]
    return a_out, b_out


class LoRASlots:
    """The host cache and device slots of one model's adapters (one per runner)."""

    def __init__(
        self, model_state: nnx.State, spec: LoRASpec, config: LoRAConfig, mesh: Any = None
    ) -> None:
        self.spec = spec
        self.config = config
        self.mesh = mesh
        flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(model_state)}
        self._paths = sorted(spec.targets)
        # The model state's own Variables: setting their values is what the programs read.
        self._a = [flat[f"{p}.lora_a"] for p in self._paths]
        self._b = [flat[f"{p}.lora_b"] for p in self._paths]
        shardings = None
        if mesh is not None:
            shardings = (
                [v.get_value().sharding for v in self._a],
                [v.get_value().sharding for v in self._b],
            )
        self._write = jax.jit(_write, out_shardings=shardings)
        self.requests: dict[int, LoRARequest] = {}  # every adapter seen, by id
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()  # LRU: oldest first
        # Adapter -> slot 1..N, least recently used first.
        self.slot_of: OrderedDict[LoRARequest, int] = OrderedDict()
        self.live: Counter[int] = Counter()  # requests alive per adapter id
        self._removed: set[int] = set()  # unloaded while requests still use it
        self.num_slot_writes = 0

    # ---- registration -------------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAWeights:
        """Read (or find) an adapter on the host; raises LoRAAdapterError when it is bad."""
        lid = request.lora_int_id
        known = self.requests.get(lid)
        if known is not None and known.lora_path != request.lora_path:
            # The same id with another directory: the old one is gone from every cache.
            self._forget(lid)
        self._removed.discard(lid)
        weights = self.host.get(lid)
        if weights is None:
            weights = load_adapter(request.lora_path, self.spec, request.lora_name)
            self.host[lid] = weights
        self.host.move_to_end(lid)
        self.requests[lid] = request
        self._trim_host(keep=lid)
        return weights

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (after its live requests end); whether it was known."""
        if lora_id not in self.requests or lora_id in self._removed:
            return False
        if self.live[lora_id]:
            self._removed.add(lora_id)
        else:
            self._forget(lora_id)
        return True

    def list(self) -> list[int]:
        return sorted(i for i in self.requests if i not in self._removed)

    def _forget(self, lora_id: int) -> None:
        """Drop the host copy (its slot, if any, is simply reused later)."""
        self.requests.pop(lora_id, None)
        self.host.pop(lora_id, None)
        self._removed.discard(lora_id)

    def _trim_host(self, keep: int) -> None:
        """Drop the least recently used adapters past max_cpu_loras (never `keep`, one in
        a device slot or one a live request uses: those stay, over the limit if need be)."""
        in_slots = {r.lora_int_id for r in self.slot_of}
        pinned = {keep, *in_slots} | {i for i, n in self.live.items() if n}
        for lid in list(self.host):
            if len(self.host) <= self.config.max_cpu_loras:
                break
            if lid not in pinned:
                del self.host[lid]

    # ---- request lifetimes ------------------------------------------------------------
    def acquire(self, request: LoRARequest) -> None:
        """A request using `request`'s adapter starts (its adapter is read if needed)."""
        self.add(request)
        self.live[request.lora_int_id] += 1

    def release(self, lora_id: int) -> None:
        """A request using adapter `lora_id` ended."""
        self.live[lora_id] -= 1
        if self.live[lora_id] <= 0:
            del self.live[lora_id]
            if lora_id in self._removed:
                self._forget(lora_id)

    def track(self, scheduler_output: SchedulerOutput, requests: Mapping[str, Any]) -> None:
        """Count each adapter's live requests from a step's new and finished ones (one in
        use is never dropped); `requests`: the known requests' states (`lora_request`)."""
        for req_id in scheduler_output.finished_req_ids:
            lora = getattr(requests.get(req_id), "lora_request", None)
            if lora is not None:
                self.release(lora.lora_int_id)
        for new in scheduler_output.scheduled_new_reqs:
            if new.lora_request is not None:
                self.acquire(new.lora_request)

    # ---- device slots -----------------------------------------------------------------
    def slots_for(self, loras: list[LoRARequest | None]) -> np.ndarray:
        """The device slot of each adapter (0: none), writing missing ones into slots."""
        # In the step's order, never a set's: a string's hash differs between processes,
        # and every process of a multi-host engine must fill the same slots.
        wanted = list(dict.fromkeys(r for r in loras if r is not None))
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(
                f"a step uses {len(wanted)} adapters but max_loras={self.config.max_loras}"
            )
        for lora in wanted:
            if lora in self.slot_of:
                self.slot_of.move_to_end(lora)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(1, self.config.max_loras + 1) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(r for r in self.slot_of if r not in wanted)
                slot = self.slot_of.pop(victim)
            self._fill(slot, self._weights(lora))
            self.slot_of[lora] = slot
        return np.asarray([0 if r is None else self.slot_of[r] for r in loras], np.int32)

    def _weights(self, lora: LoRARequest) -> LoRAWeights:
        weights = self.host.get(lora.lora_int_id)
        if weights is None or self.requests.get(lora.lora_int_id) != lora:
            weights = self.add(lora)  # dropped from the host cache (or renamed): read again
        return weights

    def _fill(self, slot: int, weights: LoRAWeights) -> None:
        """Write an adapter's A and B into `slot` of every projection (zeros elsewhere)."""
        a_vals, b_vals = [], []
        for path, a_var in zip(self._paths, self._a):
            in_features, _, rank = a_var.shape
            out_logical = self.spec.targets[path].out_features
            a, b = weights.weights.get(path) or (
                np.zeros((in_features, rank), np.float32),
                np.zeros((rank, out_logical), np.float32),
            )
            b = to_physical(b, self.spec.targets[path].b_metadata)
            a_vals.append(put_replicated(a, self.mesh))
            b_vals.append(put_replicated(b, self.mesh))
        index = put_replicated(np.asarray(slot - 1, np.int32), self.mesh)
        a_leaves = [v.get_value() for v in self._a]
        b_leaves = [v.get_value() for v in self._b]
        new_a, new_b = self._write(a_leaves, b_leaves, index, a_vals, b_vals)
        for var, value in zip(self._a, new_a):
            var.set_value(value)
        for var, value in zip(self._b, new_b):
            var.set_value(value)
        self.num_slot_writes += 1
        logger.debug("LoRA adapter %s written into slot %d.", weights.name, slot)
