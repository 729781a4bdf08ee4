"""GGUF matrices kept in their blocks (``checkpoint.gguf_blocks``) and the integer GEMM form made of
them (``layers.forms.packed_forms``): for every type read directly, the codes and steps give back
bitwise what the ``gguf`` package's own de-quantizer gives (the independent reference), the form
multiplies by exactly those values, and the memory plan counts the bytes the form holds."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lockgate.checkpoint.gguf_blocks import DIRECT_TYPES, STEPS_FLOAT16, QuantMatrix, resident_bytes

SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                "Q6_K": (208,)}


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> QuantMatrix:
    """Random codes (and 6-bit scales and mins for the K-quants), sane float16 scales."""
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype]:
        d = rng.uniform(0.002, 0.02, raw.shape[:2]).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return QuantMatrix(qtype, (rows, cols), raw.reshape(rows, -1))


def gguf_values(qm: QuantMatrix) -> np.ndarray:
    t = gguf.GGMLQuantizationType[qm.qtype]
    return gguf.quants.dequantize(qm.raw, t).astype(np.float32).reshape(qm.shape)


@pytest.mark.parametrize("qtype", DIRECT_TYPES)
def test_codes_and_steps_give_back_the_gguf_packages_values_bitwise(qtype: str) -> None:
    qm = random_blocks(qtype, 24, 512, seed=1)
    want = gguf_values(qm)
    assert np.array_equal(qm.dequantize(), want)
    assert np.array_equal(qm.dequantize(8, 16), want[8:16])  # a row range alone
    codes, step, low = qm.codes()
    assert codes.shape == (24, 512) and step.dtype == np.float32
    assert step.shape == (24, 32 if qtype == "Q6_K" else 16)  # Q6_K: a step per 16 values
    assert (low is not None) == (qtype in ("Q4_0", "Q4_1", "Q4_K", "Q5_K"))
    assert int(codes.min()) >= (0 if qm.bits == 4 else -128) and int(codes.max()) <= (15 if qm.bits == 4 else 127)
    picked = qm.rows(np.array([5, 0, 23]))
    assert np.array_equal(picked.dequantize(), want[[5, 0, 23]])


def test_a_k_quant_matrix_must_be_whole_super_blocks() -> None:
    with pytest.raises(ValueError, match=r"Q4_K blocks of a \[4, 96\] matrix"):
        QuantMatrix("Q4_K", (4, 96), np.zeros((4, 54), np.uint8))


@pytest.mark.parametrize("qtype", DIRECT_TYPES)
def test_the_integer_gemm_form_multiplies_by_the_files_values(qtype: str) -> None:
    from lockgate import kernels
    from lockgate.layers.forms import int_gemm_available, int_gemm_isa, packed_forms

    assert kernels.load(), f"lockgate CPU kernels did not build: {kernels.error()}"
    if not int_gemm_available():
        pytest.skip(f"int_linear has no vector path on this CPU ({int_gemm_isa()})")
    n, k = 48, 512
    qm = random_blocks(qtype, n, k, seed=2)
    forms = packed_forms(qm, kernels=True)
    assert list(forms) == ["int-gemm"]
    other = packed_forms(qm, kernels=True, want={"group-quant"})  # few-row kernel: steps per 32, lows at 4 bits
    assert list(other) == ([] if qtype in ("Q6_K", "Q5_K") else ["group-quant"])
    form = forms["int-gemm"]
    want = torch.from_numpy(gguf_values(qm))
    assert torch.equal(form.dequantize(n, k), want)  # no value re-rounded, float16 or float32 steps
    # the legacy types' steps in float16; a K-quant's as the file factors them (int8 x float16 super)
    assert form.scales.dtype == (torch.float16 if qtype in STEPS_FLOAT16 else torch.uint8)
    held = sum(t.numel() * t.element_size() for t in (form.packed, form.scales, form.zeros) if t is not None)
    assert held == resident_bytes(qtype, n, k)  # what the memory plan counts
    torch.manual_seed(0)
    for rows in (1, 2, 3, 5, 7, 40):  # the few-row (decode) paths and the tiled (prompt) one
        x = torch.randn(rows, k)
        y = form(x, None)
        ref = torch.ops.lockgate.int_linear_reference(x, form.packed, form.scales, form.zeros, form.bits)
        assert torch.equal(y, ref)  # the vector path and the plain C++ one agree bitwise
        exact = (x.double() @ want.double().T).float()
        assert (y - exact).abs().max() <= 1e-4 * exact.abs().max() + 1e-5
    assert torch.equal(form(x[:1], None), y[:1])  # a row's result does not depend on the call's other rows


@pytest.mark.parametrize("qtype", [t for t in DIRECT_TYPES if t in ("Q4_0", "Q4_1", "Q4_K")])
def test_int8_activations_on_the_files_4_bit_blocks(qtype: str) -> None:
    """``--activation-quant int8`` on a file's 4-bit blocks (float16 steps, or a K-quant's factored
    ones): the vector path gives the plain C++ path's bits, near the exact product."""
    from lockgate import kernels
    from lockgate.layers.forms import int_gemm_available, int_gemm_isa, packed_forms

    assert kernels.load(), f"lockgate CPU kernels did not build: {kernels.error()}"
    if not int_gemm_available():
        pytest.skip(f"int_linear has no vector path on this CPU ({int_gemm_isa()})")
    n, k = 48, 512
    qm = random_blocks(qtype, n, k, seed=3)
    form = packed_forms(qm, kernels=True)["int-gemm"].with_int8_activations()
    assert form.decode_layers_args()[0] == 114
    want = torch.from_numpy(gguf_values(qm)).double()
    torch.manual_seed(1)
    for rows in (1, 2, 3, 5, 7, 40):
        x = torch.randn(rows, k)
        y = form(x, None)
        ref = torch.ops.lockgate.int_linear_reference(x, form.packed, form.scales, form.zeros, 4, None, 8)
        assert torch.equal(y, ref)
        exact = x.double() @ want.T
        assert ((y.double() - exact).norm() / exact.norm()) < 0.02  # int8 rounding of x: 0.5-1% here


