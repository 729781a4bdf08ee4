"""Linear and its forms: each form equals F.linear on the weight it holds; FormChoice picks the
form per row count; make_forms gives a weight the forms it can have without losing precision."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lockgate.kernel_choice import STATIC_SMALL_ROWS, UNBOUNDED, FormChoice
from lockgate.layers.forms import (
    Bf16GemmWeight,
    Fp32Weight,
    GroupQuantWeight,
    Int4Weight,
    IntGemmWeight,
    bf16_gemm_available,
    int4_activation_dtype,
    int4_unfit_reason,
    int_gemm_available,
    int_gemm_isa,
    make_forms,
    onednn_packs,
)
from lockgate.layers.grid import INT4_GROUP, LOSSLESS_TOLERANCE, find_grid, quantize_int4, quantize_int8
from lockgate.layers.linear import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    w = torch.randn(96, 64).to(dtype)
    b = torch.randn(96).to(dtype) if with_bias else None
    lin = Linear(w, b)
    assert set(lin.forms) == {"dense"} and str(lin.choice) == "dense"
    assert (lin.forms["dense"].packed is not None) == onednn_packs(dtype, w.device)
    x = torch.randn(rows, 64).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lin(x.view(1, rows, 64)), F.linear(x, w, b).view(1, rows, 96), atol=1e-2, rtol=1e-2)


def test_float32_is_never_packed() -> None:
    assert not onednn_packs(torch.float32, torch.device("cpu"))


# ---- FormChoice ------------------------------------------------------------------------------


def test_form_choice_picks_by_rows_and_round_trips() -> None:
    c = FormChoice.parse("torch-int4:3,int-gemm:48,dense")
    assert [c.pick(r) for r in (1, 3, 4, 48, 49, 10**6)] == ["torch-int4"] * 2 + ["int-gemm"] * 2 + ["dense"] * 2
    assert FormChoice.parse(str(c)) == c
    assert c.describe() == "torch-int4 1-3, int-gemm 4-48, dense 49+"
    assert FormChoice.parse("dense") == FormChoice.single("dense") and FormChoice.single("fp32").pick(1) == "fp32"
    assert c.names() == {"torch-int4", "int-gemm", "dense"}


@pytest.mark.parametrize("bad", ["", "int-gemm:64", "int-gemm,dense", "int-gemm:x,dense", "turbo", "dense:0,fp32",
                                 "int-gemm:64,fp32:32,dense"])
def test_form_choice_rejects_bad_specs(bad: str) -> None:
    with pytest.raises(ValueError, match="matmul|form|bound|span"):
        FormChoice.parse(bad)


def test_form_choice_restriction_and_fp32_override() -> None:
    c = FormChoice.parse("torch-int4:3,int-gemm:48,dense")
    # a projection without torch-int4 gets dense there (adjacent dense spans merge)
    assert str(c.restricted_to({"dense", "int-gemm"})) == "dense:3,int-gemm:48,dense"
    assert str(c.restricted_to({"dense"})) == "dense"
    # --fp32-matmul-rows N: calls of N rows or more take fp32, the rest keep the choice
    assert str(c.from_rows(20, "fp32")) == "torch-int4:3,int-gemm:19,fp32"
    assert str(c.from_rows(100, "fp32")) == "torch-int4:3,int-gemm:48,dense:99,fp32"
    assert str(c.from_rows(1, "fp32")) == "fp32"
    assert c.from_rows(4, "fp32").spans == ((3, "torch-int4"), (UNBOUNDED, "fp32"))


def test_static_choice_is_quantized_for_small_calls_only() -> None:
    assert str(FormChoice.static({"dense"})) == "dense"
    assert str(FormChoice.static({"dense", "torch-int4", "int-gemm"})) == f"int-gemm:{STATIC_SMALL_ROWS},dense"
    assert str(FormChoice.static({"dense", "group-quant"})) == f"group-quant:{STATIC_SMALL_ROWS},dense"


def test_matmul_forms_flag_is_validated() -> None:
    from lockgate.config import ModelConfig

    assert ModelConfig(matmul_forms="int-gemm:64,dense").matmul_forms == "int-gemm:64,dense"
    with pytest.raises(ValueError, match="unknown matmul form"):
        ModelConfig(matmul_forms="int8")
    for bad in ("0", "-3", "many", "1.5"):
        with pytest.raises(ValueError, match="--fp32-matmul-rows must be auto, off or a row count"):
            ModelConfig(fp32_matmul_rows=bad)


# ---- the forms and which a weight gets ---------------------------------------------------------


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


def _bits_and_loss(source: torch.Tensor, mode: str, kernels: bool) -> tuple[int, float] | None:
    grid = find_grid(source, mode, kernels)
    return None if grid is None else (grid.bits, grid.error)


def test_find_grid_finds_the_smallest_lossless_grid() -> None:
    grid4, dense = _on_grid(64, 96, seed=2), torch.randn(64, 96)
    assert _bits_and_loss(grid4, "auto", kernels=False) == (4, pytest.approx(0, abs=LOSSLESS_TOLERANCE))
    assert _bits_and_loss(dense, "auto", kernels=True) is None  # off-grid: would lose precision
    bits, loss = _bits_and_loss(dense, "int4", kernels=False)
    assert bits == 4 and 0.3 < loss <= 0.5 + 1e-3  # round to nearest: at most half a step
    assert find_grid(grid4, "none", kernels=True) is None
    with pytest.raises(ValueError, match="not one of"):
        find_grid(grid4, "int3", kernels=True)


def _gguf_blocks(qtype_name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """A [rows, cols] weight de-quantized from random ``qtype`` blocks (random codes, sane scales)."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in {"Q4_K": (0, 2), "Q5_0": (0,), "Q4_0": (0,), "Q6_K": (208,)}[qtype_name]:  # the float16 scales
        raw[..., off:off + 2] = np.full(raw.shape[:2], 0.01, np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(gguf.quants.dequantize(raw.reshape(rows, -1), qtype).astype(np.float32))


@pytest.mark.parametrize("sample_rows", [256, 8], ids=["whole", "sample-first"])
@pytest.mark.parametrize(("qtype", "bits"), [("Q4_K", 4), ("Q4_0", 4), ("Q5_0", 8), ("Q6_K", None)])
def test_find_grid_finds_gguf_grids_whose_codes_do_not_reach_both_ends(monkeypatch, qtype: str, bits: int | None,
                                                                       sample_rows: int) -> None:
    """Q4_K's fitted minimum sits below its lowest code, Q5_0's codes span 32 of the 255 an 8-bit grid
    has: the range-based step misses both; the values still lie on a grid the kernels run exactly.
    Q6_K's two scales per 32 columns do not (it stays dense). The same when a few rows are tried
    first (what a weight of more than ``GRID_SAMPLE_ROWS`` rows gets)."""
    from lockgate.layers import grid as grid_mod

    monkeypatch.setattr(grid_mod, "GRID_SAMPLE_ROWS", sample_rows)
    w = _gguf_blocks(qtype, 64, 256, seed=3)
    searched_rows: list[int] = []
    real_of = grid_mod.Grid.of
    monkeypatch.setattr(grid_mod.Grid, "of", staticmethod(lambda src, b: searched_rows.append(src.shape[0])
                                                           or real_of(src, b)))
    found = _bits_and_loss(w, "auto", kernels=True)
    assert (found[0] if found else None) == bits
    if sample_rows == 8:  # 8 rows first; the whole weight only for the grid it lies on
        assert searched_rows == ([8, 64] if bits == 4 else [8, 8, 64] if bits == 8 else [8, 8])
    if bits is not None:
        form = GroupQuantWeight.from_weight(w, bits)
        assert form.error <= LOSSLESS_TOLERANCE
        torch.testing.assert_close(form.dequantize(64, 256), w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("qtype", "bits"), [("Q4_K", 4), ("Q5_0", 8)])
def test_a_weights_quantized_forms_search_its_grid_once(monkeypatch, qtype: str, bits: int) -> None:
    """make_forms searches a weight's grid once (a K-quant grid search sorts every group) and every
    quantized form takes its codes from it: the same tensors as each form searching on its own."""
    from lockgate import kernels as cpu_kernels
    from lockgate.layers import grid as grid_mod
    from lockgate.layers.forms import IntGemmWeight

    assert cpu_kernels.load(), cpu_kernels.error()
    w = _gguf_blocks(qtype, 64, 256, seed=4)
    searched = {4: 0, 8: 0}
    for b, name in ((4, "quantize_int4"), (8, "quantize_int8")):
        real = getattr(grid_mod, name)
        monkeypatch.setattr(grid_mod, name, lambda *a, _real=real, _b=b, **k: searched.__setitem__(_b, searched[_b] + 1)
                            or _real(*a, **k))
    made = make_forms(w, torch.bfloat16, "auto", kernels=True)
    assert searched == ({4: 1, 8: 0} if bits == 4 else {4: 1, 8: 1})  # auto tries 4 bits first
    alone = {"group-quant": GroupQuantWeight.from_weight(w, bits)}
    if bits == 4:
        alone["torch-int4"] = Int4Weight.from_weight(w, torch.bfloat16)
    assert set(alone) <= set(made)
    if "int-gemm" in made:  # (made only where its float16 scales hold the grid exactly)
        alone["int-gemm"] = IntGemmWeight.from_weight(w, bits)
    for name, form in alone.items():
        for field in dataclasses.fields(form):
            a, b = getattr(made[name], field.name), getattr(form, field.name)
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), (name, field.name)


