"""Attention over the slot-indexed KV pool: fast batched path vs loop reference vs dense SDPA."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lockgate import kernels
from lockgate.layers.attention import paged_attention, reference_attention, write_kv
from lockgate.layers.attention_meta import MIN_SHARED_PREFIX, SOLO_PREFILL_TOKENS, AttentionMetadata


def make_step(rng: np.random.Generator, seqs: list[tuple[int, int]], h: int, hkv: int, d: int,
              capacity: int = 4096, runs: bool = False):
    """Random step. ``seqs`` = [(seq_len, query_len)]; context slots scattered over the pool, or
    with ``runs`` each sequence's context one contiguous slot run (as the allocator hands them out).

    Returns the plan arrays, the step's q/k/v, the pool (NaN where never written, old context
    written) and each sequence's full dense q/k/v for the dense reference.
    """
    total = sum(s for s, _ in seqs)
    if runs:
        starts = np.cumsum([0] + [s + 3 for s, _ in seqs[:-1]]) + 5  # gaps between the runs
        slots = np.concatenate([np.arange(a, a + s) for a, (s, _) in zip(starts, seqs, strict=True)]).astype(np.int64)
    else:
        slots = rng.permutation(capacity)[:total].astype(np.int64)
    k_cache = torch.full((capacity, hkv, d), float("nan"))
    v_cache = torch.full((capacity, hkv, d), float("nan"))
    kv_offsets = np.concatenate([[0], np.cumsum([s for s, _ in seqs])]).astype(np.int64)
    qs, ks, vs, out_slots, dense = [], [], [], [], []
    for b, (sl, ql) in enumerate(seqs):
        fq, fk, fv = torch.randn(sl, h, d), torch.randn(sl, hkv, d), torch.randn(sl, hkv, d)
        ctx = torch.from_numpy(slots[kv_offsets[b]:kv_offsets[b + 1]])
        old = sl - ql
        write_kv(k_cache, v_cache, ctx[:old], fk[:old], fv[:old])  # earlier chunks / decode history
        qs.append(fq[old:])
        ks.append(fk[old:])
        vs.append(fv[old:])
        out_slots.append(ctx[old:].numpy())
        dense.append((fq, fk, fv))
    plan = dict(query_lens=np.array([q for _, q in seqs], np.int64), seq_lens=np.array([s for s, _ in seqs], np.int64),
                kv_slots=slots, kv_offsets=kv_offsets, out_slots=np.concatenate(out_slots))
    return plan, torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, dense


def dense_causal(dense, seqs, h: int, hkv: int) -> torch.Tensor:
    """Full-sequence causal SDPA per sequence, keeping the last query_len rows -> [T, H, D]."""
    outs = []
    for (fq, fk, fv), (_, ql) in zip(dense, seqs, strict=True):
        k = fk.repeat_interleave(h // hkv, dim=1)
        v = fv.repeat_interleave(h // hkv, dim=1)
        o = F.scaled_dot_product_attention(fq.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        outs.append(o.transpose(0, 1)[-ql:])
    return torch.cat(outs)


CASES = {
    "mixed": [(37, 1), (50, 20), (16, 16), (9, 1), (120, 7), (1, 1)],
    "decode_varied": [(5, 1), (64, 1), (33, 1), (1, 1), (200, 1)],
    "decode_equal": [(40, 1), (40, 1), (40, 1)],
    "prefill_one": [(80, 80)],
    "later_chunks": [(100, 30), (64, 2), (31, 31)],
    "interleaved": [(20, 5), (7, 1), (30, 30), (12, 1), (2, 2)],
    "long_prefills": [(200, 200), (9, 1), (300, 130), (20, 5), (150, 150)],  # solo groups >= SOLO_PREFILL_TOKENS
}


@pytest.fixture(scope="module", params=[False, True], ids=["torch", "kernel"])
def decode_kernel(request) -> bool:
    """Both decode paths: gathers + SDPA, and lockgate's C++ kernel."""
    if request.param:
        load_kernels()
    return request.param


