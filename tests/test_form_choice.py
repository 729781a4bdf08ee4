"""FormPlan's row-invariant prompt forms from the cached check (lockgate.runner.form_choice).

The check itself (``row_invariance.row_floors``: real matmuls on real forms) and the pieces the
choice combines (``built_floors``, ``first_invariant``) are tested in tests/test_linear.py. Here:
what ``FormPlan`` does with a cached result, on stand-in projections (a role's ``Linear`` objects
reduced to the forms they were built with and the prompt form they are given) and a stand-in check
that records its calls: whether a start whose cache names a form it did not build checks again,
and that a current cache is used as it is. The cache is the real one, in a temporary directory.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lockgate.config import ModelConfig
from lockgate.kernel_choice import FormChoice
from lockgate.layers.linear import PromptForm
from lockgate.runner import form_choice, row_invariance, tuning_cache


class StandInLinear:
    """What FormPlan touches of a ``Linear``: its forms, its choice, its prompt form."""

    def __init__(self, forms: set[str]) -> None:
        self.forms = {f: object() for f in forms}
        self.choice = FormChoice.single("dense")
        self.prompt: PromptForm | None = None

    def choose(self, choice: FormChoice) -> None:
        self.choice = choice

    def set_prompt_form(self, prompt: PromptForm) -> None:
        assert prompt.name in self.forms, "a prompt form must be one this projection has"
        self.prompt = prompt


class StandInModel:
    args = SimpleNamespace(attn_softcap=None, layer_windows=(), moe=None)  # a plain Llama layout

    def __init__(self, forms: set[str]) -> None:
        self.roles = {role: [StandInLinear(forms), StandInLinear(forms)] for role in ("qkv", "o")}
        self.ops = SimpleNamespace(forget=lambda: None)

    def projections(self) -> dict[str, list[StandInLinear]]:
        return self.roles


def plan_for(cfg: ModelConfig) -> form_choice.FormPlan:
    """A FormPlan as a start on this machine makes it, without a model file behind its key."""
    plan = object.__new__(form_choice.FormPlan)
    plan.cfg, plan.dtype, plan.cpu_kernels, plan.stored_table, plan.bf16_gemm_fits = (
        cfg, torch.bfloat16, True, None, False)
    plan.forms_key = tuning_cache.TuningKey(kind="forms", cpu="test CPU", flags="", threads=2, torch="test",
                                      kernels="test", shape={"layers": 2}, dtype="bfloat16",
                                      weights={"checkpoint": "test"})
    return plan


@pytest.fixture
def checks(tmp_path, monkeypatch) -> list[dict[str, Any]]:
    """The row check's calls; it finds the integer GEMM invariant from 1 row, dense nowhere."""
    monkeypatch.setenv("LOCKGATE_TUNING_DIR", str(tmp_path))
    calls: list[dict[str, Any]] = []

    def row_floors(roles, dtype, candidates, first_only):
        calls.append({"candidates": candidates, "first_only": first_only})
        return {role: {f: (1 if f == "int-gemm" else None) for f in candidates[role] if f in lins[0].forms}
                for role, lins in roles.items()}

    monkeypatch.setattr(row_invariance, "row_floors", row_floors)
    return calls


def cache_floors(plan: form_choice.FormPlan, model: StandInModel, floors: dict[str, int | None]) -> None:
    """Store ``floors`` for every role under the key this start's check uses."""
    candidates = plan._candidates({role: lins[0].choice for role, lins in model.projections().items()})
    tuning_cache.cached(plan._rows_key(candidates), lambda: {"floors": {role: dict(floors) for role in candidates}})


def test_a_cached_floor_naming_a_form_this_start_lacks_is_checked_again(checks) -> None:
    # An earlier start had lockgate's bf16 kernel and found it invariant; this one is short of
    # memory and did not build it. The cached pick cannot serve, so the plan checks the forms it
    # has (once) instead of turning exact prefill off.
    plan = plan_for(ModelConfig())
    model = StandInModel({"dense", "int-gemm"})
    cache_floors(plan, model, {"dense": None, "bf16-gemm": 1})
    paths = form_choice.Paths(decode_kernel=True)
    plan._choose_row_forms(model, paths, {})  # type: ignore[arg-type]
    assert len(checks) == 1 and checks[0]["first_only"] is True
    assert paths.exact_prefill_problem is None
    assert paths.prompt_forms == {"qkv": PromptForm("int-gemm", 1), "o": PromptForm("int-gemm", 1)}
    assert all(lin.prompt == PromptForm("int-gemm", 1) for lins in model.roles.values() for lin in lins)
    assert paths.decode_kernel and paths.prefill_kernel  # every token's attention on the kernel
    # the new result replaced the stale one: the next start uses it without checking
    again = StandInModel({"dense", "int-gemm"})
    plan._choose_row_forms(again, form_choice.Paths(decode_kernel=True), {})  # type: ignore[arg-type]
    assert len(checks) == 1


def test_a_current_cache_is_used_without_checking(checks) -> None:
    plan = plan_for(ModelConfig())
    model = StandInModel({"dense", "int-gemm"})
    cache_floors(plan, model, {"dense": 2, "int-gemm": 1})
    paths = form_choice.Paths(decode_kernel=True)
    plan._choose_row_forms(model, paths, {})  # type: ignore[arg-type]
    assert checks == []
    assert paths.prompt_forms["qkv"] == PromptForm("dense", 2)  # the first invariant candidate: dense


def test_a_role_with_no_invariant_form_leaves_every_projection_as_it_was(checks) -> None:
    plan = plan_for(ModelConfig())
    model = StandInModel({"dense"})  # no integer GEMM: nothing the stand-in check finds invariant
    paths = form_choice.Paths(decode_kernel=False)
    plan._choose_row_forms(model, paths, {})  # type: ignore[arg-type]
    assert len(checks) == 1  # nothing cached: checked once
    assert paths.prompt_forms == {} and not paths.prefill_kernel and not paths.decode_kernel
    assert paths.exact_prefill_problem is not None and "qkv, o" in paths.exact_prefill_problem
    assert "checked dense" in paths.exact_prefill_problem
    assert all(lin.prompt is None for lins in model.roles.values() for lin in lins)
    # --deterministic then refuses to start, naming the roles
    det = dataclasses.replace(ModelConfig(), deterministic=True)
    with pytest.raises(ValueError, match="o, qkv have none on this machine"):
        form_choice.check_deterministic(model, det, torch.bfloat16, True)  # type: ignore[arg-type]
