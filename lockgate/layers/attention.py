"""Attention over the slot-indexed KV pool (TokenAttention).

Owns the per-step attention metadata and the per-layer attention kernel. The model runner
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

GQA without expanding K/V: query heads h = kv * G + g (G = H // Hkv) share kv head ``kv``, so
the queries are reshaped to [Bg, Hkv, G * Q, D] (the G heads of a kv group become extra query
rows) and attend to K/V [Bg, Hkv, L, D] directly. For decode (Q == 1) this reshape is a free
view; measured on CPU it is several times faster than ``enable_gqa=True`` or repeating K/V.

Called by ``lockgate.models.decoder`` (per layer) and ``lockgate.runner.model_runner`` (builds
the metadata once per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

MIN_SHARED_PREFIX = 64  # shortest common prefix (tokens) worth a separate SDPA call per layer
SOLO_PREFILL_TOKENS = 128  # a prefill chunk at least this long gets an SDPA call of its own


@dataclass
class SharedPrefix:
    """Sequences of one group whose contexts all start with the same ``length`` slots, all of them
    before each member's first query."""

    members: torch.Tensor  # [M] i64: rows of these sequences in the group (0 .. Bg - 1), M >= 2
    length: int  # Lp: shared keys (positions 0 .. Lp - 1); every member has keys of its own after them
    run_start: int | None  # the prefix is the slot run [run_start, run_start + Lp): read in place
    slots: torch.Tensor | None  # [Lp] i64 pool slots of the prefix when it is not one run


