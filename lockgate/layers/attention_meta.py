"""The per-step attention metadata over the slot-indexed KV pool: what ``AttentionMetadata.build``
works out once per step from the plan's numpy arrays, and the per-step layouts derived from it
on first use (a sliding window's decode group, the padded masked batch).

Owns ``AttentionMetadata`` (the step's groups of sequences: decoding and prefilling ones, those on
a shared prefix, solo long prefill chunks; the gather indices and masks of each; the CSR slots of
the decode kernel's group), ``AttentionGroup``, ``SharedPrefix``, ``MaskedLayout`` and their
builders. How a layer attends with them is ``lockgate.layers.attention``'s (its docstring describes
the groups, shared prefixes and windows in full).

Invariants: built once per step and read-only afterwards, except the two per-window caches that
``window_group`` and ``masked_layout`` fill on a step's first windowed layer; every index it holds
is a slot of the sequence it belongs to (padding repeats one of the sequence's own slots), so a
gather never reads another sequence's or an unwritten slot. Called by
``lockgate.runner.model_runner`` (``build``, once per step) and ``lockgate.layers.attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

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


def window_group(meta: AttentionMetadata, window: int, device: torch.device) -> AttentionGroup:
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


def masked_layout(meta: AttentionMetadata, window: int | None, device: torch.device) -> MaskedLayout:
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
