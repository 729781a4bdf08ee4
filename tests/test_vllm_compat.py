"""vLLM's command line and offline API on lockgate: a vLLM user's launch command, ``LLM(...)``
keyword arguments, ``SamplingParams`` and prompt forms, with vLLM's meaning.

Parser-level tests build the config from vLLM's flags without starting anything; one real
``lockgate serve`` (the simulated model, started by vLLM's command line) checks the served names
through the official ``openai`` client; the offline tests share the session's default model.
"""

from __future__ import annotations

import re
import subprocess
import sys

import openai
import pytest

from lockgate.cli import build_parser, main
from lockgate.config import CacheConfig, EngineConfig, config_from_args, parse_count
from lockgate.sampling import SamplingParams
from lockgate.server_config import ServerConfig, server_config_from_args
from lockgate.vllm_compat import apply_vllm_args, engine_options

VLLM_COMMAND = ("serve Qwen/Qwen2.5-0.5B-Instruct --gpu-memory-utilization 0.5 -tp 1 --no-enable-prefix-caching "
                "--max-num-batched-tokens 2048 --max-num-seqs 8 --max-model-len 32k --trust-remote-code "
                "--enforce-eager --disable-log-requests --enable-auto-tool-choice --tool-call-parser hermes "
                "--served-model-name a b --kv-cache-dtype auto")


def _serve_ns(argv: str):  # type: ignore[no-untyped-def]
    ns = build_parser().parse_args(argv.split())
    notes = apply_vllm_args(ns)
    return config_from_args(ns), server_config_from_args(ns), notes


def test_a_vllm_launch_command_maps_onto_lockgate_options() -> None:
    engine, server, notes = _serve_ns(VLLM_COMMAND)
    assert engine.model.model == "Qwen/Qwen2.5-0.5B-Instruct"  # the positional MODEL
    assert engine.cache.gpu_memory_utilization == 0.5 and engine.cache.kv_cache_memory is None
    assert engine.scheduler.disable_prefix_cache is True
    assert engine.scheduler.max_prefill_tokens == 2048 and engine.scheduler.max_running_requests == 8
    assert engine.model.max_model_len == 32000
    assert server.served_model_name == ("a", "b") and server.model_name("x") == "a"
    assert server.tool_call_parser == "hermes"
    said = "\n".join(notes)
    for flag in ("--trust-remote-code", "--enforce-eager", "--disable-log-requests", "--enable-auto-tool-choice"):
        assert f"{flag}: accepted for vLLM compatibility, no effect" in said
    assert len(notes) == 4  # one line each, nothing for the flags that do something
    engine, _, _ = _serve_ns("serve --enable-prefix-caching")
    assert engine.scheduler.disable_prefix_cache is False and engine.model.model == "default"


def test_token_counts_as_vllm_writes_them() -> None:
    assert [parse_count(t) for t in ("32768", "32k", "32K", "1K", "25.6k", "2m")] == [
        32768, 32000, 32768, 1024, 25600, 2_000_000]
    with pytest.raises(ValueError, match="no decimals with the binary suffix K"):
        parse_count("1.5K")
    with pytest.raises(ValueError, match="not a token count"):
        parse_count("lots")
    assert EngineConfig.build(max_model_len="4K").model.max_model_len == 4096


@pytest.mark.parametrize("argv, message", [
    ("serve -tp 0", "--tensor-parallel-size must be >= 1, got 0"),
    ("serve -pp 2", "--pipeline-parallel-size 2: pipeline parallelism is not available yet"),
    ("serve -tp 2 --dp 2", "--tensor-parallel-size with replicas"),
    ("serve --gpu-memory-utilization 0.5 --kv-cache-memory 1GiB",
     "--gpu-memory-utilization and --kv-cache-memory both size the KV pool: give one"),
    ("serve --gpu-memory-utilization 0.5 --max-total-tokens 4096",
     "--gpu-memory-utilization and --max-total-tokens both size the KV pool"),
    ("serve --gpu-memory-utilization 1.5", r"--gpu-memory-utilization must be in \(0, 1\], got 1.5"),
    ("serve --gpu-memory-utilization 0.5 --dp 2", "with several replicas size each one's pool with --kv-cache-memory"),
    ("serve --enable-prefix-caching --disable-prefix-cache", "contradict each other"),
    ("serve org/a --model org/b", "the model is given twice: MODEL 'org/a' and --model 'org/b'"),
    ("serve --tokenizer other/tok", "--tokenizer other/tok: only the model's own tokenizer"),
])
def test_unsupported_vllm_values_are_errors_naming_the_flag(argv: str, message: str, capsys) -> None:
    assert main(argv.split()) == 2  # before any process starts
    assert re.search(message, capsys.readouterr().err)


