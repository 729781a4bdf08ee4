"""Scheduler: continuous batching over a token-granular KV pool with peak-usage admission.

Owns the waiting queue, the running set and the slot allocator. Each call to
``schedule()`` builds one step (a ``ForwardPlan``):

1. **Prefill** prompts already admitted (oldest first) under the ``max_prefill_tokens``
   budget; a prompt longer than what is left of the budget is cut into chunks over
   several steps.
2. **Admit** waiting requests in queue order while the running set has room
   (``max_running_requests``), prefill budget is left, and the Efficient Router's peak
   estimate of the batch's future KV usage, with the candidate included, fits the pool
   (``admission.py``, including how chunked prompts are charged). Admitted requests get
   their first prefill chunk in this same step (prefill first: it sets TTFT); every slot
   they will ever ask for is already counted by the estimate.
3. **Decode** every running request whose prompt is done: one token each, in the same
   step as the prefill chunks, so a long prompt never stalls running decodes.

``update()`` applies the runner's ``ForwardResult``: appends tokens, finishes requests
(stop token, EOS, max_tokens) and frees their slots at once.

Invariant (checked by ``check_invariants``, asserted after every step in tests):
``allocator.num_free + sum(len(r.held_slots()) for r in running) == capacity``, and no
``alloc`` ever fails (the consequence of peak admission).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from lockgate.config import SchedulerConfig
from lockgate.kvcache.allocator import SlotAllocator
from lockgate.plan import ForwardPlan, ForwardResult, SamplingBatch
from lockgate.scheduler.admission import peak_usage
from lockgate.scheduler.request import FinishReason, Request

log = logging.getLogger("lockgate.scheduler")
I64 = np.int64


class RequestRejected(ValueError):
    """The request can never run here (too long for the context or the pool, bad ids)."""


@dataclass
class StepOutput:
    """What one step produced for one request (the scheduler's outbound event)."""

    rid: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top: list[list[tuple[int, float]]]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ScheduledStep:
    plan: ForwardPlan
    rows: list[Request]  # row b of the plan
    sampled: list[Request]  # one per plan.sample_rows entry
    num_new_seqs: int  # requests whose first chunk is in this step
    num_prefill_tokens: int
    num_decode: int


@dataclass(frozen=True)
class SchedulerStats:
    running: int
    waiting: int
    slots_used: int
    slots_free: int
    capacity: int
    headroom: int  # capacity - peak estimate of the running batch


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, capacity: int, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.cfg = cfg
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = SlotAllocator(capacity)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self._by_id: dict[str, Request] = {}
        self._ids = itertools.count()

    # ---- intake ----------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def validate(self, prompt_ids: np.ndarray, max_tokens: int) -> None:
        """Raise RequestRejected if a request of this shape can never run here."""
        n = int(len(prompt_ids))
        if n == 0:
            raise RequestRejected("the prompt is empty: at least one token is needed")
        if n + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens exceeds the "
                f"model's context length of {self.max_model_len} tokens")
        if n + max_tokens > self.capacity:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens exceeds the KV "
                f"cache capacity of {self.capacity} tokens (--max-total-tokens / --kv-cache-memory)")
        lo, hi = int(np.min(prompt_ids)), int(np.max(prompt_ids))
        if lo < 0 or hi >= self.vocab_size:
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size}), got {lo}..{hi}")

    def submit(self, req: Request) -> None:
        if req.rid in self._by_id:
            raise RequestRejected(f"duplicate request id {req.rid!r}")
        self.validate(req.prompt_ids, req.params.max_tokens)
        eos = frozenset() if req.params.ignore_eos else self.eos_token_ids
        req.stop_token_ids = eos | frozenset(req.params.stop_token_ids)
        self.waiting.append(req)
        self._by_id[req.rid] = req

    def abort(self, rid: str) -> Request | None:
        """Cancel a request wherever it is; its slots return to the pool at once."""
        req = self._by_id.get(rid)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return req

    # ---- queries ---------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, rid: str) -> Request | None:
        return self._by_id.get(rid)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(running=len(self.running), waiting=len(self.waiting),
                              slots_used=self.allocator.num_used, slots_free=self.allocator.num_free,
                              capacity=self.capacity, headroom=self.capacity - self.peak_estimate())

    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        held = sum(r.num_computed for r in self.running)
        assert self.allocator.num_free + held == self.capacity, (
            f"slot accounting broken: free {self.allocator.num_free} + held {held} != capacity {self.capacity}")
        peak = self.peak_estimate()
        assert peak <= self.capacity, f"running batch's peak estimate {peak} exceeds capacity {self.capacity}"

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        budget = self.cfg.max_prefill_tokens
        prefill: list[tuple[Request, int]] = []
        for r in self.running:  # prompts already admitted continue first, oldest first
            if budget <= 0:
                break
            if r.is_prefilling:
                n = min(r.num_prompt - r.num_computed, budget)
                prefill.append((r, n))
                budget -= n
        budget = self._admit(budget, prefill)
        if not self.running:
            return None
        chosen = {id(r) for r, _ in prefill}
        decode = [r for r in self.running if not r.is_prefilling and id(r) not in chosen]
        if not decode and not prefill:
            return None
        return self._build(decode, prefill)

    def update(self, step: ScheduledStep, result: ForwardResult) -> list[StepOutput]:
        """Apply a step's result; returns one StepOutput per request that got a token or finished."""
        now = time.monotonic()
        for r, q in zip(step.rows, step.plan.query_lens.tolist(), strict=True):
            if not r.finished:
                r.num_computed += q
        outs: list[StepOutput] = []
        k = result.top_ids.shape[1] if result.top_ids.ndim == 2 else 0
        tokens, lps = result.tokens.tolist(), result.logprobs.tolist()
        for i, r in enumerate(step.sampled):
            if r.finished:  # aborted while the step ran
                continue
            tok = tokens[i]
            r.output_ids.append(tok)
            r.output_logprobs.append(lps[i])
            n_top = r.params.logprobs or 0
            top = [(int(a), float(b)) for a, b in zip(result.top_ids[i, :min(n_top, k)],
                                                      result.top_logprobs[i, :min(n_top, k)], strict=True)]
            r.output_top.append(top)
            if r.first_token_time is None:
                r.first_token_time = now
            reason = None
            if tok in r.stop_token_ids and r.num_output >= r.params.min_tokens:
                reason = FinishReason.STOP
            elif r.num_output >= r.params.max_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                self._finish(r, reason)
            outs.append(StepOutput(r.rid, [tok], [lps[i]], [top], reason, r.num_prompt, r.num_output))
        return outs

    # ---- internals -------------------------------------------------------------------
    def _admit(self, budget: int, prefill: list[tuple[Request, int]]) -> int:
        """Move waiting requests (queue order) into the running set while they fit.

        A candidate whose whole prompt is prefilled this step advances in lockstep with the
        decoders from now on and is judged by the peak formula; one whose prompt must be
        chunked is charged as a constant block until it decodes (see admission.py). The
        queue head that does not fit blocks the rest (first come, first served). Appends the
        admitted requests' prefill chunks to ``prefill``; returns the budget left.
        """
        if not self.waiting or budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
            return budget
        res, left, blocked = self._batch_split()
        res_l, left_l = res.tolist(), left.tolist()
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            cand = self.waiting[0]
            n = min(cand.num_prompt - cand.num_computed, budget)
            if n == cand.num_prompt - cand.num_computed:
                peak = peak_usage(np.array(res_l + [cand.resident], I64), np.array(left_l + [cand.left], I64))
                if peak + blocked > self.capacity:
                    break
                res_l.append(cand.resident)
                left_l.append(cand.left)
            else:
                if peak_usage(np.array(res_l, I64), np.array(left_l, I64)) + blocked + cand.resident + cand.left \
                        > self.capacity:
                    break
                blocked += cand.resident + cand.left
            self.waiting.popleft()
            cand.admit_time = now
            self.running.append(cand)
            prefill.append((cand, n))
            budget -= n
        return budget

    def _batch_split(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(resident, left) of the requests advancing every step, and the blocked total."""
        lock = [r for r in self.running if not r.is_prefilling]
        blocked = sum(r.resident + r.left for r in self.running if r.is_prefilling)
        res = np.fromiter((r.resident for r in lock), dtype=I64, count=len(lock))
        left = np.fromiter((r.left for r in lock), dtype=I64, count=len(lock))
        return res, left, blocked

    def peak_estimate(self) -> int:
        res, left, blocked = self._batch_split()
        return peak_usage(res, left) + blocked

    def _finish(self, r: Request, reason: FinishReason) -> None:
        r.finish_reason = reason
        self._by_id.pop(r.rid, None)
        if r in self.running:
            self.running.remove(r)
            if r.num_computed:
                self.allocator.free(r.held_slots())
        else:
            try:
                self.waiting.remove(r)
            except ValueError:
                pass

    def _build(self, decode: list[Request], prefill: list[tuple[Request, int]]) -> ScheduledStep:
        rows = decode + [r for r, _ in prefill]
        q_lens = np.array([1] * len(decode) + [n for _, n in prefill], dtype=I64)
        # Slots for this step's new tokens: one run for all decodes, one run per prefill chunk.
        new_slots = [self.allocator.alloc(len(decode))] if decode else []
        new_slots += [self.allocator.alloc(n) for _, n in prefill]
        d_slots = new_slots[0] if decode else None
        for i, r in enumerate(decode):
            assert d_slots is not None
            r.slots[r.num_computed] = d_slots[i]
        for (r, n), s in zip(prefill, new_slots[1:] if decode else new_slots, strict=True):
            r.slots[r.num_computed:r.num_computed + n] = s
        starts = np.fromiter((r.num_computed for r in rows), dtype=I64, count=len(rows))
        seq_lens = starts + q_lens
        input_ids = np.concatenate(
            [np.fromiter((r.output_ids[-1] for r in decode), dtype=I64, count=len(decode))]
            + [r.token_at(r.num_computed, r.num_computed + n) for r, n in prefill])
        out_slots = np.concatenate(new_slots)
        positions = np.repeat(starts - np.cumsum(q_lens) + q_lens, q_lens) + np.arange(int(q_lens.sum()))
        kv_offsets = np.zeros(len(rows) + 1, dtype=I64)
        np.cumsum(seq_lens, out=kv_offsets[1:])
        kv_slots = np.concatenate([r.slots[:s] for r, s in zip(rows, seq_lens.tolist(), strict=True)])
        # A row samples when its prompt is complete after this step.
        sample_mask = seq_lens >= np.fromiter((r.num_prompt for r in rows), dtype=I64, count=len(rows))
        sample_rows = np.flatnonzero(sample_mask).astype(I64)
        sampled = [rows[i] for i in sample_rows.tolist()]
        plan = ForwardPlan(input_ids=input_ids.astype(I64, copy=False), positions=positions.astype(I64),
                           out_slots=out_slots, query_lens=q_lens, seq_lens=seq_lens, kv_slots=kv_slots,
                           kv_offsets=kv_offsets, sample_rows=sample_rows, sampling=build_sampling(sampled))
        n_new = sum(1 for r, _ in prefill if r.num_computed == 0)
        return ScheduledStep(plan, rows, sampled, n_new, int(q_lens[len(decode):].sum()), len(decode))


def build_sampling(reqs: list[Request]) -> SamplingBatch:
    """Per-row sampling arrays for the requests that sample this step."""
    ps = [r.params for r in reqs]
    n = len(ps)

    def col(get, dtype):  # type: ignore[no-untyped-def]
        return np.fromiter((get(p) for p in ps), dtype=dtype, count=n)

    batch = SamplingBatch(
        temperature=col(lambda p: p.temperature, np.float32),
        top_p=col(lambda p: p.top_p, np.float32),
        top_k=col(lambda p: p.top_k, I64),
        min_p=col(lambda p: p.min_p, np.float32),
        repetition_penalty=col(lambda p: p.repetition_penalty, np.float32),
        frequency_penalty=col(lambda p: p.frequency_penalty, np.float32),
        presence_penalty=col(lambda p: p.presence_penalty, np.float32),
        seeds=col(lambda p: (p.seed or 0) & 0x7FFF_FFFF_FFFF_FFFF, I64),
        has_seed=col(lambda p: p.seed is not None, np.bool_),
        seed_steps=np.fromiter((r.num_output for r in reqs), dtype=I64, count=n),
        num_logprobs=col(lambda p: -1 if p.logprobs is None else p.logprobs, I64),
    )
    if any(p.has_penalties for p in ps):
        empty = np.zeros(0, I64)
        batch.prompt_ids, batch.prompt_offsets = SamplingBatch.ragged(
            [r.prompt_ids if r.params.repetition_penalty != 1.0 else empty for r in reqs])
        batch.output_ids, batch.output_offsets = SamplingBatch.ragged(
            [r.output_ids if r.params.has_penalties else [] for r in reqs])
    if any(p.min_tokens for p in ps):
        batch.suppress_ids, batch.suppress_offsets = SamplingBatch.ragged(
            [sorted(r.stop_token_ids) if r.num_output < r.params.min_tokens else [] for r in reqs])
    return batch
