"""``lockgate bench``: measure any OpenAI-compatible server; ``lockgate bench compare``: read results.

Owns the command's flags and its steps, in order: check the flags, ask the server its model
and context (``GET /v1/models``), load the tokenizer (``tokens.py``), build the workload
(``workloads.py``, before the clock starts), warm up, run the load (``client.py``) under a
progress bar, then print the table, write the JSON and the charts (``report.py``).

Exit codes: 0 done (even with failed requests, which the report counts), 1 the server could
not be reached, the warm-up request failed or every request failed, 2 bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from lockgate.bench.workloads import DEFAULTS, WORKLOADS, Workload, WorkloadSpec, check_spec

if TYPE_CHECKING:
    from lockgate.bench.client import LoadConfig, RunResult

log = logging.getLogger("lockgate.bench")
DEFAULT_NUM_REQUESTS = 100
WARMUP_PROMPT = "Warm-up request: please write one short sentence about the weather."


class BenchError(Exception):
    """A failure to report in one line; ``code`` is the exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def add_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions (raw prompt) or /v1/chat/completions (messages)")
    g.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    g.add_argument("--api-key", default=os.environ.get("LOCKGATE_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default $LOCKGATE_API_KEY)")
    g.add_argument("--tokenizer", default="auto",
                   help="counts prompt tokens: auto (the server's /tokenize), sim, default, a .gguf file or a "
                        "tokenizer directory (default %(default)s)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds a request may wait for its next chunk")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="request mix: random lengths, ShareGPT-like lengths, mixed short/long outputs, "
                        "groups sharing a prompt prefix, or multi-turn conversations")
    w.add_argument("--num-requests", type=int, default=None,
                   help="requests to send (default 100; shared-prefix: groups x prompts-per-group)")
    w.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    w.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens (random 256, mixed 256; multi-turn: each new user message, 128)")
    w.add_argument("--output-len", type=int, default=None,
                   help="tokens to generate (random 128, shared-prefix 128, multi-turn 128; mixed: the long half, 512)")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="random/mixed: lengths uniform in [L(1-r), L(1+r)] (default 0: fixed)")
    w.add_argument("--groups", type=int, default=None, help="shared-prefix: prefix groups (default 4)")
    w.add_argument("--prompts-per-group", type=int, default=None,
                   help="shared-prefix: requests per group (default num-requests / groups)")
    w.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: shared prefix tokens (default 256)")
    w.add_argument("--suffix-len", type=int, default=None, help="shared-prefix: unique suffix tokens (default 64)")
    w.add_argument("--turns", type=int, default=None, help="multi-turn: turns per conversation (default 4)")

    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", type=float, default=float("inf"),
                    help="mean requests/s (conversations/s for multi-turn); inf = all at once (default)")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the inter-arrival gaps: 1 Poisson, <1 burstier, >1 steadier")
    ld.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    ld.add_argument("--warmup-requests", type=int, default=1, help="short requests sent before the clock starts")
    ld.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request (0 = greedy)")
    ld.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="send ignore_eos and min_tokens = max_tokens so outputs have the asked length")

    o = p.add_argument_group("report")
    o.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    o.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    o.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    o.add_argument("--plot", action="store_true", help="PNG charts next to --out (needs matplotlib)")
    o.add_argument("--label", default=None, help="name of this run in 'compare' (default: the --out file name)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")

    sub = p.add_subparsers(dest="bench_command", metavar="{compare}")
    cmp = sub.add_parser("compare", help="print saved results side by side, with ratios to the first")
    cmp.add_argument("files", nargs="+", type=Path, help="result JSON files from --out")


def run_bench(ns: argparse.Namespace, argv: list[str]) -> int:
    for noisy in ("httpx", "httpcore"):  # one INFO line per request would bury the progress bar
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        if ns.bench_command == "compare":
            return compare(ns.files)
        return _run(ns, argv)
    except BenchError as e:
        print(f"lockgate bench: error: {e}", file=sys.stderr)
        return e.code
    except ValueError as e:
        print(f"lockgate bench: error: {e}", file=sys.stderr)
        return 2


def compare(files: list[Path]) -> int:
    from lockgate.bench.report import format_compare

    results, labels = [], []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise BenchError(f"cannot read {f}: {e}", 2) from None
        if not isinstance(data, dict) or not {"summary", "config", "workload"} <= data.keys():
            raise BenchError(f"{f} is not a lockgate bench result (no summary, config and workload)", 2)
        results.append(data)
        labels.append(data["config"].get("label") or f.stem)
    print(format_compare(results, labels))
    return 0


def _check_flags(ns: argparse.Namespace) -> None:
    if ns.request_rate <= 0:
        raise ValueError(f"--request-rate must be positive (inf for all at once), got {ns.request_rate}")
    if ns.burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {ns.burstiness}")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {ns.max_concurrency}")
    if ns.warmup_requests < 0:
        raise ValueError(f"--warmup-requests must be >= 0, got {ns.warmup_requests}")
    if ns.timeout <= 0:
        raise ValueError(f"--timeout must be positive (seconds to wait for the next bytes), got {ns.timeout}")
    if ns.plot:
        from lockgate.bench.report import MATPLOTLIB_MISSING, have_matplotlib

        if ns.out is None:
            raise ValueError("--plot writes the charts next to the result JSON: give --out too")
        if not have_matplotlib():
            raise ValueError(MATPLOTLIB_MISSING)