def load_kernels():
    """lockgate's C++ kernels must build here: a machine that runs the suite has a compiler, so a
    failed build fails the tests, never skips them."""
    assert kernels.load(), f"lockgate CPU kernels did not build: {kernels.error()}"
    return torch.ops.lockgate


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("h,hkv", [(8, 2), (9, 3), (4, 4)])
def test_fast_matches_reference_and_dense(case: str, h: int, hkv: int, decode_kernel: bool) -> None:
    seqs = CASES[case]
    rng = np.random.default_rng(zlib.crc32(f"{case}-{h}-{hkv}".encode()))
    torch.manual_seed(int(rng.integers(1 << 30)))
    d = 16
    plan, q, k, v, k_cache, v_cache, dense = make_step(rng, seqs, h, hkv, d)
    scale = d ** -0.5
    meta = AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                   plan["out_slots"], num_queries_per_kv=h // hkv, decode_kernel=decode_kernel)
    assert meta.num_tokens == q.shape[0]
    assert any(g.kernel_slots is not None for g in meta.groups) == (decode_kernel and 1 in plan["query_lens"])
    fast = paged_attention(q, k, v, k_cache, v_cache, meta, scale)  # also writes the step's K/V
    assert fast.shape == q.shape and torch.isfinite(fast).all()
    ref = reference_attention(q, k_cache, v_cache, plan["query_lens"], plan["seq_lens"], plan["kv_slots"],
                              plan["kv_offsets"], scale)
    want = dense_causal(dense, seqs, h, hkv)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, want, atol=1e-5, rtol=1e-5)
    # The step's new K/V landed in its out_slots.
    slots = torch.from_numpy(plan["out_slots"])
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)


@pytest.mark.parametrize("seqs", [[(300, 1)], [(80, 80)], [(100, 30)], [(50, 1), (40, 12)], [(9, 1), (7, 1)]])
def test_contiguous_runs_read_the_pool_in_place(seqs: list[tuple[int, int]]) -> None:
    rng = np.random.default_rng(len(seqs) * 1000 + seqs[0][0])
    plan, q, k, v, k_cache, v_cache, dense = make_step(rng, seqs, 9, 3, 16, runs=True)
    meta = AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                   plan["out_slots"], num_queries_per_kv=3)
    # A group of one sequence on a slot run skips the gather; several sequences never do.
    assert [g.run_start is not None for g in meta.groups] == [g.num_seqs == 1 for g in meta.groups]
    fast = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(fast, dense_causal(dense, seqs, 9, 3), atol=1e-5, rtol=1e-5)


def test_long_prefill_chunks_attend_alone() -> None:
    rng = np.random.default_rng(5)
    plan, *_ = make_step(rng, CASES["long_prefills"], 9, 3, 16)
    meta = AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                   plan["out_slots"], num_queries_per_kv=3)
    # decode (9, 1); the short chunk (20, 5); then each long chunk alone, whole prompts causal
    shape = [(g.num_seqs, g.max_q, g.causal) for g in meta.groups]
    assert shape == [(1, 1, False), (1, 5, False), (1, 200, True), (1, 130, False), (1, 150, True)]
    assert SOLO_PREFILL_TOKENS <= 130


def test_groups_split_decode_and_prefill() -> None:
    qlens = np.array([1, 4, 1], np.int64)
    slens = np.array([3, 6, 2], np.int64)
    offs = np.array([0, 3, 9, 11], np.int64)
    kv = np.arange(11, dtype=np.int64)[::-1].copy()
    out = np.concatenate([kv[2:3], kv[5:9], kv[10:11]])
    meta = AttentionMetadata.build(qlens, slens, kv, offs, out, num_queries_per_kv=2)
    dec, pre = meta.groups
    assert dec.max_q == 1 and dec.token_idx.tolist() == [0, 5]
    assert dec.gather.tolist() == [[10, 9, 8], [1, 0, 0]]  # padded with the sequence's own last slot
    assert dec.mask[:, 0, 0].tolist() == [[True, True, True], [True, True, False]]
    assert pre.max_q == 4 and pre.token_idx.tolist() == [1, 2, 3, 4] and pre.q_index.tolist() == [0, 1, 2, 3]
    # query i (position 2 + i) sees keys 0..2+i; the mask repeats for each of the G=2 heads
    want = np.array([[j <= 2 + i for j in range(6)] for i in range(4)])
    assert np.array_equal(pre.mask[0, 0].numpy(), np.concatenate([want, want]))


def test_bf16_close_to_reference() -> None:
    rng = np.random.default_rng(7)
    seqs = CASES["mixed"]
    plan, q, k, v, k_cache, v_cache, _ = make_step(rng, seqs, 9, 3, 64)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    meta = AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                   plan["out_slots"], num_queries_per_kv=3)
    fast = paged_attention(q, k, v, k_cache, v_cache, meta, 0.125)
    ref = reference_attention(q, k_cache, v_cache, plan["query_lens"], plan["seq_lens"], plan["kv_slots"],
                              plan["kv_offsets"], 0.125)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), ref.float(), atol=3e-2, rtol=3e-2)


