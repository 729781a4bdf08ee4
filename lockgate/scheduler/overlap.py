"""Overlap scheduling's bookkeeping: a step launched before the result of the one ahead of it.

Owns the four operations ``EngineCore`` performs around a step it launches early
(``--overlap-schedule``; the event loop is engine/core.py's):

* ``needs_result``: whether the next step can be planned before a step's result, or must wait
  for it. A plan that needs a token's value waits: guesses to verify, a grammar's mask, penalties,
  an adapter's slot. A plan that needs only the token's place does not.
* ``commit``: the step's rows count as computed now, and each request it samples for holds
  ``plan.PLACEHOLDER`` as its newest token, so the next ``Scheduler.schedule`` builds on it.
* ``feed``: which of the next step's input rows take which of this step's sampled tokens. Whoever
  runs the next step copies them in once this step's result exists.
* ``uncommit``: a committed step failed. Its rows are not computed after all and its placeholders
  go.

``Scheduler.update`` puts a committed step's tokens in their places (``step.out_index``).

Invariants: a step with guesses is never committed (how many tokens it keeps is known only after).
Nothing reads a placeholder's value: it sits past ``num_computed``, so the prefix cache never takes
it, and admission holds back a request retracted while its token is in flight. A placeholder in
a plan's inputs always belongs to the committed step launched just ahead of it.
"""

from __future__ import annotations

from collections.abc import Container

import numpy as np

from lockgate.plan import PLACEHOLDER
from lockgate.scheduler.plan_builder import ScheduledStep
from lockgate.scheduler.request import Request
from lockgate.scheduler.speculate import may_speculate


def needs_result(step: ScheduledStep, speculative: bool) -> bool:
    """The next step cannot be planned before ``step``'s result. Either ``step`` has guesses to
    verify, or a request it samples for guesses (``speculative``: speculation is on), follows a
    grammar or has penalties: the next plan would read the token's value, not only its place."""
    if not step.committed or step.plan.lora_slots.size:  # (adapters: no slot changes under a step in flight)
        return True
    return any(r.grammar is not None or r.params.has_penalties or (speculative and may_speculate(r))
               for r in step.sampled if not r.finished)


def commit(step: ScheduledStep) -> None:
    """``step`` is launched ahead of its result. Its rows count as computed now, and each request it
    samples for gets ``PLACEHOLDER`` as its newest token (its index in ``step.out_index``)."""
    assert not any(step.drafts), "a step with guesses cannot be committed ahead of its result"
    for r, q in zip(step.rows, step.plan.query_lens.tolist(), strict=True):
        if not r.finished:
            r.num_computed += q
            r.pending = 0
    step.out_index = []
    for r in step.sampled:
        if not r.finished:
            r.output_ids.append(PLACEHOLDER)
        step.out_index.append(len(r.output_ids) - 1)
    step.committed = True


def feed(step: ScheduledStep, before: ScheduledStep) -> tuple[np.ndarray, np.ndarray]:
    """Where ``step``'s inputs wait for ``before``'s tokens. Returns the rows of ``step``'s plan that
    hold ``PLACEHOLDER``, and the index of each one's token among ``before``'s sampled rows.
    ``before`` is the committed step launched just ahead of ``step``."""
    ids = step.plan.input_ids
    rows = np.flatnonzero(ids[:step.num_decode_rows] == PLACEHOLDER)
    if not rows.size:
        return rows, rows
    at = {id(r): s for s, r in enumerate(before.sampled)}
    src = np.array([at[id(step.rows[b])] for b in rows.tolist()], dtype=np.int64)
    return rows, src


def uncommit(step: ScheduledStep, running: Container[Request], waiting: Container[Request]) -> None:
    """A committed step failed. Its rows are not computed after all: for the requests still
    ``running``, their slots go back to being in flight, so leaving frees them. Its placeholders
    go. A request ``waiting`` again (retracted meanwhile) resumes from the tokens it has."""
    for r, q in zip(step.rows, step.plan.query_lens.tolist(), strict=True):
        if not r.finished and r.num_computed >= q and r in running:
            r.num_computed -= q
            r.pending += q
    for r, at in zip(step.sampled, step.out_index, strict=True):
        if not r.finished and at < len(r.output_ids) and r.output_ids[at] == PLACEHOLDER:
            del r.output_ids[at:]
            if r in waiting:
                r.prefill_len = r.num_tokens
    step.committed = False