def test_int4_unfit_shapes_are_named() -> None:
    cpu = torch.device("cpu")
    assert int4_unfit_reason((64, 96), torch.bfloat16, cpu) is None
    assert "rows % 16" in (int4_unfit_reason((100, 96), torch.bfloat16, cpu) or "")
    assert "columns % 32" in (int4_unfit_reason((64, 48), torch.bfloat16, cpu) or "")
    assert "torch-int4" not in make_forms(_on_grid(64, 96, 3)[:40], torch.bfloat16, "int4", kernels=False)
    with pytest.raises(ValueError, match="rows % 16"):
        Int4Weight.from_weight(torch.randn(40, 64), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_takes_each_form_where_its_choice_says(dtype: torch.dtype, with_bias: bool) -> None:
    # The int4 form is made from a *different* weight than the dense one, so each call's
    # result shows which kernel ran.
    torch.manual_seed(0)
    w_int4, w_dense = _on_grid(96, 64, seed=4), torch.randn(96, 64) * 0.05
    b = torch.randn(96) if with_bias else None
    q = Int4Weight.from_weight(w_int4, int4_activation_dtype(dtype))
    lin = Linear(w_dense.to(dtype), None if b is None else b.to(dtype), {"torch-int4": q})
    assert str(lin.choice) == f"torch-int4:{STATIC_SMALL_ROWS},dense"  # the static choice until told otherwise
    deq = q.dequantize(96, 64)  # what the kernel multiplies by: w_int4 up to the scales' rounding to bf16
    torch.testing.assert_close(deq, w_int4, atol=0.02, rtol=0.01)
    tol = {"atol": 0.05, "rtol": 0.02}  # bf16 activations in the int4 form (float32 runs too)
    bias = None if b is None else b.to(dtype).float()
    with torch.inference_mode():
        for limit in (STATIC_SMALL_ROWS, 4):
            lin.choose(FormChoice.parse(f"torch-int4:{limit},dense"))
            for rows in (1, limit, limit + 1, 64):
                x = torch.randn(rows, 64).to(dtype)
                want = F.linear(x.float(), deq if rows <= limit else w_dense.to(dtype).float(), bias)
                got = lin(x)
                assert got.dtype == dtype and got.shape == (rows, 96)
                torch.testing.assert_close(got.float(), want, **(tol if rows <= limit else {"atol": 0.02, "rtol": 0.02}))
        x3 = torch.randn(1, 3, 64).to(dtype)  # any leading shape
        torch.testing.assert_close(lin(x3), lin(x3.view(3, 64)).view(1, 3, 96))
    lin.choose(FormChoice.single("group-quant"))  # a form it lacks: dense
    assert str(lin.choice) == "dense"


def test_float32_run_multiplies_int4_with_bf16_activations() -> None:
    # A float32 run makes its int4 forms for bf16 activations (the kernel's fast path): float32
    # in, float32 out, the input rounded to bf16.
    assert int4_activation_dtype(torch.float32) == torch.bfloat16
    assert int4_activation_dtype(torch.bfloat16) == torch.bfloat16
    torch.manual_seed(1)
    w_int4, w_dense, b = _on_grid(96, 64, seed=6), torch.randn(96, 64) * 0.05, torch.randn(96)
    q = Int4Weight.from_weight(w_int4, int4_activation_dtype(torch.float32))
    lin = Linear(w_dense, b, {"torch-int4": q}, FormChoice.parse("torch-int4:8,dense"))
    with torch.inference_mode():
        x = torch.randn(3, 64)
        got = lin(x)
        assert got.dtype == torch.float32
        want = F.linear(x.bfloat16().float(), q.dequantize(96, 64)) + b
        torch.testing.assert_close(got, want, atol=0.02, rtol=0.01)  # the product is rounded to bf16 too
        x = torch.randn(9, 64)  # above: the dense float32 weight, exactly
        torch.testing.assert_close(lin(x), F.linear(x, w_dense, b))


def test_linear_three_forms_by_rows() -> None:
    # int4, dense bf16 and float32 forms made from three different weights: each call's result
    # shows which one ran. The fp32 form keeps the unrounded float32 bias of its own.
    torch.manual_seed(0)
    w_int4, w_dense, w_fp32 = _on_grid(96, 64, seed=5), torch.randn(96, 64) * 0.05, torch.randn(96, 64) * 0.05
    b = torch.randn(96)
    q = Int4Weight.from_weight(w_int4, torch.bfloat16)
    lin = Linear(w_dense.bfloat16(), b.bfloat16(), {"torch-int4": q, "fp32": Fp32Weight(w_fp32, b)},
                 FormChoice.parse("torch-int4:16,dense:39,fp32"))
    with torch.inference_mode():
        for rows, want_w in ((1, q.dequantize(96, 64)), (17, w_dense.bfloat16().float()),
                             (39, w_dense.bfloat16().float()), (40, w_fp32), (300, w_fp32)):
            x = torch.randn(rows, 64).bfloat16()
            bias = b if want_w is w_fp32 else b.bfloat16().float()
            got = lin(x)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), F.linear(x.float(), want_w, bias), atol=0.05, rtol=0.02)
    lin.choose(FormChoice.parse("torch-int4:16,dense"))
    lin.drop_unchosen()
    assert set(lin.forms) == {"dense", "torch-int4"}  # the float32 copy is freed