def make_shared_step(rng: np.random.Generator, groups: list[tuple[int, list[int]]], loners: list[int], h: int,
                     hkv: int, d: int, run: bool, capacity: int = 4096, query_len: int = 1):
    """A step where each group [(prefix_len, [own_len, ...])] shares its prefix's pool slots (one
    slot run when ``run``, else scattered), as prefix-cache hits do; ``loners`` share nothing. Every
    sequence brings its last min(query_len, own_len) keys as new tokens (1: decode)."""
    free = list(rng.permutation(np.arange(1000, capacity)))
    seqs, ctxs, dense = [], [], []
    k_cache = torch.full((capacity, hkv, d), float("nan"))
    v_cache = torch.full((capacity, hkv, d), float("nan"))
    next_run = 0
    for prefix_len, owns in groups:
        if run:
            pslots = np.arange(next_run, next_run + prefix_len)
            next_run += prefix_len + 7
        else:
            pslots = np.array([free.pop() for _ in range(prefix_len)])
        pk, pv = torch.randn(prefix_len, hkv, d), torch.randn(prefix_len, hkv, d)
        write_kv(k_cache, v_cache, torch.from_numpy(pslots), pk, pv)
        for own in owns:
            oslots = np.array([free.pop() for _ in range(own)])
            ok, ov = torch.randn(own, hkv, d), torch.randn(own, hkv, d)
            seqs.append((prefix_len + own, min(query_len, own)))
            ctxs.append(np.concatenate([pslots, oslots]))
            dense.append((torch.randn(prefix_len + own, h, d), torch.cat([pk, ok]), torch.cat([pv, ov])))
    for n in loners:
        slots = np.array([free.pop() for _ in range(n)])
        seqs.append((n, min(query_len, n)))
        ctxs.append(slots)
        dense.append((torch.randn(n, h, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)))
    order = rng.permutation(len(seqs))  # members of a group need not be neighbours in the batch
    seqs, ctxs, dense = [seqs[i] for i in order], [ctxs[i] for i in order], [dense[i] for i in order]
    for ctx, (_, fk, fv), (_, ql) in zip(ctxs, dense, seqs, strict=True):  # own old keys (prefix written above)
        write_kv(k_cache, v_cache, torch.from_numpy(ctx[:-ql]), fk[:-ql], fv[:-ql])
    plan = dict(query_lens=np.array([q for _, q in seqs], np.int64), seq_lens=np.array([s for s, _ in seqs], np.int64),
                kv_slots=np.concatenate(ctxs).astype(np.int64),
                kv_offsets=np.concatenate([[0], np.cumsum([len(c) for c in ctxs])]).astype(np.int64),
                out_slots=np.concatenate([c[-ql:] for c, (_, ql) in zip(ctxs, seqs, strict=True)]))
    q = torch.cat([fq[-ql:] for (fq, _, _), (_, ql) in zip(dense, seqs, strict=True)])
    k = torch.cat([fk[-ql:] for (_, fk, _), (_, ql) in zip(dense, seqs, strict=True)])
    v = torch.cat([fv[-ql:] for (_, _, fv), (_, ql) in zip(dense, seqs, strict=True)])
    return plan, seqs, q, k, v, k_cache, v_cache, dense


