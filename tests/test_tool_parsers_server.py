"""Tool-call formats over HTTP (issue 51), through the official ``openai`` client.

No model the suite has teaches a format other than Hermes (the default model's template does not
render tools), so the real-model test serves the default model's weights and tokenizer with a chat
template written here, offline: the model's own ChatML frame with Llama 3.1's JSON tool section
(``{"name": ..., "parameters": ...}``, earlier calls after ``<|python_tag|>``). ``auto`` must pick
``llama3_json`` from it and say so in the start-up log. Then: ``tool_choice`` required gives a call in
that format, whole and streamed; ``auto`` with the model made to write a given text (a
one-choice ``guided_choice`` constraint, so the real tokenizer cuts the stream into its own pieces)
streams the text before the call as content and the call as a ``tool_calls`` delta, with no markup
in the content; a malformed call is a 200 whose content is the text; the call and its answer go back
through the template. The sim model covers an explicit ``--tool-call-parser mistral``.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_util import ServerProc
from test_tools import SCHEMAS, TOOLS  # the same two tools, over HTTP here

LLAMA3_JSON_TEMPLATE = """\
{%- for message in messages %}
{%- if loop.first %}<|im_start|>system
{% if message['role'] == 'system' %}{{ message['content'] }}
{% endif %}{% if tools %}Given the following functions, please respond with a JSON for a function call with its \
proper arguments that best answers the given prompt.
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. \
Do not use variables.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}<|im_end|>
{% endif %}
{%- if message['role'] == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for c in message.tool_calls %}<|python_tag|>{"name": "{{ c.function.name }}", "parameters": \
{{ c.function.arguments | tojson }}}{% endfor %}<|im_end|>
{% elif message['role'] == 'tool' %}<|im_start|>ipython
{{ message['content'] }}<|im_end|>
{% elif message['role'] != 'system' %}<|im_start|>{{ message['role'] }}
{{ message['content'] or '' }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def llama3_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "llama3_json.jinja"
    template.write_text(LLAMA3_JSON_TEMPLATE)
    s = ServerProc("--model", "default", "--chat-template", str(template), "--max-total-tokens", "8192")
    try:
        yield s.wait_ready(timeout=300)
    finally:
        s.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def stream_of(c: openai.OpenAI, **kw) -> tuple[str, list, str | None]:
    """(the content deltas joined, the tool_calls deltas, the finish reason) of a streamed answer."""
    content, calls, finish = [], [], None
    for chunk in c.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            d = chunk.choices[0].delta
            content.append(d.content or "")
            calls += d.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    return "".join(content), calls, finish


def test_a_llama3_json_template_is_read_in_its_format(llama3_server) -> None:
    assert "tool calls read as llama3_json (auto: from the chat template)" in llama3_server.log()
    c = client(llama3_server)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    # forced: one call in the template's format, valid against the schema, whole and streamed alike
    # (named choices take the same path with one function: test_tools covers them on the default format)
    kw = dict(model="default", messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)
    ch = c.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    (call,) = ch.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, deltas, finish = stream_of(c, **kw)
    assert finish == "tool_calls" and content == "" and len(deltas) == 1
    assert (deltas[0].function.name, deltas[0].function.arguments) == (call.function.name, call.function.arguments)
    # auto: the model writes text, then a call after <|python_tag|>
    said = 'Let me check the weather for you. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", ' \
           '"unit": "celsius"}}'
    kw = dict(model="default", messages=msgs, tools=TOOLS, max_tokens=80, extra_body={"guided_choice": [said]})
    ch = c.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check the weather for you."
    (call,) = ch.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"} and call.id.startswith("call_")
    content, deltas, finish = stream_of(c, **kw)
    assert content.strip() == "Let me check the weather for you." and finish == "tool_calls"
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, "get_weather", call.function.arguments)]
    # malformed: text after the call's JSON: the whole answer is content (streamed: test_hostile, sim model)
    bad = '{"name": "get_weather", "parameters": {"city": "Paris"}} is what I would call'
    kw = dict(model="default", messages=msgs, tools=TOOLS, max_tokens=80, extra_body={"guided_choice": [bad]})
    ch = c.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "stop" and ch.message.content == bad and not ch.message.tool_calls
    # the call and the tool's answer go back through the template
    back = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    r = c.chat.completions.create(model="default", messages=back, tools=TOOLS, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_the_flag_chooses_the_format_mistral_on_the_sim_model() -> None:
    """``--tool-call-parser mistral`` on a model whose template does not render tools: the prompt teaches
    ``[TOOL_CALLS]``, forced calls are written in it, call ids are 9 letters and digits (what Mistral's
    templates accept back), and a model's ``[TOOL_CALLS]`` list in auto mode is read, whole and streamed."""
    s = ServerProc("--model", "sim", "--tool-call-parser", "mistral")
    try:
        s.wait_ready()
        assert "tool calls read as mistral (--tool-call-parser mistral)" in s.log()
        c = client(s)
        msgs = [{"role": "user", "content": "What is 2 + 3?"}]
        ch = c.chat.completions.create(model="sim", messages=msgs, tools=TOOLS, tool_choice="required",
                                       max_tokens=200).choices[0]
        (call,) = ch.message.tool_calls
        assert ch.finish_reason == "tool_calls" and len(call.id) == 9 and call.id.isalnum()
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        said = 'Adding.[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]'
        kw = dict(model="sim", messages=msgs, tools=TOOLS, max_tokens=100, extra_body={"guided_choice": [said]})
        ch = c.chat.completions.create(**kw).choices[0]
        assert ch.message.content == "Adding." and ch.message.tool_calls[0].function.arguments == '{"a": 2, "b": 3}'
        content, deltas, finish = stream_of(c, **kw)
        assert (content, finish) == ("Adding.", "tool_calls")
        assert [(d.function.name, d.function.arguments) for d in deltas] == [("add", '{"a": 2, "b": 3}')]
    finally:
        s.stop()
