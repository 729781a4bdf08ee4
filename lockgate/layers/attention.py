"""Attention over the slot-indexed KV pool (TokenAttention).

Owns the per-layer attention over the pool; the per-step metadata it reads (``AttentionMetadata``,
its groups and derived layouts) is ``lockgate.layers.attention_meta``'s. The model runner
owns the pool tensors ``k_cache`` / ``v_cache`` of shape [num_layers, capacity, Hkv, D]; one
slot holds one token's K (or V) in one layer. Each layer gets the views ``k_cache[layer]``
[capacity, Hkv, D]. The pool may come from ``torch.empty``: only slots written by some
step are ever *used* (read slots that are masked out are always valid slots of the same
sequence, so no garbage or NaN reaches the softmax).

A step runs B sequences (see ``lockgate.plan``). Sequence b brings ``query_lens[b]`` new
tokens at positions ``seq_lens[b] - query_lens[b] .. seq_lens[b] - 1``; its context (old
tokens plus the new ones) lives in ``kv_slots[kv_offsets[b]:kv_offsets[b + 1]]`` in position
order, so key index j of that list *is* position j. A query at position p sees keys j <= p.

Two implementations:

* ``reference_attention``: a loop over sequences with plain causal math in float32. Slow and
  obviously right; tests compare the fast path against it.
* ``paged_attention`` (used by the model): ``AttentionMetadata.build`` runs once per step on
  the plan's numpy arrays and splits the sequences into groups: decoding ones (query_len == 1) and
  prefilling ones (query_len > 1), each split again into those on a shared prefix (below) and the
  rest; a prefill chunk of at least ``SOLO_PREFILL_TOKENS`` not on a shared prefix is a group of its
  own (padded into one call, every member would pay for the longest chunk and context). Per group
  it precomputes a padded gather index [Bg, L] into the pool and a boolean mask. Per layer, ``paged_attention``
  writes the step's K/V with ``index_copy_``, gathers each group's context K/V, and runs one
  ``scaled_dot_product_attention`` per group. There is no per-sequence Python loop. A group of
  one sequence whose context is one contiguous slot run (batch-1 decode and a fresh prompt's
  prefill, as the allocator hands out runs) reads the pool in place instead of gathering, and a
  whole prompt in one chunk (one sequence, Q == L) uses SDPA's own causal mask with
  ``enable_gqa`` (no mask tensor, masked blocks skipped).

Shared prefixes (cascade attention): sequences of a group whose contexts begin with the
same pool slots (prefix-cache hits on one prompt prefix: the radix cache hands every request the
same slots), cut to the keys before all their queries, form a ``SharedPrefix``. Their queries
(decode tokens or prefill chunks) attend to that prefix in one SDPA call, without a mask, that
reads it once (in place when its slots are one run), and to the rest of their own contexts in the
group's batched call; the two partial results are merged exactly with their log-sum-exps
(softmax over a union of disjoint key sets). Without this, every member gathers and reads the
prefix's K/V again: with 8 requests on a 1,024-token prefix, 8x the bytes.

With lockgate's kernels (``decode_kernel``), all decoding sequences form one group on
``torch.ops.lockgate.decode_attention``, which reads each sequence's keys from the pool in place:
no gather, no padding, and no cascade (the shared prefix is read per member but from cache;
measured faster than the cascade's extra call and merge). Prefill chunks keep the paths above.

Sliding windows and soft-capping (``windowed_attention``): the paths above attend over a
sequence's whole context with plain scores. A layer with a sliding window (Mistral, Gemma's local
layers, Qwen's upper layers when configured) whose step has a context longer than its window, or
a layer with soft-capped scores (Gemma 2), attends with ``windowed_attention`` instead: a step of
decodes on the decode kernel over each sequence's last ``window`` keys, anything else with
``masked_attention`` (the step as one padded batch with an explicit mask, causal and inside the
window, and float32 scores). Windowed layers keep
every key in the pool (the window decides what is read, not what is kept).

An 8-bit pool (``--kv-cache-dtype int8 / fp8``: [capacity, Hkv, D + 4] int8 or float8_e4m3fn, each
row D codes and its float32 scale, ``lockgate.layers.kv_quant``) is read only by lockgate's kernels,
in place: the runner then puts every token's attention on them (``AttentionMetadata.build`` with
``prefill_kernel``: one kernel group, no SDPA path), and ``masked_attention`` de-quantizes the rows it
gathers for the step. ``write_kv`` quantizes each row as it is written (the kernels' write path,
``rope_write_kv``, does the same in C++).

GQA without expanding K/V: query heads h = kv * G + g (G = H // Hkv) share kv head ``kv``, so
the queries are reshaped to [Bg, Hkv, G * Q, D] (the G heads of a kv group become extra query
rows) and attend to K/V [Bg, Hkv, L, D] directly. For decode (Q == 1) this reshape is a free
view; measured on CPU it is several times faster than ``enable_gqa=True`` or repeating K/V.

Called by ``lockgate.models.decoder`` (per layer) and ``lockgate.runner.model_runner`` (builds
the metadata once per step).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from lockgate.layers import kv_quant
from lockgate.layers.attention_meta import (
    AttentionGroup,
    AttentionMetadata,
    SharedPrefix,
    masked_layout,
    window_group,
)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_cache/v_cache [capacity, Hkv, D] (one layer; an 8-bit pool's [capacity, Hkv, D + 4]: each
    row quantized as written, ``kv_quant``), slots [T], k/v [T, Hkv, D]."""
    if kv_quant.is_quantized(k_cache):
        kind = "int8" if k_cache.dtype == torch.int8 else "fp8"
        k, v = kv_quant.quantize(k, kind), kv_quant.quantize(v, kind)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One layer: write this step's K/V into the pool, then attend over each sequence's context.

    q [T, H, D], k/v [T, Hkv, D] (rope applied; None: already written at ``meta.out_slots``),
    k_cache/v_cache [capacity, Hkv, D] -> [T, H, D].
    """
    if k is not None and v is not None:
        write_kv(k_cache, v_cache, meta.out_slots, k, v)
    if len(meta.groups) == 1 and meta.groups[0].token_idx is None:
        return _attend_group(q, k_cache, v_cache, meta.groups[0], scale)
    out = torch.empty_like(q)  # [T, H, D]
    for g in meta.groups:
        assert g.token_idx is not None
        out.index_copy_(0, g.token_idx, _attend_group(q.index_select(0, g.token_idx), k_cache, v_cache, g, scale))
    return out


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttentionGroup,
                  scale: float) -> torch.Tensor:
    """q [Tg, H, D] (the group's tokens, in order) -> [Tg, H, D]."""
    b, qn = g.num_seqs, g.max_q
    _, h, d = q.shape
    hkv = k_cache.shape[1]
    gs = h // hkv
    if g.kernel_q_offsets is not None:  # every token, causal, each sequence's keys read by slot in place
        o, _ = torch.ops.lockgate.prefill_attention(q, k_cache, v_cache, g.kernel_slots, g.kernel_offsets,
                                                    g.kernel_q_offsets, scale)  # [T, H, D]
        return o
    if g.kernel_slots is not None:  # decode, each sequence's own keys read by slot in place
        o, _ = torch.ops.lockgate.decode_attention(q, k_cache, v_cache, g.kernel_slots, g.kernel_offsets,
                                                   scale)  # [Bg, H, D] (and log-sum-exps [Bg, H], unused)
        return o
    length = g.max_len
    assert g.gather is not None
    if g.run_start is not None:  # one sequence on a slot run: read the pool in place
        kc = k_cache[g.run_start:g.run_start + length].view(1, length, hkv, d).transpose(1, 2)  # [1, Hkv, L, D]
        vc = v_cache[g.run_start:g.run_start + length].view(1, length, hkv, d).transpose(1, 2)
    else:
        flat = g.gather.view(-1)  # [Bg * L]
        kc = k_cache.index_select(0, flat).view(b, length, hkv, d).transpose(1, 2)  # [Bg, Hkv, L, D]
        vc = v_cache.index_select(0, flat).view(b, length, hkv, d).transpose(1, 2)  # [Bg, Hkv, L, D]
    if g.causal:  # Q == L: SDPA's own causal mask skips the masked blocks (~1.5x faster than a mask tensor)
        o = F.scaled_dot_product_attention(q.view(1, qn, h, d).transpose(1, 2), kc, vc, is_causal=True,
                                           scale=scale, enable_gqa=gs > 1)  # [1, H, Q, D]
        return o.transpose(1, 2).reshape(qn, h, d)
    if g.q_index is None:  # decode: Q == 1
        qp = q.reshape(b, 1, h, d)  # [Bg, 1, H, D]: one token per sequence, no padding
    else:
        qp = q.new_zeros(b * qn, h, d).index_copy_(0, g.q_index, q).view(b, qn, h, d)  # [Bg, Q, H, D]
    # Fold each kv group's G query heads into the row axis: [Bg, Hkv, G * Q, D] (a view when Q == 1).
    qf = qp.view(b, qn, hkv, gs, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, gs * qn, d)
    if g.prefixes:
        sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        own, lse = sdpa(qf, kc, vc, 0.0, False, attn_mask=g.additive_mask(qf.dtype), scale=scale)  # lse [Bg, Hkv, R]
        o = _add_prefixes(qf, own, lse, k_cache, v_cache, g.prefixes, scale)  # [Bg, Hkv, G * Q, D]
    else:
        o = F.scaled_dot_product_attention(qf, kc, vc, attn_mask=g.mask, scale=scale)  # [Bg, Hkv, G * Q, D]
    o = o.view(b, hkv, gs, qn, d).permute(0, 3, 1, 2, 4).reshape(b * qn, h, d)  # [Bg * Q, H, D]
    return o if g.q_index is None else o.index_select(0, g.q_index)  # [Tg, H, D]


def _add_prefixes(qf: torch.Tensor, own: torch.Tensor, lse: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, prefixes: list[SharedPrefix], scale: float) -> torch.Tensor:
    """GQA-folded queries qf [Bg, Hkv, R, D] (R = G * Q rows), their attention over their own keys
    ``own`` [Bg, Hkv, R, D] with its log-sum-exps ``lse`` [Bg, Hkv, R] f32, plus the shared prefixes
    (every prefix key is visible to every query of its members) -> [Bg, Hkv, R, D]. Partial softmaxes
    are merged in float32 by log-sum-exps."""
    b, hkv, rows, d = qf.shape
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out = own.clone()
    for p in prefixes:
        m, lp = int(p.members.shape[0]), p.length
        if p.slots is None:
            assert p.run_start is not None
            kp, vp = k_cache[p.run_start:p.run_start + lp], v_cache[p.run_start:p.run_start + lp]  # [Lp, Hkv, D]
        else:
            kp, vp = k_cache.index_select(0, p.slots), v_cache.index_select(0, p.slots)
        # The members' query rows of each kv head become one block of rows: [1, Hkv, M * R, D].
        qm = qf.index_select(0, p.members).transpose(0, 1).reshape(1, hkv, m * rows, d)
        op, lsep = sdpa(qm, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0), 0.0, False,
                        scale=scale)  # [1, Hkv, M * R, D], [1, Hkv, M * R]
        op = op.view(hkv, m, rows, d).transpose(0, 1).float()  # [M, Hkv, R, D]
        lsep = lsep.view(hkv, m, rows).transpose(0, 1)  # [M, Hkv, R]
        lso = lse.index_select(0, p.members)
        top = torch.maximum(lsep, lso)
        wp, wo = (lsep - top).exp_().unsqueeze(-1), (lso - top).exp_().unsqueeze(-1)
        merged = (op * wp + out.index_select(0, p.members).float() * wo) / (wp + wo)
        out.index_copy_(0, p.members, merged.to(out.dtype))
    return out


