"""Latency and throughput statistics shared by the benchmark scripts and ``lockgate bench``.

Owns the arithmetic only (numpy): percentiles by linear interpolation (numpy's default, as
vLLM's benchmark reports them), means, and goodput under SLOs. Values in seconds go in;
the summaries report milliseconds where the name says ``_ms``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def summarize_ms(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    """{prefix_mean_ms, prefix_p50_ms, prefix_p90_ms, prefix_p99_ms} of seconds ``values``."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {f"{prefix}_mean_ms": round(float(v.mean()), 2) if v.size else None}
    for p in PERCENTILES:
        out[f"{prefix}_p{p}_ms"] = round(float(np.percentile(v, p)), 2) if v.size else None
    return out


def meets_slo(ttft: float, tpot: float | None, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether one request met every given SLO (seconds in, milliseconds SLOs; no TPOT meets that SLO)."""
    if slo_ttft_ms is not None and ttft * 1000.0 > slo_ttft_ms:
        return False
    return not (slo_tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo_tpot_ms)


def goodput(ttft: Sequence[float], tpot: Sequence[float | None], duration: float,
            slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> float:
    """Requests per second that met every given SLO (a request without a TPOT meets that SLO)."""
    ok = sum(meets_slo(t, p, slo_ttft_ms, slo_tpot_ms) for t, p in zip(ttft, tpot, strict=True))
    return ok / duration if duration > 0 else 0.0


def tpot(latency: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (tokens - 1); None for one token."""
    return (latency - ttft) / (output_tokens - 1) if output_tokens > 1 else None