@dataclass
class AttentionGroup:
    """Sequences that share one SDPA call: all decoding (max_q == 1) or all prefilling; all on
    shared prefixes (``prefixes``) or none."""

    token_idx: torch.Tensor | None  # [Tg] i64: rows of the step's T tokens in this group; None = all, in order
    num_seqs: int  # Bg
    # [Bg, L] i64: pool slot of key j of sequence b (padded with the sequence's last slot); None on the kernel path
    gather: torch.Tensor | None
    mask: torch.Tensor | None  # bool [Bg, 1, G * Q, L] (prefill) or [Bg, 1, 1, L] (decode); None = all visible or causal
    q_index: torch.Tensor | None  # [Tg] i64: row of each group token in the padded [Bg * Q] layout (prefill only)
    max_q: int  # Q: longest query run in the group (1 for decode)
    run_start: int | None = None  # one sequence whose context is the slot run [run_start, run_start + L): no gather
    causal: bool = False  # one sequence whose queries are its whole context: SDPA's causal mask, no mask tensor
    # Shared prefixes; then ``gather``/``mask`` cover each member's keys *after* its prefix.
    prefixes: list[SharedPrefix] = field(default_factory=list)
    # Decode on ``lockgate.kernels`` (``decode_attention``): each sequence's keys as CSR, read by slot.
    kernel_slots: torch.Tensor | None = None  # [N] i64
    kernel_offsets: torch.Tensor | None = None  # [Bg + 1] i64
    # Every token of the step on ``prefill_attention``: sequence b's new tokens are rows
    # kernel_q_offsets[b] .. [b + 1] of q, each attending causally to its keys in the CSR above.
    kernel_q_offsets: torch.Tensor | None = None  # [Bg + 1] i64
    _additive: dict[torch.dtype, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` as 0 / -inf in ``dtype`` (what the SDPA op that returns log-sum-exps takes), made once."""
        if dtype not in self._additive:
            m = self.mask
            self._additive[dtype] = None if m is None else torch.zeros(m.shape, dtype=dtype).masked_fill_(
                ~m, float("-inf"))
        return self._additive[dtype]

    @property
    def max_len(self) -> int:
        assert self.gather is not None
        return int(self.gather.shape[1])


@dataclass
class AttentionMetadata:
    """Everything the per-layer attention needs, built once per step from the plan."""

    out_slots: torch.Tensor  # [T] i64: pool slot where each new token's K/V is written
    groups: list[AttentionGroup]  # 1 to 4 groups (decode / prefill x shared prefix or not); disjoint, cover all T
    num_tokens: int  # T
    # the plan's arrays (query_lens, seq_lens, kv_slots, kv_offsets), for ``masked_attention``
    layout: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    decode_kernel: bool = False  # decoding sequences may attend on lockgate's decode kernel
    _masked: dict[int | None, MaskedLayout] = field(default_factory=dict)  # masked_attention's, per window
    _windowed: dict[int, AttentionGroup] = field(default_factory=dict)  # windowed_attention's decode groups

    @property
    def longest_context(self) -> int:
        return int(self.layout[1].max()) if self.layout is not None and len(self.layout[1]) else 0

    @staticmethod
    def build(query_lens: np.ndarray, seq_lens: np.ndarray, kv_slots: np.ndarray, kv_offsets: np.ndarray,
              out_slots: np.ndarray, num_queries_per_kv: int, device: torch.device | str = "cpu",
              decode_kernel: bool = False, row_invariant: bool = False,
              prefill_kernel: bool = False) -> AttentionMetadata:
        """Plan arrays (numpy i64, shapes as in ``ForwardPlan``) -> tensors on ``device``.

        ``decode_kernel``: decoding sequences attend with ``torch.ops.lockgate.decode_attention``
        (the caller has loaded ``lockgate.kernels``); else with gathers and SDPA.
        ``row_invariant`` (needs ``decode_kernel``; ``--deterministic``): every token of the step,
        prefill chunks included, is one row of the decode kernel over its own keys (key 0 up to its
        position), so a token's attention is computed the same way, bitwise, whether it comes alone
        in a decode step, in a chunk of any size or among any other sequences.
        ``prefill_kernel`` (needs ``decode_kernel``; chosen by the tuning where it measures faster than
        SDPA): the same single kernel call for the whole step, for speed."""
        query_lens = np.asarray(query_lens, dtype=np.int64)
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        kv_slots = np.asarray(kv_slots, dtype=np.int64)
        kv_offsets = np.asarray(kv_offsets, dtype=np.int64)
        q_offsets = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=q_offsets[1:])
        t = torch.from_numpy(np.asarray(out_slots, dtype=np.int64)).to(device)
        if row_invariant or prefill_kernel:
            if not decode_kernel:
                raise ValueError("row-invariant attention runs on lockgate's decode attention kernel")
            dev = torch.device(device)
            group = AttentionGroup(
                token_idx=None, num_seqs=len(query_lens), gather=None, mask=None, q_index=None,
                max_q=int(query_lens.max()) if len(query_lens) else 0,
                kernel_slots=torch.from_numpy(np.ascontiguousarray(kv_slots, dtype=np.int64)).to(dev),
                kernel_offsets=torch.from_numpy(kv_offsets).to(dev), kernel_q_offsets=torch.from_numpy(q_offsets).to(dev))
            return AttentionMetadata(out_slots=t, groups=[group], num_tokens=int(q_offsets[-1]),
                                     layout=(query_lens, seq_lens, kv_slots, kv_offsets), decode_kernel=True)
        is_decode = query_lens == 1
        groups = []
        for kind in (np.flatnonzero(is_decode), np.flatnonzero(~is_decode)):
            if decode_kernel and kind.size and query_lens[kind[0]] == 1:
                # The decode kernel reads each sequence's keys in place, shared prefix or not:
                # measured faster than the cascade's extra SDPA call and merge (batch 32 on
                # 1,024-token shared prefixes: 127 vs 159 ms per step; the prefix stays in cache).
                groups.append(_build_kernel_group(kind, kind.size == len(query_lens), seq_lens, kv_slots,
                                                  kv_offsets, q_offsets, torch.device(device)))
                continue
            # Sequences on shared prefixes get a group of their own: their own keys are short,
            # and padding them to the full contexts of the others would cost what sharing saves.
            sharing = _on_shared_prefix(kind, query_lens, seq_lens, kv_slots, kv_offsets)
            # A long prefill chunk not on a shared prefix attends alone: padded into one call with
            # others, every member would pay for the longest chunk and context, and a whole prompt
            # alone runs SDPA's causal mode (masked blocks skipped, no mask tensor).
            solo = ~sharing & (query_lens[kind] >= SOLO_PREFILL_TOKENS)
            for sel in (kind[sharing], kind[~sharing & ~solo], *(kind[i:i + 1] for i in np.flatnonzero(solo))):
                if sel.size == 0:
                    continue
                whole = sel.size == len(query_lens)  # one group covers the whole step, in order
                groups.append(_build_group(sel, whole, query_lens, seq_lens, kv_slots, kv_offsets, q_offsets,
                                           num_queries_per_kv, torch.device(device)))
        return AttentionMetadata(out_slots=t, groups=groups, num_tokens=int(q_offsets[-1]),
                                 layout=(query_lens, seq_lens, kv_slots, kv_offsets), decode_kernel=decode_kernel)


def _on_shared_prefix(sel: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray, kv_slots: np.ndarray,
                      kv_offsets: np.ndarray) -> np.ndarray:
    """bool [len(sel)]: which of these sequences share a prefix of >= MIN_SHARED_PREFIX keys with another."""
    if sel.size < 2:
        return np.zeros(sel.size, dtype=bool)
    slen = seq_lens[sel]
    j = np.arange(int(slen.max()), dtype=np.int64)[None, :]
    gather = kv_slots[kv_offsets[sel][:, None] + np.minimum(j, slen[:, None] - 1)]
    _, starts = _shared_prefixes(gather, slen - query_lens[sel], torch.device("cpu"))
    return starts > 0


def _build_group(sel: np.ndarray, whole: bool, query_lens: np.ndarray, seq_lens: np.ndarray,
                 kv_slots: np.ndarray, kv_offsets: np.ndarray, q_offsets: np.ndarray, group_size: int,
                 device: torch.device) -> AttentionGroup:
    """Vectorised numpy: gather index, mask and token scatter indices for sequences ``sel``."""
    qlen, slen = query_lens[sel], seq_lens[sel]  # [Bg]
    b, q, length = len(sel), int(qlen.max()), int(slen.max())
    j = np.arange(length, dtype=np.int64)[None, :]  # [1, L] key index == key position
    # Keys past a sequence's end re-read its last slot (valid memory, masked out below).
    gather = kv_slots[kv_offsets[sel][:, None] + np.minimum(j, slen[:, None] - 1)]  # [Bg, L]
    # Token rows of the group in the step's flat layout, and their row in the padded [Bg * Q] layout.
    seq_of_tok = np.repeat(np.arange(b, dtype=np.int64), qlen)  # [Tg]
    tok_in_seq = np.arange(int(qlen.sum()), dtype=np.int64) - np.repeat(np.cumsum(qlen) - qlen, qlen)  # [Tg]
    token_idx = q_offsets[sel][seq_of_tok] + tok_in_seq  # [Tg]
    causal = b == 1 and q == length > 1  # a whole prompt in one chunk: plain causal attention
    prefixes: list[SharedPrefix] = []
    if b >= 2:
        prefixes, starts = _shared_prefixes(gather, slen - qlen, device)
        if prefixes:  # the group's own call covers each sequence's keys from starts[b] on
            slen = slen - starts
            length = int(slen.max())
            j = j[:, :length]
            gather = kv_slots[kv_offsets[sel][:, None] + starts[:, None] + np.minimum(j, slen[:, None] - 1)]
    if causal:
        mask, q_index = None, None
    elif q == 1:
        # Decode: the query at position seq_len - 1 sees keys j < seq_len.
        mask = None if np.all(slen == length) else (j < slen[:, None])[:, None, None, :]  # [Bg, 1, 1, L]
        q_index = None
    else:
        i = np.arange(q, dtype=np.int64)[None, :]  # [1, Q]
        # Absolute position of padded query row i; padding rows pretend to be position 0 so they
        # see key 0 (no all-masked row, hence no NaN; their output is dropped).
        pos = np.where(i < qlen[:, None], slen[:, None] - qlen[:, None] + i, 0)  # [Bg, Q]
        visible = j[:, None, :] <= pos[:, :, None]  # [Bg, Q, L]
        # Row r = g * Q + i of the GQA-folded queries is query i of head g in the kv group.
        mask = np.repeat(visible[:, None], group_size, axis=1).reshape(b, 1, group_size * q, length)  # [Bg, 1, G*Q, L]
        q_index = torch.from_numpy(seq_of_tok * q + tok_in_seq).to(device)
    first = int(gather[0, 0])
    run = b == 1 and bool(np.array_equal(gather[0], np.arange(first, first + length, dtype=np.int64)))
    return AttentionGroup(
        token_idx=None if whole else torch.from_numpy(token_idx).to(device),
        num_seqs=b,
        gather=torch.from_numpy(np.ascontiguousarray(gather)).to(device),
        mask=None if mask is None else torch.from_numpy(np.ascontiguousarray(mask)).to(device),
        q_index=q_index,
        max_q=q,
        run_start=first if run else None,
        causal=causal,
        prefixes=prefixes,
    )


def _build_kernel_group(sel: np.ndarray, whole: bool, seq_lens: np.ndarray, kv_slots: np.ndarray,
                        kv_offsets: np.ndarray, q_offsets: np.ndarray, device: torch.device) -> AttentionGroup:
    """Decoding sequences ``sel`` on the kernel: each one's keys as CSR (the plan's own when the
    group is the whole step)."""
    slen = seq_lens[sel]
    offsets = np.zeros(len(sel) + 1, dtype=np.int64)
    np.cumsum(slen, out=offsets[1:])
    if whole:
        slots = kv_slots  # the plan's CSR is the group's
    else:
        slots = kv_slots[np.repeat(kv_offsets[sel] - offsets[:-1], slen) + np.arange(int(offsets[-1]))]
    return AttentionGroup(
        token_idx=None if whole else torch.from_numpy(q_offsets[sel]).to(device),  # one token per sequence
        num_seqs=len(sel), gather=None, mask=None, q_index=None, max_q=1,
        kernel_slots=torch.from_numpy(np.ascontiguousarray(slots)).to(device),
        kernel_offsets=torch.from_numpy(offsets).to(device))


def _shared_prefixes(gather: np.ndarray, old: np.ndarray, device: torch.device
                     ) -> tuple[list[SharedPrefix], np.ndarray]:
    """Sequences (rows of the padded gather [Bg, L]; ``old`` [Bg] = keys before each one's
    queries) whose first slot is the same share their longest common slot prefix (the same slot at
    the same position is the same cached token), cut to keys that precede every member's queries.
    Returns the prefixes of at least MIN_SHARED_PREFIX tokens and each row's first key of its own."""
    starts = np.zeros(len(old), dtype=np.int64)
    prefixes = []
    _, inverse, counts = np.unique(gather[:, 0], return_inverse=True, return_counts=True)
    for c in np.flatnonzero(counts >= 2):
        members = np.flatnonzero(inverse == c)
        limit = int(old[members].min())  # the prefix is visible to all of a member's queries
        rows = gather[members, :limit]
        differs = np.flatnonzero((rows != rows[0]).any(axis=0))
        lp = int(differs[0]) if differs.size else limit
        if lp < MIN_SHARED_PREFIX:
            continue
        slots = rows[0, :lp]
        run = bool(slots[-1] - slots[0] == lp - 1 and np.all(np.diff(slots) == 1))
        prefixes.append(SharedPrefix(
            members=torch.from_numpy(members).to(device), length=lp, run_start=int(slots[0]) if run else None,
            slots=None if run else torch.from_numpy(np.ascontiguousarray(slots)).to(device)))
        starts[members] = lp
    return prefixes, starts


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_cache/v_cache [capacity, Hkv, D] (one layer), slots [T], k/v [T, Hkv, D]."""
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
            g = meta._windowed[window] = _window_group(meta, window, q.device)
        if k is not None and v is not None:
            write_kv(k_cache, v_cache, meta.out_slots, k, v)
        return _attend_group(q, k_cache, v_cache, g, scale)
    return masked_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap)


def _window_group(meta: AttentionMetadata, window: int, device: torch.device) -> AttentionGroup:
    assert meta.layout is not None
    _, seq_lens, kv_slots, kv_offsets = meta.layout
    lens = np.minimum(seq_lens, window)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    first = kv_offsets[:-1] + seq_lens - lens  # each sequence's first key inside the window, in kv_slots
    slots = kv_slots[np.repeat(first - offsets[:-1], lens) + np.arange(int(offsets[-1]))]
    return AttentionGroup(token_idx=None, num_seqs=len(lens), gather=None, mask=None, q_index=None, max_q=1,
                          kernel_slots=torch.from_numpy(np.ascontiguousarray(slots)).to(device),
                          kernel_offsets=torch.from_numpy(offsets).to(device))


@dataclass
class MaskedLayout:
    """The whole step as one padded batch [B, Q] queries x [B, L] keys, for ``masked_attention``."""

    q_rows: torch.Tensor  # [N] i64: rows of T that are real queries, in (sequence, query) order
    q_pad: torch.Tensor  # [N] i64: where each sits in the flattened [B * Q] padded queries
    gather: torch.Tensor  # [B, L] i64 pool slots (padding repeats a slot of the same sequence)
    allowed: torch.Tensor  # [B, 1, Q, L] bool: causal, within the window, real keys only
    shape: tuple[int, int, int]  # (B, Q, L)


def _masked_layout(meta: AttentionMetadata, window: int | None, device: torch.device) -> MaskedLayout:
    assert meta.layout is not None, "AttentionMetadata.build records the plan's arrays"
    query_lens, seq_lens, kv_slots, kv_offsets = meta.layout
    b = len(query_lens)
    q, l_max = int(query_lens.max()), int(seq_lens.max())
    gather = np.zeros((b, l_max), dtype=np.int64)
    qpos = np.full((b, q), -1, dtype=np.int64)
    rows, pads = [], []
    t = 0
    for i in range(b):
        ql, sl = int(query_lens[i]), int(seq_lens[i])
        mine = kv_slots[kv_offsets[i]:kv_offsets[i + 1]]
        gather[i, :sl] = mine
        gather[i, sl:] = mine[0]
        qpos[i, :ql] = np.arange(sl - ql, sl)
        rows.append(np.arange(t, t + ql))
        pads.append(i * q + np.arange(ql))
        t += ql
    keys = np.arange(l_max)[None, None, :]
    pos = qpos[:, :, None]
    allowed = (keys <= pos) & (keys < seq_lens[:, None, None])
    if window is not None:
        allowed &= keys > pos - window
    allowed[:, :, 0] |= qpos < 0  # a padding query sees key 0 (no all-masked row; its output is dropped)
    return MaskedLayout(torch.from_numpy(np.concatenate(rows)).to(device), torch.from_numpy(np.concatenate(pads)).to(device),
                        torch.from_numpy(gather).to(device), torch.from_numpy(allowed[:, None]).to(device), (b, q, l_max))


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
        lay = meta._masked[window] = _masked_layout(meta, window, q.device)
    b, qmax, l_max = lay.shape
    h, hkv, d = q.shape[1], k_cache.shape[1], q.shape[2]
    qp = q.new_zeros(b * qmax, h, d)
    qp.index_copy_(0, lay.q_pad, q.index_select(0, lay.q_rows))
    qp = qp.view(b, qmax, h, d).transpose(1, 2).float()  # [B, H, Q, D]
    keys = k_cache[lay.gather].float().repeat_interleave(h // hkv, dim=2).transpose(1, 2)  # [B, H, L, D]
    vals = v_cache[lay.gather].float().repeat_interleave(h // hkv, dim=2).transpose(1, 2)
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

    q [T, H, D], k_cache/v_cache [capacity, Hkv, D] -> [T, H, D] in q's dtype.
    """
    h, hkv = q.shape[1], k_cache.shape[1]
    outs = []
    t = 0
    for b in range(len(query_lens)):
        ql, sl = int(query_lens[b]), int(seq_lens[b])
        slots = torch.as_tensor(kv_slots[kv_offsets[b]:kv_offsets[b + 1]], dtype=torch.long, device=q.device)
        k = k_cache[slots].float().repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        qb = q[t:t + ql].float()  # [ql, H, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale  # [H, ql, L]
        pos = torch.arange(sl - ql, sl, device=q.device)[:, None]  # [ql, 1] absolute query positions
        keys = torch.arange(sl, device=q.device)[None, :]  # [1, L]
        scores = scores.masked_fill(keys > pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))  # [ql, H, D]
        t += ql
    return torch.cat(outs).to(q.dtype)
