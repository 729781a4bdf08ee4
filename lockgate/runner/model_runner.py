"""ModelRunner: owns the weights and the KV pool; turns a ForwardPlan into a ForwardResult.

Owns: the model (``DecoderModel``), the KV pool tensors ``k_cache`` / ``v_cache`` of shape
[num_layers, capacity, Hkv, D] (slot s = one token's K/V in every layer), the run dtype and
device, and the torch.Generator used for unseeded sampling (seeded from ``--seed``).

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

Called by the scheduler process loop (``lockgate.engine.core``) and the offline ``LLM``
through ``lockgate.runner.make_runner``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lockgate import kernels
from lockgate.checkpoint.loader import checkpoint_fingerprint, prepare_model_dir
from lockgate.checkpoint.peft import AdapterInfo
from lockgate.config import DETERMINISTIC_FORM, CacheConfig, ModelConfig
from lockgate.kernel_choice import FORM_NAMES, QUANTIZED_FORMS, FormChoice
from lockgate.layers.attention import AttentionMetadata
from lockgate.layers.forms import int_gemm_available, int_gemm_isa, weight_copies_fit
from lockgate.layers.linear import PromptForm
from lockgate.layers.lora import AdapterWeights, LoraSlots, LoraStep
from lockgate.models.args import ModelArgs
from lockgate.models.decoder import PROJECTION_ROLES, DecoderModel
from lockgate.models.lora import load_adapter
from lockgate.models.registry import args_from_config
from lockgate.plan import ForwardPlan, ForwardResult, SamplingBatch
from lockgate.runner import row_invariance, tuning, tuning_attention
from lockgate.runner.pool_memory import allocate_pool
from lockgate.runner.sampler import argmax_kernel, greedy_output, plain_greedy, sample

log = logging.getLogger("lockgate.runner")

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The dtype ``name`` names; for ``auto``: bf16 on a CUDA device that supports it, float32 on
    one that does not, and None on a CPU (measured: ``ModelRunner._auto_dtype``)."""
    if name != "auto":
        return _DTYPES[name]
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
    def __init__(self, model_cfg: ModelConfig, cache_cfg: CacheConfig) -> None:
        t0 = time.perf_counter()
        if model_cfg.deterministic and model_cfg.tuning == "off" and model_cfg.matmul_forms == "auto":
            # one batch-invariant form for every call; nothing measured to choose by: the integer GEMM
            model_cfg = dataclasses.replace(model_cfg, matmul_forms=DETERMINISTIC_FORM)
        self.cfg = model_cfg
        if model_cfg.num_threads is not None:
            torch.set_num_threads(model_cfg.num_threads)
        self.model_dir: Path = prepare_model_dir(model_cfg.model)
        self.device = torch.device(model_cfg.device)
        torch.manual_seed(model_cfg.seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(model_cfg.seed)
        args = args_from_config(json.loads((self.model_dir / "config.json").read_text()))
        # lockgate's CPU kernels: decode attention read from the pool by slot, the layers' fused
        # element-wise ops, groupwise int4/int8 matmuls; plain torch where they cannot build (or
        # dtype float16, which they lack).
        kernels_built = self.device.type == "cpu" and model_cfg.dtype != "float16" and kernels.load(model_cfg.cpu_kernels)
        self.dtype_info: dict[str, Any] = {"how": f"--dtype {model_cfg.dtype}"}  # how the dtype was chosen
        self.dtype: torch.dtype = resolve_dtype(model_cfg.dtype, self.device) or self._auto_dtype(args, kernels_built)
        self.cpu_kernels: bool = kernels_built and self.dtype in (torch.float32, torch.bfloat16)
        # auto keeps an explicit --dtype float32 dense: what one asks for to match a reference exactly.
        # float32 chosen by --dtype auto still takes the lossless quantized forms.
        self.quantization = "none" if model_cfg.quantization == "auto" and model_cfg.dtype == "float32" \
            and not model_cfg.deterministic else model_cfg.quantization
        if self.quantization != model_cfg.quantization:
            log.info("--dtype float32 asked for explicitly: dense float32 weights only (exact, and several times "
                     "slower at small batches: every step streams 4 bytes per parameter); --dtype auto (float32 where "
                     "measured fastest), or --quantization int4 with it, keeps the checkpoint's 4/8-bit forms")
        fp32 = (self.dtype != torch.float32 and model_cfg.fp32_matmul_rows != "off"
                and (model_cfg.fp32_matmul_rows != "auto" or weight_copies_fit(4 * args.matmul_parameters)))
        # lockgate's bf16 kernel keeps its own packed copy (2 bytes a parameter; all forms are made
        # while the table is measured): only where it fits beside the float32 copies
        self._bf16_gemm_fits = weight_copies_fit((2 + (4 if fp32 else 0)) * args.matmul_parameters)
        self._forms_key = self._key("forms", args, str(self.dtype).removeprefix("torch."), {
            "checkpoint": checkpoint_fingerprint(self.model_dir), "quantization": self.quantization, "fp32": fp32})
        self._stored_table = tuning.peek(self._forms_key) \
            if model_cfg.tuning == "auto" and model_cfg.matmul_forms == "auto" else None
        self.model = DecoderModel.from_pretrained(self.model_dir, self.dtype, self.device, self.quantization,
                                                fp32, self.cpu_kernels, self._wanted_forms(model_cfg)).eval()
        # decode attention on lockgate's kernel (else gathers + SDPA), and prefill attention on it
        # too (else SDPA): measured with the forms
        self.decode_kernel: bool = self.cpu_kernels
        # plain greedy steps take the argmax on the LM head's own output (lockgate::argmax_rows,
        # vectorised); a final softcap could merge the largest logits, so those models keep the logits
        self._greedy_argmax = (self.cpu_kernels and self.device.type == "cpu" and self.model.args.final_softcap is None
                               and argmax_kernel())
        self.prefill_kernel: bool = False
        # the attention kernel prefetches its next item's K/V rows (measured with the forms; off
        # unless measured faster: lockgate::set_attention_lookahead)
        self.attention_lookahead: bool = False
        # --deterministic: every token's attention is a decode-kernel row (AttentionMetadata.build)
        self.row_invariant: bool = model_cfg.deterministic
        # --exact-prefill: each role's prompt-row form (checked row-invariant), or why there is none
        self.prompt_forms: dict[str, PromptForm] = {}
        self.exact_prefill_problem: str | None = "off (--no-exact-prefill)"
        self.tuned = self._choose_forms(model_cfg)
        if self.row_invariant:
            self._check_deterministic()
        args = self.model.args
        self.vocab_size: int = args.vocab_size
        self._logits = torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)  # _logits_buffer
        self.eos_token_ids: tuple[int, ...] = read_eos_token_ids(self.model_dir)
        self.max_model_len: int = self._context_length(model_cfg)

        elem = torch.empty((), dtype=self.dtype).element_size()
        bytes_per_token = args.num_layers * 2 * args.num_kv_heads * args.head_dim * elem
        if cache_cfg.max_total_tokens is not None:
            self.capacity: int = cache_cfg.max_total_tokens
        else:
            self.capacity = cache_cfg.kv_cache_bytes // bytes_per_token
            if self.capacity < 1:
                raise ValueError(f"--kv-cache-memory {cache_cfg.kv_cache_memory} holds no token "
                                 f"({bytes_per_token} bytes per token)")
        shape = self.model.kv_shape(self.capacity)  # [layers, capacity, Hkv, D]
        t_pool = time.perf_counter()
        sized_by = (f"--max-total-tokens {cache_cfg.max_total_tokens}" if cache_cfg.max_total_tokens is not None
                    else f"--kv-cache-memory {cache_cfg.kv_cache_memory}")
        self.k_cache, self.v_cache = allocate_pool(shape, self.dtype, self.device, sized_by)
        t_pool = time.perf_counter() - t_pool
        log.info("model %s (%s, %d layers) on %s in %s, loaded in %.2fs; max_model_len %d",
                 self.model_dir, args.model_type, args.num_layers, self.device, self.dtype,
                 time.perf_counter() - t0, self.max_model_len)
        log.info("KV pool: %d tokens x %d bytes = %.1f MiB (allocated and faulted in in %.2fs)", self.capacity,
                 bytes_per_token, self.capacity * bytes_per_token / 2**20, t_pool)
        self.lora_slots: LoraSlots | None = None  # LoRA: the adapters the scheduler put in slots
        self.max_lora_rank = 0
        self._adapters: dict[int, AdapterWeights] = {}  # uid -> weights of every loaded adapter

    # ---- LoRA adapters ----

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        self.lora_slots = LoraSlots(max_loras, self.model.args.num_layers)
        self.max_lora_rank = max_rank

    def load_adapter(self, uid: int, name: str, path: str) -> AdapterInfo:
        """Read and check a PEFT adapter (ValueError saying what is wrong); kept until ``drop_adapter``."""
        if self.lora_slots is None:
            raise ValueError("LoRA is not enabled (start without --no-enable-lora)")
        info, weights = load_adapter(name, path, self.model.args.lora_targets(), self.max_lora_rank, self.dtype)
        self._adapters[uid] = weights
        log.info("LoRA adapter %r loaded from %s: rank %d, %s, %.1f MiB", name, info.path, info.rank,
                 "/".join(info.modules), info.nbytes / 2**20)
        return info

    def drop_adapter(self, uid: int) -> None:
        self._adapters.pop(uid, None)

    def put_adapter(self, slot: int, uid: int) -> None:
        """Slot ``slot`` holds adapter ``uid`` from the next step on (0: empty it)."""
        assert self.lora_slots is not None
        if uid == 0:
            self.lora_slots.clear(slot)
        else:
            self.lora_slots.put(slot, uid, self._adapters[uid])

    # ---- measured choices (lockgate.runner.tuning) ----

    def _check_deterministic(self) -> None:
        """--deterministic holds only if every projection really runs the batch-invariant form and
        the attention kernel is there: else a start-up error saying what is missing."""
        if not self.cpu_kernels:
            raise ValueError(f"--deterministic needs lockgate's CPU kernels ({kernels.error() or 'not loaded'}; "
                             f"dtype {self.dtype})")
        a = self.model.args
        if a.attn_softcap is not None or any(a.layer_windows) or a.moe is not None:
            raise ValueError(f"--deterministic does not cover {a.model_type} yet: its sliding-window or soft-capped "
                             "attention, or its experts, do not run on batch-invariant paths")
        self.decode_kernel = True
        lacking = sorted(role for role, lins in self.model.projections().items()
                         if any(lin.prompt is None or lin.choice.names() != {lin.prompt.name} for lin in lins))
        if lacking:
            raise ValueError(f"--deterministic needs, for every projection, one matmul form whose rows do not depend on "
                             f"how many share the call; {', '.join(lacking)} have none on this machine (checked: "
                             f"{self.cfg.matmul_forms if self.cfg.matmul_forms != 'auto' else 'dense and int-gemm'}; "
                             f"int-gemm comes with a 4- or 8-bit GGUF checkpoint such as the default model, "
                             f"--quantization auto or int4, and int_linear's vector path: {int_gemm_isa() or 'not built'})")

    def _wanted_forms(self, cfg: ModelConfig) -> dict[str, set[str]] | None:
        """``_table_forms``, without the bf16-gemm copy where it does not fit memory."""
        want = self._table_forms(cfg)
        if self._bf16_gemm_fits:
            return want
        if want is None:
            return {role: set(FORM_NAMES) - {"bf16-gemm"} for role in PROJECTION_ROLES}
        return {role: names - {"bf16-gemm"} for role, names in want.items()}

    def _table_forms(self, cfg: ModelConfig) -> dict[str, set[str]] | None:
        """Per role the forms worth building (dense is always built): those a forced
        ``--matmul-forms`` names, those a stored table calls (``peek`` before loading), the
        quantized ones for the static rule (``--tuning off``), plus ``fp32`` under
        ``--fp32-matmul-rows N``, plus the row-invariant ones a stored check found (all candidates
        while unchecked); None (every form a projection can have) when the table is
        still to be measured."""
        if cfg.matmul_forms != "auto":
            choices = {role: FormChoice.parse(cfg.matmul_forms) for role in PROJECTION_ROLES}
            want = {role: c.names() for role, c in choices.items()}
        elif cfg.tuning == "off":
            choices = {role: FormChoice.static(("dense", *QUANTIZED_FORMS)) for role in PROJECTION_ROLES}
            want = {role: set(QUANTIZED_FORMS) for role in PROJECTION_ROLES}
        elif self._stored_table is not None:
            stored = self._stored_table.get("choices", {})
            choices = {role: FormChoice.parse(stored.get(role, "dense")) for role in PROJECTION_ROLES}
            want = {role: c.names() for role, c in choices.items()}
        else:
            return None
        if cfg.fp32_matmul_rows not in ("auto", "off"):
            want = {role: names | {"fp32"} for role, names in want.items()}
        if cfg.exact_prefill or cfg.deterministic:  # the forms the row check found (or may find) invariant
            candidates = self._candidates(cfg, choices)
            floors = (tuning.peek(self._rows_key(candidates, cfg.deterministic)) or {}).get("floors", {})
            want = {role: names | ({f for f, fl in floors[role].items() if fl is not None} if role in floors
                                   else set(candidates[role])) for role, names in want.items()}
        return want

    def _key(self, kind: str, args: ModelArgs, dtype: str, weights: dict[str, Any] | None = None) -> tuning.TuningKey:
        cpu = tuning.cpu_description()
        shape = {"layers": args.num_layers, "hidden": args.hidden_size, "intermediate": args.intermediate_size,
                 "heads": args.num_heads, "kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
                 "vocab": args.vocab_size}
        built = kernels.build_name() if kernels.error() is None and kernels.load(self.cfg.cpu_kernels) else "none"
        return tuning.TuningKey(kind=kind, cpu=cpu["cpu"], flags=cpu["flags"], threads=torch.get_num_threads(),
                                torch=tuning.torch_build(), kernels=built, shape=shape, dtype=dtype, weights=weights or {})

    def _auto_dtype(self, args: ModelArgs, kernels_built: bool) -> torch.dtype:
        """``--dtype auto`` on a CPU: float32 unless bf16's matmuls measure faster (``tuning``)."""
        if self.cfg.tuning == "off":
            self.dtype_info = {"how": "--dtype auto with --tuning off: float32 without measuring"}
            return torch.float32
        shapes = [((args.num_heads + 2 * args.num_kv_heads) * args.head_dim, args.hidden_size),
                  (args.hidden_size, args.num_heads * args.head_dim),
                  (2 * args.intermediate_size, args.hidden_size), (args.hidden_size, args.intermediate_size)]
        int_gemm = kernels_built and int_gemm_available()

        def measure() -> dict[str, Any]:
            log.info("measuring bf16 against float32 matmuls at this model's shapes (once per CPU and shape)")
            figures = tuning.measure_dtypes(shapes, int_gemm)
            return {"figures": figures, "dtype": tuning.decide_dtype(figures)}

        data, hit = tuning.cached(self._key("dtype", args, "auto"), measure, refresh=self.cfg.tuning == "refresh")
        dtype = str(data["dtype"])
        if dtype not in ("float32", "bfloat16"):
            dtype = tuning.decide_dtype(data.get("figures", {}))
        ms = {p: {c: round(float(np.median(ts)), 2) for c, ts in at.items()} for p, at in data.get("figures", {}).items()}
        how = "cached" if hit else f"measured in {data.get('seconds', 0):.1f}s"
        self.dtype_info = {"how": f"--dtype auto: {how}, {data['path']}", "ms_per_layer_pass": ms}
        log.info("--dtype auto -> %s (%s: one layer's projections, ms per pass by rows: %s)", dtype, how, ms)
        return _DTYPES[dtype]

    def _choose_forms(self, cfg: ModelConfig) -> dict[str, Any]:
        """Give every projection its FormChoice and pick the decode attention path: measured
        (cached), or ``--tuning off`` (static rule), or ``--matmul-forms`` (forced); then the
        ``--fp32-matmul-rows N`` override. Logs the table; returns what was decided."""
        roles = self.model.projections()
        choices: dict[str, FormChoice] = {}
        source = "static rule (--tuning off)"
        info: dict[str, Any] = {}
        if cfg.matmul_forms != "auto":
            choices = {role: FormChoice.parse(cfg.matmul_forms) for role in roles}
            source = f"--matmul-forms {cfg.matmul_forms}"
        elif cfg.tuning != "off":
            info = self._measured(cfg.tuning == "refresh")
            choices = {role: FormChoice.parse(text) for role, text in info["choices"].items()}
            self.decode_kernel = self.cpu_kernels and info.get("attention", "kernel") == "kernel"
            self.prefill_kernel = self.decode_kernel and info.get("prefill_attention", "sdpa") == "kernel"
            self.attention_lookahead = self.decode_kernel and info.get("attention_lookahead") == "on"
            source = ("cached " if info["cached"] else f"measured in {info.get('seconds', 0):.1f}s, ") + info["path"]
        if self.cpu_kernels:  # process-wide: the last model loaded in a process decides
            torch.ops.lockgate.set_attention_lookahead(self.attention_lookahead)
        self.model.choose_forms(choices)
        if cfg.fp32_matmul_rows not in ("auto", "off"):  # (--deterministic refuses it: ModelConfig)
            rows = int(cfg.fp32_matmul_rows)
            for lin in (lin for lins in roles.values() for lin in lins):
                if "fp32" in lin.forms:
                    lin.choose(lin.choice.from_rows(rows, "fp32"))
        if cfg.exact_prefill or cfg.deterministic:
            self._choose_row_forms(cfg, info)
        self.model.choose_forms({}, drop=True)  # free the forms no projection calls
        cpu = tuning.cpu_description()
        lines = [f"matmul forms ({source}; {cpu['cpu']}, {tuning.notable_flags(cpu['flags'])}, "
                 f"{torch.get_num_threads()} threads, {self.dtype}, int-gemm path {int_gemm_isa() or 'not built'}):"]
        lines += [f"  {role:<8} {roles[role][0].choice.describe()}" for role in roles]
        lines.append(f"  decode attention: {'lockgate kernel' if self.decode_kernel else 'gathers + SDPA'}"
                     f"{' (look-ahead on)' if self.attention_lookahead else ''}; "
                     f"prefill attention: {'lockgate kernel' if self.prefill_kernel or self.row_invariant else 'SDPA'}")
        lines.append(f"  prompt rows: {self.describe_prompt_forms()}")
        log.info("\n".join(lines))
        if self.exact_prefill_problem and cfg.exact_prefill:
            log.warning("prefix-cache hits and prompt chunking may change results in the last bits on this "
                        "machine: %s", self.exact_prefill_problem)
        return {**info, "choices": {role: str(lins[0].choice) for role, lins in roles.items()},
                "prompt_forms": {role: {"form": p.name, "min_rows": p.min_rows} for role, p in self.prompt_forms.items()},
                "exact_prefill": self.describe_prompt_forms(),
                "decode_attention": "kernel" if self.decode_kernel else "sdpa",
                "prefill_attention": "kernel" if self.prefill_kernel else "sdpa",
                "attention_lookahead": "on" if self.attention_lookahead else "off", "source": source,
                "int_gemm_isa": int_gemm_isa()}

    # ---- row-invariant forms (--exact-prefill, --deterministic; issue 19) ----

    def _rows_key(self, candidates: dict[str, list[str]], every: bool) -> tuning.TuningKey:
        """``every``: all candidates checked (--deterministic compares their costs), else each
        role's up to its first invariant one (--exact-prefill)."""
        return dataclasses.replace(self._forms_key, kind="rows", weights={
            **self._forms_key.weights, "candidates": candidates, "max_rows": row_invariance.INVARIANCE_ROWS[-1],
            "check": "every" if every else "first", "forms_on": "every projection"})

    def _candidates(self, cfg: ModelConfig, choices: dict[str, FormChoice]) -> dict[str, list[str]]:
        """The forms checked per role: a forced --matmul-forms under --deterministic, else
        ``row_invariance.candidates_for`` the table's choices."""
        if cfg.deterministic and cfg.matmul_forms != "auto":
            return {role: sorted(FormChoice.parse(cfg.matmul_forms).names()) for role in choices}
        return row_invariance.candidates_for(choices)

    def _choose_row_forms(self, cfg: ModelConfig, info: dict[str, Any]) -> None:
        """Give every projection its ``PromptForm`` from the cached row-invariance check: with
        --deterministic the cheapest invariant form, which then serves every call; else (exact
        prefill) the first invariant candidate, for prompt rows. Every token's attention goes to the
        kernel. All or nothing: a role without an invariant form leaves every projection as it was
        and ``exact_prefill_problem`` says why (--deterministic then refuses to start)."""
        if not self.cpu_kernels:
            self.exact_prefill_problem = f"it needs lockgate's CPU kernels ({kernels.error() or 'not loaded'})"
            return
        roles = self.model.projections()
        candidates = self._candidates(cfg, {role: lins[0].choice for role, lins in roles.items()})
        samples = info.get("samples") or {}

        def check(refresh: bool) -> tuple[dict[str, dict[str, int | None]], dict[str, PromptForm | None], bool]:
            """The cached (or new) floors, each role's pick among the forms built, and whether a
            role lacks one because the cache named a form this start did not build."""
            data, _ = tuning.cached(self._rows_key(candidates, cfg.deterministic), lambda: {
                "floors": row_invariance.row_floors(roles, self.dtype, candidates, first_only=not cfg.deterministic)},
                refresh=refresh)
            checked = {role: data["floors"].get(role, {}) for role in roles}
            built = {role: row_invariance.built_floors(checked[role], lins) for role, lins in roles.items()}
            picks = {role: row_invariance.cheapest_invariant(built[role], samples.get(role, {}))
                     if cfg.deterministic else row_invariance.first_invariant(built[role], candidates[role])
                     for role in roles}
            return checked, picks, any(picks[r] is None and built[r] != checked[r] for r in roles)

        checked, picks, stale = check(cfg.tuning == "refresh")
        if stale and cfg.tuning != "refresh":
            checked, picks, _ = check(True)  # check the forms this start has
        lacking = [role for role, pick in picks.items() if pick is None]
        if lacking:
            self.exact_prefill_problem = (f"no form of {', '.join(lacking)} gives a row the same bits whatever the "
                                          f"call's row count (checked {', '.join(checked[lacking[0]]) or 'no form'})")
            return
        self.prompt_forms = {role: pick for role, pick in picks.items() if pick is not None}  # (all of them)
        for role, lins in roles.items():
            for lin in lins:
                if cfg.deterministic:
                    lin.choose(FormChoice.single(self.prompt_forms[role].name))
                lin.set_prompt_form(self.prompt_forms[role])  # built on every projection (built_floors)
        self.decode_kernel = self.prefill_kernel = True  # every token's attention: one kernel row over its keys
        self.model.ops.forget()
        a = self.model.args
        self.exact_prefill_problem = ("its sliding-window, soft-capped or expert layers do not run on row-invariant "
                                      "paths yet" if a.attn_softcap is not None or any(a.layer_windows)
                                      or a.moe is not None else None)

    def describe_prompt_forms(self) -> str:
        if not self.prompt_forms:
            return f"by row count, as decode rows ({self.exact_prefill_problem})"
        text = ", ".join(f"{role} {p.name}" + (f" (>= {p.min_rows} rows)" if p.min_rows > 1 else "")
                         for role, p in self.prompt_forms.items())
        return text + ("" if self.exact_prefill_problem is None else f"; not exact: {self.exact_prefill_problem}")

    @property
    def generated_kv_exact(self) -> bool:
        """Whether a generated token's KV is what computing it as a prompt row gives (the prefix
        cache may then keep it): no prompt forms, or decode rows on the very same form everywhere
        (padded alike: ``Linear`` pads any call on the prompt form, the one-call operator refuses)."""
        return all(lin.prompt is None or lin.choice.names() == {lin.prompt.name}
                   for lins in self.model.projections().values() for lin in lins)

    def _measured(self, refresh: bool) -> dict[str, Any]:
        """The table for ``_forms_key``: the one ``peek`` found before loading, else the cached or
        a new measurement of the forms the model now has (all it can have: ``_wanted_forms``)."""
        if self._stored_table is not None and not refresh:
            return {**self._stored_table, "cached": True}
        roles = self.model.projections()
        args = self.model.args
        forms = {role: sorted({f for lin in lins for f in lin.forms}) for role, lins in roles.items()}

        def measure() -> dict[str, Any]:
            log.info("measuring the matmul forms at this model's shapes (once per CPU, threads and shape)")
            samples = tuning.measure_forms(roles, self.dtype) if any(len(f) > 1 for f in forms.values()) else {}
            heads = (args.num_heads, args.num_kv_heads, args.head_dim, self.dtype)
            attention = tuning_attention.measure_attention(*heads, args.num_layers) if self.cpu_kernels else {}
            prefill = tuning_attention.measure_prefill_attention(*heads) if self.cpu_kernels else {}
            lookahead = (tuning_attention.measure_attention_lookahead(*heads, args.num_layers)
                         if self.cpu_kernels else {})
            choices = tuning.decide(samples)
            return {"samples": samples, "choices": {r: str(choices.get(r, FormChoice.single("dense"))) for r in roles},
                    "attention_ms": attention, "attention": tuning_attention.decide_attention(attention),
                    "prefill_attention_ms": prefill,
                    "prefill_attention": tuning_attention.decide_prefill_attention(prefill),
                    "attention_lookahead_ms": lookahead,
                    "attention_lookahead": tuning_attention.decide_attention_lookahead(lookahead),
                    "forms": forms}

        data, hit = tuning.cached(self._forms_key, measure, refresh=refresh)
        return {**data, "cached": hit}

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
                                       plan.out_slots, self.model.args.num_queries_per_kv, dev, self.decode_kernel,
                                       self.row_invariant, self.prefill_kernel)
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
        with torch.inference_mode():
            logits = self.model(torch.from_numpy(plan.input_ids.astype(np.int64, copy=False)).to(dev),
                                torch.from_numpy(plan.positions.astype(np.int64, copy=False)).to(dev),
                                meta, self.k_cache, self.v_cache, rows, lora,
                                plan.decode_rows if self.prompt_forms else None,
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

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """float32 [>= rows, V] kept from step to step (grown, never shrunk) for the model's logits."""
        if self._logits.shape[0] < rows:
            self._logits = torch.empty(-(-rows // 64) * 64, self.vocab_size,
                                       dtype=torch.float32, device=self.device)
        return self._logits

    # Tokens of the warm-up prefill: the default --max-prefill-tokens, the largest step the
    # scheduler makes by default.
    WARMUP_PREFILL_TOKENS = 1024

    def warmup(self) -> None:
        """A prefill of up to ``WARMUP_PREFILL_TOKENS`` and one decode step on slots 0..n (their
        contents are garbage after). The prefill's activations take their memory from the OS now:
        glibc maps a large block afresh (and the kernel faults its pages in) until a free of that
        size has raised its mmap threshold, so without it the first long prompt a user sent paid
        that inside its first token (the first 256-token request after a short one: 8-15 ms slower
        than the next, on the Zen 5 class CPU of docs/performance.md round 16)."""
        n = min(self.WARMUP_PREFILL_TOKENS, self.capacity - 1, self.max_model_len - 1)
        if n < 1:
            return
        t0 = time.perf_counter()
        ids = np.arange(1, n + 1, dtype=np.int64) % self.vocab_size
        self.execute(_single_seq_plan(ids, start=0))
        decode = _single_seq_plan(ids[:1], start=n)
        self.execute(decode)
        # once more through the sampler's general path (a banned token, as min_tokens bans EOS; a
        # seeded draw with top-k / top-p and logprobs): its first use cost 8-10 ms of a first token
        s = decode.sampling
        decode.sampling = dataclasses.replace(
            s, temperature=np.ones(1, np.float32), top_p=np.full(1, 0.9, np.float32), top_k=np.full(1, 50, np.int64),
            has_seed=np.ones(1, bool), num_logprobs=np.full(1, 1, np.int64), suppress_ids=np.zeros(1, np.int64),
            suppress_offsets=np.array([0, 1], np.int64))
        self.execute(decode)
        log.info("warmup done in %.2fs", time.perf_counter() - t0)


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
