"""LoRA adapters at run time: the resident slots and each step's per-row update of the projections.

Owns three things:

* ``LoraUpdate``: one adapter's update of one fused projection (qkv, o, gate_up, down) in the
  form the step needs: ``a`` [K, R] (the LoRA A matrices of the projection's parts side by side,
  transposed), ``b`` [R, N] (the B matrices with the adapter's scaling folded in, zero outside
  each rank row's output columns) and ``spans`` [R, 2] int32 (those columns). A projection fused
  from parts (q, k, v) gets its parts' ranks side by side: rank rows of q touch only q's columns.
* ``LoraSlots``: ``max_loras`` slots, each empty or holding one adapter's updates for every layer
  (``put`` / ``clear``). Which adapter sits in which slot is the scheduler's decision (the plan
  says it); this only holds the weights.
* ``LoraStep``: one step's row -> slot map (``row_slot`` [T], -1 for the base model) and
  ``add(y, x, layer, role)``, which adds every row's update to a projection's output ``y`` in
  place: on lockgate's kernel (``lockgate::lora_add_``: rows of all adapters in one call, grouped
  by adapter, the SGMV idea on a CPU; measured faster than float32 matmuls per adapter from 32 to
  512 rows of one adapter, as it skips the zero blocks of a fused projection's B) or, without the
  kernels, one pair of matmuls per adapter in the step.

Invariants: a row's update depends only on that row and its adapter (the kernel sums each row in
a fixed order whatever the other rows: batch-invariant, as ``--deterministic`` needs); rows with
slot -1 are never touched, so a step of
base-model rows only computes exactly what it would without adapters; weights are in the run
dtype (float32 or bf16 sums in float32 on the kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

LORA_ROLES = ("qkv", "o", "gate_up", "down")
RANK_BLOCK = 16  # an update's rank rows come in blocks of this many (zero-padded): the kernel's vector width
_EMPTY = torch.empty(0)
_EMPTY_SPANS = torch.empty(0, dtype=torch.int32)


@dataclass(frozen=True)
class LoraUpdate:
    a: torch.Tensor  # [K, R] run dtype; R a multiple of RANK_BLOCK
    b: torch.Tensor  # [R, N] run dtype, scaling folded in
    spans: torch.Tensor  # int32 [R, 2]: rank row r adds to output columns spans[r, 0] .. spans[r, 1]

    @staticmethod
    def padded(a: torch.Tensor, b: torch.Tensor, spans: torch.Tensor, dtype: torch.dtype) -> LoraUpdate:
        """a [K, R], b [R, N], spans [R, 2] of any rank R -> rank rows padded with zeros (and empty
        spans) to a multiple of RANK_BLOCK, in ``dtype``."""
        r = int(a.shape[1])
        pad = -r % RANK_BLOCK
        if pad:
            a = torch.cat([a, a.new_zeros(a.shape[0], pad)], dim=1)
            b = torch.cat([b, b.new_zeros(pad, b.shape[1])], dim=0)
            spans = torch.cat([spans, spans.new_zeros(pad, 2)], dim=0)
        return LoraUpdate(a.to(dtype).contiguous(), b.to(dtype).contiguous(), spans.to(torch.int32).contiguous())

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> the update [M, N] (plain torch; the reference and the no-kernel path)."""
        return (x @ self.a) @ self.b


@dataclass
class AdapterWeights:
    """One adapter's updates, per layer and role (a role the adapter does not touch is absent)."""

    layers: list[dict[str, LoraUpdate]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for u in layer.values()
                   for t in (u.a, u.b))


