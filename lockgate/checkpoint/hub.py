"""Hugging Face model ids: ``org/name`` (and ``org/name:file.gguf``) -> a local directory or GGUF file.

Owns resolving a hub id the way ``vllm serve`` and ``llama-server -hf`` do, through
``huggingface_hub``: its cache (``HF_HOME`` / ``HF_HUB_CACHE``), its token (``HF_TOKEN``) and its
offline switch (``HF_HUB_OFFLINE=1``: the cache only). What a repository holds decides what comes
back:

* a Hugging Face checkpoint (``config.json`` + ``*.safetensors``): the snapshot directory, with
  only the files a model needs fetched (configs, tokenizer, chat template, weights);
* GGUF files: the one the spec names (``org/name:file.gguf``, or ``gguf_file``), else the only one
  there is; several and none named is an error listing them (a GGUF repository usually holds one
  file per quantization, gigabytes each, so nothing is guessed).

Errors are ValueErrors naming the id, the revision and what was tried (the cache it looked in,
whether the hub was reachable). Nothing here runs unless ``--model`` is a hub id: a local path of
that shape wins.

Torch-free.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("lockgate.models")

_ID = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}/[A-Za-z0-9][\w.\-]{0,95}$")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def split_id(spec: str) -> tuple[str, str | None] | None:
    """(repository, GGUF file or None) if ``spec`` is a hub id (``org/name`` or ``org/name:file``)
    and not an existing local path; else None."""
    if Path(spec).expanduser().exists():
        return None
    repo, _, file = spec.partition(":")
    if not _ID.match(repo) or ".." in repo:
        return None
    return repo, (file or None)


def resolve(repo: str, revision: str | None = None, gguf_file: str | None = None) -> Path:
    """A local path for ``repo`` at ``revision``: its snapshot directory, or one GGUF file in it."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE)
    where = f"{repo}" + (f" (revision {revision})" if revision else "")
    tried = (f"the Hugging Face cache {constants.HF_HUB_CACHE}"
             + (" only (HF_HUB_OFFLINE is set)" if offline else " and the hub"))
    try:
        if gguf_file:
            path = Path(huggingface_hub.hf_hub_download(repo, gguf_file, revision=revision, local_files_only=offline))
            log.info("model %s: %s", where, path)
            return path
        snapshot = Path(str(huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=MODEL_FILES,
                                                               local_files_only=offline)))
        if (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors")):
            log.info("model %s: %s", where, snapshot)
            return snapshot
        ggufs = _gguf_files(repo, revision, offline, snapshot)
        if len(ggufs) == 1:
            return resolve(repo, revision, ggufs[0])
        if not ggufs:
            raise ValueError(f"model {where}: holds neither config.json + *.safetensors nor a .gguf file "
                             f"(looked in {tried})")
        raise ValueError(f"model {where} holds {len(ggufs)} GGUF files ({', '.join(ggufs[:12])}"
                         f"{', ...' if len(ggufs) > 12 else ''}): name one as {repo}:FILE or with --gguf-file")
    except LocalEntryNotFoundError:
        raise ValueError(f"model {where}: not found in {tried}"
                         + (" (download it first, or unset HF_HUB_OFFLINE)" if offline else "")) from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {where}: no such repository on the hub, or it needs a token (HF_TOKEN); "
                         f"looked in {tried}") from None
    except (HfHubHTTPError, OSError) as e:
        raise ValueError(f"model {where}: could not be fetched ({type(e).__name__}: {e}); looked in {tried}") from None


def _gguf_files(repo: str, revision: str | None, offline: bool, snapshot: Path) -> list[str]:
    """The .gguf files of the repository: listed by the hub, or (offline) those in the cached snapshot."""
    if offline:
        return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf"))
    import huggingface_hub

    return sorted(f for f in huggingface_hub.list_repo_files(repo, revision=revision) if f.endswith(".gguf"))
