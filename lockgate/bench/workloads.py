"""Benchmark workloads: what each request asks for (real-text prompt, exact lengths), built by seed.

Owns turning ``--workload NAME`` and its knobs into a ``Workload``: a tuple of ``Session``s,
each a chain of ``Turn``s (one turn for every workload but ``multi-turn``). The load generator
(``client.py``) sends the turns of one session in order and the sessions concurrently.

Invariants:

* Prompt text is real English (stdlib docstrings, ``corpus.py``), never random token ids, and
  a turn's ``text`` encodes to exactly ``input_len`` tokens with the benchmark tokenizer
  (``tokens.py``, no special tokens). ``TextMaker.text`` enforces it by decode -> re-encode ->
  adjust, because a window of N corpus tokens need not re-encode to N tokens (BPE merges at
  the cut, a UTF-8 character split by a byte-level tokenizer).
* Everything is a function of the seed: the same seed and tokenizer give the same texts and
  lengths; the arrival process draws from its own stream (``client.arrival_offsets``).
* A request whose input + output cannot fit the server's context (``max_model_len``, when
  the server reports it) is refused here, with the numbers, before anything is sent.

The workloads:

* ``random``: ``--input-len`` / ``--output-len``; ``--range-ratio r`` draws each length
  uniformly from [L(1-r), L(1+r)] (vLLM's convention), r = 0 means fixed.
* ``sharegpt-like``: input and output lengths from log-normal fits of ShareGPT (see
  ``SHAREGPT_*`` below for the numbers and where they come from).
* ``mixed``: ``--input-len`` prompts, half of the requests generating ``MIXED_SHORT`` (16)
  tokens and half ``--output-len`` (default ``MIXED_LONG``, 512), shuffled: the case the
  Efficient Router's peak admission is about, where reserving ``max_tokens`` for everyone
  wastes the pool.
* ``shared-prefix``: ``--groups G`` x ``--prompts-per-group M`` requests; the requests of a
  group start with the same ``--prefix-len`` tokens of text (byte-identical) followed by a
  unique ``--suffix-len`` suffix; the groups are interleaved in a seeded random order.
* ``multi-turn``: conversations of ``--turns T`` turns; every turn adds a new user message of
  ``--input-len`` tokens to the conversation so far, and the server's own reply to the
  previous turn is part of the history, so each prompt extends the previous one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lockgate.bench.corpus import PromptMaker
from lockgate.bench.tokens import BenchTokenizer

WORKLOADS = ("random", "sharegpt-like", "mixed", "shared-prefix", "multi-turn")

# ---- ShareGPT statistics --------------------------------------------------------------------
# Means: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
# PagedAttention" (vLLM, SOSP 2023), section 6.1 / Fig. 11a: on ShareGPT the mean input is
# 161.31 tokens and the mean output 337.99 tokens (8.4x and 5.8x Alpaca's 19.31 / 58.45).
# Cross-check: vLLM's benchmark on 1000 ShareGPT_Vicuna_unfiltered prompts with the Llama-3.1
# tokenizer reports 229,711 input tokens (230 per request; vllm-project/vllm PR #18566):
# the mean depends on the tokenizer and the dataset version; we keep the paper's figures.
# Shape: the paper gives histograms with long right tails but no median or spread, so the
# log-normal sigmas are OUR assumption (not published numbers): sigma_in = 1.1 (median input
# 161.31 * exp(-1.1^2/2) ~ 88 tokens: many short questions, a few pasted documents) and
# sigma_out = 0.8 (median output ~ 245). mu = ln(mean) - sigma^2/2 keeps the published mean.
# Lengths below 4 are raised to 4 (vLLM's ShareGPT loader drops such pairs), and pairs whose
# sum exceeds the context are redrawn (vLLM drops them), so a small context lowers the means.
SHAREGPT_MEAN_INPUT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99
SHAREGPT_SIGMA_INPUT = 1.1
SHAREGPT_SIGMA_OUTPUT = 0.8
SHAREGPT_MIN_LEN = 4
SHAREGPT_DEFAULT_CONTEXT = 2048  # when the server does not report max_model_len

MIXED_SHORT, MIXED_LONG = 16, 512

DEFAULTS: dict[str, dict[str, int]] = {
    "random": {"input_len": 256, "output_len": 128},
    "sharegpt-like": {},
    "mixed": {"input_len": 256, "output_len": MIXED_LONG},
    "shared-prefix": {"groups": 4, "prefix_len": 256, "suffix_len": 64, "output_len": 128},
    "multi-turn": {"turns": 4, "input_len": 128, "output_len": 128},
}


@dataclass(frozen=True)
class Turn:
    text: str        # the prompt (single-turn) or the new user message (multi-turn)
    input_len: int   # tokens of ``text`` with the benchmark tokenizer
    output_len: int  # tokens to generate (max_tokens = min_tokens)


@dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]
    group: int = -1  # shared-prefix group, -1 elsewhere


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    params: dict[str, Any] = field(default_factory=dict)  # the resolved knobs, for the report
    prefixes: tuple[str, ...] = ()  # shared-prefix: the prefix text of each group

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    num_requests: int
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float = 0.0
    groups: int | None = None
    prompts_per_group: int | None = None
    prefix_len: int | None = None
    suffix_len: int | None = None
    turns: int | None = None
    max_model_len: int | None = None  # the server's context, when known

    def get(self, name: str) -> int:
        v = getattr(self, name)
        return int(v) if v is not None else DEFAULTS[self.name][name]


class TextMaker:
    """Real corpus text of exact token counts (see the module docstring)."""

    ATTEMPTS = 8

    def __init__(self, tok: BenchTokenizer, seed: int) -> None:
        self.tok = tok
        self.maker = PromptMaker(tok.encode, seed)

    def _window(self, start: int, k: int) -> list[int]:
        ids = self.maker.ids
        out = ids[start:start + k]
        while len(out) < k:  # wrap around the corpus
            out += ids[:k - len(out)]
        return out

    def text(self, n: int, head: str = "") -> str:
        """Text t with len(encode(head + t)) == len(encode(head)) + n (for head = "": exactly n)."""
        if n <= 0:
            raise ValueError(f"a prompt length must be positive, got {n}")
        base = len(self.tok.encode(head)) if head else 0
        for _ in range(self.ATTEMPTS):
            start = self.maker.rng.randrange(len(self.maker.ids))
            k, tried = n, set()
            while k not in tried and k > 0:
                tried.add(k)
                t = self.tok.decode(self._window(start, k))
                got = len(self.tok.encode(head + t)) - base
                if got == n:
                    return t
                k += n - got
        raise ValueError(f"could not cut a text of exactly {n} tokens from the corpus with this tokenizer")


def _check_fits(input_len: int, output_len: int, ctx: int | None, what: str) -> None:
    if ctx is not None and input_len + output_len > ctx:
        raise ValueError(f"{what}: {input_len} input + {output_len} output tokens do not fit the server's "
                         f"context of {ctx} tokens (max_model_len); lower the lengths")


def _ranged(rng: np.random.Generator, length: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)] if ratio > 0 else [length] * n


def sharegpt_lengths(rng: np.random.Generator, n: int, ctx: int | None) -> list[tuple[int, int]]:
    """n (input, output) pairs from the ShareGPT log-normal fits, redrawn to fit ``ctx``."""
    limit = ctx or SHAREGPT_DEFAULT_CONTEXT
    if limit < 2 * SHAREGPT_MIN_LEN:
        raise ValueError(f"sharegpt-like: the context of {limit} tokens is too small")
    out: list[tuple[int, int]] = []
    for _ in range(1000):
        mu_in = math.log(SHAREGPT_MEAN_INPUT) - SHAREGPT_SIGMA_INPUT ** 2 / 2
        mu_out = math.log(SHAREGPT_MEAN_OUTPUT) - SHAREGPT_SIGMA_OUTPUT ** 2 / 2
        ins = rng.lognormal(mu_in, SHAREGPT_SIGMA_INPUT, size=n)
        outs = rng.lognormal(mu_out, SHAREGPT_SIGMA_OUTPUT, size=n)
        for i, o in zip(ins, outs, strict=True):
            pair = (max(SHAREGPT_MIN_LEN, round(float(i))), max(SHAREGPT_MIN_LEN, round(float(o))))
            if sum(pair) <= limit:
                out.append(pair)
        if len(out) >= n:
            return out[:n]
    raise ValueError(f"sharegpt-like: too few ShareGPT-like pairs fit a context of {limit} tokens")


def build_workload(spec: WorkloadSpec, tok: BenchTokenizer, seed: int) -> Workload:
    """The workload ``spec`` names, with prompts cut by ``tok``; ValueError on bad knobs."""
    check_spec(spec)
    rng = np.random.default_rng([seed, 1])  # lengths; the text positions use the TextMaker's own stream
    maker = TextMaker(tok, seed)
    return _BUILDERS[spec.name](spec, rng, maker)


def check_spec(spec: WorkloadSpec) -> None:
    """ValueError naming the first knob of ``spec`` out of range (before anything is built or sent)."""
    if spec.name not in WORKLOADS:
        raise ValueError(f"unknown workload {spec.name!r}; choose one of {', '.join(WORKLOADS)}")
    if spec.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {spec.num_requests}")
    if not 0.0 <= spec.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {spec.range_ratio}")
    for name in ("input_len", "output_len", "groups", "prompts_per_group", "prefix_len", "suffix_len", "turns"):
        v = getattr(spec, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {v}")


def _single(name: str, lengths: list[tuple[int, int]], maker: TextMaker, params: dict[str, Any],
            ctx: int | None) -> Workload:
    for i, o in lengths:
        _check_fits(i, o, ctx, name)
    sessions = tuple(Session((Turn(maker.text(i), i, o),)) for i, o in lengths)
    return Workload(name, sessions, params)


def _random(spec: WorkloadSpec, rng: np.random.Generator, maker: TextMaker) -> Workload:
    n, il, ol = spec.num_requests, spec.get("input_len"), spec.get("output_len")
    lengths = list(zip(_ranged(rng, il, spec.range_ratio, n), _ranged(rng, ol, spec.range_ratio, n), strict=True))
    return _single("random", lengths, maker, {"input_len": il, "output_len": ol, "range_ratio": spec.range_ratio},
                   spec.max_model_len)


def _sharegpt(spec: WorkloadSpec, rng: np.random.Generator, maker: TextMaker) -> Workload:
    lengths = sharegpt_lengths(rng, spec.num_requests, spec.max_model_len)
    params = {"mean_input": SHAREGPT_MEAN_INPUT, "mean_output": SHAREGPT_MEAN_OUTPUT,
              "sigma_input": SHAREGPT_SIGMA_INPUT, "sigma_output": SHAREGPT_SIGMA_OUTPUT,
              "context": spec.max_model_len or SHAREGPT_DEFAULT_CONTEXT}
    return _single("sharegpt-like", lengths, maker, params, spec.max_model_len)


def _mixed(spec: WorkloadSpec, rng: np.random.Generator, maker: TextMaker) -> Workload:
    n, il, long = spec.num_requests, spec.get("input_len"), spec.get("output_len")
    ins = _ranged(rng, il, spec.range_ratio, n)
    outs = [MIXED_SHORT] * (n // 2) + [long] * (n - n // 2)
    outs = [outs[k] for k in rng.permutation(n)]
    return _single("mixed", list(zip(ins, outs, strict=True)), maker,
                   {"input_len": il, "range_ratio": spec.range_ratio, "short_output_len": MIXED_SHORT,
                    "long_output_len": long}, spec.max_model_len)


def _shared_prefix(spec: WorkloadSpec, rng: np.random.Generator, maker: TextMaker) -> Workload:
    g, p, u, o = spec.get("groups"), spec.get("prefix_len"), spec.get("suffix_len"), spec.get("output_len")
    m = spec.prompts_per_group if spec.prompts_per_group is not None else spec.num_requests // g
    if m < 1:
        raise ValueError(f"shared-prefix: --num-requests {spec.num_requests} is fewer than --groups {g}")
    _check_fits(p + u, o, spec.max_model_len, "shared-prefix")
    prefixes = tuple(maker.text(p) for _ in range(g))
    sessions = [Session((Turn(prefixes[k] + maker.text(u, head=prefixes[k]), p + u, o),), group=k)
                for k in range(g) for _ in range(m)]
    order = rng.permutation(len(sessions))
    return Workload("shared-prefix", tuple(sessions[k] for k in order),
                    {"groups": g, "prompts_per_group": m, "prefix_len": p, "suffix_len": u, "output_len": o},
                    prefixes)


def _multi_turn(spec: WorkloadSpec, rng: np.random.Generator, maker: TextMaker) -> Workload:
    t, u, o, n = spec.get("turns"), spec.get("input_len"), spec.get("output_len"), spec.num_requests
    # the last turn's prompt holds every user message and every earlier reply
    _check_fits(t * u + (t - 1) * o, o, spec.max_model_len, f"multi-turn ({t} turns)")
    sessions = []
    for c in range(math.ceil(n / t)):
        k = min(t, n - c * t)
        sessions.append(Session(tuple(Turn(maker.text(u), u, o) for _ in range(k))))
    return Workload("multi-turn", tuple(sessions),
                    {"turns": t, "input_len": u, "output_len": o, "conversations": len(sessions)})


_BUILDERS = {"random": _random, "sharegpt-like": _sharegpt, "mixed": _mixed, "shared-prefix": _shared_prefix,
             "multi-turn": _multi_turn}
