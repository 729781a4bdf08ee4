"""Tool calling on chat: the tools into the prompt, the model's calls out of its text.

Owns the one tool-call format lockgate speaks, Hermes-style (Qwen 2.5/3 and NousResearch Hermes
templates use it): each call is a JSON object ``{"name": ..., "arguments": {...}}`` between
``<tool_call>`` and ``</tool_call>`` lines, and a tool's answer goes back between
``<tool_response>`` tags.

* ``render_conversation``: OpenAI messages (assistant ``tool_calls``, ``role: "tool"`` answers) and
  tool definitions -> what the chat template is given. A template that renders ``tools`` itself gets
  them as they are (arguments parsed into objects, as Hugging Face templates expect); for one that
  does not (the default model's), the definitions and the call format are written into the system
  message, earlier calls into the assistant's text, and tool answers become user turns wrapped in
  ``<tool_response>`` (roles every template knows).
* ``tool_grammar``: ``tool_choice`` ``required`` or a named function -> a grammar the output must
  match: one call whose ``arguments`` follow the function's JSON schema (so it always parses and
  validates). ``auto`` leaves the output free; ``none`` leaves the tools out of the prompt.
* ``parse_tool_calls`` and ``ToolCallStream``: the text -> (content, calls); a block that is not
  valid JSON naming a known function stays in the content, unparsed (nothing is invented).

Invariants: a call's ``arguments`` is a JSON string (the OpenAI wire format); call ids are
``call_`` + 24 hex digits; the streamed calls equal the parsed ones of the same text.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from lockgate import jsonsafe
from lockgate.sampling import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _system_text(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call functions to help answer the user. The functions you can call are listed "
            f"between <tools> and </tools>, one JSON object each:\n<tools>\n{lines}\n</tools>\n"
            "To call one, answer with a JSON object holding the function's name and its arguments "
            "between <tool_call> and </tool_call>, like this:\n"
            '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>')


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = _loads(fn.get("arguments"))
    return f"{OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def render_conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        template_takes_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template; see the module docstring."""
    if template_takes_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _loads(c["function"].get("arguments"))}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, tools or None
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        text = _system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def _loads(args: Any) -> Any:
    """A client's call arguments (JSON text) as an object, or the text itself if it is not JSON
    within ``jsonsafe``'s limits."""
    if isinstance(args, str):
        try:
            return jsonsafe.loads(args)
        except ValueError:
            return args
    return args


def tool_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> StructuredOutput | None:
    """The constraint ``tool_choice`` puts on the output: None for auto/none; one call otherwise.

    Each function's ``parameters`` schema goes under the call schema's ``$defs`` (``tool0``,
    ``tool1``, ...) with its own ``$ref`` pointers moved along (``#/$defs/Unit`` becomes
    ``#/$defs/tool0/$defs/Unit``), so schemas that refer to their own ``$defs`` (as pydantic writes
    them) mean the same inside the call as they do alone."""
    if choice in ("auto", "none"):
        return None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
    else:  # required
        chosen = tools
    defs: dict[str, Any] = {}

    def call_schema(i: int, t: dict[str, Any]) -> dict[str, Any]:
        params = t["function"].get("parameters") or {"type": "object", "properties": {}}
        defs[f"tool{i}"] = _moved_refs(params, f"#/$defs/tool{i}")
        return {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 "arguments": {"$ref": f"#/$defs/tool{i}"}},
                "required": ["name", "arguments"], "additionalProperties": False}

    calls = [call_schema(i, t) for i, t in enumerate(chosen)]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "$defs": defs, "x-guidance": JSON_STYLE}
    return StructuredOutput("lark", f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}')


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are data, not schemas


def _moved_refs(node: Any, base: str) -> Any:
    """A schema whose local ``$ref`` pointers (``#...``) are rebased under ``base``."""
    if isinstance(node, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else v if k in _DATA_KEYWORDS else _moved_refs(v, base)) for k, v in node.items()}
    if isinstance(node, list):
        return [_moved_refs(v, base) for v in node]
    return node


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def wire(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def _parse_block(body: str, names: set[str]) -> ToolCall | None:
    """The call a ``<tool_call>`` block holds, or None if it is not one (then it stays text).

    Total over any text a model can write: a block is a call only if it is JSON within
    ``jsonsafe``'s limits (depth, valid Unicode), an object whose ``name`` is one of ``names`` and
    whose ``arguments`` (or ``parameters``) is an object or JSON text of one."""
    try:
        obj = jsonsafe.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            parsed = jsonsafe.loads(args)
        except ValueError:
            return None
        if not isinstance(parsed, dict):
            return None
        return ToolCall(name, args)
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content without the parsed calls, or None if nothing is left; the calls, in order)."""
    stream = ToolCallStream(names)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    content += rest
    calls += more
    return (content.strip() or None) if calls else content, calls


class ToolCallStream:
    """Incremental ``parse_tool_calls``: ``feed`` text pieces as they are generated, get back the content
    that can be shown now and the calls completed so far; text that may be the start of a call is held."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.buf = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        out, calls = [], []
        while True:
            start = self.buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buf, OPEN)  # "...<tool_" might become a call
                out.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            end = self.buf.find(CLOSE, start)
            if end < 0:
                out.append(self.buf[:start])
                self.buf = self.buf[start:]
                break
            call = _parse_block(self.buf[start + len(OPEN):end].strip(), self.names)
            if call is None:  # not a call: shown as text
                out.append(self.buf[:end + len(CLOSE)])
            else:
                out.append(self.buf[:start].rstrip("\n"))
                calls.append(call)
            self.buf = self.buf[end + len(CLOSE):].lstrip("\n") if call is not None else self.buf[end + len(CLOSE):]
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the text: what is held is content (an unclosed call is not a call)."""
        rest, self.buf = self.buf, ""
        return rest, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
