"""NgramIndex: the n-gram table behind prompt-lookup speculation (speculate.py uses it).

Owns one sequence's tokens and, for every n-gram of them (``min_n <= n <= max_n``), the index
just after its latest occurrence that has a continuation. Adding a token updates ``max_n -
min_n + 1`` entries, so a step costs O(tokens added), never a scan of the history. A request
keeps one as its ``drafter`` (request.py); ``Speculator.propose`` makes it and feeds it.

Invariants: ``propose`` returns tokens that follow an earlier occurrence of the sequence's
suffix, in order, at most ``k`` of them; the index is a pure function of the tokens added so
far (in order). It knows nothing of requests (no scheduler import: request.py imports it).
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
