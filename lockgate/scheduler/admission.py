"""Peak-usage admission (the Efficient Router): may a waiting request join the batch?

Owns one pure computation, the future peak KV-slot usage of a batch, and the admission
rule built on it. Numpy and ints only; the scheduler calls it with per-request arrays
every time it considers moving requests from the waiting queue into the running batch.

The model
---------
Describe every request ``i`` of the batch by two numbers:

* ``resident_i``: tokens whose KV it holds, or will hold once its prompt is prefilled
  (prompt + tokens generated so far);
* ``left_i``: tokens it may still generate (``max_tokens - generated``).

Each future decode step adds one slot to every request still running, and request ``i``
leaves (freeing everything) after ``left_i`` more steps. So ``t`` steps from now

    usage(t) = sum over {i : left_i >= t} of (resident_i + t),      t = 0, 1, 2, ...

The formula
-----------
Sort the requests by ``left`` descending (``left_0 >= left_1 >= ...``). Between two
departures ``usage`` only grows, so its maximum is reached at ``t = left_k`` for some
``k``, just before request ``k`` leaves. At that moment requests ``0..k`` are alive
(plus any ties with ``left_j == left_k``, which the later index accounts for), giving

    peak = max_k ( sum_{j<=k} resident_j + (k + 1) * left_k ).

Degenerate cases: an empty batch has peak 0 (no rows, defined as 0); ``t = 0`` (the
current usage, ``sum resident``) is covered by the last term ``k = n - 1`` since
``left >= 0``; rows with ``left = 0`` sort last and only show up there, at ``t = 0``.
With ``n`` requests this is one sort and one cumulative sum: O(n log n).

Why it is safe
--------------
``resident_i + left_i = prompt + max_tokens`` bounds the slots request ``i`` can ever
hold, and requests that stop early (EOS, stop strings, aborts) only free slots sooner,
so real usage never exceeds the estimate. Admitting a candidate only when the peak *with
the candidate included* is ``<= capacity`` therefore means decode never runs out of KV
slots. Tokens several requests share through the prefix cache must be counted once, and
only while they can stay locked: ``Charges`` (end of this module) charges each locked cache
node to the request that can hold it longest and folds it into that request's ``resident``.

Requests that do not advance every step
---------------------------------------
The formula assumes lockstep: every request gains one token per step. A request whose
prompt is being prefilled in chunks (or that is admitted but gets no prefill budget this
step) stalls while the others advance, which can push the real peak above the estimate.
The scheduler therefore splits the batch in two: requests that advance every step (all
decoding requests, plus candidates whose whole remaining prompt is prefilled this step)
go through ``peak_usage``; each stalled request is charged its whole
``resident + left`` as a constant block on top. When a stalled request starts decoding,
its contribution can only shrink (in lockstep it holds at most ``resident + left`` at any
time), so the estimate never grows as steps run and the guarantee holds.

Requests that advance faster (speculation) also break lockstep: a request whose guesses are
accepted gains several tokens in one step. The scheduler therefore only speculates while every
running request could hold its whole ``resident + left`` at once (``Speculator.propose``),
which no order of progress can exceed; outside that condition requests advance in lockstep and
the estimate holds as above.

Adding a request adds a non-negative term to ``usage(t)`` at every ``t``, so the peak
never decreases when requests join: the candidates that fit "one after another" form a
prefix of the queue, and the scheduler stops at the first one that does not fit.
"""

from __future__ import annotations

import numpy as np

from lockgate.kvcache.radix import RadixNode

I64 = np.int64


