"""The measured kernel choice (lockgate.runner.tuning): how figures become a table, how the
cache is keyed and shared, and the real measurement on the default model through
``lockgate tune``.

The decision tests feed synthetic per-round figures to the pure functions (``winner``,
``decide``, ``decide_dtype``, ``decide_attention``): what a noisy host could produce, with a
known right answer. The measurement itself is real (real model, real kernels, this CPU); its
outcome depends on the CPU, so those tests check properties every outcome must have.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from lockgate.kernel_choice import FormChoice
from lockgate.layers.linear import Linear
from lockgate.runner import tuning, tuning_attention, tuning_cache


def test_winner_takes_the_fastest_unless_a_more_exact_form_is_within_noise() -> None:
    # int-gemm is 30% faster in every round: it wins over dense
    assert tuning.winner({"dense": [1.0, 1.1, 0.9], "int-gemm": [0.7, 0.77, 0.63]}) == "int-gemm"
    # 3% faster (paired): within the 5% margin, the more exact (earlier in FORM_NAMES) form stays
    assert tuning.winner({"dense": [1.0, 1.2, 0.8], "int-gemm": [0.97, 1.164, 0.776]}) == "dense"
    # a host that slowed down in the second timing round for everyone: pairing by round keeps the verdict
    assert tuning.winner({"dense": [1.0, 3.0, 1.0], "int-gemm": [0.5, 1.5, 0.5]}) == "int-gemm"
    # one lucky round does not make a winner: the median paired ratio decides
    assert tuning.winner({"dense": [1.0, 1.0, 1.0], "torch-int4": [0.5, 1.02, 1.01]}) == "dense"
    # oneDNN 3% faster than lockgate's bf16 kernel: a tie, and the tie goes to the kernel (the same
    # products, row-invariant where oneDNN is not)
    assert tuning.winner({"dense": [0.97, 0.97, 0.98], "bf16-gemm": [1.0, 1.0, 1.0]}) == "bf16-gemm"
    assert tuning.winner({"dense": [0.8, 0.8, 0.8], "bf16-gemm": [1.0, 1.0, 1.0]}) == "dense"
    # among quantized forms, group-quant (exact float32 math) is preferred over torch-int4 (bf16 x)
    assert tuning.winner({"group-quant": [1.0, 1.0, 1.0], "torch-int4": [0.98, 0.99, 0.97]}) == "group-quant"


def test_decide_builds_row_ranges_and_smooths_one_point_islands() -> None:
    def figures(ms: dict[str, list[float]]) -> dict[str, dict[str, list[float]]]:
        points = [1, 2, 4, 8, 16, 32, 64]
        return {f: {str(p): [v] * 3 for p, v in zip(points, vals, strict=True)} for f, vals in ms.items()}

    samples = {"qkv": figures({"dense": [10, 10, 10, 10, 10, 12, 14],
                               "int-gemm": [2, 3, 4, 6, 9, 13, 20]}),
               # o: int-gemm wins 1-8, loses by 8% at 16 (an island between two int-gemm points: within
               # 2x the margin, smoothed), then loses for good
               "o": figures({"dense": [10, 10, 10, 10, 10, 10, 10],
                             "int-gemm": [2, 3, 4, 6, 10.8, 9, 30]})}
    got = tuning.decide(samples)
    assert str(got["qkv"]) == "int-gemm:16,dense"
    assert got["qkv"].pick(17) == "dense" and got["qkv"].pick(10**5) == "dense" and got["qkv"].pick(9) == "int-gemm"
    assert str(got["o"]) == "int-gemm:32,dense"


def test_decide_keeps_a_real_island() -> None:
    points = [1, 2, 4]
    samples = {"down": {"dense": {str(p): [v] * 3 for p, v in zip(points, [10, 10, 10], strict=True)},
                        "int-gemm": {str(p): [v] * 3 for p, v in zip(points, [5, 20, 5], strict=True)}}}
    assert str(tuning.decide(samples)["down"]) == "int-gemm:1,dense:2,int-gemm"


def test_dtype_decision_needs_bf16_faster_everywhere() -> None:
    fast = {"64": {"bfloat16/dense": [1.0, 1.1, 1.0], "float32/dense": [3.0, 3.3, 3.0], "float32/int-gemm": [2.0] * 3},
            "256": {"bfloat16/dense": [4.0] * 3, "float32/dense": [12.0] * 3, "float32/int-gemm": [9.0] * 3}}
    assert tuning.decide_dtype(fast) == "bfloat16"
    close = {**fast, "256": {"bfloat16/dense": [4.0] * 3, "float32/dense": [12.0] * 3, "float32/int-gemm": [4.2] * 3}}
    assert tuning.decide_dtype(close) == "float32"  # 5% faster than the integer GEMM: not worth bf16's rounding
    emulated = {"64": {"bfloat16/dense": [25.0] * 3, "float32/dense": [5.0] * 3}}  # stopped after one point
    assert tuning.decide_dtype(emulated) == "float32"
    assert tuning.decide_dtype({}) == "float32"


def test_attention_decision_prefers_the_kernel() -> None:
    assert tuning_attention.decide_attention({"kernel": [10.0] * 3, "sdpa": [8.5] * 3}) == "kernel"  # 15% is not enough
    assert tuning_attention.decide_attention({"kernel": [10.0] * 3, "sdpa": [7.0] * 3}) == "sdpa"
    assert tuning_attention.decide_attention({}) == "sdpa"  # no kernel built


def test_lookahead_decision_needs_a_paired_gain_beyond_noise() -> None:
    """The attention kernel's look-ahead is on only when the paired rounds say it is at least
    LOOKAHEAD_MARGIN faster; within noise, slower, or unmeasured: off (the plainer schedule)."""
    assert tuning_attention.decide_attention_lookahead({"off": [10.0, 11.0, 10.5], "on": [9.0, 9.9, 9.5]}) == "on"
    assert tuning_attention.decide_attention_lookahead({"off": [10.0, 11.0, 10.5], "on": [9.9, 10.9, 10.4]}) == "off"  # 1%
    assert tuning_attention.decide_attention_lookahead({"off": [10.0] * 3, "on": [12.0] * 3}) == "off"
    assert tuning_attention.decide_attention_lookahead({}) == "off"
    # paired: a drift of the host that hits both sides alike does not decide it
    assert tuning_attention.decide_attention_lookahead({"off": [10.0, 20.0, 10.0], "on": [9.5, 19.0, 9.5]}) == "on"


def test_lookahead_is_measured_only_where_it_can_change_something() -> None:
    """A float32 pool never takes the AVX512-BF16 path the look-ahead belongs to: nothing to time.
    On a bf16 pool where the build has that path, both settings are timed, paired, and the switch
    is left as it was."""
    from lockgate import kernels

    assert kernels.load(), kernels.error()
    assert tuning_attention.measure_attention_lookahead(9, 3, 64, torch.float32, layers=2) == {}
    if not torch.ops.lockgate.bf16_linear_available():
        assert tuning_attention.measure_attention_lookahead(9, 3, 64, torch.bfloat16, layers=2) == {}
        return
    before = torch.ops.lockgate.set_attention_lookahead(True)
    try:
        times = tuning_attention.measure_attention_lookahead(9, 3, 64, torch.bfloat16, layers=2, rounds=3)
        assert torch.ops.lockgate.set_attention_lookahead(True) is True  # left as it was
    finally:
        torch.ops.lockgate.set_attention_lookahead(before)
    assert set(times) == {"off", "on"} and all(len(ts) == 3 and min(ts) > 0 for ts in times.values())


def _grid(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    step = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    return (codes * step - 7.5 * step).view(n, k)


class _Spin:
    """A stand-in form that takes a known time (busy-waiting: no sleep granularity): ``fixed`` ms
    plus ``per_row`` ms per row of x of this thread's CPU time. Timed on that clock too
    (``tuning.CLOCK``), its figures are exact on a busy host, where a wall-clock deadline and timer
    counted whole preemptions in some calls and not others. The timing loop cannot tell it from a
    kernel."""

    def __init__(self, name: str, fixed: float, per_row: float) -> None:
        self.name, self.fixed, self.per_row = name, fixed, per_row
        self.calls = 0

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.calls += 1
        end = time.thread_time() + 1e-3 * (self.fixed + self.per_row * x.shape[0])
        while time.thread_time() < end:
            pass
        return x.new_zeros(x.shape[0], 64)


def test_measure_forms_times_every_form_and_prunes_hopeless_ones(monkeypatch) -> None:
    monkeypatch.setattr(tuning, "CLOCK", time.thread_time)
    # Forms with known costs (CPU time they burn themselves, timed on that clock):
    # "int-gemm" wins up to 4 rows, "dense" beyond; "group-quant" is hopeless, grows linearly and
    # must stop being timed once that is clear, and never come back.
    forms = {"dense": _Spin("dense", 0.1, 0.0), "int-gemm": _Spin("int-gemm", 0.0, 0.02),
             "group-quant": _Spin("group-quant", 0.0, 0.5)}
    lins = []
    for i in range(3):
        lin = Linear(_grid(64, 96, seed=i))
        lin.forms = dict(forms)  # type: ignore[arg-type]
        lins.append(lin)
    points = (1, 2, 4, 8, 16, 32)
    samples = tuning.measure_forms({"qkv": lins}, torch.float32, points=points, rounds=5)
    got = samples["qkv"]
    assert set(got) == {"dense", "int-gemm", "group-quant"}
    assert all(len(got["dense"][str(p)]) == 5 for p in points)  # dense is never pruned
    slow = sorted(int(p) for p in got["group-quant"])
    assert slow == [1, 2]  # 5x the best at 1 row; at 2 rows twice that: linear, pruned
    # at 16 rows 3.2x dense and doubled since 8: not timed at 32
    assert sorted(int(p) for p in got["int-gemm"]) == [1, 2, 4, 8, 16]
    for p in points:  # every figure is what the form costs, up to timer noise
        assert min(got["dense"][str(p)]) == pytest.approx(0.1, rel=0.5)
    assert str(tuning.decide(samples)["qkv"]) == "int-gemm:4,dense"


def test_cpu_description_names_family_and_model_so_look_alike_cpus_do_not_share_a_cache() -> None:
    """A hypervisor shows Zen 4 and Zen 5 parts both as "AMD EPYC" with nearly the same flags;
    the family and model numbers tell them apart."""
    def info(family: int, model: int) -> str:
        return (f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
                f"model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu avx512f avx512_bf16\n\n"
                f"processor\t: 1\ncpu family\t: 99\nmodel\t\t: 99\nflags\t\t: fpu\n")

    zen4, zen5 = tuning_cache.cpu_description(info(25, 17)), tuning_cache.cpu_description(info(26, 2))
    assert zen4 == {"cpu": "AMD EPYC (family 25, model 17, stepping 1)", "flags": "fpu avx512f avx512_bf16"}
    assert zen5["cpu"] == "AMD EPYC (family 26, model 2, stepping 1)" and zen5["flags"] == zen4["flags"]
    # without the numbers (another OS, another architecture) the name stands alone
    assert tuning_cache.cpu_description("model name\t: Some CPU\nflags\t: a b\n") == {"cpu": "Some CPU", "flags": "a b"}


def test_torch_isa_switches_enter_the_key(monkeypatch) -> None:
    for name in tuning_cache.ISA_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert tuning_cache.torch_build() == torch.__version__  # a plain start: the key it always had
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert tuning_cache.torch_build() == f"{torch.__version__} ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2"


def test_cache_is_keyed_shared_and_survives_garbage(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(tmp_path))
    key = tuning_cache.TuningKey(kind="forms", cpu="cpu", flags="avx2", threads=2, torch="t", kernels="k",
                           shape={"hidden": 8}, dtype="float32",
                           weights={"checkpoint": "abc", "quantization": "auto", "fp32": False})
    calls = []
    # a key never measured: peek says so and leaves nothing behind (no table, no lock file)
    assert tuning_cache.peek(key) is None and not (tmp_path / "tuning").exists()

    def measure() -> dict:
        calls.append(1)
        time.sleep(0.2)  # long enough for the other thread to queue on the lock
        return {"choices": {"qkv": "int-gemm:8,dense"}}

    results = []
    threads = [threading.Thread(target=lambda: results.append(tuning_cache.cached(key, measure))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1  # the second waited for the first and read its result
    assert sorted(hit for _, hit in results) == [False, True]
    assert all(data["choices"] == {"qkv": "int-gemm:8,dense"} for data, _ in results)
    peeked = tuning_cache.peek(key)
    assert peeked is not None and peeked["choices"] == {"qkv": "int-gemm:8,dense"}
    # another thread count is another key; a corrupt file is measured again; refresh measures again
    other = tuning_cache.TuningKey(**{**key.__dict__, "threads": 1})
    assert other.digest() != key.digest()
    path = tmp_path / "tuning" / f"forms-{key.digest()}.json"
    path.write_text("{not json")
    assert tuning_cache.cached(key, measure)[1] is False and len(calls) == 2
    assert tuning_cache.cached(key, measure)[1] is True
    assert tuning_cache.cached(key, measure, refresh=True)[1] is False and len(calls) == 3
    stored = json.loads(path.read_text())
    assert stored["key"]["flags"] == "avx2" and stored["key"]["version"] == tuning_cache.TUNING_VERSION


def test_lockgate_tune_measures_the_default_model_and_the_runner_follows_it(tmp_path, monkeypatch) -> None:
    """``lockgate tune`` on the real model (real kernels, this CPU), into an empty tuning cache of
    its own (the user's table, measured on a quiet machine, is left alone): a table for every role
    whose every span names a form the projections have, every figure positive, and the cache then
    holds what an engine on the same settings uses."""
    monkeypatch.setenv("LOCKGATE_TUNING_DIR", str(tmp_path))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "lockgate.cli", "tune", "--model", "default",
                        "--json", "--log-level", "WARNING"], capture_output=True, text=True, env=env, timeout=900)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(r.stdout)
    assert data["dtype"] in ("float32", "bfloat16")
    assert set(data["choices"]) == {"qkv", "o", "gate_up", "down", "head"}
    assert data["cached"] is False and 0 < data["seconds"] < took
    samples = data["samples"]
    for role, text in data["choices"].items():
        choice = FormChoice.parse(text)
        if role not in samples:  # one form only (the GGUF's blocks on the integer GEMM): nothing to compare
            assert choice.names() == set(data["forms"][role]) and len(data["forms"][role]) == 1, (role, data["forms"])
            continue
        assert choice.names() <= set(samples[role])  # only forms that were measured
        assert all(t > 0 for by_p in samples[role].values() for ts in by_p.values() for t in ts)
        assert all("1" in by_p for by_p in samples[role].values())
    assert data["decode_attention"] in ("kernel", "sdpa")
    assert data["attention_lookahead"] in ("on", "off")
    if data["attention_lookahead"] == "on":  # only ever chosen by a measurement that favoured it
        look = data["attention_lookahead_ms"]
        assert tuning_attention.decide_attention_lookahead(look) == "on" and data["decode_attention"] == "kernel"
    # prompt rows: a row-invariant form for every role (the integer GEMM always qualifies where it
    # is built), or the reason there is none
    if data["prompt_forms"]:
        assert set(data["prompt_forms"]) == set(data["choices"]) and data["prefill_attention"] == "kernel"
        assert all(p["form"] in data["forms"][role] and p["min_rows"] >= 1 for role, p in data["prompt_forms"].items())
    else:
        assert "by row count" in data["exact_prefill"]
    assert len(list(tmp_path.glob("forms-*.json"))) == 1 and len(list(tmp_path.glob("dtype-*.json"))) == 1
    assert len(list(tmp_path.glob("rows-*.json"))) == 1
    # the human-readable form names the CPU and every role, from the cache this time
    r2 = subprocess.run([sys.executable, "-m", "lockgate.cli", "tune", "--model", "default", "--log-level", "WARNING"],
                        capture_output=True, text=True, env=env, timeout=600)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "cached" in r2.stdout and "threads" in r2.stdout and "prompt rows" in r2.stdout
    for role in ("qkv", "o", "gate_up", "down", "head"):
        assert f"  {role} " in r2.stdout
    # an engine with the same settings reads that table
    import lockgate.models.decoder as llama
    from lockgate.config import CacheConfig, ModelConfig
    from lockgate.runner.model_runner import ModelRunner

    built: list[tuple[set[str] | None, set[str]]] = []  # (forms asked for, forms made) per projection
    make_forms = llama.make_forms

    def spy(*a, **kw):
        forms = make_forms(*a, **kw)
        built.append((kw.get("want"), set(forms)))
        return forms

    packed_forms = llama.packed_forms

    def spy_packed(qm, kernels, want=None):
        forms = packed_forms(qm, kernels, want)
        built.append((want, set(forms)))
        return forms

    monkeypatch.setattr(llama, "make_forms", spy)
    monkeypatch.setattr(llama, "packed_forms", spy_packed)  # a GGUF's projections, kept in their blocks
    runner = ModelRunner(ModelConfig(model="default"), CacheConfig(max_total_tokens=64))
    table = runner.paths.table
    assert table.cached is True and {role: str(c) for role, c in table.choices.items()} == data["choices"]
    assert table.attention_lookahead == data["attention_lookahead"]
    on = data["attention_lookahead"] == "on"
    assert torch.ops.lockgate.set_attention_lookahead(on) is on  # the process runs what the table says
    called = set()
    for role, lins in runner.model.projections().items():
        prompt = {data["prompt_forms"][role]["form"]} if data["prompt_forms"] else set()
        assert all(str(lin.choice) == data["choices"][role] for lin in lins)
        assert all(set(lin.forms) <= lin.choice.names() | {"dense"} | prompt for lin in lins)
        assert all((lin.prompt.name if lin.prompt else None) == next(iter(prompt), None) for lin in lins)
        called |= FormChoice.parse(data["choices"][role]).names() | prompt
    # the stored table was read before the weights: no form it never calls was even built (a GGUF's
    # blocks get their one default form, want None, which is the table's: one form, nothing to choose)
    assert len(built) == 4 * runner.model.args.num_layers + 1
    assert all((want is not None and made <= want) or (want is None and len(made) == 1) for want, made in built)
    assert set().union(*(made for _, made in built)) <= called


def test_checkpoint_fingerprint_follows_content_not_place(tmp_path) -> None:
    from safetensors.numpy import save_file

    from lockgate.checkpoint.loader import checkpoint_fingerprint

    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((256, 256), dtype=np.float32), "b": np.zeros(8, np.float32)}
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"model_type": "llama"}')
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
    first = checkpoint_fingerprint(tmp_path / "one")
    assert first == checkpoint_fingerprint(tmp_path / "two")  # another place, same content
    save_file({**tensors, "a": tensors["a"] + 1}, str(tmp_path / "two" / "model.safetensors"))
    assert checkpoint_fingerprint(tmp_path / "two") != first  # other values, same header
    (tmp_path / "one" / "config.json").write_text('{"model_type": "qwen2"}')
    assert checkpoint_fingerprint(tmp_path / "one") != first


def test_tune_rejects_bad_input() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for args, msg in ((["--model", "sim"], "no kernels to tune"), (["--model", "/nope"], "not 'default'"),
                      (["--matmul-forms", "int9"], "unknown matmul form")):
        r = subprocess.run([sys.executable, "-m", "lockgate.cli", "tune", *args], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_one_form_cost_sums_the_measured_points_and_bounds_pruned_ones() -> None:
    """--deterministic picks one form per role by what serving every call on it costs: the sum of
    its medians over the measured row counts, a pruned point counted at PRUNE_RATIO x the fastest."""
    from lockgate.runner.tuning import PRUNE_RATIO, one_form_cost

    samples = {"dense": {"1": [0.05, 0.05], "64": [0.2], "512": [1.0]},
               "int-gemm": {"1": [0.02], "64": [0.3]}}  # pruned at 512 rows
    assert one_form_cost(samples, "dense") == pytest.approx(1.25)
    assert one_form_cost(samples, "int-gemm") == pytest.approx(0.02 + 0.3 + PRUNE_RATIO * 1.0)
    assert one_form_cost(samples, "dense") < one_form_cost(samples, "int-gemm")
