"""Batched sampler: logits [S, V] + ``SamplingBatch`` -> one token per row, plus logprobs.

Owns turning the model's last-position logits into tokens for the ``S`` rows that sample
this step, and the log-probabilities reported to clients. Called by the model runner once
per step with ``ForwardPlan.sampling``; it knows nothing of requests, the scheduler or the
server (only ``lockgate.plan.SamplingBatch``, plain numpy arrays).

Order of processing, each step one batched pass over the whole [S, V] tensor:

0. allowed: a constrained row's tokens outside its grammar bitmask (``allowed_rows`` /
   ``allowed``) -> -inf, so greedy and sampled rows alike choose only what the grammar allows.
1. suppress: each row's ``suppress_ids`` -> -inf (EOS / stop ids while the request has
   produced fewer than ``min_tokens``).
2. repetition penalty, HF style, over the tokens in the row's ``prompt_ids`` + ``output_ids``:
   ``logit > 0 -> logit / p`` else ``logit * p``.
3. frequency / presence penalties, OpenAI style, over ``output_ids`` only:
   ``logit -= freq * count + presence * (count > 0)``.
4. greedy rows (``temperature == 0``): argmax of the penalised logits.
5. other rows: ``logits / temperature``; ``top_k`` (<= 0 off); ``top_p`` (the nucleus: the
   smallest prefix of the descending distribution whose cumulative probability reaches
   ``top_p``, so the top token always stays); ``min_p`` (drop tokens whose probability is
   < ``min_p`` * the largest probability); then sample by an exponential race,
   ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per (row, token), which draws exactly
   from ``probs`` (so masking needs no renormalisation). top_k and top_p cut at a value
   threshold: tokens tied with the last kept one stay too, so the result never depends on
   how a sort ordered ties. Only the head of each row is sorted for top_p (``topk`` of a
   few hundred, widened when a nucleus is bigger), never the whole vocabulary up front.

Fast path: every row greedy, no penalties, no suppress ids, no grammar -> plain argmax
(``argmax``: lockgate's kernel where it is loaded, torch's rules either way). Where no row asks
for logprobs either (``plain_greedy``), the runner skips the float32 logits altogether: the model
takes the argmax of its head's rows in the run dtype and ``greedy_output`` wraps the tokens.

Invariants:

* The caller's logits are never modified; all arithmetic is float32.
* ``logprobs`` / ``top_logprobs`` are the log-softmax of the RAW logits (before steps 1-5), as
  vLLM reports by default; ``top_*`` have ``K = max(num_logprobs)`` columns (>= 0, <= V),
  sorted descending, equal values by ascending id (argmax's tie rule, so a greedy row's token
  leads its own top list). Rows that asked for fewer just ignore the extra columns. When no row asked
  (every num_logprobs is -1) ``logprobs`` is NaN: the log-sum-exp over the vocabulary is skipped
  (2.7 ms of a 32-row step of a 49k vocabulary on 2 cores).
* A seeded row draws its noise, in vocabulary order, from its own ``torch.Generator`` seeded
  with ``step_seed(seed, seed_steps)``. Its token therefore depends only on (seed, seed_steps,
  its logits row, its own knobs), never on the other rows or its position in the batch.
  Unseeded rows share one draw from ``global_generator`` (torch's default if None).
* Ids outside ``[0, V)`` in the ragged lists are ignored (a user's stop_token_ids may be).
* No Python loop over rows, except one generator draw per seeded sampling row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lockgate.plan import SamplingBatch

__all__ = ["SampleOutput", "apply_allowed", "apply_penalties", "apply_suppress", "argmax", "argmax_kernel",
           "greedy_output", "plain_greedy", "sample", "step_seed"]

_M64 = (1 << 64) - 1
# float32 uniforms come on a 2^-24 grid, so E = -log(1 - U) has an atom at 0 standing for the
# bin [0, 2^-24); it becomes that bin's midpoint. A tiny floor (say 1e-30) would instead let
# any token with a nonzero probability win whenever its U == 0 (V * 2^-24 of all draws).
_MIN_NOISE = 2.0**-25


@dataclass
class SampleOutput:
    """The sampler's answer, torch tensors on the logits' device."""

    tokens: torch.Tensor  # i64 [S]
    logprobs: torch.Tensor  # f32 [S], raw log-softmax at the chosen token
    top_ids: torch.Tensor  # i64 [S, K]
    top_logprobs: torch.Tensor  # f32 [S, K], descending

    def to_numpy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens i64 [S], logprobs f32 [S], top_ids i64 [S, K], top_logprobs f32 [S, K])."""
        return (self.tokens.cpu().numpy(), self.logprobs.cpu().numpy(),
                self.top_ids.cpu().numpy(), self.top_logprobs.cpu().numpy())


