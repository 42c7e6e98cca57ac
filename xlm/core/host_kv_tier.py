"""The host KV tier's index: full blocks evicted from the device pool, kept in host memory.

Pure Python, like the rest of xlm.core: it decides, the worker copies. A cached full block
that the device pool evicts (reallocates) is saved to a host slot under the same block hash;
a prefix lookup that runs out of device hits continues in the host tier, and each host hit
is loaded into a newly allocated device block instead of being recomputed. Each step's
copies ride in its SchedulerOutput (`HostKVTransfers`); the worker does the saves before
the loads and both before the step's forward, so a save reads an evicted block before the
step that reuses it writes it (xlm.worker.host_kv_cache).

The tier keeps its own LRU over a fixed number of slots (the byte cap over the bytes of one
block). A block saved in a step becomes loadable from the next step on (its copy to the
host is still in flight during its own step); a slot loaded in a step is not reused by that
step's saves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class HostKVTransfers:
    """One step's block copies: device blocks out to host slots, host slots into blocks."""

    save_block_ids: list[int] = field(default_factory=list)
    save_slots: list[int] = field(default_factory=list)
    load_slots: list[int] = field(default_factory=list)
    load_block_ids: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.save_slots or self.load_slots)


class HostKVTier:
    """Block hash -> host slot, LRU over `num_slots` slots of `block_bytes` each."""

    def __init__(self, num_slots: int, block_bytes: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} is invalid: must be >= 1")
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        # Oldest first: the head is the next to go when a save needs a slot.
        self._slots: OrderedDict[Hashable, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self._unready: set[Hashable] = set()  # saved this step: loadable from the next
        self._pinned: set[int] = set()  # slots loaded this step
        self._fresh: set[int] = set()  # device blocks whose K/V this step computes
        self._step = HostKVTransfers()
        self.num_hit_tokens = 0  # prompt tokens loaded from the host instead of computed
        self.num_saved_blocks = 0
        self.num_loaded_blocks = 0

    @property
    def num_used_slots(self) -> int:
        return len(self._slots)

    @property
    def usage(self) -> float:
        """Fraction of the slots holding a block."""
        return len(self._slots) / self.num_slots

    def note_computed_this_step(self, block_id: int) -> None:
        """A block registered in the prefix cache this step: its K/V is not written yet."""
        self._fresh.add(block_id)

    def save(self, key: Hashable, block_id: int) -> None:
        """The device pool evicts a cached block: copy it out unless the tier has it."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return
        if block_id in self._fresh:
            return  # registered and evicted in one schedule: nothing computed to save
        slot = self._take_slot()
        if slot is None:
            return  # every slot is in use by this step's copies
        self._slots[key] = slot
        self._unready.add(key)
        self._step.save_block_ids.append(block_id)
        self._step.save_slots.append(slot)
        self.num_saved_blocks += 1

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used one no copy of this step touches."""
        if self._free:
            return self._free.pop()
        for key, slot in self._slots.items():
            if slot not in self._pinned and key not in self._unready:
                del self._slots[key]
                return slot
        return None

    def find(self, keys: Sequence[Hashable], start: int, stop: int) -> list[int]:
        """Slots of the run of loadable blocks keys[start:stop] from start (may be empty).

        They stay pinned for the rest of the step: the allocation that follows may evict
        device blocks, whose saves must not take these slots before `load` reads them.
        """
        slots = []
        get = self._slots.get
        for i in range(start, stop):
            key = keys[i]
            slot = get(key)
            if slot is None or key in self._unready:
                break
            slots.append(slot)
        self._pinned.update(slots)
        return slots

    def load(self, keys: Sequence[Hashable], slots: list[int], block_ids: list[int]) -> None:
        """Copy host slots into newly allocated device blocks in this step (hits counted)."""
        for key in keys:
            self._slots.move_to_end(key)
        self._step.load_slots.extend(slots)
        self._step.load_block_ids.extend(block_ids)
        self.num_loaded_blocks += len(slots)

    def take_transfers(self) -> HostKVTransfers | None:
        """End of a schedule: this step's copies (None: none); the next step begins."""
        step = self._step
        self._step = HostKVTransfers()
        self._unready.clear()
        self._pinned.clear()
        self._fresh.clear()
        return step if step else None

    def clear(self) -> None:
        """Forget every block (reset_prefix_cache)."""
        self._slots.clear()
        self._unready.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    @property
    def bytes_to_host(self) -> int:
        return self.num_saved_blocks * self.block_bytes

    @property
    def bytes_to_device(self) -> int:
        return self.num_loaded_blocks * self.block_bytes
