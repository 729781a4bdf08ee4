"""How the model runs on this machine: ``--dtype auto``, each projection's matmul forms, the
attention paths and the row-invariant prompt forms (``--exact-prefill``, ``--deterministic``).

Owns choosing, not running steps. ``auto_dtype`` picks the dtype before anything loads.
``FormPlan`` is made once the dtype is known and before the weights load: its cache key is known
then, so a stored ``TuningTable`` (``tuning_cache.peek_table``) tells the loader which forms to
build at all (``wanted_forms``). ``FormPlan.choose`` then applies the table to the loaded ``DecoderModel``:
every projection's ``FormChoice`` and, where asked, its ``PromptForm``; the forms nothing calls
freed and the model's packed whole-step weights forgotten; the attention kernel's process-wide
look-ahead switch set (the last model loaded in a process decides); one readable table logged.
It returns ``Paths``, the facts ``ModelRunner.execute`` reads each step and ``Paths.table``, the
``TuningTable`` as applied (what the log and ``lockgate tune`` show), or raises ValueError
(``--deterministic`` where it cannot hold).

Invariants:

* A choice is measured (``lockgate.runner.tuning``, ``tuning_attention``, ``row_invariance``) and
  cached per machine, model and what decides the forms; ``--tuning off`` applies the static rule
  and ``--matmul-forms`` forces one, and ``--fp32-matmul-rows N`` overrides either. Nothing reads
  CPU flags to decide.
* Row-invariant prompt forms are all or nothing: either every role has one, checked, on every
  projection, or none changes and ``Paths.exact_prefill_problem`` says why. A model whose
  sliding-window, soft-capped or expert layers cannot be exact anyway is not checked (it says so;
  ``--deterministic`` still checks, and then refuses such a model).
* ``--deterministic`` starts only where it holds: every projection on one batch-invariant form
  and the attention kernel there (``check_deterministic``: a ValueError saying what is missing).

Called by ``lockgate.runner.model_runner`` (``ModelRunner.__init__``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from lockgate import kernels
from lockgate.config import ModelConfig
from lockgate.kernel_choice import (
    FORM_NAMES,
    QUANTIZED_FORMS,
    FormChoice,
    PromptForm,
    Samples,
    TuningTable,
    fallback_form,
)
from lockgate.layers.forms import int_gemm_available, int_gemm_isa, weight_copies_fit
from lockgate.models.args import ModelArgs
from lockgate.models.decoder import PROJECTION_ROLES, DecoderModel
from lockgate.progress import phase
from lockgate.runner import row_invariance, tuning, tuning_attention, tuning_cache

log = logging.getLogger("lockgate.runner")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclasses.dataclass
class Paths:
    """What ``FormPlan.choose`` decided that the runner reads per step, and the record of it."""

    decode_kernel: bool  # decode attention on lockgate's kernel (else gathers + SDPA)
    prefill_kernel: bool = False  # prompt attention on it too (else SDPA)
    # the attention kernel prefetches its next item's K/V rows (lockgate::set_attention_lookahead)
    attention_lookahead: bool = False
    row_invariant: bool = False  # --deterministic: every token's attention is a decode-kernel row
    prompt_forms: dict[str, PromptForm] = dataclasses.field(default_factory=dict)  # per role
    exact_prefill_problem: str | None = "off (--no-exact-prefill)"  # why prompt rows are not exact
    # the kernel choice as applied, for logs and `lockgate tune`
    table: TuningTable = dataclasses.field(default_factory=lambda: TuningTable(choices={}))

    def describe_prompt_forms(self) -> str:
        if not self.prompt_forms:
            return f"by row count, as decode rows ({self.exact_prefill_problem})"
        text = ", ".join(f"{role} {p.name}" + (f" (>= {p.min_rows} rows)" if p.min_rows > 1 else "")
                         for role, p in self.prompt_forms.items())
        return text + ("" if self.exact_prefill_problem is None else f"; not exact: {self.exact_prefill_problem}")


def tuning_key(kind: str, cfg: ModelConfig, args: ModelArgs, dtype: str,
               weights: dict[str, Any] | None = None) -> tuning_cache.TuningKey:
    """The cache key of a ``kind`` measurement for this machine, thread count, kernels and model shape."""
    cpu = tuning_cache.cpu_description()
    shape = {"layers": args.num_layers, "hidden": args.hidden_size, "intermediate": args.intermediate_size,
             "heads": args.num_heads, "kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
             "vocab": args.vocab_size}
    built = kernels.build_name() if kernels.error() is None and kernels.load(cfg.cpu_kernels) else "none"
    return tuning_cache.TuningKey(kind=kind, cpu=cpu["cpu"], flags=cpu["flags"], threads=torch.get_num_threads(),
                            torch=tuning_cache.torch_build(), kernels=built, shape=shape, dtype=dtype, weights=weights or {})


def auto_dtype(cfg: ModelConfig, args: ModelArgs, kernels_built: bool) -> tuple[torch.dtype, dict[str, Any]]:
    """``--dtype auto`` on a CPU: float32 unless bf16's matmuls measure faster (``tuning``); with
    how it was chosen (for the log and ``lockgate tune``)."""
    if cfg.tuning == "off":
        return torch.float32, {"how": "--dtype auto with --tuning off: float32 without measuring"}
    shapes = [((args.num_heads + 2 * args.num_kv_heads) * args.head_dim, args.hidden_size),
              (args.hidden_size, args.num_heads * args.head_dim),
              (2 * args.intermediate_size, args.hidden_size), (args.hidden_size, args.intermediate_size)]
    int_gemm = kernels_built and int_gemm_available()

    def measure() -> dict[str, Any]:
        with phase(log, "measuring bf16 against float32 matmuls at this model's shapes (once per CPU and shape)",
                   total=len(tuning.DTYPE_POINTS), unit="row counts") as p:
            figures = tuning.measure_dtypes(shapes, int_gemm, on_point=lambda rows: p.advance())
        return {"figures": figures, "dtype": tuning.decide_dtype(figures)}

    data, hit = tuning_cache.cached(tuning_key("dtype", cfg, args, "auto"), measure, refresh=cfg.tuning == "refresh")
    dtype = str(data["dtype"])
    if dtype not in ("float32", "bfloat16"):
        dtype = tuning.decide_dtype(data.get("figures", {}))
    ms = {p: {c: round(float(np.median(ts)), 2) for c, ts in at.items()} for p, at in data.get("figures", {}).items()}
    how = "cached" if hit else f"measured in {data.get('seconds', 0):.1f}s"
    log.info("--dtype auto -> %s (%s: one layer's projections, ms per pass by rows: %s)", dtype, how, ms)
    return DTYPES[dtype], {"how": f"--dtype auto: {how}, {data['path']}", "ms_per_layer_pass": ms}


def check_deterministic(model: DecoderModel, cfg: ModelConfig, dtype: torch.dtype, cpu_kernels: bool) -> None:
    """--deterministic holds only if every projection really runs the batch-invariant form and
    the attention kernel is there: else a start-up error saying what is missing."""
    if not cpu_kernels:
        raise ValueError(f"--deterministic needs lockgate's CPU kernels ({kernels.error() or 'not loaded'}; "
                         f"dtype {dtype})")
    a = model.args
    if a.attn_softcap is not None or any(a.layer_windows) or a.moe is not None:
        raise ValueError(f"--deterministic does not cover {a.model_type} yet: its sliding-window or soft-capped "
                         "attention, or its experts, do not run on batch-invariant paths")
    lacking = sorted(role for role, lins in model.projections().items()
                     if any(lin.prompt is None or lin.choice.names() != {lin.prompt.name} for lin in lins))
    if lacking:
        raise ValueError(f"--deterministic needs, for every projection, one matmul form whose rows do not depend on "
                         f"how many share the call; {', '.join(lacking)} have none on this machine (checked: "
                         f"{cfg.matmul_forms if cfg.matmul_forms != 'auto' else 'dense and int-gemm'}; "
                         f"int-gemm comes with a 4- or 8-bit GGUF checkpoint such as the default model, "
                         f"--quantization auto or int4, and int_linear's vector path: {int_gemm_isa() or 'not built'})")


class FormPlan:
    """The forms one model start builds and chooses (module docstring)."""

    def __init__(self, cfg: ModelConfig, args: ModelArgs, dtype: torch.dtype, cpu_kernels: bool,
                 quantization: str, fp32: bool, checkpoint: str) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.cpu_kernels = cpu_kernels
        # lockgate's bf16 kernel keeps its own packed copy (2 bytes a parameter; all forms are made
        # while the table is measured): only where it fits beside the float32 copies
        self.bf16_gemm_fits = weight_copies_fit((2 + (4 if fp32 else 0)) * args.matmul_parameters)
        weights: dict[str, Any] = {"checkpoint": checkpoint, "quantization": quantization, "fp32": fp32}
        if cfg.activation_quant != "none":  # the tier's forms run other kernels: a table of their own
            weights["activation_quant"] = cfg.activation_quant
        self.forms_key = tuning_key("forms", cfg, args, str(dtype).removeprefix("torch."), weights)
        self.stored_table: TuningTable | None = tuning_cache.peek_table(self.forms_key) \
            if cfg.tuning == "auto" and cfg.matmul_forms == "auto" else None

    # ---- before loading ----

    def wanted_forms(self) -> dict[str, set[str]] | None:
        """``_table_forms``, without the bf16-gemm copy where it does not fit memory."""
        want = self._table_forms()
        if self.bf16_gemm_fits:
            return want
        if want is None:
            return {role: set(FORM_NAMES) - {"bf16-gemm"} for role in PROJECTION_ROLES}
        return {role: names - {"bf16-gemm"} for role, names in want.items()}

    def forced_forms(self) -> dict[str, set[str]] | None:
        """Per role the forms ``--matmul-forms`` forces (what a GGUF's blocks are then made into,
        a dense copy included if named); None: not forced (blocks get their one default form)."""
        if self.cfg.matmul_forms == "auto":
            return None
        return {role: FormChoice.parse(self.cfg.matmul_forms).names() for role in PROJECTION_ROLES}

    def _table_forms(self) -> dict[str, set[str]] | None:
        """Per role the forms worth building (dense is always built): those a forced
        ``--matmul-forms`` names, those a stored table calls, the quantized ones for the static
        rule (``--tuning off``), plus ``fp32`` under ``--fp32-matmul-rows N``, plus the
        row-invariant ones a stored check found (all candidates while unchecked); None (every
        form a projection can have) when the table is still to be measured."""
        cfg = self.cfg
        if cfg.matmul_forms != "auto":
            choices = {role: FormChoice.parse(cfg.matmul_forms) for role in PROJECTION_ROLES}
            want = {role: c.names() for role, c in choices.items()}
        elif cfg.tuning == "off":
            choices = {role: FormChoice.static(("dense", *QUANTIZED_FORMS)) for role in PROJECTION_ROLES}
            want = {role: set(QUANTIZED_FORMS) for role in PROJECTION_ROLES}
        elif self.stored_table is not None:
            stored = self.stored_table.choices
            choices = {role: stored.get(role, FormChoice.single("dense")) for role in PROJECTION_ROLES}
            want = {role: c.names() for role, c in choices.items()}
        else:
            return None
        if cfg.fp32_matmul_rows not in ("auto", "off"):
            want = {role: names | {"fp32"} for role, names in want.items()}
        if cfg.exact_prefill or cfg.deterministic:  # the forms the row check found (or may find) invariant
            candidates = self._candidates(choices)
            floors = (tuning_cache.peek(self._rows_key(candidates)) or {}).get("floors", {})
            want = {role: names | ({f for f, fl in floors[role].items() if fl is not None} if role in floors
                                   else set(candidates[role])) for role, names in want.items()}
        return want

    # ---- after loading ----

    def choose(self, model: DecoderModel) -> Paths:
        """Give every projection its FormChoice and pick the attention paths: measured (cached),
        or ``--tuning off`` (static rule), or ``--matmul-forms`` (forced); then the
        ``--fp32-matmul-rows N`` override and the row-invariant prompt forms. Logs the table."""
        cfg = self.cfg
        roles = model.projections()
        paths = Paths(decode_kernel=self.cpu_kernels, row_invariant=cfg.deterministic)
        choices: dict[str, FormChoice] = {}
        table = TuningTable(choices={}, source="static rule (--tuning off)")
        if cfg.matmul_forms != "auto":
            choices = {role: FormChoice.parse(cfg.matmul_forms) for role in roles}
            table = TuningTable(choices={}, source=f"--matmul-forms {cfg.matmul_forms}")
        elif cfg.tuning != "off":
            table = self._measured(model, cfg.tuning == "refresh")
            choices = dict(table.choices)
            paths.decode_kernel = self.cpu_kernels and table.decode_attention == "kernel"
            paths.prefill_kernel = paths.decode_kernel and table.prefill_attention == "kernel"
            paths.attention_lookahead = paths.decode_kernel and table.attention_lookahead == "on"
        if self.cpu_kernels:  # process-wide: the last model loaded in a process decides
            torch.ops.lockgate.set_attention_lookahead(paths.attention_lookahead)
        model.choose_forms(choices)
        if cfg.fp32_matmul_rows not in ("auto", "off"):  # (--deterministic refuses it: ModelConfig)
            rows = int(cfg.fp32_matmul_rows)
            for lin in (lin for lins in roles.values() for lin in lins):
                if "fp32" in lin.forms:
                    lin.choose(lin.choice.from_rows(rows, "fp32"))
        if cfg.exact_prefill or cfg.deterministic:
            self._choose_row_forms(model, paths, table.samples)
        model.choose_forms({}, drop=True)  # free the forms no projection calls
        self._log_table(_applied(table, model, paths))
        if paths.exact_prefill_problem and cfg.exact_prefill:
            log.warning("prefix-cache hits and prompt chunking may change results in the last bits on this "
                        "machine: %s", paths.exact_prefill_problem)
        if cfg.deterministic:
            check_deterministic(model, cfg, self.dtype, self.cpu_kernels)
            paths.decode_kernel = True
        paths.table = _applied(table, model, paths)
        return paths

    def _log_table(self, table: TuningTable) -> None:
        cpu = tuning_cache.cpu_description()
        lines = [f"matmul forms ({table.source}; {cpu['cpu']}, {tuning_cache.notable_flags(cpu['flags'])}, "
                 f"{torch.get_num_threads()} threads, {self.dtype}, int-gemm path {int_gemm_isa() or 'not built'}):"]
        log.info("\n".join(lines + table.describe()))

    def _measured(self, model: DecoderModel, refresh: bool) -> TuningTable:
        """The table for ``forms_key``: the one ``peek_table`` found before loading, else the cached
        or a new measurement of the forms the model now has (all it can have: ``wanted_forms``)."""
        if self.stored_table is not None and not refresh:
            return self.stored_table
        roles = model.projections()
        args = model.args
        forms = {role: sorted({f for lin in lins for f in lin.forms}) for role, lins in roles.items()}

        def measure() -> TuningTable:
            several = any(len(f) > 1 for f in forms.values())
            steps = (len(tuning.POINTS) if several else 0) + (3 if self.cpu_kernels else 0)
            with phase(log, "measuring the matmul forms and attention paths at this model's shapes (once per CPU, "
                       "threads and shape)", total=steps, unit="steps") as p:
                p.detail("matmul forms")
                samples = tuning.measure_forms(roles, self.dtype, on_point=lambda rows: p.at(
                    p.n + 1, f"matmul forms, {rows} rows done")) if several else {}
                heads = (args.num_heads, args.num_kv_heads, args.head_dim, self.dtype)
                attention, prefill, lookahead = {}, {}, {}
                if self.cpu_kernels:
                    p.detail("decode attention")
                    attention = tuning_attention.measure_attention(*heads, args.num_layers)
                    p.advance()
                    p.detail("prefill attention")
                    prefill = tuning_attention.measure_prefill_attention(*heads)
                    p.advance()
                    p.detail("attention look-ahead")
                    lookahead = tuning_attention.measure_attention_lookahead(*heads, args.num_layers)
                    p.advance()
            choices = tuning.decide(samples)
            return TuningTable(
                choices={r: choices.get(r, FormChoice.single(fallback_form(forms[r]))) for r in roles},
                decode_attention=tuning_attention.decide_attention(attention),
                prefill_attention=tuning_attention.decide_prefill_attention(prefill),
                attention_lookahead=tuning_attention.decide_attention_lookahead(lookahead),
                forms=forms, samples=samples, attention_ms=attention, prefill_attention_ms=prefill,
                attention_lookahead_ms=lookahead)

        return tuning_cache.cached_table(self.forms_key, measure, refresh=refresh)

    # ---- row-invariant forms (--exact-prefill, --deterministic; issue 19) ----

    def _rows_key(self, candidates: dict[str, list[str]]) -> tuning_cache.TuningKey:
        """--deterministic: all candidates checked (it compares their costs), else each role's up
        to its first invariant one (--exact-prefill)."""
        return dataclasses.replace(self.forms_key, kind="rows", weights={
            **self.forms_key.weights, "candidates": candidates, "max_rows": row_invariance.INVARIANCE_ROWS[-1],
            "check": "every" if self.cfg.deterministic else "first", "forms_on": "every projection"})

    def _candidates(self, choices: dict[str, FormChoice]) -> dict[str, list[str]]:
        """The forms checked per role: a forced --matmul-forms under --deterministic, else
        ``row_invariance.candidates_for`` the table's choices."""
        if self.cfg.deterministic and self.cfg.matmul_forms != "auto":
            return {role: sorted(FormChoice.parse(self.cfg.matmul_forms).names()) for role in choices}
        return row_invariance.candidates_for(choices)

    def _choose_row_forms(self, model: DecoderModel, paths: Paths, samples: Samples) -> None:
        """Give every projection its ``PromptForm`` from the cached row-invariance check: with
        --deterministic the cheapest invariant form, which then serves every call; else (exact
        prefill) the first invariant candidate, for prompt rows. Every token's attention goes to the
        kernel. All or nothing: a role without an invariant form leaves every projection as it was
        and ``exact_prefill_problem`` says why (--deterministic then refuses to start)."""
        cfg = self.cfg
        if not self.cpu_kernels:
            paths.exact_prefill_problem = f"it needs lockgate's CPU kernels ({kernels.error() or 'not loaded'})"
            return
        inexact = _inexact_layers(model.args)
        if inexact and not cfg.deterministic:  # no promise to keep: the check's start-up time is not spent
            paths.exact_prefill_problem = inexact
            return
        roles = model.projections()
        candidates = self._candidates({role: lins[0].choice for role, lins in roles.items()})

        def check(refresh: bool) -> tuple[dict[str, dict[str, int | None]], dict[str, PromptForm | None], bool]:
            """The cached (or new) floors, each role's pick among the forms built, and whether a
            role lacks one because the cache named a form this start did not build."""
            def measure() -> dict[str, Any]:
                with phase(log, "checking which forms give a prompt row the same bits at any row count (once per "
                           "CPU, threads and shape)"):
                    return {"floors": row_invariance.row_floors(roles, self.dtype, candidates,
                                                                first_only=not cfg.deterministic)}

            data, _ = tuning_cache.cached(self._rows_key(candidates), measure, refresh=refresh)
            checked = {role: data["floors"].get(role, {}) for role in roles}
            built = {role: row_invariance.built_floors(checked[role], lins) for role, lins in roles.items()}
            picks = {role: row_invariance.cheapest_invariant(built[role], samples.get(role, {}))
                     if cfg.deterministic else row_invariance.first_invariant(built[role], candidates[role])
                     for role in roles}
            return checked, picks, any(picks[r] is None and built[r] != checked[r] for r in roles)

        checked, picks, stale = check(cfg.tuning == "refresh")
        if stale and cfg.tuning != "refresh":
            checked, picks, _ = check(True)  # check the forms this start has
        lacking = [role for role, pick in picks.items() if pick is None]
        if lacking:
            paths.exact_prefill_problem = (f"no form of {', '.join(lacking)} gives a row the same bits whatever the "
                                           f"call's row count (checked {', '.join(checked[lacking[0]]) or 'no form'})")
            return
        paths.prompt_forms = {role: pick for role, pick in picks.items() if pick is not None}  # (all of them)
        for role, lins in roles.items():
            for lin in lins:
                if cfg.deterministic:
                    lin.choose(FormChoice.single(paths.prompt_forms[role].name))
                lin.set_prompt_form(paths.prompt_forms[role])  # built on every projection (built_floors)
        paths.decode_kernel = paths.prefill_kernel = True  # every token's attention: one kernel row over its keys
        model.ops.forget()
        paths.exact_prefill_problem = _inexact_layers(model.args)


def _applied(table: TuningTable, model: DecoderModel, paths: Paths) -> TuningTable:
    """``table`` as this start runs it: every role's choice as its projections now have it, the
    prompt forms and attention paths ``paths`` holds."""
    return dataclasses.replace(
        table, choices={role: lins[0].choice for role, lins in model.projections().items()},
        prompt_forms=dict(paths.prompt_forms), exact_prefill=paths.describe_prompt_forms(),
        decode_attention="kernel" if paths.decode_kernel else "sdpa",
        prefill_attention="kernel" if paths.prefill_kernel or paths.row_invariant else "sdpa",
        attention_lookahead="on" if paths.attention_lookahead else "off")


def _inexact_layers(a: Any) -> str | None:
    """Why a model of args ``a`` cannot give a prompt token the same bits whatever its chunk or
    cache hit even on row-invariant forms, or None."""
    if a.attn_softcap is not None or any(a.layer_windows) or a.moe is not None:
        return "its sliding-window, soft-capped or expert layers do not run on row-invariant paths yet"
    return None
