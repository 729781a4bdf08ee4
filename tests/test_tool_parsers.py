"""Tool-call formats (issue 51): each parser on the text its model family writes, whole and streamed.

Every realistic output is parsed whole and streamed split at every character boundary (two pieces),
one character at a time, and in pieces of 3 and 7: the stream must give the whole text's calls and
content, and no piece of call markup may reach the content. Malformed calls come back as content.
What a parser writes (``calls_text``, the prompt's example, the forced-call grammar) is read back by
the same parser, and ``auto`` is checked on the tool sections of the families' chat templates.
"""

from __future__ import annotations

import json

import pytest

from lockgate.grammar import GrammarCompiler
from lockgate.server.tool_parsers import ALIASES, NAMES, PARSERS, detect, resolve
from lockgate.server.tools import render_conversation, tool_grammar
from lockgate.server_config import TOOL_CALL_PARSERS
from lockgate.tokenizer.tokenizer import SimTokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer"}}, "required": ["city"]}
CODE = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                         "overwrite": {"type": "boolean"}, "lines": {"type": "array"}}}
TOOLS = {"get_weather": WEATHER, "write_file": CODE}
TOOL_DEFS = [{"type": "function", "function": {"name": n, "description": n, "parameters": p}} for n, p in TOOLS.items()]
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
SOURCE = 'def f(x):\n    return x < 2 and "a" or \'b\'\n'

# (format, the model's text, the content left, the calls) as each family writes them
CASES = [
    # Hermes 2 Pro / Qwen 2.5 / Qwen3
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [PARIS]),
    ("hermes", 'I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "I will check both.", [PARIS, ("get_weather", {"city": "Oslo"})]),
    ("hermes", "<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     '{"city": "Paris", "unit": "celsius"}}\n</tool_call>', "<think>\nThe user wants weather.\n</think>", [PARIS]),
    # Qwen3-Coder: raw values, typed by the schema
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
     "celsius\n</parameter>\n</function>\n</tool_call>", None, [PARIS]),
    ("qwen3_coder", f"Writing the file.\n<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
     f"<parameter=content>\n{SOURCE}\n</parameter>\n<parameter=overwrite>\ntrue\n</parameter>\n<parameter=lines>\n"
     "[1, 2]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Oslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "Writing the file.",
     [("write_file", {"path": "/tmp/a.py", "content": SOURCE, "overwrite": True, "lines": [1, 2]}),
      ("get_weather", {"city": "Oslo", "days": 3})]),
    # Llama 3.1-3.3 (JSON): the whole answer, after <|python_tag|> or not, several separated by ";"
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eom_id|>', None, [PARIS, ("get_weather", {"city": "Oslo"})]),
    ("llama3_json", 'Let me look that up. <|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}', "Let me look that up.", [PARIS]),
    # Mistral: v0.3's JSON list, v11's NAME[ARGS]{...}, with [CALL_ID], and with the special tokens skipped
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None, [PARIS]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_weather[ARGS]'
     '{"city": "Oslo"}</s>', "Sure.", [PARIS, ("get_weather", {"city": "Oslo"})]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "celsius"}', None, [PARIS]),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None, [PARIS]),
    ("mistral", 'get_weather{"city": "Paris", "unit": "celsius"}', None, [PARIS]),
    # pythonic (Llama 3.2 / 4 pythonic templates)
    ("pythonic", "[get_weather(city='Paris', unit='celsius')]", None, [PARIS]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", unit="celsius"), write_file(path="a", overwrite=True, '
     'lines=[1, (2, 3)], content=None)]<|python_end|>', None,
     [PARIS, ("write_file", {"path": "a", "overwrite": True, "lines": [1, [2, 3]], "content": None})]),
]

