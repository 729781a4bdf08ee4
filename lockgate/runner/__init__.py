"""Runners turn a ForwardPlan into a ForwardResult: the real torch model or the simulator.

``Runner`` is everything the engine (``engine/core.py``, ``engine/process.py``) and the offline
``LLM`` use of one, so they read its attributes plainly: ``ModelRunner`` (torch; with
``--tensor-parallel-size`` > 1 it is rank 0 and drives the other ranks through ``tensor_parallel``)
and ``SimRunner`` (``--model sim``) implement it. Torch-free: what would be a torch type here is
typed by what the caller does with it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from lockgate.checkpoint.peft import AdapterInfo
from lockgate.config import CacheConfig, ModelConfig
from lockgate.plan import ForwardPlan, ForwardResult


class RankGroup(Protocol):
    """The other tensor-parallel ranks a rank-0 runner drives (``TensorParallelGroup``)."""

    on_death: Callable[[str], None] | None  # called (from a watcher thread) when a rank ends or the group breaks

    def describe(self) -> str:
        """The ranks, for the operator's log line."""
        ...

    def kill(self) -> None:
        """End every other rank now."""
        ...


class Runner(Protocol):
    capacity: int  # KV slots in the pool
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @property
    def model_dir(self) -> Path | None:
        """The checkpoint directory (config, tokenizer files); None for ``sim``."""
        ...

    @property
    def dtype(self) -> object:
        """The compute dtype; ``str()`` of it is what the engine reports (``torch.bfloat16``, ``sim``)."""
        ...

    @property
    def kv_cache_dtype_name(self) -> str:
        """What the KV pool stores: the run dtype's name, ``int8`` or ``fp8_e4m3`` (``auto`` for ``sim``)."""
        ...

    @property
    def generated_kv_exact(self) -> bool:
        """A generated token's KV is what computing it as a prompt row gives: the prefix cache may keep it."""
        ...

    @property
    def tensor_parallel(self) -> RankGroup | None:
        """The other tensor-parallel ranks (None with one rank)."""
        ...

    def warmup(self) -> None: ...

    def execute(self, plan: ForwardPlan) -> ForwardResult: ...

    def close(self) -> None:
        """Release what outlives the object (tensor-parallel ranks); also done at exit."""
        ...

    # LoRA adapters: the engine numbers them (uid >= 1), the scheduler puts them into slots
    def enable_lora(self, max_loras: int, max_rank: int) -> None: ...

    def read_adapter(self, name: str, path: str) -> tuple[AdapterInfo, object]:
        """Read and check an adapter's files: (what it is, its weights); ValueError saying what is
        wrong. Changes nothing here, so it may run on another thread than ``execute``."""
        ...

    def add_adapter(self, uid: int, weights: object) -> None:
        """Keep ``read_adapter``'s weights as adapter ``uid`` until ``drop_adapter``."""
        ...

    def drop_adapter(self, uid: int) -> None: ...

    def put_adapter(self, slot: int, uid: int) -> None: ...


def make_runner(model_cfg: ModelConfig, cache_cfg: CacheConfig) -> Runner:
    """The sim runner for ``--model sim``, else the torch ModelRunner (imported lazily)."""
    if model_cfg.model == "sim":
        from lockgate.runner.sim_runner import SimRunner

        return SimRunner(model_cfg, cache_cfg)
    from lockgate.runner.model_runner import ModelRunner

    return ModelRunner(model_cfg, cache_cfg)
