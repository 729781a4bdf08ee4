"""The plan's per-row sampling settings, built from the requests that sample in a step.

Owns one translation: requests (their ``SamplingParams``, prompt and output so far, grammar
state) -> ``SamplingBatch``, the numpy arrays the runner's sampler reads. One row per plan sample
row; a speculating request has one row per guess row, each at its own output position (after the
guesses fed before it, ``before``), so seeded draws, min_tokens suppression and the grammar's
allowed tokens are those that row's token would have had one token per step. A constrained
request's rows get their grammar bitmask (its state after ``before``) and no min_tokens
suppression: the grammar decides where the output may end. Reads the requests; the grammar states
it consults are left as they were.
"""

from __future__ import annotations

import time

import numpy as np

from lockgate.plan import SamplingBatch
from lockgate.scheduler.request import Request

I64 = np.int64


def build_sampling(reqs: list[Request], before: list[list[int]] | None = None) -> SamplingBatch:
    """Per-row sampling arrays for the requests that sample this step. ``before[i]``: the guessed
    tokens fed ahead of row ``i`` (a speculating request's rows after its first; [] for every other
    row): row ``i`` samples the request's output token ``num_output + len(before[i])``."""
    ps = [r.params for r in reqs]
    n = len(ps)
    ahead = [len(b) for b in before] if before is not None else [0] * n
    made = [r.num_output + ahead[i] for i, r in enumerate(reqs)]  # outputs before each row's token

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
        seed_steps=np.asarray(made, dtype=I64).reshape(n),
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
            [sorted(r.stop_token_ids) if m < r.params.min_tokens and r.grammar is None else []
             for r, m in zip(reqs, made, strict=True)])
    constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if constrained:
        words = reqs[constrained[0]].grammar.words  # type: ignore[union-attr]
        t0 = time.perf_counter()
        allowed = np.empty((len(constrained), words), dtype=np.int32)
        for k, i in enumerate(constrained):
            reqs[i].grammar.fill(allowed[k], before[i] if before is not None else ())  # type: ignore[union-attr]
        batch.allowed_rows, batch.allowed = np.asarray(constrained, dtype=I64), allowed
        batch.allowed_seconds = time.perf_counter() - t0
    return batch
