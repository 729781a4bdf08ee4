"""PEFT adapter directories, torch-free: the config file and what lockgate refuses in it.

``read_adapter_config(path)`` reads ``adapter_config.json`` and raises ValueError naming what
cannot be served: another ``peft_type`` than LORA, DoRA, LoRA biases, ``modules_to_save`` (full
weights besides the adapter), fan-in-fan-out weights, layer replication. The weights themselves
are read by ``lockgate.models.lora`` (torch); the sim runner uses only this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


@dataclass
class AdapterInfo:
    """What is known of a loaded adapter besides its weights (reported by /v1/models and logs)."""

    name: str
    path: str
    rank: int
    alpha: float
    modules: list[str]
    base_model: str | None
    nbytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def read_adapter_config(path: Path) -> dict[str, Any]:
    """The adapter's config, checked (see the module docstring)."""
    path = Path(path).expanduser()
    cfg_path = path / CONFIG
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {path}: not a directory")
    if not cfg_path.is_file():
        raise ValueError(f"LoRA adapter {path}: no {CONFIG} (a PEFT adapter directory is expected)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {path}: {CONFIG} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path}: {CONFIG} is not a JSON object")
    _check_config(path, cfg)
    return cfg


def _check_config(path: Path, cfg: dict[str, Any]) -> None:
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {kind!r} is not supported (only LORA)")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "layer_replication": "layer_replication",
               "modules_to_save": "modules_to_save (full weights besides the adapter)",
               "lora_bias": "LoRA biases", "use_qalora": "QA-LoRA"}
    for key, what in refused.items():
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {path}: {what} ({key}={cfg[key]!r}) is not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise ValueError(f"LoRA adapter {path}: bias={cfg['bias']!r} is not supported (only 'none')")
