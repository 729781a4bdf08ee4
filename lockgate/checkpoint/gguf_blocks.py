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
  -> 8-bit codes ``q - 16`` (in -16..15), step ``d``;
* Q4_K (144 bytes per 256 values): ``d``, ``dmin`` (float16), 12 bytes of eight 6-bit scales ``sc``
  and mins ``m`` (one per 32 values), 128 bytes of nibbles (32-byte chunk c: value i of sub-block
  2c in the low nibble of byte i, of sub-block 2c + 1 in the high one): ``w = q * (d sc) - dmin m``
  -> 4-bit codes, step ``d sc``, low ``-(dmin m)``;
* Q5_K (176 bytes per 256): as Q4_K with 32 bytes of fifth bits before the nibbles (bit j of byte
  i: value i of sub-block j) -> 8-bit codes ``q`` (0..31), step ``d sc``, low ``-(dmin m)``;
* Q6_K (210 bytes per 256): 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 scales
  ``sc`` (one per 16 values), ``d`` (float16): ``w = (q - 32) * (d sc)`` -> 8-bit codes ``q - 32``
  (in -32..31) with a step per 16 values (``STEP_VALUES``), no low.

The legacy types' steps and lows are float16 values or 8 times one, so they are exact in float16
(``STEPS_FLOAT16``); a K-quant's are products of a float16 super-scale and a 6- or 8-bit integer,
exact in float32 only, and kept factored as the file has them (``factors``). Either way the codes and steps give back exactly the values ``gguf.quants.dequantize``
gives (``q * step + low`` rounds as its ``d * q - dm`` does). Other types (Q5_1, Q2_K, Q3_K, F16,
...) are read as float32 (``dense``).

``QuantMatrix`` holds an [N, K] matrix's rows of blocks (uint8 [N, K / 32 * block bytes], a view of
the file's memory map until ``rows`` or ``vstack`` copy), row-selectable and stackable so that a
loader can undo llama.cpp's row permutation of q/k and fuse q, k, v (or gate, up) into one matrix
without touching a weight's value. Parts of different types (a Q4_K_M file's Q6_K v under Q4_K q
and k) stack as a ``QuantStack``: one matrix on a common 8-bit grid, still exact (``stack``).

