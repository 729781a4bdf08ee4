"""xgrammar vs llguidance on the default model's tokenizer: grammar compile time and the per-token
cost of building an allowed-token bitmask and advancing the grammar (issue 20's "pick by measurement").

For each engine and each grammar (JSON schemas of growing size, ``json_object``, a regex), it
measures the cold compile (first use of that grammar) and then walks the grammar token by token:
at every step it fills the row's bitmask, picks one allowed token with a seeded generator (the
same for both engines; a random walk touches many grammar states, not only one pretty instance),
and feeds it to the matcher. Reported: compile milliseconds, the median and p99 microseconds of
one mask fill, and of one token advance. One JSON line.

xgrammar is not a lockgate dependency: install it beside the venv to run this, e.g.
``pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi`` then
``PYTHONPATH=/tmp/xg .venv/bin/python benchmarks/grammar_engines.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from _common import command, machine

from lockgate.checkpoint.loader import prepare_model_dir

SCHEMAS: dict[str, Any] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "status": {"enum": ["active", "inactive", "banned"]},
            "owner": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4}},
                "required": ["name", "tags"]},
            "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 5},
            "active": {"type": "boolean"},
        },
        "required": ["id", "status", "owner"],
    },
}


def big_schema(n: int) -> dict[str, Any]:
    props = {f"field_{i}": ({"type": "string"} if i % 3 == 0 else {"type": "integer"} if i % 3 == 1
                           else {"type": "array", "items": {"type": "number"}, "maxItems": 3}) for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def walk(fill, advance, done, vocab: int, words: int, steps: int, seed: int) -> tuple[list[float], list[float], int]:
    rng = np.random.default_rng(seed)
    mask = np.zeros((1, words), dtype=np.int32)
    fills, advances = [], []
    for _ in range(steps):
        if done():
            break
        t0 = time.perf_counter()
        fill(mask)
        fills.append(time.perf_counter() - t0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab]
        allowed = np.flatnonzero(bits)
        if allowed.size == 0:
            break
        tok = int(rng.choice(allowed))
        t0 = time.perf_counter()
        ok = advance(tok)
        advances.append(time.perf_counter() - t0)
        assert ok, tok
    return fills, advances, len(fills)


def us(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return round(float(np.quantile(np.asarray(xs), q)) * 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--walks", type=int, default=5, help="random walks per grammar (different seeds)")
    args = ap.parse_args()

    model_dir = prepare_model_dir(args.model)
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    words = (vocab + 31) // 32
    grammars: dict[str, tuple[str, Any]] = {
        **{f"schema_{k}": ("schema", v) for k, v in SCHEMAS.items()},
        "schema_60_fields": ("schema", big_schema(60)),
        "json_object": ("schema", {"type": "object"}),
        "regex_phone": ("regex", r"\(\d{3}\) \d{3}-\d{4}"),
    }
    results: dict[str, Any] = {}

    # ---- llguidance
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    results["llguidance_tokenizer_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    for name, (kind, spec) in grammars.items():
        t0 = time.perf_counter()
        g = (llguidance.LLMatcher.grammar_from_json_schema(spec) if kind == "schema"
             else llguidance.LLMatcher.grammar_from_regex(spec))
        m = llguidance.LLMatcher(lltok, g)
        assert not m.is_error(), m.get_error()
        first = np.zeros((1, words), dtype=np.int32)
        lln.fill_next_token_bitmask(m, first)  # the lexer/parser tables are built lazily: count the first mask in the compile
        compile_ms = (time.perf_counter() - t0) * 1e3
        fills, advances, n = [], [], 0
        for w in range(args.walks):
            mw = llguidance.LLMatcher(lltok, g)
            f, a, k = walk(lambda mask, mw=mw: lln.fill_next_token_bitmask(mw, mask), lambda t, mw=mw: mw.consume_token(t),
                           lambda mw=mw: mw.is_stopped(), vocab, words, args.steps, seed=w)
            fills += f
            advances += a
            n += k
        results.setdefault(name, {})["llguidance"] = {
            "compile_ms": round(compile_ms, 2), "tokens": n, "fill_us_p50": us(fills, 0.5),
            "fill_us_p99": us(fills, 0.99), "advance_us_p50": us(advances, 0.5)}

    # ---- xgrammar
    try:
        import xgrammar as xgr
    except ImportError:
        results["xgrammar"] = "not installed (see the module docstring)"
    else:
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        results["xgrammar_tokenizer_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        import torch
        for name, (kind, spec) in grammars.items():
            t0 = time.perf_counter()
            cg = (compiler.compile_json_schema(json.dumps(spec)) if kind == "schema"
                  else compiler.compile_regex(spec))
            compile_ms = (time.perf_counter() - t0) * 1e3
            fills, advances, n = [], [], 0
            tmask0 = torch.zeros((1, words), dtype=torch.int32)
            for w in range(args.walks):
                mx = xgr.GrammarMatcher(cg)

                def fill(mask: np.ndarray, mx: Any = mx, tmask: Any = tmask0) -> None:
                    mx.fill_next_token_bitmask(tmask, 0)
                    mask[:] = tmask.numpy()

                f, a, k = walk(fill, lambda t, mx=mx: mx.accept_token(t), lambda mx=mx: mx.is_terminated(),
                               vocab, words, args.steps, seed=w)
                fills += f
                advances += a
                n += k
            results.setdefault(name, {})["xgrammar"] = {
                "compile_ms": round(compile_ms, 2), "tokens": n, "fill_us_p50": us(fills, 0.5),
                "fill_us_p99": us(fills, 0.99), "advance_us_p50": us(advances, 0.5)}

    print(json.dumps({"benchmark": "grammar_engines", "command": command(), "machine": machine(),
                      "vocab": vocab, "results": results}))


if __name__ == "__main__":
    main()