def test_fp32_form_only_for_16_bit_runs() -> None:
    w = torch.randn(32, 64)
    assert "fp32" in make_forms(w, torch.bfloat16, "none", kernels=False, fp32=True)
    assert make_forms(w, torch.float32, "none", kernels=False, fp32=True) == {}  # already float32
    assert make_forms(w, torch.bfloat16, "none", kernels=False, fp32=False) == {}


# ---- groupwise int4 / int8 on lockgate's kernels -------------------------------------------------


@pytest.fixture(scope="module")
def kernels_loaded() -> None:
    from lockgate import kernels

    # A machine that runs the suite has a compiler: a failed build fails these tests, never skips them.
    assert kernels.load(), f"lockgate CPU kernels did not build: {kernels.error()}"


def _needs_int_gemm() -> None:
    if not int_gemm_available():
        pytest.skip(f"int_linear has no vector path on this CPU ({int_gemm_isa()}): the int-gemm form is not made")


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
    lin = Linear(torch.randn(n, k).to(dtype), b, {"group-quant": q}, FormChoice.single("group-quant"))
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 9, 16, 40):
            x = torch.randn(rows, k).to(dtype)
            want = F.linear(x.float(), w, None if b is None else b.float())
            got = lin(x)
            assert got.dtype == dtype and got.shape == (rows, n)
            tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.01}
            torch.testing.assert_close(got.float(), want, **tol)


