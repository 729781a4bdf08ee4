"""Our Llama-family model vs transformers on tiny random models (fp32, tight tolerance; the int4
and float32 projection forms in bf16, bf16 tolerance)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lockgate import kernels as cpu_kernels
from lockgate.kernel_choice import FormChoice
from lockgate.layers.forms import GroupQuantWeight, Int4Weight
from lockgate.layers.ops import KernelOps
from lockgate.models.decoder import DecoderModel
from lockgate.models.registry import args_from_config

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

KINDS = {
    "llama": lambda tie: LlamaForCausalLM(LlamaConfig(**COMMON, rope_theta=1000.0, tie_word_embeddings=tie)),
    "llama3_rope": lambda tie: LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE,
                                                             tie_word_embeddings=tie)),
    "llama_bias_mha": lambda tie: LlamaForCausalLM(LlamaConfig(
        **{**COMMON, "num_key_value_heads": 4}, attention_bias=True, mlp_bias=True, tie_word_embeddings=tie)),
    "qwen2": lambda tie: Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=tie)),
    "mistral": lambda tie: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=tie)),
}


def build(tmp_path, kind: str, tie: bool):
    """A random HF model saved as safetensors; every parameter (norms, biases too) randomised."""
    torch.manual_seed(0)
    hf = KINDS[kind](tie).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors"))
    return hf, DecoderModel.from_pretrained(tmp_path, torch.float32)


PROMPT = [5, 17, 3, 88, 42, 42, 7, 1, 60, 33, 91, 2, 14, 70, 29, 50]
OTHER = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [L, V]


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_matches_transformers_whole_and_chunked(tmp_path, pool_driver, kind: str, tie: bool, kernels: bool) -> None:
    hf, ours = build(tmp_path, kind, tie)
    assert ours.args.tie_word_embeddings == tie
    assert (ours.lm_head is ours.embed) == tie
    want, want_b = hf_logits(hf, PROMPT), hf_logits(hf, OTHER)
    assert want.abs().max() > 1.0  # the comparison is not between near-zero logits

    # The whole prompt in one step, logits at every position.
    got = pool_driver(ours, kernels=kernels).step({0: PROMPT}, all_rows=True)[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)

    # The same prompt as chunk + chunk + decodes, sharing steps with a second sequence.
    drv = pool_driver(ours, seed=1, kernels=kernels)
    r = drv.step({0: PROMPT[:5], 1: OTHER[:9]})
    torch.testing.assert_close(r[0], want[4], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(r[1], want_b[8], atol=2e-5, rtol=1e-5)
    r = drv.step({1: OTHER[9:10], 0: PROMPT[5:12]})  # a decode and a later prefill chunk in one step
    torch.testing.assert_close(r[0], want[11], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(r[1], want_b[9], atol=2e-5, rtol=1e-5)
    for i in range(12, len(PROMPT)):
        r = drv.step({0: PROMPT[i:i + 1], 1: OTHER[10:11]} if i == 12 else {0: PROMPT[i:i + 1]})
        torch.testing.assert_close(r[0], want[i], atol=2e-5, rtol=1e-5)


def test_logits_into_a_buffer_in_blocks_of_rows(tmp_path, pool_driver, monkeypatch) -> None:
    """The runner's logits buffer: the LM head runs in blocks of rows (HEAD_BLOCK_BYTES, made tiny
    here: blocks of 3 rows, the last one shorter) written into the buffer, which the model returns a
    view of; rows past the step's are left alone."""
    from lockgate.models import decoder

    hf, ours = build(tmp_path, "llama", tie=False)
    monkeypatch.setattr(decoder, "HEAD_BLOCK_BYTES", 3 * ours.args.vocab_size * 4)
    calls: list[int] = []
    head = ours.head
    monkeypatch.setattr(ours, "head", lambda x, prompt: calls.append(x.shape[0]) or head(x, prompt))
    buf = torch.full((40, ours.args.vocab_size), float("nan"))
    got = pool_driver(ours).step({0: PROMPT}, all_rows=True, logits_out=buf)[0]
    torch.testing.assert_close(got, hf_logits(hf, PROMPT), atol=2e-5, rtol=1e-5)
    assert calls == [3, 3, 3, 3, 3, 1]  # 16 rows in blocks of 3
    assert got.data_ptr() == buf.data_ptr() and buf[len(PROMPT):].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_path_gives_the_logits_argmax(tmp_path, pool_driver, monkeypatch, dtype) -> None:
    """The runner's greedy path (``argmax=True``: the head's rows argmaxed in the run dtype, block by
    block, never widened to float32 logits) picks exactly the logits path's argmax, on a prompt of
    every row and on decode steps; blocks of 3 rows here (HEAD_BLOCK_BYTES made tiny)."""
    from lockgate.models import decoder

    build(tmp_path, "llama", tie=False)
    assert cpu_kernels.load(), cpu_kernels.error()
    model = DecoderModel.from_pretrained(tmp_path, dtype, cpu_kernels=True)
    row_bytes = model.args.vocab_size * torch.tensor([], dtype=dtype).element_size()
    monkeypatch.setattr(decoder, "HEAD_BLOCK_BYTES", 3 * row_bytes)
    by_logits, by_argmax = pool_driver(model, seed=3), pool_driver(model, seed=3)
    buf = torch.empty(64, model.args.vocab_size)  # the runner's buffer: its head runs in the same blocks
    decode = [({0: [t], 1: [u]}, False) for t, u in zip(PROMPT[:4], OTHER[7:11], strict=True)]
    steps = [({0: PROMPT, 1: OTHER[:7]}, True), *decode]
    for chunks, all_rows in steps:
        logits = by_logits.step(chunks, all_rows=all_rows, logits_out=buf)
        tokens = by_argmax.step(chunks, all_rows=all_rows, argmax=True)
        for sid in chunks:
            assert tokens[sid].dtype == torch.int64
            assert torch.equal(tokens[sid], logits[sid].argmax(dim=-1))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_kernels_round_like_torch_in_bf16(tmp_path, pool_driver, kind: str) -> None:
    # bf16 is where rounding shows. The fused layer ops round each intermediate where the torch ops
    # do: a prefill step (no decode attention) gives the same logits up to the rare last-bit
    # difference of a norm or silu (tests/test_kernels.py). Decode steps differ
    # slightly: the decode attention kernel keeps its probabilities in float32 where SDPA rounds
    # them to bf16; there both paths must be as close to the float32 model as each other.
    build(tmp_path, kind, tie=False)
    model = DecoderModel.from_pretrained(tmp_path, torch.bfloat16)
    exact = DecoderModel.from_pretrained(tmp_path, torch.float32)
    runs = {}
    for name, m, kernels in (("torch", model, False), ("kernels", model, True), ("fp32", exact, False)):
        drv = pool_driver(m, seed=2, kernels=kernels)
        out = [drv.step({0: PROMPT[:12], 1: OTHER[:5]}, all_rows=True)[0]]
        out += [drv.step({0: PROMPT[i:i + 1], 1: OTHER[5 + i - 12:6 + i - 12]})[0] for i in range(12, 16)]
        runs[name] = out
    assert _rel_err(runs["kernels"][0], runs["torch"][0].float()) < 1e-3  # measured: 0 (equal)
    for t, k, ref in zip(runs["torch"][1:], runs["kernels"][1:], runs["fp32"][1:], strict=True):
        assert _rel_err(k, ref) < 1.5 * _rel_err(t, ref)  # measured 0.8x to 1.15x