def _as_rows(resident: np.ndarray, left: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    res = np.asarray(resident, dtype=I64).reshape(-1)
    lft = np.asarray(left, dtype=I64).reshape(-1)
    if res.shape != lft.shape:
        raise ValueError(f"resident has {res.size} rows but left has {lft.size}")
    if res.size and (res.min() < 0 or lft.min() < 0):
        raise ValueError("resident and left must be non-negative")
    return res, lft


def peak_usage(resident: np.ndarray, left: np.ndarray) -> int:
    """Future peak slot usage of a batch: ``max_k(cumsum(resident)[k] + (k+1) * left[k])``
    over rows sorted by ``left`` descending; 0 for an empty batch."""
    res, lft = _as_rows(resident, left)
    if res.size == 0:
        return 0
    order = np.argsort(-lft, kind="stable")
    lft_sorted = lft[order]
    cum_res = np.cumsum(res[order])
    alive = np.arange(1, res.size + 1, dtype=I64)
    return int((cum_res + alive * lft_sorted).max())


# ---------------------------------------------------------------------------------------
# Admission modes (``--admission``): one interface, so benchmarks compare them on one workload.
#
# Each mode estimates the KV slots the running batch (plus candidates) will need, from the
# lockstep rows (``resident``, ``left`` arrays) and the stalled rows (chunked prompts; their
# totals). The scheduler admits a candidate when ``estimate + slots held by the prefix
# cache's locked nodes <= capacity``.
#
# * ``peak``: the formula above; exact worst case, decode never runs out of slots.
# * ``reserve``: every request reserves prompt + max_tokens up front (what TGI does); also
#   never runs out, but admits fewer requests because it ignores that short requests leave.
# * ``ratio``: SGLang's optimistic estimate, ``resident + ratio * left``, where the
#   new-token ratio starts at ``init`` and decays linearly to ``floor`` over ``decay_steps``
#   decode steps. It can run out: the scheduler then retracts requests (their KV goes to
#   the prefix cache, they are re-queued first) and calls ``on_retract``, which raises the
#   ratio to what the batch actually needed.
# ---------------------------------------------------------------------------------------


class AdmissionMode:
    """Base: the peak estimate. Subclasses override ``estimate`` (and the ratio hooks)."""

    name = "peak"
    can_run_out = False  # True: the scheduler must be ready to retract

    def estimate(self, resident: np.ndarray, left: np.ndarray, stalled_resident: int, stalled_left: int) -> int:
        return peak_usage(resident, left) + stalled_resident + stalled_left

    def on_decode_step(self) -> None:
        """Called once per step that decoded something."""

    def on_retract(self, decoded: int, num_running: int, max_total: int) -> None:
        """Called after retracting: the running batch has generated ``decoded`` of its
        ``max_total`` tokens over ``num_running`` requests."""


class PeakMode(AdmissionMode):
    pass


class ReserveMode(AdmissionMode):
    name = "reserve"

    def estimate(self, resident: np.ndarray, left: np.ndarray, stalled_resident: int, stalled_left: int) -> int:
        return int(np.sum(resident) + np.sum(left)) + stalled_resident + stalled_left


class RatioMode(AdmissionMode):
    name = "ratio"
    can_run_out = True

    def __init__(self, init: float, floor: float, decay_steps: int) -> None:
        self.init, self.floor = init, floor
        self.step = (init - floor) / decay_steps
        self.ratio = init

    def estimate(self, resident: np.ndarray, left: np.ndarray, stalled_resident: int, stalled_left: int) -> int:
        need = float(np.sum(left)) + stalled_left
        return int(np.sum(resident)) + stalled_resident + int(np.ceil(self.ratio * need))

    def on_decode_step(self) -> None:
        self.ratio = max(self.floor, self.ratio - self.step)

    RETRACT_HEADROOM_STEPS = 20  # SGLang: assume every remaining request decodes this many more tokens

    def on_retract(self, decoded: int, num_running: int, max_total: int) -> None:
        need = decoded + self.RETRACT_HEADROOM_STEPS * num_running
        self.ratio = min(1.0, max(self.ratio, need / max(max_total, 1)))


def make_admission(name: str, init_ratio: float = 0.7, min_ratio: float = 0.1, decay_steps: int = 600
                   ) -> AdmissionMode:
    if name == "peak":
        return PeakMode()
    if name == "reserve":
        return ReserveMode()
    if name == "ratio":
        return RatioMode(init_ratio, min_ratio, decay_steps)
    raise ValueError(f"unknown admission mode {name!r} (peak, reserve, ratio)")


class Charges:
    """Admission rows of a batch, with the prefix cache's shared slots counted once.

    Row ``i`` is one request: ``res[i]`` = its own resident tokens (prompt + output not in
    the cache) plus the tokens of the locked cache nodes *charged* to it; ``left[i]`` = the
    tokens it may still generate; stalled rows (chunked prefill) count as a constant block.
    A locked node stays in the pool until its last locker leaves, so it is charged to the
    locker that lives longest in the worst case (largest ``left``; stalled = infinite). The
    owner key never decreases from a node to its ancestors, so a walk up from a request's
    node stops at the first node owned by a request that lives at least as long.
    """

    def __init__(self) -> None:
        self.res: list[int] = []
        self.left: list[int] = []
        self.stalled: list[bool] = []
        self.key: list[float] = []
        self.owner: dict[int, int] = {}  # id(node) -> row

    def copy(self) -> Charges:
        c = Charges()
        c.res, c.left, c.stalled, c.key = list(self.res), list(self.left), list(self.stalled), list(self.key)
        c.owner = dict(self.owner)
        return c

    def add(self, private: int, left: int, stalled: bool, node: RadixNode | None) -> None:
        row, key = len(self.res), float("inf") if stalled else float(left)
        shared = 0
        for n in node.ancestry() if node is not None else ():
            cur = self.owner.get(id(n))
            if cur is not None:
                if self.key[cur] >= key:
                    break
                self.res[cur] -= n.size
            self.owner[id(n)] = row
            shared += n.size
        self.res.append(private + shared)
        self.left.append(left)
        self.stalled.append(stalled)
        self.key.append(key)

    def estimate(self, mode: AdmissionMode) -> int:
        lock = [i for i, st in enumerate(self.stalled) if not st]
        res = np.fromiter((self.res[i] for i in lock), dtype=I64, count=len(lock))
        left = np.fromiter((self.left[i] for i in lock), dtype=I64, count=len(lock))
        st_res = sum(r for r, st in zip(self.res, self.stalled, strict=True) if st)
        st_left = sum(x for x, st in zip(self.left, self.stalled, strict=True) if st)
        return mode.estimate(res, left, st_res, st_left)
