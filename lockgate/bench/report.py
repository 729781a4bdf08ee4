"""Benchmark results: the JSON document, the table printed at the end, ``compare``, and the charts.

Owns the shape of a ``lockgate bench`` result (``build_result``): ``summary`` (the numbers a
reader compares), ``config`` / ``workload`` / ``server`` (what was measured), ``command``,
``machine``, wall-clock ``started_at`` / ``finished_at``, ``warnings`` and ``requests`` (one
record per request, failed ones included, with its inter-token gaps). ``compare`` and
``--plot`` read only that document, so they work on saved files too.

Counting conventions: totals and throughputs count successful requests only; input tokens
are the client's count of the prompt text (the same for every server given the same
workload and tokenizer); the server's own ``usage.prompt_tokens`` (chat template and special
tokens included) is kept next to it as ``server_prompt_tokens``. Latencies are milliseconds,
percentiles by linear interpolation (``stats.summarize_ms``).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from lockgate.bench.client import RequestRecord, RunResult
from lockgate.bench.stats import goodput, summarize_ms

FORMAT_VERSION = 1
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))


def machine_info() -> dict[str, Any]:
    try:
        version = importlib.metadata.version("lockgate")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "lockgate": version}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")


def summarize(records: list[RequestRecord], duration: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, max_in_flight: int | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    n_in = sum(r.input_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    server_prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    per_s = (lambda x: round(x / duration, 2)) if duration > 0 else (lambda x: 0.0)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok]
    out: dict[str, Any] = {
        "duration_s": round(duration, 3), "num_requests": len(records), "completed": len(ok),
        "failed": len(failed), "first_error": failed[0].error if failed else None,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "server_prompt_tokens": sum(server_prompt) if server_prompt else None,
        "cached_prompt_tokens": sum(cached) if cached else None,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(n_out),
        "total_token_throughput": per_s(n_in + n_out),
        "max_in_flight": max_in_flight,
        "short_outputs": sum(r.output_tokens < r.output_len for r in ok),
        "outputs_counted_from_usage": sum(r.tokens_from == "usage" for r in ok),
        "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
        "goodput": (round(goodput(ttfts, tpots, duration, slo_ttft_ms, slo_tpot_ms), 2)
                    if slo_ttft_ms is not None or slo_tpot_ms is not None else None),
    }
    out.update(summarize_ms(ttfts, "ttft"))
    out.update(summarize_ms([t for t in tpots if t is not None], "tpot"))
    out.update(summarize_ms([g for r in ok for g in r.itl], "itl"))
    out.update(summarize_ms([r.latency for r in ok if r.latency is not None], "e2e"))
    out["errors"] = dict(Counter(r.error for r in failed).most_common(5))
    return out


def warnings_for(summary: dict[str, Any]) -> list[str]:
    w = []
    if summary["failed"]:
        w.append(f"{summary['failed']} of {summary['num_requests']} requests failed; first error: "
                 f"{summary['first_error']}")
    if summary["short_outputs"]:
        w.append(f"server did not honour ignore_eos/min_tokens for {summary['short_outputs']} requests: they "
                 "returned fewer tokens than asked, so output lengths differ from the workload's")
    no_usage = summary["completed"] - summary["outputs_counted_from_usage"]
    if no_usage:
        w.append(f"the server reported no usage for {no_usage} requests (stream_options.include_usage): their "
                 "output tokens are counted as stream chunks, an undercount if a chunk carries several tokens")
    return w


def build_result(run: RunResult, *, config: dict[str, Any], workload: dict[str, Any], server: dict[str, Any],
                 command: str, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict[str, Any]:
    summary = summarize(run.records, run.duration, slo_ttft_ms, slo_tpot_ms, run.max_in_flight)
    return {"format": f"lockgate-bench/{FORMAT_VERSION}", "command": command, "machine": machine_info(),
            "started_at": _iso(run.started_at), "finished_at": _iso(run.started_at + run.duration),
            "config": config, "workload": workload, "server": server, "summary": summary,
            "warnings": warnings_for(summary), "requests": [r.to_json() for r in run.records]}


# ---- the table ----------------------------------------------------------------------------
def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _load_line(cfg: dict[str, Any]) -> str:
    rate = cfg.get("request_rate")
    parts = [f"rate {'inf' if rate is None or rate == float('inf') else rate} req/s"]
    if rate not in (None, float("inf")):
        parts.append(f"burstiness {cfg.get('burstiness')}")
    parts.append(f"max concurrency {cfg.get('max_concurrency') or 'none'}")
    return ", ".join(parts)


def _load_short(cfg: dict[str, Any]) -> str:
    rate = cfg.get("request_rate")
    out = "all at once" if rate is None or rate == float("inf") else f"{rate:g} req/s"
    if rate not in (None, float("inf")) and cfg.get("burstiness") not in (None, 1.0):
        out += f" (burst {cfg['burstiness']:g})"
    return out + (f", conc {cfg['max_concurrency']}" if cfg.get("max_concurrency") else "")


def format_table(result: dict[str, Any]) -> str:
    s, cfg, wl = result["summary"], result["config"], result["workload"]
    knobs = ", ".join(f"{k} {v}" for k, v in wl.get("params", {}).items())
    rows = [("Workload", f"{wl['name']} ({knobs})" if knobs else wl["name"]),
            ("Server", f"{cfg['url']} ({cfg['endpoint']}, model {cfg.get('model')})"),
            ("Load", _load_line(cfg)),
            ("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", _fmt(s["duration_s"])),
            ("Total input tokens", s["total_input_tokens"]), ("Total output tokens", s["total_output_tokens"])]
    if s.get("cached_prompt_tokens") is not None:
        rows.append(("Cached prompt tokens (server)", s["cached_prompt_tokens"]))
    rows += [("Request throughput (req/s)", _fmt(s["request_throughput"])),
             ("Output token throughput (tok/s)", _fmt(s["output_throughput"])),
             ("Total token throughput (tok/s)", _fmt(s["total_token_throughput"]))]
    if s.get("goodput") is not None:
        slo = ", ".join(f"{n} <= {s[k]} ms" for n, k in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"))
                        if s[k] is not None)
        rows.append(("SLOs", slo))
        rows.append(("Goodput (req/s)", _fmt(s["goodput"])))
    if s.get("max_in_flight") is not None:
        rows.append(("Max requests in flight", s["max_in_flight"]))
    width = max(len(k) for k, _ in rows) + 2
    title = " lockgate bench "
    lines = [title.center(width + 40, "=")]
    lines += [f"{k + ':':<{width}}{v}" for k, v in rows]
    lines.append("-" * (width + 40))
    lines.append(f"{'Latency (ms)':<{width}}" + "".join(f"{h:>10}" for h in ("mean", "p50", "p90", "p99")))
    for key, name in LATENCIES:
        lines.append(f"{name:<{width}}" + "".join(f"{_fmt(s.get(f'{key}_{p}_ms')):>10}"
                                                 for p in ("mean", "p50", "p90", "p99")))
    lines.append("=" * (width + 40))
    lines += [f"warning: {w}" for w in result.get("warnings", [])]
    return "\n".join(lines)


# ---- compare ------------------------------------------------------------------------------
COMPARED = [("request_throughput", "Request throughput (req/s)"),
            ("output_throughput", "Output tokens/s"),
            ("total_token_throughput", "Total tokens/s"),
            ("goodput", "Goodput (req/s)"),
            *[(f"{k}_{p}_ms", f"{n} {p} (ms)") for k, n in LATENCIES for p in ("mean", "p50", "p90", "p99")],
            ("completed", "Successful requests"), ("failed", "Failed requests"),
            ("duration_s", "Duration (s)")]


def format_compare(results: list[dict[str, Any]], labels: list[str]) -> str:
    """The runs side by side; every value after the first run's with its ratio to the first."""
    cols = labels
    head_rows = [("Workload", [r["workload"]["name"] for r in results]),
                 ("Server", [r["config"]["url"] for r in results]),
                 ("Load", [_load_short(r["config"]) for r in results]),
                 ("Requests", [str(r["summary"]["num_requests"]) for r in results])]
    body: list[tuple[str, list[str]]] = []
    for key, name in COMPARED:
        vals = [r["summary"].get(key) for r in results]
        if all(v is None for v in vals):
            continue
        base = vals[0]
        cells = [_fmt(base)]
        for v in vals[1:]:
            ratio = f" ({v / base:.2f}x)" if isinstance(v, int | float) and isinstance(base, int | float) and base \
                else ""
            cells.append(_fmt(v) + ratio)
        body.append((name, cells))
    rows = head_rows + body
    w0 = max(len(n) for n, _ in rows) + 2
    widths = [max(len(c), *(len(cells[i]) for _, cells in rows)) + 2 for i, c in enumerate(cols)]
    lines = [f"{'':<{w0}}" + "".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))]
    for n, cells in rows:
        lines.append(f"{n:<{w0}}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
        if n == "Requests":
            lines.append("-" * (w0 + sum(widths)))
    lines.append(f"ratios are each run's value / {labels[0]}'s")
    return "\n".join(lines)


# ---- charts -------------------------------------------------------------------------------
MATPLOTLIB_MISSING = "--plot needs matplotlib, which is not installed: pip install matplotlib"


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def tokens_over_time(requests: list[dict[str, Any]], bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times, output tokens/s per bin) from the per-request records; a request's tokens
    are spread evenly over its text chunks."""
    times: list[float] = []
    weights: list[float] = []
    for r in requests:
        if not r["success"] or r["ttft_s"] is None:
            continue
        t = r["start_s"] + r["ttft_s"] + np.concatenate([[0.0], np.cumsum(r["itl_s"])])
        times += list(t)
        weights += [r["output_tokens"] / len(t)] * len(t)
    if not times:
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0.0, max(times) + bin_s, bin_s)
    if len(edges) < 2:
        edges = np.array([0.0, bin_s])
    counts, edges = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], counts / bin_s


def plot(result: dict[str, Any], out_json: Path) -> list[Path]:
    """PNG charts next to ``out_json``: latency CDFs (TTFT, TPOT, E2E) and output tokens/s over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r for r in result["requests"] if r["success"]]
    stem = out_json.with_suffix("")
    title = f"{result['workload']['name']} @ {result['config']['url']} ({_load_line(result['config'])})"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, name) in zip(axes, (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency")),
                               strict=True):
        v = np.sort([r[key] * 1000.0 for r in reqs if r[key] is not None])
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post")
            for p in (50, 90, 99):
                ax.axvline(np.percentile(v, p), ls=":", lw=0.8, color="grey")
        ax.set(title=name, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    cdf = Path(f"{stem}_latency_cdf.png")
    fig.savefig(cdf, dpi=110)
    plt.close(fig)

    duration = float(result["summary"]["duration_s"]) or 1.0
    bin_s = 1.0 if duration >= 30 else max(duration / 30, 0.01)
    t, rate = tokens_over_time(reqs, bin_s)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(t + bin_s / 2, rate, marker=".", lw=1, label="output tokens/s")
    mean = result["summary"]["output_throughput"]
    ax.axhline(mean, ls="--", lw=0.8, color="grey", label=f"mean {mean:.0f} tokens/s")
    ax.set(title=f"Output tokens/s over time ({bin_s:.2g} s bins)", xlabel="seconds since start",
           ylabel="tokens/s")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()  # requests in flight, a step function of the request start and end times
    events = sorted([(r["start_s"], 1) for r in reqs] + [(r["start_s"] + r["e2e_s"], -1) for r in reqs])
    if events:
        ax2.step([e[0] for e in events], np.cumsum([e[1] for e in events]), where="post", color="tab:orange",
                 lw=0.8, alpha=0.7, label="requests in flight")
    ax2.set_ylabel("requests in flight")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    tps = Path(f"{stem}_throughput.png")
    fig.savefig(tps, dpi=110)
    plt.close(fig)
    return [cdf, tps]