def test_argparse_errors_print_serves_usage_and_serve_has_version(capsys) -> None:
    for argv, said in ((["serve", "--bogus"], "unrecognized arguments: --bogus"),
                       (["serve", "--max-model-len", "3.5K"], "argument --max-model-len: '3.5K': no decimals"),
                       (["serve", "--tool-call-parser", "nonesuch"], "invalid choice: 'nonesuch' (choose from 'auto', 'hermes'")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "usage: lockgate serve" in err and said in err, err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("lockgate ")


def test_gpu_memory_utilization_is_a_share_of_available_memory_for_the_engine() -> None:
    gib = 1024**3
    c = CacheConfig(gpu_memory_utilization=0.5)
    assert c.pool_bytes(resident=1 * gib, available=10 * gib) == 4 * gib  # 5 GiB for the engine, 1 GiB resident
    with pytest.raises(ValueError, match="leaves nothing for the KV pool"):
        c.pool_bytes(resident=6 * gib, available=10 * gib)
    assert CacheConfig().pool_bytes(resident=6 * gib, available=None) == 2 * gib  # the default size
    assert c.sized_by == "--gpu-memory-utilization 0.5"


def test_served_model_names_round_trip_and_accept_a_single_string() -> None:
    assert ServerConfig(served_model_name="m").served_model_name == ("m",)
    assert ServerConfig().model_name("default") == "default"
    assert ServerConfig(tool_call_parser="pythonic").tool_call_parser == "pythonic"
    with pytest.raises(ValueError, match="--tool-call-parser 'granite' is not available: the supported parsers are "
                                         "auto, hermes"):
        ServerConfig(tool_call_parser="granite")


# ---- the offline API ------------------------------------------------------------------------

VLLM_KWARGS = dict(gpu_memory_utilization=0.01, tensor_parallel_size=1, enable_prefix_caching=False, max_num_seqs=4,
                   max_model_len=1024, kv_cache_dtype="auto", dtype="auto", seed=0, trust_remote_code=True,
                   enforce_eager=True, max_num_batched_tokens=512, tokenizer="sim", quantization=None,
                   swap_space=4, disable_log_stats=True)


def test_llm_takes_vllms_keyword_arguments_and_refuses_unknown_ones_as_vllm_does() -> None:
    flat, notes = engine_options("sim", VLLM_KWARGS)
    cfg = EngineConfig.build(model="sim", **flat)
    assert cfg.cache.gpu_memory_utilization == 0.01 and cfg.scheduler.disable_prefix_cache is True
    assert (cfg.scheduler.max_running_requests, cfg.scheduler.max_prefill_tokens) == (4, 512)
    assert cfg.model.quantization == "auto" and cfg.model.max_model_len == 1024
    assert {n.split(":")[0] for n in notes} == {"trust_remote_code", "enforce_eager", "swap_space", "disable_log_stats"}
    assert engine_options("sim", {"dtype": "half"})[0] == {"dtype": "float16"}
    from lockgate import LLM

    with pytest.raises(TypeError, match="unexpected keyword argument 'speculative_model'"):
        LLM(model="sim", speculative_model="x")
    with pytest.raises(ValueError, match="--tensor-parallel-size: the simulated model"):
        LLM(model="sim", tensor_parallel_size=2)  # vLLM's keyword reaches the config (a real model splits)
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, bfloat16, float16, fp8, fp8_e4m3, "
                                         "int8; got 'fp4'"):
        LLM(model="sim", kv_cache_dtype="fp4")
    llm = LLM(model="sim", **VLLM_KWARGS)
    assert llm.engine.cfg.scheduler.max_running_requests == 4


def test_sampling_params_take_vllms_forms() -> None:
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b") and SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)
    assert SamplingParams(n=4).n == 4
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 128\], got 0"):
        SamplingParams(n=0)
    with pytest.raises(TypeError):
        SamplingParams(best_of_beams=2)  # type: ignore[call-arg]  # unknown: refused, never ignored


def test_offline_n_prompt_dicts_tokenizer_and_chat(smol_fp32) -> None:
    llm = smol_fp32
    text = "The capital of France is"
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    [grouped] = llm.generate([{"prompt": text}], p)
    assert grouped.prompt == text and [c.index for c in grouped.outputs] == [0, 1, 2]
    singles = [llm.generate(text, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8))[0].outputs[0]
               for i in range(3)]
    assert [c.token_ids for c in grouped.outputs] == [s.token_ids for s in singles]  # choice i: seed + i
    assert len({tuple(c.token_ids) for c in grouped.outputs}) > 1
    ids = llm.get_tokenizer().encode(text)
    greedy = SamplingParams(temperature=0, max_tokens=8, stop=["\n"])
    by_text, by_dict, by_ids = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}], greedy)
    assert by_text.prompt_token_ids == by_dict.prompt_token_ids == by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].text == by_dict.outputs[0].text == by_ids.outputs[0].text != ""
    assert by_ids.prompt is None
    with pytest.raises(ValueError, match="prompt 0: 'multi_modal_data' not supported"):
        llm.generate({"prompt": text, "multi_modal_data": {}}, greedy)
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=4, n=2))
    assert len(out[0].outputs) == 2 and out[0].outputs[0].text == out[0].outputs[1].text  # greedy: the same


