"""ModelRunner: owns the weights and the KV pool; turns a ForwardPlan into a ForwardResult.

Owns: the model (``DecoderModel``), the KV pool tensors ``k_cache`` / ``v_cache`` of shape
[num_layers, capacity, Hkv, D] (slot s = one token's K/V in every layer; with ``--kv-cache-dtype
int8 / fp8`` [num_layers, capacity, Hkv, D + 4] of 8-bit codes and per-row scales,
``lockgate.kvcache.kv_dtype``, its capacity counted at those bytes, every token's attention on the
kernels, which read it in place), the run dtype and
device, and the torch.Generator used for unseeded sampling (seeded from ``--seed``). The choices
read from the flags stay here (an explicit ``--dtype``, ``--quantization auto`` kept dense under an
explicit float32, whether float32 copies are made, ``--deterministic`` without tuning on the integer
GEMM); the measured ones (``--dtype auto`` on a CPU, matmul forms, attention paths, prompt-row
forms) are ``lockgate.runner.form_choice``'s, and ``paths`` is what it decided.

Invariants:

* The runner never sees requests: per step it gets plain arrays (``ForwardPlan``) and returns
  plain arrays (``ForwardResult``). Which slots are free or cached is the scheduler's
  business; the runner only writes the step's K/V to ``plan.out_slots`` and reads
  ``plan.kv_slots``. A slot is meaningful once some step wrote it; the pool's memory is zero-filled
  and resident from the start (``pool_memory.allocate_pool``).
* Facts learned at start-up (``capacity``, ``max_model_len``, ``vocab_size``,
  ``eos_token_ids``) are attributes, never edits of the config.
* ``execute`` computes logits only for ``plan.sample_rows`` (the last token of each sampled
  sequence) and skips the LM head entirely when no row samples. A plain greedy step (every row
  greedy on unchanged logits, no logprobs: ``sampler.plain_greedy``) gets its tokens from the
  model's argmax path and never builds float32 logits; the tokens are the ones ``sample`` picks.

* Tensor parallelism (``--tensor-parallel-size`` N > 1, ``runner/tensor_parallel.py``): rank 0's
  runner owns the group; it computes the pool capacity every rank holds (the budget shared by all
  ranks' pools, KV heads replicated on several ranks counted on each), starts the other ranks with
  it and with its own dtype and quantization, loads its part while they load theirs, and sends each
  step before running it. A rank > 0 is a ``ModelRunner(rank=r)`` driven by ``run_part``.

Called by the scheduler process loop (``lockgate.engine.core``) and the offline ``LLM``
through ``lockgate.runner.make_runner``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lockgate import kernels
from lockgate.checkpoint.gguf_tensors import GgufWeights
from lockgate.checkpoint.loader import checkpoint_fingerprint, gguf_weights_of, prepare_model_dir_apart
from lockgate.checkpoint.peft import AdapterInfo
from lockgate.config import DETERMINISTIC_FORM, CacheConfig, ModelConfig
from lockgate.kvcache import kv_dtype
from lockgate.layers import kv_quant
from lockgate.layers.attention_meta import AttentionMetadata
from lockgate.layers.forms import weight_copies_fit
from lockgate.layers.lora import AdapterWeights, LoraSlots, LoraStep
from lockgate.models.decoder import DecoderModel
from lockgate.models.lora import load_adapter
from lockgate.models.registry import args_from_config
from lockgate.models.shard import Shard, shard_args, split
from lockgate.plan import ForwardPlan, ForwardResult, SamplingBatch
from lockgate.progress import Phase, phase
from lockgate.runner import form_choice
from lockgate.runner.memory_plan import MemoryPlan, plan_memory
from lockgate.runner.pool_memory import allocate_pool
from lockgate.runner.sampler import argmax_kernel, greedy_output, plain_greedy, sample
from lockgate.runner.tensor_parallel import (
    RankStep,
    TensorParallelGroup,
    cpu_groups,
    decode_array,
    encode_step,
    take_cpus,
)

log = logging.getLogger("lockgate.runner")

PLANNED_PREFILL_TOKENS = 1024  # the activations the memory plan counts (the default prefill budget)


def return_freed_memory() -> None:
    """Give the heap's freed pages back to the system (glibc's ``malloc_trim``): loading a model
    frees hundreds of MB of scratch that glibc would otherwise keep mapped (270 MB for a 1B GGUF)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def resolve_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The dtype ``name`` names; for ``auto``: bf16 on a CUDA device that supports it, float32 on
    one that does not, and None on a CPU (measured: ``form_choice.auto_dtype``)."""
    if name != "auto":
        return form_choice.DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return None


def read_eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """eos_token_id (int or list) from config.json, then generation_config.json; deduplicated, in order."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.append(eos)
        elif isinstance(eos, list):
            ids.extend(int(e) for e in eos)
    return tuple(dict.fromkeys(ids))


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cache_cfg: CacheConfig, rank: int = 0) -> None:
        """``rank``: with ``--tensor-parallel-size`` N > 1, which rank this process is: 0 starts
        the others (``runner/tensor_parallel.py``) and runs the steps; a rank > 0 is started by it
        with rank 0's dtype, quantization and KV capacity, and runs ``run_part``. A start that fails
        stops the ranks it started and gives back the CPUs it took."""
        self.tensor_parallel: TensorParallelGroup | None = None  # rank 0's group (the other ranks)
        self._before_tp: tuple[set[int], int] | None = None  # rank 0's CPUs and threads before it took its group
        try:
            self._load(model_cfg, cache_cfg, rank)
        except BaseException:
            self.close()
            raise

    def _load(self, model_cfg: ModelConfig, cache_cfg: CacheConfig, rank: int) -> None:
        t0 = time.perf_counter()
        if model_cfg.deterministic and model_cfg.tuning == "off" and model_cfg.matmul_forms == "auto":
            # one batch-invariant form for every call; nothing measured to choose by: the integer GEMM
            model_cfg = dataclasses.replace(model_cfg, matmul_forms=DETERMINISTIC_FORM)
        self.cfg = model_cfg
        tp = model_cfg.tensor_parallel_size
        self.shard: Shard | None = Shard(rank, tp) if tp > 1 else None
        tp_cpus: list[list[int]] = []
        if self.shard is not None and rank == 0:
            tp_cpus = cpu_groups(tp, model_cfg.tp_cpus, os.sched_getaffinity(0))
            self._before_tp = (os.sched_getaffinity(0), torch.get_num_threads())
            take_cpus(tp_cpus[0], model_cfg.num_threads)
        elif model_cfg.num_threads is not None:
            torch.set_num_threads(model_cfg.num_threads)
        self.device = torch.device(model_cfg.device)
        wants_kernels = self.device.type == "cpu" and model_cfg.dtype != "float16"
        if wants_kernels:  # a first build takes minutes: the compiler runs while the model is prepared
            kernels.start(model_cfg.cpu_kernels)
        # one bar on a terminal at a time: the conversion logs lines while the kernels' bar is up
        self.model_dir: Path = prepare_model_dir_apart(model_cfg.model, model_cfg.revision, model_cfg.gguf_file,
                                                       bars=not kernels.building())
        torch.manual_seed(model_cfg.seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(model_cfg.seed)
        args = args_from_config(json.loads((self.model_dir / "config.json").read_text()))
        # lockgate's CPU kernels: decode attention read from the pool by slot, the layers' fused
        # element-wise ops, groupwise int4/int8 matmuls; plain torch where they cannot build (or
        # dtype float16, which they lack).
        kernels_built = wants_kernels and kernels.load(model_cfg.cpu_kernels)  # (joins the build)
        self.dtype_info: dict[str, Any] = {"how": f"--dtype {model_cfg.dtype}"}  # how the dtype was chosen
        dtype = resolve_dtype(model_cfg.dtype, self.device)
        if dtype is None:
            dtype, self.dtype_info = form_choice.auto_dtype(model_cfg, args, kernels_built)
        self.dtype: torch.dtype = dtype
        self.cpu_kernels: bool = kernels_built and self.dtype in (torch.float32, torch.bfloat16)
        # auto keeps an explicit --dtype float32 dense: what one asks for to match a reference exactly.
        # float32 chosen by --dtype auto still takes the lossless quantized forms.
        self.quantization = "none" if model_cfg.quantization == "auto" and model_cfg.dtype == "float32" \
            and not model_cfg.deterministic and rank == 0 else model_cfg.quantization  # a rank > 0 takes rank 0's
        if self.quantization != model_cfg.quantization:
            log.info("--dtype float32 asked for explicitly: dense float32 weights only (exact, and several times "
                     "slower at small batches: every step streams 4 bytes per parameter); --dtype auto (float32 where "
                     "measured fastest), or --quantization int4 with it, keeps the checkpoint's 4/8-bit forms")
        fp32 = (self.dtype != torch.float32 and model_cfg.fp32_matmul_rows != "off"
                and (model_cfg.fp32_matmul_rows != "auto" or weight_copies_fit(4 * args.matmul_parameters)))
        elem = torch.empty((), dtype=self.dtype).element_size()
        run_dtype = str(self.dtype).removeprefix("torch.")
        # the pool's format: the run dtype (auto), or 8-bit codes with per token and head scales
        self.kv_cache_dtype: str = kv_dtype.resolve(cache_cfg.kv_cache_dtype, run_dtype)
        if self.kv_cache_dtype != "auto" and not self.cpu_kernels:
            raise ValueError(f"--kv-cache-dtype {cache_cfg.kv_cache_dtype}: the 8-bit KV pool is read by lockgate's "
                             f"CPU kernels, which this run lacks ({kernels.error() or 'not loaded'}; --dtype "
                             f"{run_dtype}, device {self.device}; they need a CPU, float32 or bfloat16, and "
                             "--cpu-kernels auto)")
        self.kv_cache_dtype_name: str = run_dtype if self.kv_cache_dtype == "auto" else (
            "fp8_e4m3" if self.kv_cache_dtype == "fp8" else self.kv_cache_dtype)
        full_args = args
        kv_heads_all = args.num_kv_heads  # KV heads over every rank (replicated ones counted on each)
        if self.shard is not None:
            parts = [split(args, Shard(r, tp)) for r in range(tp)]
            kv_heads_all = sum(p.kv_heads[1] - p.kv_heads[0] for p in parts)
            args = shard_args(args, parts[rank])  # this rank's shapes (the forms' tuning key)
        bytes_per_token = kv_dtype.bytes_per_token(args.num_layers, args.num_kv_heads, args.head_dim,
                                                   self.kv_cache_dtype, elem)  # this process's pool
        gguf_path = gguf_weights_of(self.model_dir)
        gguf = GgufWeights(gguf_path) if gguf_path is not None else None  # read once: planned, then loaded

        def memory_for(pool_bytes: int) -> MemoryPlan:
            return plan_memory(full_args, elem, pool_bytes, PLANNED_PREFILL_TOKENS,
                               gguf_tensors=None if gguf is None else gguf.table_of_contents(),
                               packed=self.quantization != "none", fp32_copies=fp32)

        if cache_cfg.max_total_tokens is not None:
            self.capacity: int = cache_cfg.max_total_tokens
        else:
            bare = memory_for(0)  # weights and overhead: what a share of the memory is left for the pool
            # with tensor parallelism every rank's pool comes out of the same budget
            per_token_all = kv_dtype.bytes_per_token(full_args.num_layers, kv_heads_all, full_args.head_dim,
                                                     self.kv_cache_dtype, elem)
            self.capacity = cache_cfg.pool_bytes(bare.weights + bare.overhead, bare.available) // per_token_all
            if self.capacity < 1:
                raise ValueError(f"{cache_cfg.sized_by} holds no token ({bytes_per_token} bytes per token)")
        memory = memory_for(self.capacity * bytes_per_token)
        log.info("%s", memory.describe())
        if self.device.type == "cpu":
            memory.check()
        if self.shard is not None and rank == 0:  # the other ranks load while this one does
            dtype_name = next(n for n, d in form_choice.DTYPES.items() if d == self.dtype)
            self.tensor_parallel = TensorParallelGroup(
                dataclasses.replace(model_cfg, dtype=dtype_name, quantization=self.quantization), self.capacity,
                self.kv_cache_dtype, tp_cpus)
        plan = form_choice.FormPlan(model_cfg, args, self.dtype, self.cpu_kernels, self.quantization, fp32,
                                    checkpoint_fingerprint(self.model_dir))
        with phase(log, f"loading the weights ({args.num_layers} layers; 4/8-bit blocks packed for the kernels)"):
            self.model = DecoderModel.from_pretrained(self.model_dir, self.dtype, self.device, self.quantization,
                                                    fp32, self.cpu_kernels, plan.wanted_forms(), gguf=gguf,
                                                    packed_want=plan.forced_forms(), shard=self.shard).eval()
        if model_cfg.activation_quant == "int8":
            changed, total = self.model.use_int8_activations()
            if not changed:
                raise ValueError("--activation-quant int8 applies to projections on 4-bit integer-GEMM forms (a "
                                 "Q4 GGUF, or --quantization int4) and lockgate's kernels; this model has none "
                                 f"(--dtype {self.dtype}, --quantization {self.quantization}, kernels "
                                 f"{'loaded' if self.cpu_kernels else 'not loaded'})")
            log.info("--activation-quant int8: %d of %d projections (the 4-bit ones) round their activations to "
                     "int8 per 32 columns (an inexact tier; the 8-bit and dense ones keep theirs)", changed, total)
        # plain greedy steps take the argmax on the LM head's own output (lockgate::argmax_rows,
        # vectorised); a final softcap could merge the largest logits, so those models keep the logits
        self._greedy_argmax = (self.cpu_kernels and self.device.type == "cpu" and self.model.args.final_softcap is None
                               and argmax_kernel())
        # the matmul forms, attention paths and prompt-row forms (form_choice: measured, cached, logged)
        self.paths: form_choice.Paths = plan.choose(self.model)
        args = self.model.args
        self.vocab_size: int = args.vocab_size
        self._logits = torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)  # _logits_buffer
        self.eos_token_ids: tuple[int, ...] = read_eos_token_ids(self.model_dir)
        self.max_model_len: int = self._context_length(model_cfg)
        if self.kv_cache_dtype != "auto":  # the 8-bit pool is read by the kernels only: every token's attention there
            self.paths.decode_kernel = self.paths.prefill_kernel = True
            self.paths.table = dataclasses.replace(
                self.paths.table, decode_attention="kernel", prefill_attention="kernel",
                source=f"{self.paths.table.source}; --kv-cache-dtype {self.kv_cache_dtype_name}: attention on the kernels")
        # [layers, capacity, Hkv, D], or [layers, capacity, Hkv, D + 4] int8 / float8_e4m3fn (codes, then the scale)
        shape = kv_quant.pool_shape(self.model.kv_shape(self.capacity), self.kv_cache_dtype)
        t_pool = time.perf_counter()
        with phase(log, f"allocating the KV pool ({self.capacity * bytes_per_token / 2**20:.0f} MiB, its pages "
                        "faulted in now)"):
            self.k_cache, self.v_cache = allocate_pool(shape, kv_quant.POOL_DTYPES.get(self.kv_cache_dtype, self.dtype),
                                                       self.device, cache_cfg.sized_by)
        t_pool = time.perf_counter() - t_pool
        return_freed_memory()  # loading's scratch (blocks, codes) goes back to the system
        log.info("model %s (%s, %d layers) on %s in %s, loaded in %.2fs; max_model_len %d",
                 self.model_dir, args.model_type, args.num_layers, self.device, self.dtype,
                 time.perf_counter() - t0, self.max_model_len)
        log.info("KV pool: %d tokens x %d bytes = %.1f MiB, --kv-cache-dtype %s: %s (allocated and faulted in in "
                 "%.2fs)", self.capacity, bytes_per_token, self.capacity * bytes_per_token / 2**20,
                 cache_cfg.kv_cache_dtype, kv_dtype.describe(self.kv_cache_dtype, run_dtype), t_pool)
        self.lora_slots: LoraSlots | None = None  # LoRA: the adapters the scheduler put in slots
        self.max_lora_rank = 0
        self._adapters: dict[int, AdapterWeights] = {}  # uid -> weights of every loaded adapter
        if self.tensor_parallel is not None:
            self.tensor_parallel.wait_ready()
            self.model.reduce = self.tensor_parallel.reduce  # after the tuning: it measures this rank alone

    # ---- LoRA adapters ----

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        if self.shard is not None:
            log.info("LoRA adapters are off with --tensor-parallel-size %d (not sharded yet): loading one is refused",
                     self.shard.size)
            return
        self.lora_slots = LoraSlots(max_loras, self.model.args.num_layers)
        self.max_lora_rank = max_rank

    def read_adapter(self, name: str, path: str) -> tuple[AdapterInfo, object]:
        """Read and check a PEFT adapter (ValueError saying what is wrong); changes nothing here (it
        runs on the scheduler process's side thread while steps go on)."""
        if self.shard is not None:
            raise ValueError(f"LoRA adapters are not supported with --tensor-parallel-size {self.shard.size} yet "
                             "(adapters are not sharded across ranks); serve them with --tensor-parallel-size 1")
        if self.lora_slots is None:
            raise ValueError("LoRA is not enabled (start without --no-enable-lora)")
        info, weights = load_adapter(name, path, self.model.args.lora_targets(), self.max_lora_rank, self.dtype)
        log.info("LoRA adapter %r read from %s: rank %d, %s, %.1f MiB", name, info.path, info.rank,
                 "/".join(info.modules), info.nbytes / 2**20)
        return info, weights

    def add_adapter(self, uid: int, weights: object) -> None:
        """Keep ``read_adapter``'s weights as adapter ``uid`` until ``drop_adapter``."""
        assert isinstance(weights, AdapterWeights)
        self._adapters[uid] = weights

    def drop_adapter(self, uid: int) -> None:
        self._adapters.pop(uid, None)

    def put_adapter(self, slot: int, uid: int) -> None:
        """Slot ``slot`` holds adapter ``uid`` from the next step on (0: empty it)."""
        assert self.lora_slots is not None
        if uid == 0:
            self.lora_slots.clear(slot)
        else:
            self.lora_slots.put(slot, uid, self._adapters[uid])

    # ---- what the prefix cache may keep ----

    @property
    def generated_kv_exact(self) -> bool:
        """Whether a generated token's KV is what computing it as a prompt row gives (the prefix
        cache may then keep it): no prompt forms, or decode rows on the very same form everywhere
        (padded alike: ``Linear`` pads any call on the prompt form, the one-call operator refuses)."""
        return all(lin.prompt is None or lin.choice.names() == {lin.prompt.name}
                   for lins in self.model.projections().values() for lin in lins)

    def _context_length(self, cfg: ModelConfig) -> int:
        args = self.model.args
        n = args.max_position_embeddings
        if cfg.max_model_len is not None:
            n = min(n, cfg.max_model_len)
        return n

    def execute(self, plan: ForwardPlan) -> ForwardResult:
        """Run one step: write K/V for every new token, sample one token per ``sample_rows`` entry."""
        t0 = time.perf_counter()
        t = plan.num_tokens
        if plan.out_slots.shape != (t,) or (t and int(plan.out_slots.max()) >= self.capacity):
            raise ValueError(f"bad plan: {t} tokens, out_slots {plan.out_slots.shape}, capacity {self.capacity}")
        dev = self.device
        meta = AttentionMetadata.build(plan.query_lens, plan.seq_lens, plan.kv_slots, plan.kv_offsets,
                                       plan.out_slots, self.model.args.num_queries_per_kv, dev,
                                       self.paths.decode_kernel, self.paths.row_invariant, self.paths.prefill_kernel)
        s = int(plan.sample_rows.shape[0])
        rows = None
        if s:
            ends = np.cumsum(plan.query_lens) - 1  # [B] last token row of each sequence
            rows = torch.from_numpy(np.ascontiguousarray(ends[plan.sample_rows], dtype=np.int64)).to(dev)
        lora = None
        if plan.lora_slots.size:
            assert self.lora_slots is not None, "a plan with adapters, but LoRA is not enabled"
            lora = LoraStep(self.lora_slots, LoraStep.expand(plan.lora_slots, plan.query_lens),
                            self.cpu_kernels and dev.type == "cpu")
        # plain greedy rows: the model hands back tokens, not float32 logits
        greedy = s > 0 and self._greedy_argmax and plain_greedy(plan.sampling)
        if self.tensor_parallel is not None:
            if lora is not None:
                raise ValueError("a plan with LoRA adapters under tensor parallelism (adapters are refused at load)")
            self.tensor_parallel.send(encode_step(
                plan.input_ids, plan.positions, plan.out_slots, plan.query_lens, plan.seq_lens, plan.kv_slots,
                plan.kv_offsets, np.zeros(0, np.int64) if rows is None else rows.numpy(),
                plan.decode_rows if self.paths.prompt_forms else None))
        try:
            return self._forward(plan, t0, meta, rows, lora, greedy, s)
        except Exception as e:
            if self.tensor_parallel is not None:  # the other ranks may wait in an all-reduce: the group is lost
                self.tensor_parallel.broken(f"rank 0's step failed ({type(e).__name__}: {e})")
            raise

    def _forward(self, plan: ForwardPlan, t0: float, meta: AttentionMetadata, rows: torch.Tensor | None,
                 lora: LoraStep | None, greedy: bool, s: int) -> ForwardResult:
        dev = self.device
        with torch.inference_mode():
            logits = self.model(torch.from_numpy(plan.input_ids.astype(np.int64, copy=False)).to(dev),
                                torch.from_numpy(plan.positions.astype(np.int64, copy=False)).to(dev),
                                meta, self.k_cache, self.v_cache, rows, lora,
                                plan.decode_rows if self.paths.prompt_forms else None,
                                None if greedy else self._logits_buffer(s), argmax=greedy)  # [S, V] f32, [S] or None
            if logits is None:
                return ForwardResult(tokens=np.zeros(0, np.int64), logprobs=np.zeros(0, np.float32),
                                     top_ids=np.zeros((0, 0), np.int64), top_logprobs=np.zeros((0, 0), np.float32),
                                     step_seconds=time.perf_counter() - t0)
            if greedy:  # the tokens themselves
                assert logits.shape == (s,) and plan.sampling.temperature.shape == (s,)
                out = greedy_output(logits)
            else:
                out = sample(logits, plan.sampling, self.generator)
            tokens, logprobs, top_ids, top_logprobs = out.to_numpy()
        return ForwardResult(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs,
                             step_seconds=time.perf_counter() - t0)

    def chunk_logits(self, ids: np.ndarray, start: int) -> torch.Tensor:
        """float32 [len(ids), V]: the logits after each token of a chunk of one sequence (teacher
        forcing, ``lockgate eval``), whose first ``start`` tokens' K/V are in pool slots 0 ..
        start - 1; the chunk's K/V go to the next slots, so a later chunk reads them from the pool
        as a prompt continued over several steps does. The rows are prompt rows (their forms)."""
        n = int(ids.shape[0])
        end = start + n
        if n < 1 or end > self.capacity:
            raise ValueError(f"a chunk of {n} tokens after {start} does not fit the pool of {self.capacity} tokens")
        i64 = np.int64
        meta = AttentionMetadata.build(np.array([n], i64), np.array([end], i64), np.arange(end, dtype=i64),
                                       np.array([0, end], i64), np.arange(start, end, dtype=i64),
                                       self.model.args.num_queries_per_kv, self.device, self.paths.decode_kernel,
                                       self.paths.row_invariant, self.paths.prefill_kernel)
        if self.tensor_parallel is not None:
            self.tensor_parallel.send(encode_step(
                ids, np.arange(start, end, dtype=i64), np.arange(start, end, dtype=i64), np.array([n], i64),
                np.array([end], i64), np.arange(end, dtype=i64), np.array([0, end], i64), np.arange(n, dtype=i64),
                0 if self.paths.prompt_forms else None))
        with torch.inference_mode():
            out = self.model(torch.from_numpy(ids.astype(i64)).to(self.device),
                             torch.arange(start, end, device=self.device), meta, self.k_cache, self.v_cache,
                             torch.arange(n, device=self.device), None, 0 if self.paths.prompt_forms else None,
                             self._logits_buffer(n), argmax=False)
        return out[:n].clone()

    def run_part(self, step: RankStep) -> None:
        """A tensor-parallel rank > 0: rank 0's step on this rank's heads and columns (the layers
        only: no LM head, no sampling); the all-reduces pair with rank 0's."""
        def d(b: bytes) -> np.ndarray:
            return decode_array(b).copy()  # writable: torch refuses read-only arrays
        query_lens, seq_lens = d(step.query_lens), d(step.seq_lens)
        meta = AttentionMetadata.build(query_lens, seq_lens, d(step.kv_slots), d(step.kv_offsets), d(step.out_slots),
                                       self.model.args.num_queries_per_kv, self.device, self.paths.decode_kernel,
                                       self.paths.row_invariant, self.paths.prefill_kernel)
        rows = torch.from_numpy(d(step.rows))
        with torch.inference_mode():
            self.model(torch.from_numpy(d(step.input_ids)), torch.from_numpy(d(step.positions)), meta,
                       self.k_cache, self.v_cache, rows, None, None if step.decode_rows < 0 else step.decode_rows,
                       head=False)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (rank 0; also done at exit) and give this process
        back the CPUs and threads it had (an offline ``LLM`` lives in the caller's process)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
        if self._before_tp is not None:
            cpus, threads = self._before_tp
            os.sched_setaffinity(0, cpus)
            torch.set_num_threads(threads)
            self._before_tp = None

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """float32 [>= rows, V] kept from step to step (grown, never shrunk) for the model's logits."""
        if self._logits.shape[0] < rows:
            self._logits = torch.empty(-(-rows // 64) * 64, self.vocab_size,
                                       dtype=torch.float32, device=self.device)
        return self._logits

    # Tokens of the warm-up prefill: the default --max-prefill-tokens, the largest step the
    # scheduler makes by default, unless that many cost more than WARMUP_FLOPS of matmuls.
    WARMUP_PREFILL_TOKENS = 1024
    WARMUP_FLOPS = 4e11  # ~3 s on 2 AVX2 cores: a 1B model's warm-up prefill is 190 tokens, not 1,024 (13 s)

    def warmup(self) -> None:
        """A prefill of up to ``WARMUP_PREFILL_TOKENS`` (fewer for a large model: ``WARMUP_FLOPS``,
        where a long prompt's own compute dwarfs its page faults) and one decode step on slots 0..n
        (their contents are garbage after). The prefill's activations take their memory from the OS now:
        glibc maps a large block afresh (and the kernel faults its pages in) until a free of that
        size has raised its mmap threshold, so without it the first long prompt a user sent paid
        that inside its first token (the first 256-token request after a short one: 8-15 ms slower
        than the next, on the Zen 5 class CPU)."""
        affordable = int(self.WARMUP_FLOPS // (2 * max(self.model.args.matmul_parameters, 1)))
        n = min(self.WARMUP_PREFILL_TOKENS, max(32, affordable), self.capacity - 1, self.max_model_len - 1)
        if n < 1:
            return
        with phase(log, f"warming up ({n}-token prefill, then decode steps)", total=3, unit="steps") as p:
            self._warmup_steps(n, p)

    def _warmup_steps(self, n: int, p: Phase) -> None:
        ids = np.arange(1, n + 1, dtype=np.int64) % self.vocab_size
        p.detail("prefill")
        self.execute(_single_seq_plan(ids, start=0))
        p.to(1)
        p.detail("decode")
        decode = _single_seq_plan(ids[:1], start=n)
        self.execute(decode)
        p.to(2)
        p.detail("sampler")
        # once more through the sampler's general path (a banned token, as min_tokens bans EOS; a
        # seeded draw with top-k / top-p and logprobs): its first use cost 8-10 ms of a first token
        s = decode.sampling
        decode.sampling = dataclasses.replace(
            s, temperature=np.ones(1, np.float32), top_p=np.full(1, 0.9, np.float32), top_k=np.full(1, 50, np.int64),
            has_seed=np.ones(1, bool), num_logprobs=np.full(1, 1, np.int64), suppress_ids=np.zeros(1, np.int64),
            suppress_offsets=np.array([0, 1], np.int64))
        self.execute(decode)


def _single_seq_plan(ids: np.ndarray, start: int) -> ForwardPlan:
    """A greedy plan for one sequence whose slots are its positions 0..start + len(ids) - 1."""
    i64 = np.int64
    q, sl = len(ids), start + len(ids)
    greedy = SamplingBatch(
        temperature=np.zeros(1, np.float32), top_p=np.ones(1, np.float32), top_k=np.zeros(1, i64),
        min_p=np.zeros(1, np.float32), repetition_penalty=np.ones(1, np.float32),
        frequency_penalty=np.zeros(1, np.float32), presence_penalty=np.zeros(1, np.float32),
        seeds=np.zeros(1, i64), has_seed=np.zeros(1, bool), seed_steps=np.zeros(1, i64),
        num_logprobs=np.full(1, -1, i64), prompt_offsets=np.zeros(2, i64), output_offsets=np.zeros(2, i64),
        suppress_offsets=np.zeros(2, i64))
    return ForwardPlan(input_ids=ids.astype(i64), positions=np.arange(start, sl, dtype=i64),
                       out_slots=np.arange(start, sl, dtype=i64), query_lens=np.array([q], i64),
                       seq_lens=np.array([sl], i64), kv_slots=np.arange(sl, dtype=i64),
                       kv_offsets=np.array([0, sl], i64), sample_rows=np.zeros(1, i64), sampling=greedy)
