"""The forms a projection's weight can be multiplied in, one class each, and which ones a weight gets.

Owns the weight layouts of every matmul kernel lockgate has and the rule that decides which of
them a projection may use (``make_forms``); ``lockgate.layers.linear`` picks among a projection's
forms per call, by a measured table (``lockgate.runner.tuning``). Every form is a callable
``form(x [M, K], bias [N] | None) -> [M, N]`` in x's dtype with a ``name``; the quantized ones also
give ``decode_layers_args`` (their tensors for ``lockgate::decode_layers_``) and ``dequantize``.

* ``dense`` (``DenseWeight``): the run-dtype weight. bf16 on a CPU whose oneDNN has bf16 kernels
  is reordered once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``, what
  inductor uses for frozen CPU graphs) and run by ``mkldnn._linear_pointwise`` (``F.linear``
  re-packs the weight on every call; the packed form measured 1.6-2x faster at 1 row, equal from
  256 rows); everything else runs ``F.linear`` (MKL's sgemm for float32).
* ``bf16-gemm`` (``Bf16GemmWeight``, bf16 runs on a CPU with AVX512-BF16): the same bf16 weight
  packed for ``lockgate::bf16_linear`` (VDPBF16PS, float32 sums, one rounding): without AMX it
  measured 1.2-1.7x oneDNN's bf16 matmul at 8-64 rows, 1.1-1.2x at 128-256, 1.03-1.07x at
  1,024-2,048 (Zen 5 class, docs/performance.md); row-invariant by construction.
* ``f32-dot`` (``F32DotWeight``, float32 runs on a CPU with AVX2 + FMA): the dense float32 weight
  itself (no copy) on ``lockgate::f32_linear``, one fixed-order dot product per output, so
  row-invariant at every row count. MKL's sgemm is not below 16 rows, so an exact-prefill float32
  run pads small calls to 16 rows on it; this form runs a one-row decode call as one row (5-8x
  less time than the padded call at the default model's shapes, Zen 3 class CPU). sgemm is
  faster at 512 rows: the tuning table picks per row count.
* ``fp32`` (``Fp32Weight``, 16-bit runs only): a float32 copy made from the checkpoint's
  unrounded values, for CPUs whose bf16 matmul is slower than sgemm (AVX512-BF16 without AMX,
  measured 1.15-1.5x at 64-1,024 rows); activations cast up and the result back. +4 bytes per
  parameter, so only while the copies fit ``COPIES_MEMORY_SHARE`` of memory (``make_forms``).
* ``torch-int4`` (``Int4Weight``): 4-bit codes in groups of 32 with a scale and an offset, on
  torch's ``_weight_int4pack_mm_for_cpu`` with 16-bit activations (a float32 run rounds x to bf16
  for the call: the kernel's float32 path is 25-30x slower).
* ``group-quant`` (``GroupQuantWeight``): GGUF's Q4_1 / Q8_0 blocks as they are, on
  ``lockgate::quant_linear`` (float32 math, exact products); the only 8-bit form besides
  ``int-gemm`` (torch has int8 only per output row).
* ``int-gemm`` (``IntGemmWeight``): the same grid packed for int16 dot products
  (``lockgate::int_linear``: AVX512-VNNI, AVX512BW or AVX2), x rounded to int16 per 32 columns
  (2^8 times finer than bf16), float16 scales (exact for GGUF blocks). ``--activation-quant int8``
  (an inexact tier) rounds x to int8 instead for the 4-bit ones (``with_int8_activations``): AVX2
  multiplies those bytes on VPMADDUBSW, the other paths run their int16 products on the same
  values, so every CPU gives the tier the same result.

What a weight gets (``make_forms``): ``quantization`` none gives no quantized form; auto gives
them only on the smallest grid (4, then 8 bits) the checkpoint's values already lie on, so
nothing is lost (a Q4_1 or Q4_K GGUF's projections, Q5_0 ones on 8 bits, a Q8_0 head); int4
forces 4 bits. The three
quantized forms of one weight are made from the same codes (one ``Grid``, searched once by
``lockgate.layers.grid``, which owns the grid search and its tolerance); torch's int4 form rounds its scales
and offsets to bf16, the integer GEMM's float16 scales are exact for GGUF grids (else it is not
made). ``want`` restricts what is made to the forms a measured table will call.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lockgate.checkpoint.gguf_blocks import Blocks
from lockgate.kernel_choice import QUANTIZED_FORMS
from lockgate.layers.grid import INT4_GROUP, LOSSLESS_TOLERANCE, Grid, find_grid, grid_error, quantize_int4

COPIES_MEMORY_SHARE = 0.25  # extra weight copies (float32, bf16-gemm) may take at most this share of memory
_NONE = torch.empty(0)  # "no tensor" in lockgate::decode_layers_'s flat list
INT_LINEAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x and bias dtypes lockgate::int_linear takes



def onednn_packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether dense projections of ``dtype`` on ``device`` run on oneDNN-packed weights."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def weight_copies_fit(nbytes: int) -> bool:
    """Whether extra weight copies of ``nbytes`` in all (the float32 forms, the bf16 kernel's
    packed one) fit COPIES_MEMORY_SHARE of physical memory."""
    memory = physical_memory_bytes()
    return memory is None or nbytes <= COPIES_MEMORY_SHARE * memory


class DenseWeight:
    """The run-dtype weight, oneDNN-packed where that is faster (bf16 with oneDNN bf16 kernels)."""

    name: typing.ClassVar[str] = "dense"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.packed: torch.Tensor | None = None  # oneDNN blocked copy of weight, or None
        if onednn_packs(weight.dtype, weight.device):
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def decode_layers_args(self) -> tuple[int, list[torch.Tensor]] | None:
        """Kind and tensors for ``lockgate::decode_layers_``: 200 (the oneDNN-packed weight, run as
        here) or 201 (F.linear on the weight)."""
        if self.packed is None:
            return 201, [self.weight, _NONE, _NONE]
        return 200, [self.packed, _NONE, _NONE]


def _kernel_says(query: str) -> bool:
    """``torch.ops.lockgate.<query>()``, False where lockgate's kernels are not loaded."""
    try:
        return bool(getattr(torch.ops.lockgate, query)())
    except (AttributeError, RuntimeError):
        return False


