"""Linear projections (``y = x @ W^T + b``) on the fastest kernel torch has for the weight and the step.

Owns one projection's weight and bias, the kernels' prepared forms of the weight (made once at
load) and the choice between them per call:

* dense, bfloat16 on a CPU with oneDNN bf16 support: the weight is reordered once into oneDNN's
  blocked layout (``mkldnn._reorder_linear_weight``, the packed form inductor uses for frozen
  CPU graphs) and every call runs ``mkldnn._linear_pointwise`` on it. ``F.linear`` re-packs the
  weight on every call; measured on the 2-core AVX512-BF16 machine (docs/performance.md), the
  packed form is 1.6-2x faster at 1 row and about as fast from 256 rows up. Results are
  bit-identical to ``F.linear`` (the same oneDNN kernel family).
* dense, everything else (float32, where MKL's sgemm is already the fastest path, CUDA, a torch
  without oneDNN): ``F.linear`` on the weight as loaded.
* float32 for large calls (optional, ``fp32_min_rows``): a float32 copy of the weight (from the
  checkpoint's unrounded values) multiplied by MKL's sgemm, activations cast up and the result
  back. On a CPU with AVX512-BF16 but no AMX (this machine), oneDNN's bf16 matmul reaches fewer
  FLOP/s than sgemm: measured over the default model's 30 layers, fp32 is 1.15x faster at 64
  rows, 1.38x at 256 and 1.5x at 512-1024 (bf16 wins below ~48 rows, where bytes dominate).
  With AMX, bf16 is several times faster and this form should stay off.
* weight-only int4 (``Int4Weight``, optional): the weight in groups of ``INT4_GROUP`` input
  columns, each group stored as 4-bit codes with a scale and an offset, multiplied by torch's
  CPU kernel ``_weight_int4pack_mm_for_cpu``. Its activations are 16-bit: in a float32 run they
  are cast to bf16 for the call and the result back (measured: the kernel's float32 path is
  25-30x slower than its bf16 one, e.g. 1.8 ms vs 0.06 ms for the gate/up projection at 1 row). A step with few rows (decode) is bound by reading
  the weights from memory, and int4 reads a quarter of bf16's bytes: measured on this machine
  with all 30 layers of the default model streamed from memory, the projections of a 1-row step
  take 9.5 ms instead of 24.7 ms. From about 32 rows the kernel's arithmetic costs more than the
  bytes it saves, so calls with more than ``INT4_MAX_ROWS`` rows (prefill, mixed steps, big decode
  batches) use the dense weight.

* groupwise int8 / int4 on lockgate's own kernel (``GroupQuantWeight``, when ``lockgate.kernels``
  is built): the GGUF block formats themselves, Q8_0 (codes -127..127, a scale per 32 columns)
  and Q4_1 (codes 0..15, a scale and an offset per 32 columns), multiplied by
  ``lockgate::quant_linear`` (each weight byte read once, float32 math). int8 is what torch
  lacks (it has int8 only per output row): the default model's LM head is Q8_0, and re-gridding
  it per row would lose precision; at one row the int8 head takes 1.0-1.1 ms where the float32
  head takes 3.8-4.4 ms. Its int4 serves shapes torch's int4 kernel does not take.

* groupwise int4 / int8 for every float32 call (``IntGemmWeight``, ``lockgate::int_linear``, when
  the kernels are built and the CPU has AVX512-VNNI): the same grid as the small-step form (its
  float16 scales exact for GGUF blocks), the codes packed for VNNI's int16 dot products (32
  products per instruction, twice float32 FMA's 16) and x rounded to int16 per 32 columns (2^8
  times finer than bf16). Measured on the default model's shapes on a 2-core CPU without bf16
  units (docs/performance.md): at 1-6 rows it streams the codes from memory faster than torch's
  int4 kernel (decode steps 1.3-1.5x faster); 1.2-3x sgemm on the dense float32 weight at 17-64
  rows (decode batches: 4-8x fewer weight bytes read), 1.0-1.4x at 256-1,024 rows (prefill), the
  LM head 2-2.7x at 17-32 rows.

The small-step form (``quant``, either kind) is chosen per projection by ``choose_quant``:
``auto`` takes the smallest grid (4, then 8 bits) the checkpoint's values already lie on, so
nothing is lost; ``int4`` forces 4 bits (lossy for 16-bit checkpoints); ``none`` keeps it dense.

Invariants: ``weight`` (run dtype) stays the source of truth for shapes and tests; a call of r
rows uses the integer-GEMM form if it has one (only float32 runs get it), else the small-step
quantized form if it has one and r <= ``small_max_rows`` (``INT4_MAX_ROWS``), else float32 if
it has that form and r >= ``fp32_min_rows``, else the dense run-dtype weight; each equals
``F.linear`` with the corresponding weight (dequantized, the float32 source, ``weight``) up to
accumulation order, the integer GEMM's int16 rounding of x and the output's rounding to x's
dtype. The quantized forms of one projection are made from the same codes; the integer GEMM's
float16 scales equal the small forms' float32 ones for GGUF grids (else it is not made), torch's
int4 form rounds its scales and offsets to bf16.
Called by ``lockgate.models.llama`` (every projection and the LM head).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

INT4_GROUP = 32  # input columns per scale/offset: Q4_0/Q4_1 GGUF blocks are 32 wide
INT4_MAX_ROWS = 16  # quantized forms for calls with at most this many rows; dense above (measured crossover ~32)
INT4_MODES = ("auto", "none", "int4")
LOSSLESS_TOLERANCE = 1e-3  # auto mode: largest error allowed, in quantization steps (float rounding only)
_NONE = torch.empty(0)  # "no tensor" in lockgate::decode_layers_'s flat list


def onednn_packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether dense projections of ``dtype`` on ``device`` run on oneDNN-packed weights."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


FP32_MIN_ROWS = 64  # auto: calls of at least this many rows multiply in float32 (measured crossover 48-56)


def cpu_has_amx() -> bool:
    """Whether the CPU advertises AMX tiles for bf16 (Linux /proc/cpuinfo; False when unknown)."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


