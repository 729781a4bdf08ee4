"""Memory planned before anything heavy loads: weights, KV pool and overhead, in bytes.

Owns ``MemoryPlan`` and ``plan_memory``: from the checkpoint's tensor table (a GGUF's types and
shapes, or a safetensors directory's parameter count), the run dtype and the KV pool's size, what
the scheduler process will hold resident, against what the machine has available
(``MemAvailable``). The start-up log states it; a model that cannot fit is refused with the figures
(``check``) before a weight is read or the pool allocated.

What is counted:

* weights: a GGUF's projections and LM head kept in their blocks (the direct types of
  ``checkpoint.gguf_blocks``: Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K / Q5_K / Q6_K) as the integer GEMM
  packs them (``gguf_blocks.resident_bytes``: half a byte or a byte per weight, plus float16 steps
  and lows, or a K-quant's int8 factors and float16 super-scales; a fused projection whose parts
  differ in type at a byte per weight: ``stacked_resident_bytes``); every other matrix, and every tensor of a safetensors checkpoint, dense in
  the run dtype; a GGUF's token embedding not at all (its rows are read from the file as steps use
  them: ``layers.embedding``);
* the KV pool: tokens x (layers x 2 x KV heads x head size x the dtype's bytes);
* overhead: the process itself (``RUNTIME_BYTES``: torch, the kernels, Python) and one step's
  activations at the prefill budget (the residual stream, q/k/v, the MLP's gate/up rows, their
  float32 widening) plus the logits buffer.

Figures are estimates within a few percent of what is measured (``benchmarks/serve_footprint.py``);
the check leaves the rest of the machine's memory to the kernel's page cache and the other processes.

Torch-free (the dtype comes in as a byte count).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockgate.checkpoint.gguf_blocks import (
    BLOCK_VALUES,
    DIRECT_TYPES,
    K_QUANTS,
    resident_bytes,
    stacked_resident_bytes,
)

log = logging.getLogger("lockgate.runner")

RUNTIME_BYTES = 450 * 1024**2  # the scheduler process before weights: Python, torch, lockgate's kernels


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv_pool: int
    overhead: int
    available: int | None  # MemAvailable when planned (None: not known)

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.overhead

    def describe(self) -> str:
        gib = 1024**3
        have = f"{self.available / gib:.2f} GiB available" if self.available is not None else "available memory unknown"
        return (f"memory plan: weights {self.weights / gib:.2f} GiB + KV pool {self.kv_pool / gib:.2f} GiB + "
                f"overhead {self.overhead / gib:.2f} GiB = {self.total / gib:.2f} GiB ({have})")

    def check(self) -> None:
        """ValueError with the figures when the plan does not fit the available memory."""
        if self.available is not None and self.total > self.available:
            raise ValueError(f"the model does not fit this machine's memory: {self.describe()}; lower "
                             "--kv-cache-memory / --max-total-tokens, or serve a smaller model or quantization")


def available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gguf_weights_bytes(tensors: list[tuple[str, str, tuple[int, ...]]], elem: int, packed: bool) -> int:
    """Resident bytes of a GGUF's weights: (Hugging Face name, GGUF type, shape) per tensor."""
    total = 0
    groups: dict[tuple[str, str], list[tuple[str, int, int]]] = {}
    tied = not any(name == "lm_head.weight" for name, _, _ in tensors)
    for name, qtype, shape in tensors:
        n, k = (shape[0], shape[1]) if len(shape) == 2 else (shape[0], 1)
        if name == "model.embed_tokens.weight":
            if not packed:  # de-quantized whole: the table, and the tied head's copy of it
                total += n * k * elem * (2 if tied else 1)
            elif tied:  # rows read per lookup; the tied head is packed from the same blocks
                total += resident_bytes(qtype, n, k) if qtype in DIRECT_TYPES else n * k * elem
            continue
        if packed and len(shape) == 2 and qtype in DIRECT_TYPES and k % BLOCK_VALUES[qtype] == 0:
            fused = _FUSED.get(name.rsplit(".", 2)[-2]) if name.count(".") >= 2 else None
            if fused is not None:  # counted with the rest of its fused projection
                groups.setdefault((name.rsplit(".", 2)[0], fused), []).append((qtype, n, k))
                continue
            total += resident_bytes(qtype, n, k)
        else:
            total += n * k * elem
    for parts in groups.values():
        types = {q for q, _, _ in parts}
        exact = len(types) == 1 or types <= set(K_QUANTS) or not types & set(K_QUANTS)
        total += stacked_resident_bytes(parts) if exact else sum(n * k * elem for _, n, k in parts)
    return total


# the projections a loader fuses (``CheckpointReader.matrix``): parts of different block types are
# held on a common 8-bit grid (``QuantStack``), or dense where K-quant and legacy blocks meet
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def activation_bytes(args: Any, prefill_tokens: int, elem: int, logits_rows: int) -> int:
    """One step's largest activations at ``prefill_tokens`` rows, and the float32 logits buffer."""
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    per_row = (2 * args.hidden_size + qkv + 3 * args.intermediate_size) * max(elem, 4)
    return prefill_tokens * per_row + logits_rows * args.vocab_size * 4


def plan_memory(args: Any, elem: int, kv_pool: int, prefill_tokens: int, *, gguf_tensors: list[Any] | None = None,
                packed: bool = True, fp32_copies: bool = False) -> MemoryPlan:
    """The plan for a model of ``args`` in a dtype of ``elem`` bytes with a ``kv_pool``-byte pool:
    ``gguf_tensors`` (name, type, shape) when the weights come from a GGUF, else a dense checkpoint
    (``args.matmul_parameters`` plus the embedding, in the run dtype; float32 copies too when made)."""
    if gguf_tensors is not None:
        weights = gguf_weights_bytes(gguf_tensors, elem, packed)
    else:
        table = args.vocab_size * args.hidden_size * (1 if args.tie_word_embeddings else 2)
        weights = (args.matmul_parameters + table) * elem + (4 * args.matmul_parameters if fp32_copies else 0)
    overhead = RUNTIME_BYTES + activation_bytes(args, prefill_tokens, elem, logits_rows=min(prefill_tokens, 256))
    return MemoryPlan(weights, kv_pool, overhead, available_bytes())