# (format, text): calls that are not calls, returned as content whole
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'),  # never closed
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # not among the tools
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=nope>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\nstray text<parameter=city>\nP\n</parameter>\n</function>\n"
     "</tool_call>"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and that is all'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}'),  # cut short
    ("llama3_json", '{"answer": 42}'),  # JSON, but no call
    ("llama3_json", '<|python_tag|>print("hi")'),  # a built-in (code interpreter) call: not a function
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} trailing'),
    ("mistral", "[1] is the first item"),
    ("mistral", "get_weather is a function I could call."),
    ("pythonic", "[get_weather('Paris')]"),  # positional arguments
    ("pythonic", "[get_weather(city=__import__('os').getcwd())]"),  # not a literal
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[get_weather(city={1, 2})]"),  # a set is not JSON
    ("pythonic", "[" * 200 + "]" * 200),
]


def streamed(fmt: str, text: str, cuts: list[int]) -> tuple[list[str], list]:
    stream = PARSERS[fmt].stream(TOOLS)
    shown, calls, at = [], [], 0
    for end in [*cuts, len(text)]:
        out, got = stream.feed(text[at:end])
        shown.append(out)
        calls += got
        at = end
    out, got = stream.finish()
    return [*shown, out], calls + got


def splits(n: int) -> list[list[int]]:
    """Two pieces cut at every boundary, one character at a time, pieces of 3 and of 7."""
    return [[i] for i in range(n + 1)] + [list(range(1, n))] + [list(range(k, n, k)) for k in (3, 7)]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_each_format_reads_its_familys_calls_whole_and_split_anywhere(fmt, text, content, calls) -> None:
    got_content, got = PARSERS[fmt].parse(text, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)
    if fmt == "mistral":  # the only ids Mistral's chat templates take back
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got)
    else:
        assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got)
    markup = ("<tool_call>", "</tool_call>", "<function=", "<parameter=", "[TOOL_CALLS]", "[ARGS]", "<|python",
              '"name"', "get_weather(", "get_weather{")
    for cuts in splits(len(text)):
        shown, s_calls = streamed(fmt, text, cuts)
        assert [(c.name, c.arguments) for c in s_calls] == [(c.name, c.arguments) for c in got], cuts
        assert ("".join(shown).strip() or None) == content, cuts
        assert not any(m in piece for piece in shown for m in markup), (cuts, shown)


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_malformed_calls_are_content_whole_and_streamed(fmt, text) -> None:
    assert PARSERS[fmt].parse(text, TOOLS) == (text, [])
    for cuts in splits(len(text)):
        shown, calls = streamed(fmt, text, cuts)
        assert calls == [] and "".join(shown) == text, cuts


def test_plain_answers_stream_as_they_come() -> None:
    """Text that cannot start a call is shown at once, in every format (only a possible tag's start is held)."""
    for fmt in PARSERS:
        stream = PARSERS[fmt].stream(TOOLS)
        assert stream.feed("The weather in Paris ") == ("The weather in Paris ", [])
        tag_start = "[TOOL" if fmt == "mistral" else "<"
        assert stream.feed("is mild " + tag_start) == ("is mild ", [])  # held: it may become a tag
        assert stream.feed("3 degrees.") == (tag_start + "3 degrees.", []) and stream.finish() == ("", [])


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_what_a_format_writes_it_reads_back(fmt) -> None:
    """Earlier calls written into the prompt (``calls_text``) and the prompt's own example parse as calls."""
    p = PARSERS[fmt]
    calls = [PARIS, ("write_file", {"path": "a.py", "content": SOURCE, "overwrite": False, "lines": [1, 2]})]
    content, got = p.parse(p.calls_text(calls), TOOLS)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in got] == calls
    example = p.how_to().rsplit(":\n", 1)[1]
    _, got = p.parse(example, {"function_name": {}})
    assert [(c.name, json.loads(c.arguments)) for c in got] == [("function_name", {"argument": "value"})]
    out, _ = render_conversation([{"role": "user", "content": "Weather?"},
                                  {"role": "assistant", "content": None, "tool_calls": [
                                      {"id": "x", "type": "function", "function": {"name": "get_weather",
                                                                                  "arguments": json.dumps(PARIS[1])}}]}],
                                 TOOL_DEFS, template_takes_tools=False, parser=p)
    assert p.how_to() in out[0]["content"] and out[2]["content"] == p.calls_text([PARIS])


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_forced_calls_are_written_in_a_format_the_server_reads(fmt) -> None:
    """``tool_choice`` required: the grammar takes a valid call in the forced format and nothing else,
    and that format's parser reads it back as the one call."""
    tok = SimTokenizer()
    gc = GrammarCompiler(lambda: tok, tok.vocab_size, tok.eos_token_ids)
    p = PARSERS[fmt]
    forced = p.forced
    assert forced.name == {"qwen3_coder": "hermes", "pythonic": "llama3_json"}.get(fmt, fmt)
    so = tool_grammar(TOOL_DEFS, "required", p)
    text = forced.calls_text([("get_weather", {"city": "Paris", "unit": "celsius", "days": 2})])

    def takes(t: str) -> bool:
        ids = tok.encode(t)
        return gc.matcher(so).valid_prefix(ids) == len(ids)

    assert takes(text) and not takes("Sure! " + text)
    assert not takes(text.replace('"days": 2', '"days": "two"'))
    content, calls = forced.parse(text, TOOLS)
    assert content is None and [c.name for c in calls] == ["get_weather"]