def test_make_forms_gives_the_smallest_lossless_grid(kernels_loaded) -> None:
    grid4, grid8, dense = _on_grid(64, 96, seed=3), _on_8bit_grid(64, 96, seed=3), torch.randn(64, 96) * 0.05
    bf16, f32 = torch.bfloat16, torch.float32
    quantized = {"torch-int4", "group-quant"} | ({"int-gemm"} if int_gemm_available() else set())
    four = make_forms(grid4, f32, "auto", kernels=True)
    assert set(four) == quantized and all(getattr(f, "bits", 4) == 4 for f in four.values())
    eight = make_forms(grid8, bf16, "auto", kernels=True)
    # bf16 runs also get lockgate's bf16 kernel where it was built (not a quantized form: the same weight)
    bf16_kernel = {"bf16-gemm"} if bf16_gemm_available() else set()
    assert set(eight) == (quantized - {"torch-int4"}) | bf16_kernel  # torch has no 8-bit groups
    assert all(f.bits == 8 and f.error <= LOSSLESS_TOLERANCE for n, f in eight.items() if n != "bf16-gemm")
    assert make_forms(dense, f32, "auto", kernels=True) == {}  # would lose precision
    forced = make_forms(dense, bf16, "int4", kernels=True)
    assert forced["group-quant"].bits == 4 and forced["group-quant"].error > 0.1
    assert make_forms(grid4, f32, "none", kernels=True) == {}
    # A shape torch's int4 kernel does not take (rows % 16 != 0): lockgate's forms only, or none without them.
    odd = make_forms(_on_grid(40, 96, seed=3), f32, "auto", kernels=True)
    assert set(odd) == {"group-quant"}  # int-gemm needs rows % 16 == 0 too
    assert make_forms(_on_grid(40, 96, seed=3), f32, "auto", kernels=False) == {}
    # Without lockgate's kernels: torch's int4 kernel, 4 bits only.
    assert set(make_forms(grid4, bf16, "auto", kernels=False)) == {"torch-int4"}
    assert make_forms(grid8, bf16, "auto", kernels=False) == {}
    # want: only what a measured table calls
    assert set(make_forms(grid4, f32, "auto", kernels=True, want={"torch-int4"})) == {"torch-int4"}


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
    # The integer-GEMM form is made from the same codes and scales as the other forms: all
    # dequantize to the same weight, and a weight already on the grid comes back exactly.
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_runs_the_int_gemm_form_in_either_dtype(kernels_loaded, dtype: torch.dtype) -> None:
    # Different weights show which form ran; a 16-bit run widens x for the kernel (exactly) and
    # rounds the result once.
    _needs_int_gemm()
    torch.manual_seed(0)
    w_int, w_dense = _on_grid(96, 64, seed=10), torch.randn(96, 64) * 0.05
    b = torch.randn(96)
    forms = make_forms(w_int, dtype, "auto", kernels=True)
    assert "int-gemm" in forms and forms["int-gemm"].error < 1e-3
    lin = Linear(w_dense.to(dtype), b.to(dtype), forms, FormChoice.parse("int-gemm:100,dense"))
    tol = 1e-3 if dtype == torch.float32 else 0.05
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 7, 16, 100, 101, 200):
            x = torch.randn(rows, 64).to(dtype)
            got = lin(x)
            assert got.dtype == dtype
            which = w_int if rows <= 100 else w_dense.to(dtype).float()
            torch.testing.assert_close(got.float(), F.linear(x.float(), which, b.to(dtype).float()), atol=tol, rtol=tol)


