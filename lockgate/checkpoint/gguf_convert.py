"""GGUF -> a Hugging Face style directory: config.json from the metadata, the tokenizer (with its chat
template) from transformers' GGUF reader; and the tables that give each GGUF tensor its Hugging Face
name (the weights themselves stay in the file: ``gguf_tensors.GgufWeights`` reads them at load).

Owns what llama.cpp's converter did to each architecture and how to undo it (our own code; the
``gguf`` package reads the file and de-quantizes blocks):

* names: ``blk.N.<gguf name>`` -> ``model.layers.N.<HF name>`` by a per-architecture table
  (``ARCHES``); an unknown tensor is an error naming it, never skipped;
* llama (and Mixtral, which llama.cpp files as llama with experts): q/k rows were interleaved for
  GPT-J style rope, ``unpermute_rope_rows`` puts them back; no other family was permuted;
* Gemma 2 / 3: every ``*norm.weight`` was stored as ``1 + w``; we store ``w`` again (the model adds
  the 1, as transformers' Gemma does);
* experts: ``ffn_{gate,up,down}_exps`` are 3-D ([expert, out, in]); they are split into one HF
  tensor per expert (Qwen3-MoE ``mlp.experts.E.*_proj``, Mixtral ``block_sparse_moe.experts.E.w1/w3/w2``);
* Phi-3: ``attn_qkv`` / ``ffn_up`` are already fused like HF's ``qkv_proj`` / ``gate_up_proj``;
  LongRoPE's factor tables are tensors (``rope_factors_long/short``) folded back into config.json;
* config facts the metadata does not carry are llama.cpp's own fixed choices for that
  architecture (Gemma 3: one global layer in 6 and local rope base 10000; Gemma 2/3: attention
  scaled by the head size, by hidden/heads on the 27B models; Qwen3-MoE: top-k weights
  renormalised), written down in ``_family_config``.

No weight is written: the directory holds config.json, generation_config.json, the tokenizer and
``lockgate_source.json`` (which GGUF, its size, types and the converter version), a few MB
however large the model. Quantizations other than ``SUPPORTED_TYPES`` are refused before anything
is written, with the list; so is an architecture outside ``ARCHES`` or a tensor no table places.

Torch-free except the tokenizer step (transformers' GGUF tokenizer reader imports torch).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lockgate.checkpoint.rope_scaling import llama3_inv_freq

log = logging.getLogger("lockgate.models")

CONVERTER_VERSION = 3  # bump when the converted output changes, to invalidate old caches

# What gguf.quants de-quantizes and the tests cover, one tensor type at a time.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PRE_POST = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class Arch:
    """How one llama.cpp architecture maps back to a transformers model type."""

    model_type: str
    hf_class: str
    layer: dict[str, str]                 # blk.N.<key> -> model.layers.N.<value>
    experts: dict[str, str] = field(default_factory=dict)  # blk.N.<key>_exps -> model.layers.N.<value with {e}>
    permute_qk: bool = False               # llama.cpp interleaved q/k rows (GPT-J rope)
    norm_shift: float = 0.0                # stored norm weight = HF weight + shift


_QWEN_MOE = {"ffn_gate_inp": "mlp.gate"}
_MIXTRAL = {"ffn_gate_inp": "block_sparse_moe.gate"}

ARCHES: dict[str, Arch] = {
    "llama": Arch("llama", "LlamaForCausalLM", {**_PRE_POST, **_ATTN, **_MLP}, permute_qk=True),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", {**_PRE_POST, **_ATTN, **_MLP}),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", {**_PRE_POST, **_ATTN, **_QK_NORM, **_MLP}),
    "qwen3moe": Arch("qwen3_moe", "Qwen3MoeForCausalLM", {**_PRE_POST, **_ATTN, **_QK_NORM, **_MLP, **_QWEN_MOE},
                     experts={"ffn_gate": "mlp.experts.{e}.gate_proj", "ffn_up": "mlp.experts.{e}.up_proj",
                              "ffn_down": "mlp.experts.{e}.down_proj"}),
    "gemma2": Arch("gemma2", "Gemma2ForCausalLM", {**_GEMMA_NORMS, **_ATTN, **_MLP}, norm_shift=1.0),
    "gemma3": Arch("gemma3_text", "Gemma3ForCausalLM", {**_GEMMA_NORMS, **_ATTN, **_QK_NORM, **_MLP},
                   norm_shift=1.0),
    "phi3": Arch("phi3", "Phi3ForCausalLM", {**_PRE_POST, "attn_qkv": "self_attn.qkv_proj",
                                             "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
                                             "ffn_down": "mlp.down_proj"}),
}
# llama.cpp files Mixtral as "llama" with experts; chosen when the metadata has expert_count > 0.
MIXTRAL = Arch("mixtral", "MixtralForCausalLM", {**_PRE_POST, **_ATTN, **_MIXTRAL}, permute_qk=True,
               experts={"ffn_gate": "block_sparse_moe.experts.{e}.w1", "ffn_up": "block_sparse_moe.experts.{e}.w3",
                        "ffn_down": "block_sparse_moe.experts.{e}.w2"})
# Tensors folded into config.json instead of written.
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def read_metadata(reader: Any) -> dict[str, Any]:
    return {k: _field_value(f) for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_token_id")}


def arch_of(meta: dict[str, Any], src: Path) -> tuple[str, Arch]:
    """The file's architecture and its mapping (ValueError naming it and the supported ones)."""
    name = meta.get("general.architecture")
    if name not in ARCHES:
        raise ValueError(f"{src}: GGUF architecture {name!r} is not supported "
                         f"(supported: {', '.join(sorted(ARCHES))}; Mixtral as llama.cpp's llama with experts)")
    if name == "llama" and int(meta.get("llama.expert_count") or 0) > 0:
        return name, MIXTRAL
    return name, ARCHES[name]