TEMPLATES = {  # the tool sections of the families' chat templates (abridged)
    "hermes": "{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\nFor each function "
              "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags"
              "{%- endif %}",
    "qwen3_coder": "{%- if tools %}<tools>{% for tool in tools %}<function><name>{{ tool.function.name }}</name>"
                   "</function>{% endfor %}</tools>\nIf you choose to call a function ONLY reply in the following "
                   "format:\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1"
                   "\n</parameter>\n</function>\n</tool_call>{%- endif %}",
    "llama3_json": "{%- if tools is not none %}Given the following functions, please respond with a JSON for a function "
                   'call with its proper arguments.Respond in the format {"name": function name, "parameters": '
                   "dictionary of argument name and its value}.{%- endif %}{%- if message.tool_calls %}"
                   "<|python_tag|>{{ tool_call.function.arguments | tojson }}{% endif %}",
    "mistral": "{%- if tools is not none and (message == user_messages[-1]) %}[AVAILABLE_TOOLS]{{ tools|tojson }}"
               "[/AVAILABLE_TOOLS]{%- endif %}{%- elif message.tool_calls is defined %}[TOOL_CALLS][{%- for tool_call "
               "in message.tool_calls %}{{ tool_call.function|tojson }}{% endfor %}]",
    "pythonic": "{%- if tools is not none %}If you decide to invoke any of the function(s), you MUST put it in the "
                "format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
                "{%- endif %}<|python_tag|>",
}


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_auto_picks_the_format_the_chat_template_teaches(fmt) -> None:
    assert detect(TEMPLATES[fmt])[0] == fmt
    parser, line = resolve("auto", TEMPLATES[fmt])
    assert parser is PARSERS[fmt] and fmt in line and "auto" in line


def test_auto_without_a_tool_template_and_the_names() -> None:
    """A template that does not render tools gets lockgate's Hermes prompt, so Hermes is read; every
    name vLLM gives these formats is accepted, by the flag too; others are a clear error."""
    assert detect(None)[0] == detect("{% for m in messages %}{{ m.content }}{% endfor %}")[0] == "hermes"
    assert resolve(None, None)[0] is PARSERS["hermes"]
    assert set(TOOL_CALL_PARSERS) == set(NAMES)
    for alias, name in ALIASES.items():
        assert resolve(alias, None)[0] is PARSERS[name]
    assert resolve("mistral", TEMPLATES["hermes"])[0] is PARSERS["mistral"]  # the flag wins over the template
    with pytest.raises(ValueError, match="--tool-call-parser 'granite'"):
        resolve("granite", None)
