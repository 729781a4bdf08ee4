"""A grammar sandbox worker: compiles clients' constraints where a crash costs one request.

Owns one process started by ``grammar.sandbox`` as ``python -m lockgate.grammar.worker ARGS_JSON``
(``ipc.child.GrammarWorkerArgs``). It loads the model's tokenizer once, says ``WorkerReady``, then
answers each ``CompileJob`` read from its stdin with one ``CompileResult`` on its stdout: the
constraint compiled exactly as the scheduler will compile it (``GrammarCompiler.check``: parsed,
turned into llguidance text, a matcher built over the tokenizer, its first mask computed), or the
error. Messages are msgpack, each behind a 4-byte big-endian length.

Limits, so that what a hostile constraint can do ends here:

* the compile runs in a thread whose stack is ``stack_bytes``, smaller than the stack the scheduler
  compiles on (``engine.grammar_wait``): a grammar whose parse recurses past it crashes this process
  (SIGSEGV), and the sandbox refuses the request, before the scheduler ever sees the grammar;
* the address space may grow by ``memory_bytes`` past what the loaded worker holds (RLIMIT_AS): an
  allocation beyond it fails, which llguidance reports as an error or aborts on;
* time is the parent's to bound: it kills a worker that has not answered within the timeout.

Invariants: stdout carries nothing but the protocol (file descriptor 1 is pointed at stderr, so a
stray print from native code cannot corrupt it); one job at a time; EOF on stdin (the API process
gone) ends the process.
"""

from __future__ import annotations

import logging
import os
import resource
import struct
import sys
import threading
import time
from typing import BinaryIO

import msgspec

from lockgate.ipc.child import GrammarWorkerArgs, child_startup
from lockgate.ipc.messages import CompileJob, CompileResult, WorkerReady

log = logging.getLogger("lockgate.grammar")

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024  # a job or a result larger than this is a broken pipe, not a message


def write_frame(out: BinaryIO, payload: bytes) -> None:
    out.write(HEADER.pack(len(payload)) + payload)
    out.flush()


def read_frame(inp: BinaryIO) -> bytes | None:
    """One frame's payload, or None at EOF (or on a frame that breaks the protocol)."""
    head = inp.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_FRAME:
        return None
    payload = inp.read(n)
    return payload if len(payload) == n else None


def limit_address_space(extra_bytes: int) -> None:
    """Cap this process's address space at what it maps now plus ``extra_bytes``."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = mapped + extra_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def serve(args: GrammarWorkerArgs, inp: BinaryIO, out: BinaryIO) -> None:
    from lockgate.grammar import GrammarCompiler
    from lockgate.sampling import StructuredOutput
    from lockgate.tokenizer.tokenizer import load_tokenizer

    compiler = GrammarCompiler(lambda: load_tokenizer(args.model, args.model_dir), args.vocab_size,
                               args.eos_token_ids, cache_size=8)
    compiler.prepare()
    limit_address_space(args.memory_bytes)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CompileJob)
    write_frame(out, encoder.encode(WorkerReady(os.getpid())))
    while True:
        payload = read_frame(inp)
        if payload is None:
            return
        t0 = time.perf_counter()
        try:
            job = decoder.decode(payload)
            text: str | None = compiler.check(StructuredOutput(job.kind, job.value))
            error = None
        except MemoryError:
            text, error = None, "compiling it needs more memory than a grammar may use"
        except RecursionError:
            text, error = None, "it is nested too deeply to compile"
        except Exception as e:  # noqa: BLE001  (every failure is this request's answer, never the worker's end)
            text, error = None, str(e) or type(e).__name__
        write_frame(out, encoder.encode(CompileResult(text, error, time.perf_counter() - t0)))


def main(argv: list[str] | None = None) -> int:
    args = child_startup(argv, GrammarWorkerArgs, "grammar")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # native code printing to stdout lands in the log, not in the protocol
    inp = sys.stdin.buffer
    failed: list[BaseException] = []

    def run() -> None:
        try:
            serve(args, inp, out)
        except BaseException as e:  # noqa: BLE001
            failed.append(e)

    threading.stack_size(args.stack_bytes)
    worker = threading.Thread(target=run, name="grammar-compile")
    worker.start()
    worker.join()
    if failed and not isinstance(failed[0], BrokenPipeError):
        log.error("grammar worker failed: %s", failed[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
