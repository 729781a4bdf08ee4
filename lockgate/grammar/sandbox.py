"""The grammar sandbox: the API process checks clients' constraints in worker processes.

A JSON schema, regex or grammar from a client is untrusted input to a compiler written in native
code. Parsed in the API process, a grammar deep enough overflows the stack and the server dies with
SIGSEGV; parsed in a thread, one that compiles slowly keeps the thread. Here every constraint is
compiled by a worker process (``grammar.worker``) under a stack, memory and time limit, so what a
hostile constraint can do costs one request a 400:

* **crash** (stack overflow, abort): the worker's pipe closes; the request gets ``GrammarError``;
  the worker is replaced;
* **timeout** (``timeout`` seconds, ``--grammar-compile-timeout``): the worker is killed, the
  request gets ``GrammarError``, a new worker is started;
* **too many at once**: at most ``queue_limit`` constraints wait for a worker; one more raises
  ``GrammarBusy`` (a 429 with Retry-After), never a wait that holds other requests.

Nothing else in the API process waits on a worker: requests without a constraint, /health and
streams go on whatever the workers do.

``compile(so)`` returns the constraint as an ``llguidance`` ``StructuredOutput`` (the text the
worker compiled), which is what the scheduler is sent: it builds the matcher from that text
(off its loop) and never parses client text itself. Results are cached by the constraint (LRU,
failures too, so a hostile grammar sent again costs nothing; a timeout or a crash only for
``TIMEOUT_MEMORY`` seconds, since a busy machine can slow a good grammar), and requests for a
constraint being compiled share that compile. A request waits at most ``max_wait`` for its compile
(two timeouts and a worker's start; then a 429), and a queued compile nobody waits for any more is dropped unstarted, so
constraints abandoned by their clients cannot keep the workers busy for later ones.

Workers start on demand, with the first constrained request (~0.7 s, once), up to ``workers`` of
them while compiles wait, each ~100 MB (the tokenizer and llguidance's view of it): a server that
never sees a constraint never holds one.
Invariant: each worker runs one job at a time and is owned by one task (``_run``), which alone
reads and writes its pipes; ``close()`` kills every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from lockgate.grammar import GrammarBusy, GrammarError
from lockgate.ipc.child import GRAMMAR_WORKER_MODULE, GrammarWorkerArgs
from lockgate.ipc.messages import CompileJob, CompileResult, FromGrammarWorker, WorkerReady
from lockgate.sampling import StructuredOutput

log = logging.getLogger("lockgate.grammar")

HEADER = struct.Struct(">I")  # the worker's framing (grammar.worker): a 4-byte big-endian length
START_TIMEOUT = 120.0  # seconds a worker may take to load the tokenizer
STACK_BYTES = 8 * 1024 * 1024  # a worker's compile stack (the scheduler's is larger: engine.grammar_wait)
MEMORY_BYTES = 2 * 1024**3  # address space a compile may add to a worker
TIMEOUT_MEMORY = 60.0  # seconds a timed-out or crashing constraint is refused without being tried again
WAIT_FACTOR = 2.0  # a request waits at most this many compile timeouts for its compile, then gets a 429,
WORKER_START_ALLOWANCE = 5.0  # and this many seconds more (a worker may have to start first)


class _TimedOut(GrammarError):
    """A compile that ran out of time or crashed its worker (remembered for ``TIMEOUT_MEMORY``
    seconds only: a busy machine can slow a good grammar, and a worker can die of something else)."""


@dataclass
class _Job:
    so: StructuredOutput
    done: asyncio.Future[str]  # the llguidance text, or GrammarError
    waiters: int = 0  # requests awaiting it now
    started: bool = False  # a worker took it


@dataclass(eq=False)
class _Worker:
    proc: asyncio.subprocess.Process
    busy: bool = False


@dataclass
class GrammarSandbox:
    spec: GrammarWorkerArgs
    workers: int = 2
    queue_limit: int = 64
    timeout: float = 10.0
    cache_size: int = 512
    on_outcome: Callable[[str], None] = field(default=lambda outcome: None)  # ok, invalid, crash, timeout, busy, cached

    def __post_init__(self) -> None:
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._cache: OrderedDict[tuple[str, str], tuple[str | GrammarError, float]] = OrderedDict()  # (result, until)
        self._inflight: dict[tuple[str, str], _Job] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._live: set[_Worker] = set()
        self._closed = False

    # ---- the API's side ----------------------------------------------------------------------
    async def compile(self, so: StructuredOutput) -> StructuredOutput:
        """``so`` checked and compiled by a worker, as the ``llguidance`` constraint to send on.
        ``GrammarError`` (what is wrong, or that it crashed or timed out the compiler);
        ``GrammarBusy`` when ``queue_limit`` constraints are already waiting."""
        if so.kind == "llguidance":
            raise GrammarError("an llguidance constraint is the sandbox's output, not a client's input")
        key = (so.kind, so.value)
        hit, until = self._cache.get(key, (None, 0.0))
        if hit is not None and until < time.monotonic():
            del self._cache[key]
        elif hit is not None:
            self._cache.move_to_end(key)
            self.on_outcome("cached")
            if isinstance(hit, GrammarError):
                raise GrammarError(str(hit))
            return StructuredOutput("llguidance", hit)
        job = self._inflight.get(key)
        if job is None:
            if self._queue.qsize() >= self.queue_limit:
                self.on_outcome("busy")
                raise GrammarBusy(f"{self._queue.qsize()} constraints are waiting to be compiled (the limit); "
                                  "retry shortly", retry_after=max(1, round(self.timeout)))
            job = _Job(so, asyncio.get_running_loop().create_future())
            self._inflight[key] = job
            job.done.add_done_callback(functools.partial(self._settle, key))
            self._queue.put_nowait(job)
            self._grow()
        job.waiters += 1
        try:  # shielded: one client leaving does not cancel a compile others share
            text = await asyncio.wait_for(asyncio.shield(job.done), self.max_wait)
        except TimeoutError:
            self.on_outcome("busy")
            raise GrammarBusy(f"the grammar compilers stayed busy for {self.max_wait:g} s; retry shortly",
                              retry_after=max(1, round(self.timeout))) from None
        finally:
            job.waiters -= 1
            if job.waiters == 0 and not job.started and not job.done.done():
                job.done.cancel()  # nobody waits for it any more: a worker skips it
        return StructuredOutput("llguidance", text)

    @property
    def max_wait(self) -> float:
        """How long a request waits for its compile: two timeouts, and a worker's start."""
        return WAIT_FACTOR * self.timeout + WORKER_START_ALLOWANCE

    def _settle(self, key: tuple[str, str], f: asyncio.Future[str]) -> None:
        if (job := self._inflight.get(key)) is not None and job.done is f:
            del self._inflight[key]
        if f.cancelled():
            return
        err = f.exception()
        if err is None:
            self._remember(key, f.result())
        elif isinstance(err, GrammarError):
            self._remember(key, err)

    def _remember(self, key: tuple[str, str], value: str | GrammarError) -> None:
        until = time.monotonic() + TIMEOUT_MEMORY if isinstance(value, _TimedOut) else math.inf
        self._cache[key] = (value, until)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    async def close(self) -> None:
        self._closed = True
        for w in list(self._live):
            _kill(w.proc)
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t

    # ---- workers -----------------------------------------------------------------------------
    def _grow(self) -> None:
        """One more worker while jobs wait and every live one is busy (up to ``workers``)."""
        idle = sum(1 for w in self._live if not w.busy)
        starting = len(self._tasks) - len(self._live)
        if self._queue.qsize() > idle + starting and len(self._tasks) < self.workers:
            self._spawn()

    def _spawn(self) -> None:
        task = asyncio.create_task(self._run(), name="grammar-worker")
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A worker's task never ends but at ``close()``; if a bug ends it, nobody may wait forever."""
        self._tasks.discard(task)
        if task.cancelled() or self._closed:
            return
        err = task.exception()
        log.error("a grammar worker's task failed (%r); waiting constraints are refused", err)
        self._fail_waiting(f"the grammar compiler failed ({type(err).__name__})")

    async def _start(self) -> _Worker:
        cmd = [sys.executable, "-m", GRAMMAR_WORKER_MODULE, msgspec.json.encode(self.spec).decode()]
        proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, limit=2**26)
        try:
            ready = await asyncio.wait_for(_read(proc), START_TIMEOUT)
        except BaseException:
            _kill(proc)
            raise
        if not isinstance(ready, WorkerReady):
            _kill(proc)
            raise RuntimeError(f"grammar worker (pid {proc.pid}) failed to start: exit code {proc.returncode}")
        log.info("grammar worker started, pid %d", proc.pid)
        return _Worker(proc)

    async def _run(self) -> None:
        """One worker's life, and its replacements': take a job, answer it, replace a broken worker."""
        failures = 0
        while not self._closed:
            try:
                w = await self._start()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                failures += 1
                log.error("could not start a grammar worker (%s)", e)
                self._fail_waiting(f"the grammar compiler could not start ({e})")
                await asyncio.sleep(min(30.0, 2.0**failures))
                continue
            failures = 0
            self._live.add(w)
            try:
                while await self._serve_one(w):
                    pass
            finally:
                self._live.discard(w)
                _kill(w.proc)
                with contextlib.suppress(BaseException):
                    await w.proc.wait()

    async def _serve_one(self, w: _Worker) -> bool:
        """Answer one job on ``w``; False if ``w`` is broken (crashed, killed for time) and must go."""
        job = await self._queue.get()
        if job.done.done():  # cancelled: every request waiting for it left
            return True
        job.started = True
        w.busy = True
        self._grow()
        try:
            return await self._answer(w, job)
        finally:
            w.busy = False

    async def _answer(self, w: _Worker, job: _Job) -> bool:
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "lark": "grammar"}.get(
            job.so.kind, job.so.kind)
        assert w.proc.stdin is not None
        payload = msgspec.msgpack.encode(CompileJob(job.so.kind, job.so.value))
        try:
            w.proc.stdin.write(HEADER.pack(len(payload)) + payload)
            await w.proc.stdin.drain()
            reply = await asyncio.wait_for(_read(w.proc), self.timeout)
        except TimeoutError:
            self.on_outcome("timeout")
            log.warning("a %s did not compile within %gs; its worker (pid %d) is replaced", what, self.timeout,
                        w.proc.pid)
            _settle(job, _TimedOut(f"the {what} did not compile within {self.timeout:g} s "
                                   "(--grammar-compile-timeout)"))
            return False
        except (OSError, ConnectionError):
            reply = None
        if not isinstance(reply, CompileResult):
            code = await _exit_code(w.proc)
            self.on_outcome("crash")
            log.warning("a %s crashed the grammar compiler (worker pid %d, %s); the worker is replaced", what,
                        w.proc.pid, code)
            _settle(job, _TimedOut(f"the {what} cannot be compiled: it crashed the grammar compiler ({code}); "
                                   "it is too large or too deeply nested"))
            return False
        if reply.error is not None:
            self.on_outcome("invalid")
            _settle(job, GrammarError(reply.error))
        else:
            assert reply.text is not None
            self.on_outcome("ok")
            if not job.done.done():
                job.done.set_result(reply.text)
        return True

    def _fail_waiting(self, message: str) -> None:
        while not self._queue.empty():
            _settle(self._queue.get_nowait(), GrammarError(message))


def _settle(job: _Job, err: GrammarError) -> None:
    if not job.done.done():
        job.done.set_exception(err)


_DECODER = msgspec.msgpack.Decoder(FromGrammarWorker)


async def _read(proc: asyncio.subprocess.Process) -> FromGrammarWorker | None:
    """The worker's next message, or None if its stdout closed (it died) or broke the framing."""
    assert proc.stdout is not None
    try:
        head = await proc.stdout.readexactly(HEADER.size)
        (n,) = HEADER.unpack(head)
        return _DECODER.decode(await proc.stdout.readexactly(n))
    except (asyncio.IncompleteReadError, msgspec.DecodeError, ConnectionError):
        return None


async def _exit_code(proc: asyncio.subprocess.Process) -> str:
    try:
        code = await asyncio.wait_for(proc.wait(), 2.0)
    except TimeoutError:
        return "no answer"
    if code < 0:
        import signal

        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
