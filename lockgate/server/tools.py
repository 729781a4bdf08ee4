"""Tool calling on chat: the tools into the prompt, and the constraint ``tool_choice`` puts on the answer.

The formats themselves (how a family writes a call, reading calls back from the text, streamed or
whole) are ``tool_parsers``'; this module uses the server's parser (``--tool-call-parser``, Hermes
by default) where a format is needed. A tool's answer goes back between ``<tool_response>`` tags.

* ``render_conversation``: OpenAI messages (assistant ``tool_calls``, ``role: "tool"`` answers) and
  tool definitions -> what the chat template is given. A template that renders ``tools`` itself gets
  them as they are (arguments parsed into objects, as Hugging Face templates expect); for one that
  does not (the default model's), the definitions and the parser's call format are written into the
  system message, earlier calls into the assistant's text in that format, and tool answers become
  user turns wrapped in ``<tool_response>`` (roles every template knows).
* ``tool_grammar``: ``tool_choice`` ``required`` or a named function -> a grammar the output must
  match: one call, in the parser's ``forced`` format, whose arguments follow the function's JSON
  schema (so it always parses and validates). ``auto`` leaves the output free; ``none`` leaves the
  tools out of the prompt.

Invariants: a call's ``arguments`` is a JSON string (the OpenAI wire format); what ``tool_grammar``
allows, the forced format's parser reads back as exactly one call.
"""

from __future__ import annotations

from typing import Any

from lockgate import jsonsafe
from lockgate.sampling import StructuredOutput
from lockgate.server.tool_parsers import PARSERS, ToolParser

HERMES = PARSERS["hermes"]
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _calls_text(calls: list[dict[str, Any]], parser: ToolParser) -> str:
    return parser.calls_text([(str((c.get("function") or {}).get("name")),
                               _loads((c.get("function") or {}).get("arguments"))) for c in calls])


def render_conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        template_takes_tools: bool, parser: ToolParser = HERMES,
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
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
            calls = _calls_text(m["tool_calls"], parser)
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        text = parser.instructions(tools)
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


def tool_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                 parser: ToolParser = HERMES) -> StructuredOutput | None:
    """The constraint ``tool_choice`` puts on the output: None for auto/none; one call otherwise, in
    ``parser.forced``'s format (read it back with that parser).

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
    fmt = parser.forced
    key = fmt.args_key

    def call_schema(i: int, t: dict[str, Any]) -> dict[str, Any]:
        params = t["function"].get("parameters") or {"type": "object", "properties": {}}
        defs[f"tool{i}"] = _moved_refs(params, f"#/$defs/tool{i}")
        return {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 key: {"$ref": f"#/$defs/tool{i}"}},
                "required": ["name", key], "additionalProperties": False}

    calls = [call_schema(i, t) for i, t in enumerate(chosen)]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "$defs": defs, "x-guidance": JSON_STYLE}
    return StructuredOutput("lark", fmt.grammar(schema))


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are data, not schemas


def _moved_refs(node: Any, base: str) -> Any:
    """A schema whose local ``$ref`` pointers (``#...``) are rebased under ``base``."""
    if isinstance(node, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else v if k in _DATA_KEYWORDS else _moved_refs(v, base)) for k, v in node.items()}
    if isinstance(node, list):
        return [_moved_refs(v, base) for v in node]
    return node