def bf16_gemm_available() -> bool:
    """Whether ``lockgate::bf16_linear`` is loaded and was built with AVX512-BF16 (call after
    ``lockgate.kernels.load``); elsewhere the form is not made."""
    return _kernel_says("bf16_linear_available")


class Bf16GemmWeight:
    """A bf16 weight [N, K] (N % 16 == 0, K even) in ``lockgate::bf16_linear``'s layout: [N / 16,
    K / 2, 32], 16 output rows' column pairs side by side (documented in
    ``kernels/csrc/bf16_gemm.cpp``). The products are those of the dense form (bf16 x bf16, float32
    sums), only the kernel differs."""

    name: typing.ClassVar[str] = "bf16-gemm"

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        if not Bf16GemmWeight.fits((n, k)) or weight.dtype != torch.bfloat16:
            raise ValueError(f"bf16_linear needs a bfloat16 [N, K] weight with N % 16 == 0 and K even, "
                             f"got {weight.dtype} [{n}, {k}]")
        with torch.no_grad():
            self.packed = weight.detach().reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(
                n // 16, k // 2, 32).contiguous()

    @staticmethod
    def fits(shape: tuple[int, ...]) -> bool:
        n, k = shape
        return n % 16 == 0 and k % 2 == 0 and k > 0

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] bf16 -> [M, N] bf16 (the bias added in float32 before the one rounding)."""
        return torch.ops.lockgate.bf16_linear(x.contiguous(), self.packed, bias)

    def decode_layers_args(self) -> tuple[int, list[torch.Tensor]] | None:
        """Kind 202 and the packed weight for ``lockgate::decode_layers_``."""
        return 202, [self.packed, _NONE, _NONE]

    def dequantize(self, n: int, k: int) -> torch.Tensor:
        """The weight [N, K] float32 the kernel multiplies by (for tests)."""
        return self.packed.view(n // 16, k // 2, 16, 2).permute(0, 2, 1, 3).reshape(n, k).float()


def f32_dot_available() -> bool:
    """Whether ``lockgate::f32_linear`` is loaded and was built with AVX2 + FMA (call after
    ``lockgate.kernels.load``); elsewhere the form is not made."""
    return _kernel_says("f32_linear_available")


class F32DotWeight:
    """A float32 run's dense weight (the same tensor, no copy) on ``lockgate::f32_linear``."""

    name: typing.ClassVar[str] = "f32-dot"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.lockgate.f32_linear(x.contiguous(), self.weight, bias)

    def decode_layers_args(self) -> tuple[int, list[torch.Tensor]] | None:
        """Kind 203: the weight, run as here."""
        return 203, [self.weight, _NONE, _NONE]