class LoraSlots:
    """``size`` slots of resident adapter weights for a model of ``num_layers`` layers."""

    def __init__(self, size: int, num_layers: int) -> None:
        if size < 1:
            raise ValueError(f"max_loras must be at least 1, got {size}")
        self.size = size
        self.num_layers = num_layers
        # per layer, per role: the kernel's three lists, one entry per slot (empty tensors = empty slot)
        self._a = [{r: [_EMPTY] * size for r in LORA_ROLES} for _ in range(num_layers)]
        self._b = [{r: [_EMPTY] * size for r in LORA_ROLES} for _ in range(num_layers)]
        self._spans = [{r: [_EMPTY_SPANS] * size for r in LORA_ROLES} for _ in range(num_layers)]
        self._held: list[object | None] = [None] * size  # what each slot holds (the caller's key)

    def holds(self, slot: int) -> object | None:
        return self._held[slot]

    def put(self, slot: int, key: object, weights: AdapterWeights) -> None:
        """Fill ``slot`` with ``weights`` (replacing what it held)."""
        if len(weights.layers) != self.num_layers:
            raise ValueError(f"adapter has {len(weights.layers)} layers, the model {self.num_layers}")
        self.clear(slot)
        for i, layer in enumerate(weights.layers):
            for role, u in layer.items():
                self._a[i][role][slot] = u.a
                self._b[i][role][slot] = u.b
                self._spans[i][role][slot] = u.spans
        self._held[slot] = key

    def clear(self, slot: int) -> None:
        for i in range(self.num_layers):
            for role in LORA_ROLES:
                self._a[i][role][slot] = _EMPTY
                self._b[i][role][slot] = _EMPTY
                self._spans[i][role][slot] = _EMPTY_SPANS
        self._held[slot] = None

    def update(self, layer: int, role: str, slot: int) -> LoraUpdate | None:
        a = self._a[layer][role][slot]
        if a.numel() == 0:
            return None
        return LoraUpdate(a, self._b[layer][role][slot], self._spans[layer][role][slot])

    def lists(self, layer: int, role: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        return self._a[layer][role], self._b[layer][role], self._spans[layer][role]


class LoraStep:
    """One step's adapters: ``row_slot`` [T] int64 (-1: base model) over ``slots``."""

    def __init__(self, slots: LoraSlots, row_slot: np.ndarray, kernel: bool) -> None:
        self.slots = slots
        ks = np.ascontiguousarray(row_slot, dtype=np.int64)
        self.row_slot = torch.from_numpy(ks)
        self.kernel = kernel
        self._groups: list[tuple[int, torch.Tensor]] | None = None  # (slot, rows) for the torch path
        # the kernel's rows grouped by slot: rows [M], group offsets [G + 1], group slots [G]
        mine = np.flatnonzero(ks >= 0)
        order = mine[np.argsort(ks[mine], kind="stable")]
        slots_in, counts = np.unique(ks[order], return_counts=True)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        self._kernel_groups = (torch.from_numpy(order.astype(np.int64)), torch.from_numpy(offsets),
                               torch.from_numpy(slots_in.astype(np.int64)))
        self._any_kernel_row = bool(mine.size)

    @staticmethod
    def expand(seq_slots: np.ndarray, query_lens: np.ndarray) -> np.ndarray:
        """Per-sequence slots [B] -> per-row slots [T] (each sequence's rows are contiguous)."""
        return np.repeat(np.asarray(seq_slots, dtype=np.int64), np.asarray(query_lens, dtype=np.int64))

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, role: str) -> torch.Tensor:
        """y [T, N] += each row's update of projection ``role`` in ``layer`` for x [T, K]; returns y."""
        if self.kernel and y.dtype in (torch.float32, torch.bfloat16) and y.stride(-1) == 1 and x.stride(-1) == 1:
            if self._any_kernel_row:
                a, b, spans = self.slots.lists(layer, role)
                rows, offsets, slots = self._kernel_groups
                torch.ops.lockgate.lora_add_(y, x, rows, offsets, slots, a, b, spans)
            return y
        for slot, rows in self._slot_groups():
            u = self.slots.update(layer, role, slot)
            if u is not None:
                y.index_add_(0, rows, u.delta(x.index_select(0, rows)).to(y.dtype))
        return y

    def _slot_groups(self) -> list[tuple[int, torch.Tensor]]:
        if self._groups is None:
            rs = self.row_slot.numpy()
            self._groups = [(int(s), torch.from_numpy(np.flatnonzero(rs == s))) for s in np.unique(rs) if s >= 0]
        return self._groups
