"""The scheduler -> runner contract: ``ForwardPlan`` in, ``ForwardResult`` out.

Owns only data: ints and numpy arrays, no torch and no request objects, so the scheduler
(numpy) and the runner (torch) meet here and nowhere else (docs/design.md, habit 2).

A step runs ``B`` sequences. Sequence ``b`` brings ``query_lens[b]`` new tokens (a whole
prompt, a later chunk of a long prompt, or one decode token) whose KV is written to
``out_slots``; after the step its context holds ``seq_lens[b]`` tokens whose KV lives in the
slots ``kv_slots[kv_offsets[b]:kv_offsets[b+1]]``, in position order (the new tokens'
slots last). Rows listed in ``sample_rows`` produce one token each (a prefill chunk that is
not the last one of its prompt produces none). The first ``num_decode_rows`` sequences are
decode rows (one token of a generating request, or one of its guesses); the rest are prompt
rows (prefill chunks, also of one token, as after a prefix-cache hit on all but the last prompt
token): the runner computes prompt rows on forms whose results do not depend on the chunk.

Invariants (checked by ``validate``): ``len(input_ids) == len(positions) == len(out_slots)
== sum(query_lens)``; ``query_lens[b] <= seq_lens[b]``; the last ``query_lens[b]`` context
slots of each sequence are its ``out_slots``; the positions of a sequence's new tokens are
``seq_lens[b] - query_lens[b] ... seq_lens[b] - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

I64 = np.int64
# A token id not known yet: the output token a step in flight samples (overlap scheduling). The
# scheduler may build a plan that feeds it; the plan is resolved before a runner sees it.
PLACEHOLDER = -1


def _ragged(rows: list[list[int]] | list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Pack rows into (flat values, offsets[len(rows) + 1])."""
    lens = np.fromiter((len(r) for r in rows), dtype=I64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=I64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.concatenate([np.asarray(r, dtype=I64) for r in rows]) if rows else np.zeros(0, I64)
    return flat.astype(I64, copy=False), offsets


@dataclass
class SamplingBatch:
    """Per-row sampling settings for the ``S`` rows that sample this step (all arrays [S])."""

    temperature: np.ndarray  # f32; 0 = greedy
    top_p: np.ndarray  # f32 in (0, 1]
    top_k: np.ndarray  # i64; <= 0 = off
    min_p: np.ndarray  # f32
    repetition_penalty: np.ndarray  # f32; 1 = off (HF: over prompt + output tokens)
    frequency_penalty: np.ndarray  # f32; 0 = off (OpenAI: over output tokens)
    presence_penalty: np.ndarray  # f32; 0 = off
    seeds: np.ndarray  # i64; meaningful where has_seed
    has_seed: np.ndarray  # bool
    seed_steps: np.ndarray  # i64: tokens generated so far (a seeded row's draw depends on it, not on the batch)
    num_logprobs: np.ndarray  # i64; -1 none, 0 chosen only, N chosen + top N
    # Ragged per-row token lists (flat values + offsets[S + 1]); empty rows where unused.
    prompt_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, I64))  # rows with repetition penalty
    prompt_offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, I64))
    output_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, I64))  # rows with any penalty
    output_offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, I64))
    suppress_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, I64))  # EOS/stop ids banned (min_tokens)
    suppress_offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, I64))
    # Constrained decoding: rows ``allowed_rows`` [M] may only choose the tokens set in their
    # bitmask ``allowed`` (int32 [M, ceil(V / 32)], bit t % 32 of word t // 32 = token t allowed).
    allowed_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, I64))
    allowed: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    allowed_seconds: float = 0.0  # wall time the scheduler spent filling ``allowed`` (reported, not used)

    def __post_init__(self) -> None:
        # Unused ragged lists default to S empty rows: offsets of S + 1 zeros.
        s = self.size
        for name in ("prompt", "output", "suppress"):
            if getattr(self, f"{name}_ids").size == 0 and getattr(self, f"{name}_offsets").shape != (s + 1,):
                setattr(self, f"{name}_offsets", np.zeros(s + 1, I64))

    @property
    def size(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def all_greedy(self) -> bool:
        return bool(np.all(self.temperature == 0.0))

    @property
    def any_penalty(self) -> bool:
        return bool(np.any(self.repetition_penalty != 1.0) or np.any(self.frequency_penalty != 0.0)
                    or np.any(self.presence_penalty != 0.0))

    @staticmethod
    def ragged(rows: list[list[int]] | list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return _ragged(rows)


@dataclass
class ForwardPlan:
    input_ids: np.ndarray  # i64 [T]
    positions: np.ndarray  # i64 [T]
    out_slots: np.ndarray  # i64 [T]
    query_lens: np.ndarray  # i64 [B]
    seq_lens: np.ndarray  # i64 [B]
    kv_slots: np.ndarray  # i64 [sum(seq_lens)]
    kv_offsets: np.ndarray  # i64 [B + 1]
    sample_rows: np.ndarray  # i64 [S], indices into [0, B)
    sampling: SamplingBatch
    # LoRA: per sequence the runner slot of its adapter (-1: the base model) [B]; empty when no
    # sequence of the step uses an adapter. Slots are filled before the step (``AdapterSlots``).
    lora_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, I64))
    # Decode rows (the first sequences, one token each); None: the leading one-token sequences.
    num_decode_rows: int | None = None

    @property
    def decode_rows(self) -> int:
        """How many leading sequences (= token rows) are decode rows."""
        if self.num_decode_rows is not None:
            return self.num_decode_rows
        multi = np.flatnonzero(self.query_lens != 1)
        return int(multi[0]) if multi.size else self.num_seqs

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return bool(np.all(self.query_lens == 1))

    def validate(self) -> None:
        """Assert the invariants in the module docstring (used by tests and debug runs)."""
        t = int(self.query_lens.sum())
        assert self.input_ids.shape == self.positions.shape == self.out_slots.shape == (t,)
        assert np.all(self.query_lens >= 1) and np.all(self.query_lens <= self.seq_lens)
        assert self.kv_offsets[-1] == self.kv_slots.shape[0] == int(self.seq_lens.sum())
        q_off = np.concatenate([[0], np.cumsum(self.query_lens)])
        for b in range(self.num_seqs):
            q, s = int(self.query_lens[b]), int(self.seq_lens[b])
            ctx = self.kv_slots[self.kv_offsets[b]:self.kv_offsets[b + 1]]
            assert np.array_equal(ctx[s - q:], self.out_slots[q_off[b]:q_off[b + 1]])
            assert np.array_equal(self.positions[q_off[b]:q_off[b + 1]], np.arange(s - q, s))
        sb = self.sampling
        assert sb.size == self.sample_rows.shape[0]
        for name in ("prompt", "output", "suppress"):
            ids, off = getattr(sb, f"{name}_ids"), getattr(sb, f"{name}_offsets")
            assert off.shape == (sb.size + 1,) and int(off[-1]) == ids.shape[0], name
        assert sb.allowed.ndim == 2 and sb.allowed.shape[0] == sb.allowed_rows.shape[0]
        assert np.all((sb.allowed_rows >= 0) & (sb.allowed_rows < sb.size))
        assert self.lora_slots.shape in ((0,), (self.num_seqs,))
        d = self.decode_rows
        assert 0 <= d <= self.num_seqs and np.all(self.query_lens[:d] == 1)


@dataclass
class ForwardResult:
    tokens: np.ndarray  # i64 [S], one per sample row, in sample_rows order
    logprobs: np.ndarray  # f32 [S]: log-probability of the chosen token under the model (before sampling knobs)
    top_ids: np.ndarray  # i64 [S, K], K = max requested top logprobs (0 if none)
    top_logprobs: np.ndarray  # f32 [S, K]
    step_seconds: float = 0.0  # wall time the runner spent on the step