@pytest.mark.parametrize("run", [True, False])
@pytest.mark.parametrize("h,hkv", [(9, 3), (4, 4)])
def test_shared_prefixes_are_read_once_and_merged_exactly(run: bool, h: int, hkv: int, decode_kernel: bool) -> None:
    rng = np.random.default_rng(11 + run + h)
    torch.manual_seed(int(rng.integers(1 << 30)))
    d = 16
    groups = [(100, [1, 5, 30]), (MIN_SHARED_PREFIX, [2, 2]), (MIN_SHARED_PREFIX - 1, [3, 4])]  # last: too short
    plan, seqs, q, k, v, k_cache, v_cache, dense = make_shared_step(rng, groups, [50, 120], h, hkv, d, run)
    meta = AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                   plan["out_slots"], num_queries_per_kv=h // hkv, decode_kernel=decode_kernel)
    scale = d ** -0.5
    want = dense_causal(dense, seqs, h, hkv)
    if decode_kernel:
        # The kernel reads every decoding sequence's keys in place, shared prefix or not: one group.
        (g,) = meta.groups
        assert g.kernel_slots is not None and g.prefixes == [] and g.num_seqs == len(seqs)
        torch.testing.assert_close(paged_attention(q, k, v, k_cache, v_cache, meta, scale), want, atol=1e-5,
                                   rtol=1e-5)
        return
    # Sequences on shared prefixes form their own group (their short own keys are not padded to
    # the others' full contexts); the too-short group and the loners form the other.
    shared, rest = sorted(meta.groups, key=lambda g: not g.prefixes)
    assert rest.prefixes == [] and rest.num_seqs == 4
    assert sorted((p.length, p.members.numel(), p.run_start is not None) for p in shared.prefixes) == \
        [(MIN_SHARED_PREFIX, 2, run), (100, 3, run)]
    # The shared group's own call covers only each member's keys after its prefix.
    assert shared.mask is not None and sorted(shared.mask[:, 0, 0].sum(-1).tolist()) == [1, 2, 2, 5, 30]
    assert shared.max_len == 30
    fast = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(fast, want, atol=1e-5, rtol=1e-5)
    ref = reference_attention(q, k_cache, v_cache, plan["query_lens"], plan["seq_lens"], plan["kv_slots"],
                              plan["kv_offsets"], scale)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    # bf16 pool and queries: close to the float32 reference
    fb = paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta,
                         scale)
    assert fb.dtype == torch.bfloat16
    torch.testing.assert_close(fb.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("run", [True, False])
def test_shared_prefixes_for_prefill_chunks(run: bool, decode_kernel: bool) -> None:
    # Prefix-cache hits prefilling their own suffixes (up to 12 tokens each) beside decodes: the
    # prefill group attends to each shared prefix once, without a mask, and causally to its own keys.
    rng = np.random.default_rng(21 + run)
    torch.manual_seed(int(rng.integers(1 << 30)))
    h, hkv, d = 9, 3, 16
    groups = [(100, [12, 5, 30]), (80, [1, 9])]  # own_len 1: that member is a decode (one own key)
    plan, seqs, q, k, v, k_cache, v_cache, dense = make_shared_step(rng, groups, [50, 7], h, hkv, d, run,
                                                                    query_len=12)
    meta = AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                   plan["out_slots"], num_queries_per_kv=h // hkv, decode_kernel=decode_kernel)
    dec, pre_shared, pre_rest = meta.groups
    assert dec.num_seqs == 1 and dec.prefixes == []  # the one decoding sequence shares with nobody in its group
    # Group 1 (3 prefilling members); group 2's other member prefills alone; loners share nothing.
    assert [(p.length, p.members.numel(), p.run_start is not None) for p in pre_shared.prefixes] == [(100, 3, run)]
    assert pre_shared.num_seqs == 3 and pre_rest.num_seqs == 3 and pre_rest.prefixes == []
    scale = d ** -0.5
    fast = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    want = dense_causal(dense, seqs, h, hkv)
    torch.testing.assert_close(fast, want, atol=1e-5, rtol=1e-5)
    fb = paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta,
                         scale)
    torch.testing.assert_close(fb.float(), want, atol=3e-2, rtol=3e-2)


# ---- lockgate's decode kernel on its own ---------------------------------------------------------


def _decode_inputs(lens: list[int], h: int, hkv: int, d: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                   seed: int, capacity: int = 6000):
    """Scattered keys for decoding sequences of ``lens`` keys; the rest of the pool is NaN."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.full((capacity, hkv, d), float("nan")).to(kv_dtype)
    v_cache = torch.full((capacity, hkv, d), float("nan")).to(kv_dtype)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    slots = torch.randperm(capacity, generator=g)[:int(offsets[-1])]
    k_cache[slots] = torch.randn(len(slots), hkv, d, generator=g).to(kv_dtype)
    v_cache[slots] = torch.randn(len(slots), hkv, d, generator=g).to(kv_dtype)
    q = torch.randn(len(lens), h, d, generator=g).to(q_dtype)
    return q, k_cache, v_cache, slots, torch.from_numpy(offsets)


def _dense_decode(q, k_cache, v_cache, slots, offsets, scale):
    """Per sequence in float64: softmax(scale q K^T) V and the log-sum-exp, heads h -> kv h // G."""
    outs, lses = [], []
    g = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        sl = slots[int(offsets[b]):int(offsets[b + 1])]
        k = k_cache[sl].double().repeat_interleave(g, dim=1)  # [L, H, D]
        v = v_cache[sl].double().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale  # [H, L]
        outs.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v))
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("d", [16, 32, 64, 96, 128, 256, 80])  # 32, 64, 96 (AVX-512), 128, 256: vector paths
@pytest.mark.parametrize("h,hkv", [(9, 3), (8, 1), (10, 2), (4, 4)])  # G = 3, 8 (two passes of 4), 5, 1
def test_decode_kernel_matches_float64(d: int, h: int, hkv: int) -> None:
    load_kernels()
    lens = [1, 2, 17, 300, 33, 1, 129]
    q, kc, vc, slots, offsets = _decode_inputs(lens, h, hkv, d, torch.float32, torch.float32, seed=d * 100 + h)
    scale = d ** -0.5
    out, lse = torch.ops.lockgate.decode_attention(q, kc, vc, slots, offsets, scale)
    want, want_lse = _dense_decode(q, kc, vc, slots, offsets, scale)
    assert out.dtype == torch.float32 and lse.shape == (len(lens), h)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("q_dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_decode_kernel_bf16_pool(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    load_kernels()
    q, kc, vc, slots, offsets = _decode_inputs([5, 64, 250], 9, 3, 64, q_dtype, kv_dtype, seed=3)
    out, lse = torch.ops.lockgate.decode_attention(q, kc, vc, slots, offsets, 0.125)
    want, want_lse = _dense_decode(q, kc, vc, slots, offsets, 0.125)  # from the same bf16 values
    assert out.dtype == q_dtype
    # float32 math inside: only the output's rounding to q's dtype is lost
    tol = 2e-5 if q_dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_decode_kernel_splits_long_contexts_exactly() -> None:
    """One sequence with a long context: its keys are split over the threads in chunks, and the
    partial softmaxes are merged; the result equals the unsplit float64 one."""
    load_kernels()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            q, kc, vc, slots, offsets = _decode_inputs([4000], 9, 3, 64, torch.float32, torch.float32, seed=n,
                                                       capacity=5000)
            out, lse = torch.ops.lockgate.decode_attention(q, kc, vc, slots, offsets, 0.125)
            want, want_lse = _dense_decode(q, kc, vc, slots, offsets, 0.125)
            torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-5)
            torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=2e-6)
    finally:
        torch.set_num_threads(threads)


