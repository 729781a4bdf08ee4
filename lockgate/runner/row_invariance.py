"""Which matmul forms give a row the same bits whatever the call's row count (issue 19).

Owns the check and the two choices made from it. A form is *row-invariant from a floor m* when
every row of a call of r >= m rows is bitwise what the largest call gives it, and calls of fewer
rows padded with zero rows to m agree too. That is a property of a kernel on a CPU, so it is
measured, not assumed (``min_rows_for``): MKL's sgemm on the Zen 5 class CPU rounds calls of 1, 2,
3, 5, 7 or 9 rows differently from larger ones; oneDNN's bf16 kernel a 1-row call of the
1,536-column down projection (about one row in ten, in the last bit); lockgate's integer GEMM and
bf16 kernel are row-invariant by construction. ``row_floors`` checks every candidate of every
role on the role's first projection (for ``--exact-prefill`` only up to the first invariant one),
calls of 1..``INVARIANCE_ROWS[-1]`` rows (the LM head up to ``HEAD_MAX_ROWS``); the runner caches
the result per machine, model and check (tuning kind "rows").

The two choices (``lockgate.runner.form_choice`` applies them to ``Linear.set_prompt_form``):

* ``first_invariant`` (``--exact-prefill``, the default): a role's prompt rows run on the first
  row-invariant candidate in ``candidates`` order (the measured table's form at large row counts,
  then lockgate's bf16 or float32 kernel where the projection has it, dense, the integer GEMM), decode rows
  keep the per-row-count table;
* ``cheapest_invariant`` (``--deterministic``): every call of a role runs on one form, the
  row-invariant candidate whose medians summed over the measured row counts are least
  (``tuning.one_form_cost``; the integer GEMM when nothing was measured).

Both pick only among forms every projection of the role has (``built_floors``): the floors are
cached, the forms built at each start.

Torch only for the check; the choices are plain dictionaries.
"""

from __future__ import annotations

from typing import Any

import torch

from lockgate.config import DETERMINISTIC_FORM
from lockgate.kernel_choice import UNBOUNDED, FormChoice
from lockgate.layers.forms import Form
from lockgate.layers.linear import PromptForm
from lockgate.runner.tuning import HEAD_MAX_ROWS, one_form_cost

INVARIANCE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257,
                   511, 512, 513, 1024)  # call sizes compared
MIN_ROWS_FLOORS = (1, 2, 4, 8, 16, 32)  # the padding floors tried, fewest first
COVERED_ROWS = 128  # calls smaller than this are checked on every row of the first COVERED_ROWS ...
COVERED_OUTPUTS = COVERED_ROWS * 8192  # ... of a projection with up to 8,192 outputs a row; a wider
MIN_COVERED_ROWS = 16  # one on proportionally fewer rows, never fewer than these. Every call
# streams the whole weight: the float32 LM head of a 262,144-token vocabulary (640 MiB) took 68 s
# at 128 rows, 15 s at 16.