Torch-free (numpy only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32  # values per step
BLOCK_VALUES = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q5_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
DIRECT_TYPES = tuple(BLOCK_BYTES)
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q5_0": 8, "Q4_K": 4, "Q5_K": 8, "Q6_K": 8}  # the grid the codes are on
STEP_VALUES = {"Q6_K": 16}  # values per step where not GROUP
LOWS = {"Q4_0", "Q4_1", "Q4_K", "Q5_K"}  # types whose values have a low (an offset) per step
STEPS_FLOAT16 = {"Q4_0", "Q4_1", "Q8_0", "Q5_0"}  # steps and lows exact in float16 (else float32)


def resident_bytes(qtype: str, n: int, k: int) -> int:
    """Bytes of an [n, k] matrix of a direct type held as codes (4 or 8 bits) with a step (and a
    low) per 32 values (``layers.forms``' layout): in float16 for the legacy types, as int8 factors
    with a float16 super-scale per 256 values for the K-quants (as they store them)."""
    steps = n * (k // STEP_VALUES.get(qtype, GROUP))
    tables = 2 if qtype in LOWS else 1
    if qtype in STEPS_FLOAT16:
        return n * k * BITS[qtype] // 8 + steps * 2 * tables
    return n * k * BITS[qtype] // 8 + (steps + n * (k // 256) * 2) * tables


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
        per, size = BLOCK_VALUES[self.qtype], BLOCK_BYTES[self.qtype]
        if k % per or self.raw.shape != (n, k // per * size) or self.raw.dtype != np.uint8:
            raise ValueError(f"{self.qtype} blocks of a [{n}, {k}] matrix must be uint8 "
                             f"[{n}, {k // per * size}], got {self.raw.dtype} {list(self.raw.shape)}")

    @property
    def bits(self) -> int:
        return BITS[self.qtype]

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def rows(self, index: np.ndarray) -> QuantMatrix:
        """The rows ``index`` (in that order), copied out of the file's map."""
        return QuantMatrix(self.qtype, (len(index), self.shape[1]), np.ascontiguousarray(self.raw[index]))

    def columns(self, lo: int, hi: int) -> QuantMatrix:
        """Columns [lo, hi), whole blocks only (ValueError naming the block size otherwise), copied."""
        per, size = BLOCK_VALUES[self.qtype], BLOCK_BYTES[self.qtype]
        if lo % per or hi % per or not 0 <= lo < hi <= self.shape[1]:
            raise ValueError(f"{self.qtype} blocks hold {per} columns each: columns [{lo}, {hi}) of a "
                             f"{list(self.shape)} matrix do not start and end on a block")
        return QuantMatrix(self.qtype, (self.shape[0], hi - lo),
                           np.ascontiguousarray(self.raw[:, lo // per * size:hi // per * size]))

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
        [n, K / 32] (Q6_K: [n, K / 16]); low float32 the same for the types in ``LOWS``, else None)
        with ``w = codes * step + low``."""
        hi = self.shape[0] if hi is None else hi
        n, k = hi - lo, self.shape[1]
        if self.qtype in ("Q4_K", "Q5_K"):
            return _k_quant_codes(self.qtype, self.raw[lo:hi].reshape(n, k // 256, BLOCK_BYTES[self.qtype]))
        if self.qtype == "Q6_K":
            return _q6_k_codes(self.raw[lo:hi].reshape(n, k // 256, BLOCK_BYTES[self.qtype]))
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

    def factors(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None] | None:
        """A K-quant's steps and lows as the file factors them: ((int8 factors [n, K / 32] (Q6_K:
        [n, K / 16]), float16 supers [n, K / 256]) for the steps, the same for the lows or None),
        with ``step = super * factor`` and ``low = -(super * factor)`` (exact in float32, as
        ``codes`` gives them); None for the other types."""
        n, k = self.shape
        if self.qtype not in ("Q4_K", "Q5_K", "Q6_K"):
            return None
        b = self.raw.reshape(n, k // 256, BLOCK_BYTES[self.qtype])
        if self.qtype == "Q6_K":
            sc = b[..., 192:208].copy().view(np.int8).reshape(n, k // 16)
            return (sc, b[..., 208:210].copy().view(np.float16).reshape(n, k // 256)), None
        sc, m = _scales_mins(b[..., 4:16])
        d = b[..., 0:2].copy().view(np.float16).reshape(n, k // 256)
        dmin = b[..., 2:4].copy().view(np.float16).reshape(n, k // 256)
        return ((sc.astype(np.int8).reshape(n, k // 32), d), (m.astype(np.int8).reshape(n, k // 32), dmin))

    def dequantize(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows [lo, hi) as float32 (the values ``gguf.quants.dequantize`` gives)."""
        codes, step, low = self.codes(lo, hi)
        n = codes.shape[0]
        out = np.empty(codes.shape, np.float32)
        per_step = out.reshape(n, step.shape[1], -1)  # two passes over the output, no temporaries
        np.multiply(codes.reshape(per_step.shape), step[..., None], out=per_step, dtype=np.float32)
        if low is not None:
            np.add(per_step, low[..., None], out=per_step)
        return out


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # steps (and lows) factored as int8 x float16 per 256 values


def stacked_resident_bytes(parts: list[tuple[str, int, int]]) -> int:
    """Bytes of matrices (type, n, k) held one under the other: ``resident_bytes`` for one type,
    else ``QuantStack``'s common form (a byte per weight, its steps per 16 or 32 and lows per 32)."""
    types = {q for q, _, _ in parts}
    if len(types) == 1:
        return sum(resident_bytes(q, n, k) for q, n, k in parts)
    n, k = sum(p[1] for p in parts), parts[0][2]
    per = min(STEP_VALUES.get(q, GROUP) for q in types)
    lows = 1 if types & LOWS else 0
    if types <= set(K_QUANTS):
        return n * k + (n * (k // per) + n * (k // 256) * 2) * (1 + lows)
    return n * k + n * (k // per) * 2 * (1 + lows)


@dataclass(frozen=True)
class QuantStack:
    """Matrices of different direct types and one width, one under the other: a fused projection
    whose parts the file quantized differently (a Q4_K_M file's Q4_K q and k over a Q6_K v), read
    as one matrix on a common grid, each value as its own blocks give it:

    * codes on the 8-bit grid (int8: a 4-bit part's 0..15 fit);
    * a step per 16 columns where a part has one (Q6_K; the other parts' per-32 steps repeated),
      else per 32; lows per 32 columns (0 for a part without), or None when no part has them;
    * all parts K-quants (steps factored, ``factors``) or all legacy types (float16 steps): a mix
      of the two has no common exact table and is refused (ValueError: the caller reads it dense).
    """

    parts: tuple[QuantMatrix, ...]

    def __post_init__(self) -> None:
        widths = {p.shape[1] for p in self.parts}
        types = {p.qtype for p in self.parts}
        if len(self.parts) < 2 or len(widths) != 1:
            raise ValueError(f"a stack needs two or more matrices of one width, got widths {sorted(widths)}")
        if not (types <= set(K_QUANTS) or not types & set(K_QUANTS)):
            raise ValueError(f"cannot stack K-quant and legacy blocks exactly: {sorted(types)}")

    @property
    def qtype(self) -> str:
        return "+".join(p.qtype for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def bits(self) -> int:
        return 8

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def _per(self) -> int:
        """Values per step: 16 when a part has steps per 16, else 32."""
        return min(STEP_VALUES.get(p.qtype, GROUP) for p in self.parts)

    @property
    def _lows(self) -> bool:
        return any(p.qtype in LOWS for p in self.parts)

    def codes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(codes [N, K] int8, step float32 [N, K / 16 or K / 32], low float32 [N, K / 32] or None)
        with ``w = codes * step + low``, each at its own granularity."""
        k, per = self.shape[1], self._per
        codes, steps, lows = [], [], []
        for p in self.parts:
            c, st, lo = p.codes()
            n = p.shape[0]
            codes.append(c.astype(np.int8))
            steps.append(np.repeat(st, (k // per) // st.shape[1], axis=1))
            lows.append(lo if lo is not None else np.zeros((n, k // GROUP), np.float32))
        return np.concatenate(codes), np.concatenate(steps), np.concatenate(lows) if self._lows else None

    def factors(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None] | None:
        """As ``QuantMatrix.factors`` over the stack (K-quant parts; None for legacy ones): step
        factors [N, K / 16 or K / 32] (a part's per-32 factors repeated), low factors [N, K / 32]
        (0, with super 0, for a part without lows)."""
        if self.parts[0].qtype not in K_QUANTS:
            return None
        k, per = self.shape[1], self._per
        sf, sd, lf, ld = [], [], [], []
        for p in self.parts:
            got = p.factors()
            assert got is not None
            (f, d), low = got
            n = p.shape[0]
            sf.append(np.repeat(f, (k // per) // f.shape[1], axis=1))
            sd.append(d)
            lf.append(low[0] if low is not None else np.zeros((n, k // GROUP), np.int8))
            ld.append(low[1] if low is not None else np.zeros((n, k // 256), np.float16))
        steps = (np.concatenate(sf), np.concatenate(sd))
        return steps, ((np.concatenate(lf), np.concatenate(ld)) if self._lows else None)

    def dequantize(self) -> np.ndarray:
        """The stack as float32 (each part's values as ``gguf.quants.dequantize`` gives them)."""
        return np.concatenate([p.dequantize() for p in self.parts])


Blocks = QuantMatrix | QuantStack  # a matrix held in a GGUF's blocks, of one type or stacked


def select_rows(m: Blocks, index: np.ndarray) -> Blocks:
    """Rows ``index`` (ascending) of a matrix in blocks, each row as its own part's blocks give it."""
    if isinstance(m, QuantMatrix):
        return m.rows(index)
    parts, start = [], 0
    for p in m.parts:
        own = index[(index >= start) & (index < start + p.shape[0])] - start
        if own.size:
            parts.append(p.rows(own))
        start += p.shape[0]
    return stack(parts)


def select_columns(m: Blocks, lo: int, hi: int) -> Blocks:
    """Columns [lo, hi) of a matrix in blocks (whole blocks of every part)."""
    if isinstance(m, QuantMatrix):
        return m.columns(lo, hi)
    return QuantStack(tuple(p.columns(lo, hi) for p in m.parts))


def block_columns(m: Blocks) -> int:
    """How many columns one block of ``m`` holds (the largest of its parts')."""
    return max(BLOCK_VALUES[p.qtype] for p in (m.parts if isinstance(m, QuantStack) else (m,)))


def stack(parts: list[QuantMatrix]) -> Blocks:
    """Matrices one under the other: one ``QuantMatrix`` when they share a type, else a ``QuantStack``."""
    if len({p.qtype for p in parts}) == 1:
        return parts[0] if len(parts) == 1 else QuantMatrix.vstack(parts)
    return QuantStack(tuple(parts))


def _k_quant_codes(qtype: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks b [n, B, bytes] as (codes [n, B * 256], step, low [n, B * 8])."""
    n, nb, _ = b.shape
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [n, B]
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc, m = _scales_mins(b[..., 4:16])  # [n, B, 8] each
    step = d[..., None] * sc.astype(np.float32)
    low = -(dmin[..., None] * m.astype(np.float32))
    qs = b[..., -128:].reshape(n, nb, 4, 1, 32)  # chunk c: sub-blocks 2c (low nibbles), 2c + 1 (high)
    q = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F).reshape(n, nb, 8, 32)
    if qtype == "Q4_K":
        return q.reshape(n, nb * 256), step.reshape(n, nb * 8), low.reshape(n, nb * 8)
    qh = b[..., 16:48].reshape(n, nb, 1, 32)  # bit j of byte i: value i of sub-block j
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    codes = (q | (high << 4)).astype(np.int8)
    return codes.reshape(n, nb * 256), step.reshape(n, nb * 8), low.reshape(n, nb * 8)


def _q6_k_codes(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Q6_K super-blocks b [n, B, 210] as (codes [n, B * 256] int8, step [n, B * 16], None)."""
    n, nb, _ = b.shape
    ql, qh = b[..., 0:128].reshape(n, nb, 2, 1, 64), b[..., 128:192].reshape(n, nb, 2, 1, 32)
    low = ((ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F).reshape(n, nb, 8, 32)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03).reshape(n, nb, 8, 32)
    codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [n, B, 16]
    d = b[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    return codes.reshape(n, nb * 256), (d[..., None] * sc).reshape(n, nb * 16), None


def _scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of K-quant super-blocks (12 bytes each, llama.cpp's packing:
    bytes 0-3 hold scales 0-3 and the top bits of scales 4-7, 4-7 the mins likewise, 8-11 the low
    nibbles of scales and mins 4-7)."""
    a, mm, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (hi & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    m = np.concatenate([mm & 0x3F, (hi >> 4) | ((mm >> 2) & 0x30)], axis=-1)
    return sc, m


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] uint8 codes: the low nibbles (values 0-15), then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
