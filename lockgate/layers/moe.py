"""A mixture-of-experts MLP block: top-k routing and the experts' matmuls grouped by expert.

Owns ``MoeBlock``: the router weight [E, hidden] and each expert's fused gate/up and down
projections (``Linear``s, so an expert's weight has the same forms as any projection: dense, and
the integer forms where the checkpoint's values sit on a 4- or 8-bit grid; each follows its static
choice, the tuning measures the dense roles only).

How a step runs: router logits in the run dtype, softmax in float32, the ``top_k`` experts per
token (renormalised to sum to 1 when ``norm_topk``: Qwen3-MoE's ``norm_topk_prob``, always for
Mixtral), weights back to the run dtype. Tokens are sorted by expert (stable), and each expert with
tokens runs once on all of its rows: gate/up, the activation, down, times each row's weight,
added into the output with ``index_add_`` (the order transformers' eager loop uses, so float32
results match it). Experts with no token this step cost nothing.

Invariants: a token's output depends only on its own row (routing is per row, and an expert's
matmul computes each row on its own up to the matmul's blocking: batch-invariant only with a
row-invariant form); the output has the input's shape and dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lockgate.layers.linear import Linear


class MoeBlock:
    """router [E, hidden] (run dtype); ``experts[e]`` = (gate_up [2 F, hidden], down [hidden, F])."""

    def __init__(self, router: torch.Tensor, experts: list[tuple[Linear, Linear]], top_k: int, norm_topk: bool) -> None:
        if not 1 <= top_k <= len(experts):
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={len(experts)}")
        self.router = router
        self.experts = experts
        self.top_k = top_k
        self.norm_topk = norm_topk

    def __call__(self, x: torch.Tensor, act_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; ``act_mul``: [T, 2 F] gate|up -> [T, F] (silu(gate) * up)."""
        logits = torch.nn.functional.linear(x, self.router)  # [T, E]
        probs = logits.float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = chosen.flatten()  # [T k]: token t's j-th expert at t * k + j
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows_of = order // self.top_k  # the token of each sorted entry
        w_of = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = rows_of[start:start + n]
            gate_up, down = self.experts[e]
            h = down(act_mul(gate_up(x.index_select(0, rows))))  # [n, hidden]
            out.index_add_(0, rows, h * w_of[start:start + n, None])
            start += n
        return out

    def linears(self) -> list[Linear]:
        return [lin for pair in self.experts for lin in pair]
