"""Overlap scheduling offline, one configuration per run: decode tok/s of the default model's engine
(``EngineCore`` driven in-process, as the offline ``LLM`` does) with ``--overlap-schedule`` on or
off. Run the configurations interleaved, several times, and compare medians (the host is noisy):

    for r in 1 2 3; do for cfg in "0 1 0.8 2" "1 1 0.8 2" "0 32 0.8 2" "1 32 0.8 2"; do
      .venv/bin/python benchmarks/overlap_offline.py $cfg; done; done

Arguments: OVERLAP (0/1) CONCURRENCY TEMPERATURE SPECULATIVE_TOKENS. Each run: a warm-up round,
then CONCURRENCY requests of 128 random prompt tokens (64 output tokens each at c > 1, 96 at c = 1,
ignore_eos); decode tok/s counts the tokens after every request has its first one. With overlap
on, the interpreter's switch interval is shortened as the scheduler process does. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from _common import machine

from lockgate.config import EngineConfig
from lockgate.engine.core import OVERLAP_SWITCH_INTERVAL, EngineCore
from lockgate.runner.threads import pin_torch_threads
from lockgate.sampling import SamplingParams


def main() -> None:
    overlap, c = sys.argv[1] == "1", int(sys.argv[2])
    temp, spec = float(sys.argv[3]), int(sys.argv[4])
    eng = EngineCore(EngineConfig.build(model="default", speculative_tokens=spec, overlap_schedule=overlap))
    eng.on_runner_thread(eng.runner.warmup)
    if overlap:
        sys.setswitchinterval(OVERLAP_SWITCH_INTERVAL)
    eng.on_runner_thread(pin_torch_threads)
    rng = np.random.default_rng(0)
    out_tokens = 64 if c > 1 else 96
    for _round in range(2):  # the first round warms up
        for i in range(c):
            eng.add_request(rng.integers(100, 5000, size=128),
                            SamplingParams(max_tokens=out_tokens, temperature=temp, seed=i, ignore_eos=True))
        t0, n, n_dec0 = time.perf_counter(), 0, 0
        t_dec: float | None = None
        while eng.has_work:
            n += sum(len(o.new_token_ids) for o in eng.step())
            if t_dec is None and n >= c:  # every request has its first token
                t_dec, n_dec0 = time.perf_counter(), n
        wall = time.perf_counter() - t0
    assert t_dec is not None
    dec = time.perf_counter() - t_dec
    print(json.dumps({"command": " ".join(sys.argv), "machine": machine(), "overlap": overlap, "concurrency": c,
                      "temperature": temp, "speculative_tokens": spec, "wall_s": wall,
                      "decode_tok_s": (n - n_dec0) / dec, "tok_s": n / wall}))


if __name__ == "__main__":
    main()
