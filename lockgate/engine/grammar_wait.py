"""Requests waiting for their grammar, compiled off the scheduler's loop (vLLM's WAITING_FOR_FSM).

Owns ``GrammarWait``: a constrained request whose matcher is not in the compiler's cache is parked
here while a side thread (``engine.side_thread``) builds it (llguidance releases the GIL, so the
loop's steps go on meanwhile), then handed back by ``take()`` to join the scheduler's waiting queue.
A grammar that compiles slowly delays its own request only; every other stream keeps its pace.

The side thread's stack is several times the grammar sandbox worker's: in the server every grammar
reaching here compiled in a worker first, with the same code over the same tokenizer, so one whose
parse recursed past the worker's stack was refused there and never reaches this process.

Invariants: a request is in here or in the scheduler, never both; ``take()`` returns each parked
request exactly once, with its grammar or with the error that refused it, unless ``abort`` took it
out first; ``wake`` (if given) is called from the side thread each time a result is ready, so an
idle loop blocked on its socket can be woken to collect it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from lockgate.engine.side_thread import SideThread
from lockgate.grammar import GrammarCompiler, GrammarError, RequestGrammar
from lockgate.sampling import StructuredOutput
from lockgate.scheduler.request import Request


@dataclass
class Compiled:
    req: Request
    grammar: RequestGrammar | None
    error: str | None = None


class GrammarWait:
    def __init__(self, compiler: Callable[[], GrammarCompiler], wake: Callable[[], None] | None = None) -> None:
        self._compiler = compiler
        self._side = SideThread("grammar-compile", wake)
        self._done: list[Compiled] = []
        self._parked: dict[str, Request] = {}  # rid -> request, until take() or abort()
        self._cond = threading.Condition()

    def __len__(self) -> int:
        """Requests parked (compiling, or compiled and not yet taken)."""
        return len(self._parked)

    def __contains__(self, rid: str) -> bool:
        return rid in self._parked

    def requests(self) -> list[Request]:
        return list(self._parked.values())

    @property
    def has_ready(self) -> bool:
        return bool(self._done)

    def park(self, req: Request, so: StructuredOutput) -> None:
        self._parked[req.rid] = req
        self._side.submit(lambda: self._compile(req, so))

    def take(self) -> list[Compiled]:
        """The parked requests whose compile ended (grammar or error), each once."""
        if not self._done:
            return []
        with self._cond:
            done, self._done = self._done, []
        return [c for c in done if self._parked.pop(c.req.rid, None) is not None]

    def wait(self, timeout: float | None = None) -> None:
        """Block until a compile has ended (for a caller with nothing else to do: the offline ``LLM``)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._done) or not self._parked, timeout)

    def abort(self, rid: str) -> Request | None:
        """Take a parked request out (its compile still runs; the result is dropped)."""
        return self._parked.pop(rid, None)

    def close(self) -> None:
        self._side.close()

    def _compile(self, req: Request, so: StructuredOutput) -> None:
        if req.rid not in self._parked:
            return  # aborted while it waited
        try:
            result = Compiled(req, self._compiler().matcher(so))
        except GrammarError as e:
            result = Compiled(req, None, str(e))
        except Exception as e:  # noqa: BLE001  (the loop must hear of every end, whatever it was)
            result = Compiled(req, None, f"the constraint could not be compiled: {type(e).__name__}: {e}")
        with self._cond:
            self._done.append(result)
            self._cond.notify_all()