def check_types(tensors: dict[str, Any], src: Path) -> None:
    bad = sorted({t.tensor_type.name for t in tensors.values()} - set(SUPPORTED_TYPES))
    if bad:
        which = next(n for n, t in tensors.items() if t.tensor_type.name in bad)
        raise ValueError(f"{src}: GGUF quantization {', '.join(bad)} is not supported (first in {which}); "
                         f"supported: {', '.join(SUPPORTED_TYPES)}")


CONVERT_STEPS = 3  # reading the metadata, the config, the tokenizer: ``convert_gguf``'s ``step`` calls


def convert_gguf(gguf_path: Path, out_dir: Path, step: Callable[[int, str], None] | None = None) -> str:
    """Write config.json, generation_config.json, the tokenizer files and the source record into
    ``out_dir`` (the weights stay in the GGUF: ``gguf_tensors.GgufWeights`` reads them at load);
    return a summary. ``step(i, what)``: told as each of the ``CONVERT_STEPS`` steps begins."""
    step = step or (lambda i, what: None)
    step(0, "reading the metadata")
    try:
        reader = plain_reader(gguf_path)
    except (ValueError, OSError, IndexError) as e:  # bad magic, truncated header or tensor data
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({e})") from e
    meta = read_metadata(reader)
    name, arch = arch_of(meta, gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    check_types(tensors, gguf_path)
    config = gguf_config(meta, name, arch, tensors, gguf_path)

    step(1, "mapping the tensors")
    qtypes: dict[str, int] = {}
    n_params = 0
    for tname, t in tensors.items():
        if tname in _CONFIG_TENSORS:
            continue
        hf_entries(tname, arch, int(t.shape[2]) if len(t.shape) >= 3 else None)  # every tensor has a place
        qtypes[t.tensor_type.name] = qtypes.get(t.tensor_type.name, 0) + 1
        n_params += int(t.n_elements)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos_ids(meta)}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    step(2, "converting the tokenizer")
    save_tokenizer(gguf_path, out_dir, config["max_position_embeddings"], reader)
    st = gguf_path.stat()
    (out_dir / "lockgate_source.json").write_text(json.dumps({
        "gguf": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "converter_version": CONVERTER_VERSION, "architecture": name, "tensor_types": qtypes}, indent=2) + "\n")
    return f"{name}, {len(tensors)} tensors {qtypes}, {n_params / 1e6:.1f}M params (weights stay in the file)"


def hf_tensors(name: str, w: np.ndarray, arch: Arch) -> list[tuple[str, np.ndarray]]:
    """GGUF tensor ``name`` (de-quantized to ``w``) -> its Hugging Face tensors (ValueError if unknown)."""
    entries = hf_entries(name, arch, w.shape[0] if w.ndim >= 3 else None)
    return [(hf_name, w if expert is None else w[expert]) for hf_name, expert in entries]


