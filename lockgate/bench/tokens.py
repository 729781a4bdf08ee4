"""The tokenizer the benchmark counts prompt tokens with: the served model's own.

Owns ``--tokenizer SPEC`` for ``lockgate bench``. A benchmark prompt of "N tokens" means N
tokens of the model being served, so the count must come from that model's tokenizer:

* ``auto`` (default) / ``server``: ask the server itself, ``POST /tokenize`` and
  ``POST /detokenize`` (lockgate and vLLM both serve them, same bodies). Works for any model
  the server runs and needs nothing local; costs a few HTTP calls per prompt while the
  workload is built, before the clock starts.
* ``sim``: lockgate's byte-level sim tokenizer (1 UTF-8 byte = 1 token), for ``--model sim``.
* ``default`` / a ``.gguf`` file: the converted model directory of
  ``lockgate.checkpoint.loader.prepare_model_dir`` (a cache hit imports no torch).
* a directory with a Hugging Face tokenizer (tokenizer.json / tokenizer_config.json).

Every tokenizer here encodes *without* special tokens: the count is of the text the client
sends; a BOS or a chat template the server adds shows up in the server's
``usage.prompt_tokens``, which the report keeps separately.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import httpx


class BenchTokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LocalTokenizer:
    """A lockgate ``Tokenizer`` (sim or Hugging Face) in this process."""

    def __init__(self, tok: object, name: str) -> None:
        self.tok = tok
        self.name = name

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids))  # type: ignore[attr-defined]


class ServerTokenizer:
    """The server's own tokenizer over ``POST /tokenize`` and ``POST /detokenize``."""

    def __init__(self, url: str, model: str | None, headers: dict[str, str], timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.name = f"server:{self.url}/tokenize"
        self.http = httpx.Client(headers=headers, timeout=timeout)

    def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        if self.model is not None:
            body = {"model": self.model, **body}
        r = self.http.post(self.url + path, json=body)
        if r.status_code == 404:
            raise ValueError(f"the server has no {path} route, so it cannot count tokens for the benchmark; "
                             "pass --tokenizer sim|default|MODEL_DIR|FILE.gguf to count them locally")
        if r.status_code != 200:
            raise ValueError(f"{path} answered {r.status_code}: {r.text[:300]}")
        out: dict[str, object] = r.json()
        return out

    def encode(self, text: str) -> list[int]:
        ids = self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        assert isinstance(ids, list)
        return [int(i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        return str(self._post("/detokenize", {"tokens": ids})["prompt"])

    def close(self) -> None:
        self.http.close()


def load_bench_tokenizer(spec: str, url: str, model: str | None, headers: dict[str, str]) -> BenchTokenizer:
    """``--tokenizer SPEC`` -> a tokenizer (see the module docstring). ValueError on a bad spec."""
    if spec in ("auto", "server"):
        return ServerTokenizer(url, model, headers)
    if spec == "sim":
        from lockgate.tokenizer.tokenizer import SimTokenizer

        return LocalTokenizer(SimTokenizer(), "sim")
    from lockgate.tokenizer.tokenizer import HFTokenizer

    path = Path(spec).expanduser()
    if path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return LocalTokenizer(HFTokenizer(path), str(path))
    from lockgate.checkpoint.loader import prepare_model_dir

    return LocalTokenizer(HFTokenizer(prepare_model_dir(spec)), spec)
