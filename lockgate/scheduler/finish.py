"""When a request's output ends, token by token: the scheduler's finish check.

Owns the end conditions that token ids decide. ``Scheduler.update`` calls ``finish_after`` once
per token it appends to a request's output, in order (after a speculating request's accepted
guesses are each appended too), and stops appending at the first token that finishes it. The
first rule that holds wins:

1. a constrained request's grammar refuses the token (the grammar engine gave up on its own mask,
   a limit it reached past the first token): ``error``, with a message saying after how many
   tokens and why; the output no longer follows the constraint, so it is not a normal end;
2. the grammar is complete (``Grammar.done``): ``stop``;
3. the token is a stop token (EOS unless ``ignore_eos``, plus ``stop_token_ids``: the request's
   ``stop_token_ids``) and the output has at least ``min_tokens`` tokens: ``stop``;
4. the output has ``max_tokens`` tokens: ``length``. This is the context limit too:
   ``Scheduler.validate`` admits no request whose prompt + ``max_tokens`` exceeds it.

Stop *strings* are not decided here: they need text. ``OutputProcessor`` (tokenizer/output.py;
the detokenizer process, and the offline ``LLM`` in its own process) cuts the text before the stop
string, finishes the request with ``stop`` on its stream and aborts it in the engine.

Invariant: a grammar's state advances by exactly the tokens appended to the output (``accept`` is
called once per appended token while a grammar is set, never for a token that is not kept).
"""

from __future__ import annotations

from lockgate.scheduler.request import FinishReason, Request


def finish_after(r: Request, tok: int, made: int | None = None) -> tuple[FinishReason, str | None] | None:
    """Whether ``tok``, just appended to ``r``'s output, ends it: (reason, error message for
    ``error``), or None to go on. ``made``: the output's length up to ``tok`` (default: all of it;
    with overlap scheduling a later step's placeholder may already follow it)."""
    made = r.num_output if made is None else made
    g = r.grammar
    if g is not None and not g.accept(tok):
        return FinishReason.ERROR, (f"the output constraint failed after {made} tokens "
                                    f"({g.error or 'the grammar refused its own token'})")
    if g is not None and g.done:
        return FinishReason.STOP, None  # the output is complete
    if tok in r.stop_token_ids and made >= r.params.min_tokens:
        return FinishReason.STOP, None
    if made >= r.params.max_tokens:
        return FinishReason.LENGTH, None
    return None