def step_seed(seed: int, step: int) -> int:
    """A 63-bit torch seed for draw number ``step`` of a request seeded with ``seed``.

    splitmix64(splitmix64(seed) + step): stable across processes and Python versions, and
    distinct (seed, step) pairs collide only by 64-bit chance.
    """

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & _M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)

    return mix((mix(int(seed) & _M64) + int(step)) & _M64) & 0x7FFF_FFFF_FFFF_FFFF


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of ``x`` [S, V] (float32 or bf16): torch's rules (first of equal
    values, first NaN), on ``lockgate::argmax_rows`` where it is loaded (one read of the rows at
    memory speed; torch's float32 argmax took 2.5 ms on [175, 49152], its bf16 one 9.9 ms)."""
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.shape[1]
            and argmax_kernel()):
        return torch.ops.lockgate.argmax_rows(x if x.stride(1) == 1 else x.contiguous())  # type: ignore[no-any-return]
    return x.argmax(dim=-1)


_argmax_kernel = False  # becomes True once lockgate::argmax_rows is seen loaded and vectorised


def argmax_kernel() -> bool:
    """Whether ``lockgate::argmax_rows`` is loaded and vectorised (AVX-512; its plain loop is slower
    than torch's argmax, so elsewhere torch's is kept). A yes is kept (kernels never unload); a no
    is asked again, as the kernels may load later."""
    global _argmax_kernel
    if not _argmax_kernel:
        try:
            _argmax_kernel = bool(torch.ops.lockgate.argmax_rows_vectorized())
        except (AttributeError, RuntimeError):
            return False
    return _argmax_kernel


def _greedy_on_raw_logits(batch: SamplingBatch) -> bool:
    """Every row greedy on unchanged logits (no penalty, suppressed id or grammar): a row's token
    is its logits' argmax."""
    return bool(batch.all_greedy and not batch.any_penalty and batch.suppress_ids.size == 0
                and batch.allowed_rows.size == 0)


def plain_greedy(batch: SamplingBatch) -> bool:
    """``_greedy_on_raw_logits`` and no row asking for logprobs: nothing but the argmax is reported."""
    return _greedy_on_raw_logits(batch) and (batch.num_logprobs.size == 0 or bool(batch.num_logprobs.max() < 0))


def greedy_output(tokens: torch.Tensor) -> SampleOutput:
    """``sample``'s answer for a ``plain_greedy`` batch whose tokens are known: NaN logprobs and
    no top lists, as ``sample`` gives when no row asked for logprobs."""
    s = tokens.shape[0]
    return SampleOutput(tokens=tokens, logprobs=torch.full((s,), float("nan"), device=tokens.device),
                        top_ids=torch.zeros(s, 0, dtype=torch.int64, device=tokens.device),
                        top_logprobs=torch.zeros(s, 0, dtype=torch.float32, device=tokens.device))


def sample(logits: torch.Tensor, batch: SamplingBatch,
           global_generator: torch.Generator | None = None) -> SampleOutput:
    """One token per row of ``logits`` [S, V] under ``batch``'s per-row settings."""
    _check(logits, batch)
    raw = logits.float()  # [S, V] f32; may alias the caller's tensor: read only
    if _greedy_on_raw_logits(batch):
        tokens = argmax(raw)  # [S]
    else:
        x = raw.clone()  # [S, V], ours to modify
        apply_allowed(x, batch)
        apply_suppress(x, batch)
        _penalize_(x, batch)
        tokens = _choose(x, batch, global_generator)  # [S]
    return _logprobs(raw, tokens, batch)


