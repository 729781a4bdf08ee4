"""N-gram speculation (prompt lookup): guess a request's next tokens from its own history.

Owns the draft proposer. A decode step at batch 1 is bound by reading the weights, so feeding
a sequence ``1 + k`` tokens (its newest token and ``k`` guesses) costs little more than feeding
it one; the model then says, at every one of those positions, which token it would have
produced. The guesses it agrees with are accepted, so one step can yield several tokens
(Saxena's prompt lookup decoding; vLLM's ``ngram`` and TGI's ``--speculate`` proposers do
the same).

The guess: take the longest suffix of the request's tokens (prompt + output), ``max_n`` down
to ``min_n`` tokens long, that occurred earlier in those tokens, and propose what followed its
most recent earlier occurrence. Small models asked for long outputs repeat themselves, and
answers copy from their prompts; both make such guesses right often.

``NgramIndex`` keeps, for every n-gram of the sequence (``min_n <= n <= max_n``), the index
just after its latest occurrence that has a continuation. Adding a token updates ``max_n -
min_n + 1`` entries, so a step costs O(tokens added), never a scan of the history.

Invariants: ``propose`` returns tokens that follow an earlier occurrence of the sequence's
suffix, in order, at most ``k`` of them; the index is a pure function of the tokens added so
far (in order). Whether a request may speculate at all, and how many guesses a step can
afford, is the scheduler's decision (``Scheduler._drafts``); this module only guesses.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # (n-gram as a tuple) -> index of the token that followed its latest occurrence
        self._next: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Iterable[int]) -> None:
        toks, table = self.tokens, self._next
        for t in new:
            end = len(toks)  # the n-grams ending just before ``t`` are followed by it
            for n in range(self.min_n, min(self.max_n, end) + 1):
                table[tuple(toks[end - n:end])] = end
            toks.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        matching suffix; [] when no suffix of ``min_n`` or more tokens occurred before."""
        toks = self.tokens
        if k <= 0:
            return []
        end = len(toks)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = self._next.get(tuple(toks[end - n:end]))
            if start is not None:
                return toks[start:start + k]
        return []