def covered_rows(outputs: int) -> int:
    """How many leading rows of the reference call the small calls cover for a projection with
    ``outputs`` outputs a row: ``COVERED_ROWS`` up to 8,192 outputs, fewer above (never under
    ``MIN_COVERED_ROWS``), so that every call size still compares at least ``COVERED_OUTPUTS``
    results. A different accumulation order shows in some outputs of some rows (oneDNN's 1-row
    call of a 576-output projection: about one row in ten); what matters is how many outputs are
    compared, and a wide row holds many."""
    return max(MIN_COVERED_ROWS, min(COVERED_ROWS, COVERED_OUTPUTS // max(1, outputs)))


def min_rows_for(form: Form, bias: torch.Tensor | None, k: int, dtype: torch.dtype, max_rows: int,
                 seed: int = 0, covered: int = COVERED_ROWS) -> int | None:
    """The fewest rows ``form`` must be called with for every row's result to be the same bits
    whatever the call's size (calls of fewer rows padded with zero rows to that floor), among
    ``MIN_ROWS_FLOORS``; None when no floor makes it so. Checked on random rows against the
    largest call (``max_rows`` or the largest ``INVARIANCE_ROWS`` below it), at every size of
    ``INVARIANCE_ROWS`` up to it: calls of fewer than ``COVERED_ROWS`` rows cover the first
    ``covered`` rows one after the other (a call of more rows than that, its first rows only; a
    different accumulation order shows in the rounded result of only some rows), larger calls take
    the rows from the front and from the back."""
    sizes = [r for r in INVARIANCE_ROWS if r <= max_rows] or [1]
    big = sizes[-1]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(big, k, generator=g).to(dtype)

    def starts(r: int) -> list[int]:  # (the largest call once: from the front is from the back)
        return list(range(0, max(r, min(covered, big)) - r + 1, r)) if r < COVERED_ROWS else sorted({0, big - r})

    def agrees(r: int, floor: int) -> bool:
        for i in starts(r):
            part = x[i:i + r] if r >= floor else torch.cat([x[i:i + r], x.new_zeros(floor - r, k)])
            if not torch.equal(form(part, bias)[:r], ref[i:i + r]):
                return False
        return True

    with torch.inference_mode():
        ref = form(x, bias)
        direct = {r: agrees(r, 1) for r in sizes}
        for floor in MIN_ROWS_FLOORS:
            if floor <= big and all(ok for r, ok in direct.items() if r >= floor) \
                    and all(agrees(r, floor) for r in range(1, floor)):
                return floor
    return None


def row_floors(projections: dict[str, list[Any]], dtype: torch.dtype, candidates: dict[str, list[str]],
               max_rows: int = INVARIANCE_ROWS[-1], first_only: bool = False) -> dict[str, dict[str, int | None]]:
    """Per role, each of ``candidates[role]`` that every projection of the role has -> its
    ``min_rows_for`` floor on the role's first projection (None: its rows depend on the call's size
    whatever the floor). With ``first_only`` (all ``first_invariant`` needs) a role's check stops
    at its first invariant candidate: the later ones are left out, not recorded as None. (A form
    only some layers have, e.g. the integer GEMM where a GGUF mixes 4- and 6-bit layers, is never
    a role's prompt form, so it is not checked.)"""
    out: dict[str, dict[str, int | None]] = {}
    for role, lins in projections.items():
        lin = lins[0]
        limit = min(max_rows, HEAD_MAX_ROWS) if role == "head" else max_rows
        covered = covered_rows(lin.shape[0])
        out[role] = {}
        for name in (n for n in candidates.get(role, []) if all(n in other.forms for other in lins)):
            out[role][name] = min_rows_for(lin.forms[name], lin.bias, lin.shape[1], dtype, limit, covered=covered)
            if first_only and out[role][name] is not None:
                break
    return out


def candidates_for(choices: dict[str, FormChoice]) -> dict[str, list[str]]:
    """Per role the forms worth checking, the most wanted first: the choice's form at large row
    counts (the fastest there), then lockgate's bf16 and float32 kernels, dense, the integer GEMM
    (a projection is checked on those it has)."""
    return {role: list(dict.fromkeys([c.pick(UNBOUNDED), "bf16-gemm", "f32-dot", "dense", DETERMINISTIC_FORM]))
            for role, c in choices.items()}


def built_floors(floors: dict[str, int | None], projections: list[Any]) -> dict[str, int | None]:
    """``floors`` without the forms some of ``projections`` (one role's) lack. The floors come from
    a cache kept per machine and model, the forms are built at each start: a start short of memory
    skips lockgate's bf16 copies, and a floor for them must not be picked, or the role's prompt
    rows would quietly go by row count while the start-up log names the form. (``FormPlan`` checks
    again when that leaves a role without a form.)"""
    return {f: fl for f, fl in floors.items() if all(f in lin.forms for lin in projections)}


def first_invariant(floors: dict[str, int | None], candidates: list[str]) -> PromptForm | None:
    """The first of ``candidates`` with a floor (``--exact-prefill``)."""
    return next((PromptForm(f, floor) for f in candidates if (floor := floors.get(f)) is not None), None)


def cheapest_invariant(floors: dict[str, int | None], samples: dict[str, dict[str, list[float]]]) -> PromptForm | None:
    """The candidate with a floor that costs least over the measured row counts (``--deterministic``;
    ``samples``: one role's form -> rows -> times, possibly empty); unmeasured forms rank after
    measured ones, the integer GEMM first among them."""
    ok = {f: int(fl) for f, fl in floors.items() if fl is not None}

    def cost(form: str) -> tuple[int, float]:
        if form in samples:
            return 0, one_form_cost(samples, form)
        return 1, 0.0 if form == DETERMINISTIC_FORM else 1.0

    best = min(ok, key=cost, default=None)
    return None if best is None else PromptForm(best, ok[best])