class Fp32Weight:
    """A float32 copy of a 16-bit run's weight (made from the checkpoint's unrounded values) and
    of its bias; x is cast up for sgemm and the result back to x's dtype."""

    name: typing.ClassVar[str] = "fp32"

    def __init__(self, source: torch.Tensor, source_bias: torch.Tensor | None) -> None:
        self.weight = source.detach().float().contiguous()
        self.bias = None if source_bias is None else source_bias.detach().float()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``bias`` is not used: the form keeps the unrounded float32 bias of its own."""
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)

    def decode_layers_args(self) -> tuple[int, list[torch.Tensor]] | None:
        return None


def int4_unfit_reason(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> str | None:
    """Why torch's int4 CPU kernel cannot run a [N, K] weight for ``dtype`` activations, or None."""
    if device.type != "cpu":
        return f"the int4 kernel is CPU-only (device {device})"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations of dtype {dtype}"
    n, k = shape
    if n % 16 or k % INT4_GROUP:
        return f"shape [{n}, {k}] (needs rows % 16 == 0 and columns % {INT4_GROUP} == 0)"
    return None


def int4_activation_dtype(run_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype int4 calls run in: 16-bit stays, float32 goes through bf16."""
    return torch.bfloat16 if run_dtype == torch.float32 else run_dtype


def _grid(source: torch.Tensor, bits: int, grid: Grid | None) -> Grid:
    return grid if grid is not None and grid.fits(source, bits) else Grid.of(source, bits)


@dataclass(frozen=True)
class Int4Weight:
    """A weight's int4 form for ``_weight_int4pack_mm_for_cpu``; ``error`` is the largest
    |weight - dequantized| over the tensor, in quantization steps (0 for a weight already on the grid)."""

    name: typing.ClassVar[str] = "torch-int4"
    packed: torch.Tensor  # uint8 [N, K/2], the kernel's layout
    scales_zeros: torch.Tensor  # [K/group, N, 2] activation dtype: w = (code - 8) * scale + zero
    group: int
    error: float

    @staticmethod
    def from_weight(source: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP,
                    grid: Grid | None = None) -> Int4Weight:
        """Quantize ``source`` [N, K] (full precision, not yet rounded to the run dtype) for
        activations of ``dtype`` (``grid``: its 4-bit grid, already made); raises ValueError when
        the kernel cannot take it."""
        reason = int4_unfit_reason(tuple(source.shape), dtype, source.device)
        if reason:
            raise ValueError(f"int4 weights not possible: {reason}")
        if group == INT4_GROUP:
            g = _grid(source, 4, grid)
            codes, step, low, error = g.codes, g.step, g.low, g.error
            assert low is not None
        else:
            codes, step, low = quantize_int4(source, group)
            n, k = source.shape
            back = (codes.view(n, k // group, group).float() * step[..., None] + low[..., None]).view(n, k)
            error = grid_error(back, source, step, group)
        zero = low + 8 * step  # the kernel subtracts 8 from each code
        scales_zeros = torch.stack([step, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [K/g, N, 2]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        return Int4Weight(packed, scales_zeros, group, error)

    @property
    def bits(self) -> int:
        return 4

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype, through the kernel's 16-bit activations."""
        act = self.scales_zeros.dtype  # 16-bit: the kernel's fast path
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(act), self.packed, self.group, self.scales_zeros).to(x.dtype)
        return y if bias is None else y + bias

    def decode_layers_args(self) -> tuple[int, list[torch.Tensor]] | None:
        """This form's kind and tensors (a, b, c) for ``lockgate::decode_layers_`` (contract in
        decode_layers.cpp), or None when that operator cannot run it."""
        return (0, [self.packed, self.scales_zeros, _NONE]) if self.group == INT4_GROUP else None

    def dequantize(self, n: int, k: int) -> torch.Tensor:
        """The weight [N, K] float32 the kernel multiplies by (for tests and error reports)."""
        eye = torch.eye(k, dtype=self.scales_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scales_zeros).float().t()[:n]

