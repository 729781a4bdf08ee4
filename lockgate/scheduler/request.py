"""Request: the scheduler's record of one generation request.

Owns the per-request bookkeeping: prompt and output token ids, the KV slots the request
holds, and how far its prompt has been computed. Phases are derived, never stored
(docs/design.md, habit 4): a request is *prefilling* while ``num_computed < prefill_len`` (the
prompt; or prompt + output so far when it resumes after a retraction); after that it
decodes, feeding back its last sampled token each step.

Slot invariant: ``slots[:num_computed]`` are the KV slots of the first ``num_computed``
tokens of ``prompt_ids + output_ids``, in position order, and the request owns exactly
those slots in the allocator. A decoding request has ``num_computed == len(all tokens) - 1``
(its newest token's KV is written by the next step).

Overlap scheduling (engine/core.py) commits a step when it is launched: ``num_computed`` already
counts its rows and each request it samples for holds ``plan.PLACEHOLDER`` as its newest output token
until the step's result replaces it. Nothing reads that token's value before then: it is past
``num_computed`` (never cached), and steps that would read it (guesses, grammar masks, penalties)
wait for the result instead.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import numpy as np

from lockgate.kvcache.radix import RadixNode
from lockgate.sampling import SamplingParams
from lockgate.scheduler.ngram import NgramIndex


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens (or the context limit) reached
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # the request cannot go on (its output constraint broke: StepOutput.error says how)


class Grammar(Protocol):
    """A constrained request's grammar state, as the scheduler uses it (``lockgate.grammar``
    implements it): bitmask rows of ``words`` int32 words, checked guesses, accepted tokens."""

    words: int

    def fill(self, row: np.ndarray, guesses: Sequence[int] = ()) -> None: ...

    def valid_prefix(self, tokens: Sequence[int]) -> int: ...

    def accept(self, token: int) -> bool: ...

    @property
    def done(self) -> bool: ...

    @property
    def error(self) -> str: ...


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: np.ndarray  # i64 [P]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[int, float]]] = field(default_factory=list)
    num_computed: int = 0
    finish_reason: FinishReason | None = None
    stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + params.stop_token_ids
    first_token_time: float | None = None
    last_token_time: float | None = None  # when its newest output token was sampled
    admit_time: float | None = None
    enqueue_step: int = 0  # scheduler step at which it (re)joined the waiting queue
    # Prefix-cache bookkeeping (scheduler-side; the tree knows nothing of requests):
    # slots[:tree_len] belong to the radix tree and are locked through ``tree_node``;
    # slots[tree_len:num_computed] are the request's own.
    tree_len: int = 0
    tree_node: RadixNode | None = None
    cached_tokens: int = 0  # prompt tokens reused from the cache at first admission (reported in usage)
    num_retractions: int = 0
    pending: int = 0  # slots[num_computed:num_computed + pending] were allocated for the step in flight
    # N-gram speculation (scheduler-side, made on the first step the request may speculate):
    drafter: NgramIndex | None = None
    num_drafted: int = 0  # guessed tokens fed to the model
    num_accepted: int = 0  # of those, the ones the model agreed with (extra tokens gained)
    guess_hit_rate: float = 0.5  # how often the drafter's first guess was the next token (moving average)
    open_guess: tuple[int, int] | None = None  # (position, token): the drafter's last first guess, not yet scored
    grammar: Grammar | None = None  # constrained decoding: what the output must match (set by the engine)
    # LoRA: the adapter's number (0: the base model; also the request's prefix-cache namespace)
    # and, while running, the runner slot it sits in (-1: none)
    adapter: int = 0
    lora_slot: int = -1
    tenant: str = "default"  # who the request is served for (fair share between tenants: fairness.py)
    prefill_len: int = field(init=False)  # tokens to compute before sampling: the prompt, or all tokens on resume
    slots: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int64)
        self.prefill_len = self.num_prompt
        # Room for every token that can ever need KV: prompt + max_tokens (the last sampled
        # token never does, so this is one more than needed).
        self.slots = np.empty(self.num_prompt + self.params.max_tokens, dtype=np.int64)

    # ---- derived state -------------------------------------------------------------
    @property
    def num_prompt(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_len

    @property
    def num_private(self) -> int:
        """KV slots the request owns itself (not shared through the prefix cache), including
        those allocated for the step in flight."""
        return self.num_computed + self.pending - self.tree_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def resident(self) -> int:
        """Tokens whose KV the request holds privately, or will once prefilled: all its tokens
        minus those it shares through the prefix cache (counted once, as locked cache slots)."""
        return self.num_tokens - self.tree_len

    @property
    def left(self) -> int:
        """Tokens the request may still generate."""
        return self.params.max_tokens - len(self.output_ids)

    def token_at(self, start: int, stop: int) -> np.ndarray:
        """Token ids at positions [start, stop) of prompt + output."""
        p = self.num_prompt
        if stop <= p:
            return self.prompt_ids[start:stop]
        out = np.asarray(self.output_ids[max(start - p, 0):stop - p], dtype=np.int64)
        return out if start >= p else np.concatenate([self.prompt_ids[start:], out])

    def held_slots(self) -> np.ndarray:
        return self.slots[:self.num_computed]
