"""The quantization grid a weight already lies on, found once per weight.

Owns the search for a weight's grid (``find_grid``: the smallest one, 4 then 8 bits in groups of
``INT4_GROUP`` columns, the checkpoint's values lie on, so that a quantized form loses nothing),
the codes on it (``Grid``: made once, shared by every quantized form of the weight,
``lockgate.layers.forms``) and what a grid loses (``grid_error``, in quantization steps).
Invariants: a weight that lies on a GGUF Q4_0/Q4_1/Q4_K/Q5_0/Q8_0 grid comes back exactly from its
codes (up to float rounding, ``LOSSLESS_TOLERANCE``); ``--quantization auto`` never takes a grid
that loses more than that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lockgate.checkpoint.gguf_blocks import Blocks

INT4_GROUP = 32  # input columns per scale/offset: Q4_0/Q4_1 GGUF blocks are 32 wide
INT4_MODES = ("auto", "none", "int4")
LOSSLESS_TOLERANCE = 1e-3  # auto mode: largest error allowed, in quantization steps (float rounding only)


def grid_error(back: torch.Tensor, source: torch.Tensor, step: torch.Tensor, group: int = INT4_GROUP) -> float:
    """The largest |back - source| over a weight [N, K], in units of its group's quantization step
    ``step`` [N, K/group] (absolute where the step is 0): 0 for a weight already on the grid."""
    n, k = source.shape
    err = (back.float() - source.float()).abs().view(n, k // group, group).amax(-1)  # [N, K/g]
    return float(torch.where(step > 0, err / torch.where(step > 0, step, 1), err).max())


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groupwise asymmetric min/max 4-bit quantization of weight [N, K] (computed in float32).

    Returns codes [N, K] int32 in 0..15, step [N, K/group] and low [N, K/group] float32 with
    ``weight ~= codes * step + low``. A weight that already lies on such a grid comes back
    exactly: a Q4_1 block (its smallest value has code 0 and its largest 15) and a Q4_K sub-block
    (fitted scale and minimum: its codes may not reach both ends, ``native_steps``).
    """
    n, k = weight.shape
    w = weight.float().view(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)  # [N, K/g]
    step = native_steps(w, low, (high - low) / 15, 0, 15)
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = ((w - low[..., None]) * inv[..., None]).round_().clamp_(0, 15).to(torch.int32).view(n, k)
    return codes, step, low


