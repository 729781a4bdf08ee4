"""Reading PEFT LoRA adapters for a loaded model: a directory -> ``AdapterWeights`` (layers/lora.py).

Owns the PEFT weights (``adapter_model.safetensors``, the layout ``peft``'s ``save_pretrained``
writes; the config's checks are ``lockgate.checkpoint.peft``'s) and the checks that make a bad
adapter a clear error at load instead of a wrong answer later:

* only plain LoRA (no embedding or LM-head targets: refused by name);
* every tensor must belong to a projection the architecture maps (``LoraTargets``: for the
  Llama family q/k/v/o and gate/up/down), with ``lora_A`` [r, in] and ``lora_B`` [out, r] of the
  base model's shapes (an adapter made for another base model fails here, naming the tensor);
* rank at most ``max_rank`` (``--max-lora-rank``), the same rank in A and B;
* scaling per module: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``;
  ``alpha_pattern`` / ``rank_pattern`` entries are honoured (the rank is read from the tensors).

The result is in the run dtype, each fused projection's parts side by side (``LoraUpdate``).
Called by the model runner (at start-up for ``--lora-modules`` and on each run-time load) and tests.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from lockgate.checkpoint.peft import WEIGHTS, AdapterInfo, open_inside, read_adapter_config
from lockgate.layers.lora import LORA_ROLES, AdapterWeights, LoraUpdate

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class ModuleTarget:
    """Where a PEFT target module's update goes: fused projection ``role`` (input width ``k``,
    output width ``n``), output columns [``lo``, ``hi``) of it."""

    role: str
    k: int
    n: int
    lo: int
    hi: int


@dataclass(frozen=True)
class LoraTargets:
    """What an architecture lets adapters touch: ``modules`` by PEFT module name, over ``num_layers``."""

    num_layers: int
    modules: dict[str, ModuleTarget]


def max_weights_bytes(targets: LoraTargets, max_rank: int) -> int:
    """The largest ``adapter_model.safetensors`` an adapter within ``max_rank`` can need (every
    target in every layer at that rank, 8-byte floats, plus room for the header): a larger file is
    refused before it is read."""
    per_layer = sum((t.k + t.hi - t.lo) * max_rank for t in targets.modules.values())
    return per_layer * targets.num_layers * 8 + 16 * 1024 * 1024


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's alpha_pattern / rank_pattern lookup: a key matches a module path equal to it or
    ending in ``.key`` (keys are module names, ``checkpoint.peft`` checked; PEFT's ``.`` as any
    character is kept)."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def load_adapter(name: str, path: str | Path, targets: LoraTargets, max_rank: int,
                 dtype: torch.dtype) -> tuple[AdapterInfo, AdapterWeights]:
    """Read and check the PEFT adapter in ``path`` for a model described by ``targets``; raises
    ValueError saying what is wrong (and which tensor or limit) when it cannot be served."""
    path = Path(path).expanduser()
    cfg = read_adapter_config(path)
    weights_path = path / WEIGHTS
    if not weights_path.is_file():
        other = sorted(p.name for p in path.glob("adapter_model.*"))
        raise ValueError(f"LoRA adapter {path}: no {WEIGHTS}" + (f" (found {', '.join(other)}: only safetensors "
                                                                  f"are read)" if other else ""))
    fd = open_inside(path, WEIGHTS)  # the file checked is the file read (/proc/self/fd names it)
    tensors: dict[str, torch.Tensor] = {}
    try:
        size, limit = os.fstat(fd).st_size, max_weights_bytes(targets, max_rank)
        if size > limit:
            raise ValueError(f"LoRA adapter {path}: {WEIGHTS} is {size} bytes, more than an adapter of this model "
                             f"within --max-lora-rank {max_rank} can need ({limit} bytes)")
        with safe_open(f"/proc/self/fd/{fd}", framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensors[key] = f.get_tensor(key)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"LoRA adapter {path}: cannot read {WEIGHTS} ({e})") from None
    finally:
        os.close(fd)
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"LoRA adapter {path}: tensor {key!r} is not a LoRA A/B weight of an attention or MLP "
                             f"projection (supported targets: {', '.join(targets.modules)})")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in targets.modules:
            raise ValueError(f"LoRA adapter {path}: tensor {key!r} targets {module!r}, which this model's adapters "
                             f"cannot touch (supported: {', '.join(targets.modules)})")
        if not 0 <= layer < targets.num_layers:
            raise ValueError(f"LoRA adapter {path}: tensor {key!r} is for layer {layer}, the model has "
                             f"{targets.num_layers} layers")
        pairs.setdefault((layer, module), {})[ab] = (key, t)
    if not pairs:
        raise ValueError(f"LoRA adapter {path}: {WEIGHTS} holds no LoRA weights")
    alpha, rslora = cfg.lora_alpha, cfg.use_rslora
    layers: list[dict[str, list[tuple[ModuleTarget, torch.Tensor, torch.Tensor]]]] = [
        {} for _ in range(targets.num_layers)]
    top_rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"LoRA adapter {path}: layer {layer} {module} has no {missing} weight")
        tgt = targets.modules[module]
        (ka, a), (kb, b) = ab["A"], ab["B"]
        r = int(a.shape[0]) if a.dim() == 2 else -1
        out = tgt.hi - tgt.lo
        if a.dim() != 2 or tuple(a.shape) != (r, tgt.k):
            raise ValueError(f"LoRA adapter {path}: {ka} has shape {list(a.shape)}, this base model needs "
                             f"[rank, {tgt.k}] (an adapter made for another base model?)")
        if tuple(b.shape) != (out, r):
            raise ValueError(f"LoRA adapter {path}: {kb} has shape {list(b.shape)}, this base model needs "
                             f"[{out}, {r}] (an adapter made for another base model?)")
        if r < 1 or r > max_rank:
            raise ValueError(f"LoRA adapter {path}: rank {r} ({ka}) is above --max-lora-rank {max_rank}"
                             if r > max_rank else f"LoRA adapter {path}: {ka} has rank 0")
        full = ka[:ka.index(".lora_A")] if ".lora_A" in ka else ka
        mod_alpha = float(_pattern_value(cfg.alpha_pattern, full, alpha))
        scale = mod_alpha / (math.sqrt(r) if rslora else r)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"LoRA adapter {path}: layer {layer} {module} has non-finite weights")
        top_rank = max(top_rank, r)
        layers[layer].setdefault(tgt.role, []).append((tgt, a.float(), b.float() * scale))
    weights = AdapterWeights([{role: _fuse(parts, dtype) for role, parts in layer.items()} for layer in layers])
    modules = sorted({module for _, module in pairs})
    info = AdapterInfo(name=name, path=str(path), rank=top_rank, alpha=alpha, modules=modules,
                       base_model=cfg.base_model, nbytes=weights.nbytes,
                       extra={"rslora": rslora})
    return info, weights


def _fuse(parts: list[tuple[ModuleTarget, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> LoraUpdate:
    """A fused projection's parts (target, A [r, K], scaled B [out, r]) -> one ``LoraUpdate``."""
    assert parts and all(p[0].role in LORA_ROLES for p in parts)
    n = parts[0][0].n
    ranks = [int(a.shape[0]) for _, a, _ in parts]
    total = sum(ranks)
    a_all = torch.cat([a.t() for _, a, _ in parts], dim=1)  # [K, R]
    b_all = torch.zeros(total, n)
    spans = torch.zeros(total, 2, dtype=torch.int32)
    row = 0
    for (tgt, _, b), r in zip(parts, ranks, strict=True):
        b_all[row:row + r, tgt.lo:tgt.hi] = b.t()
        spans[row:row + r, 0], spans[row:row + r, 1] = tgt.lo, tgt.hi
        row += r
    return LoraUpdate.padded(a_all, b_all, spans, dtype)
