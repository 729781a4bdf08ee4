"""Incremental detokenization with stop strings.

Owns turning a growing list of output token ids into text deltas that are always valid
UTF-8 and never contain a stop string. Two offsets into the ids (``prefix`` and ``read``,
as in vLLM/TGI; ``ids[prefix:read]`` is the left context last decoded completely): the text of ``ids[prefix:]`` minus the text of
``ids[prefix:read]`` is the new text; a delta ending in U+FFFD (an incomplete multi-byte
character) is held back until the next token completes it, or, at the end of the request, released
as it decodes (what a one-shot decode of all the ids gives).

Stop strings: the tail of the text that could still become a stop string (up to the
longest stop string minus one characters) is held back; when a stop string appears, the
text is cut just before it and ``stopped`` becomes true. Of several, the one whose occurrence
ends first wins (ties: the one starting first), which is what text arriving one character at a
time would see; so the cut never depends on how the text was split into pushes. Nothing after or of the stop
string is ever emitted.
"""

from __future__ import annotations

from lockgate.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""  # all decoded text so far (stop-truncated once stopped)
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False
        self.stop_reason: str | None = None

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text that may now be emitted."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        self._decode_new(complete_only=True)
        self._cut_at_stop()
        return self._release(final=self.stopped)

    def _decode_new(self, complete_only: bool) -> None:
        """Append the text of the tokens past ``read``; ``complete_only``: not while it ends in
        U+FFFD (an unfinished multi-byte character the next token may complete)."""
        if self.read == len(self.ids):
            return
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        full = self.tok.decode(self.ids[self.prefix:], self.skip)
        if len(full) > len(prefix_text) and not (complete_only and full.endswith("\ufffd")):
            self.text += full[len(prefix_text):]
            # The text is complete up to read: those tokens become the next left context.
            self.prefix, self.read = self.read, len(self.ids)

    def _cut_at_stop(self) -> None:
        if not self.stop:
            return
        start = max(self.emitted - self.hold, 0)
        hits = [(i + len(s), i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            _, i, s = min(hits)  # the stop string completed first (then the one starting first)
            self.text = self.text[:i]
            self.stopped = True
            self.stop_reason = s

    def push_until_stop(self, new_ids: list[int]) -> tuple[str, int]:
        """``push`` for several tokens at once (a step that accepted speculative guesses):
        (text, how many of ``new_ids`` were used). With stop strings the tokens go in one at
        a time, and those after the one that completed a stop string are left out, so ids,
        logprobs and usage end where they would had the tokens come one per step."""
        if not self.stop or len(new_ids) <= 1:
            return self.push(new_ids), len(new_ids)
        text = []
        for i, t in enumerate(new_ids):
            text.append(self.push([t]))
            if self.stopped:
                return "".join(text), i + 1
        return "".join(text), len(new_ids)

    def flush(self) -> str:
        """The request ended: release whatever was held back, including text still waiting for a
        multi-byte character to complete (it never will: it is what the whole output decodes to,
        U+FFFD included), cut at a stop string it completes."""
        if not self.stopped:
            self._decode_new(complete_only=False)
            self._cut_at_stop()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(len(self.text) - self.hold, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
