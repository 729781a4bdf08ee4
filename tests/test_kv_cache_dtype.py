"""``--kv-cache-dtype`` end to end: a real server on the default model with the 8-bit pool, driven
with the official ``openai`` client; the pool's capacity counted at its bytes (scales included) and
admission using it; what it shows (/v1/loads, /metrics, the start-up log); bad values refused with
the flag's name. (The kernels' tests: test_kv_quant.py; the tier's determinism: test_determinism.py;
its quality: benchmarks/kv_quality.py.)"""

from __future__ import annotations

import httpx
import openai
import pytest
from server_util import ServerProc

from lockgate import LLM, SamplingParams
from lockgate.kvcache import kv_dtype

POOL = 8 * 2**20  # 8 MiB: a few hundred tokens of the default model's KV


@pytest.fixture(scope="module")
def int8_server():
    s = ServerProc("--model", "default", "--kv-cache-memory", str(POOL), "--kv-cache-dtype", "int8")
    try:
        yield s.wait_ready(timeout=300)
    finally:
        s.stop()


def test_server_serves_from_the_int8_pool_through_the_openai_client(int8_server) -> None:
    client = openai.OpenAI(base_url=int8_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    r = client.completions.create(model="default", prompt="The capital of France is", max_tokens=8, temperature=0,
                                  logprobs=1)
    assert "Paris" in r.choices[0].text and r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Say hi."}],
                                                 max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    again = client.completions.create(model="default", prompt="The capital of France is", max_tokens=8,
                                      temperature=0, logprobs=1)  # its prompt now a prefix-cache hit
    assert again.choices[0].text == r.choices[0].text
    assert again.choices[0].logprobs.token_logprobs == r.choices[0].logprobs.token_logprobs


def test_the_pool_holds_what_its_bytes_buy_and_says_so(int8_server) -> None:
    """The 8-bit pool's capacity is the memory over its real bytes per token (codes and scales),
    ~3.8x the float32 pool's here (~1.9x bf16's); /v1/loads, /metrics and the log name the dtype;
    admission takes a request the exact pool of the same memory could not hold."""
    loads = httpx.get(int8_server.url + "/v1/loads").json()
    layers, kv_heads, head_dim = 30, 3, 64  # SmolLM2-135M
    per_token = kv_dtype.bytes_per_token(layers, kv_heads, head_dim, "int8", 4)
    assert per_token == layers * 2 * kv_heads * (head_dim + 4)
    assert loads["kv_cache_dtype"] == "int8" and loads["capacity"] == POOL // per_token
    exact = POOL // (layers * 2 * kv_heads * head_dim * 4)  # the float32 pool of the same memory: 182 tokens
    bf16 = POOL // (layers * 2 * kv_heads * head_dim * 2)
    assert loads["capacity"] >= 1.85 * bf16 and loads["capacity"] > 3.7 * exact
    metrics = httpx.get(int8_server.url + "/metrics").text
    assert 'cache_dtype="int8"' in metrics
    assert "--kv-cache-dtype int8: int8 (per token and head scales; inexact tier)" in int8_server.log()
    # a request of ~2x the exact pool's capacity (prompt + max_tokens) is admitted and served
    client = openai.OpenAI(base_url=int8_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    r = client.completions.create(model="default", prompt="one two three four five six seven eight " * 30,
                                  max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + 64 > 1.5 * exact and r.usage.completion_tokens == 64
    too_long = "word " * (loads["capacity"] + 10)
    with pytest.raises(openai.BadRequestError, match="KV cache capacity"):
        client.completions.create(model="default", prompt=too_long, max_tokens=4)


def test_fp8_tier_offline_and_the_16_bit_names() -> None:
    llm = LLM("default", dtype="float32", kv_cache_dtype="fp8_e4m3", max_total_tokens=512)
    r = llm.engine.runner
    assert r.kv_cache_dtype_name == "fp8_e4m3" and r.k_cache.shape[-1] == 64 + 4
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert "Paris" in out.outputs[0].text
    with pytest.raises(ValueError, match=r"--kv-cache-dtype float16: the KV pool is kept in the model's dtype "
                                         r"\(float32\) or at 8 bits \(int8, fp8\); give --dtype float16"):
        LLM("default", dtype="float32", kv_cache_dtype="float16", max_total_tokens=512)


def test_bad_values_are_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, bfloat16, float16, fp8, fp8_e4m3, "
                                         "int8; got 'fp4'"):
        LLM("default", kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="--kv-cache-dtype int8: the 8-bit KV pool is read by lockgate's CPU kernels"):
        LLM("default", dtype="float32", cpu_kernels="off", kv_cache_dtype="int8", max_total_tokens=256)
    s = ServerProc("--model", "default", "--kv-cache-dtype", "int4")
    assert s.proc.wait(120) == 2
    s.stop()
    assert "argument --kv-cache-dtype: invalid choice: 'int4'" in s.log()
