"""TokenAttention slot allocator: which KV-pool slots are free.

The engine reserves KV storage for ``capacity`` tokens up front. One *slot* is one
token's K and V in every layer; the tensors live in the model runner, this module only
hands out and takes back slot indices (int64 numpy arrays). A request owns a list of
slots, not pages, so no memory is lost to half-full blocks.

State: a boolean ``free`` mask of length ``capacity`` plus a cached ``num_free`` count,
and a next-fit cursor that only serves as a hint.

Invariants (``check_invariants`` verifies them):

* ``num_free + num_used == capacity`` and ``num_free == count_nonzero(mask)``;
* every slot is either free or held by exactly one holder. The allocator does not know
  the holders (requests, the prefix cache); it only guarantees that ``alloc`` never
  returns a slot that is not free and ``free`` rejects a slot that is free already, so a
  slot can never be handed out twice.

Allocation policy for ``alloc(n)``, in this order:

1. *Next-fit*: if the ``n`` slots starting at the cursor are all free, take them. This is
   an O(n) check and the common case while the pool is filled front to back (one decode
   slot per request per step, prompts in order).
2. *Best-fit contiguous run*: find the runs of free slots (one ``diff`` over the mask) and
   take the start of the shortest run of length ``>= n`` (lowest start on ties). Best fit
   keeps long runs intact for long prompts, whose gathers benefit most from locality.
3. *Scattered*: the ``n`` lowest-indexed free slots.

Steps 2 and 3 are O(capacity) numpy passes (tens of microseconds for 100k slots); no
step loops in Python per slot. ``free`` is O(n) in the slots freed, including its checks
for out-of-range, already-free and duplicate slots; it changes nothing when it raises.

Callers: the scheduler (slots for prompts and decode tokens, returning them when a
request leaves) and the prefix cache (evicting unreferenced nodes).
"""

from __future__ import annotations

import operator

import numpy as np

I64 = np.int64


class OutOfSlots(RuntimeError):
    """Raised when more slots are requested than are free."""


class SlotAllocator:
    """Free-slot bookkeeping for a KV pool of ``capacity`` token slots."""

    def __init__(self, capacity: int) -> None:
        capacity = operator.index(capacity)
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity: int = capacity
        self._free = np.ones(capacity, dtype=np.bool_)
        self._num_free = capacity
        self._cursor = 0  # next-fit hint, 0 <= cursor <= capacity
        # Scratch for the O(n) duplicate check in free(); contents are never trusted.
        self._stamp = np.zeros(capacity, dtype=I64)

    # -- counts -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.capacity - self._num_free

    # -- alloc / free -----------------------------------------------------------------

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` free slots; returns them as int64 ``[n]``.

        Raises ``OutOfSlots`` (and changes nothing) when ``n > num_free``.
        """
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n == 0:
            return np.zeros(0, dtype=I64)
        if n > self._num_free:
            raise OutOfSlots(f"requested {n} slots but only {self._num_free} are free "
                             f"(capacity {self.capacity})")
        start = self._find_run(n)
        if start is not None:
            slots = np.arange(start, start + n, dtype=I64)
            self._cursor = start + n
        else:
            slots = np.flatnonzero(self._free)[:n].astype(I64, copy=False)
            self._cursor = int(slots[-1]) + 1
        self._free[slots] = False
        self._num_free -= n
        return slots

    def free(self, slots: np.ndarray) -> None:
        """Return ``slots`` to the pool.

        Raises ``ValueError`` (and changes nothing) if any slot is out of range, already
        free, or listed twice.
        """
        slots = self._as_slots(slots)
        n = slots.size
        if n == 0:
            return
        if not self._free[slots].any():
            # Duplicate check in O(n): write each position into its slot's stamp; a slot
            # listed twice keeps only one of the positions.
            order = np.arange(n, dtype=I64)
            self._stamp[slots] = order
            if not np.array_equal(self._stamp[slots], order):
                dup = slots[self._stamp[slots] != order][0]
                raise ValueError(f"slot {int(dup)} is listed more than once in free()")
        else:
            bad = slots[self._free[slots]][0]
            raise ValueError(f"double free: slot {int(bad)} is already free")
        self._free[slots] = True
        self._num_free += n

    def is_free(self, slots: np.ndarray) -> np.ndarray:
        """Boolean array: which of ``slots`` are currently free (mainly for tests)."""
        return self._free[self._as_slots(slots)].copy()

    # -- checks -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the internal state is inconsistent."""
        if self._free.shape != (self.capacity,) or self._free.dtype != np.bool_:
            raise AssertionError(f"free mask has shape {self._free.shape} / dtype "
                                 f"{self._free.dtype}, expected ({self.capacity},) bool")
        counted = int(np.count_nonzero(self._free))
        if counted != self._num_free:
            raise AssertionError(f"cached num_free {self._num_free} != {counted} free slots in the mask")
        if not 0 <= self._num_free <= self.capacity:
            raise AssertionError(f"num_free {self._num_free} outside [0, {self.capacity}]")
        if self.num_free + self.num_used != self.capacity:
            raise AssertionError("num_free + num_used != capacity")
        if not 0 <= self._cursor <= self.capacity:
            raise AssertionError(f"cursor {self._cursor} outside [0, {self.capacity}]")

    # -- internals --------------------------------------------------------------------

    def _find_run(self, n: int) -> int | None:
        """Start of a free run of length ``>= n`` (next-fit, then best-fit), or None."""
        c = self._cursor
        if c + n <= self.capacity and self._free[c:c + n].all():
            return c
        padded = np.zeros(self.capacity + 2, dtype=np.int8)
        padded[1:-1] = self._free
        edges = np.diff(padded)
        starts = np.flatnonzero(edges == 1)
        lengths = np.flatnonzero(edges == -1) - starts
        fit = np.flatnonzero(lengths >= n)
        if fit.size == 0:
            return None
        best = fit[np.argmin(lengths[fit])]  # argmin takes the first (lowest start) on ties
        return int(starts[best])

    def _as_slots(self, slots: np.ndarray) -> np.ndarray:
        arr = np.asarray(slots)
        if arr.size == 0:
            return np.zeros(0, dtype=I64)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"slots must be integers, got dtype {arr.dtype}")
        arr = arr.reshape(-1).astype(I64, copy=False)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.capacity:
            bad = lo if lo < 0 else hi
            raise ValueError(f"slot {bad} out of range [0, {self.capacity})")
        return arr
