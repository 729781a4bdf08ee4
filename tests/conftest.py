"""Shared test helpers.

``pool_driver``: drives a ``DecoderModel`` through steps over a NaN-initialised KV pool with
scattered slots, the way the runner does (one AttentionMetadata per step), so model tests can
feed a prompt whole, in chunks, or as decode steps and compare logits with a reference.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: its idle threads sleep instead of spinning. The suite runs servers (two
# torch threads each) beside this process's own two on a 2-core machine; spinning waiters there
# made a 2-thread matmul 10-40x slower than when they sleep (measured on the AMD EPYC Zen 3 class CPU).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import copy  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_sessionstart(session) -> None:
    """Build lockgate's CPU kernels once, before any test: the servers the tests start then load
    them from the cache instead of each compiling (or waiting on) them inside a start-up timeout.
    A failed build is not an error here: the tests that need the kernels assert it themselves."""
    from lockgate import kernels

    kernels.load()


# The longest files (a minute or more on 2 cores), started first: ``make test`` hands whole files to
# its two workers in collection order, and a long file started last would run alone at the end.
LONG_FILES = ("test_golden.py", "test_ray_fleet.py", "test_offline_model.py", "test_lora.py", "test_determinism.py",
              "test_gateway.py", "test_tensor_parallel.py", "test_gguf_families.py", "test_real_size.py",
              "test_robustness.py", "test_overlap_schedule.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: order within a file kept


class PoolDriver:
    def __init__(self, model, capacity: int = 512, seed: int = 0, kernels: bool | None = None,
                 prefill_kernel: bool = False):
        """``kernels``: run on lockgate's CPU kernels (fused layer ops, decode attention kernel),
        as the runner does when they build, or on plain torch ops; None: as the model was loaded.
        ``prefill_kernel``: every step's attention in one group on the prefill kernel (the runner's
        choice where the tuning measures it faster)."""
        from lockgate import kernels as cpu_kernels
        from lockgate.layers.attention_meta import AttentionMetadata

        kernels = model.fused_ops if kernels is None else kernels
        if kernels:
            assert cpu_kernels.load(), f"lockgate CPU kernels did not build: {cpu_kernels.error()}"
        self.kernels = kernels
        self.prefill_kernel = prefill_kernel and kernels
        self._meta = AttentionMetadata
        self.model = model
        self.k_cache = torch.full(model.kv_shape(capacity), float("nan"), dtype=model.dtype)
        self.v_cache = torch.full(model.kv_shape(capacity), float("nan"), dtype=model.dtype)
        self.free = [int(s) for s in np.random.default_rng(seed).permutation(capacity)]  # scattered
        self.slots: dict[int, list[int]] = {}

    def step(self, chunks: dict[int, list[int]], all_rows: bool = False,
             logits_out: torch.Tensor | None = None, decode_rows: int | None = None,
             argmax: bool = False, sampled: set[int] | None = None) -> dict[int, torch.Tensor]:
        """One step: sequence id -> new tokens. Returns id -> logits [V] of the last new token
        (or [q, V] for every new token when ``all_rows``); ``logits_out``: the model's logits buffer;
        ``decode_rows``: the step's first rows that are decode rows, the rest prompt rows (as the
        runner passes it with exact prefill; None: no prompt rows, every call by its row count);
        ``argmax``: the model's greedy path (each row's argmax token, int64, instead of its logits);
        ``sampled``: the sequences whose rows are sampled (None: all; the others, middle prompt
        chunks, get no logits and are left out of the result)."""
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
                                self.model.args.num_queries_per_kv, decode_kernel=self.kernels,
                                prefill_kernel=self.prefill_kernel)
        self.model.use_kernels(self.kernels)
        # every token's row, or the last token of each sequence
        sampled = set(chunks) if sampled is None else sampled
        ends = np.cumsum(qlens)
        rows = [r for sid, q, end in zip(chunks, qlens, ends, strict=True) if sid in sampled
                for r in (range(end - q, end) if all_rows else [end - 1])]
        with torch.inference_mode():
            logits = self.model(torch.tensor(ids), torch.tensor(pos), meta, self.k_cache, self.v_cache,
                                torch.tensor(rows, dtype=torch.long) if rows else None, logits_out=logits_out,
                                decode_rows=decode_rows, argmax=argmax)
        res, r = {}, 0
        for sid, toks in chunks.items():
            if sid not in sampled:
                continue
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

    from lockgate.checkpoint.gguf_convert import _reader_reused, plain_reader
    from lockgate.checkpoint.loader import default_gguf_path

    gguf = default_gguf_path()
    with _reader_reused(gguf, plain_reader(gguf)):  # the header parsed once, not twice
        return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_fp32():
    """lockgate's offline LLM on the default model in float32 (small KV pool, default budgets)."""
    from lockgate import LLM

    return LLM("default", dtype="float32", max_total_tokens=8192, check_invariants=True)


@pytest.fixture(scope="session")
def smol_server():
    """A real ``lockgate serve`` on the default model (defaults, warm-up included, a 64k-token pool,
    run-time LoRA loads allowed), shared by the modules that drive it over HTTP; stopped by process id at the end
    of the session."""
    from server_util import ServerProc

    s = ServerProc("--model", "default", "--max-total-tokens", "65536", "--allow-runtime-lora-updating", warmup=True)
    try:
        yield s.wait_ready(timeout=300)
    finally:
        s.stop()


# ---- LoRA adapters for the default model, made with peft during the run ----------------------

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (peft LoraConfig keywords, scale applied to the random LoRA weights)
ADAPTERS = {
    "all8": ({"r": 8, "lora_alpha": 16, "target_modules": ALL, "use_rslora": True}, 0.5),
    "qv4": ({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, 2.0),
    "mlp16": ({"r": 16, "lora_alpha": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"],
               "alpha_pattern": {"down_proj": 32}}, 0.5),
}


def make_adapter(base, where: Path, seed: int, scale: float, **config) -> None:
    """A random-weight PEFT adapter for ``base`` (a transformers model, copied), saved to ``where``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    model.save_pretrained(str(where))


@pytest.fixture(scope="session")
def adapters(hf_reference, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (config, scale)) in enumerate(ADAPTERS.items()):
        make_adapter(hf_reference, root / name, seed=100 + i, scale=scale, **config)
        out[name] = root / name
    return out
