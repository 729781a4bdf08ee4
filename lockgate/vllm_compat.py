"""vLLM's names for lockgate's options: the ``vllm serve`` flags and ``LLM(...)`` keyword arguments
vLLM users copy, with vLLM's meaning, mapped onto the config tree (``config.py``).

Owns the vLLM options that are not config fields: it holds no state of its own. Every vLLM
option lands in one of four places:

* a config field under vLLM's name or as an alias of lockgate's (``--max-num-seqs`` is
  ``--max-running-requests``, ``--max-num-batched-tokens`` is ``--max-prefill-tokens``,
  ``--gpu-memory-utilization``, ``--kv-cache-dtype``, ``--served-model-name``,
  ``--tool-call-parser``): nothing here;
* ``INVERTED``: a switch that is a lockgate switch the other way round
  (``--enable-prefix-caching`` is ``not --disable-prefix-cache``);
* ``ONLY``: an option with one supported value (``--pipeline-parallel-size 1``); any other value is
  an error saying why, never ignored;
* ``NO_EFFECT``: an option that changes nothing here (``--enforce-eager``: there are no CUDA
  graphs); accepted, and one log line says so.

``add_vllm_args`` adds the flags of the last three to ``serve`` (and its positional ``MODEL``);
``apply_vllm_args`` folds them into the parsed namespace before the config is built;
``engine_options`` does the same for ``LLM(**kwargs)``, raising vLLM's ``TypeError`` for a
keyword neither knows. Imports only ``config``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from lockgate.config import engine_aliases, engine_fields

# vLLM option -> the lockgate switch it inverts
INVERTED = {"enable_prefix_caching": "disable_prefix_cache"}

# vLLM option -> (the one value supported, why no other)
ONLY: dict[str, tuple[Any, str]] = {
    "pipeline_parallel_size": (1, "pipeline parallelism is not available yet: one process runs the whole model"),
}

# vLLM option -> why it changes nothing here (logged once when given)
NO_EFFECT = {
    "trust_remote_code": "lockgate runs no code from a model repository: its architectures are built in",
    "enforce_eager": "lockgate has no CUDA graphs to turn off: every step runs eagerly",
    "disable_log_requests": "lockgate does not log requests",
    "enable_auto_tool_choice": 'tool_choice "auto" is always available when a request gives tools',
    "disable_log_stats": "lockgate logs no periodic stats",
    "swap_space": "nothing is swapped out: peak admission never preempts a request",
    "block_size": "the KV pool is token-granular: it has no blocks",
    "enable_chunked_prefill": "prompts are always prefilled in chunks of --max-prefill-tokens, and results do "
                              "not depend on the chunking",
    "max_seq_len_to_capture": "lockgate has no CUDA graphs",
    "disable_custom_all_reduce": "tensor parallelism's all-reduce is always gloo's (there is no custom one)",
}
CLI_NO_EFFECT = ("trust_remote_code", "enforce_eager", "disable_log_requests", "enable_auto_tool_choice",
                 "disable_log_stats")

VLLM_DTYPES = {"half": "float16", "float": "float32"}  # vLLM's other spellings of --dtype values


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kwarg(name: str) -> str:
    return name + "="


def _shown(name_of: Callable[[str], str], name: str, value: Any) -> str:
    shown = name_of(name)
    return f"{shown}{value!r}" if shown.endswith("=") else f"{shown} {value}"


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    """``serve``'s positional MODEL and vLLM's flags that are not config fields."""
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="the model to serve, as vLLM's positional argument (the same as --model)")
    g = p.add_argument_group("vLLM's flags", "accepted with vLLM's meaning; the ones with no effect here log why")
    g.add_argument("-tp", dest="tensor_parallel_size", type=int, default=argparse.SUPPRESS,
                   help="--tensor-parallel-size (vLLM's short flag)")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=None, help="only 1")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="the radix prefix cache (on by default; --no-enable-prefix-caching = --disable-prefix-cache)")
    g.add_argument("--tokenizer", default=None, help="only the model's own tokenizer (the --model value)")
    for name in CLI_NO_EFFECT:
        g.add_argument(_flag(name), action="store_true", default=None, help=f"no effect: {NO_EFFECT[name]}")


def _fold(opts: dict[str, Any], model: str, name_of: Callable[[str], str]) -> tuple[dict[str, Any], list[str]]:
    """vLLM options (``None``: not given) -> (lockgate config fields, log lines); ValueError naming one."""
    fields: dict[str, Any] = {}
    notes: list[str] = []
    for name, value in opts.items():
        if value is None:
            continue
        if name in INVERTED:
            fields[INVERTED[name]] = not value
        elif name in ONLY:
            ok, why = ONLY[name]
            if value != ok:
                raise ValueError(f"{_shown(name_of, name, value)}: {why}")
        elif name == "tokenizer":
            if value != model:
                raise ValueError(f"{_shown(name_of, name, value)}: only the model's own tokenizer is supported "
                                 f"(the --model value, {model!r})")
        elif name in NO_EFFECT:
            if value is not False:
                notes.append(f"{name_of(name).rstrip('=')}: accepted for vLLM compatibility, no effect: {NO_EFFECT[name]}")
        else:
            raise AssertionError(name)
    return fields, notes


def apply_vllm_args(ns: argparse.Namespace) -> list[str]:
    """Fold ``serve``'s vLLM flags into ``ns`` (its config fields); returns the lines to log.
    ValueError naming the flag when a value is not supported or contradicts a lockgate flag."""
    if ns.model_tag is not None:
        if ns.model not in ("default", ns.model_tag):
            raise ValueError(f"the model is given twice: MODEL {ns.model_tag!r} and --model {ns.model!r}: give one")
        ns.model = ns.model_tag
    names = [*INVERTED, *ONLY, "tokenizer", *CLI_NO_EFFECT]
    fields, notes = _fold({n: getattr(ns, n) for n in names}, ns.model, _flag)
    if "disable_prefix_cache" in fields and ns.disable_prefix_cache and not fields["disable_prefix_cache"]:
        raise ValueError("--enable-prefix-caching and --disable-prefix-cache contradict each other: give one")
    for k, v in fields.items():
        setattr(ns, k, v)
    return notes


def engine_options(model: str, options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``LLM(model, **options)``'s keyword arguments -> (``EngineConfig.build`` arguments, lines to log).

    Config fields and their aliases pass through; vLLM's other options are folded as for ``serve``;
    ``dtype="half"`` / ``"float"`` and ``quantization=None`` are read as vLLM reads them. TypeError
    (vLLM's wording) for a keyword neither knows, ValueError for a value not supported."""
    known = engine_fields() | set(engine_aliases())
    vllm = {*INVERTED, *ONLY, "tokenizer", *NO_EFFECT}
    for name in options:
        if name not in known and name not in vllm:
            raise TypeError(f"LLM.__init__() got an unexpected keyword argument {name!r}")
    flat = {k: v for k, v in options.items() if k in known}
    if isinstance(flat.get("dtype"), str):
        flat["dtype"] = VLLM_DTYPES.get(flat["dtype"], flat["dtype"])
    if "quantization" in flat and flat["quantization"] is None:
        flat["quantization"] = "auto"
    if "seed" in flat and flat["seed"] is None:
        del flat["seed"]  # vLLM's "no seed": the engine's default seed
    fields, notes = _fold({k: v for k, v in options.items() if k in vllm}, model, _kwarg)
    if flat.get("disable_prefix_cache") and fields.get("disable_prefix_cache") is False:
        raise ValueError("enable_prefix_caching=True and disable_prefix_cache=True contradict each other: give one")
    flat.update(fields)
    return flat, notes
