"""The routing key of a request: the prompt as characters or as the served model's token ids.

Only generation routes have one (OpenAI completions and chat, TGI generate); other routes and
bodies the gateway cannot read get ``None`` and are routed by load alone (the replica will
answer a bad body with its own 4xx; the gateway never rejects what a replica might accept).

* ``character``: the prompt text; chat messages are joined as ``role\\ncontent\\n`` so two chats
  share a key prefix exactly when their leading messages are equal. Token-id prompts are used as
  they are.
* ``model``: the token ids the replica will see: the completion prompt encoded with special
  tokens, or the chat template applied to the messages then encoded (as the engine's API does),
  so block boundaries fall on the same tokens the replicas' radix trees hold.
A batch prompt is keyed by its first element (the batch goes to one replica).

``read_generation`` decodes a request's body once; the readers below take that dict.
``request_max_tokens`` reads how many tokens a generation request may produce (OpenAI ``max_tokens`` /
``max_completion_tokens``, TGI ``parameters.max_new_tokens``; the replica's defaults when absent:
16 for completions and 20 for TGI as those APIs say, None for chat, where the replica's
``--default-max-tokens`` applies), for the ``forecast`` policy's decode estimate.

``request_model`` reads the model a request names (OpenAI ``model``, TGI ``parameters.adapter_id``):
the gateway routes a request for a LoRA adapter to replicas that have it loaded and keys its
prefix blocks by the adapter too (``block_hashes``' ``salt``), since a replica caches KV per adapter.
"""

from __future__ import annotations

from typing import Any

import msgspec

from lockgate.tokenizer.tokenizer import Tokenizer

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream")
Key = str | list[int]


def read_generation(path: str, body: bytes) -> dict[str, Any] | None:
    """A generation request's body, decoded once for every reader below; None when the route is not
    generation or the body is not a JSON object (bad UTF-8, absurd nesting: routed by load alone)."""
    if path not in GENERATION_PATHS:
        return None
    try:
        data = msgspec.json.decode(body)
    except Exception:  # noqa: BLE001 - only a routing hint; the replica answers the body with its own 4xx
        return None
    return data if isinstance(data, dict) else None


def request_key(path: str, data: dict[str, Any] | None, tokenizer: Tokenizer | None) -> Key | None:
    """The prompt key of a request ``read_generation`` decoded, or None."""
    if data is None:
        return None
    try:
        if path == "/v1/chat/completions":
            return _chat_key(data.get("messages"), tokenizer)
        prompt = data.get("prompt") if path == "/v1/completions" else data.get("inputs")
        return _prompt_key(prompt, tokenizer)
    except Exception:  # noqa: BLE001 - only a routing hint: a template or tokenizer error...
        return None  # ...becomes "no key"; the replica answers the body with its own 4xx


def request_model(path: str, data: dict[str, Any] | None) -> str | None:
    """The model (or LoRA adapter) a decoded generation request names, or None."""
    if data is None:
        return None
    if path in ("/generate", "/generate_stream"):
        params = data.get("parameters")
        name = params.get("adapter_id") if isinstance(params, dict) else None
    else:
        name = data.get("model")
    return name if isinstance(name, str) and name else None


def request_max_tokens(path: str, data: dict[str, Any] | None) -> int | None:
    """Tokens a decoded generation request may produce, or None (not said, not readable)."""
    if data is None:
        return None
    if path in ("/generate", "/generate_stream"):
        params = data.get("parameters")
        n = params.get("max_new_tokens", 20) if isinstance(params, dict) else 20
    elif path == "/v1/chat/completions":
        n = data.get("max_completion_tokens")
        n = data.get("max_tokens") if n is None else n
    else:
        n = data.get("max_tokens", 16)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _prompt_key(prompt: Any, tokenizer: Tokenizer | None) -> Key | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return tokenizer.encode(prompt) if tokenizer is not None else prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


def _chat_key(messages: Any, tokenizer: Tokenizer | None) -> Key | None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    plain = [{"role": str(m.get("role", "")), "content": _text(m.get("content"))} for m in messages]
    if tokenizer is None:
        return "".join(f"{m['role']}\n{m['content']}\n" for m in plain)
    text = tokenizer.apply_chat_template(plain, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