FP32_AUTO_MEMORY_SHARE = 0.25  # auto: the float32 copies may take at most this share of physical memory


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fp32_min_rows_for(setting: str, dtype: torch.dtype, device: torch.device,
                      fp32_copy_bytes: int = 0) -> int | None:
    """Resolve ``--fp32-matmul-rows`` (auto | off | N): the row count from which projections
    multiply in float32, or None for never. auto: ``FP32_MIN_ROWS`` for a 16-bit run on a CPU
    whose bf16 matmul is slower than sgemm (oneDNN bf16 support without AMX) when the float32
    copies (``fp32_copy_bytes``) fit in FP32_AUTO_MEMORY_SHARE of physical memory, else None."""
    if setting == "off" or dtype == torch.float32:
        return None
    if setting == "auto":
        memory = physical_memory_bytes()
        fits = memory is None or fp32_copy_bytes <= FP32_AUTO_MEMORY_SHARE * memory
        return FP32_MIN_ROWS if onednn_packs(dtype, device) and not cpu_has_amx() and fits else None
    rows = int(setting)
    if rows < 1:
        raise ValueError(f"--fp32-matmul-rows must be auto, off or a row count >= 1, got {setting!r}")
    return rows


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


def grid_error(back: torch.Tensor, source: torch.Tensor, step: torch.Tensor, group: int = INT4_GROUP) -> float:
    """The largest |back - source| over a weight [N, K], in units of its group's quantization step
    ``step`` [N, K/group] (absolute where the step is 0): 0 for a weight already on the grid."""
    n, k = source.shape
    err = (back.float() - source.float()).abs().view(n, k // group, group).amax(-1)  # [N, K/g]
    return float(torch.where(step > 0, err / torch.where(step > 0, step, 1), err).max())


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groupwise asymmetric min/max 4-bit quantization of weight [N, K] (computed in float32).

    Returns codes [N, K] int32 in 0..15, step [N, K/group] and low [N, K/group] float32 with
    ``weight ~= codes * step + low``. A weight that already lies on such a grid (a Q4_1 block:
    its smallest value has code 0 and its largest code 15) comes back exactly.
    """
    n, k = weight.shape
    w = weight.float().view(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)  # [N, K/g]
    step = (high - low) / 15
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = ((w - low[..., None]) * inv[..., None]).round_().clamp_(0, 15).to(torch.int32).view(n, k)
    return codes, step, low


@dataclass(frozen=True)
class Int4Weight:
    """A weight's int4 form for ``_weight_int4pack_mm_for_cpu``; ``error`` is the largest
    |weight - dequantized| over the tensor, in quantization steps (0 for a weight already on the grid)."""

    packed: torch.Tensor  # uint8 [N, K/2], the kernel's layout
    scales_zeros: torch.Tensor  # [K/group, N, 2] activation dtype: w = (code - 8) * scale + zero
    group: int
    error: float

    @staticmethod
    def from_weight(source: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP) -> Int4Weight:
        """Quantize ``source`` [N, K] (full precision, not yet rounded to the run dtype) for
        activations of ``dtype``; raises ValueError when the kernel cannot take it."""
        reason = int4_unfit_reason(tuple(source.shape), dtype, source.device)
        if reason:
            raise ValueError(f"int4 weights not possible: {reason}")
        codes, step, low = quantize_int4(source, group)
        n, k = source.shape
        back = (codes.view(n, k // group, group).float() * step[..., None] + low[..., None]).view(n, k)
        error = grid_error(back, source, step, group)
        zero = low + 8 * step  # the kernel subtracts 8 from each code
        scales_zeros = torch.stack([step, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [K/g, N, 2]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return Int4Weight(packed, scales_zeros, group, error)

    @staticmethod
    def choose(source: torch.Tensor, mode: str, dtype: torch.dtype) -> Int4Weight | None:
        """The int4 form ``mode`` asks for: none -> None; int4 -> always (when the kernel fits);
        auto -> only when it loses nothing (``source`` already lies on a 4-bit grid of INT4_GROUP)."""
        if mode not in INT4_MODES:
            raise ValueError(f"quantization mode {mode!r} is not one of {INT4_MODES}")
        if mode == "none" or int4_unfit_reason(tuple(source.shape), dtype, source.device):
            return None
        q = Int4Weight.from_weight(source, dtype)
        return q if mode == "int4" or q.error <= LOSSLESS_TOLERANCE else None

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


def quantize_int8(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Groupwise symmetric absmax 8-bit quantization of weight [N, K] (float32): codes [N, K] int8
    in -127..127 and step [N, K/group] with ``weight ~= codes * step``. A GGUF Q8_0 block (its
    largest magnitude has code +-127) comes back exactly."""
    n, k = weight.shape
    w = weight.float().view(n, k // group, group)
    step = w.abs().amax(-1) / 127  # [N, K/g]
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = (w * inv[..., None]).round_().clamp_(-127, 127).to(torch.int8).view(n, k)
    return codes, step


@dataclass(frozen=True)
class GroupQuantWeight:
    """A weight as GGUF-style blocks of 32 columns for ``lockgate::quant_linear``; ``error`` is the
    largest |weight - dequantized| in quantization steps (0 for a weight already on the grid)."""

    bits: int  # 4 (Q4_1: q * scale + zero, q in 0..15) or 8 (Q8_0: q * scale, q in -127..127)
    qweight: torch.Tensor  # bits 4: uint8 [N, K/2], byte j of a group = column j | column j + 16 << 4; 8: int8 [N, K]
    scales: torch.Tensor  # float32 [N, K/32]
    zeros: torch.Tensor | None  # float32 [N, K/32] (bits 4) or None
    error: float

    @staticmethod
    def from_weight(source: torch.Tensor, bits: int) -> GroupQuantWeight:
        """Quantize ``source`` [N, K] (full precision); raises ValueError for K % 32 != 0."""
        n, k = source.shape
        if k % INT4_GROUP or bits not in (4, 8):
            raise ValueError(f"{bits}-bit groups of {INT4_GROUP} do not fit a [{n}, {k}] weight")
        zeros: torch.Tensor | None
        if bits == 4:
            codes, step, low = quantize_int4(source)
            back = codes.view(n, k // INT4_GROUP, INT4_GROUP).float() * step[..., None] + low[..., None]
            g = codes.view(n, k // INT4_GROUP, INT4_GROUP).to(torch.uint8)
            qweight = (g[..., :16] | (g[..., 16:] << 4)).reshape(n, k // 2).contiguous()
            zeros = low.contiguous()
        else:
            codes8, step = quantize_int8(source)
            back = codes8.view(n, k // INT4_GROUP, INT4_GROUP).float() * step[..., None]
            qweight, zeros = codes8, None
        return GroupQuantWeight(bits, qweight, step.contiguous(), zeros, grid_error(back.view(n, k), source, step))

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


QuantForm = Int4Weight | GroupQuantWeight


def int_gemm_available() -> bool:
    """Whether ``lockgate::int_linear`` is loaded and vectorized (AVX512-VNNI); call after
    ``lockgate.kernels.load``. Without VNNI its plain C++ path is correct but slower than sgemm."""
    try:
        return bool(torch.ops.lockgate.int_linear_vectorized())
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class IntGemmWeight:
    """A 4-bit (Q4_1) or 8-bit (Q8_0) grid weight in ``lockgate::int_linear``'s layout: codes
    packed for AVX512-VNNI's int16 dot products, scales/zeros per 16 output rows and 32 columns
    (the layout is documented in ``kernels/csrc/int_gemm.cpp``). Multiplies float32 x of any row
    count; x is rounded to int16 per row and 32 columns (relative error <= 2^-16 of the block's
    largest magnitude), the weight's codes are exact."""

    bits: int
    packed: torch.Tensor  # bits 4: uint8 [N/16, K/4, 32]; bits 8: int8 [N/16, K/2, 32]
    scales: torch.Tensor  # float16 [N/16, K/32, 16]
    zeros: torch.Tensor | None  # float16 [N/16, K/32, 16] (bits 4) or None
    error: float  # largest |weight - dequantized| in quantization steps, float16 scales included

    @staticmethod
    def fits(shape: tuple[int, ...]) -> bool:
        n, k = shape
        return n % 16 == 0 and k % INT4_GROUP == 0

    @staticmethod
    def from_weight(source: torch.Tensor, bits: int) -> IntGemmWeight:
        """``source`` [N, K] (full precision) on the grid ``quantize_int4`` / ``quantize_int8``
        make of it (the same codes the small-step forms use)."""
        n, k = source.shape
        if not IntGemmWeight.fits((n, k)) or bits not in (4, 8):
            raise ValueError(f"int_linear needs N % 16 == 0 and K % {INT4_GROUP} == 0 and 4 or 8 bits, "
                             f"got [{n}, {k}] at {bits} bits")

        def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N/16, G, 16] float16
            return t.view(n // 16, 16, -1).permute(0, 2, 1).to(torch.float16).contiguous()

        zeros: torch.Tensor | None = None
        if bits == 4:
            codes, step, low = quantize_int4(source)
            # (nb, lane, chunk c, pair-in-chunk, column-in-pair) -> (nb, c, lane, column-in-pair, pair-in-chunk)
            c = codes.view(n // 16, 16, k // 4, 2, 2).permute(0, 2, 1, 4, 3).to(torch.uint8)
            packed = (c[..., 0] | (c[..., 1] << 4)).reshape(n // 16, k // 4, 32).contiguous()
            zeros = per_block(low)
        else:
            codes8, step = quantize_int8(source)
            packed = codes8.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32).contiguous()
        made = IntGemmWeight(bits, packed, per_block(step), zeros, 0.0)
        return dataclasses.replace(made, error=grid_error(made.dequantize(n, k), source, step))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] float32."""
        y = torch.ops.lockgate.int_linear(x.contiguous(), self.packed, self.scales, self.zeros, self.bits)
        return y if bias is None else y + bias

    def decode_layers_args(self) -> tuple[int, list[torch.Tensor]] | None:
        """Kind and tensors for ``lockgate::decode_layers_`` (as ``Int4Weight.decode_layers_args``)."""
        return 100 + self.bits, [self.packed, self.scales, _NONE if self.zeros is None else self.zeros]

    def dequantize(self, n: int, k: int) -> torch.Tensor:
        """The weight [N, K] float32 the kernel multiplies by (for tests)."""
        if self.bits == 4:
            b = self.packed.view(n // 16, k // 4, 16, 2)
            lo, hi = (b & 0xF), (b >> 4)  # [nb, c, lane, column-in-pair]
            codes = torch.stack([lo, hi], dim=-2).permute(0, 2, 1, 3, 4).reshape(n, k).float()
        else:
            codes = self.packed.view(n // 16, k // 2, 16, 2).permute(0, 2, 1, 3).reshape(n, k).float()
        scales = self.scales.permute(0, 2, 1).reshape(n, k // INT4_GROUP).float()
        w = codes.view(n, k // INT4_GROUP, INT4_GROUP) * scales[..., None]
        if self.zeros is not None:
            w = w + self.zeros.permute(0, 2, 1).reshape(n, k // INT4_GROUP).float()[..., None]
        return w.reshape(n, k)

    @staticmethod
    def matching(source: torch.Tensor, quant: QuantForm | None, run_dtype: torch.dtype) -> IntGemmWeight | None:
        """The form for every call of a projection whose small-step form is ``quant``: the same
        grid (same codes; float16 scales, where torch's int4 form rounds its scales to bf16).
        None when there is no small-step form, the run is not float32 (16-bit runs keep oneDNN),
        the shape does not fit, the kernel is not vectorized on this CPU, or float16 scales would
        lose more than the small form does."""
        if (quant is None or run_dtype != torch.float32 or source.device.type != "cpu"
                or not IntGemmWeight.fits(tuple(source.shape)) or not int_gemm_available()):
            return None
        large = IntGemmWeight.from_weight(source, quant.bits)
        # float16 scales are exact for GGUF grids. Where they would round: a lossless grid stays
        # lossless by not having this form; a lossy one (``int4`` on a 16-bit checkpoint) may lose
        # up to 1/16 step more (float16 scales: <= 15 * 2^-11 step; torch's bf16 ones lose 15 * 2^-8)
        limit = LOSSLESS_TOLERANCE if quant.error <= LOSSLESS_TOLERANCE else quant.error + 1 / 16
        return large if large.error <= limit else None


def choose_quant(source: torch.Tensor, mode: str, dtype: torch.dtype, kernels: bool) -> QuantForm | None:
    """The small-step form of a projection's weight (``source`` [N, K], full precision) for ``mode``:
    none -> None; int4 -> 4 bits whatever is lost; auto -> the smallest of 4 and 8 bits that loses
    nothing (the checkpoint is already on that grid), else None.

    4 bits run on torch's int4 kernel (for ``dtype`` activations) where it fits the shape, else on
    lockgate's (``kernels``: loaded); 8 bits only on lockgate's. Measured at 1-16 rows on the
    default model's shapes, torch's int4 kernel is as fast as lockgate's or faster (0.07 vs 0.10 ms
    for gate/up at one row), so it keeps that job."""
    if mode not in INT4_MODES:
        raise ValueError(f"quantization mode {mode!r} is not one of {INT4_MODES}")
    if mode == "none":
        return None
    ours = kernels and source.device.type == "cpu" and source.shape[1] % INT4_GROUP == 0
    torch_int4 = Int4Weight.choose(source, mode, int4_activation_dtype(dtype))
    if torch_int4 is not None:
        return torch_int4
    if not ours:
        return None
    q4 = GroupQuantWeight.from_weight(source, 4)
    if mode == "int4" or q4.error <= LOSSLESS_TOLERANCE:
        return q4
    q8 = GroupQuantWeight.from_weight(source, 8)
    return q8 if q8.error <= LOSSLESS_TOLERANCE else None


class Linear:
    """One projection: weight [N, K], optional bias [N], optional quantized and float32 forms;
    call with x [..., K] -> [..., N] in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, quant: QuantForm | None = None,
                 fp32_min_rows: int | None = None, source: torch.Tensor | None = None,
                 source_bias: torch.Tensor | None = None, large: IntGemmWeight | None = None) -> None:
        """``source``/``source_bias``: the unrounded values the float32 form is made from
        (default: ``weight``/``bias``); used only when ``fp32_min_rows`` is set. ``large``: the
        integer-GEMM form, which then takes every call (float32 runs, ``IntGemmWeight.matching``)."""
        self.weight = weight
        self.bias = bias
        self.quant = quant
        self.large = large
        self.fp32_min_rows = fp32_min_rows
        self.weight32: torch.Tensor | None = None
        self.bias32: torch.Tensor | None = None
        if fp32_min_rows is not None and weight.dtype != torch.float32:
            self.weight32 = (weight if source is None else source).detach().float().contiguous()
            b = bias if source_bias is None else source_bias
            self.bias32 = None if b is None else b.detach().float()
        self.packed: torch.Tensor | None = None  # oneDNN blocked copy of weight, or None
        if onednn_packs(weight.dtype, weight.device):
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)

    @property
    def small_max_rows(self) -> int:
        """The largest call (rows) the small-step form takes; 0 without one. The one rule both
        ``__call__`` and the one-call decode path (``LlamaModel._layers_decode``) follow.

        With an integer-GEMM form the small-step form takes no call: ``int_linear``'s few-row path
        streams the codes at least as fast as torch's int4 kernel and quant_linear, without
        rounding x to bf16 (docs/performance.md, round 5: decode batch 1-3 steps 1.3-1.5x faster)."""
        if self.quant is None or self.large is not None:
            return 0
        return INT4_MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        form = self.large or (self.quant if rows <= self.small_max_rows else None)  # large: float32 runs only
        if form is not None:
            y = form(x.reshape(-1, x.shape[-1]), self.bias)
            return y.view(*x.shape[:-1], y.shape[-1])
        if self.weight32 is not None and rows >= typing.cast(int, self.fp32_min_rows):
            return F.linear(x.float(), self.weight32, self.bias32).to(x.dtype)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