def test_int_gemm_form_is_not_made_where_float16_scales_would_lose_precision(kernels_loaded) -> None:
    # int_linear keeps scales in float16 (GGUF's own precision): a grid whose steps fall below
    # float16's normal range would be rounded, so make_forms leaves such a projection without it.
    _needs_int_gemm()
    tiny = _on_grid(96, 64, seed=11) * 1e-4  # steps ~1e-7..1e-6: float16 subnormals
    assert GroupQuantWeight.from_weight(tiny, 4).error < 1e-3
    assert IntGemmWeight.from_weight(tiny, 4).error > 1e-3
    forms = make_forms(tiny, torch.float32, "auto", kernels=True)
    assert "int-gemm" not in forms and "group-quant" in forms


class _CountedForm:
    """A form whose results depend on the call's row count below ``exact_from`` rows (it adds
    a tiny offset there, as a kernel with another accumulation order would), and that records
    the row counts it was called with. A stand-in for sgemm's small-call path: the real kernels'
    behaviour differs by CPU, so the mechanism is tested on a form whose behaviour is known. It
    multiplies x rounded to integers by an integer weight, so its sums are exact in any order."""

    name = "dense"

    def __init__(self, weight: torch.Tensor, exact_from: int) -> None:
        self.weight, self.exact_from, self.calls = weight, exact_from, []

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.calls.append(x.shape[0])
        y = F.linear(x.round(), self.weight, bias)
        return y + 1e-3 if x.shape[0] < self.exact_from else y

    def decode_layers_args(self) -> None:
        return None


def test_prompt_rows_run_on_the_prompt_form_padded_to_its_floor() -> None:
    from lockgate.layers.linear import PromptForm

    torch.manual_seed(0)
    w = torch.randint(-4, 5, (32, 64)).float()
    lin = Linear(w)
    form = _CountedForm(w, exact_from=4)
    lin.forms["dense"] = form
    lin.forms["int-gemm"] = _CountedForm(w, exact_from=1)  # stands for the decode rows' form
    lin.choose(FormChoice.parse("int-gemm:8,dense"))
    lin.set_prompt_form(PromptForm("dense", min_rows=4))
    x = torch.randint(-4, 5, (20, 64)).float()
    want = F.linear(x, w)
    # a one-token prompt chunk (a prefix-cache hit on all but its last token) is padded to 4 rows
    assert torch.equal(lin(x[:1], prompt_rows=True), want[:1]) and form.calls == [4]
    # 2 decode rows and 1 prompt row: one call on the prompt form, padded to its floor
    form.calls.clear()
    assert torch.equal(lin(x[:3], prompt_rows=True), want[:3]) and form.calls == [4]
    # 12 decode rows and 8 prompt rows: one call of 20
    form.calls.clear()
    assert torch.equal(lin(x, prompt_rows=True), want) and form.calls == [20]
    # decode rows alone keep their own form by count (int-gemm up to 8 rows) ...
    form.calls.clear()
    assert torch.equal(lin(x[:5]), want[:5]) and form.calls == []
    # ... and where that count picks the prompt form, it is padded like prompt rows
    lin.choose(FormChoice.parse("int-gemm:1,dense"))
    assert torch.equal(lin(x[:3]), want[:3]) and form.calls == [4]
    # without a prompt form every call goes by count, unpadded: here 2 rows on dense, which this
    # form computes differently
    lin.set_prompt_form(None)
    form.calls.clear()
    assert not torch.equal(lin(x[:2], prompt_rows=True), want[:2]) and form.calls == [2]
    with pytest.raises(ValueError, match="not one of this projection's forms"):
        lin.set_prompt_form(PromptForm("torch-int4"))


