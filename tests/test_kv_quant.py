"""The 8-bit KV pool (``--kv-cache-dtype int8 / fp8``) in the kernels: the write path quantizes each
(token, kv head) row as ``lockgate.layers.kv_quant.quantize`` does (the same bytes), and decode and
prefill attention read the codes in place, matching a float64 reference computed on the de-quantized
values, with each token's result bitwise its own whatever else is in the call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lockgate import kernels
from lockgate.kvcache import kv_dtype
from lockgate.layers import kv_quant
from lockgate.layers.rope import RotaryEmbedding, apply_rope

KINDS = ["int8", "fp8"]


@pytest.fixture(scope="module")
def ops():
    assert kernels.load(), f"lockgate CPU kernels did not build: {kernels.error()}"
    return torch.ops.lockgate


def test_format_names_and_bytes() -> None:
    assert kv_dtype.canonical("fp8_e4m3") == "fp8" and kv_dtype.is_quantized("int8")
    assert not kv_dtype.is_quantized("auto")
    # SmolLM2-135M (30 layers, 3 kv heads of 64): 128 bytes a row in bf16, 64 codes + a 4-byte scale at 8 bits
    assert kv_dtype.bytes_per_token(30, 3, 64, "bfloat16", 2) == 30 * 2 * 3 * 128
    assert kv_dtype.bytes_per_token(30, 3, 64, "int8", 2) == 30 * 2 * 3 * 68
    assert kv_dtype.resolve("bfloat16", "bfloat16") == "auto" and kv_dtype.resolve("fp8_e4m3", "float32") == "fp8"
    with pytest.raises(ValueError, match=r"--kv-cache-dtype float16: the KV pool is kept in the model's dtype "
                                         r"\(bfloat16\) or at 8 bits"):
        kv_dtype.resolve("float16", "bfloat16")
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, bfloat16, float16, fp8, fp8_e4m3, "
                                         "int8; got 'int4'"):
        kv_dtype.canonical("int4")


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_round_trip_within_half_a_step(kind: str) -> None:
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.rand(50, 3, 1) * 10
    x[3, 1] = 0.0  # a row of zeros: scale 0, codes 0
    rows = kv_quant.quantize(x, kind)
    assert rows.shape == (50, 3, 68) and rows.dtype == kv_quant.POOL_DTYPES[kind]
    back = kv_quant.dequantize(rows)
    assert torch.equal(back[3, 1], torch.zeros(64))
    amax = x.abs().amax(-1, keepdim=True)
    if kind == "int8":  # half a step of amax / 127
        assert ((back - x).abs() <= amax / 127 * 0.5001).all()
    else:  # e4m3: 3 mantissa bits, relative 2^-4 at most (subnormals: absolute 2^-10 of amax)
        assert ((back - x).abs() <= torch.maximum(x.abs() * 2 ** -4, amax * 2 ** -10) * 1.0001).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 64), (7, 256), (300, 64), (5, 48)])
def test_rope_write_kv_quantizes_each_row_as_the_reference(ops, kind: str, dtype: torch.dtype, t: int, d: int) -> None:
    h, hkv = 9, 3
    g = torch.Generator().manual_seed(t + d)
    qkv = (torch.randn(t, (h + 2 * hkv) * d, generator=g) * 3).to(dtype)
    cos, sin = RotaryEmbedding(d, 10000.0, None, torch.device("cpu")).cos_sin(torch.randint(0, 2000, (t,), generator=g),
                                                                              dtype)
    slots = torch.randperm(1000, generator=g)[:t]
    # the exact pool's K (the kernel's rope, rounded to dtype): what the 8-bit pool quantizes
    exact_k, exact_v = torch.zeros(1000, hkv, d, dtype=dtype), torch.zeros(1000, hkv, d, dtype=dtype)
    exact_q = ops.rope_write_kv(qkv, cos.view(t, d), sin.view(t, d), h, hkv, exact_k, exact_v, slots)
    roped = apply_rope(qkv[:, :(h + hkv) * d].view(t, h + hkv, d), cos, sin)  # [T, H + Hkv, D] in dtype
    torch.testing.assert_close(exact_k[slots], roped[:, h:], atol=2e-5, rtol=2e-5)  # (float32: FMA's last bits)
    k_cache = torch.full((1000, hkv, d + 4), 0x55, dtype=torch.uint8).view(kv_quant.POOL_DTYPES[kind])
    v_cache = k_cache.clone()
    q = ops.rope_write_kv(qkv, cos.view(t, d), sin.view(t, d), h, hkv, k_cache, v_cache, slots)
    assert torch.equal(q, exact_q)
    as_bytes = lambda x: x.view(torch.uint8)  # noqa: E731 (fp8 NaN codes compare unequal as floats)
    assert torch.equal(as_bytes(k_cache[slots]), as_bytes(kv_quant.quantize(exact_k[slots], kind)))
    assert torch.equal(as_bytes(v_cache[slots]), as_bytes(kv_quant.quantize(qkv[:, (h + hkv) * d:].view(t, hkv, d),
                                                                            kind)))
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[slots] = False
    assert (as_bytes(k_cache[untouched]) == 0x55).all() and (as_bytes(v_cache[untouched]) == 0x55).all()


def _quantized_inputs(lens: list[int], h: int, hkv: int, d: int, q_dtype: torch.dtype, kind: str, seed: int,
                      capacity: int = 3000):
    """Scattered 8-bit keys for sequences of ``lens`` keys (the rest of the pool: garbage bytes)."""
    g = torch.Generator().manual_seed(seed)
    garbage = torch.randint(0, 256, (capacity, hkv, d + 4), generator=g, dtype=torch.uint8)
    k_cache = garbage.clone().view(kv_quant.POOL_DTYPES[kind])
    v_cache = garbage.flip(0).contiguous().view(kv_quant.POOL_DTYPES[kind])
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    slots = torch.randperm(capacity, generator=g)[:int(offsets[-1])]
    k_cache[slots] = kv_quant.quantize(torch.randn(len(slots), hkv, d, generator=g) * 2, kind)
    v_cache[slots] = kv_quant.quantize(torch.randn(len(slots), hkv, d, generator=g), kind)
    q = torch.randn(len(lens), h, d, generator=g).to(q_dtype)
    return q, k_cache, v_cache, slots, torch.from_numpy(offsets)


def _reference(q, k_cache, v_cache, slots, offsets, scale):
    """float64 softmax(scale q K^T) V over each sequence's de-quantized keys, and its log-sum-exp."""
    outs, lses = [], []
    g = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        sl = slots[int(offsets[b]):int(offsets[b + 1])]
        k = kv_quant.dequantize(k_cache[sl]).double().repeat_interleave(g, dim=1)  # [L, H, D]
        v = kv_quant.dequantize(v_cache[sl]).double().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale  # [H, L]
        outs.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v))
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [32, 64, 128, 256, 80])  # AVX2 vector paths, and the plain loops (80)
@pytest.mark.parametrize("h,hkv", [(9, 3), (8, 1), (4, 4)])
def test_decode_attention_on_an_8_bit_pool_matches_float64(ops, kind: str, d: int, h: int, hkv: int) -> None:
    lens = [1, 2, 17, 300, 129]
    q, kc, vc, slots, offsets = _quantized_inputs(lens, h, hkv, d, torch.float32, kind, seed=d * 10 + h)
    scale = d ** -0.5
    out, lse = ops.decode_attention(q, kc, vc, slots, offsets, scale)
    want, want_lse = _reference(q, kc, vc, slots, offsets, scale)
    torch.testing.assert_close(out.double(), want, atol=5e-6, rtol=5e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=5e-6, rtol=5e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_attention_bf16_queries_on_an_8_bit_pool(ops, kind: str) -> None:
    q, kc, vc, slots, offsets = _quantized_inputs([5, 64, 250], 9, 3, 64, torch.bfloat16, kind, seed=3)
    out, lse = ops.decode_attention(q, kc, vc, slots, offsets, 0.125)
    want, want_lse = _reference(q, kc, vc, slots, offsets, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=8e-3, rtol=8e-3)  # the output's rounding to bf16
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d,h,hkv", [(64, 9, 3), (256, 4, 1), (48, 4, 2)])
def test_prefill_attention_on_an_8_bit_pool_gives_each_token_its_decode_result(ops, kind: str, d: int, h: int,
                                                                               hkv: int) -> None:
    """Every token of a prefill call (chunks over cached keys, a single new token) gets bitwise what
    decode_attention gives it alone over its own keys, and the float64 reference's result; a decode
    call over several sequences gives each row its result alone."""
    ctx, new = [300, 130, 17, 5], [45, 130, 17, 1]
    q_offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(new)]).astype(np.int64))
    _, kc, vc, slots, offsets = _quantized_inputs(ctx, h, hkv, d, torch.float32, kind, seed=d + h)
    q = torch.randn(int(q_offsets[-1]), h, d, generator=torch.Generator().manual_seed(d))
    scale = d ** -0.5
    out, lse = ops.prefill_attention(q, kc, vc, slots, offsets, q_offsets, scale)
    t = 0
    for b, (n_ctx, n_new) in enumerate(zip(ctx, new, strict=True)):
        lo = int(offsets[b])
        for i in range(n_new):
            n = n_ctx - n_new + 1 + i
            keys, one_off = slots[lo:lo + n], torch.tensor([0, n])
            one, one_lse = ops.decode_attention(q[t:t + 1], kc, vc, keys, one_off, scale)
            assert torch.equal(one[0], out[t]) and torch.equal(one_lse[0], lse[t]), (b, i)
            if i % 11 == 0 or i == n_new - 1:
                want, want_lse = _reference(q[t:t + 1], kc, vc, keys, one_off, scale)
                torch.testing.assert_close(out[t:t + 1].double(), want, atol=5e-6, rtol=5e-5)
                torch.testing.assert_close(lse[t:t + 1].double(), want_lse, atol=5e-6, rtol=5e-6)
            t += 1
    last = offsets[1:] - 1  # each sequence's newest token, decoded in one call
    rows = q[q_offsets[1:] - 1]
    both, _ = ops.decode_attention(rows, kc, vc, slots, offsets, scale)
    assert torch.equal(both, out[q_offsets[1:] - 1]), last


def test_8_bit_pool_bad_input_is_refused(ops) -> None:
    q, kc, vc, slots, offsets = _quantized_inputs([5], 4, 2, 64, torch.float32, "int8", seed=1, capacity=64)
    with pytest.raises(RuntimeError, match=r"head dim of q and the pool differ \(an 8-bit pool's rows are D codes"):
        ops.decode_attention(q[..., :60].contiguous(), kc, vc, slots, offsets, 0.1)
    with pytest.raises(RuntimeError, match="k_cache and v_cache dtypes differ"):
        ops.decode_attention(q, kc, vc.view(torch.float8_e4m3fn), slots, offsets, 0.1)
    qkv = torch.randn(1, (4 + 2 * 2) * 64)
    cs = torch.ones(1, 64)
    with pytest.raises(RuntimeError, match="the pool must share one dtype"):
        ops.rope_write_kv(qkv, cs, cs, 4, 2, torch.zeros(64, 2, 64, dtype=torch.uint8),
                          torch.zeros(64, 2, 64, dtype=torch.uint8), slots[:1])
