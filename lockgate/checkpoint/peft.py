"""PEFT adapter directories, torch-free: the config file, typed, and what lockgate refuses in it.

``read_adapter_config(path)`` reads ``adapter_config.json`` into an ``AdapterConfig`` or raises
ValueError naming the field and the limit. The file is untrusted (a client names the directory at
run time), so every field lockgate uses is checked for its type and range here, and nothing else in
the file is kept:

* the file: at most ``MAX_CONFIG_BYTES``, a regular file inside the adapter directory, checked on
  the opened file (``open_inside``: a symlink that leads out, a FIFO, a file swapped after a check
  are refused), JSON within ``jsonsafe``'s limits, an object;
* ``peft_type`` LORA only; ``r`` an integer in [1, ``MAX_RANK``]; ``lora_alpha`` a finite number;
  ``use_rslora`` a boolean; ``target_modules`` a list of at most ``MAX_MODULES`` module names
  (letters, digits, ``_ . -``) or one such name; ``alpha_pattern`` / ``rank_pattern`` at most
  ``MAX_MODULES`` module names -> numbers (names only: PEFT reads their keys as regular expressions,
  which from an untrusted file could take exponential time); ``base_model_name_or_path`` a string;
* refused (cannot be served): DoRA, LoRA biases, ``modules_to_save`` (full weights besides the
  adapter), fan-in-fan-out weights, layer replication, QA-LoRA.

The weights themselves are read by ``lockgate.models.lora`` (torch); the sim runner uses only this
module.
"""

from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockgate import jsonsafe

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1024 * 1024
MAX_RANK = 4096  # beyond any real adapter; --max-lora-rank is the limit that applies
MAX_MODULES = 256
MAX_TEXT = 1024
MODULE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,256}")


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


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of ``adapter_config.json`` lockgate uses, checked."""

    r: int = 8
    lora_alpha: float = 8.0
    use_rslora: bool = False
    target_modules: tuple[str, ...] = ()
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    base_model: str | None = None


def inside(path: Path, root: Path) -> bool:
    """Whether ``path`` resolves (symlinks followed) to ``root`` or below it."""
    try:
        real, base = os.path.realpath(path), os.path.realpath(root)
        return os.path.commonpath([real, base]) == base
    except ValueError:
        return False


def open_inside(directory: Path, name: str) -> int:
    """A read-only descriptor of ``directory / name``, which must be a regular file inside
    ``directory`` (symlinks followed): checked on the opened file itself, so a file swapped
    between a check and the open (for a FIFO that would block a reader, a link leading out) is
    refused. Opened non-blocking, so a FIFO never stalls the open. ValueError saying what is wrong."""
    where = directory / name
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"LoRA adapter {directory}: cannot open {name} ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"LoRA adapter {directory}: {name} is not a regular file")
        opened = os.readlink(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else os.path.realpath(where)
        base = os.path.realpath(directory)
        if os.path.commonpath([opened, base]) != base:
            raise ValueError(f"LoRA adapter {directory}: {name} is a link to a file outside the adapter directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_adapter_config(path: Path | str) -> AdapterConfig:
    """The adapter's config, read and checked (see the module docstring)."""
    path = Path(path).expanduser()
    cfg_path = path / CONFIG
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {path}: not a directory")
    if not cfg_path.exists():
        raise ValueError(f"LoRA adapter {path}: no {CONFIG} (a PEFT adapter directory is expected)")
    fd = open_inside(path, CONFIG)
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ValueError(f"LoRA adapter {path}: cannot read {CONFIG} ({e.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"LoRA adapter {path}: {CONFIG} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = jsonsafe.loads(raw, CONFIG)
    except ValueError as e:
        raise ValueError(f"LoRA adapter {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path}: {CONFIG} is not a JSON object")
    try:
        return _typed(cfg)
    except ValueError as e:
        raise ValueError(f"LoRA adapter {path}: {CONFIG}: {e}") from None


def _typed(cfg: dict[str, Any]) -> AdapterConfig:
    kind = cfg.get("peft_type", "LORA")
    if not isinstance(kind, str) or kind.upper() != "LORA":
        raise ValueError(f"peft_type {_show(kind)} is not supported (only LORA)")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "layer_replication": "layer_replication",
               "modules_to_save": "modules_to_save (full weights besides the adapter)",
               "lora_bias": "LoRA biases", "use_qalora": "QA-LoRA"}
    for key, what in refused.items():
        if cfg.get(key):
            raise ValueError(f"{what} ({key}={_show(cfg[key])}) is not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise ValueError(f"bias={_show(cfg['bias'])} is not supported (only 'none')")
    r = _int(cfg.get("r", 8), "r", 1, MAX_RANK)
    alpha = _number(cfg["lora_alpha"], "lora_alpha") if cfg.get("lora_alpha") is not None else float(r)
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool | None):
        raise ValueError(f"use_rslora must be true or false, got {_show(rslora)}")
    base = cfg.get("base_model_name_or_path")
    if base is not None and not (isinstance(base, str) and len(base) <= MAX_TEXT):
        raise ValueError(f"base_model_name_or_path must be a string of at most {MAX_TEXT} characters")
    return AdapterConfig(r=r, lora_alpha=alpha, use_rslora=bool(rslora),
                         target_modules=_modules(cfg.get("target_modules")),
                         alpha_pattern={k: _number(v, f"alpha_pattern[{k!r}]")
                                        for k, v in _patterns(cfg.get("alpha_pattern"), "alpha_pattern").items()},
                         rank_pattern={k: _int(v, f"rank_pattern[{k!r}]", 1, MAX_RANK)
                                       for k, v in _patterns(cfg.get("rank_pattern"), "rank_pattern").items()},
                         base_model=base)


def _show(v: Any) -> str:
    return f"{v!r:.60}"


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if type(v) is float and v.is_integer():
        v = int(v)
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {_show(v)}")
    return v


def _number(v: Any, name: str) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {_show(v)}")
    return float(v)


def _modules(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    names = [v] if isinstance(v, str) else v
    if not isinstance(names, list) or len(names) > MAX_MODULES:
        raise ValueError(f"target_modules must be a module name or a list of at most {MAX_MODULES} of them")
    for n in names:
        if not isinstance(n, str) or not MODULE_NAME.fullmatch(n):
            raise ValueError(f"target_modules: {_show(n)} is not a module name (letters, digits, _ . -)")
    return tuple(names)


def _patterns(v: Any, name: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > MAX_MODULES:
        raise ValueError(f"{name} must be an object of at most {MAX_MODULES} module names")
    for k in v:
        if not MODULE_NAME.fullmatch(k):
            raise ValueError(f"{name}: {_show(k)} is not a module name (letters, digits, _ . -; patterns are not "
                             "supported)")
    return v