def test_row_invariance_check_finds_the_floor_or_refuses() -> None:
    from lockgate.runner.row_invariance import cheapest_invariant, first_invariant, min_rows_for, row_floors

    torch.manual_seed(0)
    w = torch.randint(-4, 5, (32, 64)).float()
    assert min_rows_for(_CountedForm(w, 1), None, 64, torch.float32, 256) == 1
    assert min_rows_for(_CountedForm(w, 3), None, 64, torch.float32, 256) == 4
    assert min_rows_for(_CountedForm(w, 100), None, 64, torch.float32, 256) is None  # no floor of <= 32 rows helps
    form = _CountedForm(w, 1)
    min_rows_for(form, None, 64, torch.float32, 256)
    # a large call is checked from the front and from the back of the reference; the reference's own
    # size once more (front and back are the same rows: a second identical call would add nothing)
    assert form.calls.count(255) == 2 and form.calls.count(256) == 2

    class Erratic(_CountedForm):  # a result that depends on where a row sits in the call
        def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            y = F.linear(x.round(), self.weight, bias)
            y[-1:] += 1e-3
            return y

    assert min_rows_for(Erratic(w, 1), None, 64, torch.float32, 256) is None
    good, bad = Linear(w), Linear(w)
    good.forms["int-gemm"] = _CountedForm(w, 2)
    bad.forms["dense"] = Erratic(w, 1)
    floors = row_floors({"o": [good], "down": [bad]}, torch.float32,
                        {"o": ["dense", "int-gemm"], "down": ["dense", "int-gemm"]}, 64)
    assert floors["down"] == {"dense": None}  # down has no int-gemm form; its dense is erratic
    assert floors["o"]["int-gemm"] == 2
    # --exact-prefill takes the first invariant candidate, --deterministic the cheapest measured one
    from lockgate.layers.linear import PromptForm

    o = {"dense": 1, "int-gemm": 2}
    assert first_invariant(o, ["int-gemm", "dense"]) == PromptForm("int-gemm", 2)
    assert first_invariant(floors["down"], ["dense", "int-gemm"]) is None
    samples = {"dense": {"1": [0.05], "512": [1.0]}, "int-gemm": {"1": [0.02], "512": [3.0]}}
    assert cheapest_invariant(o, samples) == PromptForm("dense", 1)
    assert cheapest_invariant({"dense": None, "int-gemm": 2}, samples) == PromptForm("int-gemm", 2)
    assert cheapest_invariant(o, {}) == PromptForm("int-gemm", 2)  # nothing measured: the integer GEMM
    # cached floors naming a form one of the role's projections lacks (not built at this start)
    # are not picked: that projection's prompt rows would go by row count under the form's name
    from lockgate.runner.row_invariance import built_floors

    lacking = Linear(w)
    assert built_floors(o, [good, lacking]) == {"dense": 1}
    assert first_invariant(built_floors(o, [good, lacking]), ["int-gemm", "dense"]) == PromptForm("dense", 1)
    assert first_invariant(built_floors({"int-gemm": 2}, [good, lacking]), ["int-gemm", "dense"]) is None
    # ... and the check itself passes over a form only some of a role's projections have (a GGUF
    # mixing 4- and 6-bit layers gives the integer GEMM to some): it could never be the role's form
    some = _CountedForm(w, 1)
    half = Linear(w)
    half.forms["int-gemm"] = some
    checked = row_floors({"o": [half, Linear(w)]}, torch.float32, {"o": ["int-gemm", "dense"]}, 64, first_only=True)
    assert "int-gemm" not in checked["o"] and "dense" in checked["o"] and not some.calls
    # --exact-prefill's check stops at a role's first invariant candidate; the later ones are never called
    first, later = _CountedForm(w, 1), _CountedForm(w, 1)
    lin = Linear(w)
    lin.forms["dense"], lin.forms["int-gemm"] = first, later
    assert row_floors({"o": [lin]}, torch.float32, {"o": ["dense", "int-gemm"]}, 64, first_only=True) == {"o": {"dense": 1}}
    assert first.calls and not later.calls
    first.exact_from = 40  # not invariant (no floor of <= 32 rows helps): the next candidate is checked
    assert row_floors({"o": [lin]}, torch.float32, {"o": ["dense", "int-gemm"]}, 64, first_only=True) \
        == {"o": {"dense": None, "int-gemm": 1}}


def test_row_check_covers_fewer_rows_of_a_wide_projection(monkeypatch) -> None:
    from lockgate.runner import row_invariance as ri

    assert ri.covered_rows(576) == ri.covered_rows(8192) == ri.COVERED_ROWS
    assert ri.covered_rows(4 * 8192) == ri.COVERED_ROWS // 4
    assert ri.covered_rows(262_144) == ri.MIN_COVERED_ROWS  # a 262,144-token vocabulary's LM head
    torch.manual_seed(0)
    w = torch.randint(-4, 5, (32, 64)).float()
    calls = {}
    for covered in (ri.MIN_COVERED_ROWS, ri.COVERED_ROWS):
        form = _CountedForm(w, 3)
        assert ri.min_rows_for(form, None, 64, torch.float32, 256, covered=covered) == 4  # the same floor
        calls[covered] = len(form.calls)
    assert calls[ri.MIN_COVERED_ROWS] * 3 < calls[ri.COVERED_ROWS]  # with far fewer calls

    class Rarely(_CountedForm):  # wrong on one 1-row call in 40: what fewer covered rows can miss
        def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            y = F.linear(x.round(), self.weight, bias)
            self.calls.append(x.shape[0])
            return y + 1e-3 if x.shape[0] == 1 and self.calls.count(1) % 40 == 0 else y

    assert ri.min_rows_for(Rarely(w, 1), None, 64, torch.float32, 256, covered=ri.COVERED_ROWS) != 1
    assert ri.min_rows_for(Rarely(w, 1), None, 64, torch.float32, 256, covered=ri.MIN_COVERED_ROWS) == 1
    # row_floors sizes the coverage by the projection's outputs (its weight's rows)
    seen = []
    monkeypatch.setattr(ri, "covered_rows", lambda outputs: seen.append(outputs) or ri.MIN_COVERED_ROWS)
    lin = Linear(w)
    lin.forms["dense"] = form = _CountedForm(w, 1)
    assert ri.row_floors({"o": [lin]}, torch.float32, {"o": ["dense"]}, 256) == {"o": {"dense": 1}}
    assert seen == [32] and form.calls.count(1) == ri.MIN_COVERED_ROWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int_gemm_rows_never_depend_on_the_call_size(kernels_loaded, dtype: torch.dtype) -> None:
    """The integer GEMM is the fallback prompt form where dense is not row-invariant: the check
    must accept it at floor 1 on every CPU its vector path runs on."""
    from lockgate.runner.row_invariance import min_rows_for

    if not int_gemm_available():
        pytest.skip(f"int_linear has no vector path on this CPU ({int_gemm_isa()})")
    torch.manual_seed(1)
    form = IntGemmWeight.from_weight(torch.randn(64, 128), bits=8)
    assert min_rows_for(form, None, 128, dtype, 300) == 1


