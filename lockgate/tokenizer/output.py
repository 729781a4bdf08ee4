"""One request's output path: token ids in, text deltas and the finish decision out.

Owns what the server's detokenizer process and the offline ``LLM`` both do with each step's new
tokens of a request: detokenize incrementally, cut at a stop string (the ids, logprobs and top
logprobs after the token that completed it are dropped, as if tokens had come one per step),
decide the finish (a stop string ends the request with ``stop`` even if the engine had not
finished it, and then the engine must be told to abort it), and release the held-back text when
the request ends.

Invariants: the text is valid UTF-8 and never contains a stop string; after a ``Delta`` with a
finish reason, nothing more is produced for the request; with several ids, ``pieces`` has one
entry per (kept) id and joins to ``text``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lockgate.tokenizer.detokenizer import IncrementalDetokenizer
from lockgate.tokenizer.tokenizer import Tokenizer

TopLogprobs = list[list[tuple[int, float]]]


@dataclass
class Delta:
    text: str
    ids: list[int]  # the step's tokens, cut after a stop string
    logprobs: list[float] | None
    top: TopLogprobs | None
    finish_reason: str | None  # the engine's, or "stop" when a stop string matched here
    stop_matched: str | None = None  # the stop string, when one ended the request
    abort_engine: bool = False  # a stop string ended a request the engine still runs: abort it there
    pieces: list[str] | None = None  # with several ids (accepted guesses): each one's share of ``text``


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, stop, skip_special_tokens)
        self.finished = False

    def process(self, ids: list[int], logprobs: list[float] | None, top: TopLogprobs | None,
                finish_reason: str | None) -> Delta:
        """One step's share of the request; ``finish_reason`` is the engine's (None: still running)."""
        assert not self.finished, "a finished request got more output"
        pieces: list[str] | None = None
        if len(ids) > 1:  # one token at a time, so each token's own text is known (TGI streams it)
            pieces, used = [], 0
            for t in ids:
                piece, n = self.detok.push_until_stop([t])
                pieces.append(piece)
                used += n
                if self.detok.stopped:
                    break
            text = "".join(pieces)
        else:
            text, used = self.detok.push_until_stop(ids) if ids else ("", 0)
        if used < len(ids):  # tokens after a stop string, from one step's accepted guesses
            ids = ids[:used]
            logprobs = logprobs[:used] if logprobs is not None else None
            top = top[:used] if top is not None else None
        delta = Delta(text, ids, logprobs, top, finish_reason, pieces=pieces)
        if self.detok.stopped:
            delta.abort_engine = finish_reason is None
            delta.finish_reason, delta.stop_matched = "stop", self.detok.stop_reason
        if delta.finish_reason is not None:
            rest = self.detok.flush()
            delta.text += rest
            if delta.pieces:
                delta.pieces[-1] += rest
            self.finished = True
        return delta
