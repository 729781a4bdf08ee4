"""Tokenizer: text <-> token ids and chat templates, without torch.

Owns the ``Tokenizer`` interface every process uses: ``encode``, ``decode``,
``apply_chat_template``, ``eos_token_ids``. For a local model directory (the one
``prepare_model_dir`` made) ``FastTokenizer`` reads ``tokenizer.json`` with the ``tokenizers``
library and renders the chat template with transformers' Jinja renderer, so the API process,
the detokenizer and the gateway never import torch; ``HFTokenizer`` (transformers' own, which
imports torch) serves the directories whose config asks for more than tokenizer.json says;
``SimTokenizer`` is a byte-level tokenizer for the ``sim`` model (ids 3..258 are bytes,
2 is EOS), so the sim server speaks real text.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

Message = dict[str, Any]


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str: ...

    @property
    def supports_tools(self) -> bool:
        """The chat template renders ``tools`` itself (else the server writes them into the prompt)."""
        ...

    @property
    def chat_template(self) -> str | None:
        """The chat template's text (None: the model has none)."""
        ...


def _takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


class HFTokenizer:
    """A Hugging Face tokenizer through transformers (which imports torch): the fallback for model
    directories ``FastTokenizer`` does not mirror exactly."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        eos = self.tok.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (eos,) if eos is not None else ()
        self.vocab_size = len(self.tok)
        # lockgate checks prompt lengths against the context itself; transformers' "longer than the
        # maximum sequence length" warning would only repeat that in the server's log
        self.tok.model_max_length = 1 << 62
        if getattr(self.tok, "chat_template", None) is None:
            self.tok.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(NO_TEMPLATE)
        return str(self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                tools=tools))  # type: ignore[arg-type]

    @property
    def supports_tools(self) -> bool:
        return _takes_tools(self.chat_template)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tok, "chat_template", None)
        return template if isinstance(template, str) else None


NO_TEMPLATE = ("this model has no chat template: start the server with --chat-template (a Jinja file or the "
               "template text), or use the completions API with a plain prompt")
# tokenizer_config.json keys that make transformers change what tokenizer.json alone would do
_NOT_MIRRORED = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "from_slow", "do_lower_case")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class FastTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library and the chat template through
    transformers' own Jinja renderer, without importing torch: the same ids, text and prompts as
    transformers' fast tokenizer for the directories ``load_fast`` accepts (tests/test_tokenizer.py
    compares them)."""

    def __init__(self, model_dir: Path, config: dict[str, Any], template: str | None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.tok = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.special: dict[str, str] = {}
        for key in _SPECIAL:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                self.special[key] = value
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
        self.extra_special: list[str] = [str(t.get("content") if isinstance(t, dict) else t)
                                         for t in extra] if isinstance(extra, list) else []
        eos = self.tok.token_to_id(self.special["eos_token"]) if "eos_token" in self.special else None
        self.eos_token_ids: tuple[int, ...] = (eos,) if eos is not None else ()
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.template = template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, as transformers calls it: unlike encode it releases the GIL (a 2 MB text held
        # it 2.3 s, stalling the API's event loop; through encode_batch the loop waited 3 ms).
        return list(self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if not self.template:
            raise ValueError(NO_TEMPLATE)
        kwargs: dict[str, Any] = dict(self.special)
        if self.extra_special:
            kwargs["additional_special_tokens"] = self.extra_special
        return render_template(self.template, messages, add_generation_prompt, kwargs, tools)

    @property
    def supports_tools(self) -> bool:
        return _takes_tools(self.template)

    @property
    def chat_template(self) -> str | None:
        return self.template


def load_fast(model_dir: Path) -> FastTokenizer | None:
    """A ``FastTokenizer`` for ``model_dir``, or None when it has no tokenizer.json or its
    tokenizer_config.json asks for something only transformers does (``_NOT_MIRRORED``, a cleanup
    of decoded spaces, a tokenizer class other than the generic fast one)."""
    if not (model_dir / "tokenizer.json").is_file():
        return None
    cfg_path = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if any(k in config for k in _NOT_MIRRORED) or config.get("clean_up_tokenization_spaces"):
        return None
    if config.get("tokenizer_class") not in (None, "PreTrainedTokenizerFast", "TokenizersBackend"):
        return None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text()
    elif (model_dir / "chat_template.json").is_file():
        template = json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
    return FastTokenizer(model_dir, config, template if isinstance(template, str) else None)


class SimTokenizer:
    """Byte-level tokenizer for the sim model: id = byte + 3; 0 pad, 1 bos, 2 eos."""

    OFFSET = 3

    def __init__(self, vocab_size: int = 32000) -> None:
        self.eos_token_ids: tuple[int, ...] = (2,)
        self.vocab_size = vocab_size
        self.template: str | None = None  # --chat-template, else the built-in format below

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Sim token ids above the byte range map onto printable ASCII so outputs read as text.
        out = bytearray()
        for i in ids:
            if i < self.OFFSET:
                continue
            b = i - self.OFFSET
            out.append(b if b < 256 else 97 + (b % 26))
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if self.template is not None:
            return render_template(self.template, messages, add_generation_prompt, {}, tools)
        text = "".join(f"<|{m.get('role', 'user')}|>{m.get('content') or ''}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    @property
    def supports_tools(self) -> bool:
        return _takes_tools(self.template)

    @property
    def chat_template(self) -> str | None:
        return self.template


def render_template(template: str, messages: list[Message], add_generation_prompt: bool,
                    special: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> str:
    """``template`` rendered over ``messages`` (and ``tools``, OpenAI-style function definitions) by
    transformers' own Jinja renderer (torch-free)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    # returns (one prompt per conversation, generation indices), whatever its annotation says
    out: Any = render_jinja_template(conversations=[messages], chat_template=template, tools=tools,  # type: ignore[arg-type]
                                     add_generation_prompt=add_generation_prompt, **special)
    return str(out[0][0])


WARM_UP_CHAT = [{"role": "user", "content": "Hi!"}]


def import_renderer() -> None:
    """Import the chat template renderer (transformers' Jinja utilities: ~1.5 s of CPU, torch-free),
    which the first render would otherwise import. The API process runs it on a side thread as it
    starts, while the engine loads the model."""
    import transformers.utils.chat_template_utils  # noqa: F401


def warm_up(tok: Tokenizer) -> None:
    """Render a one-message chat through ``tok``'s template and encode it, once: the first render
    imports the Jinja renderer (unless ``import_renderer`` did) and compiles the template, which a
    server's first chat request would otherwise wait for. A template that refuses this chat is left
    to say so on a real request."""
    if not tok.chat_template:
        return
    try:
        tok.encode(tok.apply_chat_template(WARM_UP_CHAT), add_special_tokens=False)
    except Exception as e:  # noqa: BLE001 (a template may raise anything; the request will show it)
        logging.getLogger("lockgate.tokenizer").debug("chat template warm-up: %s", e)


def load_tokenizer(model: str, model_dir: str | Path | None, chat_template: str | None = None) -> Tokenizer:
    """The byte tokenizer for ``sim``; else the torch-free ``FastTokenizer`` where it mirrors
    transformers exactly, or transformers' own (``HFTokenizer``). ``chat_template``: the template
    text to use instead of the model's own (``--chat-template``, read by ``config.read_chat_template``)."""
    tok: SimTokenizer | FastTokenizer | HFTokenizer
    if model == "sim":
        tok = SimTokenizer()
        tok.template = chat_template
        return tok
    assert model_dir is not None
    fast = load_fast(Path(model_dir))
    tok = fast if fast is not None else HFTokenizer(model_dir)
    if chat_template is not None:
        if isinstance(tok, FastTokenizer):
            tok.template = chat_template
        else:
            tok.tok.chat_template = chat_template
    return tok