def _num_requests(ns: argparse.Namespace) -> int:
    if ns.workload != "shared-prefix" or ns.prompts_per_group is None:
        return int(ns.num_requests if ns.num_requests is not None else DEFAULT_NUM_REQUESTS)
    n = (ns.groups or DEFAULTS["shared-prefix"]["groups"]) * ns.prompts_per_group
    if ns.num_requests is not None and ns.num_requests != n:
        raise ValueError(f"shared-prefix sends --groups x --prompts-per-group = {n} requests, not "
                         f"--num-requests {ns.num_requests}: give one or the other")
    return n


def _server_info(url: str, headers: dict[str, str]) -> dict[str, Any]:
    """The server's first model and its context length, from GET /v1/models."""
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {url}: {e}") from None
    if r.status_code != 200:
        raise BenchError(f"GET {url}/v1/models answered {r.status_code}: {r.text[:300]}")
    data = r.json().get("data") or []
    first = data[0] if data else {}
    return {"models": [m.get("id") for m in data], "model": first.get("id"),
            "max_model_len": first.get("max_model_len")}


def _run(ns: argparse.Namespace, argv: list[str]) -> int:
    from lockgate.bench.client import LoadConfig, warmup
    from lockgate.bench.report import build_result, format_table, plot
    from lockgate.bench.tokens import load_bench_tokenizer
    from lockgate.bench.workloads import build_workload

    _check_flags(ns)
    num_requests = _num_requests(ns)
    spec = WorkloadSpec(ns.workload, num_requests, ns.input_len, ns.output_len, ns.range_ratio, ns.groups,
                        ns.prompts_per_group, ns.prefix_len, ns.suffix_len, ns.turns)
    check_spec(spec)  # a bad knob fails here, before the server is asked anything
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    server = _server_info(ns.url, headers)
    model = ns.model or server["model"]
    if model is None:
        raise BenchError(f"{ns.url}/v1/models lists no model; pass --model")
    if ns.model is not None and server["models"] and ns.model not in server["models"]:
        raise BenchError(f"--model {ns.model!r}: the server serves {', '.join(map(str, server['models']))}", 2)
    ctx = server["max_model_len"] if isinstance(server["max_model_len"], int) else None
    spec = dataclasses.replace(spec, max_model_len=ctx)
    tok = load_bench_tokenizer(ns.tokenizer, ns.url, model, headers)
    log.info("building %d prompts (%s workload, tokenizer %s)", num_requests, ns.workload, tok.name)
    try:
        workload = build_workload(spec, tok, ns.seed)
    finally:
        close = getattr(tok, "close", None)
        if close is not None:
            close()
    cfg = LoadConfig(url=ns.url, endpoint=ns.endpoint, model=model, headers=headers, request_rate=ns.request_rate,
                     burstiness=ns.burstiness, max_concurrency=ns.max_concurrency, seed=ns.seed,
                     temperature=ns.temperature, ignore_eos=ns.ignore_eos, timeout=ns.timeout)
    if ns.warmup_requests:
        for rec in asyncio.run(warmup(cfg, WARMUP_PROMPT, ns.warmup_requests)):
            if not rec.success:
                raise BenchError(f"the warm-up request to {ns.url}{cfg.path} failed: {rec.error}")
    run = asyncio.run(_with_progress(cfg, workload, not ns.no_progress))

    config = {"url": ns.url, "endpoint": ns.endpoint, "model": model, "tokenizer": tok.name,
              "request_rate": None if ns.request_rate == float("inf") else ns.request_rate,
              "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency, "seed": ns.seed,
              "num_requests": workload.num_requests, "temperature": ns.temperature, "ignore_eos": ns.ignore_eos,
              "warmup_requests": ns.warmup_requests, "label": ns.label or (ns.out.stem if ns.out else None)}
    result = build_result(run, config=config, workload={"name": workload.name, "params": workload.params},
                          server=server, command=shlex.join(["lockgate", *argv]),
                          slo_ttft_ms=ns.slo_ttft_ms, slo_tpot_ms=ns.slo_tpot_ms)
    print(format_table(result), flush=True)
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {ns.out}")
        if ns.plot:
            for path in plot(result, ns.out):
                print(f"wrote {path}")
    return 1 if result["summary"]["completed"] == 0 else 0


async def _with_progress(cfg: LoadConfig, workload: Workload, show: bool) -> RunResult:
    from tqdm import tqdm

    from lockgate.bench.client import run_load

    with tqdm(total=workload.num_requests, desc="bench", unit="req", disable=not show, file=sys.stderr,
              dynamic_ncols=True) as bar:
        return await run_load(cfg, workload, on_done=lambda rec: bar.update(1))