def hf_entries(name: str, arch: Arch, experts: int | None = None) -> list[tuple[str, int | None]]:
    """GGUF tensor ``name`` -> its Hugging Face tensor names, each with the expert it is (None: the
    whole tensor); ``experts``: how many matrices the tensor holds (None: it is 2-D or 1-D).
    ValueError for a tensor no table knows, or an experts tensor that is not 3-D."""
    stem, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    if stem in _GLOBAL:
        return [(f"{_GLOBAL[stem]}.{kind}", None)]
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer, key = parts[1], parts[2]
        if key in arch.layer:
            return [(f"model.layers.{layer}.{arch.layer[key]}.{kind}", None)]
        if key.endswith("_exps") and key[:-5] in arch.experts:
            pattern = arch.experts[key[:-5]]
            if experts is None:
                raise ValueError(f"GGUF tensor {name!r} should hold one matrix per expert (a 3-D tensor)")
            return [(f"model.layers.{layer}.{pattern.format(e=e)}.{kind}", e) for e in range(experts)]
    raise ValueError(f"unsupported GGUF tensor {name!r} for a {arch.model_type} model "
                     f"(known per-layer tensors: {', '.join(sorted(arch.layer) + [k + '_exps' for k in arch.experts])})")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``permute`` of q/k rows (weight [out, in] or bias [out]).

    llama.cpp maps HF row (head, half, i) to (head, i, half); we reshape as the latter and swap back.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(meta: dict[str, Any], name: str, arch: Arch, tensors: dict[str, Any], src: Path) -> dict[str, Any]:
    """Hugging Face config.json contents from GGUF metadata."""

    def key(k: str, default: Any = None, required: bool = True) -> Any:
        full = f"{name}.{k}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise ValueError(f"{src}: GGUF metadata has no {full}")
        return default

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
    elif scaling_type not in ("none", None) and "rope_factors_long.weight" not in tensors:
        raise ValueError(f"{src}: rope scaling {scaling_type!r} is not supported")
    if "rope_freqs.weight" in tensors:
        rope.update(_llama3_rope_from_freqs(tensors["rope_freqs.weight"], rope["rope_theta"], head_dim, src))
    n_layers = int(key("block_count"))
    ff = key("feed_forward_length", None, required=False)
    cfg: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(ff) if ff is not None else None,
        "num_hidden_layers": n_layers,
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
    cfg.update(_family_config(meta, name, arch, key, tensors, cfg, src))
    if cfg["intermediate_size"] is None:
        raise ValueError(f"{src}: GGUF metadata has no {name}.feed_forward_length")
    for hf_key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                             ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                             ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if gguf_key in meta:
            cfg[hf_key] = int(meta[gguf_key])
    return cfg


