"""Tool calling on chat (issue 20): tools into the prompt, calls out of the text, constrained calls.

The parsing and rendering units are checked directly (streamed parsing must equal whole-text parsing,
split anywhere); the OpenAI client drives the sim server for the wire format (non-streamed and streamed
``tool_calls``, ``finish_reason: "tool_calls"``, a ``role: "tool"`` answer sent back) and the real model
for the promise that matters: with ``tool_choice: required`` or a named function, every answer is a call
whose arguments parse and validate against the function's schema.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_util import ServerProc

from lockgate.grammar import GrammarCompiler
from lockgate.server.tool_parsers import PARSERS
from lockgate.server.tools import render_conversation, tool_grammar
from lockgate.tokenizer.tokenizer import SimTokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMES = SCHEMAS
HERMES = PARSERS["hermes"]


# ---- parsing ------------------------------------------------------------------------------------
CALL_A = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'


@pytest.mark.parametrize("text,content,calls", [
    ("just words", "just words", []),
    (CALL_A, None, [("add", {"a": 1, "b": 2})]),
    (f"Let me check.\n{CALL_W}\n{CALL_A}", "Let me check.", [("get_weather", {"city": "Oslo", "unit": "celsius"}),
                                                             ("add", {"a": 1, "b": 2})]),
    ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', None, []),  # unknown function: text
    ("<tool_call>\n{not json\n</tool_call>", None, []),
    ("<tool_call>\n{\"name\": \"add\"", None, []),  # never closed: text
    ("a < b and <tool", "a < b and <tool", []),
])
def test_parse_tool_calls(text, content, calls) -> None:
    got_content, got = HERMES.parse(text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (content if calls else text)
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got)
    assert len({c.id for c in got}) == len(got)
    # streamed in pieces split anywhere: the same calls, the same content
    for step in (1, 3, 7):
        stream = HERMES.stream(NAMES)
        shown, streamed = "", []
        for i in range(0, len(text), step):
            s, c = stream.feed(text[i:i + step])
            shown += s
            streamed += c
        shown += stream.finish()[0]
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in got]
        assert (shown.strip() or None) == got_content if calls else shown == text


def test_render_conversation_without_and_with_template_support() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "3", "tool_call_id": "call_1"}]
    out, tools = render_conversation(msgs, TOOLS, template_takes_tools=False)
    assert tools is None and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and json.dumps(ADD["function"]) in out[0]["content"]
    assert out[2]["content"] == CALL_A
    assert out[3]["content"] == "<tool_response>\n3\n</tool_response>"
    out, tools = render_conversation(msgs, TOOLS, template_takes_tools=True)
    assert tools == TOOLS and out[3]["role"] == "tool"
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}  # HF templates expect an object
    # a template that renders tools gets them
    tok = SimTokenizer()
    tok.template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert tok.supports_tools
    assert tok.apply_chat_template(out[:2], tools=tools).startswith("[get_weather][add]<system>")


def test_tool_grammar_allows_exactly_one_valid_call() -> None:
    tok = SimTokenizer()
    gc = GrammarCompiler(lambda: tok, tok.vocab_size, tok.eos_token_ids)
    assert tool_grammar(TOOLS, "auto") is None and tool_grammar(TOOLS, "none") is None

    def takes(so, text: str) -> bool:
        g = gc.matcher(so)
        ids = tok.encode(text)
        return g.valid_prefix(ids) == len(ids) and (g.accept(ids[0]) or True)

    named = tool_grammar(TOOLS, {"function": {"name": "add"}})
    required = tool_grammar(TOOLS, "required")
    assert takes(named, CALL_A) and not takes(named, CALL_W)
    assert takes(required, CALL_A) and takes(required, CALL_W)
    assert not takes(required, CALL_A.replace('"b": 2', '"b": "two"'))
    assert not takes(required, "Sure! " + CALL_A)


# ---- over HTTP, sim model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim():
    s = ServerProc("--model", "sim")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_tool_calls_on_the_wire(sim) -> None:
    c = openai.OpenAI(base_url=sim.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = c.chat.completions.create(model="sim", messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=200)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        (call,) = ch.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
    # streamed: the same call (apart from its id), one tool_calls delta, finish_reason tool_calls
    kw = dict(model="sim", messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    whole = c.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    deltas, finish = [], None
    for chunk in c.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(deltas) == 1 and deltas[0].index == 0
    assert (deltas[0].function.name, deltas[0].function.arguments) == (whole.function.name, whole.function.arguments)
    # the call and its answer go back into the conversation
    back = msgs + [{"role": "assistant", "content": None, "tool_calls": [whole.model_dump()]},
                   {"role": "tool", "tool_call_id": whole.id, "content": "5"}]
    r = c.chat.completions.create(model="sim", messages=back, tools=TOOLS, max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    # tool_choice none: no tools in the prompt, nothing parsed
    r = c.chat.completions.create(model="sim", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body,needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "give one"),
    ({"tools": [ADD, ADD]}, "same name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
])
def test_bad_tool_requests_are_400(sim, body, needle) -> None:
    r = httpx.post(sim.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_tools_on_completions_are_refused(sim) -> None:
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "tools": TOOLS})
    assert r.status_code == 400 and "tools is not supported" in r.text


# ---- the real model ------------------------------------------------------------------------------
def test_required_tool_choice_always_yields_a_valid_call(smol_server) -> None:
    c = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    questions = ["What is the weather in Tokyo?", "Add 17 and 25.", "Is it cold in Helsinki today?",
                 "What is 3 plus 4?", "Tell me a joke.", "Weather in Lima, in fahrenheit please."]
    for i, q in enumerate(questions):
        r = c.chat.completions.create(model="default", messages=[{"role": "user", "content": q}], tools=TOOLS,
                                      tool_choice="required", max_tokens=120, temperature=0.0 if i % 2 else 0.7,
                                      seed=i)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    r = c.chat.completions.create(model="default", messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                  tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                  max_tokens=60, temperature=0)
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    jsonschema.validate(args, SCHEMAS["add"])