def _per_op_then_one_call(model, pool_driver, monkeypatch, seed: int, steps: list[dict[int, list[int]]],
                          prefill_kernel: bool = False,
                          decode_rows: list[int | None] | None = None) -> tuple[list, list, list[set[int]]]:
    """The steps' outputs through the per-op path, then through the one-call path (same pool
    contents), and the projection kinds of each decode_layers_ call. ``decode_rows``: per step, as
    ``PoolDriver.step`` takes it (None: no prompt rows)."""
    kinds_seen: list[set[int]] = []
    real = torch.ops.lockgate.decode_layers_
    monkeypatch.setattr(torch.ops.lockgate, "decode_layers_",
                        lambda *a: kinds_seen.append(set(a[10])) or real(*a), raising=False)

    whole_step = KernelOps.whole_step

    def run(one_call: bool) -> list[torch.Tensor]:
        # the layer loop on the same fused ops, or the whole-step path where it applies
        monkeypatch.setattr(KernelOps, "whole_step", whole_step if one_call else (lambda *a, **k: None))
        drv = pool_driver(model, seed=seed, kernels=True, prefill_kernel=prefill_kernel)
        rows = decode_rows or [None] * len(steps)
        return [drv.step(step, decode_rows=r)[0] for step, r in zip(steps, rows, strict=True)]

    per_op = run(one_call=False)
    assert kinds_seen == []
    return per_op, run(one_call=True), kinds_seen


