"""Linear: the packed oneDNN path (bf16 on CPU) and the plain path both equal F.linear; the int4
form re-grids 4-bit weights exactly and serves calls of up to INT4_MAX_ROWS rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lockgate.layers.linear import (
    FP32_MIN_ROWS,
    INT4_GROUP,
    INT4_MAX_ROWS,
    LOSSLESS_TOLERANCE,
    GroupQuantWeight,
    Int4Weight,
    Linear,
    choose_quant,
    cpu_has_amx,
    fp32_min_rows_for,
    int4_activation_dtype,
    int4_unfit_reason,
    onednn_packs,
    quantize_int4,
    quantize_int8,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    w = torch.randn(96, 64).to(dtype)
    b = torch.randn(96).to(dtype) if with_bias else None
    lin = Linear(w, b)
    assert (lin.packed is not None) == onednn_packs(dtype, w.device)
    x = torch.randn(rows, 64).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lin(x.view(1, rows, 64)), F.linear(x, w, b).view(1, rows, 96), atol=1e-2, rtol=1e-2)


def test_float32_is_never_packed() -> None:
    assert not onednn_packs(torch.float32, torch.device("cpu"))


def _on_grid(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight that already is 4-bit blocks of 32 (like a Q4_1 GGUF tensor): code * step + low,
    with codes 0 and 15 present in every block."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // INT4_GROUP, INT4_GROUP), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    step = torch.rand(n, k // INT4_GROUP, 1, generator=g) * 0.01 + 1e-3
    low = -7.5 * step + torch.randn(n, k // INT4_GROUP, 1, generator=g) * 1e-3
    step, low = step.half().float(), low.half().float()  # GGUF keeps fp16 scales and offsets
    return (codes * step + low).view(n, k)


def test_quantize_int4_recovers_a_4bit_grid_exactly() -> None:
    w = _on_grid(64, 96, seed=1)
    codes, step, low = quantize_int4(w)
    back = (codes.view(64, 3, INT4_GROUP).float() * step[..., None] + low[..., None]).view(64, 96)
    assert codes.min() == 0 and codes.max() == 15
    torch.testing.assert_close(back, w, atol=1e-7, rtol=0)
    assert Int4Weight.from_weight(w, torch.bfloat16).error < LOSSLESS_TOLERANCE


def test_auto_takes_int4_only_when_lossless() -> None:
    grid, dense = _on_grid(64, 96, seed=2), torch.randn(64, 96)
    assert Int4Weight.choose(grid, "auto", torch.bfloat16) is not None
    assert Int4Weight.choose(dense, "auto", torch.bfloat16) is None  # off-grid: would lose precision
    forced = Int4Weight.choose(dense, "int4", torch.bfloat16)
    assert forced is not None and 0.3 < forced.error <= 0.5 + 1e-3  # round to nearest: at most half a step
    assert Int4Weight.choose(grid, "none", torch.bfloat16) is None
    with pytest.raises(ValueError, match="not one of"):
        Int4Weight.choose(grid, "int3", torch.bfloat16)


def test_int4_unfit_shapes_are_named() -> None:
    cpu = torch.device("cpu")
    assert int4_unfit_reason((64, 96), torch.bfloat16, cpu) is None
    assert "rows % 16" in (int4_unfit_reason((100, 96), torch.bfloat16, cpu) or "")
    assert "columns % 32" in (int4_unfit_reason((64, 48), torch.bfloat16, cpu) or "")
    assert Int4Weight.choose(_on_grid(64, 96, 3)[:40], "int4", torch.bfloat16) is None  # 40 rows: kernel unfit
    with pytest.raises(ValueError, match="rows % 16"):
        Int4Weight.from_weight(torch.randn(40, 64), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_uses_int4_up_to_max_rows_and_dense_above(dtype: torch.dtype, with_bias: bool) -> None:
    # The int4 form is made from a *different* weight than the dense one, so each call's
    # result shows which kernel ran.
    torch.manual_seed(0)
    w_int4, w_dense = _on_grid(96, 64, seed=4), torch.randn(96, 64) * 0.05
    b = torch.randn(96) if with_bias else None
    q = Int4Weight.from_weight(w_int4, dtype)
    lin = Linear(w_dense.to(dtype), None if b is None else b.to(dtype), q)
    deq = q.dequantize(96, 64)  # what the kernel multiplies by: w_int4 up to the scales' rounding to dtype
    torch.testing.assert_close(deq, w_int4, atol=0.02 if dtype == torch.bfloat16 else 1e-6, rtol=0.01)
    tol = {"atol": 0.05, "rtol": 0.02} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    bias = None if b is None else b.to(dtype).float()
    with torch.inference_mode():
        for rows in (1, 5, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 64):
            x = torch.randn(rows, 64).to(dtype)
            want = F.linear(x.float(), deq if rows <= INT4_MAX_ROWS else w_dense.to(dtype).float(), bias)
            got = lin(x)
            assert got.dtype == dtype and got.shape == (rows, 96)
            torch.testing.assert_close(got.float(), want, **tol)
        x3 = torch.randn(1, 3, 64).to(dtype)  # any leading shape
        torch.testing.assert_close(lin(x3), lin(x3.view(3, 64)).view(1, 3, 96))


def test_float32_run_multiplies_int4_with_bf16_activations() -> None:
    # A float32 run (--dtype auto on a CPU without native bf16) makes its int4 forms for bf16
    # activations (the kernel's fast path): float32 in, float32 out, the input rounded to bf16.
    assert int4_activation_dtype(torch.float32) == torch.bfloat16
    assert int4_activation_dtype(torch.bfloat16) == torch.bfloat16
    torch.manual_seed(1)
    w_int4, w_dense, b = _on_grid(96, 64, seed=6), torch.randn(96, 64) * 0.05, torch.randn(96)
    q = Int4Weight.from_weight(w_int4, int4_activation_dtype(torch.float32))
    lin = Linear(w_dense, b, q)
    with torch.inference_mode():
        x = torch.randn(3, 64)
        got = lin(x)
        assert got.dtype == torch.float32
        want = F.linear(x.bfloat16().float(), q.dequantize(96, 64)) + b
        torch.testing.assert_close(got, want, atol=0.02, rtol=0.01)  # the product is rounded to bf16 too
        x = torch.randn(INT4_MAX_ROWS + 1, 64)  # above: the dense float32 weight, exactly
        torch.testing.assert_close(lin(x), F.linear(x, w_dense, b))


def test_linear_three_forms_by_rows() -> None:
    # int4, dense bf16 and float32 forms made from three different weights: each call's result
    # shows which one ran (int4 <= INT4_MAX_ROWS < dense < fp32_min_rows <= float32).
    torch.manual_seed(0)
    w_int4, w_dense, w_fp32 = _on_grid(96, 64, seed=5), torch.randn(96, 64) * 0.05, torch.randn(96, 64) * 0.05
    b = torch.randn(96)
    q = Int4Weight.from_weight(w_int4, torch.bfloat16)
    lin = Linear(w_dense.bfloat16(), b.bfloat16(), q, fp32_min_rows=40, source=w_fp32, source_bias=b)
    assert lin.weight32 is not None and lin.weight32.dtype == torch.float32
    with torch.inference_mode():
        for rows, want_w in ((1, q.dequantize(96, 64)), (INT4_MAX_ROWS + 1, w_dense.bfloat16().float()),
                             (39, w_dense.bfloat16().float()), (40, w_fp32), (300, w_fp32)):
            x = torch.randn(rows, 64).bfloat16()
            bias = b if want_w is w_fp32 else b.bfloat16().float()
            got = lin(x)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), F.linear(x.float(), want_w, bias), atol=0.05, rtol=0.02)
    assert Linear(w_dense, None, None, fp32_min_rows=1).weight32 is None  # already float32: nothing to add


def test_fp32_min_rows_setting() -> None:
    cpu = torch.device("cpu")
    assert fp32_min_rows_for("off", torch.bfloat16, cpu) is None
    assert fp32_min_rows_for("100", torch.bfloat16, cpu) == 100
    assert fp32_min_rows_for("auto", torch.float32, cpu) is None  # float32 runs need no copy
    want = FP32_MIN_ROWS if onednn_packs(torch.bfloat16, cpu) and not cpu_has_amx() else None
    assert fp32_min_rows_for("auto", torch.bfloat16, cpu) == want
    with pytest.raises(ValueError, match="fp32-matmul-rows"):
        fp32_min_rows_for("0", torch.bfloat16, cpu)


def test_fp32_matmul_rows_flag_is_validated() -> None:
    from lockgate.config import ModelConfig
    for bad in ("0", "-3", "many", "1.5"):
        with pytest.raises(ValueError, match="--fp32-matmul-rows must be auto, off or a row count"):
            ModelConfig(fp32_matmul_rows=bad)
    assert ModelConfig(fp32_matmul_rows="128").fp32_matmul_rows == "128"


def test_fp32_auto_stays_off_when_the_copy_would_not_fit() -> None:
    cpu = torch.device("cpu")
    if fp32_min_rows_for("auto", torch.bfloat16, cpu) is None:
        pytest.skip("auto is off on this CPU anyway (AMX or no oneDNN bf16): nothing to switch off")
    assert fp32_min_rows_for("auto", torch.bfloat16, cpu, fp32_copy_bytes=1 << 60) is None
    assert fp32_min_rows_for("64", torch.bfloat16, cpu, fp32_copy_bytes=1 << 60) == 64  # explicit: obeyed


# ---- groupwise int4 / int8 on lockgate's kernel ------------------------------------------------


@pytest.fixture(scope="module")
def kernels_loaded() -> None:
    from lockgate import kernels

    # A machine that runs the suite has a compiler: a failed build fails these tests, never skips them.
    assert kernels.load(), f"lockgate CPU kernels did not build: {kernels.error()}"


def _on_8bit_grid(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight that already is Q8_0 blocks of 32: code * step, codes in -127..127 with +-127 present
    (and, with a near-certain draw, more than 16 distinct codes: not on any 4-bit grid)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k // INT4_GROUP, INT4_GROUP), generator=g)
    codes[..., 0] = 127
    step = (torch.rand(n, k // INT4_GROUP, 1, generator=g) * 0.01 + 1e-3).half().float()  # GGUF keeps fp16 scales
    return (codes * step).view(n, k)


def test_quantize_int8_recovers_a_q8_0_grid_exactly() -> None:
    w = _on_8bit_grid(64, 96, seed=2)
    codes, step = quantize_int8(w)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127
    torch.testing.assert_close((codes.view(64, 3, INT4_GROUP).float() * step[..., None]).view(64, 96), w,
                               atol=0, rtol=0)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_group_quant_matches_its_dequantized_weight(kernels_loaded, bits: int, dtype: torch.dtype,
                                                    with_bias: bool) -> None:
    n, k = 96, 160  # 5 groups per row; rows not a multiple of any tile size
    w = _on_grid(n, k, seed=7) if bits == 4 else _on_8bit_grid(n, k, seed=7)
    q = GroupQuantWeight.from_weight(w, bits)
    assert q.bits == bits and q.error <= LOSSLESS_TOLERANCE  # lossless on its own grid (up to float rounding)
    torch.testing.assert_close(q.dequantize(n, k), w, atol=1e-6, rtol=1e-6)
    b = torch.randn(n).to(dtype) if with_bias else None
    lin = Linear(torch.randn(n, k).to(dtype), b, q)  # dense weight is different: results show which ran
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 9, INT4_MAX_ROWS):
            x = torch.randn(rows, k).to(dtype)
            want = F.linear(x.float(), w, None if b is None else b.float())
            got = lin(x)
            assert got.dtype == dtype and got.shape == (rows, n)
            tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.01}
            torch.testing.assert_close(got.float(), want, **tol)


def test_choose_quant_takes_the_smallest_lossless_grid(kernels_loaded) -> None:
    grid4, grid8, dense = _on_grid(64, 96, seed=3), _on_8bit_grid(64, 96, seed=3), torch.randn(64, 96) * 0.05
    bf16 = torch.bfloat16
    assert isinstance(choose_quant(grid4, "auto", bf16, kernels=True), Int4Weight)  # torch's int4 where it fits
    q8 = choose_quant(grid8, "auto", bf16, kernels=True)
    assert isinstance(q8, GroupQuantWeight) and q8.bits == 8
    assert choose_quant(dense, "auto", bf16, kernels=True) is None  # would lose precision
    forced = choose_quant(dense, "int4", bf16, kernels=True)
    assert forced.bits == 4 and forced.error > 0.1
    assert choose_quant(grid4, "none", bf16, kernels=True) is None
    # A shape torch's int4 kernel does not take (rows % 16 != 0): lockgate's 4 bits, or nothing without them.
    odd = _on_grid(40, 96, seed=3)
    q4 = choose_quant(odd, "auto", bf16, kernels=True)
    assert isinstance(q4, GroupQuantWeight) and q4.bits == 4
    assert choose_quant(odd, "auto", bf16, kernels=False) is None
    # Without lockgate's kernels: torch's int4 kernel, 4 bits only.
    assert isinstance(choose_quant(grid4, "auto", bf16, kernels=False), Int4Weight)
    assert choose_quant(grid8, "auto", bf16, kernels=False) is None
    with pytest.raises(ValueError, match="int3"):
        choose_quant(grid4, "int3", bf16, kernels=True)


def test_quant_linear_rejects_bad_input(kernels_loaded) -> None:
    op = torch.ops.lockgate.quant_linear
    q = GroupQuantWeight.from_weight(_on_grid(32, 64, seed=1), 4)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        op(x, q.qweight, q.scales, q.zeros, None, 3)
    with pytest.raises(RuntimeError, match="multiple of the group size"):
        op(torch.randn(2, 48), q.qweight, q.scales, q.zeros, None, 4)
    with pytest.raises(RuntimeError, match="zeros are required"):
        op(x, q.qweight, q.scales, None, None, 4)
    with pytest.raises(RuntimeError, match="scales must be"):
        op(x, q.qweight, q.scales[:, :1].contiguous(), q.zeros, None, 4)
    with pytest.raises(RuntimeError, match="bias must be"):
        op(x, q.qweight, q.scales, q.zeros, torch.zeros(31), 4)


@pytest.mark.parametrize("bits", [4, 8])
def test_int_gemm_form_multiplies_the_small_forms_weight(kernels_loaded, bits: int) -> None:
    # The large-call form is made from the same codes and scales as the small-step form: both
    # dequantize to the same weight, and a weight already on the grid comes back exactly.
    from lockgate.layers.linear import IntGemmWeight

    w = _on_grid(96, 64, seed=8) if bits == 4 else _on_8bit_grid(96, 64, seed=8)
    large = IntGemmWeight.from_weight(w, bits)
    small = GroupQuantWeight.from_weight(w, bits)
    assert torch.equal(large.dequantize(96, 64), small.dequantize(96, 64))
    torch.testing.assert_close(large.dequantize(96, 64), w, atol=1e-6, rtol=0)
    if bits == 4:  # torch's int4 form: the same codes, its scales and offsets rounded to bf16
        torch_form = Int4Weight.from_weight(w, torch.bfloat16).dequantize(96, 64)
        torch.testing.assert_close(torch_form, large.dequantize(96, 64), atol=0.02, rtol=0.01)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        IntGemmWeight.from_weight(torch.randn(40, 64), bits)


def test_linear_takes_the_int_gemm_form_for_every_float32_call(kernels_loaded) -> None:
    # Three different weights show which form ran: with an integer-GEMM form, every call of a
    # float32 run takes it (int_linear's few-row path included); without one, the small int4 form
    # takes calls up to INT4_MAX_ROWS rows; 16-bit runs get no integer-GEMM form (they keep oneDNN).
    from lockgate.layers.linear import IntGemmWeight, int_gemm_available

    assert int_gemm_available()  # the suite runs on a CPU with AVX512-VNNI (test_kernels checks the flag)
    torch.manual_seed(0)
    w_small, w_large, w_dense = _on_grid(96, 64, seed=9), _on_grid(96, 64, seed=10), torch.randn(96, 64) * 0.05
    b = torch.randn(96)
    small = Int4Weight.from_weight(w_small, torch.bfloat16)
    assert IntGemmWeight.matching(w_large, None, torch.float32) is None  # no small form: stays dense
    assert IntGemmWeight.matching(w_large, small, torch.bfloat16) is None  # 16-bit run
    large = IntGemmWeight.matching(w_large, small, torch.float32)
    assert large is not None and large.bits == 4 and large.error < 1e-3
    with_large, without = Linear(w_dense, b, small, large=large), Linear(w_dense, b, small)
    assert with_large.small_max_rows == 0 and without.small_max_rows == INT4_MAX_ROWS
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 200):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(with_large(x), F.linear(x, w_large, b), atol=1e-3, rtol=1e-3)
            which = w_small if rows <= INT4_MAX_ROWS else w_dense
            tol = 0.03 if rows <= INT4_MAX_ROWS else 1e-5  # bf16 activations
            torch.testing.assert_close(without(x), F.linear(x, which, b), atol=tol, rtol=tol)


def test_int_gemm_form_is_not_made_where_float16_scales_would_lose_precision(kernels_loaded) -> None:
    # int_linear keeps scales in float16 (GGUF's own precision): a grid whose steps fall below
    # float16's normal range would be rounded, so matching() leaves such a projection without the form.
    from lockgate.layers.linear import IntGemmWeight

    tiny = _on_grid(96, 64, seed=11) * 1e-4  # steps ~1e-7..1e-6: float16 subnormals
    small = GroupQuantWeight.from_weight(tiny, 4)
    assert small.error < 1e-3
    assert IntGemmWeight.from_weight(tiny, 4).error > 1e-3
    assert IntGemmWeight.matching(tiny, small, torch.float32) is None
