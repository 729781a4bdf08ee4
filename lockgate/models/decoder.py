"""The shared decoder: every supported family's layers, weights and forward over one step of flat tokens.

Owns ``DecoderLayer`` (one block's weights and its ``Linear`` projections) and ``DecoderModel``
(embedding, layers, final norm, LM head, rope tables, the forward). What differs between
families is data, in ``ModelArgs`` (``models/args.py``): the activation (SwiGLU or GeGLU), q/k
norms, Gemma's extra norms around attention and the MLP, embedding scaling, the attention scale
and soft-capping, sliding-window layers and their own rope, a mixture-of-experts MLP. Which
tensors of a checkpoint fill a layer is the family's (``models/registry.py`` -> ``read_layer``).

Invariants:

* Weights are fused at load: one QKV matmul ([(H + 2 Hkv) D, hidden]) and one gate/up matmul
  ([2 F, hidden]) per layer, each a ``lockgate.layers.linear.Linear`` with its forms
  (``lockgate.layers.forms.make_forms``: dense always; with ``quantization`` auto/int4 the
  quantized forms, made from the checkpoint's full-precision values read as float32 one layer
  at a time, before rounding to the run dtype, auto only where nothing is lost; with ``fp32`` a
  float32 copy for 16-bit runs), for every family. The LM head gets quantized forms only where
  nothing is lost. Which form serves which call is each projection's ``FormChoice``, by role
  (``projections``, ``choose_forms``), measured by ``lockgate.runner.tuning``; MoE experts follow
  their static choice.
* The forward gets the step's tokens flat (input_ids [T], positions [T]) plus an
  ``AttentionMetadata`` built once per step, writes the step's K/V into the pool at
  ``out_slots`` and returns float32 logits only for ``logits_rows`` (the last token of each
  sampled sequence), skipping the final norm and LM head for everything else (on the one-call
  path also the last layer's attention, o projection and MLP, where that changes no bit of the
  sampled rows: ``KernelOps.whole_step``; on the layer loop, those only for a step that samples no
  row, a middle prompt chunk); with ``argmax``
  (plain greedy steps) it returns those rows' argmax tokens instead, taken on the head's output
  in the run dtype, in the same row blocks and forms the logits would have come from.
* The one-call fused step (``LayerOps.whole_step``) runs only for the plain Llama layout
  (``ModelArgs.plain``) and steps without LoRA adapters; a windowed layer whose step has a context
  longer than its window, or a soft-capped one, attends with ``windowed_attention``.
* Tensor parallelism (``from_pretrained(shard=...)``, ``models/shard.py``): a rank's model holds
  its heads and MLP columns, its ``args`` are that part's, and ``reduce`` (set by the runner) sums
  the O projection's and the MLP's (or MoE block's) output over the ranks in place, before any norm
  reads them; with ``reduce`` set the one-call fused step is not taken.
* Unsupported architectures or features raise ``ValueError`` at load naming the key, and a
  missing or misshapen tensor names the tensor and the shape config.json implies.

Called by ``lockgate.runner.model_runner`` (load + one forward per step), ``lockgate.runner.form_choice``
(forms chosen at start) and tests.
"""

from __future__ import annotations

import json
import logging
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lockgate.checkpoint.gguf_blocks import Blocks, QuantMatrix, QuantStack
from lockgate.checkpoint.gguf_tensors import GgufWeights
from lockgate.kernel_choice import FORM_NAMES, FormChoice
from lockgate.layers.attention import paged_attention, windowed_attention
from lockgate.layers.attention_meta import AttentionMetadata
from lockgate.layers.embedding import PackedEmbedding
from lockgate.layers.forms import IntGemmWeight, make_forms, packed_forms
from lockgate.layers.grid import INT4_MODES
from lockgate.layers.linear import Linear
from lockgate.layers.lora import LoraStep
from lockgate.layers.moe import MoeBlock
from lockgate.layers.norm import rms_norm
from lockgate.layers.ops import KernelOps, LayerOps, TorchOps, gelu_tanh_mul
from lockgate.layers.rope import RotaryEmbedding
from lockgate.models.args import ModelArgs
from lockgate.models.layout import LayerTensors
from lockgate.models.registry import family_for
from lockgate.models.shard import Part, Shard, shard_args, shard_layer, split, units
from lockgate.models.weights import CheckpointReader, log_quantization

