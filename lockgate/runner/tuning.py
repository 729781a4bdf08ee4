"""Measured kernel choice: which matmul form serves which calls, and which dtype.

Owns timing the forms a loaded model's projections have (``lockgate.layers.forms``) at that
model's shapes on the CPU at hand, turning the timings into one ``FormChoice`` per projection
role (qkv, o, gate_up, down, head), and choosing ``--dtype auto`` the same way; the results (and
the attention choices, ``tuning_attention``) are cached by ``tuning_cache``. Nothing here reads
CPU flags to decide: flags only go into the cache key and the log.

How a measurement runs (``measure_forms``), built to survive a noisy, shared host:

* Calls of r rows for every r in ``POINTS``. For small r a pass calls every layer's projection
  of each role in layer order, as a decode step does, so the weights stream from memory as they
  do in a step (timing one layer again and again would find it in cache); from 24 rows on, where
  the arithmetic dominates, a pass covers fewer layers (``_layers_for``). The LM head is timed
  at up to ``HEAD_MAX_ROWS`` rows (it only ever sees one row per sampled sequence).
* ``ROUNDS`` rounds; within a round every form makes one pass, and the order of the forms
  rotates from round to round, so drifts of the host's speed hit them alike. The figure of a
  form is the median over rounds of its mean milliseconds per call.
* ``winner``: the fastest median, unless a form earlier in ``FORM_NAMES`` (more exact, or
  row-invariant at more row counts) is within ``MARGIN`` of it, judged on the per-round paired
  ratios: then that one.
  A one-point island between two agreeing neighbours is smoothed away when the neighbours' form
  is within twice the margin there.
* A form (not dense) more than ``PRUNE_RATIO`` x slower than the best whose cost already grows
  linearly with the rows (over at least a doubling) is not timed at larger row counts (it cannot
  catch up: no form grows slower than linearly), which keeps scalar fallbacks from costing seconds.

``--dtype auto`` (``choose_dtype``): one layer of the model's shapes, synthetic weights, at 64
and 256 rows (where the arithmetic decides): bf16 when its dense form beats the best float32
form (dense sgemm or the integer GEMM) by more than ``DTYPE_MARGIN`` at both sizes, else float32
(the more exact). The attention paths are measured the same way, in
``lockgate.runner.tuning_attention``; their figures are stored in the "forms" table.

Whether a form's rows depend on the call's size is checked in ``lockgate.runner.row_invariance``
(cached here too, kind "rows"); ``one_form_cost`` prices serving a role on one form for it.

The CPU's description, the cache key of every tuning (``TuningKey``) and the files they are kept
in are ``lockgate.runner.tuning_cache``'s. Invariant: a decision depends only on the stored
figures (``decide``), so a cached file gives the same table it gave when it was measured.

Called by ``lockgate.runner.form_choice`` (at start) and ``lockgate tune`` (``lockgate.cli``).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from lockgate.kernel_choice import FORM_NAMES, FormChoice, TuningTable
from lockgate.layers.forms import (
    DenseWeight,
    F32DotWeight,
    Form,
    IntGemmWeight,
    f32_dot_available,
    int_gemm_isa,
)
from lockgate.layers.grid import quantize_int4
from lockgate.runner.tuning_attention import (
    LOOKAHEAD_BATCH,
    LOOKAHEAD_CONTEXT,
    PREFILL_ATTENTION_TOKENS,
    paired_rounds,
)
from lockgate.runner.tuning_cache import cpu_description, notable_flags

log = logging.getLogger("lockgate.tuning")

POINTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
HEAD_MAX_ROWS = 256
ROUNDS = 3
MARGIN = 0.05  # a more exact form within 5% of the fastest is kept
PRUNE_RATIO = 2.0
DTYPE_MARGIN = 0.10
ROLES = ("qkv", "o", "gate_up", "down", "head")


# ---- deciding ----

def winner(times: dict[str, list[float]], margin: float = MARGIN) -> str:
    """The form to use given each form's per-round times (ms, rounds paired by index): the
    fastest by median, or a form earlier in FORM_NAMES whose paired ratio (fastest / it) has a
    median >= 1 - margin."""
    med = {f: statistics.median(ts) for f, ts in times.items() if ts}
    best = min(med, key=lambda f: (med[f], FORM_NAMES.index(f)))
    for f in sorted(med, key=FORM_NAMES.index):
        if f == best:
            return f
        pairs = [b / t for b, t in zip(times[best], times[f], strict=False) if t > 0]
        if pairs and statistics.median(pairs) >= 1 - margin:
            return f
    return best


def decide(samples: dict[str, dict[str, dict[str, list[float]]]], margin: float = MARGIN) -> dict[str, FormChoice]:
    """Per role, the FormChoice the figures give: calls of r rows take the winner at the
    smallest measured point >= r (beyond the last point, its winner). ``samples``: role -> form
    -> point (str) -> per-round ms."""
    out: dict[str, FormChoice] = {}
    for role, by_form in samples.items():
        points = sorted({int(p) for ts in by_form.values() for p in ts})
        if not points:
            continue
        at = {p: {f: ts[str(p)] for f, ts in by_form.items() if ts.get(str(p))} for p in points}
        wins = [winner(at[p], margin) for p in points]
        for i in range(1, len(points) - 1):  # smooth a one-point island
            before, after, here = wins[i - 1], wins[i + 1], at[points[i]]
            if before == after != wins[i] and before in here:
                ratios = [t / n for t, n in zip(here[wins[i]], here[before], strict=False) if n > 0]
                if ratios and statistics.median(ratios) >= 1 - 2 * margin:  # the neighbours' form is close
                    wins[i] = before
        out[role] = FormChoice.merged(list(zip(points, wins, strict=True)))
    return out


def one_form_cost(samples: dict[str, dict[str, list[float]]], form: str) -> float:
    """What serving every call of a role on ``form`` alone costs, from one role's measured samples
    (form -> rows -> times): the sum over the measured row counts of its median milliseconds, a
    point where it was pruned as hopeless counted at ``PRUNE_RATIO`` x the fastest there (a lower
    bound). Equal weight per point, so the large row counts that carry a busy server's work weigh
    most, as they do in its throughput."""
    points = sorted({int(p) for by_p in samples.values() for p in by_p})
    total = 0.0
    for p in points:
        at = {f: statistics.median(by_p[str(p)]) for f, by_p in samples.items() if by_p.get(str(p))}
        mine = at.get(form)
        total += mine if mine is not None else PRUNE_RATIO * min(at.values())
    return total


# ---- measuring the forms ----

def _layers_for(rows: int, n_layers: int) -> int:
    """Layers a pass covers at ``rows`` rows: all of them while the weights' bytes decide (<= 16
    rows: decode), fewer as the arithmetic takes over (each pass then costs about the same)."""
    return n_layers if rows <= 16 else max(2, min(n_layers, math.ceil(n_layers * 16 / rows)))


def _in_features(role: str, projections: dict[str, list[Any]]) -> int:
    return int(projections[role][0].shape[1])


def measure_forms(projections: dict[str, list[Any]], dtype: torch.dtype, points: tuple[int, ...] = POINTS,
                  rounds: int = ROUNDS, on_point: Callable[[int], None] | None = None,
                  ) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Time every form of every role (``projections``: role -> its ``Linear`` objects, layer
    order; the LM head under ``head``) at each row count; role -> form -> point -> per-round
    mean ms per call. Forms pruned at some point have no figures beyond it. ``on_point(rows)``:
    told after each row count is measured (progress)."""
    layer_roles = [r for r in ROLES if r != "head" and r in projections]
    n_layers = len(projections[layer_roles[0]]) if layer_roles else 0
    alive = {role: {f for lin in lins for f in lin.forms} for role, lins in projections.items()}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {role: {} for role in projections}
    previous: dict[tuple[str, str], dict[int, float]] = {}
    g = torch.Generator().manual_seed(0)
    for rows in points:
        xs = {role: torch.randn(rows, _in_features(role, projections), generator=g).to(dtype) for role in projections}
        layers = _layers_for(rows, n_layers)
        roles_now = [r for r in projections if r != "head" or rows <= HEAD_MAX_ROWS]
        forms_now = sorted({f for r in roles_now for f in alive[r]}, key=FORM_NAMES.index)
        _warm(projections, roles_now, alive, xs)
        for rnd in range(rounds):
            for f in forms_now[rnd % len(forms_now):] + forms_now[:rnd % len(forms_now)]:
                for role, ms in _one_pass(projections, roles_now, alive, f, xs, layers).items():
                    samples[role].setdefault(f, {}).setdefault(str(rows), []).append(ms)
        _prune(samples, alive, previous, rows, roles_now)
        if on_point is not None:
            on_point(rows)
    return samples


