"""Shared test helpers.

``pool_driver``: drives a ``LlamaModel`` through steps over a NaN-initialised KV pool with
scattered slots, the way the runner does (one AttentionMetadata per step), so model tests can
feed a prompt whole, in chunks, or as decode steps and compare logits with a reference.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_sessionstart(session) -> None:
    """Build lockgate's CPU kernels once, before any test: the servers the tests start then load
    them from the cache instead of each compiling (or waiting on) them inside a start-up timeout.
    A failed build is not an error here: the tests that need the kernels assert it themselves."""
    from lockgate import kernels

    kernels.load()


class PoolDriver:
    def __init__(self, model, capacity: int = 512, seed: int = 0, kernels: bool | None = None):
        """``kernels``: run on lockgate's CPU kernels (fused layer ops, decode attention kernel),
        as the runner does when they build, or on plain torch ops; None: as the model was loaded."""
        from lockgate import kernels as cpu_kernels
        from lockgate.layers.attention import AttentionMetadata

        kernels = model.fused_ops if kernels is None else kernels
        if kernels:
            assert cpu_kernels.load(), f"lockgate CPU kernels did not build: {cpu_kernels.error()}"
        self.kernels = kernels
        self._meta = AttentionMetadata
        self.model = model
        self.k_cache = torch.full(model.kv_shape(capacity), float("nan"), dtype=model.dtype)
        self.v_cache = torch.full(model.kv_shape(capacity), float("nan"), dtype=model.dtype)
        self.free = [int(s) for s in np.random.default_rng(seed).permutation(capacity)]  # scattered
        self.slots: dict[int, list[int]] = {}

    def step(self, chunks: dict[int, list[int]], all_rows: bool = False) -> dict[int, torch.Tensor]:
        """One step: sequence id -> new tokens. Returns id -> logits [V] of the last new token
        (or [q, V] for every new token when ``all_rows``)."""
        ids, pos, out, qlens, slens, kv = [], [], [], [], [], []
        for sid, toks in chunks.items():
            ctx = self.slots.setdefault(sid, [])
            start = len(ctx)
            new = [self.free.pop() for _ in toks]
            ctx.extend(new)
            ids += toks
            pos += range(start, start + len(toks))
            out += new
            qlens.append(len(toks))
            slens.append(len(ctx))
            kv += ctx
        i64 = np.int64
        meta = self._meta.build(np.array(qlens, i64), np.array(slens, i64), np.array(kv, i64),
                                np.concatenate([[0], np.cumsum(slens)]).astype(i64), np.array(out, i64),
                                self.model.args.num_queries_per_kv, decode_kernel=self.kernels)
        self.model.use_kernels(self.kernels)
        # every token's row, or the last token of each sequence
        rows = list(range(len(ids))) if all_rows else list(np.cumsum(qlens) - 1)
        with torch.inference_mode():
            logits = self.model(torch.tensor(ids), torch.tensor(pos), meta, self.k_cache, self.v_cache,
                                torch.tensor(rows, dtype=torch.long))
        res, r = {}, 0
        for sid, toks in chunks.items():
            n = len(toks) if all_rows else 1
            res[sid] = logits[r:r + n] if all_rows else logits[r]
            r += n
        return res


@pytest.fixture
def pool_driver():
    return PoolDriver


# ---- the default model, shared by the golden and offline tests (loaded once per session) ----

@pytest.fixture(scope="session")
def hf_reference():
    """transformers' own Llama, fp32, loaded from the very GGUF lockgate serves (the independent reference)."""
    from transformers import AutoModelForCausalLM

    from lockgate.checkpoint.loader import default_gguf_path

    gguf = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_fp32():
    """lockgate's offline LLM on the default model in float32 (small KV pool, default budgets)."""
    from lockgate import LLM

    return LLM("default", dtype="float32", max_total_tokens=8192, check_invariants=True)


@pytest.fixture(scope="session")
def smol_server():
    """A real ``lockgate serve`` on the default model (defaults, a 64k-token pool), shared by the
    modules that drive it over HTTP; stopped by process id at the end of the session."""
    from server_util import ServerProc

    s = ServerProc("--model", "default", "--max-total-tokens", "65536")
    try:
        yield s.wait_ready(timeout=300)
    finally:
        s.stop()
