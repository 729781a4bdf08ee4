"""Measured attention choices: decode attention on lockgate's kernel or gathers + SDPA, prefill
attention on the kernel or SDPA, and the kernel's look-ahead on or off.

Owns timing the attention paths at a model's head shapes on the CPU at hand and turning the
timings into decisions. Called by ``lockgate.runner.form_choice`` while it measures the matmul
forms; the figures and decisions are stored in the same "forms" table (``lockgate.runner.tuning``
keeps the cache) and printed by ``lockgate tune``. Invariant: each ``decide_*`` depends only on
the stored figures, so a cached table gives the decision it gave when measured; nothing here reads
CPU flags to decide.

* Decode attention (``decide_attention``): lockgate's kernel unless SDPA is at least
  ``ATTENTION_MARGIN`` faster, since the kernel also makes a sequence's result independent of its
  batch and enables the one-call step.
* Prefill attention (``decide_prefill_attention``): the whole step on lockgate's kernel
  (``prefill_attention``: every token causal over its own keys) unless SDPA (causal, flash) is at
  least ``PREFILL_ATTENTION_MARGIN`` faster on fresh prompts of 256 and 1,024 tokens (4 layers
  timed; on the Zen 5 class CPU the kernel took 0.61 vs 1.1 ms per layer at 256 tokens, 8.1 vs
  10.6 at 1,024).
* The kernel's look-ahead (``decide_attention_lookahead``: prefetching the next work item's K/V
  rows while one computes, ``lockgate::set_attention_lookahead``): on when a decode step of
  ``LOOKAHEAD_BATCH`` sequences at ``LOOKAHEAD_CONTEXT`` keys, every layer of a pool too large
  for the caches, is at least ``LOOKAHEAD_MARGIN`` faster with it (paired rounds): 9-12% faster
  at 32 and 128 sequences on the Zen 4 class CPU; three earlier forms of it were slower on the
  Zen 5 class. It changes which cache level a row is read from, never a result.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from lockgate.layers.attention import paged_attention
from lockgate.layers.attention_meta import AttentionMetadata

ATTENTION_ROUNDS = 3  # paired rounds per decode / prefill attention measurement
ATTENTION_MARGIN = 0.25
PREFILL_ATTENTION_MARGIN = 0.10
PREFILL_ATTENTION_TOKENS = (256, 1024)  # fresh prompts timed for the prefill attention choice
LOOKAHEAD_MARGIN = 0.03
LOOKAHEAD_BATCH, LOOKAHEAD_CONTEXT, LOOKAHEAD_ROUNDS = 32, 320, 7  # the decode step timed for the look-ahead
LOOKAHEAD_PROMPT = 256  # of those keys, the prompt's (one run); the rest decoded, interleaved
LOOKAHEAD_POOL_BYTES = 256 << 20  # per K and V pool of that measurement (the default model's 30 layers: 118 MB)


def paired_rounds(passes: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Per-round ms of each pass (one warm-up call each first); within a round every pass runs
    once, and the order rotates from round to round, so drifts of the host hit them alike. (Also
    ``tuning.measure_dtype``'s loop.)"""
    names = list(passes)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for run in passes.values():
            run()
        for rnd in range(rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                t0 = time.perf_counter()
                passes[name]()
                times[name].append(1e3 * (time.perf_counter() - t0))
    return times


def _paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float | None:
    """The median over rounds of a's time / b's (None when nothing was measured)."""
    ratios = [x / y for x, y in zip(times.get(a, []), times.get(b, []), strict=False) if y > 0]
    return statistics.median(ratios) if ratios else None


def _layers_pass(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, layers: int) -> None:
    for i in range(layers):
        paged_attention(q, None, None, k_cache[i], v_cache[i], meta, scale)


def measure_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, layers: int,
                      batch: int = 16, context: int = 256, rounds: int = ATTENTION_ROUNDS) -> dict[str, list[float]]:
    """Per-round ms of a decode step's attention over ``layers`` layers (batch sequences of
    ``context`` keys, each one contiguous run of a synthetic pool), on lockgate's kernel and
    on gathers + SDPA."""
    g = torch.Generator().manual_seed(0)
    cap = batch * context
    k_cache = torch.randn(layers, cap, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(layers, cap, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=g).to(dtype)
    ones = np.ones(batch, np.int64)
    seq = np.full(batch, context, np.int64)
    slots = np.arange(cap, dtype=np.int64)
    offsets = np.arange(0, cap + 1, context, dtype=np.int64)
    out_slots = offsets[1:] - 1
    metas = {name: AttentionMetadata.build(ones, seq, slots, offsets, out_slots, num_heads // num_kv_heads,
                                           decode_kernel=name == "kernel") for name in ("kernel", "sdpa")}
    scale = 1.0 / math.sqrt(head_dim)
    return paired_rounds({name: partial(_layers_pass, q, k_cache, v_cache, meta, scale, layers)
                           for name, meta in metas.items()}, rounds)


def measure_prefill_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                              layers: int = 4, rounds: int = ATTENTION_ROUNDS) -> dict[str, list[float]]:
    """Per-round ms of ``layers`` layers' attention for fresh prompts of each of
    ``PREFILL_ATTENTION_TOKENS`` tokens (one contiguous run of a synthetic pool, as a new prompt
    gets), on lockgate's prefill kernel and on SDPA's causal path; a round sums the sizes."""
    g = torch.Generator().manual_seed(0)
    cap = max(PREFILL_ATTENTION_TOKENS)
    k_cache = torch.randn(layers, cap, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(layers, cap, num_kv_heads, head_dim, generator=g).to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    cases = []
    for n in PREFILL_ATTENTION_TOKENS:
        q = torch.randn(n, num_heads, head_dim, generator=g).to(dtype)
        lens, slots = np.array([n], np.int64), np.arange(n, dtype=np.int64)
        offsets = np.array([0, n], np.int64)
        metas = {name: AttentionMetadata.build(lens, lens, slots, offsets, slots, num_heads // num_kv_heads,
                                               decode_kernel=True, prefill_kernel=name == "kernel")
                 for name in ("kernel", "sdpa")}
        cases.append((q, metas))

    def prompts(name: str) -> None:
        for q, metas in cases:
            _layers_pass(q, k_cache, v_cache, metas[name], scale, layers)

    return paired_rounds({name: partial(prompts, name) for name in ("kernel", "sdpa")}, rounds)


def measure_attention_lookahead(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                                layers: int, rounds: int = LOOKAHEAD_ROUNDS) -> dict[str, list[float]]:
    """Per-round ms of a decode step's attention (``LOOKAHEAD_BATCH`` sequences of
    ``LOOKAHEAD_CONTEXT`` keys: ``LOOKAHEAD_PROMPT`` in one run, the rest one per decode step
    interleaved with the others'; over ``layers`` layers of a pool of that
    size, fewer where the pool would pass ``LOOKAHEAD_POOL_BYTES``) on lockgate's kernel with its
    look-ahead off and on; {} where the switch changes nothing (the look-ahead is the AVX512-BF16
    path's: a bf16 pool in a build that has it). The switch is left as it was."""
    ops = torch.ops.lockgate
    if dtype != torch.bfloat16 or not ops.bf16_linear_available():
        return {}
    batch, context = LOOKAHEAD_BATCH, LOOKAHEAD_CONTEXT
    cap = batch * context
    # far beyond any cache, yet a bounded transient beside the model: at most LOOKAHEAD_POOL_BYTES a pool
    layers = max(2, min(layers, LOOKAHEAD_POOL_BYTES // (cap * num_kv_heads * head_dim * dtype.itemsize)))
    # constant keys and values: the kernel's time does not depend on them, and filling is fast
    k_cache = torch.full((layers, cap, num_kv_heads, head_dim), 0.5, dtype=dtype)
    v_cache = torch.full((layers, cap, num_kv_heads, head_dim), 0.25, dtype=dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    # slots as the scheduler leaves them: each sequence's prompt one run, then the tokens decoded
    # since, one slot per step, interleaved with the batch's (the look-ahead's gain is there: the
    # hardware prefetchers follow the prompt runs by themselves)
    prompt, decoded = LOOKAHEAD_PROMPT, context - LOOKAHEAD_PROMPT
    steps = batch * prompt + np.arange(decoded, dtype=np.int64) * batch
    slots = np.concatenate([np.concatenate([np.arange(b * prompt, (b + 1) * prompt, dtype=np.int64), steps + b])
                            for b in range(batch)])
    offsets = np.arange(0, cap + 1, context, dtype=np.int64)
    meta = AttentionMetadata.build(np.ones(batch, np.int64), np.full(batch, context, np.int64), slots, offsets,
                                   slots[offsets[1:] - 1], num_heads // num_kv_heads, decode_kernel=True)
    scale = 1.0 / math.sqrt(head_dim)

    def step(on: bool) -> None:
        ops.set_attention_lookahead(on)
        _layers_pass(q, k_cache, v_cache, meta, scale, layers)

    before = ops.set_attention_lookahead(False)
    try:
        return paired_rounds({"off": partial(step, False), "on": partial(step, True)}, rounds)
    finally:
        ops.set_attention_lookahead(before)


def decide_attention_lookahead(times: dict[str, list[float]], margin: float = LOOKAHEAD_MARGIN) -> str:
    """"on" when the paired ratio on / off has a median <= 1 - margin; else "off" (the plainer
    schedule; also when nothing was measured)."""
    ratio = _paired_ratio(times, "on", "off")
    return "on" if ratio is not None and ratio <= 1 - margin else "off"


def _kernel_unless_sdpa_faster(times: dict[str, list[float]], margin: float) -> str:
    """"kernel" unless SDPA's paired ratio to it has a median <= 1 - margin; "sdpa" when the
    kernel was not measured (not built)."""
    if not times.get("kernel"):
        return "sdpa"
    ratio = _paired_ratio(times, "sdpa", "kernel")
    return "sdpa" if ratio is not None and ratio <= 1 - margin else "kernel"


def decide_prefill_attention(times: dict[str, list[float]], margin: float = PREFILL_ATTENTION_MARGIN) -> str:
    """The prefill attention path (``_kernel_unless_sdpa_faster``)."""
    return _kernel_unless_sdpa_faster(times, margin)


def decide_attention(times: dict[str, list[float]], margin: float = ATTENTION_MARGIN) -> str:
    """The decode attention path (``_kernel_unless_sdpa_faster``)."""
    return _kernel_unless_sdpa_faster(times, margin)