def _warm(projections: dict[str, list[Any]], roles: list[str], alive: dict[str, set[str]],
          xs: dict[str, torch.Tensor]) -> None:
    """One untimed call of every form at this size (allocator, first-touch, lazy init)."""
    with torch.inference_mode():
        for role in roles:
            lin = projections[role][0]
            for f in alive[role]:
                if f in lin.forms:
                    lin.forms[f](xs[role], lin.bias)


def _one_pass(projections: dict[str, list[Any]], roles: list[str], alive: dict[str, set[str]], form: str,
              xs: dict[str, torch.Tensor], layers: int) -> dict[str, float]:
    """Mean ms per call of ``form`` for each role that has it: layers in order, every role of a
    layer in turn (as a step calls them), then the head."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    order = [(i, role) for i in range(layers) for role in roles if role != "head"]
    if "head" in roles:
        order.append((0, "head"))
    clock = CLOCK
    with torch.inference_mode():
        for i, role in order:
            if form not in alive[role]:
                continue
            lin = projections[role][i]
            fn: Form | None = lin.forms.get(form)
            if fn is None:
                continue
            t0 = clock()
            fn(xs[role], lin.bias)
            total[role] = total.get(role, 0.0) + clock() - t0
            count[role] = count.get(role, 0) + 1
    return {role: 1e3 * total[role] / count[role] for role in total}


def _prune(samples: dict[str, dict[str, dict[str, list[float]]]], alive: dict[str, set[str]],
           previous: dict[tuple[str, str], dict[int, float]], rows: int, roles: list[str]) -> None:
    """Stop timing a form (never dense: it is every projection's fallback) that is more than
    PRUNE_RATIO x slower than the best at ``rows`` and whose cost already grew linearly since a
    point at most half as large (a shorter step is too noisy to tell)."""
    for role in roles:
        med = {f: statistics.median(samples[role][f][str(rows)]) for f in alive[role]
               if str(rows) in samples[role].get(f, {})}
        if not med:
            continue
        best = min(med.values())
        for f, m in med.items():
            seen = previous.setdefault((role, f), {})
            half = [r for r in seen if r <= rows / 2]
            linear = bool(half) and m / seen[max(half)] >= 0.8 * rows / max(half)
            if f != "dense" and m > PRUNE_RATIO * best and linear:
                alive[role].discard(f)
            seen[rows] = m


# ---- dtype ----

def _synthetic_grid(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """A [N, K] float32 weight on a 4-bit grid of 32 columns (what a Q4 checkpoint holds)."""
    w = torch.randn(n, k, generator=g) * 0.02
    codes, step, low = quantize_int4(w)
    return (codes.view(n, k // 32, 32).float() * step[..., None] + low[..., None]).view(n, k)


CLOCK = time.perf_counter  # what ``measure_forms`` times a call with (tests time stand-in forms on CPU time)
DTYPE_POINTS = (64, 256)  # the row counts ``measure_dtypes`` times


def measure_dtypes(shapes: list[tuple[int, int]], int_gemm: bool, rounds: int = ROUNDS,
                   points: tuple[int, ...] = DTYPE_POINTS, on_point: Callable[[int], None] | None = None,
                   ) -> dict[str, dict[str, list[float]]]:
    """Per point, per candidate ("bfloat16/dense", "float32/dense", "float32/f32-dot" where
    lockgate's float32 kernel was built, "float32/int-gemm"), the per-round ms of one pass over
    one layer's projections (``shapes``: [N, K] each) with
    synthetic weights. Stops early when bf16 is more than 3x the float32 dense time at the
    first point (an emulated bf16 matmul: no need to wait on it twice)."""
    g = torch.Generator().manual_seed(0)
    weights = [_synthetic_grid(n, k, g) for n, k in shapes]
    cands: dict[str, list[Form]] = {
        "float32/dense": [DenseWeight(w) for w in weights],
        "bfloat16/dense": [DenseWeight(w.bfloat16()) for w in weights],
    }
    if f32_dot_available():
        cands["float32/f32-dot"] = [F32DotWeight(w) for w in weights]
    if int_gemm and all(IntGemmWeight.fits((n, k)) for n, k in shapes):
        cands["float32/int-gemm"] = [IntGemmWeight.from_weight(w, 4) for w in weights]
    out: dict[str, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for rows in points:
            xs = [torch.randn(rows, k, generator=g) for _, k in shapes]
            ins = {c: [x.to(torch.bfloat16) if c.startswith("bfloat16") else x for x in xs] for c in cands}

            def calls(c: str, ins: dict[str, list[torch.Tensor]] = ins) -> None:
                for form, x in zip(cands[c], ins[c], strict=True):
                    form(x, None)

            at = paired_rounds({c: partial(calls, c) for c in cands}, rounds)
            out[str(rows)] = at
            if on_point is not None:
                on_point(rows)
            if statistics.median(at["bfloat16/dense"]) > 3 * statistics.median(at["float32/dense"]):
                break
    return out


def decide_dtype(figures: dict[str, dict[str, list[float]]], margin: float = DTYPE_MARGIN) -> str:
    """bfloat16 when its dense form beats every float32 candidate by more than ``margin`` at
    every measured point (paired per round), else float32."""
    if not figures:
        return "float32"
    for at in figures.values():
        bf16 = at["bfloat16/dense"]
        for c, ts in at.items():
            if c.startswith("float32"):
                ratios = [b / t for b, t in zip(bf16, ts, strict=False) if t > 0]
                if not ratios or statistics.median(ratios) > 1 - margin:
                    return "float32"
    return "bfloat16"


# ---- reports ----

def medians(samples: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, dict[str, dict[str, float]]]:
    return {role: {f: {p: round(statistics.median(ts), 4) for p, ts in by_p.items()} for f, by_p in by_f.items()}
            for role, by_f in samples.items()}


def describe(choices: dict[str, FormChoice]) -> list[str]:
    return [f"  {role:<8} {choices[role].describe()}" for role in ROLES if role in choices]


def figures_table(samples: dict[str, dict[str, dict[str, list[float]]]], choices: dict[str, FormChoice]) -> str:
    """Median ms per call, per role and row count, every form measured; * marks the chosen one."""
    lines = []
    for role in ROLES:
        if role not in samples:
            continue
        by_form = samples[role]
        forms = sorted(by_form, key=FORM_NAMES.index)
        points = sorted({int(p) for ts in by_form.values() for p in ts})
        lines.append(f"{role} (ms per call)")
        lines.append("  rows  " + "".join(f"{f:>13}" for f in forms))
        for p in points:
            chosen = choices[role].pick(p) if role in choices else None
            cells = []
            for f in forms:
                ts = by_form[f].get(str(p))
                cell = "-" if not ts else f"{statistics.median(ts):.3f}{'*' if f == chosen else ' '}"
                cells.append(f"{cell:>13}")
            lines.append(f"  {p:>4}  " + "".join(cells))
    return "\n".join(lines)


def report(table: TuningTable, dtype_info: dict[str, Any], dtype: str) -> str:
    """What ``lockgate tune`` prints: the machine, how the dtype was chosen, the kernel choice
    (``TuningTable``: the table per role, the attention paths, the prompt rows' forms), and every
    figure measured."""
    cpu = cpu_description()
    lines = [f"CPU: {cpu['cpu']} ({notable_flags(cpu['flags'])}), {torch.get_num_threads()} threads, "
             f"torch {torch.__version__}, int_linear path {int_gemm_isa() or 'not built'}",
             f"dtype: {dtype} ({dtype_info.get('how', '')})"]
    for rows, at in dtype_info.get("ms_per_layer_pass", {}).items():
        lines.append(f"  one layer's projections at {rows} rows: "
                     + ", ".join(f"{c} {ms:.2f} ms" for c, ms in at.items()))
    lines.append(f"matmul forms ({table.source}):")
    lines += [f"  {role:<8} {choice.describe()}" for role, choice in table.choices.items()]
    figures = ", ".join(f"{name} {statistics.median(ts):.1f} ms" for name, ts in table.attention_ms.items() if ts)
    lines.append(f"decode attention: {'lockgate kernel' if table.decode_attention == 'kernel' else 'gathers + SDPA'}"
                 + (f" (a decode step's layers at batch 16 x 256 keys: {figures})" if figures else ""))
    figures = ", ".join(f"{name} {statistics.median(ts):.1f} ms" for name, ts in table.attention_lookahead_ms.items()
                        if ts)
    if figures:
        lines.append(f"  its look-ahead (next item's K/V rows prefetched): {table.attention_lookahead} "
                     f"(a decode step's layers at batch {LOOKAHEAD_BATCH} x {LOOKAHEAD_CONTEXT} keys: {figures})")
    figures = ", ".join(f"{name} {statistics.median(ts):.1f} ms" for name, ts in table.prefill_attention_ms.items() if ts)
    lines.append(f"prefill attention: {'lockgate kernel' if table.prefill_attention == 'kernel' else 'SDPA'}"
                 + (f" (4 layers of fresh {' + '.join(map(str, PREFILL_ATTENTION_TOKENS))}-token prompts: {figures})"
                    if figures else ""))
    if table.exact_prefill:
        lines.append(f"prompt rows (row-invariant forms, --exact-prefill): {table.exact_prefill}")
    if table.samples:
        lines += ["", "median ms per call (* = chosen; - = not measured: pruned, or beyond the head's rows):",
                  figures_table(table.samples, table.choices)]
    return "\n".join(lines)
