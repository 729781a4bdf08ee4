"""Tensor parallelism's split of a model: which heads and MLP columns each rank holds, and its tensors.

Owns ``Shard`` (a rank and the group's size), ``split`` (each rank's heads, KV heads and MLP columns)
and ``shard_layer`` / ``shard_args``: one layer's tensors as ``read_layer`` gives them (full
precision or a GGUF's blocks) cut down to one rank's part, and the ``ModelArgs`` that part is.

The split is Megatron's: the fused QKV and gate/up projections are cut by rows (each rank computes
its own heads and its own MLP columns: no communication), the O and down projections by columns
(each rank's product is a partial sum of the full output, which the ranks all-reduce: twice per
layer, after attention's O projection and after the MLP's down projection, before any norm reads
them). A MoE block's experts are each cut the same way (by rows of F, not expert-parallel), its
router is replicated; one all-reduce follows the block. Biases of the column-cut projections (O,
down) stay with rank 0 only, so the sum adds them once. Embedding, norms and the LM head are
replicated; every rank computes the same residual stream.

Heads go to ranks in whole KV groups (a KV head and its query heads), contiguous, as evenly as
the groups allow, the smaller share first (rank 0 also runs the scheduler, the LM head and
sampling): the default model's 3 groups of 3 heads split 1 | 2 over two ranks. With fewer KV
heads than ranks each KV head is replicated over ``size / Hkv`` ranks (``size`` must be a
multiple of Hkv) and its query heads split among them. MLP columns split as evenly as whole
blocks allow where the down projection is kept in a GGUF's blocks (a block's columns), else
exactly. A matrix whose blocks a cut would split is read dense (its values exactly; logged).

Invariants: the ranks' parts are disjoint and cover every head and MLP column once (KV heads: at
least once); a rank's tensors are exactly the full tensors' rows / columns, so the sum over ranks
of the partial O and down products is the full product up to float32 summation order.

Called by ``DecoderModel.from_pretrained`` (``shard=``) in each tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from lockgate.checkpoint.gguf_blocks import (
    Blocks,
    QuantMatrix,
    QuantStack,
    block_columns,
    select_columns,
    select_rows,
)
from lockgate.models.args import ModelArgs
from lockgate.models.layout import LayerTensors

log = logging.getLogger("lockgate.models")


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is out of range")


@dataclass(frozen=True)
class Part:
    """One rank's part: query heads [h0, h1), KV heads [kv0, kv1), MLP columns [f0, f1) (dense MLP),
    expert columns [e0, e1) (each expert of a MoE block)."""

    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]
    expert: tuple[int, int]


def even(total: int, n: int, unit: int = 1) -> list[tuple[int, int]]:
    """[lo, hi) for each of ``n`` ranks over ``total`` in whole ``unit``s, the smaller shares first;
    ValueError when a rank would get nothing."""
    units = total // unit
    if total % unit or units < n:
        raise ValueError(f"{total} cannot be split over {n} ranks in whole units of {unit}")
    return [(units * r // n * unit, units * (r + 1) // n * unit) for r in range(n)]


def split(a: ModelArgs, shard: Shard, mlp_unit: int = 1, expert_unit: int = 1) -> Part:
    """Rank ``shard.rank``'s heads and columns (module docstring); ValueError naming the flag and the
    model's head counts where they cannot be split over ``shard.size`` ranks."""
    n, r = shard.size, shard.rank
    h, hkv = a.num_heads, a.num_kv_heads
    g = h // hkv
    flag = f"--tensor-parallel-size {n}"
    if hkv >= n:
        kv0, kv1 = even(hkv, n)[r]
        heads = (kv0 * g, kv1 * g)
    else:
        copies = n // hkv
        if n % hkv or g < copies:
            raise ValueError(f"{flag}: the model has {h} attention heads in {hkv} KV groups; with fewer KV heads "
                             f"than ranks the ranks must be a multiple of the KV heads and each group's {g} heads "
                             f"must cover its {max(copies, 1)} ranks")
        kv0 = r // copies
        kv1 = kv0 + 1
        lo, hi = even(g, copies)[r % copies]
        heads = (kv0 * g + lo, kv0 * g + hi)
    try:
        mlp = even(a.intermediate_size, n, mlp_unit)[r] if a.intermediate_size else (0, 0)
        expert = even(a.moe.expert_size, n, expert_unit)[r] if a.moe is not None else (0, 0)
    except ValueError as e:
        raise ValueError(f"{flag}: the MLP's columns: {e}") from None
    return Part(heads, (kv0, kv1), mlp, expert)