@pytest.mark.parametrize("prefill_kernel", [False, True], ids=["sdpa-prefill", "prefill-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_layers_in_one_call_equal_the_fused_layers(tmp_path, pool_driver, monkeypatch, dtype,
                                                          prefill_kernel) -> None:
    # A small all-decode step whose projections all pick quantized forms runs its layers in one
    # call (lockgate::decode_layers_); it must give exactly what the per-op path gives. Two
    # projections of each layer take lockgate's own int8 / int4 kernel so every small kind runs.
    build(tmp_path, "llama_bias_mha", tie=False)  # biases on every projection
    assert cpu_kernels.load(), cpu_kernels.error()
    model = DecoderModel.from_pretrained(tmp_path, dtype, quantization="int4", cpu_kernels=True)
    for layer in model.layers:
        layer.o.forms["group-quant"] = GroupQuantWeight.from_weight(layer.o_weight.float(), 8)
        layer.down.forms["group-quant"] = GroupQuantWeight.from_weight(layer.down_weight.float(), 4)
    model.choose_forms({"qkv": FormChoice.parse("torch-int4:16,dense"), "gate_up": FormChoice.parse("torch-int4:16,dense"),
                        "o": FormChoice.parse("group-quant:16,dense"), "down": FormChoice.parse("group-quant:16,dense")})
    steps = [{0: PROMPT[:9], 1: OTHER[:4]}]  # prefill
    steps += [{0: PROMPT[i:i + 1], 1: OTHER[4 + i - 9:5 + i - 9]} for i in range(9, 14)]
    # several new tokens of a decoding sequence (what its guess rows are to attention) next to a
    # decode row, then a decode row next to a prompt chunk
    steps += [{0: PROMPT[14:16] + [21], 1: OTHER[9:10]}, {0: [22], 1: OTHER[10:11] + [23, 24, 25]}]
    # with the prefill kernel every step is one attention group and takes the one call (prefill
    # included, on the prompt rows' forms); with SDPA for prompt rows only the decode steps do
    per_op, one_call, kinds = _per_op_then_one_call(model, pool_driver, monkeypatch, 3, steps, prefill_kernel)
    assert kinds == [{0, 4, 8}] * (8 if prefill_kernel else 5)
    for a, b in zip(per_op, one_call, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_steps_in_one_call_run_the_prompt_forms(tmp_path, pool_driver, monkeypatch, dtype) -> None:
    # With exact prefill (the runner's default) every projection serves prompt rows on one prompt
    # form, padded up to its min_rows, whatever the row count picks (here int4 up to 8 rows, the
    # prompt form dense). Steps with prompt rows (a prefill, a prompt chunk next to a decode row)
    # take the one call on the prompt forms, bitwise what the layer loop gives; a step with fewer
    # rows than min_rows stays on the layer loop (which pads, the operator would not), before and
    # after the prompt pack exists; decode-only steps, guess rows included, keep their per-count forms.
    from lockgate.layers.forms import onednn_packs
    from lockgate.layers.linear import PromptForm

    build(tmp_path, "llama_bias_mha", tie=False)
    assert cpu_kernels.load(), cpu_kernels.error()
    model = DecoderModel.from_pretrained(tmp_path, dtype, quantization="int4", cpu_kernels=True)
    model.choose_forms({role: FormChoice.parse("torch-int4:8,dense") for role in ("qkv", "o", "gate_up", "down")})
    for layer in model.layers:
        for lin in layer.projections().values():
            lin.set_prompt_form(PromptForm("dense", min_rows=4))
    dense = 200 if onednn_packs(dtype, torch.device("cpu")) else 201
    steps = [({0: PROMPT[:2], 1: OTHER[:1]}, 0),  # a 3-row prefill: below min_rows, before any prompt pack
             ({0: PROMPT[2:9], 1: OTHER[1:4]}, 0),  # prompt rows, 10: dense
             ({0: PROMPT[9:10], 1: OTHER[4:5]}, 2),  # decode, 2 rows: int4
             ({0: PROMPT[10:11], 1: OTHER[5:9]}, 1),  # a decode row and a 4-token chunk: dense (int4 by count)
             ({0: PROMPT[11:12], 1: OTHER[9:11]}, 1),  # 3 rows with prompt rows: layer loop
             ({0: PROMPT[12:15], 1: [30]}, 4),  # a decode row and its 2 guesses, and a decode row: int4
             ({0: PROMPT[15:16], 1: [31, 32, 33, 34, 35]}, 1)]  # 6 rows with prompt rows: dense
    per_op, one_call, kinds = _per_op_then_one_call(model, pool_driver, monkeypatch, 7, [c for c, _ in steps],
                                                    prefill_kernel=True, decode_rows=[r for _, r in steps])
    assert kinds == [{dense}, {0}, {dense}, {0}, {dense}]
    for a, b in zip(per_op, one_call, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_layers_with_int_gemm_forms_equal_the_fused_layers(tmp_path, pool_driver, monkeypatch, dtype) -> None:
    # A run whose projections pick the integer GEMM (lockgate::int_linear, which computes in float32:
    # it widens a bf16 x and rounds the biased result to bf16 itself) takes the
    # one-call path for decode steps of any size (kinds 104: its few-row path at 1-6 rows, its
    # tiles above), exactly as the per-op path picks per call; where the table picks dense
    # (here: steps of more than 3 sequences) the one call runs dense (kind 200 or 201).
    from lockgate.layers.forms import int_gemm_available, int_gemm_isa, onednn_packs

    build(tmp_path, "llama_bias_mha", tie=False)
    assert cpu_kernels.load(), cpu_kernels.error()
    if not int_gemm_available():
        pytest.skip(f"int_linear has no vector path on this CPU ({int_gemm_isa()})")
    model = DecoderModel.from_pretrained(tmp_path, dtype, quantization="int4", cpu_kernels=True)
    assert all("int-gemm" in lin.forms for layer in model.layers for lin in layer.projections().values())
    model.choose_forms({role: FormChoice.parse("int-gemm:3,dense") for role in ("qkv", "o", "gate_up", "down")})
    seqs = 5
    steps = [{s: PROMPT[s:s + 5] for s in range(seqs)}]
    steps += [{s: PROMPT[s + i:s + i + 1] for s in range(seqs)} for i in range(5, 8)]
    steps += [{0: PROMPT[8:9], 1: PROMPT[9:10], 2: PROMPT[10:11]}, {0: PROMPT[9:10], 1: PROMPT[10:11]},
              {0: PROMPT[10:11]}]  # three sequences, two, one
    per_op, one_call, kinds = _per_op_then_one_call(model, pool_driver, monkeypatch, 4, steps)
    dense = 200 if onednn_packs(dtype, torch.device("cpu")) else 201
    assert kinds == [{dense}] * 3 + [{104}] * 3  # the 5-sequence steps on dense, then the integer GEMM
    for a, b in zip(per_op, one_call, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("dtype", "form"), [(torch.float32, "dense"), (torch.bfloat16, "dense"),
                                           (torch.bfloat16, "bf16-gemm")])
def test_decode_layers_with_dense_forms_equal_the_fused_layers(tmp_path, pool_driver, monkeypatch, dtype,
                                                               form) -> None:
    # Decode steps whose projections pick a dense form (what a batch of 32 picks on a CPU with
    # fast bf16 GEMMs) run in one call too: kind 200 for a bf16 weight packed for oneDNN
    # (mkldnn::_linear_pointwise through the dispatcher, bias fused as in DenseWeight), 201 for
    # F.linear (float32, or bf16 where oneDNN has no bf16 kernels), 202 for lockgate's bf16 kernel
    # (what the default model picks from a few rows up on a CPU with AVX512-BF16 and no AMX; the
    # bias added in the kernel); bitwise what the per-op path gives, steps of 1 to 4 sequences.
    from lockgate.layers.forms import bf16_gemm_available, onednn_packs

    build(tmp_path, "llama_bias_mha", tie=False)  # biases on every projection
    assert cpu_kernels.load(), cpu_kernels.error()
    if form == "bf16-gemm" and not bf16_gemm_available():
        pytest.skip("lockgate::bf16_linear is built only for CPUs with AVX512-BF16")
    model = DecoderModel.from_pretrained(tmp_path, dtype, cpu_kernels=True)
    assert all(form in lin.forms for layer in model.layers for lin in layer.projections().values())
    model.choose_forms({role: FormChoice.parse(form) for role in ("qkv", "o", "gate_up", "down")})
    seqs = 4
    steps = [{s: PROMPT[s:s + 5] for s in range(seqs)}]
    steps += [{s: PROMPT[s + i:s + i + 1] for s in range(seqs)} for i in range(5, 9)]
    steps += [{0: PROMPT[9:10], 2: PROMPT[11:12]}, {0: PROMPT[10:11]}]  # fewer sequences
    per_op, one_call, kinds = _per_op_then_one_call(model, pool_driver, monkeypatch, 5, steps)
    kind = 202 if form == "bf16-gemm" else 200 if onednn_packs(dtype, torch.device("cpu")) else 201
    assert kinds == [{kind}] * 6  # the decode steps (the prefill runs SDPA here, outside the one call)
    for a, b in zip(per_op, one_call, strict=True):
        assert torch.equal(a, b)


def _row_invariant_model(tmp_path, form: str) -> DecoderModel:
    """The small test model with every projection on ``form``, a kind that gives a row the same bits
    at any row count (skipped, with the reason, where this CPU's build lacks it)."""
    from lockgate.layers.forms import bf16_gemm_available, int_gemm_available

    build(tmp_path, "llama_bias_mha", tie=False)
    assert cpu_kernels.load(), cpu_kernels.error()
    if form == "bf16-gemm" and not bf16_gemm_available():
        pytest.skip("lockgate::bf16_linear is built only for CPUs with AVX512-BF16")
    if form == "int-gemm" and not int_gemm_available():
        pytest.skip("int_linear has no vector path on this CPU")
    dtype = torch.bfloat16 if form == "bf16-gemm" else torch.float32
    model = DecoderModel.from_pretrained(tmp_path, dtype, quantization="none" if form == "bf16-gemm" else "int4",
                                         cpu_kernels=True)
    model.choose_forms({role: FormChoice.parse(form) for role in ("qkv", "o", "gate_up", "down")})
    return model


def _out_rows_of_each_call(monkeypatch, replace=None) -> tuple[list, list]:
    """Record the out_rows of every decode_layers_ call (None: all rows wanted) and, for each call
    given some, whether the operator really left the other rows short of the last layer (it is
    called again on a copy of its input without out_rows: the wanted rows must agree bitwise, and
    some other row differ). ``replace``: a function of the recorded rows giving the out_rows to call
    it with instead."""
    seen: list = []
    trimmed: list = []
    real = torch.ops.lockgate.decode_layers_

    def spy(*a):
        rows = a[16] if len(a) > 16 else None
        seen.append(None if rows is None else rows.tolist())
        if rows is None:
            return real(*a)
        if replace is not None:
            a = (*a[:16], replace(rows))
        x0 = a[0].clone()
        out = real(*a)
        full = real(x0, *a[1:16], None)  # (writes the same K/V again)
        wanted = a[16]
        assert torch.equal(out.index_select(0, wanted), full.index_select(0, wanted))
        others = [r for r in range(out.shape[0]) if r not in set(wanted.tolist())]
        trimmed.append(bool(others) and not torch.equal(out[others], full[others]))
        return out

    monkeypatch.setattr(torch.ops.lockgate, "decode_layers_", spy, raising=False)
    return seen, trimmed


# Two sequences' prompt chunks, one of them a middle chunk; a middle chunk alone; decode rows beside
# a chunk; a chunk all of whose rows are sampled beside one with none; then decode steps, which read
# every K/V row the trimmed last layers wrote. (chunks, the sequences sampled[, every row of them])
TRIM_STEPS = [({0: PROMPT[:6], 1: OTHER[:3], 2: PROMPT[6:10]}, {0, 2}),
              ({1: OTHER[3:7]}, set()),
              ({0: PROMPT[6:7], 1: OTHER[7:9], 2: PROMPT[10:11]}, {0, 1, 2}),
              ({0: PROMPT[7:10], 2: PROMPT[11:13]}, {0}, True),
              ({0: PROMPT[10:11], 1: OTHER[9:10], 2: PROMPT[13:14]}, {0, 1, 2}),
              ({0: PROMPT[11:12], 1: OTHER[10:11], 2: PROMPT[14:15]}, {0, 1, 2})]
TRIM_ROWS = [[5, 12], [], [0, 2, 3], [0, 1, 2], None, None]  # the rows sampled, where decode_layers_ gets them


def _trim_runs(model, pool_driver, monkeypatch, steps, decode_rows=None, seed: int = 8) -> list[list[dict]]:
    """The steps' sampled logits through the per-op path (every row through every layer), then
    through the one-call path."""
    whole_step = KernelOps.whole_step
    outs = []
    for one_call in (False, True):
        monkeypatch.setattr(KernelOps, "whole_step", whole_step if one_call else (lambda *a, **k: None))
        drv = pool_driver(model, seed=seed, kernels=True, prefill_kernel=True)
        rows = decode_rows or [None] * len(steps)
        outs.append([drv.step(chunks, sampled=sampled, decode_rows=r, all_rows=bool(every))
                     for (chunks, sampled, *every), r in zip(steps, rows, strict=True)])
    return outs


def _assert_equal_steps(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for sid in x:
            assert torch.equal(x[sid], y[sid]), sid


@pytest.mark.parametrize("form", ["bf16-gemm", "int-gemm"])
def test_last_layer_runs_on_the_sampled_rows_only(tmp_path, pool_driver, monkeypatch, form) -> None:
    # Only the sampled rows of a step go past the last layer, but every row's K/V must reach the
    # pool. On forms that give a row the same bits at any row count, a step with prompt rows runs
    # the last layer's attention, o projection and MLP on its sampled rows alone (decode_layers_'
    # out_rows): a chunk's last row, none of a middle chunk's, decode rows beside a chunk. The
    # sampled rows' logits are bitwise what the per-op path (every row through every layer) gives,
    # and so are the decode steps after, which read the trimmed layers' K/V (the pool starts as NaN).
    model = _row_invariant_model(tmp_path, form)
    seen, trimmed = _out_rows_of_each_call(monkeypatch)
    per_op, one_call = _trim_runs(model, pool_driver, monkeypatch, TRIM_STEPS)
    assert seen == TRIM_ROWS
    assert trimmed == [True] * 4
    _assert_equal_steps(per_op, one_call)
    assert not any(torch.isnan(v).any() for step in one_call for v in step.values())


@pytest.mark.parametrize("form", ["bf16-gemm", "int-gemm"])
def test_last_layer_trim_keeps_whole_sequences_and_checks_its_rows(tmp_path, pool_driver, monkeypatch, form) -> None:
    # out_rows that are not the last rows of their sequences (row 3 of a 6-row chunk, given in place
    # of row 5) make the operator run the last layer over every row (rows 5 and 12, read after, are
    # then right: bitwise the per-op path's); rows out of order are refused, naming the rule.
    model = _row_invariant_model(tmp_path, form)
    steps = TRIM_STEPS[:1]
    with pytest.MonkeyPatch.context() as mp:
        _, trimmed = _out_rows_of_each_call(mp, replace=lambda rows: torch.tensor([3, 12]))
        per_op, one_call = _trim_runs(model, pool_driver, mp, steps)
    assert trimmed == [False]  # the whole layer ran
    _assert_equal_steps(per_op, one_call)
    with pytest.MonkeyPatch.context() as mp:
        _out_rows_of_each_call(mp, replace=lambda rows: torch.tensor([12, 5]))
        with pytest.raises(RuntimeError, match="out_rows must be strictly ascending"):
            _trim_runs(model, pool_driver, mp, steps)


def test_last_layer_trim_on_prompt_forms_waits_for_their_floor(tmp_path, pool_driver, monkeypatch) -> None:
    # Where a step's forms are row-invariant only from a floor (prompt forms checked with min_rows),
    # the last layer is trimmed only when the sampled rows reach it: below, the projections would
    # see fewer rows than their floor. Here every kind counts as depending on the row count but the
    # prompt forms (a row-invariant kind, so the trimmed rows' bits can be compared) have a floor of 3.
    from lockgate.layers.forms import bf16_gemm_available
    from lockgate.layers.linear import PromptForm

    form = "bf16-gemm" if bf16_gemm_available() else "int-gemm"
    model = _row_invariant_model(tmp_path, form)
    model.choose_forms({role: FormChoice.parse("dense") for role in ("qkv", "o", "gate_up", "down")})
    for layer in model.layers:
        for lin in layer.projections().values():
            lin.set_prompt_form(PromptForm(form, min_rows=3))
    monkeypatch.setattr(KernelOps, "ROW_INVARIANT_KINDS", frozenset())
    seen, trimmed = _out_rows_of_each_call(monkeypatch)
    steps = [({0: PROMPT[:6], 1: OTHER[:3], 2: PROMPT[6:10]}, {0, 2}),  # 2 sampled rows: below the floor
             ({0: PROMPT[6:9], 1: OTHER[3:7], 2: PROMPT[10:12]}, {0, 1, 2}),  # 3: trimmed
             ({1: OTHER[7:10]}, set())]  # none (a middle chunk): trimmed whatever the floor
    per_op, one_call = _trim_runs(model, pool_driver, monkeypatch, steps, decode_rows=[0, 0, 0])
    assert seen == [None, [2, 6, 8], []]
    assert trimmed == [True, True]
    _assert_equal_steps(per_op, one_call)


def test_config_parsing_and_errors(tmp_path) -> None:
    base = {**COMMON, "model_type": "llama", "hidden_act": "silu"}
    a = args_from_config({**base, "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 500.0})
    assert a.rope_theta == 500.0 and a.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    a = args_from_config({**base, "rope_parameters": LLAMA3_ROPE})
    assert a.rope_scaling["rope_type"] == "llama3" and a.rope_theta == 10000.0
    assert a.head_dim == 16 and a.num_queries_per_kv == 2 and not a.qkv_bias
    assert args_from_config({**base, "model_type": "qwen2"}).qkv_bias
    assert args_from_config({**base, "model_type": "mistral", "sliding_window": 4096}).sliding_window == 4096
    for bad, msg in [({"model_type": "gpt2"}, "unsupported model_type"),
                     ({"hidden_act": "gelu"}, "hidden_act"),
                     ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
                     ({"rope_parameters": {"rope_type": "llama3", "factor": 4.0, "rope_theta": 1e4}}, "missing"),
                     ({"num_key_value_heads": 3}, "multiple")]:
        with pytest.raises(ValueError, match=msg):
            args_from_config({**base, **bad})
    # a directory whose weights lack a tensor gives a clear error naming it
    build(tmp_path, "llama", True)
    f = next(tmp_path.glob("*.safetensors"))
    sd = load_file(f)
    assert "lm_head.weight" not in sd  # tied: saved once
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="lm_head.weight is missing"):
        DecoderModel.from_pretrained(tmp_path)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        DecoderModel.from_pretrained(tmp_path)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("kind", ["llama_bias_mha", "qwen2"])
def test_int4_and_fp32_forms_match_transformers(tmp_path, pool_driver, kind: str, kernels: bool) -> None:
    # Biased projections (Qwen2 q/k/v; Llama attention_bias and mlp_bias) through the int4 form
    # (--quantization int4, a 16-token prompt: every call has <= 16 rows) and the float32 form
    # (--fp32-matmul-rows 1), in bf16. The int4 reference is transformers with each projection
    # replaced by what the int4 kernel multiplies by (random weights are not on a 4-bit grid).
    hf, _ = build(tmp_path, kind, tie=False)
    want = hf_logits(hf, PROMPT)
    if kernels:
        pool_driver(DecoderModel.from_pretrained(tmp_path, torch.bfloat16), kernels=True)  # builds them if need be
    q4 = DecoderModel.from_pretrained(tmp_path, torch.bfloat16, quantization="int4", cpu_kernels=kernels)
    q4.choose_forms({role: FormChoice.parse("torch-int4:16,dense") for role in ("qkv", "o", "gate_up", "down")})
    assert all(isinstance(lin.forms["torch-int4"], Int4Weight) for layer in q4.layers
               for lin in layer.projections().values())
    assert not q4.head.quantized  # random weights: no lossless grid for the head
    a = q4.args
    with torch.no_grad():
        for layer, hl in zip(q4.layers, hf.model.layers, strict=True):
            deq = {name: lin.forms["torch-int4"].dequantize(*lin.weight.shape)
                   for name, lin in layer.projections().items()}
            sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
            for proj, w in zip((hl.self_attn.q_proj, hl.self_attn.k_proj, hl.self_attn.v_proj),
                               deq["qkv"].split(sizes), strict=True):
                proj.weight.copy_(w)
            hl.self_attn.o_proj.weight.copy_(deq["o"])
            hl.mlp.gate_proj.weight.copy_(deq["gate_up"][:a.intermediate_size])
            hl.mlp.up_proj.weight.copy_(deq["gate_up"][a.intermediate_size:])
            hl.mlp.down_proj.weight.copy_(deq["down"])
    want4 = hf_logits(hf, PROMPT)
    got4 = pool_driver(q4).step({0: PROMPT}, all_rows=True)[0]
    assert _rel_err(got4, want4) < 0.05 < _rel_err(got4, want)  # int4 ran, and ran right (measured 0.018 vs 0.3)

    f32 = DecoderModel.from_pretrained(tmp_path, torch.bfloat16, quantization="none", fp32=True)
    f32.choose_forms({role: FormChoice.single("fp32") for role in ("qkv", "o", "gate_up", "down", "head")})
    dense = DecoderModel.from_pretrained(tmp_path, torch.bfloat16, quantization="none")
    got32 = pool_driver(f32).step({0: PROMPT}, all_rows=True)[0]
    gotb = pool_driver(dense).step({0: PROMPT}, all_rows=True)[0]
    assert _rel_err(got32, want) < 0.05 and _rel_err(gotb, want) < 0.05  # bf16 activations: measured ~0.017
    assert not torch.equal(got32, gotb)  # the float32 form ran


def test_matmul_parameters_counts_every_projection_and_the_head(tmp_path) -> None:
    _, ours = build(tmp_path, "llama_bias_mha", tie=True)
    lins = [lin for layer in ours.layers for lin in layer.projections().values()] + [ours.head]
    assert ours.args.matmul_parameters == sum(lin.weight.numel() for lin in lins)


@pytest.mark.parametrize("form", ["bf16-gemm", "int-gemm"])
def test_decode_steps_split_in_two_halves_equal_the_fused_layers(tmp_path, pool_driver, monkeypatch, form) -> None:
    # On two threads a large enough decode step on lockgate's bf16 kernel runs as two halves of the
    # batch, one thread carrying each half through every layer (decode_layers_ parts = 2). A row's
    # arithmetic must not change: bitwise what the per-op path gives. The floor is lowered so that
    # steps of 4-5 sequences split (odd and even halves); the integer GEMM (row-invariant too, not
    # split by default: not measured to gain) is let in so the operator's split is covered on CPUs
    # without AVX512-BF16.
    model = _row_invariant_model(tmp_path, form)
    monkeypatch.setattr(KernelOps, "SPLIT_MIN_ROWS", 4)
    monkeypatch.setattr(KernelOps, "SPLIT_KINDS", KernelOps.ROW_INVARIANT_KINDS)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    parts_seen: list[int] = []
    real = torch.ops.lockgate.decode_layers_
    monkeypatch.setattr(torch.ops.lockgate, "decode_layers_",
                        lambda *a: parts_seen.append(a[15] if len(a) > 15 else 1) or real(*a), raising=False)
    whole_step = KernelOps.whole_step
    try:
        seqs = 5
        steps = [{s: PROMPT[s:s + 5] for s in range(seqs)}]
        steps += [{s: PROMPT[s + i:s + i + 1] for s in range(seqs)} for i in range(5, 9)]
        steps += [{s: PROMPT[s + 9:s + 10] for s in range(4)}, {0: PROMPT[10:11], 1: PROMPT[11:12]}]
        outs = []
        for one_call in (False, True):
            monkeypatch.setattr(KernelOps, "whole_step", whole_step if one_call else (lambda *a, **k: None))
            drv = pool_driver(model, seed=6, kernels=True)
            outs.append([drv.step(step)[0] for step in steps])
    finally:
        torch.set_num_threads(threads)
    assert parts_seen == [2, 2, 2, 2, 2, 1]  # 5 and 4 sequences split; 2 (below the floor) not
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
