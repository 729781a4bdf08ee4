"""SimRunner: a model-free runner that honours the ForwardPlan/ForwardResult contract.

Used by ``--model sim`` so the scheduler, the server and the gateway can be tested and
benchmarked in seconds. It checks each plan's invariants, "computes" for a time given by a
small cost model (``sim_step_ms + sim_token_ms * tokens in the step``, spent in
``time.sleep`` so it frees the CPU like a GIL-releasing kernel would), and returns
deterministic tokens: the next token is a hash of the row's last input token and its
position, never an EOS id, so a request runs to max_tokens unless stopped otherwise and
the same prompt always gives the same output whatever the batch. A constrained row (grammar
bitmask) takes the first allowed token at or after the hashed one. A row under a LoRA adapter
(checked from its ``adapter_config.json`` only; no weights) gets its token shifted by the
adapter's number, so adapters visibly change outputs.

No torch; the KV "pool" is only a capacity number.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from lockgate.checkpoint.peft import AdapterInfo, read_adapter_config
from lockgate.config import CacheConfig, ModelConfig
from lockgate.plan import ForwardPlan, ForwardResult
from lockgate.runner import RankGroup
from lockgate.runner.memory_plan import available_bytes

SIM_VOCAB = 32000
SIM_EOS = 2
SIM_CONTEXT = 32768
SIM_BYTES_PER_TOKEN = 4096  # pretend KV footprint, to turn --kv-cache-memory into a capacity


class SimRunner:
    def __init__(self, model_cfg: ModelConfig, cache_cfg: CacheConfig) -> None:
        self.cfg = model_cfg
        from_bytes = cache_cfg.pool_bytes(0, available_bytes()) if cache_cfg.max_total_tokens is None else 0
        self.capacity = cache_cfg.max_total_tokens or max(1, from_bytes // SIM_BYTES_PER_TOKEN)
        self.max_model_len = min(SIM_CONTEXT, model_cfg.max_model_len or SIM_CONTEXT)
        self.vocab_size = SIM_VOCAB
        self.eos_token_ids: tuple[int, ...] = (SIM_EOS,)
        self.model_dir: Path | None = None
        self.dtype = "sim"
        self.kv_cache_dtype_name = "auto"
        self.generated_kv_exact = True  # no KV at all: nothing the cache keeps can differ
        self.tensor_parallel: RankGroup | None = None
        self.max_lora_rank = 0
        self.slot_uid: list[int] | None = None  # LoRA: slot -> adapter number (0: empty)
        self.adapters: dict[int, AdapterInfo] = {}

    def warmup(self) -> None:
        pass

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        self.slot_uid, self.max_lora_rank = [0] * max_loras, max_rank

    def read_adapter(self, name: str, path: str) -> tuple[AdapterInfo, object]:
        if self.slot_uid is None:
            raise ValueError("LoRA is not enabled (start without --no-enable-lora)")
        cfg = read_adapter_config(Path(path))
        if cfg.r > self.max_lora_rank:
            raise ValueError(f"LoRA adapter {path}: rank {cfg.r} is above --max-lora-rank {self.max_lora_rank}")
        info = AdapterInfo(name=name, path=str(path), rank=cfg.r, alpha=cfg.lora_alpha,
                           modules=sorted(cfg.target_modules), base_model=cfg.base_model)
        return info, info

    def add_adapter(self, uid: int, weights: object) -> None:
        assert isinstance(weights, AdapterInfo)
        self.adapters[uid] = weights

    def drop_adapter(self, uid: int) -> None:
        self.adapters.pop(uid, None)

    def put_adapter(self, slot: int, uid: int) -> None:
        assert self.slot_uid is not None and (uid == 0 or uid in self.adapters)
        self.slot_uid[slot] = uid

    @staticmethod
    def next_tokens(last_ids: np.ndarray, last_pos: np.ndarray) -> np.ndarray:
        h = (last_ids.astype(np.uint64) * np.uint64(2654435761) + last_pos.astype(np.uint64) * np.uint64(40503)
             + np.uint64(12345)) % np.uint64(SIM_VOCAB - 3)
        return (h + np.uint64(3)).astype(np.int64)

    def close(self) -> None:
        pass  # nothing outlives a simulated runner

    def execute(self, plan: ForwardPlan) -> ForwardResult:
        t0 = time.perf_counter()
        if __debug__:
            plan.validate()
        ends = np.cumsum(plan.query_lens)[plan.sample_rows] - 1
        tokens = self.next_tokens(plan.input_ids[ends], plan.positions[ends])
        if plan.lora_slots.size:  # an adapter shifts its rows' tokens by its number
            assert self.slot_uid is not None
            uid = np.asarray(self.slot_uid, dtype=np.int64)[np.maximum(plan.lora_slots[plan.sample_rows], 0)]
            shift = np.where(plan.lora_slots[plan.sample_rows] >= 0, uid, 0)
            tokens = (tokens - 3 + 7919 * shift) % (SIM_VOCAB - 3) + 3
        sb = plan.sampling
        for row, words in zip(sb.allowed_rows.tolist(), sb.allowed, strict=True):  # constrained rows
            ok = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:self.vocab_size])
            if ok.size:  # the first allowed token at or after the hashed one (wrapping round)
                tokens[row] = ok[np.searchsorted(ok, tokens[row]) % ok.size]
        s = tokens.shape[0]
        k = int(max(0, plan.sampling.num_logprobs.max(initial=0)))
        top_ids = np.tile(np.arange(3, 3 + k, dtype=np.int64), (s, 1))
        top_lp = np.tile(-np.arange(1, k + 1, dtype=np.float32), (s, 1))
        delay = (self.cfg.sim_step_ms + self.cfg.sim_token_ms * plan.num_tokens) / 1000.0
        remaining = delay - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)
        return ForwardResult(tokens=tokens, logprobs=np.full(s, -1.0, np.float32), top_ids=top_ids,
                             top_logprobs=top_lp, step_seconds=time.perf_counter() - t0)
