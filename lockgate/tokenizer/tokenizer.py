"""Tokenizer: text <-> token ids and chat templates, without torch.

Owns the ``Tokenizer`` interface every process uses: ``encode``, ``decode``,
``apply_chat_template``, ``eos_token_ids``. ``HFTokenizer`` wraps a Hugging Face fast
tokenizer loaded from a local model directory (the one ``prepare_model_dir`` made);
``SimTokenizer`` is a byte-level tokenizer for the ``sim`` model (ids 3..258 are bytes,
2 is EOS), so the sim server speaks real text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

Message = dict[str, Any]


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> str: ...


class HFTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        eos = self.tok.eos_token_id
        self.eos_token_ids: tuple[int, ...] = (eos,) if eos is not None else ()
        self.vocab_size = len(self.tok)
        if getattr(self.tok, "chat_template", None) is None:
            self.tok.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError("this model has no chat template; use the completions API with a plain prompt")
        return str(self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt))


class SimTokenizer:
    """Byte-level tokenizer for the sim model: id = byte + 3; 0 pad, 1 bos, 2 eos."""

    OFFSET = 3

    def __init__(self, vocab_size: int = 32000) -> None:
        self.eos_token_ids: tuple[int, ...] = (2,)
        self.vocab_size = vocab_size

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

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|{m.get('role', 'user')}|>{m.get('content') or ''}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


def load_tokenizer(model: str, model_dir: str | Path | None) -> Tokenizer:
    if model == "sim":
        return SimTokenizer()
    assert model_dir is not None
    return HFTokenizer(model_dir)
