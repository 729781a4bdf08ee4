"""lockgate's fused CPU ops (lockgate/kernels/csrc/fused_ops.cpp) against the torch ops they replace.

float32: equal up to float rounding of a different summation order / exp approximation. bf16: each
op rounds where the torch sequence rounds, so results are the same numbers but for rare last-bit
differences (1/sqrt vs rsqrt, the exp polynomial vs libm inside silu). The decode attention kernel
has its own tests in tests/test_attention.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lockgate import kernels
from lockgate.layers.norm import rms_norm
from lockgate.layers.rope import RotaryEmbedding, apply_rope


@pytest.fixture(scope="module")
def ops():
    # A machine that runs the suite has a compiler: a failed build fails these tests, never skips them.
    assert kernels.load(), f"lockgate CPU kernels did not build: {kernels.error()}"
    return torch.ops.lockgate


def assert_same_numbers(got: torch.Tensor, want: torch.Tensor, max_differing: float) -> None:
    """float32: close; bf16: equal except at most ``max_differing`` of the elements, by one last bit."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        return
    differ = got != want
    assert differ.float().mean() <= max_differing, f"{int(differ.sum())} of {got.numel()} differ"
    # where they differ, by one bf16 step at most (8 significant bits)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-30, rtol=2 ** -7)


DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 7, 300]  # decode, a small mixed step, a prefill (threads split rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", ROWS)
def test_add_rms_norm_equals_add_then_norm(ops, dtype: torch.dtype, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    x, r = torch.randn(t, 576, generator=g).to(dtype), (3 * torch.randn(t, 576, generator=g)).to(dtype)
    w = (1 + 0.3 * torch.randn(576, generator=g)).to(dtype)
    want_r = r + x
    got = ops.add_rms_norm_(r, x, w, 1e-5)  # r updated in place
    assert torch.equal(r, want_r)
    assert_same_numbers(got, rms_norm(want_r, w, 1e-5), max_differing=1e-3)
    alone = ops.add_rms_norm_(r, None, w, 1e-5)  # no x: the norm only, r unchanged
    assert torch.equal(r, want_r)
    assert_same_numbers(alone, rms_norm(want_r, w, 1e-5), max_differing=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", ROWS)
def test_silu_mul_equals_silu_times_up(ops, dtype: torch.dtype, t: int) -> None:
    gu = (4 * torch.randn(t, 2 * 1536, generator=torch.Generator().manual_seed(t))).to(dtype)
    gu[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])  # saturated and zero gates
    gate, up = gu.chunk(2, dim=-1)
    assert_same_numbers(ops.silu_mul(gu), F.silu(gate) * up, max_differing=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", ROWS)
def test_rope_write_kv_equals_rope_and_index_copy(ops, dtype: torch.dtype, t: int) -> None:
    h, hkv, d = 9, 3, 64
    g = torch.Generator().manual_seed(t)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    cos, sin = RotaryEmbedding(d, 10000.0, None, torch.device("cpu")).cos_sin(torch.randint(0, 2000, (t,), generator=g),
                                                                              dtype)
    want = apply_rope(qkv[:, :(h + hkv) * d].view(t, h + hkv, d), cos, sin)  # [T, H + Hkv, D]
    k_cache = torch.full((1000, hkv, d), float("nan")).to(dtype)
    v_cache = k_cache.clone()
    slots = torch.randperm(1000, generator=g)[:t]
    q = ops.rope_write_kv(qkv, cos.view(t, d), sin.view(t, d), h, hkv, k_cache, v_cache, slots)
    assert_same_numbers(q, want[:, :h].contiguous(), max_differing=0)
    assert_same_numbers(k_cache[slots], want[:, h:].contiguous(), max_differing=0)
    assert torch.equal(v_cache[slots], qkv[:, (h + hkv) * d:].view(t, hkv, d))
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[slots] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()  # nothing else written


def test_fused_ops_reject_bad_input(ops) -> None:
    r = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm_(r, None, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.add_rms_norm_(r.half(), None, torch.ones(8).half(), 1e-5)
    with pytest.raises(RuntimeError, match=r"\[T, 2F\]"):
        ops.silu_mul(torch.randn(4, 7))
    kc = torch.zeros(10, 1, 4)
    with pytest.raises(RuntimeError, match="outside the pool of 10 slots"):
        ops.rope_write_kv(torch.randn(2, 12), torch.ones(2, 4), torch.zeros(2, 4), 1, 1, kc, kc.clone(),
                          torch.tensor([0, 10]))
    with pytest.raises(RuntimeError, match="qkv must be"):
        ops.rope_write_kv(torch.randn(2, 16), torch.ones(2, 4), torch.zeros(2, 4), 1, 1, kc, kc.clone(),
                          torch.tensor([0, 1]))


def test_stale_build_lock_is_removed(tmp_path, monkeypatch) -> None:
    # A build killed mid-way leaves torch's lock file; later loads must not wait on it forever.
    import os
    import time

    from lockgate import kernels as k

    lock = tmp_path / "lock"
    lock.write_text("")
    k._drop_stale_lock(lock)
    assert lock.exists()  # fresh: a build may be running right now
    old = time.time() - k.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    k._drop_stale_lock(lock)
    assert not lock.exists()
    k._drop_stale_lock(lock)  # no lock: nothing to do


def test_cpu_kernels_off_and_bad_mode(monkeypatch) -> None:
    from lockgate import kernels as k

    assert k.load("off") is False
    monkeypatch.setenv("LOCKGATE_CPU_KERNELS", "0")
    assert k.load("auto") is False
    with pytest.raises(ValueError, match="--cpu-kernels"):
        k.load("sometimes")