def _bf16_gemm_or_skip() -> None:
    if not bf16_gemm_available():
        pytest.skip("lockgate::bf16_linear is built only for CPUs with AVX512-BF16; this one has none, so "
                    "bf16 runs do not get the form (test_make_forms_gives_the_smallest_lossless_grid checks that)")


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_form_computes_the_dense_product(kernels_loaded, with_bias: bool) -> None:
    """lockgate's bf16 kernel multiplies exactly the dense form's bf16 weight: every product exact,
    float32 sums, one rounding, so each output is the float64 product of the same bf16 numbers
    rounded once more (to within the float32 sums' error and one bf16 rounding). Shapes with
    output blocks that do not fill a tile (N = 16 * 7) and row counts that leave uneven row blocks."""
    _bf16_gemm_or_skip()
    torch.manual_seed(5)
    n, k = 112, 200
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if with_bias else None
    form = Bf16GemmWeight(w)
    assert torch.equal(form.dequantize(n, k), w.float())  # the layout holds the weight unchanged
    lin = Linear(w, b, {"bf16-gemm": form}, FormChoice.single("bf16-gemm"))
    with torch.inference_mode():
        for rows in (1, 2, 5, 6, 7, 13, 32, 97):
            x = torch.randn(rows, k).to(torch.bfloat16)
            got = lin(x)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            exact = x.double() @ w.double().t() + (0 if b is None else b.double())
            # one bf16 rounding (2^-8 relative) plus float32 sums over 200 products
            err = (got.double() - exact).abs()
            assert bool((err <= exact.abs() * 2.0 ** -8 + 1e-3 * (x.double().abs() @ w.double().abs().t())).all())
            # and what the dense form gives, up to rounding differences
            torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=0.05, rtol=0.02)


def test_bf16_gemm_rows_never_depend_on_the_call_size_or_threads(kernels_loaded) -> None:
    """Row-invariant by construction: a row's outputs are bitwise the same in a call of any size,
    at any position, on one thread or two (the row check accepts it at floor 1)."""
    from lockgate.runner.row_invariance import min_rows_for

    _bf16_gemm_or_skip()
    torch.manual_seed(2)
    n, k = 80, 96
    form = Bf16GemmWeight(torch.randn(n, k).to(torch.bfloat16))
    x = torch.randn(61, k).to(torch.bfloat16)
    with torch.inference_mode():
        whole = form(x, None)
        for lo, hi in ((0, 1), (7, 8), (3, 9), (0, 32), (29, 61)):
            assert torch.equal(form(x[lo:hi], None), whole[lo:hi])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(form(x, None), whole)
        finally:
            torch.set_num_threads(threads)
    assert min_rows_for(form, None, k, torch.bfloat16, 300) == 1


