"""Scheduler: continuous batching over a token-granular KV pool, with a prefix cache.

Owns the waiting queue, the running set, the slot allocator, the radix prefix cache and the
bookkeeping between requests and that cache. Each call to ``schedule()`` builds one step (a
``ForwardPlan``):

0. (``ratio`` admission only) **Retract** the most recently admitted requests while the
   decoding requests would not get a slot each; their KV goes to the prefix cache and they
   are re-queued first.
1. **Prefill** prompts already admitted (oldest first) under the ``max_prefill_tokens``
   budget; a prompt longer than what is left of the budget is cut into chunks over
   several steps.
2. **Order** the waiting queue by the policy (``policy.py``: fcfs, lpm, dfs-weight, lof,
   random, with a starvation bound), then **admit** in that order while the running set has
   room, prefill budget is left and the admission mode's estimate of the batch's future KV
   need fits the pool (``admission.py``; cache slots shared by several requests are charged
   once, to the one that holds them longest: ``admission.Charges``).
   A candidate first matches its longest cached prefix: those tokens are not recomputed,
   their slots are locked in the tree and not counted again. The first candidate that does
   not fit blocks the rest. Admitted requests get their first chunk in this same step.
3. **Decode** every running request whose prefill is done: one token each, in the same
   step as the prefill chunks, so a long prompt never stalls running decodes.
4. **Speculate** (``_drafts``) while the step's decode rows are few: a greedy request is fed
   its newest token and up to ``speculative_tokens`` guesses from its own history
   (``speculate.NgramIndex``), one plan row each. The rows of one request are ordinary
   one-token decode rows whose contexts are prefixes of each other (row ``j`` sees the
   request's keys through its own guess ``j``), so the runner, the attention kernel and
   the sampler need nothing new. ``update`` keeps the sampled tokens while they agree with
   the guesses (plus the first one that does not) and frees the slots of the guesses the
   model did not take. Greedy results are the same tokens as without speculation where a
   row's logits do not depend on the other rows (bitwise on the float32 integer-kernel path;
   up to rounding where the row count changes the numerics, as batching does).

``update()`` applies the runner's ``ForwardResult``: appends tokens, inserts freshly
prefilled KV into the tree (so concurrent requests can share it), finishes requests
(stop token, EOS, max_tokens) and hands their KV to the tree (or frees it) at once.

Slot ownership (the one place that joins requests and the tree; DESIGN.md habit 3): a
running request's ``slots[:tree_len]`` belong to the tree and are locked through
``tree_node``; ``slots[tree_len:num_computed]`` are its own. Waiting requests hold nothing.
When the allocator runs short, unlocked tree nodes are evicted (LRU). Invariant (checked by
``check_invariants`` after every step in tests)::

    allocator.num_free + tree.total_size + sum(r.num_private for r in running) == capacity

and, for ``peak`` and ``reserve`` admission, no ``alloc`` ever fails. Speculation keeps that
promise by running only while every running request could grow to its full
``prompt + max_tokens`` at once (``_worst_case_fits``): a request that gains several tokens in
a step breaks the lockstep the peak estimate assumes, and outside that condition requests
advance in lockstep again.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from lockgate.config import SchedulerConfig
from lockgate.kvcache.allocator import OutOfSlots, SlotAllocator
from lockgate.kvcache.radix import RadixCache
from lockgate.plan import ForwardPlan, ForwardResult
from lockgate.scheduler.admission import Charges, make_admission
from lockgate.scheduler.policy import QueueDelayBound, make_policy
from lockgate.scheduler.request import FinishReason, Request
from lockgate.scheduler.sampling_batch import build_sampling
from lockgate.scheduler.speculate import NgramIndex

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
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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


@dataclass(frozen=True)
class SchedulerStats:
    running: int
    waiting: int
    slots_used: int  # held by running requests (their own + locked cache nodes)
    slots_free: int
    slots_evictable: int  # cached, unlocked: reclaimable on demand
    capacity: int
    headroom: int  # capacity - (admission estimate of the running batch + locked cache slots)
    retractions: int = 0
    draft_tokens: int = 0  # speculation: guesses fed to the model so far
    accepted_tokens: int = 0  # of those, the ones it agreed with


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, capacity: int, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], seed: int = 0) -> None:
        self.cfg = cfg
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = SlotAllocator(capacity)
        self.tree: RadixCache | None = None if cfg.disable_prefix_cache else RadixCache()
        self.admission = make_admission(cfg.admission, cfg.init_new_token_ratio, cfg.min_new_token_ratio,
                                        cfg.new_token_ratio_decay_steps)
        steps, seconds = cfg.queue_delay_bound
        self.policy = make_policy(cfg.schedule_policy, QueueDelayBound(steps, seconds), seed=seed)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self._by_id: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_retractions = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._step_cached = 0  # prompt tokens new requests took from the cache in the step being built

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
            raise RequestRejected(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.vocab_size})")

    def submit(self, req: Request) -> None:
        if req.rid in self._by_id:
            raise RequestRejected(f"duplicate request id {req.rid!r}")
        self.validate(req.prompt_ids, req.params.max_tokens)
        eos = frozenset() if req.params.ignore_eos else self.eos_token_ids
        req.stop_token_ids = eos | frozenset(req.params.stop_token_ids)
        req.enqueue_step = self.num_steps
        self.waiting.append(req)
        self._by_id[req.rid] = req

    def abort(self, rid: str) -> Request | None:
        """Cancel a request wherever it is; its slots return to the pool (or cache) at once."""
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

    @property
    def protected(self) -> int:
        return self.tree.protected_size if self.tree is not None else 0

    @property
    def evictable(self) -> int:
        return self.tree.evictable_size if self.tree is not None else 0

    def stats(self) -> SchedulerStats:
        free, evictable = self.allocator.num_free, self.evictable
        return SchedulerStats(running=len(self.running), waiting=len(self.waiting),
                              slots_used=self.capacity - free - evictable, slots_free=free,
                              slots_evictable=evictable, capacity=self.capacity,
                              headroom=self.capacity - self.usage_estimate(), retractions=self.num_retractions,
                              draft_tokens=self.num_draft_tokens, accepted_tokens=self.num_accepted_tokens)

    def usage_estimate(self) -> int:
        """The admission mode's estimate of the running batch's future KV need (cache slots
        the batch locks included, each counted once)."""
        return self._charges().estimate(self.admission)

    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        cached = 0
        if self.tree is not None:
            self.tree.check_invariants()
            cached = self.tree.total_size
        private = sum(r.num_private for r in self.running)
        assert self.allocator.num_free + cached + private == self.capacity, (
            f"slot accounting broken: free {self.allocator.num_free} + cached {cached} + in use {private} "
            f"!= capacity {self.capacity}")
        for r in self.running:
            assert 0 <= r.tree_len <= r.num_computed
            assert (r.tree_node is None) == (r.tree_len == 0) or self.tree is None
            if r.tree_node is not None:
                assert r.tree_node.lock_ref > 0
        for r in self.waiting:
            assert r.num_computed == 0 and r.tree_node is None, f"waiting request {r.rid} holds KV"
        if not self.admission.can_run_out:
            est = self.usage_estimate()
            assert est <= self.capacity, f"running batch's estimate {est} exceeds capacity {self.capacity}"

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        self.num_steps += 1
        if self.admission.can_run_out:
            self._retract_if_short()
        budget = self.cfg.max_prefill_tokens
        prefill: list[tuple[Request, int]] = []
        for r in self.running:  # prompts already admitted continue first, oldest first
            if budget <= 0:
                break
            if r.is_prefilling:
                n = min(r.prefill_len - r.num_computed, budget)
                prefill.append((r, n))
                budget -= n
        n_old = len(prefill)
        self._step_cached = 0
        budget = self._admit(budget, prefill)
        if not self.running:
            return None
        chosen = {id(r) for r, _ in prefill}
        decode = [r for r in self.running if not r.is_prefilling and id(r) not in chosen]
        if not decode and not prefill:
            return None
        step = self._build(decode, self._drafts(decode), prefill)
        step.num_new_seqs = len(prefill) - n_old
        step.num_cached_tokens = self._step_cached
        if decode:
            self.admission.on_decode_step()
        return step

    def update(self, step: ScheduledStep, result: ForwardResult) -> list[StepOutput]:
        """Apply a step's result; returns one StepOutput per request that got a token or finished."""
        now = time.monotonic()
        for b, (r, q) in enumerate(zip(step.rows, step.plan.query_lens.tolist(), strict=True)):
            if not r.finished:
                r.num_computed += q
                r.pending = 0
                if b >= step.num_decode_rows and self.tree is not None:
                    self._cache(r, keep_lock=True)  # share freshly prefilled KV with later requests
        outs: list[StepOutput] = []
        k = result.top_ids.shape[1] if result.top_ids.ndim == 2 else 0
        tokens, lps = result.tokens.tolist(), result.logprobs.tolist()
        row = 0
        for r, guesses in zip(step.sampled, step.drafts, strict=True):
            first, row = row, row + 1 + len(guesses)
            if r.finished:  # aborted while the step ran
                continue
            new: list[int] = []
            new_lps: list[float] = []
            new_top: list[list[tuple[int, float]]] = []
            n_top = min(r.params.logprobs or 0, k)
            reason = None
            # Row first + j sampled after guess j - 1: its token counts while the guesses before it were right.
            for j in range(1 + len(guesses)):
                i = first + j
                tok = tokens[i]
                top = [(int(a), float(b)) for a, b in zip(result.top_ids[i, :n_top], result.top_logprobs[i, :n_top],
                                                          strict=True)]
                r.output_ids.append(tok)
                r.output_logprobs.append(lps[i])
                r.output_top.append(top)
                new.append(tok)
                new_lps.append(lps[i])
                new_top.append(top)
                if tok in r.stop_token_ids and r.num_output >= r.params.min_tokens:
                    reason = FinishReason.STOP
                elif r.num_output >= r.params.max_tokens:
                    reason = FinishReason.LENGTH
                if reason is not None or j == len(guesses) or guesses[j] != tok:
                    break
            if guesses:
                self._drop_guesses(r, 1 + len(guesses) - len(new))
                r.num_drafted += len(guesses)
                r.num_accepted += len(new) - 1
                self.num_draft_tokens += len(guesses)
                self.num_accepted_tokens += len(new) - 1
            if r.first_token_time is None:
                r.first_token_time = now
            step.num_generated += len(new)
            if reason is not None:
                self._finish(r, reason)
            outs.append(StepOutput(r.rid, new, new_lps, new_top, reason, r.num_prompt, r.num_output,
                                   r.cached_tokens))
        return outs

    def _drop_guesses(self, r: Request, n: int) -> None:
        """The last ``n`` computed positions of ``r`` held guesses the model did not take:
        their slots (its own, never in the tree) go back to the pool."""
        if n:
            assert r.num_computed - n >= r.tree_len
            self.allocator.free(r.slots[r.num_computed - n:r.num_computed].copy())
            r.num_computed -= n

    # ---- admission -------------------------------------------------------------------
    def _admit(self, budget: int, prefill: list[tuple[Request, int]]) -> int:
        """Move waiting requests (policy order) into the running set while they fit.

        A candidate whose whole remaining prefill runs this step advances in lockstep with
        the decoders from now on; one whose prompt must be chunked is charged as a stalled
        block until it decodes (see admission.py). A candidate's cached prefix is locked
        before the check (``Charges`` then counts those slots once) and unlocked if it does
        not fit. Appends the admitted requests' prefill chunks to ``prefill``; returns the
        budget left.
        """
        if not self.waiting or budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
            return budget
        if len(self.waiting) > 1:
            self.waiting = deque(self.policy.order(list(self.waiting), self.tree, self.num_steps, time.monotonic()))
        charges = self._charges()
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            cand = self.waiting[0]
            matched, node, slots = self._match(cand)
            n = min(cand.prefill_len - matched, budget)
            trial = charges.copy()
            trial.add(cand.num_tokens - matched, cand.left, stalled=n < cand.prefill_len - matched, node=node)
            if trial.estimate(self.admission) > self.capacity:
                if node is not None:
                    self._unlock(node)
                break
            charges = trial
            self.waiting.popleft()
            cand.tree_node, cand.tree_len, cand.num_computed = node, matched, matched
            cand.slots[:matched] = slots
            if cand.num_retractions == 0:
                cand.cached_tokens = matched
            self._step_cached += matched
            cand.admit_time = cand.admit_time or now
            self.running.append(cand)
            prefill.append((cand, n))
            budget -= n
        return budget

    def _match(self, r: Request) -> tuple[int, Any, np.ndarray]:
        """Longest cached prefix of what ``r`` must prefill, leaving at least one token to
        compute (its logits give the next token). Locks the match; (0, None, []) if none."""
        if self.tree is None or r.prefill_len < 2:
            return 0, None, np.zeros(0, I64)
        m = self.tree.match_prefix(r.token_at(0, r.prefill_len - 1))
        if m.length == 0:
            return 0, None, np.zeros(0, I64)
        self.tree.lock(m.node)
        return m.length, m.node, m.slots

    def _unlock(self, node: Any) -> None:
        assert self.tree is not None
        self.tree.unlock(node)

    def _charges(self) -> Charges:
        """The running batch as admission rows, longest-living first (stalled ones count as
        longest), so each shared cache node is charged to the request that holds it longest."""
        ch = Charges()
        for r in sorted(self.running, key=lambda r: (r.is_prefilling, r.left), reverse=True):
            ch.add(r.num_tokens - r.tree_len, r.left, stalled=r.is_prefilling, node=r.tree_node)
        return ch


    # ---- prefix cache and retraction -------------------------------------------------
    def _cache(self, r: Request, keep_lock: bool) -> None:
        """Insert ``r``'s computed KV into the tree. Its slots the tree already had (another
        request cached the same tokens) are freed and replaced by the tree's. With
        ``keep_lock`` the request keeps using (and locking) the whole cached path;
        otherwise it lets go of the tree entirely."""
        tree = self.tree
        assert tree is not None
        n = r.num_computed
        if n > r.tree_len:
            toks = r.token_at(0, n)
            mine = r.slots[:n].copy()
            had = tree.insert(toks, mine)
            if had > r.tree_len:
                self.allocator.free(mine[r.tree_len:had])
            if keep_lock:
                m = tree.match_prefix(toks)
                assert m.length == n, f"inserted {n} tokens but matched {m.length}"
                r.slots[:n] = m.slots
                tree.lock(m.node)
                if r.tree_node is not None:
                    tree.unlock(r.tree_node)
                r.tree_node, r.tree_len = m.node, n
        if not keep_lock and r.tree_node is not None:
            tree.unlock(r.tree_node)
            r.tree_node, r.tree_len = None, 0

    def _release(self, r: Request) -> None:
        """``r`` leaves the running set: its KV goes to the tree (or back to the pool).
        Slots allocated for a step in flight (not computed yet) go straight back."""
        if r.pending:
            self.allocator.free(r.slots[r.num_computed:r.num_computed + r.pending].copy())
            r.pending = 0
        if self.tree is not None:
            self._cache(r, keep_lock=False)
        elif r.num_computed:
            self.allocator.free(r.held_slots())
        r.num_computed, r.tree_len, r.tree_node = 0, 0, None

    def _retract_if_short(self) -> None:
        """Ratio admission: while this step's decodes (one slot each) and the prefill chunks of
        admitted prompts would not fit, retract the most recently admitted request (its KV
        stays in the prefix cache) and re-queue it first."""
        while len(self.running) > 1:
            decode = sum(1 for r in self.running if not r.is_prefilling)
            chunks = min(self.cfg.max_prefill_tokens,
                         sum(r.prefill_len - r.num_computed for r in self.running if r.is_prefilling))
            if decode + chunks <= self.allocator.num_free + self.evictable:
                return
            victim = self.running.pop()
            self._release(victim)
            victim.prefill_len = victim.num_tokens  # resume: recompute prompt + output, then sample
            victim.num_retractions += 1
            victim.enqueue_step = self.num_steps
            self.waiting.appendleft(victim)
            self.num_retractions += 1
            self.admission.on_retract(sum(r.num_output for r in self.running), len(self.running),
                                      sum(r.params.max_tokens for r in self.running))
            log.info("retracted request %s (%d tokens) to free KV slots; %d running, new-token ratio now %.2f",
                     victim.rid, victim.num_tokens, len(self.running), getattr(self.admission, "ratio", 1.0))

    def _finish(self, r: Request, reason: FinishReason) -> None:
        r.finish_reason = reason
        self._by_id.pop(r.rid, None)
        if r in self.running:
            self.running.remove(r)
            self._release(r)
        else:
            try:
                self.waiting.remove(r)
            except ValueError:
                pass

    # ---- speculation -----------------------------------------------------------------
    def _drafts(self, decode: list[Request]) -> list[list[int]]:
        """Guesses for each decoding request (``[]`` for most): only while the step's decode
        rows stay within ``speculative_max_rows`` and the pool could hold every running request
        at its full size; earlier requests first; never beyond a request's last token."""
        cfg = self.cfg
        out: list[list[int]] = [[] for _ in decode]
        room = cfg.speculative_max_rows - len(decode)
        if cfg.speculative_tokens == 0 or room <= 0 or not self._worst_case_fits():
            return out
        for i, r in enumerate(decode):
            k = min(cfg.speculative_tokens, room, r.left - 1)
            if k <= 0 or not self._may_speculate(r):
                continue
            if r.drafter is None:
                r.drafter = NgramIndex(cfg.speculative_ngram_min, cfg.speculative_ngram_max)
            if len(r.drafter) < r.num_tokens:
                r.drafter.extend(r.token_at(len(r.drafter), r.num_tokens).tolist())
            out[i] = r.drafter.propose(k)
            room -= len(out[i])
        return out

    @staticmethod
    def _may_speculate(r: Request) -> bool:
        """Greedy without penalties: each row's token is then the argmax of its own logits
        (stop tokens suppressed while the row's output would be shorter than min_tokens, as
        ``build_sampling``'s ``ahead`` arranges), whatever the rows before it."""
        p = r.params
        return p.temperature == 0.0 and not p.has_penalties

    def _worst_case_fits(self) -> bool:
        """Every running request at ``prompt + max_tokens`` at once (cache slots they lock
        counted once) fits the pool: no order of progress can run it out."""
        return self.protected + sum(r.resident + r.left for r in self.running) <= self.capacity

    # ---- building the plan -----------------------------------------------------------
    def _alloc(self, n: int) -> np.ndarray:
        if self.allocator.num_free < n and self.tree is not None:
            freed = self.tree.evict(n - self.allocator.num_free)
            if freed.size:
                self.allocator.free(freed)
        if self.allocator.num_free < n:
            raise OutOfSlots(f"need {n} KV slots, {self.allocator.num_free} free and nothing evictable")
        return self.allocator.alloc(n)

    def _build(self, decode: list[Request], drafts: list[list[int]],
               prefill: list[tuple[Request, int]]) -> ScheduledStep:
        """The plan: decode rows first (request ``r`` with guesses ``g``: 1 + len(g) one-token
        rows, fed its newest token then ``g``), then one row per prefill chunk."""
        spans = [1 + len(g) for g in drafts]
        n_dec = sum(spans)
        rows = [r for r, s in zip(decode, spans, strict=True) for _ in range(s)] + [r for r, _ in prefill]
        q_lens = np.array([1] * n_dec + [n for _, n in prefill], dtype=I64)
        # Slots for this step's new tokens: one run for all decode rows, one run per prefill chunk.
        new_slots: list[np.ndarray] = []
        try:
            if decode:
                new_slots.append(self._alloc(n_dec))
            for _, n in prefill:
                new_slots.append(self._alloc(n))
        except OutOfSlots:
            for run in new_slots:  # give back what this step took before failing
                self.allocator.free(run)
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
        plan = ForwardPlan(input_ids=input_ids.astype(I64, copy=False), positions=positions.astype(I64),
                           out_slots=out_slots, query_lens=q_lens, seq_lens=seq_lens, kv_slots=kv_slots,
                           kv_offsets=kv_offsets, sample_rows=sample_rows,
                           sampling=build_sampling([rows[i] for i in sample_rows.tolist()],
                                                   [j for s in spans for j in range(s)] + [0] * len(done)))
        return ScheduledStep(plan, rows, sampled, sample_drafts, 0, int(q_lens[n_dec:].sum()), len(decode), n_dec)
