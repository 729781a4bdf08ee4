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

``NgramIndex`` (ngram.py) finds that continuation in O(tokens added) per step.

``Speculator`` is the scheduler's one hook into speculation: ``propose`` decides which decoding
requests may guess this step and how many guesses the step can afford, and asks each request's
``NgramIndex``; ``verify`` says how many of the sampled tokens the guesses let a request keep;
``accept`` records what the model agreed with and says how many of the request's rows to give back.
The scheduler keeps the rows' slots; the per-token finish check is finish.py's.

A constrained request's guesses are cut at the first one its grammar forbids (the verify rows then
carry the grammar's mask after the guesses before them, ``build_sampling``).

When it may speculate (``propose``): a greedy request without penalties (each row's token is then
the argmax of its own logits, whatever the rows before it), and while the pool could hold every
running request at its full
``prompt + max_tokens`` at once: a request that gains several tokens in one step breaks the
lockstep the peak admission estimate assumes, and only that condition keeps "decode never runs out
of KV" true (admission.py).

How many guesses (``propose``): up to ``speculative_tokens``, fed freely while the step's decode
rows stay within ``speculative_max_rows`` (where a step is bound by reading the weights, such rows
cost little). Beyond that a guess row costs about what the GEMMs spend on any row (on the Zen 5
class CPU at 32 rows, ~0.4 of a decode token's share of the step), so a request feeds its j-th
guess only while ``hit_rate ** j >= speculative_min_acceptance``, where ``hit_rate`` is a moving
average of how often the drafter's first guess was the token that came next, scored on every step
the speculator runs, whether the guess was fed or not (so a request that starts repeating itself is
noticed; while ``propose`` returns early the rate stays as it was). No guess
goes beyond the free rows while a request waits for admission: a longer step would delay its
first token. On the AVX-512 kernel paths the guess rows of one request read their keys once (the attention
kernel runs rows whose key lists extend each other as one sequence; the AVX2 path reads per token).

Invariants: a request never gets guesses beyond its last token (``left - 1``); the drafter's own
(what ``NgramIndex.propose`` returns) are in ngram.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockgate.config import SchedulerConfig
from lockgate.plan import PLACEHOLDER
from lockgate.scheduler.ngram import NgramIndex

if TYPE_CHECKING:
    from lockgate.scheduler.request import Request


# Weight of the newest outcome in a request's guess hit rate (exponential moving average): about
# the last ten guesses decide, so a request that starts or stops repeating itself is followed
# within a few steps.
HIT_RATE_WEIGHT = 0.2


class Speculator:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.num_draft_tokens = 0  # guesses fed to the model so far
        self.num_accepted_tokens = 0  # of those, the ones it agreed with
        self.num_drafts = 0  # (request, step) pairs fed at least one guess
        self.accepted_per_pos = [0] * cfg.speculative_tokens  # accepted guesses by their position (0: first)

    def propose(self, decode: list[Request], running: list[Request], protected: int,
                capacity: int, waiting: bool = False) -> list[list[int]]:
        """Guesses for each decoding request (``[]`` for most), earlier requests first.
        ``protected``: cache slots the running requests lock (counted once); ``waiting``: some
        request waits for admission (then only the free rows take guesses)."""
        cfg = self.cfg
        out: list[list[int]] = [[] for _ in decode]
        room = cfg.speculative_max_rows - len(decode)  # rows that cost little more than none
        wide = cfg.speculative_min_acceptance < 1.0 and not waiting
        if cfg.speculative_tokens == 0 or (room <= 0 and not wide):
            return out
        if protected + sum(r.resident + r.left for r in running) > capacity:  # the worst case must fit
            return out
        for i, r in enumerate(decode):
            limit = min(cfg.speculative_tokens, r.left - 1)
            if limit <= 0 or not may_speculate(r) or r.output_ids[-1:] == [PLACEHOLDER]:
                continue  # (a newest token the step in flight samples is not known yet)
            if r.drafter is None:
                r.drafter = NgramIndex(cfg.speculative_ngram_min, cfg.speculative_ngram_max)
            if len(r.drafter) < r.num_tokens:
                r.drafter.extend(r.token_at(len(r.drafter), r.num_tokens).tolist())
            guess = self._guess(r, limit)
            k = max(min(room, limit), self._paying(r, limit) if wide else 0)
            out[i] = guess[:k]
            if r.grammar is not None and out[i]:  # only guesses the grammar allows are fed
                out[i] = out[i][:r.grammar.valid_prefix(out[i])]
            room -= len(out[i])
        return out

    def _guess(self, r: Request, k: int) -> list[int]:
        """The drafter's ``k`` guesses for ``r``; scores its previous first guess against the token
        that came (whether or not that guess was fed) and opens this one's."""
        assert r.drafter is not None
        toks = r.drafter.tokens
        if r.open_guess is not None and r.open_guess[0] < len(toks):
            pos, tok = r.open_guess
            r.guess_hit_rate += HIT_RATE_WEIGHT * (float(toks[pos] == tok) - r.guess_hit_rate)
            r.open_guess = None
        guess = r.drafter.propose(k)
        if guess:
            r.open_guess = (len(toks), guess[0])
        return guess

    def _paying(self, r: Request, limit: int) -> int:
        """Guesses worth feeding beyond the free rows: the j-th while hit_rate ** j >= min_acceptance
        (the chance all j are right, treating guesses as independent)."""
        j, chance = 0, r.guess_hit_rate
        while j < limit and chance >= self.cfg.speculative_min_acceptance:
            j += 1
            chance *= r.guess_hit_rate
        return j

    @staticmethod
    def verify(guesses: list[int], sampled: list[int]) -> int:
        """How many of ``sampled`` (the tokens of a request's ``1 + len(guesses)`` rows, in order) it
        keeps: row ``j`` was sampled after guess ``j - 1``, so its token counts while every guess
        before it was the model's own token; the first (from the request's newest token) always counts.
        A finish (finish.py) may cut the kept tokens shorter: ``accept`` is then told how many stayed."""
        n = 0
        while n < len(guesses) and guesses[n] == sampled[n]:
            n += 1
        return n + 1

    def accept(self, r: Request, guesses: list[int], num_new: int) -> int:
        """``r`` was fed ``guesses`` and kept ``num_new`` tokens (the model's agreement with them plus
        its own next token). Returns how many of its rows held guesses it did not take."""
        r.num_drafted += len(guesses)
        r.num_accepted += num_new - 1
        self.num_draft_tokens += len(guesses)
        self.num_accepted_tokens += num_new - 1
        self.num_drafts += 1
        for pos in range(num_new - 1):  # the model agreed with guesses 0 .. num_new - 2
            self.accepted_per_pos[pos] += 1
        return 1 + len(guesses) - num_new


def may_speculate(r: Request) -> bool:
    """Greedy without penalties: each row's token is then the argmax of its own logits (stop tokens
    suppressed while the row's output would be shorter than min_tokens, as ``build_sampling``'s
    ``ahead`` arranges), whatever the rows before it."""
    p = r.params
    return p.temperature == 0.0 and not p.has_penalties