def _family_config(meta: dict[str, Any], name: str, arch: Arch, key: Any, tensors: dict[str, Any],
                   cfg: dict[str, Any], src: Path) -> dict[str, Any]:
    """The config.json keys one family needs beyond the common ones."""
    mt = arch.model_type
    n, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    out: dict[str, Any] = {}
    if mt in ("llama", "mixtral"):
        out["attention_bias"] = "blk.0.attn_q.bias" in tensors
        out["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if mt in ("qwen2", "qwen3", "qwen3_moe"):
        out["use_sliding_window"] = False
    if mt in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if mt in ("mixtral", "qwen3_moe"):
        experts = int(key("expert_count"))
        gate = next((t for k, t in tensors.items() if k.endswith(".ffn_gate_exps.weight")), None)
        if gate is None:
            raise ValueError(f"{src}: {name} with expert_count={experts} has no blk.N.ffn_gate_exps tensors "
                             "(per-expert tensors of older files are not supported)")
        expert_ff = int(gate.shape[1])
        out.update(num_experts_per_tok=int(key("expert_used_count")))
        if mt == "mixtral":
            out.update(num_local_experts=experts, intermediate_size=expert_ff, sliding_window=None)
        else:
            dense = [i for i in range(n) if f"blk.{i}.ffn_gate_exps.weight" not in tensors]
            out.update(num_experts=experts, moe_intermediate_size=int(key("expert_feed_forward_length", expert_ff,
                                                                            required=False)),
                       norm_topk_prob=True,  # llama.cpp's qwen3moe graph renormalises the top-k weights
                       decoder_sparse_step=1, mlp_only_layers=dense)
            if cfg["intermediate_size"] is None:
                out["intermediate_size"] = expert_ff
    if mt in ("gemma2", "gemma3_text"):
        # llama.cpp scales attention by 1/sqrt(hidden/heads) on the 27B models, else 1/sqrt(head size)
        big = (mt == "gemma2" and n == 46) or (mt == "gemma3_text" and n == 62)
        out.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=hidden // heads if big else cfg["head_dim"])
        window = key("attention.sliding_window", None, required=False)
        pattern = 2 if mt == "gemma2" else int(key("attention.sliding_window_pattern", 6, required=False))
        if window:
            out["sliding_window"] = int(window)
            out["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        if mt == "gemma2":
            out["attn_logit_softcapping"] = key("attn_logit_softcapping", None, required=False)
            out["final_logit_softcapping"] = key("final_logit_softcapping", None, required=False)
        else:
            out["rope_local_base_freq"] = 10000.0  # llama.cpp's fixed base for Gemma 3's sliding layers
    if mt == "phi3":
        window = key("attention.sliding_window", None, required=False)
        out["sliding_window"] = int(window) if window else None
        if "rope_factors_long.weight" in tensors:
            out["rope_parameters"] = _longrope(meta, name, tensors, cfg["rope_theta"], src)
            out["original_max_position_embeddings"] = out["rope_parameters"]["original_max_position_embeddings"]
    return out


def _longrope(meta: dict[str, Any], name: str, tensors: dict[str, Any], theta: float, src: Path) -> dict[str, Any]:
    """Phi-3's LongRoPE parameters from the factor tables llama.cpp stores as tensors."""
    import gguf

    def table(t: Any) -> list[float]:
        return [float(x) for x in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]

    short = tensors.get("rope_factors_short.weight")
    orig = meta.get(f"{name}.rope.scaling.original_context_length")
    if short is None or orig is None:
        raise ValueError(f"{src}: LongRoPE needs rope_factors_short.weight and "
                         f"{name}.rope.scaling.original_context_length")
    rope = {"rope_type": "longrope", "rope_theta": theta, "long_factor": table(tensors["rope_factors_long.weight"]),
            "short_factor": table(short), "original_max_position_embeddings": int(orig)}
    attn = meta.get(f"{name}.rope.scaling.attn_factor")
    if attn is not None:
        rope["attention_factor"] = float(attn)
    return rope


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


def eos_ids(meta: dict[str, Any]) -> list[int]:
    ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id") if k in meta]
    return list(dict.fromkeys(ids))


def save_tokenizer(gguf_path: Path, out_dir: Path, max_len: int, reader: Any = None) -> None:
    """The tokenizer files of ``gguf_path`` into ``out_dir`` (transformers' GGUF tokenizer reader);
    ``reader``: the file's ``gguf.GGUFReader``, already built, for transformers to read too."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for a hub
    from transformers import AutoTokenizer

    with _reader_reused(gguf_path, reader):
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


def plain_reader(path: Path) -> Any:
    """``gguf.GGUFReader(path)``, its arrays plain ``numpy.ndarray`` views of the file's map rather
    than ``numpy.memmap`` ones: the same fields, values and tensor bytes, built 2-3x faster. The
    reader makes a few numpy views per metadata value (~150,000 for SmolLM2's 49,152-token
    vocabulary and its merges, over a million for gemma-3's 262,144 tokens), and every view of a
    ``memmap`` runs its Python-level ``__getitem__`` and ``__array_finalize__``; a plain view does not."""
    import gguf

    if not isinstance(gguf.GGUFReader, type):  # inside ``_reader_reused``: the reader it hands over
        return gguf.GGUFReader(str(path))

    class PlainMapReader(gguf.GGUFReader):
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, value: Any) -> None:
            self._plain = value.view(np.ndarray)  # GGUFReader.__init__ assigns its np.memmap here

    return PlainMapReader(str(path))


_READER_SWAP = threading.RLock()  # re-entrant: a conversion inside a caller's swap nests its own


@contextlib.contextmanager
def _reader_reused(path: Path, reader: Any) -> Iterator[None]:
    """While open, ``gguf.GGUFReader(path)`` gives ``reader`` (None: nothing changes). transformers'
    GGUF loader builds its own reader of the file (``from gguf import GGUFReader``, at call time);
    building one parses every metadata field, ~10 s for gemma-3's 262,144-token vocabulary, so
    the conversion hands over the one it has. Any other call (another file, other arguments)
    builds a new reader as before."""
    if reader is None:
        yield
        return
    import gguf

    want = Path(path).resolve()
    with _READER_SWAP:  # one swap at a time in the process, undone in the order made
        real = gguf.GGUFReader

        def reader_of(p: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                same = not args and not kwargs and Path(p).resolve() == want
            except (TypeError, OSError):
                same = False
            return reader if same else real(p, *args, **kwargs)

        setattr(gguf, "GGUFReader", reader_of)  # noqa: B010 - a module attribute swapped for the block
        try:
            yield
        finally:
            setattr(gguf, "GGUFReader", real)  # noqa: B010


def _field_value(field: Any) -> Any:
    try:
        value = field.contents()
    except Exception:  # noqa: BLE001 - an odd metadata field must not stop the conversion
        return None
    from gguf import GGUFValueType

    if list(field.types) == [GGUFValueType.FLOAT32]:  # shortest float32 repr: 9.99e-06 -> 1e-05
        value = float(str(np.float32(value)))
    return value
