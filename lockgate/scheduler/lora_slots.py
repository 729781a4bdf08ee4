"""AdapterSlots: which LoRA adapter sits in which of the runner's ``--max-loras`` slots.

Owns the residency decision (the runner only holds the weights a slot is given): a request with
an adapter is admitted only once its adapter has a slot; a slot is *pinned* while any running
request uses it; ``acquire`` reuses the adapter's slot, else takes an empty one, else evicts the
least recently used unpinned adapter, else returns None (the request waits in the queue; no
error). ``put(slot, adapter)`` is the runner's call that fills a slot (the engine supplies it).

Adapters are numbered by the engine (``uid`` >= 1, a fresh number per load, so a name unloaded
and loaded again is a new adapter with a new prefix-cache namespace); 0 is the base model and
never takes a slot.

Invariants: a uid sits in at most one slot; ``pins[s] > 0`` only for an occupied slot; a pinned
slot is never evicted; ``pins`` sum to the running requests with adapters (the scheduler calls
``release`` exactly once per ``acquire`` that returned a slot).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class SlotCounters:
    loads: int = 0  # adapters put into a slot (first use, or again after an eviction)
    evictions: int = 0  # adapters taken out of a slot to make room for another


class AdapterSlots:
    def __init__(self, size: int, put: Callable[[int, int], None]) -> None:
        if size < 1:
            raise ValueError(f"--max-loras must be at least 1, got {size}")
        self.size = size
        self._put = put
        self.held: list[int] = [0] * size  # slot -> uid (0: empty)
        self.pins: list[int] = [0] * size
        self._used: list[int] = [0] * size  # slot -> tick of its last acquire (LRU)
        self._tick = 0
        self.counters = SlotCounters()

    def slot_of(self, uid: int) -> int | None:
        try:
            return self.held.index(uid)
        except ValueError:
            return None

    def acquire(self, uid: int) -> int | None:
        """A pinned slot holding ``uid`` (filled now if it was not resident), or None when every
        slot is pinned by other adapters' running requests."""
        assert uid > 0, "the base model takes no slot"
        self._tick += 1
        slot = self.slot_of(uid)
        if slot is None:
            free = [s for s in range(self.size) if self.pins[s] == 0]
            if not free:
                return None
            empty = [s for s in free if self.held[s] == 0]
            slot = empty[0] if empty else min(free, key=lambda s: self._used[s])
            if self.held[slot]:
                self.counters.evictions += 1
            self._put(slot, uid)
            self.held[slot] = uid
            self.counters.loads += 1
        self.pins[slot] += 1
        self._used[slot] = self._tick
        return slot

    def release(self, slot: int) -> None:
        assert self.pins[slot] > 0, f"release of unpinned LoRA slot {slot}"
        self.pins[slot] -= 1

    def forget(self, uid: int) -> bool:
        """Empty ``uid``'s slot if no running request pins it (the adapter was unloaded); True if
        it is no longer resident. A pinned one stays until its requests finish (call again)."""
        slot = self.slot_of(uid)
        if slot is None:
            return True
        if self.pins[slot]:
            return False
        self.held[slot] = 0
        self._put(slot, 0)
        return True

    def check(self, running_with_adapter: int) -> None:
        assert sum(self.pins) == running_with_adapter, (self.pins, running_with_adapter)
        live = [u for u in self.held if u]
        assert len(live) == len(set(live)), f"an adapter sits in two slots: {self.held}"
        assert all(self.held[s] for s in range(self.size) if self.pins[s]), "a pinned slot is empty"