def test_decode_kernel_result_does_not_depend_on_the_batch_or_threads() -> None:
    """A sequence's output is bitwise the same alone, beside others and on 1-3 threads: the
    key chunks and their merge order are fixed per sequence (what lets a request verify
    speculative guesses in rows of its own and get the logits it would get one at a time)."""
    load_kernels()
    lens = [700, 1, 130, 4000, 257]
    q, kc, vc, slots, offsets = _decode_inputs(lens, 9, 3, 64, torch.float32, torch.float32, seed=11, capacity=6000)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch, batch_lse = torch.ops.lockgate.decode_attention(q, kc, vc, slots, offsets, 0.125)
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for b in range(len(lens)):
                lo, hi = int(offsets[b]), int(offsets[b + 1])
                one, one_lse = torch.ops.lockgate.decode_attention(q[b:b + 1], kc, vc, slots[lo:hi],
                                                                   torch.tensor([0, hi - lo]), 0.125)
                assert torch.equal(one[0], batch[b]) and torch.equal(one_lse[0], batch_lse[b]), (n, b)
    finally:
        torch.set_num_threads(threads)


def test_decode_kernel_rejects_bad_input() -> None:
    op = load_kernels().decode_attention
    q, kc, vc, slots, offsets = _decode_inputs([3, 4], 9, 3, 16, torch.float32, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="has no keys"):
        op(q, kc, vc, slots, torch.tensor([0, 3, 3]), 0.25)
    with pytest.raises(RuntimeError, match="offsets leave slots"):
        op(q, kc, vc, slots, torch.tensor([0, 3, 99]), 0.25)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        op(q[:, :8], kc, vc, slots, offsets, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        op(q, kc, vc, slots.int(), offsets, 0.25)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        op(q, kc, vc.bfloat16(), slots, offsets, 0.25)
    with pytest.raises(RuntimeError, match="outside the pool of 6000 slots"):
        op(q, kc, vc, torch.cat([slots[:-1], torch.tensor([6000])]), offsets, 0.25)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_invariant_attention_gives_each_token_its_decode_result_bitwise(case: str, dtype: torch.dtype) -> None:
    """--deterministic: every token of a step is one decode-kernel row over its own keys. Its output
    is close to the dense reference and *equal* to what the same token gets as the only row of a
    step (a plain decode after its earlier tokens were written): batch, chunking and neighbours
    change nothing."""
    load_kernels()
    seqs = CASES[case]
    h, hkv, d = 8, 2, 16
    rng = np.random.default_rng(zlib.crc32(f"rows-{case}".encode()))
    torch.manual_seed(int(rng.integers(1 << 30)))
    plan, q, k, v, k_cache, v_cache, dense = make_step(rng, seqs, h, hkv, d)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    scale = d ** -0.5
    meta = AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                   plan["out_slots"], num_queries_per_kv=h // hkv, decode_kernel=True,
                                   row_invariant=True)
    assert len(meta.groups) == 1 and meta.groups[0].kernel_slots is not None
    rows = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(rows, dense_causal(dense, seqs, h, hkv), atol=1e-5, rtol=1e-5)
    t = 0
    for b, (sl, ql) in enumerate(seqs):
        ctx = plan["kv_slots"][plan["kv_offsets"][b]:plan["kv_offsets"][b + 1]]
        for i in range(ql):
            n = sl - ql + i + 1  # this token's keys
            alone = AttentionMetadata.build(np.array([1]), np.array([n]), ctx[:n], np.array([0, n]),
                                            ctx[n - 1:n], num_queries_per_kv=h // hkv, decode_kernel=True)
            got = paged_attention(q[t:t + 1], None, None, k_cache, v_cache, alone, scale)
            assert torch.equal(got, rows[t:t + 1]), (case, b, i)
            t += 1
    with pytest.raises(ValueError, match="decode attention kernel"):
        AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                plan["out_slots"], num_queries_per_kv=h // hkv, row_invariant=True)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("d", [64, 128, 256, 16])  # the AVX-512 / AVX2 vector paths, and the plain loops
def test_prefill_kernel_matches_the_reference(case: str, d: int) -> None:
    """``prefill_kernel``: the whole step (decodes and prefill chunks on cached contexts) in one
    ``prefill_attention`` call, each token causal over its own keys: the dense reference's result."""
    load_kernels()
    seqs = CASES[case]
    h, hkv = 9, 3
    rng = np.random.default_rng(zlib.crc32(f"prefill-kernel-{case}-{d}".encode()))
    torch.manual_seed(int(rng.integers(1 << 30)))
    plan, q, k, v, k_cache, v_cache, dense = make_step(rng, seqs, h, hkv, d)
    meta = AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                   plan["out_slots"], num_queries_per_kv=h // hkv, decode_kernel=True,
                                   prefill_kernel=True)
    assert len(meta.groups) == 1 and meta.groups[0].kernel_q_offsets is not None
    got = paged_attention(q, k, v, k_cache, v_cache, meta, d ** -0.5)
    torch.testing.assert_close(got, dense_causal(dense, seqs, h, hkv), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,h,hkv", [(64, 9, 3), (128, 8, 1), (32, 4, 4), (96, 10, 2), (256, 4, 2), (16, 9, 3)])
def test_prefill_kernel_runs_give_each_token_its_decode_result_bitwise(d: int, h: int, hkv: int,
                                                                       dtype: torch.dtype) -> None:
    """The prefill kernel shares each key row among a run of up to 16 tokens (keys transposed,
    masked FMAs on the causal diagonal); a token's output and log-sum-exp must still be bitwise what
    ``decode_attention`` gives it alone over its own keys, and match float64. The sequences cover
    several token runs and key chunks (300 new tokens on 300 keys), chunks whose tokens do not start
    on a 16-key boundary (45 new on 1,000; 250 on 300: a run's rows then end in different 16-key
    blocks, where the masking matters), a run shorter than one block and a single new token."""
    load_kernels()
    ctx, new = [300, 1000, 300, 17, 5, 130], [300, 45, 250, 17, 2, 1]
    q_offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(new)]).astype(np.int64))
    _, kc, vc, slots, offsets = _decode_inputs(ctx, h, hkv, d, dtype, dtype, seed=d + h, capacity=3000)
    q = torch.randn(int(q_offsets[-1]), h, d, generator=torch.Generator().manual_seed(d)).to(dtype)
    scale = d ** -0.5
    out, lse = torch.ops.lockgate.prefill_attention(q, kc, vc, slots, offsets, q_offsets, scale)
    t = 0
    for b, (n_ctx, n_new) in enumerate(zip(ctx, new, strict=True)):
        lo = int(offsets[b])
        for i in range(n_new):
            n = n_ctx - n_new + 1 + i  # this token's keys
            one, one_lse = torch.ops.lockgate.decode_attention(q[t:t + 1], kc, vc, slots[lo:lo + n],
                                                               torch.tensor([0, n]), scale)
            assert torch.equal(one[0], out[t]) and torch.equal(one_lse[0], lse[t]), (b, i)
            if i % 7 == 0 or i == n_new - 1:  # float64 reference on a sample of the tokens
                want, want_lse = _dense_decode(q[t:t + 1], kc, vc, slots[lo:lo + n], torch.tensor([0, n]), scale)
                tol = 2e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
                torch.testing.assert_close(out[t:t + 1].double(), want, atol=tol, rtol=tol)
                torch.testing.assert_close(lse[t:t + 1].double(), want_lse, atol=1e-5, rtol=1e-5)
            t += 1


