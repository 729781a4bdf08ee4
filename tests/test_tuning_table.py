"""The kernel choice as one typed object (lockgate.kernel_choice): ``TuningTable`` through its JSON
and the tuning cache (round trip, the unversioned layout read through its converter, another
version measured again), ``serving_form`` as the one rule ``Linear`` and the whole-step operator's
packs follow, and ``lockgate tune`` printing the table of a tiny model made in the test.

The rule is checked against a table of expected answers written out by hand; the cache is the
real one in a temporary directory; the CLI runs as a real process on a real (tiny, random)
checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from lockgate.kernel_choice import (
    TABLE_VERSION,
    FormChoice,
    PromptForm,
    TableVersionError,
    TuningTable,
    serving_form,
)
from lockgate.layers.linear import Linear
from lockgate.layers.ops import KernelOps
from lockgate.runner import tuning_cache

TABLE = TuningTable(
    choices={"qkv": FormChoice.parse("torch-int4:3,int-gemm:48,dense"), "head": FormChoice.single("dense")},
    prompt_forms={"qkv": PromptForm("int-gemm", 2)}, decode_attention="kernel", prefill_attention="kernel",
    attention_lookahead="on", forms={"qkv": ["dense", "int-gemm", "torch-int4"], "head": ["dense"]},
    samples={"qkv": {"dense": {"1": [1.0, 1.1, 0.9]}, "int-gemm": {"1": [0.5, 0.6, 0.4]}}},
    attention_ms={"kernel": [1.0, 1.0, 1.0], "sdpa": [2.0, 2.1, 1.9]}, prefill_attention_ms={"kernel": [3.0]},
    attention_lookahead_ms={"on": [0.9], "off": [1.0]}, exact_prefill="qkv int-gemm (>= 2 rows)")


@pytest.fixture
def key(tmp_path, monkeypatch) -> tuning_cache.TuningKey:
    monkeypatch.setenv("LOCKGATE_TUNING_DIR", str(tmp_path))
    return tuning_cache.TuningKey(kind="forms", cpu="test CPU", flags="avx2", threads=2, torch="t", kernels="k",
                                  shape={"hidden": 8}, dtype="bfloat16", weights={"checkpoint": "abc"})


def table_file(key: tuning_cache.TuningKey) -> Path:
    return tuning_cache.cache_dir() / f"forms-{key.digest()}.json"


def test_a_table_round_trips_through_its_json_and_the_cache(key) -> None:
    assert TuningTable.from_json(json.loads(json.dumps(TABLE.to_json()))) == TABLE
    calls: list[int] = []

    def measure() -> TuningTable:
        calls.append(1)
        return TABLE

    assert tuning_cache.peek_table(key) is None
    first = tuning_cache.cached_table(key, measure)
    assert calls == [1] and not first.cached and first.source.startswith("measured in ")
    assert str(table_file(key)) in first.source
    stored = json.loads(table_file(key).read_text())
    assert stored["version"] == TABLE_VERSION and stored["key"] == asdict(key)
    assert "source" not in stored and "cached" not in stored  # facts of a start, not of the measurement
    again = tuning_cache.cached_table(key, measure)
    assert calls == [1] and again.cached and again.source == f"cached {table_file(key)}"
    assert tuning_cache.peek_table(key) == again
    # the same table but for when and how it came about
    assert replace(again, source="", cached=False, seconds=0.0, measured_at="") == TABLE
    assert again.seconds == first.seconds and again.measured_at == first.measured_at != ""
    assert tuning_cache.cached_table(key, measure, refresh=True).cached is False and calls == [1, 1]


def test_a_table_stored_before_the_layout_had_a_version_gives_the_same_choices(key) -> None:
    # what the unversioned layout held (TUNING_VERSION 7): the choices as text, the decode attention under "attention"
    legacy = {"key": asdict(key), "measured_at": "2026-11-01T00:00:00+0000", "seconds": 12.5,
              "samples": TABLE.samples, "forms": TABLE.forms,
              "choices": {"qkv": "torch-int4:3,int-gemm:48,dense", "o": "int-gemm:16,dense", "head": "dense"},
              "attention_ms": {"kernel": [2.0], "sdpa": [1.0]}, "attention": "sdpa",
              "prefill_attention_ms": {}, "prefill_attention": "kernel",
              "attention_lookahead_ms": {}, "attention_lookahead": "on"}
    table_file(key).parent.mkdir(parents=True, exist_ok=True)
    table_file(key).write_text(json.dumps(legacy))

    def measure() -> TuningTable:
        raise AssertionError("a readable table is not measured again")

    for table in (tuning_cache.peek_table(key), tuning_cache.cached_table(key, measure)):
        assert table is not None and table.cached and table.version == TABLE_VERSION
        assert {role: str(c) for role, c in table.choices.items()} == legacy["choices"]
        assert table.choices["qkv"].pick(3) == "torch-int4" and table.choices["qkv"].pick(49) == "dense"
        assert (table.decode_attention, table.prefill_attention, table.attention_lookahead) == ("sdpa", "kernel", "on")
        assert table.samples == TABLE.samples and table.seconds == 12.5
    # an unversioned table that never measured the attention: the defaults the old reader took
    old = TuningTable.from_json({"choices": {"qkv": "dense"}})
    assert (old.decode_attention, old.prefill_attention, old.attention_lookahead) == ("kernel", "sdpa", "off")


def test_a_table_of_another_version_is_measured_again(key) -> None:
    newer = {**TABLE.to_json(), "version": TABLE_VERSION + 1}
    with pytest.raises(TableVersionError, match=f"version {TABLE_VERSION + 1}"):
        TuningTable.from_json(newer)
    table_file(key).parent.mkdir(parents=True, exist_ok=True)
    table_file(key).write_text(json.dumps({**newer, "key": asdict(key)}))
    assert tuning_cache.peek_table(key) is None
    calls: list[int] = []
    got = tuning_cache.cached_table(key, lambda: calls.append(1) or TABLE)
    assert calls == [1] and not got.cached
    assert json.loads(table_file(key).read_text())["version"] == TABLE_VERSION


def test_a_malformed_table_names_its_field() -> None:
    with pytest.raises(ValueError, match="decode_attention is 'gpu'"):
        TuningTable(choices={}, decode_attention="gpu")
    with pytest.raises(ValueError, match="unknown matmul form"):
        TuningTable.from_json({"version": TABLE_VERSION, "choices": {"qkv": "int9"}})
    with pytest.raises(ValueError, match="malformed field"):
        TuningTable.from_json({"version": TABLE_VERSION, "prompt_forms": {"qkv": {"min_rows": 2}}})


def test_serving_form_is_the_rule_written_out() -> None:
    choice = FormChoice.parse("torch-int4:3,int-gemm:48,dense")
    # (rows, prompt rows in the call) -> (form, rows it runs at), by hand
    no_prompt = {1: ("torch-int4", 1), 3: ("torch-int4", 3), 4: ("int-gemm", 4), 48: ("int-gemm", 48),
                 49: ("dense", 49), 10**6: ("dense", 10**6)}
    for rows, want in no_prompt.items():
        assert serving_form(choice, None, rows) == want
        assert serving_form(choice, None, rows, prompt_rows=True) == want  # no prompt form: by count
    prompt = PromptForm("int-gemm", 8)
    with_prompt = {  # decode rows only: by count, padded where the count picks the prompt form
        (1, False): ("torch-int4", 1), (4, False): ("int-gemm", 8), (7, False): ("int-gemm", 8),
        (8, False): ("int-gemm", 8), (49, False): ("dense", 49),
        # with prompt rows: the prompt form whatever the count, padded below its min_rows
        (1, True): ("int-gemm", 8), (3, True): ("int-gemm", 8), (49, True): ("int-gemm", 49),
        (10**6, True): ("int-gemm", 10**6)}
    for (rows, prompt_rows), want in with_prompt.items():
        assert serving_form(choice, prompt, rows, prompt_rows) == want, (rows, prompt_rows)


class Recording:
    """A stand-in form: records the rows of each call; its whole-step kind is ``kind``."""

    def __init__(self, kind: int, calls: list[tuple[int, int]]) -> None:
        self.kind, self.calls = kind, calls

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.calls.append((self.kind, x.shape[0]))
        return x.new_zeros(x.shape[0], 4)

    def decode_layers_args(self) -> tuple[int, list[torch.Tensor]]:
        return self.kind, []


class OneProjectionLayer:
    def __init__(self, lin: Linear) -> None:
        self.attn_norm = self.mlp_norm = torch.ones(8)
        self.lin = lin

    def projections(self) -> dict[str, Linear]:
        return {"qkv": self.lin}


def test_linear_and_the_whole_step_pack_take_the_same_form() -> None:
    """For every row count and kind of step, the form ``Linear`` calls is the one the whole-step
    pack holds, and the pack refuses exactly the calls ``Linear`` pads."""
    calls: list[tuple[int, int]] = []
    forms = {name: Recording(kind, calls) for kind, name in enumerate(("dense", "int-gemm", "torch-int4"))}
    lin = Linear(None, forms=forms, shape=(4, 8), choice=FormChoice.parse("torch-int4:3,int-gemm:48,dense"))
    for prompt in (None, PromptForm("int-gemm", 8), PromptForm("dense", 2)):
        lin.set_prompt_form(prompt)
        for rows in (1, 2, 3, 4, 7, 8, 9, 48, 49, 100):
            for prompt_rows in (False, True):
                calls.clear()
                assert lin(torch.zeros(rows, 8), prompt_rows).shape == (rows, 4)
                ((kind, ran),) = calls
                pack = KernelOps._pack([OneProjectionLayer(lin)], rows, prompt_rows)
                if ran != rows:  # padded: the operator cannot take it, the layer loop runs
                    assert pack == (), (prompt, rows, prompt_rows)
                else:
                    assert pack and pack[1] == [kind], (prompt, rows, prompt_rows)


def tiny_llama(where: Path) -> None:
    """A 2-layer Llama checkpoint of random float32 weights (config.json and safetensors)."""
    from safetensors.torch import save_file

    h, f, heads, kv, vocab = 64, 128, 4, 2, 96
    d = h // heads
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return 0.15 * torch.randn(*shape, generator=g)

    tensors = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": torch.ones(h), "lm_head.weight": w(vocab, h)}
    for i in range(2):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
                    p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
                    p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
                    p + "mlp.down_proj.weight": w(h, f), p + "input_layernorm.weight": torch.ones(h),
                    p + "post_attention_layernorm.weight": torch.ones(h)}
    where.mkdir()
    save_file(tensors, str(where / "model.safetensors"))
    (where / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": h,
        "intermediate_size": f, "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))


def test_lockgate_tune_prints_the_table_of_a_tiny_model(tmp_path) -> None:
    """``lockgate tune --json`` prints a ``TuningTable`` (it reads back as one) for every role, the
    table the cache now holds; the plain form, from the cache, names every role and the attention
    paths. float32 without the kernels: dense only, nothing to time, so it takes seconds."""
    tiny_llama(tmp_path / "model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LOCKGATE_TUNING_DIR": str(tmp_path / "tuning")}
    args = [sys.executable, "-m", "lockgate.cli", "tune", "--model", str(tmp_path / "model"), "--dtype", "float32",
            "--cpu-kernels", "off", "--log-level", "WARNING"]
    r = subprocess.run([*args, "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    printed = json.loads(r.stdout)
    assert printed["dtype"] == "float32" and printed["version"] == TABLE_VERSION
    table = TuningTable.from_json(printed)
    assert {role: str(c) for role, c in table.choices.items()} == dict.fromkeys(
        ("qkv", "o", "gate_up", "down", "head"), "dense")
    assert not table.cached and table.source.startswith("measured in ")
    assert table.decode_attention == "sdpa" and table.prompt_forms == {}  # no kernels: no attention kernel
    (stored,) = (tmp_path / "tuning").glob("forms-*.json")
    assert TuningTable.from_json(json.loads(stored.read_text())).choices == table.choices
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"matmul forms (cached {stored})" in r.stdout
    for role in ("qkv", "o", "gate_up", "down", "head"):
        assert f"  {role:<8} dense 1+" in r.stdout
    assert "decode attention: gathers + SDPA" in r.stdout and "prefill attention: SDPA" in r.stdout
