"""``lockgate eval perplexity``: the figure it prints is the model's perplexity, computed
independently by transformers on the same tokens; its exact path agrees with itself; the int8
activation tier is scored on the code that serves it; bad flags are one-line errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from lockgate.config import CacheConfig, EngineConfig, ModelConfig
from lockgate.eval import DEFAULT_TEXT_NAME, default_text, perplexity_report


def test_default_text_is_the_public_domain_book_long_enough() -> None:
    text = default_text()
    assert text.lstrip().startswith("In the beginning God created the heaven and the earth.")
    assert len(text) > 4_000_000  # ~1M tokens; the default scores its first 24,576


def test_perplexity_is_transformers_perplexity_on_the_same_tokens(hf_reference) -> None:
    # float32, dense weights (explicit --dtype float32): the exact path. Windows of 96 tokens fed in
    # chunks of 32 (later chunks read the pool), against transformers scoring each window whole.
    cfg = EngineConfig(model=ModelConfig(model="default", dtype="float32"))
    text = default_text()[:3000]
    report = perplexity_report(cfg, text, "kjv", max_tokens=300, window=96, chunk=32, reference="exact")
    assert report["top1_agreement"] == 1.0 and report["perplexity_ratio"] == 1.0  # the same path twice
    from transformers import AutoTokenizer

    from lockgate.checkpoint.loader import prepare_model_dir

    ids = AutoTokenizer.from_pretrained(str(prepare_model_dir("default")))(text).input_ids[:300]
    assert report["tokens"] == 300 and report["scored"] == sum(len(ids[w:w + 96]) - 1 for w in range(0, 299, 96))
    nll = []
    with torch.no_grad():
        for w in range(0, len(ids) - 1, 96):
            win = torch.tensor([ids[w:w + 96]])
            lp = torch.log_softmax(hf_reference(win).logits[0, :-1].double(), -1)
            nll.append(-lp.gather(1, win[0, 1:, None])[:, 0])
    want = math.exp(float(torch.cat(nll).mean()))
    assert report["perplexity"] == pytest.approx(want, rel=1e-4)
    assert 1 < want < 100  # a real model reading English


def test_int8_activation_tier_is_measured_against_the_exact_path() -> None:
    cfg = EngineConfig(model=ModelConfig(model="default", activation_quant="int8"))
    report = perplexity_report(cfg, default_text()[:2000], "kjv", max_tokens=256, window=128, chunk=64,
                               reference="exact")
    assert report["config"]["activation_quant"] == "int8"
    assert report["reference"]["config"]["activation_quant"] == "none"
    assert report["perplexity"] != report["reference"]["perplexity"]  # the tier changes the numbers...
    assert 0.8 < report["top1_agreement"] < 1.0 and 0.9 < report["perplexity_ratio"] < 1.1  # ...a little


def test_int8_kv_tier_is_measured_against_the_exact_pool() -> None:
    cfg = EngineConfig(model=ModelConfig(model="default"), cache=CacheConfig(kv_cache_dtype="int8"))
    report = perplexity_report(cfg, default_text()[:2000], "kjv", max_tokens=256, window=128, chunk=64,
                               reference="exact")
    assert report["config"]["kv_cache_dtype"] == "int8"
    assert report["reference"]["config"]["kv_cache_dtype"] in ("float32", "bfloat16")
    assert report["perplexity"] != report["reference"]["perplexity"]
    assert 0.8 < report["top1_agreement"] <= 1.0 and 0.95 < report["perplexity_ratio"] < 1.05


@pytest.mark.parametrize(("flags", "says"), [
    (["--window", "1"], "--window must be >= 2"),
    (["--chunk", "512", "--window", "256"], "--chunk (512) must be at most --window (256)"),
    (["--text", "/nonexistent/book.txt"], "No such file"),
    (["--model", "sim"], "--model sim has no logits to score"),
])
def test_bad_flags_are_one_line_errors(flags: list[str], says: str) -> None:
    r = subprocess.run([sys.executable, "-m", "lockgate.cli", "eval", "perplexity", *flags],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_command_prints_one_json_line(tmp_path) -> None:
    (tmp_path / "t.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    r = subprocess.run([sys.executable, "-m", "lockgate.cli", "eval", "perplexity", "--model", "default",
                        "--text", str(tmp_path / "t.txt"), "--max-tokens", "64", "--window", "64", "--chunk", "32",
                        "--reference", "none"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["text"] == str(tmp_path / "t.txt") != DEFAULT_TEXT_NAME and out["scored"] == 63
    assert "reference" not in out and out["perplexity"] < 20  # a repeated sentence is easy to predict
