"""Command line: ``lockgate serve | gateway | generate | chat | bench | tune | eval | cache``.

Owns argument parsing only: engine flags come from the config tree (``config.py``), the
sampling flags map onto ``SamplingParams`` (whose validation errors are printed as is),
and the work is done by the offline ``LLM``. Exit code 2 on bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from lockgate.config import add_config_args, config_from_args
from lockgate.version import __version__


def _sampling_args(p: argparse.ArgumentParser) -> None:
    # No per-request --seed here: the engine's --seed seeds all sampling, so runs are reproducible.
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                   "whose probabilities add up to this (1 = off)")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1 = all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the "
                   "likeliest (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="divide the logits of tokens already "
                   "in the prompt or output by this (1 = off)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def _params(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    from lockgate.sampling import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
                          stop=tuple(ns.stop), ignore_eos=ns.ignore_eos)


class _DefaultsShown(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings
                or default == []):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser: its own usage on every error, unknown flags included (argparse would
    otherwise leave those to the top-level parser, which prints the top-level usage)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsShown)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockgate", description="lockgate LLM engine")
    parser.add_argument("--version", action="version", version=f"lockgate {__version__}")
    common = _Parser(add_help=False)
    common.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level of every process")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", parents=[common], help="complete one or more raw text prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    chat = sub.add_parser("chat", parents=[common], help="answer a chat message with the model's chat template")
    chat.add_argument("message", nargs="?", help="user message (omit for an interactive session)")
    chat.add_argument("--system", default=None, help="system prompt")
    for p in (gen, chat):
        add_config_args(p)
        _sampling_args(p)
    serve = sub.add_parser("serve", parents=[common], help="start the OpenAI-compatible / TGI-native HTTP server")
    from lockgate.gateway.command import RoutingFlags
    from lockgate.server.launch import add_serve_args
    from lockgate.vllm_compat import add_vllm_args

    serve.add_argument("--version", action="version", version=f"lockgate {__version__}")
    add_serve_args(serve)
    add_config_args(serve, RoutingFlags)  # used with --dp N > 1
    add_vllm_args(serve)
    gateway = sub.add_parser("gateway", parents=[common],
                             help="route requests over several engine replicas (prefix-cache aware)")
    from lockgate.gateway.command import add_gateway_args

    add_gateway_args(gateway)
    tune = sub.add_parser("tune", parents=[common],
                          help="show which kernel serves which call on this CPU for a model (measured once, cached; "
                               "--tuning refresh measures again)")
    add_config_args(tune)
    tune.add_argument("--json", action="store_true", help="print the kernel choice and every figure as JSON")
    ev = sub.add_parser("eval", parents=[common],
                        help="measure a configuration's quality: perplexity over a text and top-1 agreement with "
                             "the exact path (lockgate eval perplexity --activation-quant int8)")
    from lockgate.eval import add_eval_args

    add_eval_args(ev)
    add_config_args(ev)
    bench = sub.add_parser("bench", parents=[common],
                           help="benchmark an OpenAI-compatible server (lockgate bench compare A.json B.json ...)")
    from lockgate.bench.command import add_bench_args

    add_bench_args(bench)
    cache = sub.add_parser("cache", parents=[common],
                           help="list what lockgate keeps on disk (converted models, kernel builds, tunings); "
                                "--prune removes what this version will not use again")
    cache.add_argument("--prune", action="store_true", help="remove the entries listed as stale")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if ns.command == "serve":
        return _serve(ns)
    if ns.command == "gateway":
        from lockgate.gateway.command import gateway_main

        return gateway_main(ns)
    if ns.command == "bench":
        from lockgate.bench.command import run_bench

        return run_bench(ns, list(sys.argv[1:] if argv is None else argv))
    if ns.command == "tune":
        return _tune(ns)
    if ns.command == "eval":
        from lockgate.eval import eval_main

        return eval_main(ns)
    if ns.command == "cache":
        from lockgate.cache_admin import cache_main

        return cache_main(ns.prune)
    try:
        cfg = config_from_args(ns)
        params = _params(ns)
    except ValueError as e:
        print(f"lockgate: error: {e}", file=sys.stderr)
        return 2
    from lockgate.offline import LLM

    t0 = time.perf_counter()
    try:
        llm = LLM(config=cfg)
    except (ValueError, OSError) as e:  # a model lockgate cannot load: say why in one line
        print(f"lockgate: error: cannot load --model {cfg.model.model}: {e}", file=sys.stderr)
        return 2
    logging.getLogger("lockgate").info("model loaded in %.1fs", time.perf_counter() - t0)
    try:
        if ns.command == "generate":
            for out in llm.generate(ns.prompts, params):
                print(out.outputs[0].text)
            return 0
        return _chat(llm, ns, params)
    except ValueError as e:
        print(f"lockgate: error: {e}", file=sys.stderr)
        return 2


def _tune(ns: argparse.Namespace) -> int:
    """Load the model as a server would (its tuning runs or is read from the cache), print the
    kernel choice it applies (``Paths.table``, a ``kernel_choice.TuningTable``)."""
    import json

    from lockgate.config import CacheConfig

    try:
        cfg = config_from_args(ns)
        _check_model_spec(cfg.model.model)
        if cfg.model.model == "sim":
            raise ValueError("--model sim has no kernels to tune")
    except ValueError as e:
        print(f"lockgate: error: {e}", file=sys.stderr)
        return 2
    from lockgate.layers.forms import int_gemm_isa
    from lockgate.runner.model_runner import ModelRunner
    from lockgate.runner.tuning import report

    try:
        runner = ModelRunner(cfg.model, CacheConfig(max_total_tokens=256))  # no KV pool worth the name
    except (ValueError, OSError) as e:
        print(f"lockgate: error: cannot load --model {cfg.model.model}: {e}", file=sys.stderr)
        return 2
    table = runner.paths.table  # the kernel choice as this start applies it (kernel_choice.TuningTable)
    if ns.json:
        print(json.dumps({"dtype": str(runner.dtype).removeprefix("torch."), "dtype_choice": runner.dtype_info,
                          **table.to_json(), "int_gemm_isa": int_gemm_isa()}, indent=1, sort_keys=True))
    else:
        print(report(table, runner.dtype_info, str(runner.dtype).removeprefix("torch.")))
    return 0


def _check_model_spec(spec: str) -> None:
    """Fail fast (before any process starts) on a --model that cannot exist."""
    from pathlib import Path

    from lockgate.checkpoint.hub import split_id
    from lockgate.checkpoint.loader import DEFAULT_NAMES, PACKAGED_MODELS

    if spec == "sim" or spec in DEFAULT_NAMES or spec in PACKAGED_MODELS or Path(spec).expanduser().exists() \
            or split_id(spec) is not None:  # a hub id is resolved (and its errors said) by the engine
        return
    raise ValueError(f"--model {spec!r}: not 'default', 'sim', {', '.join(map(repr, PACKAGED_MODELS))}, "
                     "an existing .gguf file, a model directory or a Hugging Face id (org/name)")


def _serve(ns: argparse.Namespace) -> int:
    from lockgate.gateway.command import routing_from_args, serve_dp
    from lockgate.server.launch import serve
    from lockgate.server_config import cors_from_args, server_config_from_args
    from lockgate.vllm_compat import apply_vllm_args

    try:
        notes = apply_vllm_args(ns)
        engine, server, routing = config_from_args(ns), server_config_from_args(ns), routing_from_args(ns)
        cors = cors_from_args(ns)
        _check_model_spec(engine.model.model)
        if engine.cache.gpu_memory_utilization is not None and (server.dp > 1 or server.ray):
            raise ValueError("--gpu-memory-utilization is a share of this machine's memory for one engine; with "
                             "several replicas size each one's pool with --kv-cache-memory")
        if engine.model.tensor_parallel_size > 1 and (server.dp > 1 or server.ray):
            raise ValueError("--tensor-parallel-size with replicas (--dp / --ray) is not supported yet: each "
                             "replica's ranks would share the same CPUs; give one of the two")
    except ValueError as e:
        print(f"lockgate: error: {e}", file=sys.stderr)
        return 2
    for line in notes:
        logging.getLogger("lockgate").info("%s", line)
    if server.ray:
        from lockgate.fleet.serve import serve_ray

        return serve_ray(engine, server, routing, ns.log_level, cors)
    if server.dp > 1:
        return serve_dp(engine, server, routing, ns.log_level, cors)
    return serve(engine, server, ns.log_level, cors)


def _chat(llm, ns: argparse.Namespace, params) -> int:  # type: ignore[no-untyped-def]
    history: list[dict[str, str]] = [{"role": "system", "content": ns.system}] if ns.system else []
    interactive = ns.message is None
    while True:
        msg = ns.message if not interactive else _read_line()
        if msg is None:
            return 0
        history.append({"role": "user", "content": msg})
        t0 = time.perf_counter()
        out = llm.chat(history, params)[0].outputs[0]
        history.append({"role": "assistant", "content": out.text})
        print(out.text, flush=True)
        dt = time.perf_counter() - t0
        logging.getLogger("lockgate").info("%d tokens in %.2fs (%.1f tok/s), finish: %s", len(out.token_ids), dt,
                                           len(out.token_ids) / dt, out.finish_reason)
        if not interactive:
            return 0


def _read_line() -> str | None:
    try:
        line = input("you> ")
    except EOFError:
        return None
    return line if line.strip() not in ("", "/exit", "/quit") else None


if __name__ == "__main__":
    sys.exit(main())