def _random_pool(capacity: int, dtype: torch.dtype, hkv: int = 3, d: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(capacity, hkv, d, generator=torch.Generator().manual_seed(1)).to(dtype),
            torch.randn(capacity, hkv, d, generator=torch.Generator().manual_seed(2)).to(dtype))


def _decode_rows_equal_each_alone(lists: list[np.ndarray], kc: torch.Tensor, vc: torch.Tensor, h: int = 9) -> None:
    """One decode_attention call over rows with these key lists; each row's output and log-sum-exp
    must be bitwise those of the row alone."""
    d = kc.shape[-1]
    slots = torch.from_numpy(np.concatenate(lists).astype(np.int64))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64))
    q = torch.randn(len(lists), h, d, generator=torch.Generator().manual_seed(4)).to(kc.dtype)
    out, lse = torch.ops.lockgate.decode_attention(q, kc, vc, slots, offsets, d ** -0.5)
    for b, keys in enumerate(lists):
        one, one_lse = torch.ops.lockgate.decode_attention(q[b:b + 1], kc, vc, torch.from_numpy(keys.astype(np.int64)),
                                                           torch.tensor([0, len(keys)]), d ** -0.5)
        assert torch.equal(one[0], out[b]) and torch.equal(one_lse[0], lse[b]), b


