"""The server's child processes as the API process sees them: how to start them, with what, and
what their exit codes mean; and the start-up every child does first.

Owns the contract between ``server.launch`` (the parent) and the two children, so the parent
never imports a child's module (and with it the engine or the tokenizer stack):

* ``SCHEDULER_MODULE`` / ``DETOKENIZER_MODULE``: run as ``python -m MODULE ARGS_JSON``;
* ``SchedulerProcArgs`` / ``DetokProcArgs``: the typed JSON argument of each (and
  ``GrammarWorkerArgs``, the API process's grammar sandbox workers', ``GRAMMAR_WORKER_MODULE``);
* ``WATCHDOG_EXIT_CODE``: the scheduler's exit code when its watchdog fired;
  ``TENSOR_PARALLEL_EXIT_CODE``: when one of its tensor-parallel ranks died;
* ``child_startup``: decode the argument, configure logging with the process name in each line,
  and ignore SIGINT/SIGTERM. Ctrl-C or a TERM sent to the whole process group reaches the
  children too; the API process coordinates shutdown (a Shutdown message, then SIGKILL), so
  children must not die on their own.
* ``freeze_heap``: what each of the three processes calls once it is ready to serve.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
from typing import TypeVar

import msgspec

from lockgate.config import EngineConfig

A = TypeVar("A")

SCHEDULER_MODULE = "lockgate.engine.process"
DETOKENIZER_MODULE = "lockgate.tokenizer.process"
GRAMMAR_WORKER_MODULE = "lockgate.grammar.worker"
WATCHDOG_EXIT_CODE = 70
TENSOR_PARALLEL_EXIT_CODE = 71  # the scheduler's exit code when a tensor-parallel rank died


class SchedulerProcArgs(msgspec.Struct, frozen=True):
    engine: EngineConfig
    model_name: str
    in_endpoint: str  # PULL, bound here
    detok_endpoint: str  # PUSH to the detokenizer
    watchdog_timeout: float
    decode_log_interval: int
    parent_pid: int
    log_level: str = "INFO"
    warmup: bool = True  # False: --skip-server-warmup


class DetokProcArgs(msgspec.Struct, frozen=True):
    model: str  # the --model spec ("sim" selects the byte tokenizer)
    in_endpoint: str  # PULL, bound here
    api_endpoint: str  # PUSH to the API
    scheduler_endpoint: str  # PUSH to the scheduler (aborts on stop strings)
    parent_pid: int
    log_level: str = "INFO"


class GrammarWorkerArgs(msgspec.Struct, frozen=True):
    """A grammar sandbox worker (``lockgate.grammar.sandbox``): the tokenizer the scheduler compiles
    grammars with, and the limits a compile runs under."""

    model: str  # the --model spec ("sim" selects the byte tokenizer)
    model_dir: str | None
    vocab_size: int  # the model's logits width (a mask row's bits)
    eos_token_ids: list[int]
    stack_bytes: int  # the compiling thread's stack
    memory_bytes: int  # address space a compile may add to the loaded worker
    log_level: str = "WARNING"


def child_startup(argv: list[str] | None, args_type: type[A], name: str) -> A:
    argv = sys.argv[1:] if argv is None else argv
    args = msgspec.json.decode(argv[0], type=args_type)
    logging.basicConfig(level=getattr(args, "log_level", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return args


def freeze_heap() -> None:
    """Collect once, then move every object made so far (modules, the model's Python objects, the
    tokenizer, the web framework) out of the garbage collector's reach (``gc.freeze``, as vLLM's
    engine does after start-up). A full collection then scans only what serving has made since:
    in the scheduler process it took 83 ms over 175,000 start-up objects (Zen 5 class CPU), a
    pause that lands on whichever step or token happens to trigger it."""
    gc.collect()
    gc.freeze()
