"""A GGUF matrix kept in its quantized blocks: ``QuantMatrix``, and the blocks read as integer codes.

Owns the byte layout of the block types lockgate's integer kernels take as they are
(``DIRECT_TYPES``) and turning their blocks into codes and per-32-column scales without going
through float32 weights:

* Q4_0 (18 bytes per 32 values): ``d`` (float16), 16 bytes of nibbles (value j in the low nibble of
  byte j, value j + 16 in the high one): ``w = (q - 8) * d`` -> 4-bit codes ``q``, step ``d``,
  low ``-8 d``;
* Q4_1 (20 bytes): ``d``, ``m`` (float16), the same nibbles: ``w = q * d + m``;
* Q8_0 (34 bytes): ``d``, 32 int8: ``w = q * d`` -> 8-bit codes, step ``d``;
* Q5_0 (22 bytes): ``d``, 4 bytes of fifth bits (bit j of value j), the nibbles: ``w = (q - 16) * d``
  -> 8-bit codes ``q - 16`` (in -16..15), step ``d``.

Every step and low is a float16 value or 8 times one, so it is exact in float16 and float32: the
codes and steps give back exactly the values ``gguf.quants.dequantize`` gives. Other types (the
K-quants, Q5_1, F16, ...) are read as float32 (``dense``).

``QuantMatrix`` holds an [N, K] matrix's rows of blocks (uint8 [N, K / 32 * block bytes], a view of
the file's memory map until ``rows`` or ``vstack`` copy), row-selectable and stackable so that a
loader can undo llama.cpp's row permutation of q/k and fuse q, k, v (or gate, up) into one matrix
without touching a weight's value.

Torch-free (numpy only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22}
DIRECT_TYPES = tuple(BLOCK_BYTES)
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q5_0": 8}  # the grid the codes are given on


@dataclass(frozen=True)
class QuantMatrix:
    """A [N, K] matrix as GGUF blocks: ``raw`` uint8 [N, K / 32 * block bytes] of type ``qtype``."""

    qtype: str
    shape: tuple[int, int]
    raw: np.ndarray

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"{self.qtype} blocks are not read directly (direct: {', '.join(DIRECT_TYPES)})")
        if k % GROUP or self.raw.shape != (n, k // GROUP * BLOCK_BYTES[self.qtype]) or self.raw.dtype != np.uint8:
            raise ValueError(f"{self.qtype} blocks of a [{n}, {k}] matrix must be uint8 "
                             f"[{n}, {k // GROUP * BLOCK_BYTES[self.qtype]}], got {self.raw.dtype} {list(self.raw.shape)}")

    @property
    def bits(self) -> int:
        return BITS[self.qtype]

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def rows(self, index: np.ndarray) -> QuantMatrix:
        """The rows ``index`` (in that order), copied out of the file's map."""
        return QuantMatrix(self.qtype, (len(index), self.shape[1]), np.ascontiguousarray(self.raw[index]))

    @staticmethod
    def vstack(parts: list[QuantMatrix]) -> QuantMatrix:
        """Matrices of one type and width, one under the other (fused projections)."""
        kinds = {(p.qtype, p.shape[1]) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack blocks of different types or widths: {sorted(kinds)}")
        return QuantMatrix(parts[0].qtype, (sum(p.shape[0] for p in parts), parts[0].shape[1]),
                           np.concatenate([p.raw for p in parts]))

    def codes(self, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Rows [lo, hi) as (codes [n, K]: uint8 0..15 for 4 bits, int8 for 8; step float32
        [n, K / 32]; low float32 [n, K / 32] for 4 bits, else None) with ``w = codes * step + low``."""
        hi = self.shape[0] if hi is None else hi
        n, k = hi - lo, self.shape[1]
        b = self.raw[lo:hi].reshape(n, k // GROUP, BLOCK_BYTES[self.qtype])
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [n, G]
        if self.qtype == "Q8_0":
            return b[..., 2:34].copy().view(np.int8).reshape(n, k), d, None
        if self.qtype == "Q4_1":
            m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            return _nibbles(b[..., 4:20]).reshape(n, k), d, m
        if self.qtype == "Q4_0":
            return _nibbles(b[..., 2:18]).reshape(n, k), d, -8.0 * d
        high = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")  # [n, G, 32]: bit j of value j
        q = (_nibbles(b[..., 6:22]) | (high << 4)).astype(np.int16) - 16  # Q5_0
        return q.astype(np.int8).reshape(n, k), d, None

    def dequantize(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows [lo, hi) as float32 (the values ``gguf.quants.dequantize`` gives)."""
        codes, step, low = self.codes(lo, hi)
        n = codes.shape[0]
        w = codes.reshape(n, -1, GROUP).astype(np.float32) * step[..., None]
        if low is not None:
            w += low[..., None]
        return w.reshape(n, -1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] uint8 codes: the low nibbles (values 0-15), then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
