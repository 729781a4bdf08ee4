"""The detokenizer process: token ids -> text deltas, off the scheduler's critical path.

Owns one ``OutputProcessor`` per live request (the same output path the offline ``LLM`` uses). Loop: receive from the scheduler
(``Register`` before a request's first tokens, one ``StepBatch`` per step, ``Ready``), turn
every ``TokenOut`` into a ``TextOut`` and send one ``TextBatch`` per step to the API.

Invariants:

* Text is valid UTF-8 and never contains a stop string (the IncrementalDetokenizer holds
  back what could still become one).
* When a stop string matches, the request is finished here (reason ``stop``) and an
  ``AbortRequest`` goes to the scheduler so its slots return to the pool; whatever the
  scheduler still sends for it afterwards is dropped, so the API sees exactly one finish.
* The tokenizer is loaded when the scheduler's ``Ready`` names the model directory (the
  scheduler prepares it); ``Ready`` is forwarded to the API only after that.

Started by ``lockgate.server.launch`` as ``python -m lockgate.tokenizer.process ARGS_JSON``.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import msgspec
import zmq

from lockgate.config import HEARTBEAT_SECONDS
from lockgate.ipc.channel import Receiver, Sender
from lockgate.ipc.child import DetokProcArgs, child_startup, freeze_heap
from lockgate.ipc.messages import (
    AbortRequest,
    AdapterReply,
    DetokenizerReady,
    Fatal,
    Heartbeat,
    Ready,
    Register,
    Shutdown,
    StepBatch,
    TextBatch,
    TextOut,
    ToDetokenizer,
    TokenOut,
)
from lockgate.tokenizer.output import OutputProcessor
from lockgate.tokenizer.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("lockgate.detokenizer")


class DetokenizerProcess:
    def __init__(self, args: DetokProcArgs) -> None:
        self.args = args
        self.ctx = zmq.Context()
        self.inbox: Receiver[ToDetokenizer] = Receiver(self.ctx, args.in_endpoint, ToDetokenizer)
        self.api = Sender(self.ctx, args.api_endpoint)
        self.scheduler = Sender(self.ctx, args.scheduler_endpoint)
        self.tokenizer: Tokenizer | None = None
        self.live: dict[str, OutputProcessor] = {}

    def run(self) -> None:
        beat, last_beat = Heartbeat("detokenizer", os.getpid()), 0.0
        while True:
            msg = self.inbox.recv(timeout_ms=int(HEARTBEAT_SECONDS * 1000))
            if os.getppid() != self.args.parent_pid:
                log.error("parent process %d is gone; exiting", self.args.parent_pid)
                return
            if self.tokenizer is not None and time.monotonic() - last_beat >= HEARTBEAT_SECONDS:
                self.api.send(beat)
                last_beat = time.monotonic()
            if msg is None:
                continue
            for m in [msg, *self.inbox.drain()]:
                if isinstance(m, StepBatch):
                    self.api.send(TextBatch([t for o in m.outs if (t := self.convert(o)) is not None], m.stats))
                elif isinstance(m, Register):
                    assert self.tokenizer is not None
                    self.live[m.rid] = OutputProcessor(self.tokenizer, tuple(m.stop), m.skip_special_tokens)
                elif isinstance(m, Ready):
                    self.ready(m)
                elif isinstance(m, Fatal | Heartbeat | AdapterReply):
                    self.api.send(m)
                elif isinstance(m, Shutdown):
                    return

    def ready(self, m: Ready) -> None:
        try:
            self.tokenizer = load_tokenizer(self.args.model, m.model_dir)
        except Exception as e:
            log.exception("cannot load the tokenizer")
            self.api.send(Fatal("detokenizer", f"cannot load the tokenizer: {e}"))
            return
        freeze_heap()
        self.api.send(DetokenizerReady(m, os.getpid()))

    def convert(self, o: TokenOut) -> TextOut | None:
        out = self.live.get(o.rid)
        if out is None:
            return None  # finished here already (stop string); the scheduler's echo is dropped
        d = out.process(o.ids, o.logprobs, o.top, o.finish_reason)
        if d.abort_engine:
            self.scheduler.send(AbortRequest(o.rid, "stop string"))
        if d.finish_reason is not None:
            del self.live[o.rid]
        fields = msgspec.structs.asdict(o)
        fields.update(ids=d.ids, logprobs=d.logprobs, top=d.top, finish_reason=d.finish_reason,
                      num_output_tokens=o.num_output_tokens - (len(o.ids) - len(d.ids)))
        return TextOut(text=d.text, stop_matched=d.stop_matched, pieces=d.pieces, **fields)


def main(argv: list[str] | None = None) -> int:
    args = child_startup(argv, DetokProcArgs, "detokenizer")
    DetokenizerProcess(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
