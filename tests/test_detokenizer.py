"""Incremental detokenization: UTF-8 safety and stop strings split across tokens.

Uses the byte-level sim tokenizer, where every multi-byte character spans several tokens,
so splits happen on purpose; tests/test_golden.py streams the real model's tokenizer.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lockgate.tokenizer.detokenizer import IncrementalDetokenizer
from lockgate.tokenizer.tokenizer import SimTokenizer

TOK = SimTokenizer()


def stream(text: str, stop: tuple[str, ...] = (), chunk: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    ids = TOK.encode(text)
    d = IncrementalDetokenizer(TOK, stop)
    pieces = []
    for i in range(0, len(ids), chunk):
        pieces.append(d.push(ids[i:i + chunk]))
        if d.stopped:
            break
    pieces.append(d.flush())
    return pieces, d


def test_multibyte_characters_never_split():
    text = "héllo wörld — 你好 🙂!"
    pieces, _ = stream(text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # Each 4-byte emoji arrives as 4 tokens but is emitted once, whole.
    assert "🙂" in pieces


def test_stop_string_split_across_tokens_is_never_emitted():
    pieces, d = stream("The answer is 42. END of story", stop=("END",))
    assert "".join(pieces) == "The answer is 42. "
    assert d.stopped and d.stop_reason == "END"
    assert not any("E" in p for p in pieces)


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    pieces, d = stream("ENtry ENd", stop=("END",))
    assert "".join(pieces) == "ENtry ENd" and not d.stopped


def test_earliest_stop_string_wins():
    pieces, d = stream("abc STOP2 xyz STOP1", stop=("STOP1", "STOP2"))
    assert "".join(pieces) == "abc " and d.stop_reason == "STOP2"


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40), stop=st.lists(st.text(min_size=1, max_size=4), max_size=3),
       chunk=st.integers(1, 5))
def test_matches_one_shot_decode(text, stop, chunk):
    """Streaming in any chunking equals: decode everything, cut at the first stop string."""
    pieces, _ = stream(text, tuple(stop), chunk)
    expect = text
    cuts = [i for s in stop if (i := text.find(s)) >= 0]
    if cuts:
        expect = text[:min(cuts)]
    assert "".join(pieces) == expect
