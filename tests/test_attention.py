"""Attention over the slot-indexed KV pool: fast batched path vs loop reference vs dense SDPA."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lockgate.layers.attention import (
    MIN_SHARED_PREFIX,
    AttentionMetadata,
    paged_attention,
    reference_attention,
    write_kv,
)


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
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("h,hkv", [(8, 2), (9, 3), (4, 4)])
def test_fast_matches_reference_and_dense(case: str, h: int, hkv: int) -> None:
    seqs = CASES[case]
    rng = np.random.default_rng(zlib.crc32(f"{case}-{h}-{hkv}".encode()))
    torch.manual_seed(int(rng.integers(1 << 30)))
    d = 16
    plan, q, k, v, k_cache, v_cache, dense = make_step(rng, seqs, h, hkv, d)
    scale = d ** -0.5
    meta = AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                   plan["out_slots"], num_queries_per_kv=h // hkv)
    assert meta.num_tokens == q.shape[0]
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
def test_shared_prefixes_are_read_once_and_merged_exactly(run: bool, h: int, hkv: int) -> None:
    rng = np.random.default_rng(11 + run + h)
    torch.manual_seed(int(rng.integers(1 << 30)))
    d = 16
    groups = [(100, [1, 5, 30]), (MIN_SHARED_PREFIX, [2, 2]), (MIN_SHARED_PREFIX - 1, [3, 4])]  # last: too short
    plan, seqs, q, k, v, k_cache, v_cache, dense = make_shared_step(rng, groups, [50, 120], h, hkv, d, run)
    meta = AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                   plan["out_slots"], num_queries_per_kv=h // hkv)
    # Sequences on shared prefixes form their own group (their short own keys are not padded to
    # the others' full contexts); the too-short group and the loners form the other.
    shared, rest = sorted(meta.groups, key=lambda g: not g.prefixes)
    assert rest.prefixes == [] and rest.num_seqs == 4
    assert sorted((p.length, p.members.numel(), p.run_start is not None) for p in shared.prefixes) == \
        [(MIN_SHARED_PREFIX, 2, run), (100, 3, run)]
    # The shared group's own call covers only each member's keys after its prefix.
    assert shared.mask is not None and sorted(shared.mask[:, 0, 0].sum(-1).tolist()) == [1, 2, 2, 5, 30]
    assert shared.max_len == 30
    scale = d ** -0.5
    fast = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    want = dense_causal(dense, seqs, h, hkv)
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
def test_shared_prefixes_for_prefill_chunks(run: bool) -> None:
    # Prefix-cache hits prefilling their own suffixes (up to 12 tokens each) beside decodes: the
    # prefill group attends to each shared prefix once, without a mask, and causally to its own keys.
    rng = np.random.default_rng(21 + run)
    torch.manual_seed(int(rng.integers(1 << 30)))
    h, hkv, d = 9, 3, 16
    groups = [(100, [12, 5, 30]), (80, [1, 9])]  # own_len 1: that member is a decode (one own key)
    plan, seqs, q, k, v, k_cache, v_cache, dense = make_shared_step(rng, groups, [50, 7], h, hkv, d, run,
                                                                    query_len=12)
    meta = AttentionMetadata.build(plan["query_lens"], plan["seq_lens"], plan["kv_slots"], plan["kv_offsets"],
                                   plan["out_slots"], num_queries_per_kv=h // hkv)
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