@dataclass(frozen=True)
class GroupQuantWeight:
    """A weight as GGUF-style blocks of 32 columns for ``lockgate::quant_linear``; ``error`` is the
    largest |weight - dequantized| in quantization steps (0 for a weight already on the grid)."""

    name: typing.ClassVar[str] = "group-quant"
    bits: int  # 4 (Q4_1: q * scale + zero, q in 0..15) or 8 (Q8_0: q * scale, q in -127..127)
    qweight: torch.Tensor  # bits 4: uint8 [N, K/2], byte j of a group = column j | column j + 16 << 4; 8: int8 [N, K]
    scales: torch.Tensor  # float32 [N, K/32]
    zeros: torch.Tensor | None  # float32 [N, K/32] (bits 4) or None
    error: float

    @staticmethod
    def from_weight(source: torch.Tensor, bits: int, grid: Grid | None = None) -> GroupQuantWeight:
        """Quantize ``source`` [N, K] (full precision; ``grid``: its grid at ``bits``, already
        made); raises ValueError for K % 32 != 0."""
        n, k = source.shape
        if k % INT4_GROUP or bits not in (4, 8):
            raise ValueError(f"{bits}-bit groups of {INT4_GROUP} do not fit a [{n}, {k}] weight")
        g = _grid(source, bits, grid)
        qweight: torch.Tensor = g.codes
        if bits == 4:
            c = g.codes.view(n, k // INT4_GROUP, INT4_GROUP).to(torch.uint8)
            qweight = (c[..., :16] | (c[..., 16:] << 4)).reshape(n, k // 2).contiguous()
        zeros = None if g.low is None else g.low.contiguous()
        return GroupQuantWeight(bits, qweight, g.step.contiguous(), zeros, g.error)

    @staticmethod
    def from_grid(g: Grid) -> GroupQuantWeight:
        """The form of a weight given by its grid alone (``Grid.from_blocks``: exact)."""
        n, k = g.shape
        qweight: torch.Tensor = g.codes
        if g.bits == 4:
            c = g.codes.view(n, k // INT4_GROUP, INT4_GROUP).to(torch.uint8)
            qweight = (c[..., :16] | (c[..., 16:] << 4)).reshape(n, k // 2).contiguous()
        return GroupQuantWeight(g.bits, qweight, g.step.contiguous(), None if g.low is None else g.low.contiguous(),
                                g.error)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] float32 or bf16 -> [M, N] in x's dtype."""
        return torch.ops.lockgate.quant_linear(x.contiguous(), self.qweight, self.scales, self.zeros, bias, self.bits)

    def decode_layers_args(self) -> tuple[int, list[torch.Tensor]] | None:
        """Kind and tensors for ``lockgate::decode_layers_`` (as ``Int4Weight.decode_layers_args``)."""
        return self.bits, [self.qweight, self.scales, _NONE if self.zeros is None else self.zeros]

    def dequantize(self, n: int, k: int) -> torch.Tensor:
        """The weight [N, K] float32 the kernel multiplies by (for tests and error reports)."""
        if self.bits == 8:
            w = self.qweight.float().view(n, k // INT4_GROUP, INT4_GROUP) * self.scales[..., None]
        else:
            b = self.qweight.view(n, k // INT4_GROUP, 16)
            codes = torch.cat([b & 0xF, b >> 4], dim=-1).float()
            assert self.zeros is not None
            w = codes * self.scales[..., None] + self.zeros[..., None]
        return w.reshape(n, k)

def int_gemm_available() -> bool:
    """Whether ``lockgate::int_linear`` is loaded and vectorized (AVX512-VNNI, AVX512BW or AVX2:
    ``int_gemm_isa``); call after ``lockgate.kernels.load``. Without a vector path its plain C++
    loops are correct but far slower than sgemm, so the form is not made."""
    return _kernel_says("int_linear_vectorized")


def int_gemm_isa() -> str | None:
    """The vector path ``lockgate::int_linear`` was built with (avx512-vnni, avx512bw, avx2-vnni,
    avx2, generic), or None when the kernels are not loaded."""
    try:
        return str(torch.ops.lockgate.int_linear_isa())
    except (AttributeError, RuntimeError):
        return None


@dataclass(frozen=True)
class IntGemmWeight:
    """A 4-bit (Q4_1) or 8-bit (Q8_0) grid weight in ``lockgate::int_linear``'s layout: codes
    packed for AVX512-VNNI's int16 dot products, scales/zeros per 16 output rows and 32 columns
    (the layout is documented in ``kernels/csrc/int_gemm.cpp``). Multiplies float32 x of any row
    count; x is rounded to int16 per row and 32 columns (relative error <= 2^-16 of the block's
    largest magnitude), the weight's codes are exact."""

    name: typing.ClassVar[str] = "int-gemm"
    bits: int
    packed: torch.Tensor  # bits 4: uint8 [N/16, K/4, 32]; bits 8: int8 [N/16, K/2, 32]
    scales: torch.Tensor  # float16 [N/16, K/32, 16] ([N/16, K/16, 16] for 8 bits with a step per 16
    #   columns), or a GGUF K-quant's factored table (uint8, see ``_factored`` and int_gemm.cpp)
    zeros: torch.Tensor | None  # the same dtype and shape (bits 4; bits 8 with lows: Q5_K) or None
    error: float  # largest |weight - dequantized| in quantization steps, float16 scales included
    act_bits: int = 16  # x rounded to int16, or to int8 (``--activation-quant int8``, 4-bit codes only)

    @staticmethod
    def fits(shape: tuple[int, ...]) -> bool:
        n, k = shape
        return n % 16 == 0 and k % INT4_GROUP == 0

    @staticmethod
    def from_weight(source: torch.Tensor, bits: int, grid: Grid | None = None) -> IntGemmWeight:
        """``source`` [N, K] (full precision) on the grid ``quantize_int4`` / ``quantize_int8``
        make of it (the same codes the small-step forms use; ``grid``: that grid, already made)."""
        n, k = source.shape
        if not IntGemmWeight.fits((n, k)) or bits not in (4, 8):
            raise ValueError(f"int_linear needs N % 16 == 0 and K % {INT4_GROUP} == 0 and 4 or 8 bits, "
                             f"got [{n}, {k}] at {bits} bits")

        g = _grid(source, bits, grid)
        made = IntGemmWeight._pack(g, n, k, 0.0)
        return dataclasses.replace(made, error=grid_error(made.dequantize(n, k), source, g.step))

    @staticmethod
    def from_grid(g: Grid) -> IntGemmWeight:
        """The form of a weight given by its grid alone (``Grid.from_blocks``: a GGUF matrix of a
        direct type), nothing lost: the legacy types' steps and lows are float16 values (checked), a
        K-quant's are kept factored as the file stores them (int8 factors, float16 super-scales)."""
        n, k = g.shape
        if not IntGemmWeight.fits((n, k)) or g.bits not in (4, 8):
            raise ValueError(f"int_linear needs N % 16 == 0 and K % {INT4_GROUP} == 0 and 4 or 8 bits, "
                             f"got [{n}, {k}] at {g.bits} bits")
        if g.step_factors is not None:
            return IntGemmWeight._pack(g, n, k, 0.0, IntGemmWeight._factored)
        for t in (g.step, g.low):
            if t is not None and not bool((t.to(torch.float16).float() == t).all()):
                raise ValueError("the grid's steps are not float16 values: int_linear would round them")
        return IntGemmWeight._pack(g, n, k, 0.0)

    @staticmethod
    def _factored(g: Grid, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The grid's factored steps and lows as the kernel's tables: uint8 [N/16, E * 16 + K/256 *
        32], per 16-row block its int8 factors [E, 16], then its float16 supers [K/256, 16]."""
        assert g.step_factors is not None
        if g.low_factors is None:
            return IntGemmWeight._factored_table(g.step_factors, n), None
        f, d = g.low_factors
        return IntGemmWeight._factored_table(g.step_factors, n), IntGemmWeight._factored_table(
            (_lows_per_step(f, g.step_factors[0].shape[1]), d), n)

    @staticmethod
    def _factored_table(factors: tuple[torch.Tensor, torch.Tensor], n: int) -> torch.Tensor:
        f, d = factors
        fb = f.view(n // 16, 16, -1).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(n // 16, -1)
        db = d.view(n // 16, 16, -1).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(n // 16, -1)
        return torch.cat([fb, db], dim=1).contiguous()

    @staticmethod
    def _pack(g: Grid, n: int, k: int, error: float,
              tables: typing.Callable[[Grid, int], tuple[torch.Tensor, torch.Tensor | None]] | None = None
              ) -> IntGemmWeight:
        """The grid's codes in the kernel's layout, with ``tables`` (grid, N) -> (scales, zeros), by
        default the steps and lows in float16 [N/16, G, 16]."""
        def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N/16, G, 16] float16
            return t.view(n // 16, 16, -1).permute(0, 2, 1).to(torch.float16).contiguous()

        if g.bits == 4:
            # (nb, lane, chunk c, pair-in-chunk, column-in-pair) -> (nb, c, lane, column-in-pair, pair-in-chunk)
            c = g.codes.view(n // 16, 16, k // 4, 2, 2).permute(0, 2, 1, 4, 3).to(torch.uint8)
            packed = (c[..., 0] | (c[..., 1] << 4)).reshape(n // 16, k // 4, 32).contiguous()
        else:
            packed = g.codes.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32).contiguous()
        scales, zeros = tables(g, n) if tables else (
            per_block(g.step), None if g.low is None else per_block(_lows_per_step(g.low, g.step.shape[1])))
        return IntGemmWeight(g.bits, packed, scales, zeros, error)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype (the kernel widens a 16-bit x exactly, computes in
        float32 and rounds the biased result once to x's dtype)."""
        if x.dtype not in INT_LINEAR_DTYPES or (bias is not None and bias.dtype not in INT_LINEAR_DTYPES):
            y = torch.ops.lockgate.int_linear(x.float().contiguous(), self.packed, self.scales, self.zeros, self.bits,
                                              None, self.act_bits)
            return (y if bias is None else y + bias).to(x.dtype)  # (float64 and the like: not a run dtype)
        return torch.ops.lockgate.int_linear(x.contiguous(), self.packed, self.scales, self.zeros, self.bits,
                                             None if bias is None else bias.contiguous(), self.act_bits)

    def with_int8_activations(self) -> IntGemmWeight:
        """This weight with x rounded to int8 per row and 32 columns (4-bit codes only: 8-bit codes
        against int8 x would saturate VPMADDUBSW's int16 pair sums, so no byte kernel serves them)."""
        if self.bits != 4:
            raise ValueError(f"int8 activations are for 4-bit codes, this weight has {self.bits}")
        return dataclasses.replace(self, act_bits=8)

    def decode_layers_args(self) -> tuple[int, list[torch.Tensor]] | None:
        """Kind and tensors for ``lockgate::decode_layers_`` (as ``Int4Weight.decode_layers_args``;
        the operator widens a 16-bit x and rounds the result as here)."""
        kind = 100 + self.bits + (10 if self.act_bits == 8 else 0)
        return kind, [self.packed, self.scales, _NONE if self.zeros is None else self.zeros]

    @staticmethod
    def _table(t: torch.Tensor, n: int, k: int, negate: bool = False) -> torch.Tensor:
        """A scale or zero table as float32 [N, entries] (a factored one multiplied out, a zero negated)."""
        if t.dtype != torch.uint8:
            return t.permute(0, 2, 1).reshape(n, -1).float()
        supers = k // 256 * 32
        f = t[:, :-supers].contiguous().view(torch.int8).view(n // 16, -1, 16).permute(0, 2, 1).reshape(n, -1)
        d = t[:, -supers:].contiguous().view(torch.float16).view(n // 16, -1, 16).permute(0, 2, 1).reshape(n, -1)
        v = d.float().repeat_interleave(f.shape[1] // d.shape[1], dim=1) * f.float()
        return -v if negate else v

    def dequantize(self, n: int, k: int) -> torch.Tensor:
        """The weight [N, K] float32 the kernel multiplies by (for tests)."""
        if self.bits == 4:
            b = self.packed.view(n // 16, k // 4, 16, 2)
            lo, hi = (b & 0xF), (b >> 4)  # [nb, c, lane, column-in-pair]
            codes = torch.stack([lo, hi], dim=-2).permute(0, 2, 1, 3, 4).reshape(n, k).float()
        else:
            codes = self.packed.view(n // 16, k // 2, 16, 2).permute(0, 2, 1, 3).reshape(n, k).float()
        scales = self._table(self.scales, n, k)
        steps = scales.shape[1]  # K / 32, or K / 16 (8 bits: a scale per 16 columns)
        w = codes.view(n, steps, k // steps) * scales[..., None]
        if self.zeros is not None:  # a zero per 32 columns (with a scale per 16: the first of its two entries)
            zeros = self._table(self.zeros, n, k, negate=True)[:, :: steps * INT4_GROUP // k]
            w = w.reshape(n, k // INT4_GROUP, INT4_GROUP) + zeros[..., None]
        return w.reshape(n, k)


def _lows_per_step(low: torch.Tensor, entries: int) -> torch.Tensor:
    """Lows (or their factors) [N, K/32] as ``int_linear``'s zero table of ``entries`` per row: as
    they are for a step per 32 columns; with a step per 16 (K/16 entries) each group's low first and
    0 second (the kernel adds each entry times the sum of x over the group's 32 columns)."""
    if low.shape[1] == entries:
        return low
    out = torch.zeros(low.shape[0], entries, dtype=low.dtype)
    out[:, 0::2] = low
    return out


Form = DenseWeight | Bf16GemmWeight | F32DotWeight | Fp32Weight | Int4Weight | GroupQuantWeight | IntGemmWeight


def make_forms(source: torch.Tensor, dtype: torch.dtype, quantization: str, kernels: bool, *,
               fp32: bool = False, source_bias: torch.Tensor | None = None,
               want: Collection[str] | None = None, dense: torch.Tensor | None = None) -> dict[str, Form]:
    """A projection's forms besides ``dense`` for a run in ``dtype``: ``source`` [N, K] is the
    weight at full precision (before rounding to ``dtype``). ``fp32``: make the float32 copy
    (16-bit runs; the caller checked memory). ``kernels``: lockgate's kernels are loaded
    (group-quant; int-gemm where ``int_linear`` is vectorized; bf16-gemm in bf16 runs where
    ``bf16_linear`` was built; f32-dot in float32 runs where ``f32_linear`` was built).
    ``dense``: the projection's run-dtype weight, which f32-dot multiplies in place. ``want``:
    make only these (None: every form the weight can have)."""

    def wanted(name: str) -> bool:
        return want is None or name in want

    forms: dict[str, Form] = {}
    if (kernels and dense is not None and dense.dtype == torch.float32 and dense.device.type == "cpu"
            and dense.is_contiguous() and wanted("f32-dot") and f32_dot_available()):
        forms["f32-dot"] = F32DotWeight(dense)
    if (kernels and dtype == torch.bfloat16 and source.device.type == "cpu" and wanted("bf16-gemm")
            and Bf16GemmWeight.fits(tuple(source.shape)) and bf16_gemm_available()):
        forms["bf16-gemm"] = Bf16GemmWeight(source.to(dtype))
    if fp32 and dtype != torch.float32 and wanted("fp32"):
        forms["fp32"] = Fp32Weight(source, source_bias)
    if not any(wanted(q) for q in QUANTIZED_FORMS):
        return forms
    grid = find_grid(source, quantization, kernels)
    if grid is None:
        return forms
    bits, grid_loss = grid.bits, grid.error
    on_cpu = source.device.type == "cpu"
    if bits == 4 and wanted("torch-int4") and not int4_unfit_reason(tuple(source.shape), dtype, source.device):
        forms["torch-int4"] = Int4Weight.from_weight(source, int4_activation_dtype(dtype), grid=grid)
    if kernels and on_cpu and wanted("group-quant"):
        forms["group-quant"] = GroupQuantWeight.from_weight(source, bits, grid)
    if kernels and on_cpu and wanted("int-gemm") and IntGemmWeight.fits(tuple(source.shape)) and int_gemm_available():
        ig = IntGemmWeight.from_weight(source, bits, grid)
        # float16 scales are exact for GGUF grids. Where they would round: a lossless grid stays
        # lossless by not having this form; a lossy one (``int4`` on a 16-bit checkpoint) may lose
        # up to 1/16 step more (float16 scales: <= 15 * 2^-11 step; torch's bf16 ones lose 15 * 2^-8)
        limit = LOSSLESS_TOLERANCE if grid_loss <= LOSSLESS_TOLERANCE else grid_loss + 1 / 16
        if ig.error <= limit:
            forms["int-gemm"] = ig
    return forms


def packed_forms(qm: Blocks, kernels: bool, want: Collection[str] | None = None) -> dict[str, Form]:
    """The forms of a projection kept in its GGUF blocks (no dense weight, issue 49), made from the
    codes and steps as the blocks hold them (the products are the file's values', never re-rounded).

    ``want`` None: one form, the integer GEMM where ``int_linear`` is vectorized (every row count:
    decode and prompt rows, which it serves row-invariantly), else lockgate's ``group-quant``.
    Else the quantized forms ``want`` names that these blocks can have (a stored table's, a forced
    ``--matmul-forms``). {} when none can be made (no lockgate kernels, or ``want`` names only
    dense): the caller then de-quantizes to a dense weight (and adds ``dense`` when ``want`` names
    it beside these)."""
    n, k = qm.shape
    if k % INT4_GROUP:
        return {}
    vectorized = kernels and IntGemmWeight.fits((n, k)) and int_gemm_available()
    if want is None:
        want = {"int-gemm"} if vectorized else {"group-quant"} if kernels else set()
    names = set(want) & set(QUANTIZED_FORMS)
    if not names:
        return {}
    grid = Grid.from_blocks(qm)
    forms: dict[str, Form] = {}
    if "int-gemm" in names and vectorized:
        forms["int-gemm"] = IntGemmWeight.from_grid(grid)
    per_32 = grid.step.shape[1] * INT4_GROUP == k  # (Q6_K's steps are per 16: the integer GEMM's alone)
    if "group-quant" in names and kernels and per_32 and (grid.bits == 4 or grid.low is None):  # (8 bits: no lows)
        forms["group-quant"] = GroupQuantWeight.from_grid(grid)
    if "torch-int4" in names and grid.bits == 4 and per_32 and not int4_unfit_reason((n, k), torch.bfloat16, torch.device("cpu")):
        assert grid.low is not None
        forms["torch-int4"] = Int4Weight(torch.ops.aten._convert_weight_to_int4pack_for_cpu(grid.codes.to(torch.int32), 1),
                                         torch.stack([grid.step, grid.low + 8 * grid.step], dim=-1).transpose(0, 1)
                                         .contiguous().to(torch.bfloat16), INT4_GROUP, 0.0)
    return forms