log = logging.getLogger("lockgate.models")

PROJECTION_ROLES = ("qkv", "o", "gate_up", "down", "head")  # ``DecoderModel.projections``' keys
# Most bytes of LM-head output computed at once when the caller gives a logits buffer: below glibc's
# largest mmap threshold (32 MB), so steady steps take it from the heap instead of mapping and
# faulting in fresh pages every step (a 384-row step's 38 MB of bf16 logits: ~35 ms on 2 MB pages).
HEAD_BLOCK_BYTES = 16 << 20
_NO_ROWS = torch.zeros(0, dtype=torch.int64)  # a step that samples no row (a middle prompt chunk)



def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class DecoderLayer(nn.Module):
    """Weights of one transformer block (fused QKV and gate/up, or a MoE block) and their projections."""

    attn_norm: nn.Parameter
    qkv_weight: nn.Parameter | None  # None: kept in the GGUF's blocks (its Linear has only packed forms)
    qkv_bias: nn.Parameter | None
    o_weight: nn.Parameter | None
    o_bias: nn.Parameter | None
    mlp_norm: nn.Parameter
    gate_up_weight: nn.Parameter | None
    gate_up_bias: nn.Parameter | None
    down_weight: nn.Parameter | None
    down_bias: nn.Parameter | None
    q_norm: nn.Parameter | None
    k_norm: nn.Parameter | None
    post_attn_norm: nn.Parameter | None
    post_mlp_norm: nn.Parameter | None

    def __init__(self, w: LayerTensors, dtype: torch.dtype, quantization: str = "none",
                 fp32: bool = False, cpu_kernels: bool = False, want: dict[str, set[str]] | None = None,
                 packed_want: dict[str, set[str]] | None = None):
        """``w``: this layer's tensors at full precision (any float dtype), cast here to ``dtype``:
        attn_norm, qkv_weight, qkv_bias, o_weight, o_bias, mlp_norm (the norm before the MLP),
        gate_up_weight/bias and down_weight/bias (a dense MLP), optional q_norm/k_norm ([D], per
        head), post_attn_norm/post_mlp_norm (Gemma), and for a MoE block router [E, hidden] and
        experts (per expert (gate_up [2 F, hidden], down [hidden, F])) with top_k / norm_topk.
        ``quantization``, ``fp32`` (make float32 copies) and ``cpu_kernels`` (lockgate's kernels
        are loaded) decide the projections' forms (``make_forms``); ``want``: per projection
        (qkv, o, gate_up, down) the forms to make, None for every one it can have. A matrix given as
        a GGUF's blocks gets ``packed_want``'s forms (a forced ``--matmul-forms``), None: its one
        default form (``packed_forms``), never a dense copy unless named there."""
        super().__init__()

        def need(name: str) -> nn.Parameter:
            t = w[name]
            assert t is not None, name
            return _frozen(t.to(dtype))

        def opt(name: str) -> nn.Parameter | None:
            t = w.get(name)
            return None if t is None else _frozen(t.to(dtype))

        def matrix(name: str) -> nn.Parameter | None:  # a GGUF's blocks stay out of the parameters
            t = w.get(name)
            return None if t is None or isinstance(t, (QuantMatrix, QuantStack)) else _frozen(t.to(dtype))

        self.attn_norm = need("attn_norm")  # [hidden]
        self.qkv_weight = matrix("qkv_weight")  # [(H + 2 Hkv) D, hidden]
        self.qkv_bias = opt("qkv_bias")  # [(H + 2 Hkv) D] or None
        self.o_weight = matrix("o_weight")  # [hidden, H D]
        self.o_bias = opt("o_bias")  # [hidden] or None
        self.mlp_norm = need("mlp_norm")  # [hidden]
        self.gate_up_weight = matrix("gate_up_weight")  # [2 F, hidden] (None in a MoE block)
        self.gate_up_bias = opt("gate_up_bias")  # [2 F] or None
        self.down_weight = matrix("down_weight")  # [hidden, F]
        self.down_bias = opt("down_bias")  # [hidden] or None
        self.q_norm = opt("q_norm")  # [D] or None
        self.k_norm = opt("k_norm")  # [D] or None
        self.post_attn_norm = opt("post_attn_norm")  # [hidden] or None (Gemma)
        self.post_mlp_norm = opt("post_mlp_norm")  # [hidden] or None (Gemma)

        def forms(source: torch.Tensor, name: str, bias: torch.Tensor | None, dense: torch.Tensor,
                  expert: bool = False) -> dict[str, typing.Any]:
            wanted = set(FORM_NAMES) if want is None else want.get(name, set())
            if expert:  # experts keep their static choice, which never calls these forms
                wanted = wanted - {"bf16-gemm", "fp32", "f32-dot"}
            return make_forms(source, dtype, quantization, cpu_kernels, fp32=fp32, source_bias=bias,
                              want=None if want is None and not expert else wanted, dense=dense)

        def project(source: torch.Tensor | Blocks, name: str, bias: nn.Parameter | None,
                    source_bias: torch.Tensor | None, expert: bool = False) -> Linear:
            """A projection of ``source``: kept in its GGUF blocks where a kernel reads them (no
            dense weight), else dense with its forms."""
            if isinstance(source, (QuantMatrix, QuantStack)):
                wanted = None if packed_want is None else packed_want.get(name, set())
                packed = packed_forms(source, cpu_kernels, wanted) if quantization != "none" else {}
                if packed and (wanted is None or "dense" not in wanted):
                    return Linear(None, bias, packed, shape=source.shape)
                dense = torch.from_numpy(source.dequantize())  # dense asked for, or no kernel reads the blocks here
                weight = dense.to(dtype)
                return Linear(weight, bias, packed or forms(dense, name, source_bias, weight, expert))
            weight = source.to(dtype)
            return Linear(weight, bias, forms(source, name, source_bias, weight, expert))

        def linear(name: str) -> Linear:
            lin = project(w[f"{name}_weight"], name, getattr(self, f"{name}_bias"), w.get(f"{name}_bias"))
            if lin.weight is not None:
                setattr(self, f"{name}_weight", _frozen(lin.weight))
            return lin

        self.qkv = linear("qkv")
        self.o = linear("o")
        has_mlp = w.get("gate_up_weight") is not None and w.get("down_weight") is not None
        self.gate_up: Linear | None = linear("gate_up") if has_mlp else None
        self.down: Linear | None = linear("down") if has_mlp else None
        self.moe: MoeBlock | None = None
        if w.get("experts") is not None:
            experts = [(project(gu, "gate_up", None, None, expert=True), project(dn, "down", None, None, expert=True))
                       for gu, dn in w["experts"]]
            self.moe = MoeBlock(w["router"].to(dtype), experts, int(w["top_k"]), bool(w["norm_topk"]))

    def projections(self) -> dict[str, Linear]:
        """The dense projections (a MoE block's experts are not among them)."""
        out = {"qkv": self.qkv, "o": self.o}
        if self.gate_up is not None and self.down is not None:
            out.update(gate_up=self.gate_up, down=self.down)
        return out