def test_bf16_gemm_stolen_tiles_are_computed_once(kernels_loaded) -> None:
    """With 8 threads on this machine's cores, threads lose their core mid-call and the others
    take their unstarted tiles (steal.h); every output block is still computed exactly once, the
    same bits as on one thread, for block counts below, at and above the thread count and runs
    that end in a partial tile."""
    _bf16_gemm_or_skip()
    before = torch.get_num_threads()
    try:
        for n, m in ((16, 5), (48, 1), (80, 61), (272, 7), (3072, 33)):
            gen = torch.Generator().manual_seed(n)
            form = Bf16GemmWeight(torch.randn(n, 96, generator=gen).to(torch.bfloat16))
            x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
            with torch.inference_mode():
                torch.set_num_threads(1)
                want = form(x, None)
                torch.set_num_threads(8)
                for _ in range(3):
                    assert torch.equal(form(x, None), want)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_with_silu_is_silu_mul_of_the_product_bitwise(kernels_loaded, with_bias: bool) -> None:
    """bf16_linear_silu(x, gate_up) is silu_mul(bf16_linear(x, gate_up)) bit for bit: the gate and up
    outputs rounded to bf16 as the product would be, then silu_mul's arithmetic in registers. Gate
    halves of 16 * 1, 16 * 3, 16 * 5 and the default model's 1536 outputs (units of one and two gate
    blocks), rows that leave uneven row blocks, one thread and eight (stolen units), a row whose
    gate and up sums are inf and NaN (an inf and a -inf in x) and one whose sums overflow."""
    _bf16_gemm_or_skip()
    before = torch.get_num_threads()
    try:
        for f, k in ((16, 64), (48, 96), (80, 128), (1536, 576)):
            gen = torch.Generator().manual_seed(f)
            w = (0.1 * torch.randn(2 * f, k, generator=gen)).to(torch.bfloat16)
            packed = Bf16GemmWeight(w).packed
            b = torch.randn(2 * f, generator=gen).to(torch.bfloat16) if with_bias else None
            for rows in (1, 5, 7, 13, 40):
                x = (4 * torch.randn(rows, k, generator=gen)).to(torch.bfloat16)
                x[rows // 2, :2] = torch.tensor([float("inf"), float("-inf")])  # sums of inf and NaN
                if rows > 2:  # finite products whose sum overflows (gate output 0's, at least)
                    x[0] = (2.0 ** 127 * torch.sign(w[0].float())).to(torch.bfloat16)
                product = torch.ops.lockgate.bf16_linear(x, packed, b).float()
                assert bool(product[rows // 2].isnan().any()) and bool(product[rows // 2].isinf().any())
                assert rows <= 2 or bool(product[0].isinf().any())
                for threads in (1, 8):
                    torch.set_num_threads(threads)
                    with torch.inference_mode():
                        want = torch.ops.lockgate.silu_mul(torch.ops.lockgate.bf16_linear(x, packed, b))
                        got = torch.ops.lockgate.bf16_linear_silu(x, packed, b)
                    assert got.shape == (rows, f) and got.dtype == torch.bfloat16
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (f, rows, threads)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="even number of 16-row blocks"):  # 3 blocks: no gate / up halves
        torch.ops.lockgate.bf16_linear_silu(torch.randn(2, 64).to(torch.bfloat16),
                                            Bf16GemmWeight(torch.randn(48, 64).to(torch.bfloat16)).packed, None)


def test_bf16_gemm_rejects_bad_input(kernels_loaded) -> None:
    _bf16_gemm_or_skip()
    op = torch.ops.lockgate.bf16_linear
    w = Bf16GemmWeight(torch.randn(32, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(torch.randn(2, 64), w.packed, None)  # float32 x
    with pytest.raises(RuntimeError, match="K / 2"):
        op(torch.randn(2, 32).to(torch.bfloat16), w.packed, None)  # K does not match
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.randn(2, 64).to(torch.bfloat16), w.packed, torch.randn(31))
    with pytest.raises(ValueError, match="N % 16"):
        Bf16GemmWeight(torch.randn(40, 64).to(torch.bfloat16))


def test_drop_unchosen_frees_what_no_call_uses(kernels_loaded) -> None:
    """A measured table is final: forms it never calls go, and so does dense's oneDNN copy when
    neither the table nor the prompt form calls dense (dense itself stays: it is the weight)."""
    from lockgate.layers.linear import PromptForm

    _bf16_gemm_or_skip()
    w = torch.randn(64, 96).to(torch.bfloat16)
    x = torch.randn(5, 96).to(torch.bfloat16)
    lin = Linear(w, None, {"bf16-gemm": Bf16GemmWeight(w)}, FormChoice.single("bf16-gemm"))
    want = lin(x)
    lin.drop_unchosen()
    assert set(lin.forms) == {"dense", "bf16-gemm"} and lin.forms["dense"].packed is None
    assert torch.equal(lin(x), want)
    torch.testing.assert_close(lin.forms["dense"](x, None).float(), want.float(), atol=0.05, rtol=0.02)
    kept = Linear(w, None, {"bf16-gemm": Bf16GemmWeight(w)}, FormChoice.single("bf16-gemm"))
    kept.set_prompt_form(PromptForm("dense", min_rows=1))
    kept.drop_unchosen()  # dense serves prompt rows: its packed copy stays
    assert (kept.forms["dense"].packed is not None) == onednn_packs(torch.bfloat16, w.device)


def test_f32_dot_form_multiplies_the_dense_weight_in_place(kernels_loaded) -> None:
    """A float32 run's projections get lockgate's float32 kernel as a form that shares the dense
    weight (no copy), row-invariant from one row; 16-bit runs and runs without kernels do not."""
    from lockgate.layers.forms import f32_dot_available

    assert f32_dot_available()
    w = torch.randn(64, 96) * 0.05
    forms = make_forms(w, torch.float32, "none", kernels=True, dense=w)
    assert set(forms) == {"f32-dot"} and forms["f32-dot"].weight.data_ptr() == w.data_ptr()
    lin = Linear(w, None, forms, FormChoice.parse("f32-dot:8,dense"))
    x = torch.randn(5, 96)
    torch.testing.assert_close(lin(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert torch.equal(lin(x[2:3]), lin(x)[2:3])  # one row alone: the same bits
    assert make_forms(w, torch.float32, "none", kernels=False, dense=w) == {}
    assert "f32-dot" not in make_forms(w, torch.bfloat16, "none", kernels=True, dense=w.bfloat16())
    assert make_forms(w, torch.float32, "none", kernels=True, dense=w, want={"dense"}) == {}