def apply_allowed(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Step 0, in place on ``x`` [S, V] f32: each constrained row's disallowed tokens -> -inf.

    As ``min(x, bound)`` with ``bound`` +inf where allowed and -inf where not (made from the
    unpacked bits as ``(bit - 0.5) * inf``): exact, and on CPU several times faster than a boolean
    ``masked_fill_`` (0.7 vs 4.5 ms for 32 rows of a 49k vocabulary)."""
    m = batch.allowed_rows.shape[0]
    if m == 0:
        return x
    s, v = x.shape
    bits = np.unpackbits(np.ascontiguousarray(batch.allowed, dtype=np.int32).view(np.uint8), axis=1,
                         bitorder="little")  # [M, 32 W] u8, token order
    if bits.shape[1] < v:
        raise ValueError(f"SamplingBatch.allowed covers {bits.shape[1]} tokens, the logits have {v}")
    bound = torch.from_numpy(bits[:, :v]).to(device=x.device, dtype=torch.float32).sub_(0.5).mul_(float("inf"))
    rows = np.asarray(batch.allowed_rows, dtype=np.int64)  # [M]
    if m == s and np.array_equal(rows, np.arange(s)):
        return torch.minimum(x, bound, out=x)
    rows_t = torch.from_numpy(rows).to(x.device)
    sub = x.index_select(0, rows_t)  # [M, V]
    x.index_copy_(0, rows_t, torch.minimum(sub, bound, out=sub))
    return x


def apply_suppress(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Step 1, in place on ``x`` [S, V] f32: each row's suppress_ids -> -inf. Returns ``x``."""
    if batch.suppress_ids.size:
        rows, cols = _ragged_index(batch.suppress_ids, batch.suppress_offsets, None, x.shape[1], x.device)
        x.index_put_((rows, cols), torch.tensor(float("-inf"), device=x.device))
    return x


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 2-3 (repetition, then frequency + presence) on a float32 copy of ``logits`` [S, V]."""
    _check(logits, batch)
    return _penalize_(logits.to(torch.float32, copy=True), batch)


# ---------------------------------------------------------------------------- internals


def _check(logits: torch.Tensor, b: SamplingBatch) -> None:
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a float [S, V] tensor, got {tuple(logits.shape)} {logits.dtype}")
    s = logits.shape[0]
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "seeds", "has_seed", "seed_steps", "num_logprobs"):
        if getattr(b, name).shape != (s,):
            raise ValueError(f"SamplingBatch.{name} has shape {getattr(b, name).shape}, logits have {s} rows")
    for name in ("prompt", "output", "suppress"):
        ids, off = getattr(b, f"{name}_ids"), getattr(b, f"{name}_offsets")
        if off.shape != (s + 1,) or int(off[-1]) != ids.shape[0]:
            raise ValueError(f"SamplingBatch.{name}_offsets must be [S + 1] ending at len({name}_ids)")


def _ragged_index(ids: np.ndarray, offsets: np.ndarray, local: np.ndarray | None, vocab: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) index tensors [N] for a ragged id list, dropping ids outside [0, vocab).

    ``local`` [S] renumbers rows into a subset (-1: row not in the subset, its ids dropped).
    """
    rows = np.repeat(np.arange(offsets.shape[0] - 1, dtype=np.int64), np.diff(offsets))  # [N]
    ids = np.asarray(ids, dtype=np.int64)  # [N]
    if local is not None:
        rows = local[rows]
    keep = (ids >= 0) & (ids < vocab) & (rows >= 0)
    return (torch.from_numpy(rows[keep]).to(device), torch.from_numpy(ids[keep]).to(device))


def _penalize_(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Steps 2-3 in place on ``x`` [S, V] f32, touching only the P rows with a penalty."""
    rep = np.asarray(b.repetition_penalty, dtype=np.float32)
    freq = np.asarray(b.frequency_penalty, dtype=np.float32)
    pres = np.asarray(b.presence_penalty, dtype=np.float32)
    rows = np.flatnonzero((rep != 1.0) | (freq != 0.0) | (pres != 0.0))  # [P]
    if rows.size == 0:
        return x
    s, v = x.shape
    dev = x.device
    local = np.full(s, -1, dtype=np.int64)
    local[rows] = np.arange(rows.size)
    rows_t = torch.from_numpy(rows).to(dev)  # [P]
    sub = x.index_select(0, rows_t)  # [P, V]

    out_r, out_c = _ragged_index(b.output_ids, b.output_offsets, local, v, dev)  # [N_out]
    counts = torch.zeros(rows.size, v, dtype=torch.float32, device=dev)  # [P, V]
    counts.index_put_((out_r, out_c), torch.ones(out_r.shape[0], device=dev), accumulate=True)

    rep_p = rep[rows]  # [P]
    if np.any(rep_p != 1.0):
        pr_r, pr_c = _ragged_index(b.prompt_ids, b.prompt_offsets, local, v, dev)  # [N_prompt]
        seen = counts > 0  # [P, V]
        seen.index_put_((pr_r, pr_c), torch.tensor(True, device=dev))
        p = torch.from_numpy(rep_p).to(dev)[:, None]  # [P, 1]
        sub = torch.where(seen, torch.where(sub > 0, sub / p, sub * p), sub)  # [P, V]

    f, pp = freq[rows], pres[rows]  # [P]
    if np.any(f != 0.0) or np.any(pp != 0.0):
        f_t = torch.from_numpy(f).to(dev)[:, None]  # [P, 1]
        pp_t = torch.from_numpy(pp).to(dev)[:, None]  # [P, 1]
        sub -= f_t * counts + pp_t * (counts > 0).float()  # [P, V]

    x.index_copy_(0, rows_t, sub)
    return x


def _choose(x: torch.Tensor, b: SamplingBatch, gen: torch.Generator | None) -> torch.Tensor:
    """Steps 4-5 on penalised ``x`` [S, V] (modified): tokens i64 [S]."""
    s = x.shape[0]
    temp = np.asarray(b.temperature, dtype=np.float32)
    rows = np.flatnonzero(temp != 0.0)  # [R] sampling rows
    if rows.size == 0:
        return x.argmax(dim=-1)  # [S]
    dev = x.device
    tokens = x.argmax(dim=-1) if rows.size < s else torch.empty(s, dtype=torch.int64, device=dev)  # [S]
    rows_t = torch.from_numpy(rows).to(dev)  # [R]
    y = x if rows.size == s else x.index_select(0, rows_t)  # [R, V]
    y.div_(torch.from_numpy(temp[rows]).to(dev)[:, None])
    _top_k_(y, np.asarray(b.top_k, dtype=np.int64)[rows])
    probs = torch.softmax(y, dim=-1)  # [R, V]
    # From here on probs are only masked to 0, never renormalised: the race below is scale-free.
    _top_p_(probs, np.asarray(b.top_p, dtype=np.float32)[rows])
    min_p = np.asarray(b.min_p, dtype=np.float32)[rows]  # [R]
    if np.any(min_p > 0):
        floor = torch.from_numpy(min_p).to(dev)[:, None] * probs.amax(dim=-1, keepdim=True)  # [R, 1]
        probs.masked_fill_(probs < floor, 0.0)
    noise = _exp_noise(probs.shape, rows, b, gen, dev)  # [R, V]
    tokens[rows_t] = probs.div_(noise).argmax(dim=-1)
    return tokens


def _top_k_(y: torch.Tensor, top_k: np.ndarray) -> None:
    """Set ``y`` [R, V] to -inf below each row's k-th largest value (ties with it stay)."""
    v = y.shape[1]
    use_k = (top_k > 0) & (top_k < v)  # [R]
    if not use_k.any():
        return
    dev = y.device
    k_max = int(top_k[use_k].max())
    k_idx = torch.from_numpy(np.where(use_k, top_k, 1) - 1).to(dev)[:, None]  # [R, 1]
    kth = torch.topk(y, k_max, dim=-1).values.gather(1, k_idx)  # [R, 1]
    kth.masked_fill_(~torch.from_numpy(use_k).to(dev)[:, None], float("-inf"))
    y.masked_fill_(y < kth, float("-inf"))


def _top_p_(probs: torch.Tensor, top_p: np.ndarray) -> None:
    """Set ``probs`` [R, V] to 0 outside each row's nucleus.

    The nucleus ends at the first token, in descending order, at which the cumulative
    probability reaches top_p; it is kept as the threshold ``probs >= that token's prob``, so
    ties with the last token stay and the result never depends on how ties were ordered.
    Only the head of each row is sorted (topk of m, widened until every nucleus fits).
    """
    rows = np.flatnonzero(top_p < 1.0)  # [Q]
    if rows.size == 0:
        return
    r, v = probs.shape
    dev = probs.device
    rows_t = torch.from_numpy(rows).to(dev)  # [Q]
    sub = probs if rows.size == r else probs.index_select(0, rows_t)  # [Q, V]
    p = torch.from_numpy(top_p[rows]).to(dev)[:, None]  # [Q, 1]
    m = min(v, 256)
    while True:
        head = torch.topk(sub, m, dim=-1).values  # [Q, m], descending
        cum = head.cumsum(dim=-1)  # [Q, m]
        if m == v or bool((cum[:, -1:] >= p).all()):
            break
        m = min(v, m * 16)
    last = (cum < p).sum(dim=-1, keepdim=True).clamp_(max=m - 1)  # [Q, 1]: first index reaching p
    sub.masked_fill_(sub < head.gather(1, last), 0.0)
    if rows.size < r:
        probs.index_copy_(0, rows_t, sub)


def _exp_noise(shape: torch.Size, rows: np.ndarray, b: SamplingBatch, gen: torch.Generator | None,
               dev: torch.device) -> torch.Tensor:
    """Exp(1) noise [R, V] for sampling rows ``rows`` (indices into the batch), as -log(1 - U).

    (``torch.rand`` + ``log1p`` is several times faster than ``exponential_`` on CPU.)
    """
    u = torch.empty(shape, dtype=torch.float32, device=dev)  # [R, V], U ~ [0, 1)
    seeded = np.asarray(b.has_seed, dtype=bool)[rows]  # [R]
    if not seeded.all():
        u.uniform_(generator=gen)  # one call for every unseeded row
    v = shape[1]
    for i in np.flatnonzero(seeded):  # each seeded row: its own stream, in vocab order
        row = int(rows[i])
        g = torch.Generator(device=dev)
        g.manual_seed(step_seed(int(b.seeds[row]), int(b.seed_steps[row])))
        u[i] = torch.rand(v, generator=g, device=dev)
    return u.neg_().log1p_().neg_().clamp_min_(_MIN_NOISE)


def _top_by_value_then_id(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of ``raw`` [S, V], descending, equal values by ascending id
    (argmax's tie rule; ``torch.topk`` picks and orders tied values in no fixed way, and bf16
    logits tie often): (values [S, K], ids [S, K])."""
    s = raw.shape[0]
    kth = torch.topk(raw, k, dim=-1).values[:, -1:]  # [S, 1]: the k-th largest value
    above = raw > kth  # [S, V]: all of these are in
    tied = raw == kth  # [S, V]: the lowest-id ones fill the rest
    room = k - above.sum(dim=-1, keepdim=True)  # [S, 1], >= 1
    chosen = above | (tied & (tied.cumsum(dim=-1) <= room))  # [S, V], exactly k per row ...
    if int(chosen.sum()) != s * k:  # ... unless a row holds NaN (compares false): topk's own order then
        return torch.topk(raw, k, dim=-1)
    ids = chosen.nonzero()[:, 1].view(s, k)  # [S, K], ascending ids
    vals = raw.gather(1, ids)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices  # stable: ties stay by id
    return vals.gather(1, order), ids.gather(1, order)


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, b: SamplingBatch) -> SampleOutput:
    """Raw log-softmax at the chosen tokens and the top-K of each row of ``raw`` [S, V]."""
    s, v = raw.shape
    most = int(b.num_logprobs.max()) if s else -1  # -1: no row asked for logprobs
    k = min(max(most, 0), v)
    if most < 0:  # skip the pass over the vocabulary
        chosen = torch.full((s,), float("nan"), device=raw.device)
    else:
        # One row at a time: torch splits a lone row's reduction over threads but a batch's by
        # rows, and a row's log-probabilities must not depend on the rows beside it (a greedy
        # request verifying speculative guesses samples several rows at once).
        lse = torch.stack([torch.logsumexp(raw[i], dim=-1) for i in range(s)]) if s else raw.new_zeros(0)  # [S]
        chosen = raw.gather(1, tokens[:, None]).squeeze(1) - lse  # [S]
    if k:
        vals, ids = _top_by_value_then_id(raw, k)  # [S, K] each
        top_lp = vals - lse[:, None]  # [S, K]
    else:
        ids = torch.zeros(s, 0, dtype=torch.int64, device=raw.device)
        top_lp = torch.zeros(s, 0, dtype=torch.float32, device=raw.device)
    return SampleOutput(tokens=tokens, logprobs=chosen, top_ids=ids, top_logprobs=top_lp)