def _prefill_rows_equal_each_alone(seqs: list[np.ndarray], new: list[int], kc: torch.Tensor, vc: torch.Tensor,
                                   h: int, seed: int) -> None:
    """One prefill_attention call over sequences with these key lists, the last new[i] keys of
    sequence i being its new tokens; each token's output and log-sum-exp must be bitwise those of
    decode_attention on its own keys (key 0 up to its position), alone."""
    d = kc.shape[-1]
    slots = torch.from_numpy(np.concatenate(seqs).astype(np.int64))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype(np.int64))
    q_offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(new)]).astype(np.int64))
    q = torch.randn(int(q_offsets[-1]), h, d, generator=torch.Generator().manual_seed(seed)).to(kc.dtype)
    out, lse = torch.ops.lockgate.prefill_attention(q, kc, vc, slots, offsets, q_offsets, d ** -0.5)
    t = 0
    for keys, n_new in zip(seqs, new, strict=True):
        for i in range(n_new):
            n = len(keys) - n_new + 1 + i
            one, one_lse = torch.ops.lockgate.decode_attention(q[t:t + 1], kc, vc,
                                                               torch.from_numpy(keys[:n].astype(np.int64)),
                                                               torch.tensor([0, n]), d ** -0.5)
            assert torch.equal(one[0], out[t]) and torch.equal(one_lse[0], lse[t]), (t, i)
            t += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_of_one_sequence_and_its_guesses_give_each_row_its_own_result(dtype: torch.dtype) -> None:
    """A request and its speculative guesses come as decode rows whose key lists extend each other
    (row j + 1: row j's slots and one more); the kernel runs them as one sequence, reading each key
    once. Every row must still be bitwise its result alone. Rows whose counts also rise by one but
    whose slots differ (another sequence, or the same slots in another order) are not joined."""
    load_kernels()
    rng = np.random.default_rng(3)
    capacity = 2000
    seq = rng.permutation(capacity)[:400]  # one request's slots, scattered
    other = rng.permutation(capacity)[:400]
    swapped = seq.copy()
    swapped[[5, 6]] = swapped[[6, 5]]  # same slot set, another order: other keys at those positions
    lists = [seq[:300], seq[:301], seq[:302], seq[:303],  # a newest token and three guesses
             other[:304], seq[:305], swapped[:306], seq[:129], seq[:130]]  # counts +1 each, slots not a prefix
    _decode_rows_equal_each_alone(lists, *_random_pool(capacity, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequences_on_a_shared_prefix_keep_their_own_results(dtype: torch.dtype) -> None:
    """Decode rows of sequences whose key lists start with the same slots (prefix-cache hits) share
    the work items of the whole 128-key chunks they have in common (read once for up to 16 rows).
    Each row must still be bitwise its result alone: with 20 sequences on one prefix (more than an
    item holds), a sequence differing in one slot of its second chunk, one whose prefix is shorter
    than a chunk boundary, the prefix's own guess rows, and a prefill chunk on the prefix."""
    load_kernels()
    h = 9
    rng = np.random.default_rng(5)
    capacity = 6000
    kc, vc = _random_pool(capacity, dtype)
    perm = rng.permutation(capacity)
    prefix, rest = perm[:300], perm[300:]
    own = [rest[i * 60:(i + 1) * 60] for i in range(40)]
    lists = [np.concatenate([prefix, own[i][:1 + i % 50]]) for i in range(20)]  # 20 on the prefix
    changed = prefix.copy()
    changed[200] = own[39][0]  # one slot of chunk 1 differs: chunk 0 shared, chunk 1 not
    lists += [np.concatenate([changed, own[20][:5]]), np.concatenate([prefix[:250], own[21][:40]])]
    lists += [np.concatenate([prefix, own[22][:j]]) for j in (10, 11, 12)]  # a request and its guesses
    _decode_rows_equal_each_alone(lists, kc, vc, h)
    # prefill: a 40-token chunk on the prefix next to two decode rows on it
    seqs = [np.concatenate([prefix, own[30][:3]]), np.concatenate([prefix, own[31][:40]]),
            np.concatenate([prefix, own[32][:2]])]
    _prefill_rows_equal_each_alone(seqs, [1, 40, 1], kc, vc, h, seed=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_interleaved_across_prefixes_keep_their_own_results_and_places(dtype: torch.dtype) -> None:
    """The scheduler's batch mixes requests on different cached prefixes (a shared-prefix workload's
    groups arrive interleaved); the kernel regroups whole sequences by their first slot so those on
    one prefix share its chunks. Each row must still be bitwise its result alone and come back in
    the caller's row order: decode rows on three prefixes taken in turn (some with guess rows), a
    sequence with no prefix between them, then prefill chunks and decode rows on two prefixes mixed."""
    load_kernels()
    h = 9
    rng = np.random.default_rng(11)
    capacity = 8000
    kc, vc = _random_pool(capacity, dtype)
    perm = rng.permutation(capacity)
    prefixes = [perm[i * 400:(i + 1) * 400][:n] for i, n in enumerate((300, 260, 390))]
    own = [perm[1200 + i * 40:1200 + (i + 1) * 40] for i in range(60)]
    lists = []
    for i in range(18):  # A, B, C, A, B, C, ...: no two neighbours share a prefix
        keys = np.concatenate([prefixes[i % 3], own[i][:1 + i]])
        lists += [keys[:len(keys) - 2], keys[:len(keys) - 1], keys] if i % 4 == 1 else [keys]  # guess rows
        if i == 7:
            lists.append(own[40][:33])  # no prefix
    _decode_rows_equal_each_alone(lists, kc, vc, h)
    seqs = [np.concatenate([prefixes[0], own[50][:2]]), np.concatenate([prefixes[1], own[51][:20]]),
            np.concatenate([prefixes[0], own[52][:30]]), np.concatenate([prefixes[1], own[53][:1]])]
    _prefill_rows_equal_each_alone(seqs, [1, 20, 30, 1], kc, vc, h, seed=12)


def test_prefill_kernel_rejects_bad_input() -> None:
    op = load_kernels().prefill_attention
    q, kc, vc, slots, offsets = _decode_inputs([3, 4], 9, 3, 16, torch.float32, torch.float32, seed=0)
    q5 = torch.cat([q, q, q[:1]])  # 5 new tokens: 2 of the first sequence, 3 of the second
    op(q5, kc, vc, slots, offsets, torch.tensor([0, 2, 5]), 0.25)  # fine
    with pytest.raises(RuntimeError, match="q_offsets must cover q"):
        op(q5, kc, vc, slots, offsets, torch.tensor([0, 2, 4]), 0.25)
    with pytest.raises(RuntimeError, match="has 5 new tokens but 4 keys"):
        op(q5, kc, vc, slots, torch.tensor([3, 7]), torch.tensor([0, 5]), 0.25)
    with pytest.raises(RuntimeError, match="has no query tokens"):
        op(q5, kc, vc, slots, offsets, torch.tensor([0, 0, 5]), 0.25)


def test_lookahead_changes_no_result_and_the_switch_reports_its_setting() -> None:
    """The AVX512-BF16 path's look-ahead (lockgate::set_attention_lookahead) only prefetches the
    next work item's rows: decode rows, guess rows, shared prefixes and a prompt chunk must give
    bitwise the same outputs with it on and off; the switch returns the setting it replaces.
    Where the build has no such path the switch stays off (returns False) and the property is
    that path's, so it is reported as skipped, not passed."""
    ops = load_kernels()
    if not ops.bf16_linear_available():
        assert ops.set_attention_lookahead(True) is False and ops.set_attention_lookahead(False) is False
        pytest.skip("the look-ahead is the AVX512-BF16 path's; this CPU's build has none")
    rng = np.random.default_rng(7)
    capacity = 8000
    kc, vc = _random_pool(capacity, torch.bfloat16)
    prefix = rng.permutation(capacity)[:700]
    seqs = [rng.permutation(capacity)[:n] for n in (321, 300, 129, 1, 600)]  # scattered, several chunks each
    seqs += [np.concatenate([prefix, rng.permutation(capacity)[:40]]) for _ in range(3)]  # one shared prefix
    seqs += [seqs[0][:322], seqs[0][:323]]  # guess rows of the first sequence
    new = [1] * 10
    seqs.append(rng.permutation(capacity)[:300])  # a prompt chunk: the last 100 keys are its new tokens
    new.append(100)
    slots = torch.from_numpy(np.concatenate(seqs).astype(np.int64))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype(np.int64))
    q_offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(new)]).astype(np.int64))
    q = torch.randn(int(q_offsets[-1]), 9, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    before = ops.set_attention_lookahead(False)
    try:
        off = ops.prefill_attention(q, kc, vc, slots, offsets, q_offsets, 0.125)
        assert ops.set_attention_lookahead(True) is False
        on = ops.prefill_attention(q, kc, vc, slots, offsets, q_offsets, 0.125)
        assert ops.set_attention_lookahead(True) is True
    finally:
        ops.set_attention_lookahead(before)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