def native_steps(w: torch.Tensor, base: torch.Tensor, step: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The step of each group of ``w`` [N, G, g] on a grid ``base + code * step`` with codes in
    ``lo..hi``: ``step`` [N, G] (from the group's range) where that grid holds the values exactly,
    else the grid the values already lie on when their codes do not reach both ends (a K-quant
    block's fitted scale and minimum, a 5-bit block read on an 8-bit grid): the smallest gap between
    the group's distinct values. Groups on neither keep ``step``; so do all of them when a sample of
    the failing groups shows the weight is not on such a grid (the common case, kept cheap)."""
    flat_w, flat_base = w.reshape(-1, w.shape[-1]), base.reshape(-1)
    steps = step.reshape(-1).clone()

    def exact(rows: torch.Tensor | None, s: torch.Tensor) -> torch.Tensor:
        off = (flat_w - flat_base[:, None]) if rows is None else (flat_w[rows] - flat_base[rows, None])
        inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
        codes = (off * inv[:, None]).round_()
        err = (codes * s[:, None] - off).abs_().amax(-1) * inv
        return (codes.amin(-1) >= lo) & (codes.amax(-1) <= hi) & (err <= LOSSLESS_TOLERANCE)

    def smallest_gap(rows: torch.Tensor) -> torch.Tensor:
        gaps = flat_w[rows].sort(-1).values.diff(dim=-1)
        gap = torch.where(gaps > 0, gaps, torch.full_like(gaps, float("inf"))).amin(-1)
        return torch.where(torch.isfinite(gap), gap, steps[rows])

    failing = (~exact(None, steps)).nonzero().view(-1)
    if len(failing) == 0:
        return step
    sample = failing[:: max(1, len(failing) // 256)]
    if not bool(exact(sample, smallest_gap(sample)).all()):
        return step
    cand = smallest_gap(failing)
    good = exact(failing, cand)
    steps[failing[good]] = cand[good]
    return steps.view(step.shape)

@dataclass(frozen=True)
class Grid:
    """A weight [N, K] on a grid of ``INT4_GROUP`` columns, as ``quantize_int4`` (bits 4: codes
    int32 0..15, uint8 when read from GGUF blocks, ``weight ~= codes * step + low``) or ``quantize_int8`` (bits 8: codes int8
    -127..127, ``weight ~= codes * step``, low None) make it, and what it loses (``error``:
    ``grid_error``, in steps). Made once per weight (``Grid.of``): the quantized forms all take
    their codes from it (a K-quant checkpoint's grid search sorts every group: ~4x the load time
    when each form searched again)."""

    bits: int
    codes: torch.Tensor
    step: torch.Tensor  # float32 [N, K/32] ([N, K/16] from Q6_K blocks and stacks with them: the integer GEMM's alone)
    low: torch.Tensor | None  # float32 [N, K/32] (bits 4; bits 8 from Q5_K blocks or a stack with lows)
    error: float
    # a K-quant's steps (and lows) as the file factors them: (int8 factors [N, K/32 or K/16], float16
    # supers [N, K/256]) with step = super * factor (low = -(super * factor)): exact, a quarter of the bytes
    step_factors: tuple[torch.Tensor, torch.Tensor] | None = None
    low_factors: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def of(source: torch.Tensor, bits: int) -> Grid:
        n, k = source.shape
        shaped = (n, k // INT4_GROUP, INT4_GROUP)
        if bits == 4:
            codes, step, low = quantize_int4(source)
            back = codes.view(shaped).float() * step[..., None] + low[..., None]
            return Grid(4, codes, step, low, grid_error(back.view(n, k), source, step))
        if bits == 8:
            codes8, step8 = quantize_int8(source)
            back8 = codes8.view(shaped).float() * step8[..., None]
            return Grid(8, codes8, step8, None, grid_error(back8.view(n, k), source, step8))
        raise ValueError(f"grids have 4 or 8 bits, not {bits}")

    @staticmethod
    def from_blocks(qm: Blocks) -> Grid:
        """The grid a GGUF matrix's blocks are on, read from the blocks (no float32 weight is made):
        exact by construction (``error`` 0). 4-bit codes come as uint8."""
        codes, step, low = qm.codes()
        factored = qm.factors()

        def pair(arrays: tuple[np.ndarray, np.ndarray] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
            return None if arrays is None else (torch.from_numpy(arrays[0]), torch.from_numpy(arrays[1]))

        return Grid(qm.bits, torch.from_numpy(codes), torch.from_numpy(step),
                    None if low is None else torch.from_numpy(low), 0.0,
                    None if factored is None else pair(factored[0]), None if factored is None else pair(factored[1]))

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def fits(self, source: torch.Tensor, bits: int) -> bool:
        """This grid was made of a weight of ``source``'s shape at ``bits`` bits."""
        return self.bits == bits and tuple(self.codes.shape) == tuple(source.shape)


def quantize_int8(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Groupwise symmetric absmax 8-bit quantization of weight [N, K] (float32): codes [N, K] int8
    in -127..127 and step [N, K/group] with ``weight ~= codes * step``. A GGUF Q8_0 block (its
    largest magnitude has code +-127) comes back exactly, and so do Q4_0 / Q5_0 blocks (``d * (q -
    8)`` / ``d * (q - 16)``: small codes on the same step, ``native_steps``)."""
    n, k = weight.shape
    w = weight.float().view(n, k // group, group)
    step = native_steps(w, torch.zeros(w.shape[:2]), w.abs().amax(-1) / 127, -127, 127)  # [N, K/g]
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = (w * inv[..., None]).round_().clamp_(-127, 127).to(torch.int8).view(n, k)
    return codes, step


def find_grid(source: torch.Tensor, mode: str, kernels: bool) -> Grid | None:
    """The grid a weight's quantized forms use for ``--quantization`` ``mode``: none -> None; int4
    -> 4 bits; auto -> 4 bits when ``source`` already lies on a 4-bit grid of 32 columns, else 8 on
    an 8-bit one (lockgate's kernels only: torch has no such form), else None."""
    if mode not in INT4_MODES:
        raise ValueError(f"quantization mode {mode!r} is not one of {INT4_MODES}")
    if mode == "none" or source.shape[1] % INT4_GROUP:
        return None
    if mode == "int4":
        return Grid.of(source, 4)
    for bits in (4, 8) if kernels else (4,):
        if _lossless_on_sample(source, bits):
            grid = Grid.of(source, bits)
            if grid.error <= LOSSLESS_TOLERANCE:
                return grid
    return None


GRID_SAMPLE_ROWS = 256  # rows a weight's grid is first tried on (auto): most weights fail there, fast


def _lossless_on_sample(source: torch.Tensor, bits: int) -> bool:
    """Whether ``GRID_SAMPLE_ROWS`` rows spread over ``source`` lie on its ``bits``-bit grid: a
    necessary condition (a group's grid is found from the group alone), so a weight failing here is
    not searched whole (a 262,144-row embedding off the 4-bit grid: 3.2 s saved)."""
    n = source.shape[0]
    if n < 2 * GRID_SAMPLE_ROWS:  # a sample would be most of the weight: search it whole once
        return True
    return Grid.of(source[:: n // GRID_SAMPLE_ROWS], bits).error <= LOSSLESS_TOLERANCE