def shard_args(a: ModelArgs, part: Part) -> ModelArgs:
    """The ``ModelArgs`` of one rank's part (its head counts and MLP width)."""
    moe = None if a.moe is None else dataclasses.replace(a.moe, expert_size=part.expert[1] - part.expert[0])
    return a.replace(num_heads=part.heads[1] - part.heads[0], num_kv_heads=part.kv_heads[1] - part.kv_heads[0],
                     intermediate_size=part.mlp[1] - part.mlp[0], moe=moe)


Matrix = torch.Tensor | Blocks


def _rows(m: Matrix, index: np.ndarray) -> Matrix:
    if isinstance(m, QuantMatrix | QuantStack):
        return select_rows(m, index)
    return m[torch.from_numpy(index)].contiguous()


def _columns(m: Matrix, lo: int, hi: int, what: str) -> Matrix:
    if isinstance(m, QuantMatrix | QuantStack):
        if lo % block_columns(m) == 0 and hi % block_columns(m) == 0:
            return select_columns(m, lo, hi)
        log.info("tensor parallelism: %s's blocks (%d columns each) do not split at column %d; reading it dense",
                 what, block_columns(m), lo if lo % block_columns(m) else hi)
        m = torch.from_numpy(m.dequantize())
    return m[:, lo:hi].contiguous()


def units(w: LayerTensors) -> tuple[int, int]:
    """The column units the MLP and the experts split in: a block's columns where the down
    projection is kept in blocks, else 1."""
    down = w.get("down_weight")
    mlp = block_columns(down) if isinstance(down, QuantMatrix | QuantStack) else 1
    experts = w.get("experts")
    ex = 1
    if experts:
        dn = experts[0][1]
        ex = block_columns(dn) if isinstance(dn, QuantMatrix | QuantStack) else 1
    return mlp, ex


def _fused_rows(first: tuple[int, int], total: int, copies: int) -> np.ndarray:
    """Rows [lo, hi) of each of ``copies`` stacked [total]-row parts (gate|up)."""
    lo, hi = first
    return np.concatenate([np.arange(c * total + lo, c * total + hi) for c in range(copies)]).astype(np.int64)


def shard_layer(w: LayerTensors, a: ModelArgs, part: Part, shard: Shard, i: int) -> LayerTensors:
    """Layer ``i``'s tensors (``read_layer``'s, for the full model ``a``) cut to ``part``."""
    d, h, hkv = a.head_dim, a.num_heads, a.num_kv_heads
    (h0, h1), (kv0, kv1) = part.heads, part.kv_heads
    qkv = np.concatenate([np.arange(h0 * d, h1 * d), h * d + np.arange(kv0 * d, kv1 * d),
                          (h + hkv) * d + np.arange(kv0 * d, kv1 * d)]).astype(np.int64)
    out = dict(w)
    out["qkv_weight"] = _rows(w["qkv_weight"], qkv)
    if w.get("qkv_bias") is not None:
        out["qkv_bias"] = w["qkv_bias"][torch.from_numpy(qkv)]
    out["o_weight"] = _columns(w["o_weight"], h0 * d, h1 * d, f"layer {i}'s o_proj")
    lead = shard.rank == 0  # the column-cut projections' biases are added once, by rank 0
    if not lead:
        out["o_bias"] = None
        out["down_bias"] = None
    if w.get("gate_up_weight") is not None:
        f = a.intermediate_size
        rows = _fused_rows(part.mlp, f, 2)
        out["gate_up_weight"] = _rows(w["gate_up_weight"], rows)
        if w.get("gate_up_bias") is not None:
            out["gate_up_bias"] = w["gate_up_bias"][torch.from_numpy(rows)]
        out["down_weight"] = _columns(w["down_weight"], part.mlp[0], part.mlp[1], f"layer {i}'s down_proj")
    if w.get("experts") is not None:
        assert a.moe is not None
        rows = _fused_rows(part.expert, a.moe.expert_size, 2)
        out["experts"] = [(_rows(gu, rows), _columns(dn, part.expert[0], part.expert[1], f"layer {i}'s expert {e}"))
                          for e, (gu, dn) in enumerate(w["experts"])]
    return out
