"""Building a step's ForwardPlan from the scheduler's choices.

Owns the layout of one step for the runner: which requests get rows, in what order, fed which
tokens at which positions, writing their KV to which slots and reading which. Given the decoding
requests (each with its guesses, possibly none) and the prefill chunks the scheduler chose,
``build_step`` allocates the step's slots from the ledger (all or nothing) and returns the plan with
the bookkeeping ``Scheduler.update`` needs to apply its result.

Layout: decode rows first (request ``r`` with guesses ``g``: ``1 + len(g)`` one-token rows fed its
newest token then ``g``; row ``j`` sees the request's keys through its own guess ``j``, so the rows
of one request are ordinary decode rows whose contexts are prefixes of each other), then one row
per prefill chunk. A row samples when its prompt is complete after this step (every decode row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lockgate.kvcache.allocator import OutOfSlots
from lockgate.plan import ForwardPlan
from lockgate.scheduler.ledger import SlotLedger
from lockgate.scheduler.request import Request
from lockgate.scheduler.sampling_batch import build_sampling

I64 = np.int64


@dataclass
class ScheduledStep:
    plan: ForwardPlan
    rows: list[Request]  # row b of the plan (a speculating request has 1 + len(guesses) rows)
    sampled: list[Request]  # the requests that get tokens this step, in plan.sample_rows order
    drafts: list[list[int]]  # per sampled request, the guesses fed after its newest token ([] if none)
    num_new_seqs: int  # requests admitted in this step
    num_prefill_tokens: int
    num_decode: int  # decoding requests
    num_decode_rows: int  # their plan rows (the first rows of the plan): num_decode + guesses
    num_cached_tokens: int = 0  # prompt tokens the new requests took from the prefix cache
    num_generated: int = 0  # tokens the step appended to outputs (set by ``update``)
    committed: bool = False  # launched ahead of its result (``overlap.commit``): overlap scheduling
    out_index: list[int] = field(default_factory=list)  # committed: where each sampled request's token goes


def build_step(decode: list[Request], drafts: list[list[int]], prefill: list[tuple[Request, int]],
               ledger: SlotLedger) -> ScheduledStep:
    """The step's plan and bookkeeping; its new slots come from ``ledger`` (all or none)."""
    spans = [1 + len(g) for g in drafts]
    n_dec = sum(spans)
    rows = [r for r, s in zip(decode, spans, strict=True) for _ in range(s)] + [r for r, _ in prefill]
    q_lens = np.array([1] * n_dec + [n for _, n in prefill], dtype=I64)
    # Slots for this step's new tokens: one run for all decode rows, one run per prefill chunk.
    new_slots: list[np.ndarray] = []
    try:
        if decode:
            new_slots.append(ledger.alloc(n_dec))
        for _, n in prefill:
            new_slots.append(ledger.alloc(n))
    except OutOfSlots:
        ledger.free(new_slots)  # give back what this step took before failing
        raise
    at = 0
    for r, s in zip(decode, spans, strict=True):
        r.slots[r.num_computed:r.num_computed + s] = new_slots[0][at:at + s]
        r.pending = s
        at += s
    for (r, n), run in zip(prefill, new_slots[1:] if decode else new_slots, strict=True):
        r.slots[r.num_computed:r.num_computed + n] = run
        r.pending = n
    # a request's j-th decode row sits j positions after its newest token
    starts = np.fromiter((r.num_computed for r in rows), dtype=I64, count=len(rows))
    if n_dec > len(decode):  # some request has guesses (every span is 1 otherwise)
        span = np.asarray(spans, dtype=I64)
        starts[:n_dec] += np.arange(n_dec, dtype=I64) - np.repeat(np.cumsum(span) - span, span)
    seq_lens = starts + q_lens
    input_ids = np.concatenate(
        [np.asarray([t for r, g in zip(decode, drafts, strict=True) for t in (r.output_ids[-1], *g)], dtype=I64)]
        + [r.token_at(r.num_computed, r.num_computed + n) for r, n in prefill])
    out_slots = np.concatenate(new_slots)
    positions = np.repeat(starts - np.cumsum(q_lens) + q_lens, q_lens) + np.arange(int(q_lens.sum()))
    kv_offsets = np.zeros(len(rows) + 1, dtype=I64)
    np.cumsum(seq_lens, out=kv_offsets[1:])
    kv_slots = np.concatenate([r.slots[:s] for r, s in zip(rows, seq_lens.tolist(), strict=True)])
    # A row samples when its prefill is complete after this step (every decode row does).
    sample_mask = seq_lens >= np.fromiter((r.prefill_len for r in rows), dtype=I64, count=len(rows))
    sample_rows = np.flatnonzero(sample_mask).astype(I64)
    done = [r for (r, _), m in zip(prefill, sample_mask[n_dec:].tolist(), strict=True) if m]
    sampled, sample_drafts = decode + done, drafts + [[] for _ in done]
    lora = np.fromiter((r.lora_slot for r in rows), dtype=I64, count=len(rows))
    plan = ForwardPlan(input_ids=input_ids.astype(I64, copy=False), positions=positions.astype(I64),
                       out_slots=out_slots, query_lens=q_lens, seq_lens=seq_lens, kv_slots=kv_slots,
                       kv_offsets=kv_offsets, sample_rows=sample_rows,
                       sampling=build_sampling([rows[i] for i in sample_rows.tolist()],
                                               [g[:j] for g, s in zip(drafts, spans, strict=True) for j in range(s)]
                                               + [[] for _ in done]),
                       lora_slots=lora if bool((lora >= 0).any()) else np.zeros(0, I64), num_decode_rows=n_dec)
    return ScheduledStep(plan, rows, sampled, sample_drafts, 0, int(q_lens[n_dec:].sum()), len(decode), n_dec)