def windowed_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None,
                       softcap: float | None = None) -> torch.Tensor:
    """A layer with a sliding ``window`` and/or soft-capped scores (shapes as ``paged_attention``).

    A step of decoding sequences only, without soft-capping, on lockgate's decode kernel: each
    sequence's last ``window`` keys as its CSR, read in place (a decode token at position p sees
    keys p - window < j <= p, so the window is a suffix of its context). Anything else:
    ``masked_attention``."""
    if (softcap is None and window is not None and meta.decode_kernel and meta.layout is not None
            and bool((meta.layout[0] == 1).all())):
        g = meta._windowed.get(window)
        if g is None:
            g = meta._windowed[window] = window_group(meta, window, q.device)
        if k is not None and v is not None:
            write_kv(k_cache, v_cache, meta.out_slots, k, v)
        return _attend_group(q, k_cache, v_cache, g, scale)
    return masked_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap)


def masked_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """``paged_attention`` for what its paths do not do: a sliding ``window`` (a query at position
    p sees keys p - window < j <= p, as transformers' sliding-window mask) and logit soft-capping
    (scores = softcap * tanh(scores / softcap), Gemma 2). The whole step as one padded batch, scores
    in float32 (eager attention's order: scale, cap, mask, softmax, then V). Correct first; the
    model takes it only for the layers and steps that need it (a windowed layer whose contexts all
    fit its window takes ``paged_attention``: the window changes nothing there).

    q [T, H, D], k/v [T, Hkv, D] or None (already in the pool), k_cache/v_cache [capacity, Hkv, D]
    -> [T, H, D] in q's dtype."""
    if k is not None and v is not None:
        write_kv(k_cache, v_cache, meta.out_slots, k, v)
    lay = meta._masked.get(window)
    if lay is None:
        lay = meta._masked[window] = masked_layout(meta, window, q.device)
    b, qmax, l_max = lay.shape
    h, hkv, d = q.shape[1], k_cache.shape[1], q.shape[2]
    qp = q.new_zeros(b * qmax, h, d)
    qp.index_copy_(0, lay.q_pad, q.index_select(0, lay.q_rows))
    qp = qp.view(b, qmax, h, d).transpose(1, 2).float()  # [B, H, Q, D]
    # the step's contexts as float32 (an 8-bit pool's gathered rows de-quantized: these rows only)
    keys = kv_quant.read_rows(k_cache, lay.gather).repeat_interleave(h // hkv, dim=2).transpose(1, 2)  # [B, H, L, D]
    vals = kv_quant.read_rows(v_cache, lay.gather).repeat_interleave(h // hkv, dim=2).transpose(1, 2)
    scores = torch.matmul(qp, keys.transpose(-1, -2)) * scale  # [B, H, Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~lay.allowed, float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(q.dtype).float(), vals)  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(b * qmax, h, d).to(q.dtype)
    res = torch.empty_like(q)
    res.index_copy_(0, lay.q_rows, out.index_select(0, lay.q_pad))
    return res


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_lens: np.ndarray, seq_lens: np.ndarray, kv_slots: np.ndarray,
                        kv_offsets: np.ndarray, scale: float) -> torch.Tensor:
    """Loop-over-sequences causal attention in float32 (the step's K/V must already be written).

    q [T, H, D], k_cache/v_cache [capacity, Hkv, D] (an 8-bit pool: its rows de-quantized) -> [T, H, D]
    in q's dtype.
    """
    h, hkv = q.shape[1], k_cache.shape[1]
    outs = []
    t = 0
    for b in range(len(query_lens)):
        ql, sl = int(query_lens[b]), int(seq_lens[b])
        slots = torch.as_tensor(kv_slots[kv_offsets[b]:kv_offsets[b + 1]], dtype=torch.long, device=q.device)
        k = kv_quant.read_rows(k_cache, slots).repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        v = kv_quant.read_rows(v_cache, slots).repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        qb = q[t:t + ql].float()  # [ql, H, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale  # [H, ql, L]
        pos = torch.arange(sl - ql, sl, device=q.device)[:, None]  # [ql, 1] absolute query positions
        keys = torch.arange(sl, device=q.device)[None, :]  # [1, L]
        scores = scores.masked_fill(keys > pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))  # [ql, H, D]
        t += ql
    return torch.cat(outs).to(q.dtype)
