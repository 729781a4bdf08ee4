"""Runners turn a ForwardPlan into a ForwardResult: the real torch model or the simulator."""

from __future__ import annotations

from typing import Protocol

from lockgate.checkpoint.peft import AdapterInfo
from lockgate.config import CacheConfig, ModelConfig
from lockgate.plan import ForwardPlan, ForwardResult


class Runner(Protocol):
    capacity: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]

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