class DecoderModel(nn.Module):
    """A decoder-only model of any supported family over the slot-indexed KV pool."""

    def __init__(self, args: ModelArgs, embed: torch.Tensor | PackedEmbedding, layers: list[DecoderLayer],
                 norm: torch.Tensor, lm_head: torch.Tensor | Blocks | None, dtype: torch.dtype | None = None,
                 fp32: bool = False, quantization: str = "none", cpu_kernels: bool = False,
                 head_want: set[str] | None = None, head_blocks: QuantMatrix | None = None,
                 head_packed_want: set[str] | None = None):
        """embed/norm/lm_head at full precision, cast to ``dtype`` (default: embed's). The LM head
        gets quantized forms only where they lose nothing (``quantization`` other than none): a
        head is a poor place to lose precision. ``head_want``: the head's forms to make (None: all).
        A GGUF's tables may stay in their blocks: ``embed`` a ``PackedEmbedding`` (rows
        de-quantized per lookup), the head ``lm_head`` (or, tied, ``head_blocks``: the embedding's
        blocks) a ``QuantMatrix`` the integer kernel reads as it is."""
        super().__init__()
        dtype = dtype or (embed.dtype if isinstance(embed, torch.Tensor) else torch.float32)
        device = embed.device if isinstance(embed, torch.Tensor) else torch.device("cpu")
        self.args = args
        # tensor parallelism (``models/shard.py``): sums the ranks' partial O / down / MoE outputs in
        # place (the runner's all-reduce); None: this process holds the whole model
        self.reduce: Callable[[torch.Tensor], None] | None = None
        self.packed_embed = embed if isinstance(embed, PackedEmbedding) else None
        self.embed: nn.Parameter | None = _frozen(embed.to(dtype)) if isinstance(embed, torch.Tensor) else None  # [V, hidden]
        self.layers = nn.ModuleList(layers)
        self.norm = _frozen(norm.to(dtype))  # [hidden]
        source: torch.Tensor | Blocks | None = lm_head if lm_head is not None else head_blocks
        packed = packed_forms(source, cpu_kernels, head_packed_want) if isinstance(source, (QuantMatrix, QuantStack)) and \
            quantization != "none" else {}
        if isinstance(source, (QuantMatrix, QuantStack)) and packed and (head_packed_want is None or "dense" not in head_packed_want):
            self.lm_head: nn.Parameter | None = None
            self.head = Linear(None, None, packed, shape=source.shape)
        else:
            if isinstance(source, (QuantMatrix, QuantStack)):
                source = torch.from_numpy(source.dequantize())
            if source is None and self.packed_embed is not None:  # tied to a table no kernel reads as it is
                source = self.packed_embed.dense()
            if source is None:  # tied to the dense table
                assert isinstance(embed, torch.Tensor)
                self.lm_head, full = self.embed, embed
            else:
                self.lm_head, full = _frozen(source.to(dtype)), source  # [V, hidden]
            head_forms = packed or make_forms(full, dtype, "none" if quantization == "none" else "auto", cpu_kernels,
                                              fp32=fp32, want=head_want, dense=self.lm_head)
            self.head = Linear(self.lm_head, None, head_forms)
        self.rope = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling, device)
        # Gemma 3: the sliding layers rotate with their own table
        self.local_rope = None if args.local_rope is None else \
            RotaryEmbedding(args.head_dim, args.local_rope[0], args.local_rope[1], device)
        self.scale = args.scale
        # The layers' ops backend: lockgate's fused CPU ops when ``lockgate.kernels`` is loaded
        # (with a one-call fast path for steps whose attention is one kernel group), else plain torch.
        self.ops: LayerOps = KernelOps() if cpu_kernels else TorchOps()

    def use_kernels(self, on: bool) -> None:
        """Run the layers on lockgate's fused CPU ops (``on``; they must be loaded) or on plain torch."""
        if on != self.fused_ops:
            self.ops = KernelOps() if on else TorchOps()

    @property
    def fused_ops(self) -> bool:
        return self.ops.name == "kernels"

    def projections(self) -> dict[str, list[Linear]]:
        """Every dense projection by role (qkv, o, gate_up, down: one per layer, a role only when
        every layer has it; head: the LM head)."""
        roles: dict[str, list[Linear]] = {"qkv": [], "o": [], "gate_up": [], "down": []}
        for layer in typing.cast(list[DecoderLayer], self.layers):
            for role, lin in layer.projections().items():
                roles[role].append(lin)
        roles = {r: lins for r, lins in roles.items() if len(lins) == len(self.layers)}
        roles["head"] = [self.head]
        return roles

    def all_linears(self) -> list[Linear]:
        """Every projection with forms: the dense ones, the LM head and every MoE expert's."""
        out = [lin for layer in typing.cast(list[DecoderLayer], self.layers) for lin in layer.projections().values()]
        out += [lin for layer in typing.cast(list[DecoderLayer], self.layers) if layer.moe for lin in layer.moe.linears()]
        return [*out, self.head]

    def use_int8_activations(self) -> tuple[int, int]:
        """Every 4-bit integer-GEMM form rounds its x to int8 (``--activation-quant int8``):
        (projections that now do, projections in all)."""
        lins = self.all_linears()
        changed = 0
        for lin in lins:
            form = lin.forms.get("int-gemm")
            if isinstance(form, IntGemmWeight) and form.bits == 4:
                lin.forms["int-gemm"] = form.with_int8_activations()
                changed += 1
        return changed, len(lins)

    def choose_forms(self, choices: dict[str, FormChoice], drop: bool = False) -> None:
        """Give each role's projections their choice (``Linear.choose``); roles not named keep
        theirs. ``drop``: free the forms no choice calls (a measured table is final)."""
        for role, lins in self.projections().items():
            for lin in lins:
                if role in choices:
                    lin.choose(choices[role])
                if drop:
                    lin.drop_unchosen()
        self.ops.forget()  # the whole-step path packed the old choices' weights

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden] in the run dtype (from the packed table when it is one)."""
        if self.packed_embed is not None:
            return self.packed_embed(input_ids)
        assert self.embed is not None
        return F.embedding(input_ids, self.embed)

    def kv_shape(self, capacity: int) -> tuple[int, int, int, int]:
        """Shape of each KV pool tensor: [num_layers, capacity, Hkv, D]."""
        a = self.args
        return (a.num_layers, capacity, a.num_kv_heads, a.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                logits_rows: torch.Tensor | None, lora: LoraStep | None = None,
                decode_rows: int | None = None, logits_out: torch.Tensor | None = None,
                argmax: bool = False, head: bool = True) -> torch.Tensor | None:
        """input_ids/positions [T] i64, k_cache/v_cache [layers, capacity, Hkv, D],
        logits_rows [S] i64 (rows of T, ascending) -> logits [S, V] f32, or None when logits_rows is None.
        ``lora``: the step's adapters (rows' low-rank updates of every projection), None for none.
        ``decode_rows``: the first rows are decode rows, the rest prompt rows; a step with prompt
        rows runs every projection on its prompt form (``Linear``); None: none are prompt rows.
        ``logits_out``: float32 [>= S, V] the logits are written into (its first S rows are returned),
        so a caller running step after step reuses one buffer: a fresh [S, V] float32 tensor past
        glibc's 32 MB mmap threshold (about 170 rows of a 49k vocabulary) is mapped and faulted in
        anew each step (a 384-row step: 70 ms of page faults on 2 MB pages); None: a new tensor.
        ``argmax``: return each row's argmax (int64 [S], ``lockgate::argmax_rows``: torch's rules)
        instead of its logits, taken on the head's output in the run dtype block by block (greedy
        steps: no float32 [S, V] is written or read); needs lockgate's kernels and no final softcap.
        ``head``: False stops after the layers and returns None (a tensor-parallel rank other than 0:
        its layers run as rank 0's do, ``logits_rows`` deciding whether the last one runs whole).
        """
        a = self.args
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if a.embed_scale is not None:
            x = x * torch.tensor(a.embed_scale, dtype=x.dtype)  # Gemma: the normaliser rounded to the run dtype
        cos, sin = self.rope.cos_sin(positions, x.dtype)  # [T, 1, D] each
        layers = typing.cast(list[DecoderLayer], self.layers)
        prompt_rows = decode_rows is not None and decode_rows < x.shape[0]  # the step has prompt rows
        whole = None if lora is not None or not a.plain or self.reduce is not None else self.ops.whole_step(
            x, cos, sin, meta, k_cache, v_cache, layers, a.num_heads, a.num_kv_heads, a.rms_norm_eps, self.scale,
            prompt_rows, _NO_ROWS if logits_rows is None else logits_rows)  # only those rows go on
        if whole is not None:
            x = whole
        else:
            local = None if self.local_rope is None else self.local_rope.cos_sin(positions, x.dtype)
            x = self._layers(x, (cos, sin), local, meta, k_cache, v_cache, lora, prompt_rows,
                             sampled=logits_rows is not None and logits_rows.shape[0] > 0)
        if logits_rows is None or not head:
            return None
        x = rms_norm(x.index_select(0, logits_rows), self.norm, a.rms_norm_eps)  # [S, hidden]
        sampled_prompt = decode_rows is not None and int(logits_rows[-1]) >= decode_rows  # ascending; decode rows first
        if argmax:
            if a.final_softcap is not None:
                raise ValueError("argmax: the final softcap would be skipped (it can merge the largest logits)")
            tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
            for rows, block in self._head_blocks(x, sampled_prompt):  # the blocks the logits path makes
                tokens[rows] = torch.ops.lockgate.argmax_rows(block)
            return tokens
        if logits_out is None:
            logits = self.head(x, sampled_prompt).float()  # [S, V]
        else:
            logits = logits_out[:x.shape[0]]
            for rows, block in self._head_blocks(x, sampled_prompt):
                logits[rows].copy_(block)
        if a.final_softcap is not None:
            logits = logits.div_(a.final_softcap).tanh_().mul_(a.final_softcap)  # in place: the buffer stays
        return logits

    def _head_blocks(self, x: torch.Tensor, sampled_prompt: bool) -> Iterator[tuple[slice, torch.Tensor]]:
        """The LM head's output for x's rows in as few even blocks of rows as stay under
        HEAD_BLOCK_BYTES (on the heap, not mmap'd anew each step): (the rows, their output)."""
        s = x.shape[0]
        blocks = -(-s * self.args.vocab_size * x.element_size() // HEAD_BLOCK_BYTES)
        step = max(1, -(-s // max(blocks, 1)))
        for lo in range(0, s, step):
            yield slice(lo, lo + step), self.head(x[lo:lo + step], sampled_prompt)

    def _layers(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                local_rope: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor, lora: LoraStep | None = None,
                prompt_rows: bool = False, sampled: bool = True) -> torch.Tensor:
        """The decoder layers on ``self.ops`` (torch, or lockgate's fused kernels): x [T, hidden] ->
        [T, hidden], the residual stream, updated in place. Each layer's MLP output is added at the
        start of the next (``add_norm``), where the kernel backend fuses the add into the norm.
        ``rope``: (cos, sin) [T, 1, D]; ``local_rope``: the sliding layers' own (Gemma 3), else None.
        ``lora``: each projection's output gets its rows' adapter updates (``LoraStep.add``).
        ``prompt_rows``: the step has prompt rows (every projection's call then runs on its prompt form).
        ``sampled``: some row's result is read; False (a middle prompt chunk alone) stops after the
        last layer's K/V are written (nothing past them is read), and x is then left meaningless."""
        a, ops = self.args, self.ops
        t = x.shape[0]
        h, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        act_mul = ops.silu_mul if a.act == "silu" else gelu_tanh_mul
        longest = meta.longest_context
        pending: torch.Tensor | None = None  # the previous layer's MLP output, not yet added to x

        def project(lin: Linear, inp: torch.Tensor, i: int, role: str) -> torch.Tensor:
            out = lin(inp, prompt_rows)
            return out if lora is None else lora.add(out, inp, i, role)

        for i, layer in enumerate(typing.cast(list[DecoderLayer], self.layers)):
            window = a.layer_windows[i]
            cos, sin = local_rope if window is not None and local_rope is not None else rope
            y = ops.add_norm(x, pending, layer.attn_norm, a.rms_norm_eps)  # x += pending; [T, hidden]
            qkv = project(layer.qkv, y, i, "qkv")
            if layer.q_norm is not None and layer.k_norm is not None:
                qkv = _qk_norm(qkv, layer.q_norm, layer.k_norm, h, hkv, d, a.rms_norm_eps)
            q, k, v = ops.rope_qkv(qkv, cos, sin, h, hkv, k_cache[i], v_cache[i], meta.out_slots)
            if not sampled and i == a.num_layers - 1:
                return x  # the last layer's K/V are in the pool; its output would go unread
            if a.attn_softcap is not None or (window is not None and longest > window):
                o = windowed_attention(q, k, v, k_cache[i], v_cache[i], meta, self.scale, window, a.attn_softcap)
            else:
                o = paged_attention(q, k, v, k_cache[i], v_cache[i], meta, self.scale)  # [T, H, D]
            o = project(layer.o, o.reshape(t, h * d), i, "o")
            if self.reduce is not None:
                self.reduce(o)  # the ranks' partial sums of the O projection
            if layer.post_attn_norm is not None:
                o = rms_norm(o, layer.post_attn_norm, a.rms_norm_eps)
            y = ops.add_norm(x, o, layer.mlp_norm, a.rms_norm_eps)
            if layer.moe is not None:
                m = layer.moe(y, act_mul)
            else:
                assert layer.gate_up is not None and layer.down is not None
                m = project(layer.down, act_mul(project(layer.gate_up, y, i, "gate_up")), i, "down")
            if self.reduce is not None:
                self.reduce(m)  # the ranks' partial sums of the down projection (or the experts')
            pending = m if layer.post_mlp_norm is None else rms_norm(m, layer.post_mlp_norm, a.rms_norm_eps)
        if pending is not None:
            x += pending
        return x

    @staticmethod
    def from_pretrained(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu", quantization: str = "none",
                        fp32: bool = False, cpu_kernels: bool = False,
                        want: dict[str, set[str]] | None = None, gguf: GgufWeights | None = None,
                        packed_want: dict[str, set[str]] | None = None, shard: Shard | None = None) -> DecoderModel:
        """Load config.json + safetensors (all shards) from a Hugging Face model directory of any
        supported family (``models/registry.py``).

        ``fp32``: 16-bit runs also keep float32 copies of every projection and the LM head, made
        from the checkpoint's values (the ``fp32`` form).
        ``quantization`` (``lockgate.layers.grid.INT4_MODES``): none, int4 (every projection the
        kernel fits), auto (only projections already on a 4- or 8-bit grid: nothing lost).
        ``cpu_kernels``: lockgate's CPU kernels are loaded (``lockgate.kernels.load``): the model
        runs its fused ops and may have lockgate's quantized forms (``make_forms``).
        ``want``: per role (qkv, o, gate_up, down, head) the forms to make; None: every form a
        projection can have (what a measurement needs). Projections follow their static choice
        (``FormChoice.static``) until ``choose_forms``. ``gguf``: the directory's GGUF, already
        opened (a converted GGUF's weights are read from it; else opened here). ``packed_want``: per
        role the forms a GGUF's blocks get (a forced ``--matmul-forms``); None: one default form each.
        ``shard``: load only this tensor-parallel rank's heads and MLP columns (``models/shard.py``);
        the model's ``args`` are then that part's, and ``reduce`` must be set before a forward.
        """
        if quantization not in INT4_MODES:
            raise ValueError(f"quantization {quantization!r} is not one of {INT4_MODES}")
        # quantized and float32 forms are made from the unrounded values (read one layer at a time)
        source = dtype if quantization == "none" and not fp32 else torch.float32
        model_dir = Path(model_dir)
        cfg_path = model_dir / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{model_dir}: no config.json")
        cfg = json.loads(cfg_path.read_text())
        family = family_for(cfg)
        args = family.parse(cfg)
        table_shape = (args.vocab_size, args.hidden_size)
        with CheckpointReader(model_dir, dtype, torch.device(device), packed=quantization != "none", gguf=gguf) as w:
            layers = []
            part: Part | None = None
            for i in range(args.num_layers):
                tensors = family.read_layer(w, args, i, source)
                if shard is not None:
                    if part is None:
                        part = split(args, shard, *units(tensors))
                    tensors = shard_layer(tensors, args, part, shard, i)
                layers.append(DecoderLayer(tensors, dtype, quantization, fp32, cpu_kernels, want, packed_want))
                del tensors
            embed: torch.Tensor | PackedEmbedding | None = None
            head_blocks: QuantMatrix | None = None
            table = w.gguf.table("model.embed_tokens.weight") if w.gguf is not None and w.packed else None
            if table is not None and w.gguf is not None and w.gguf.shape("model.embed_tokens.weight") == table_shape:
                w.skip("model.embed_tokens.weight")  # rows de-quantized per lookup, never the whole table
                embed = PackedEmbedding(w.gguf.path, table[1], table[0], table_shape, table[2], dtype)
                if args.tie_word_embeddings:
                    head_blocks = w.blocks("model.embed_tokens.weight", table_shape)
            else:
                embed = w.get("model.embed_tokens.weight", source, shape=table_shape)
            lm_head: torch.Tensor | Blocks | None = None
            if args.tie_word_embeddings:
                w.skip("lm_head.weight")  # some checkpoints store the tied copy too
            else:
                if not w.has("lm_head.weight"):
                    raise ValueError(f"{model_dir}: tie_word_embeddings is false but lm_head.weight is missing")
                lm_head = w.matrix(["lm_head.weight"], source, [table_shape])
            norm = w.get("model.norm.weight", torch.float32, shape=(args.hidden_size,))
            if args.norm_offset:
                norm = norm + 1.0
            model = DecoderModel(args if part is None else shard_args(args, part), embed, layers, norm, lm_head, dtype, fp32, quantization, cpu_kernels,
                                 None if want is None else want.get("head", set()), head_blocks,
                                 None if packed_want is None else packed_want.get("head", set()))
            unused = w.unused()
        if unused:
            log.warning("%s: ignoring %d unexpected tensors, e.g. %s", model_dir, len(unused), sorted(unused)[:3])
        del embed, lm_head, head_blocks  # the float32 copies (if any) live on only in the Linear forms
        if quantization != "none":
            log_quantization([lin for lin in model.all_linears() if lin is not model.head], model.head, quantization)
        return model


def _qk_norm(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, h: int, hkv: int, d: int,
             eps: float) -> torch.Tensor:
    """RMSNorm over each head of q and k in qkv [T, (H + 2 Hkv) D] (Qwen3, Gemma 3); v untouched."""
    t = qkv.shape[0]
    q = rms_norm(qkv[:, :h * d].reshape(t, h, d), q_norm, eps).reshape(t, h * d)
    k = rms_norm(qkv[:, h * d:(h + hkv) * d].reshape(t, hkv, d), k_norm, eps).reshape(t, hkv * d)
    return torch.cat([q, k, qkv[:, (h + hkv) * d:]], dim=1)