# ---- one real server, started by vLLM's command line ----------------------------------------

def test_serve_takes_a_vllm_command_line_and_answers_to_every_served_name() -> None:
    from server_util import ServerProc

    s = ServerProc("sim", "--served-model-name", "first", "second", "--gpu-memory-utilization", "0.02", "-tp", "1",
                   "--enable-prefix-caching", "--max-model-len", "1K", "--max-num-batched-tokens", "256",
                   "--trust-remote-code", "--enforce-eager", "--enable-auto-tool-choice", "--tool-call-parser",
                   "hermes", "--strict-model-name")
    try:
        s.wait_ready(timeout=120)
        before = _samples(s.url)
        for name in ZERO_AT_START:  # counters exist with 0 from the start, labelled as vLLM's
            assert before[name] == 0, name
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["first", "second"]
        for name in ("first", "second"):
            r = client.completions.create(model=name, prompt="hello", max_tokens=3, temperature=0)
            assert r.model == "first" and r.usage.completion_tokens == 3
        with pytest.raises(openai.NotFoundError, match="'first' / 'second'"):
            client.completions.create(model="third", prompt="hello", max_tokens=3)
        info = client.models.list().data[0]
        assert info.model_extra["max_model_len"] == 1024
        shared = "a prompt long enough to be cached " * 4
        for _ in range(2):  # the second is a prefix-cache hit
            client.completions.create(model="first", prompt=shared, max_tokens=5, temperature=0)
        after = _samples(s.url)
    finally:
        s.stop()
    log = s.log()
    assert "--trust-remote-code: accepted for vLLM compatibility, no effect" in log
    k = '{engine="0",model_name="first"}'
    requests = 4
    assert after[f"lockgate:request_time_per_output_token_seconds_count{k}"] == requests
    assert after[f"lockgate:request_prefill_kv_computed_tokens_count{k}"] == requests
    cached = after[f"lockgate:prompt_tokens_cached_total{k}"]
    assert cached > 0 and cached == after[f"lockgate:prefix_cache_hits_total{k}"]
    computed = after[f"lockgate:request_prefill_kv_computed_tokens_sum{k}"]
    assert computed + cached == after[f"lockgate:prompt_tokens_total{k}"]
    by_source = '{engine="0",model_name="first",source="%s"}'
    assert after["lockgate:prompt_tokens_by_source_total" + by_source % "local_compute"] == computed
    assert after["lockgate:prompt_tokens_by_source_total" + by_source % "local_cache_hit"] == cached
    # every step's tokens (prompt tokens prefilled + tokens generated) add up to what was computed
    assert after[f"lockgate:iteration_tokens_total_sum{k}"] == computed + after[f"lockgate:generation_tokens_total{k}"]
    [info_labels] = [lbl for lbl in after if lbl.startswith("lockgate:cache_config_info{")]
    assert 'block_size="1"' in info_labels and 'enable_prefix_caching="True"' in info_labels
    assert 'gpu_memory_utilization="0.02"' in info_labels and after[info_labels] == 1


ZERO_AT_START = [f'lockgate:{n}_total{{engine="0",model_name="first"}}' for n in (
    "prompt_tokens", "generation_tokens", "prompt_tokens_cached", "prefix_cache_hits", "prefix_cache_queries",
    "num_preemptions", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")]


def _samples(url: str) -> dict[str, float]:
    """/metrics as {'name{label="v",...}': value}, labels sorted."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for smp in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(smp.labels.items()))
            out[f"{smp.name}{{{labels}}}"] = smp.value
    return out


def test_a_switch_given_a_string_is_refused_naming_it() -> None:
    """LLM(disable_prefix_cache="no") would otherwise turn the cache off ("no" is truthy)."""
    from lockgate.config import EngineConfig

    for kw, name in ((dict(disable_prefix_cache="no"), "disable_prefix_cache"),
                     (dict(async_scheduling="yes"), "overlap_schedule")):
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            EngineConfig.build(model="sim", **kw)
    assert EngineConfig.build(model="sim", async_scheduling=True).scheduler.overlap_schedule is True


def test_sglangs_overlap_switch_is_accepted_both_ways() -> None:
    """SGLang's --disable-overlap-schedule (its overlap is on by default; here off by default) is
    accepted; given with --overlap-schedule or --async-scheduling, argparse refuses naming both."""
    assert _serve_ns("serve --disable-overlap-schedule")[0].scheduler.overlap_schedule is False
    assert _serve_ns("serve --async-scheduling")[0].scheduler.overlap_schedule is True
    for on in ("--overlap-schedule", "--async-scheduling"):
        r = subprocess.run([sys.executable, "-m", "lockgate.cli", "serve", "--model", "sim", on,
                            "--disable-overlap-schedule"], capture_output=True, text=True, timeout=60)
        err = r.stderr.splitlines()[-1]
        assert r.returncode == 2 and "not allowed with argument" in err, r.stderr
        assert "--disable-overlap-schedule" in err and "--overlap-schedule/--async-scheduling" in err, err