STACKS = [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q6_K"), ("Q6_K", "Q4_K"), ("Q4_K", "Q5_K"), ("Q4_0", "Q8_0"),
          ("Q4_1", "Q5_0", "Q4_0")]


@pytest.mark.parametrize("types", STACKS, ids="+".join)
def test_a_fused_projection_of_mixed_block_types_stays_in_its_blocks_exactly(types: tuple[str, ...]) -> None:
    """A Q4_K_M file's q, k (Q4_K) and v (Q6_K) fused into one matrix: a ``QuantStack`` on a common
    8-bit grid whose integer GEMM multiplies by each part's own values, as the memory plan counts it."""
    from lockgate import kernels
    from lockgate.checkpoint.gguf_blocks import QuantStack, stack, stacked_resident_bytes
    from lockgate.layers.forms import int_gemm_available, int_gemm_isa, packed_forms
    from lockgate.runner.memory_plan import gguf_weights_bytes

    k = 512
    parts = [random_blocks(t, 16 * (i + 1), k, seed=10 + i) for i, t in enumerate(types)]
    qm = stack(parts)
    assert isinstance(qm, QuantStack) and qm.shape == (sum(p.shape[0] for p in parts), k)
    want = np.concatenate([gguf_values(p) for p in parts])
    assert np.array_equal(qm.dequantize(), want)
    codes, step, low = qm.codes()  # each at its own granularity: w = codes * step + low
    n = qm.shape[0]
    per = k // step.shape[1]
    w = codes.astype(np.float32).reshape(n, -1, per) * step[..., None]
    w = w.reshape(n, k // 32, 32) + (0 if low is None else low[..., None])
    assert np.array_equal(w.reshape(n, k), want)
    assert kernels.load(), f"lockgate CPU kernels did not build: {kernels.error()}"
    if not int_gemm_available():
        pytest.skip(f"int_linear has no vector path on this CPU ({int_gemm_isa()})")
    form = packed_forms(qm, kernels=True)["int-gemm"]
    assert form.bits == 8 and torch.equal(form.dequantize(n, k), torch.from_numpy(want))
    held = sum(t.numel() * t.element_size() for t in (form.packed, form.scales, form.zeros) if t is not None)
    assert held == stacked_resident_bytes([(p.qtype, p.shape[0], k) for p in parts])
    names = ["q_proj", "k_proj", "v_proj"] if len(parts) == 3 else ["gate_proj", "up_proj"]
    table = [(f"model.layers.0.{'self_attn' if len(parts) == 3 else 'mlp'}.{nm}.weight", p.qtype, p.shape)
             for nm, p in zip(names, parts, strict=True)]
    assert gguf_weights_bytes(table, 4, packed=True) == held  # the memory plan counts what is held
    torch.manual_seed(0)
    for rows in (1, 2, 3, 5, 40):
        x = torch.randn(rows, k)
        y = form(x, None)
        ref = torch.ops.lockgate.int_linear_reference(x, form.packed, form.scales, form.zeros, form.bits)
        assert torch.equal(y, ref)
        exact = (x.double() @ torch.from_numpy(want).double().T).float()
        assert (y - exact).abs().max() <= 1e-4 * exact.abs().max() + 1e-5


def test_k_quant_and_legacy_blocks_do_not_stack() -> None:
    from lockgate.checkpoint.gguf_blocks import stack

    with pytest.raises(ValueError, match="K-quant and legacy"):
        stack([random_blocks("Q4_K", 16, 256, 1), random_blocks("Q8_0", 16, 256, 2)])


def test_the_fast_header_reads_what_the_gguf_package_reads(tmp_path) -> None:
    """``GgufHeader`` against ``gguf.GGUFReader`` (the independent reference) on the default model's
    file and on one written here with every kind of metadata value; a cut file is a ValueError."""
    from lockgate.checkpoint.gguf_convert import read_metadata
    from lockgate.checkpoint.gguf_header import GgufHeader
    from lockgate.checkpoint.loader import default_gguf_path

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_uint32("a.u32", 7)
    w.add_int64("a.i64", -3)
    w.add_float32("a.f32", 9.99e-06)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "héllo")
    w.add_array("a.ints", [1, 2, 3])
    w.add_array("a.strs", ["x", "yz"])
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b"])  # stepped over, as read_metadata leaves it out
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_tensor("m", random_blocks("Q4_K", 16, 256, 3).raw.reshape(16, -1), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.add_tensor("v", np.arange(5, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for path in (tmp_path / "t.gguf", default_gguf_path()):
        ours, theirs = GgufHeader(path), gguf.GGUFReader(str(path))
        meta = {k: v for k, v in ours.metadata.items() if not k.startswith("tokenizer.ggml.") or k.endswith("_token_id")}
        assert meta == read_metadata(theirs)
        assert len(ours.tensors) == len(theirs.tensors)
        for a, b in zip(ours.tensors, theirs.tensors, strict=True):
            assert (a.name, a.tensor_type, list(a.shape), a.n_bytes, a.data_offset) == \
                   (b.name, b.tensor_type, list(b.shape), b.n_bytes, b.data_offset)
            assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="cut short|past the end"):
        GgufHeader(tmp_path / "cut.gguf")
    (tmp_path / "no.gguf").write_bytes(b"not a gguf file at all, no")
    with pytest.raises(ValueError, match="magic"):
        GgufHeader(tmp_path / "no.gguf")
