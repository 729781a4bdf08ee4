"""lockgate's fused CPU ops (lockgate/kernels/csrc/fused_ops.cpp) against the torch ops they replace.

float32: equal up to float rounding of a different summation order / exp approximation. bf16: each
op rounds where the torch sequence rounds, so results are the same numbers but for rare last-bit
differences (1/sqrt vs rsqrt, the exp polynomial vs libm inside silu). The decode attention kernel
has its own tests in tests/test_attention.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lockgate import kernels
from lockgate.layers.norm import rms_norm
from lockgate.layers.rope import RotaryEmbedding, apply_rope


@pytest.fixture(scope="module")
def ops():
    # A machine that runs the suite has a compiler: a failed build fails these tests, never skips them.
    assert kernels.load(), f"lockgate CPU kernels did not build: {kernels.error()}"
    return torch.ops.lockgate


def assert_same_numbers(got: torch.Tensor, want: torch.Tensor, max_differing: float) -> None:
    """float32: close; bf16: equal except at most ``max_differing`` of the elements, by one last bit."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        return
    differ = got != want
    assert differ.float().mean() <= max_differing, f"{int(differ.sum())} of {got.numel()} differ"
    # where they differ, by one bf16 step at most (8 significant bits)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-30, rtol=2 ** -7)


DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 7, 300]  # decode, a small mixed step, a prefill (threads split rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", ROWS)
def test_add_rms_norm_equals_add_then_norm(ops, dtype: torch.dtype, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    x, r = torch.randn(t, 576, generator=g).to(dtype), (3 * torch.randn(t, 576, generator=g)).to(dtype)
    w = (1 + 0.3 * torch.randn(576, generator=g)).to(dtype)
    want_r = r + x
    got = ops.add_rms_norm_(r, x, w, 1e-5)  # r updated in place
    assert torch.equal(r, want_r)
    assert_same_numbers(got, rms_norm(want_r, w, 1e-5), max_differing=1e-3)
    alone = ops.add_rms_norm_(r, None, w, 1e-5)  # no x: the norm only, r unchanged
    assert torch.equal(r, want_r)
    assert_same_numbers(alone, rms_norm(want_r, w, 1e-5), max_differing=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", ROWS)
def test_silu_mul_equals_silu_times_up(ops, dtype: torch.dtype, t: int) -> None:
    gu = (4 * torch.randn(t, 2 * 1536, generator=torch.Generator().manual_seed(t))).to(dtype)
    gu[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])  # saturated and zero gates
    gate, up = gu.chunk(2, dim=-1)
    assert_same_numbers(ops.silu_mul(gu), F.silu(gate) * up, max_differing=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("d", [64, 256, 48])  # SmolLM2; Gemma (the vector path's widest); no vector path
def test_rope_write_kv_equals_rope_and_index_copy(ops, dtype: torch.dtype, t: int, d: int) -> None:
    h, hkv = 9, 3
    g = torch.Generator().manual_seed(t)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    cos, sin = RotaryEmbedding(d, 10000.0, None, torch.device("cpu")).cos_sin(torch.randint(0, 2000, (t,), generator=g),
                                                                              dtype)
    want = apply_rope(qkv[:, :(h + hkv) * d].view(t, h + hkv, d), cos, sin)  # [T, H + Hkv, D]
    k_cache = torch.full((1000, hkv, d), float("nan")).to(dtype)
    v_cache = k_cache.clone()
    slots = torch.randperm(1000, generator=g)[:t]
    q = ops.rope_write_kv(qkv, cos.view(t, d), sin.view(t, d), h, hkv, k_cache, v_cache, slots)
    assert_same_numbers(q, want[:, :h].contiguous(), max_differing=0)
    assert_same_numbers(k_cache[slots], want[:, h:].contiguous(), max_differing=0)
    assert torch.equal(v_cache[slots], qkv[:, (h + hkv) * d:].view(t, hkv, d))
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[slots] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()  # nothing else written


def test_fused_ops_reject_bad_input(ops) -> None:
    r = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm_(r, None, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.add_rms_norm_(r.half(), None, torch.ones(8).half(), 1e-5)
    with pytest.raises(RuntimeError, match=r"\[T, 2F\]"):
        ops.silu_mul(torch.randn(4, 7))
    kc = torch.zeros(10, 1, 4)
    with pytest.raises(RuntimeError, match="outside the pool of 10 slots"):
        ops.rope_write_kv(torch.randn(2, 12), torch.ones(2, 4), torch.zeros(2, 4), 1, 1, kc, kc.clone(),
                          torch.tensor([0, 10]))
    with pytest.raises(RuntimeError, match="qkv must be"):
        ops.rope_write_kv(torch.randn(2, 16), torch.ones(2, 4), torch.zeros(2, 4), 1, 1, kc, kc.clone(),
                          torch.tensor([0, 1]))


def test_build_survives_a_killed_builder_and_a_missing_path(tmp_path, monkeypatch) -> None:
    # A build killed mid-way leaves torch's lock file: the next load must remove it, not wait on it
    # forever. And the venv's ninja must be found with a PATH that does not include the venv. The
    # build is the real one (load -> _build -> _compile -> torch's cpp_extension and ninja) cut to
    # its smallest source, threads.cpp, so it compiles in seconds instead of a minute; the whole set
    # is compiled by the first test to load the kernels on a fresh machine (as in CI).
    import subprocess
    import sys

    cache = tmp_path / "cache"
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO)\n"
            "from lockgate import kernels as k\n"
            "k.SOURCES = tuple(s for s in k.SOURCES if s.name == 'threads.cpp'); assert len(k.SOURCES) == 1\n"
            "where = k.cache_dir() / k.build_name(); where.mkdir(parents=True); (where / 'lock').write_text('')\n"
            "k.start(); building = k.building()\n"  # the build begins on a side thread; load joins it
            "ok = k.load(); print(ok, building, k.building(), k.error()); import torch; torch.ops.lockgate.bind_threads\n"
            "sys.exit(0 if ok else 1)\n")
    bin_dir = tmp_path / "bin"  # the system's tools (compiler, linker) without any ninja
    bin_dir.mkdir()
    for d in ("/usr/local/bin", "/usr/bin", "/bin"):
        for tool in (p for p in Path(d).glob("*") if p.name != "ninja" and not (bin_dir / p.name).exists()):
            (bin_dir / tool.name).symlink_to(tool)
    env = {**os.environ, "LOCKGATE_CACHE_DIR": str(cache), "PATH": str(bin_dir)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr  # built (a fresh cache: a real compile) and loaded
    assert r.stdout.split()[:3] == ["True", "True", "False"]  # compiling in the background, then done
    assert not any(cache.rglob("lock"))  # the leftover torch lock is gone
    # stderr is a pipe: the build is a start line and a done line (with the units' count), no bar
    assert "compiling lockgate CPU kernels ... (~" in r.stderr and "compiling lockgate CPU kernels: done in" in r.stderr
    assert "\r" not in r.stderr


def test_another_checkout_of_the_same_code_loads_the_same_build(ops, tmp_path) -> None:
    """The build is keyed by content, not place: a copy of the package elsewhere (another clone,
    a worktree) finds the build this session made, loads it without compiling and without
    touching it (ninja would rebuild if a command line named other source paths)."""
    import shutil
    import subprocess
    import sys

    built = kernels.cache_dir() / kernels.build_name()
    assert (built / kernels.BUILT).is_file()
    library = built / f"{kernels.build_name()}.so"
    mtime = library.stat().st_mtime_ns
    shutil.copytree(Path(kernels.__file__).parents[1], tmp_path / "lockgate",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import logging, sys, time; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from lockgate import kernels as k\n"
            "t = time.perf_counter(); ok = k.load(); print('took', time.perf_counter() - t)\n"
            "print(k.__file__, k.build_name(), ok, k.error()); sys.exit(0 if ok else 1)\n")
    # -S: no .pth files, so the editable install's finder cannot send "lockgate" back to this checkout
    site = os.pathsep.join([str(tmp_path), *(p for p in sys.path if p.endswith("site-packages"))])
    env = {**os.environ, "PYTHONPATH": site}
    r = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert str(tmp_path) in r.stdout and kernels.build_name() in r.stdout  # the copy, same build name
    assert "compiling" not in r.stdout and library.stat().st_mtime_ns == mtime


def test_cpu_kernels_off_and_bad_mode(monkeypatch) -> None:
    from lockgate import kernels as k

    assert k.load("off") is False
    monkeypatch.setenv("LOCKGATE_CPU_KERNELS", "0")
    assert k.load("auto") is False
    with pytest.raises(ValueError, match="--cpu-kernels"):
        k.load("sometimes")


def test_kernel_march_override_names_its_own_build_and_rejects_junk(monkeypatch) -> None:
    monkeypatch.delenv(kernels.MARCH_ENV, raising=False)
    native = kernels.build_name()
    assert kernels.march() == "native" and "-march=native" in kernels.cflags()
    monkeypatch.setenv(kernels.MARCH_ENV, "x86-64-v3")
    assert "-march=x86-64-v3" in kernels.cflags()
    assert kernels.build_name() != native  # never the native build's library under another target
    monkeypatch.setenv(kernels.MARCH_ENV, "native; rm -rf /")
    with pytest.raises(ValueError, match="LOCKGATE_KERNEL_MARCH must name a compiler target"):
        kernels.cflags()
    # a target the compiler does not know, and one whose instructions this CPU lacks, are refused
    # before anything is built (a library for another CPU would load and die on its first call)
    monkeypatch.setenv(kernels.MARCH_ENV, "haswel")
    with pytest.raises(ValueError, match="the compiler rejects it"):
        kernels._check_march()
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "fpu sse4_2 avx avx2 fma f16c")  # as an AVX2 CPU
    monkeypatch.setenv(kernels.MARCH_ENV, "x86-64-v4")
    with pytest.raises(ValueError, match="x86-64-v4 needs avx512bw avx512f, which this CPU lacks"):
        kernels._check_march()
    monkeypatch.setenv(kernels.MARCH_ENV, "haswell")
    kernels._check_march()  # within it: accepted
    assert kernels.target_flags("x86-64-v2").isdisjoint({"avx2", "avx512f"})


def test_unity_groups_hold_every_source_once_in_balanced_groups() -> None:
    sources, largest = kernels.SOURCES, max(map(kernels.compile_seconds, kernels.SOURCES))
    assert set(kernels.COMPILE_SECONDS) == {f.name for f in sources}  # every source's cost is known
    for n in (1, 2, 3, len(sources), len(sources) + 5):
        groups = kernels.unity_groups(sources, n)
        assert len(groups) == min(n, len(sources)) and all(groups)
        assert sorted(f for g in groups for f in g) == sorted(sources)  # each source in exactly one unit
        for g in groups:
            assert g == sorted(g, key=sources.index)
        sizes = [sum(map(kernels.compile_seconds, g)) for g in groups]
        assert max(sizes) - min(sizes) <= largest  # no unit waits on another by more than one source


def test_sources_keep_their_names_to_themselves_in_a_unity_build() -> None:
    """A unit includes several sources: a helper in a file-scope anonymous namespace (one shared
    namespace across the unit), a file-scope static or a macro still defined would clash with, or be
    silently picked by, the next source. Each source's helpers live in ``lockgate::<file>_impl``."""
    for src in kernels.SOURCES:
        lines = src.read_text().splitlines()
        for i, line in enumerate(lines):
            if line == "namespace {":
                assert lines[i - 1] in (f"namespace lockgate::{src.stem}_impl {{", f"namespace {src.stem}_impl {{"), \
                    f"{src.name}:{i + 1}: an anonymous namespace outside lockgate::{src.stem}_impl"
            assert not line.startswith("static "), f"{src.name}:{i + 1}: a file-scope static; use {src.stem}_impl"
            if line.startswith("#define "):
                macro = line.split()[1].split("(")[0]
                assert f"#undef {macro}" in lines[i:], f"{src.name}:{i + 1}: {macro} is not #undef'd at the end"


def test_silu_edges_match_torch(ops) -> None:
    # The kernel's exp is its own polynomial: saturated, infinite and tiny gates must still give
    # what torch gives (0 below exp's range, not a tiny non-zero; NaN for -inf * 0).
    g = torch.tensor([[-3.39e38, -200.0, -88.0, -87.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 3.39e38,
                       float("inf"), float("-inf"), float("nan")]])
    gu = torch.cat([g, torch.ones_like(g)], dim=1)
    torch.testing.assert_close(ops.silu_mul(gu), F.silu(g), equal_nan=True, atol=1e-30, rtol=2e-6)
    x = torch.linspace(-87, 0, 100_001).double()  # float32 inputs, the reference computed exactly on them
    # silu(x) / x = sigmoid(x): the exp's relative error shows through (documented: ~2e-7)
    got = ops.silu_mul(torch.cat([x.float()[None], torch.ones(1, x.numel())], dim=1))[0].double()
    want = x * torch.sigmoid(x)
    assert ((got - want).abs() / want.abs().clamp_min(1e-300)).max() < 1e-6


def test_bf16_rounding_keeps_denormals_and_nans(ops) -> None:
    # Where the CPU has AVX512-BF16 the kernels convert 16 floats to bf16 in one instruction, which
    # would flush denormals to zero; vectors holding a denormal or a NaN must round as torch does.
    # silu(32) is 32 in float32, so each lane is 32 * up rounded once: here 2^-128 (a denormal),
    # 1.5 * 32 in a vector of denormals, a NaN in one vector and plain values in another.
    g = torch.full((3, 48), 32.0)
    u = torch.full((3, 48), 2.0 ** -133)  # the least bf16 denormal
    u[0, 3], u[1, 20], u[2] = 1.5, float("nan"), torch.linspace(-3, 3, 48)
    gu = torch.cat([g, u], dim=1).to(torch.bfloat16)
    got, want = ops.silu_mul(gu), F.silu(g.bfloat16()) * u.bfloat16()
    assert want[0, 0].item() == 2.0 ** -128 and want[0, 3].item() == 48.0  # what the lanes must hold
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("form", ["bf16-gemm", "int-gemm"])
def test_decode_layers_halves_give_the_same_bits(ops, form: str) -> None:
    # decode_layers_ with parts = 2 (each thread carries half the sequences through every layer)
    # against parts = 1, at the model's shapes (head size 64: the vector attention and rope paths),
    # with contexts of 1-300 keys (up to three 128-key chunks, merged) and sequences sharing their
    # first 256 slots (a shared prefix: attention groups such sequences, and the halves cut
    # through a group). Bitwise equal, over an odd number of sequences.
    from lockgate.layers.forms import Bf16GemmWeight, IntGemmWeight, bf16_gemm_available, int_gemm_available

    if form == "bf16-gemm" and not bf16_gemm_available():
        pytest.skip("lockgate::bf16_linear is built only for CPUs with AVX512-BF16")
    if form == "int-gemm" and not int_gemm_available():
        pytest.skip("int_linear has no vector path on this CPU")
    dtype = torch.bfloat16 if form == "bf16-gemm" else torch.float32
    g = torch.Generator().manual_seed(5)
    layers, hidden, h, hkv, d, f, b, cap = 2, 576, 9, 3, 64, 1536, 37, 16384

    def weight(n: int, k: int) -> list[torch.Tensor]:
        w = 0.05 * torch.randn(n, k, generator=g)
        kind, args = (Bf16GemmWeight(w.to(torch.bfloat16)) if form == "bf16-gemm"
                      else IntGemmWeight.from_weight(w, 8)).decode_layers_args()
        kinds.append(kind)
        return [*args, torch.empty(0)]

    weights: list[torch.Tensor] = []
    kinds: list[int] = []
    for _ in range(layers):
        weights += [(1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype) for _ in range(2)]
        for n, k in (((h + 2 * hkv) * d, hidden), (hidden, h * d), (2 * f, hidden), (hidden, f)):
            weights += weight(n, k)
    lens = torch.randint(1, 300, (b,), generator=g)
    lens[10:20] = 256 + torch.arange(1, 11)  # ten sequences on one 256-slot prefix, then their own
    prefix = torch.arange(256)
    own = torch.randperm(cap - 256 - b, generator=g)[:int(lens.sum())] + 256
    new_slots = torch.arange(cap - b, cap)
    ctx, used = [], 0
    for s, n in enumerate(lens.tolist()):
        mine = prefix if 10 <= s < 20 else torch.empty(0, dtype=torch.long)
        rest = own[used:used + n - len(mine) - 1]
        used += len(rest)
        ctx.append(torch.cat([mine, rest, new_slots[s:s + 1]]))
    slots = torch.cat(ctx)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    kc = torch.randn(layers, cap, hkv, d, generator=g).to(dtype)
    vc = torch.randn(layers, cap, hkv, d, generator=g).to(dtype)
    x = torch.randn(b, hidden, generator=g).to(dtype)
    cos, sin = torch.randn(b, d, generator=g).to(dtype), torch.randn(b, d, generator=g).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = []
        for parts in (1, 2):
            k1, v1, x1 = kc.clone(), vc.clone(), x.clone()
            with torch.inference_mode():
                ops.decode_layers_(x1, cos, sin, k1, v1, new_slots, slots, offsets, None, weights, kinds, h, hkv,
                                   1e-5, 0.125, parts)
            got.append((x1, k1, v1))
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(got[0][0], x)  # the layers ran
    for a, c in zip(*got, strict=True):
        assert torch.equal(a, c)


def test_decode_layers_rejects_mismatched_weights(ops) -> None:
    # The one-call decode path takes a flat list of tensors; a wrong one must raise, not read past
    # the end of a buffer (torch's int4 kernel does not check its scales' first dimension).
    from lockgate.layers.forms import Int4Weight

    torch.manual_seed(0)
    hidden, h, hkv, d, f = 64, 4, 2, 16, 128
    kc = torch.zeros(1, 32, hkv, d)
    vc = torch.zeros(1, 32, hkv, d)

    def int4(n: int, k: int) -> list[torch.Tensor]:
        q = Int4Weight.from_weight(torch.randn(n, k), torch.bfloat16)
        return [q.packed, q.scales_zeros, torch.empty(0), torch.empty(0)]

    good = [torch.ones(hidden), torch.ones(hidden), *int4((h + 2 * hkv) * d, hidden), *int4(hidden, h * d),
            *int4(2 * f, hidden), *int4(hidden, f)]
    args = (torch.zeros(1, d), torch.zeros(1, d), kc, vc, torch.tensor([3]), torch.tensor([3]), torch.tensor([0, 1]),
            None)
    out = ops.decode_layers_(torch.randn(1, hidden), *args, good, [0, 0, 0, 0], h, hkv, 1e-5, 0.25)
    assert out.shape == (1, hidden) and torch.isfinite(out).all()
    bad = list(good)
    bad[3] = bad[3][:1].contiguous()  # qkv scales for one group instead of two
    with pytest.raises(RuntimeError, match="scales_and_zeros"):
        ops.decode_layers_(torch.randn(1, hidden), *args, bad, [0, 0, 0, 0], h, hkv, 1e-5, 0.25)
    with pytest.raises(RuntimeError, match="expected 18 tensors"):
        ops.decode_layers_(torch.randn(1, hidden), *args, good[:-1], [0, 0, 0, 0], h, hkv, 1e-5, 0.25)
    with pytest.raises(RuntimeError, match="positive"):
        ops.decode_layers_(torch.randn(1, hidden), *args, good, [0, 0, 0, 0], h, 0, 1e-5, 0.25)
    with pytest.raises(RuntimeError, match="parts must be 1 or 2, got 3"):
        ops.decode_layers_(torch.randn(1, hidden), *args, good, [0, 0, 0, 0], h, hkv, 1e-5, 0.25, 3)
    with pytest.raises(RuntimeError, match="parts = 2 takes decode steps only"):  # halves of a prompt step: no
        ops.decode_layers_(torch.randn(1, hidden), *args[:-1], torch.tensor([0, 1]), good, [0, 0, 0, 0], h, hkv,
                           1e-5, 0.25, 2)
    with pytest.raises(RuntimeError, match="one row"):  # 2 rows, 1 sequence, no q_offsets
        ops.decode_layers_(torch.randn(2, hidden), torch.zeros(2, d), torch.zeros(2, d), kc, vc,
                           torch.tensor([3, 4]), torch.tensor([3, 4]), torch.tensor([0, 2]), None, good, [0, 0, 0, 0],
                           h, hkv, 1e-5, 0.25)
    with pytest.raises(RuntimeError, match="positive multiple of kv heads"):
        ops.decode_attention(torch.randn(1, 4, 16), torch.zeros(8, 0, 16), torch.zeros(8, 0, 16),
                             torch.tensor([0]), torch.tensor([0, 1]), 1.0)


# ---- int_linear (int_gemm.cpp): int16 x int4/int8 groupwise GEMM (AVX512-VNNI, AVX512BW, AVX2) ----

def _int_gemm_case(bits: int, n: int, k: int, seed: int):
    """A weight on a 4- or 8-bit grid of 32 columns, its IntGemmWeight, and the float weight."""
    from lockgate.layers.forms import IntGemmWeight

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    q = IntGemmWeight.from_weight(w, bits)
    return q, q.dequantize(n, k)


def _int_gemm_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The largest error int_linear may make on y = x w^T: x is rounded to int16 per row and block of
    32 columns (half a step of block-absmax / 32767 per element, plus float rounding of the scale),
    then float32 scaling and summation (relative 1e-5 of sum |x| |w|)."""
    m, k = x.shape
    step = x.abs().view(m, k // 32, 32).amax(-1, keepdim=True).expand(m, k // 32, 32).reshape(m, k) / 32767
    return (0.51 * step.double()) @ w.abs().double().t() + 1e-5 * (x.abs().double() @ w.abs().double().t()) + 1e-7


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (80, 288), (960, 576), (48, 544)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 130])
def test_int_linear_within_its_rounding_of_x(ops, bits: int, n: int, k: int, m: int) -> None:
    # Shapes cover every tile remainder: output rows 16 / 32 / 48 per tile (80 = 48 + 32), column
    # blocks of 256 with a shorter last one (288, 544), x rows 4 per block with 1-3 left over and
    # more than one 128-row chunk (130). The reference is float64 on the dequantized weight.
    q, w = _int_gemm_case(bits, n, k, seed=n + k + m)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4  # columns of unequal size
    x[0, :32] = 0  # an all-zero block: scale 0, no NaN
    got = ops.int_linear(x, q.packed, q.scales, q.zeros, bits)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    err = (got.double() - want).abs()
    bound = _int_gemm_bound(x, w)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    assert err.max() > 0 or not x.any()  # int16 rounding of x is visible: not a float GEMM in disguise


def test_int_linear_is_finer_than_bf16_activations(ops) -> None:
    # The reason the large-call path uses it: x rounded to int16 per block moves y far less than
    # x rounded to bf16 (what torch's int4 kernel takes).
    q, w = _int_gemm_case(4, 960, 576, seed=3)
    x = torch.randn(64, 576) * 3
    want = x.double() @ w.double().t()
    ours = (ops.int_linear(x, q.packed, q.scales, q.zeros, 4).double() - want).abs().mean()
    bf16 = (x.bfloat16().double() @ w.double().t() - want).abs().mean()
    assert ours < bf16 / 10  # measured: 24x smaller


def test_int_linear_result_does_not_depend_on_threads(ops) -> None:
    q, _ = _int_gemm_case(4, 960, 576, seed=4)
    x = torch.randn(200, 576)  # two chunks of rows
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.int_linear(x, q.packed, q.scales, q.zeros, 4)
        torch.set_num_threads(2)
        two = ops.int_linear(x, q.packed, q.scales, q.zeros, 4)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    # and no row depends on the others: a row alone gives the same numbers
    assert torch.equal(ops.int_linear(x[7:8].contiguous(), q.packed, q.scales, q.zeros, 4), one[7:8])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 6, 7, 130])
def test_int_linear_on_16_bit_x_is_the_float32_call_rounded_once(ops, dtype: torch.dtype, bits: int, m: int) -> None:
    # A 16-bit x is widened exactly inside the kernel and the biased float32 result rounded once to
    # x's dtype: bitwise what widening, calling on float32, adding the bias and casting give (the
    # conversions a 16-bit model's every call used to make around the kernel). Row counts cover the
    # few-row path (1-6) and the tiled one; a NaN in x stays a NaN in its row.
    q, _ = _int_gemm_case(bits, 80, 288, seed=7 * m + bits)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 288, generator=g) * 3).to(dtype)
    x[-1, 5] = float("nan")
    bias = torch.randn(80, generator=g).to(dtype)
    for fn in (ops.int_linear, ops.int_linear_reference):
        want = (fn(x.float(), q.packed, q.scales, q.zeros, bits) + bias).to(dtype)
        got = fn(x, q.packed, q.scales, q.zeros, bits, bias)
        assert got.dtype == dtype and got.shape == (m, 80)
        assert torch.equal(got[:-1], want[:-1])
        assert got[-1].isnan().all() and want[-1].isnan().all()
        plain = fn(x[:-1], q.packed, q.scales, q.zeros, bits)  # no bias
        assert torch.equal(plain, fn(x[:-1].float(), q.packed, q.scales, q.zeros, bits).to(dtype))
    # float32 x with a 16-bit bias, a 16-bit x with a float32 bias: the float32 sum, as y + bias
    xf, bias32 = x[:-1].float(), torch.randn(80, generator=g)
    assert torch.equal(ops.int_linear(xf, q.packed, q.scales, q.zeros, bits, bias),
                       ops.int_linear(xf, q.packed, q.scales, q.zeros, bits) + bias)
    assert torch.equal(ops.int_linear(x[:-1], q.packed, q.scales, q.zeros, bits, bias32),
                       (ops.int_linear(xf, q.packed, q.scales, q.zeros, bits) + bias32).to(dtype))
    if dtype == torch.float16 and m > 1:  # sums past float16's range: inf, as the cast gives
        big, near_max = (x[:-1].float() * 1000).to(dtype), torch.full((80,), 65000.0, dtype=dtype)
        want = (ops.int_linear(big.float(), q.packed, q.scales, q.zeros, bits) + near_max).to(dtype)
        got = ops.int_linear(big, q.packed, q.scales, q.zeros, bits, near_max)
        assert want.isinf().any() and want.isfinite().any() and torch.equal(got, want)


@pytest.mark.parametrize(("n", "k"), [(16, 32), (80, 288), (960, 576), (48, 544)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 130])
def test_int_linear_int8_activations(ops, n: int, k: int, m: int) -> None:
    # --activation-quant int8 (act_bits 8) on 4-bit codes: x rounded to int8 per row and 32 columns.
    # The vector path (AVX2: byte dot products; elsewhere the int16 ones on the same values) gives
    # the plain C++ path's bits, within the bound of that rounding (half a step of absmax / 127),
    # each row's result independent of the call's other rows (the tier's determinism promise).
    q, w = _int_gemm_case(4, n, k, seed=n + k + m + 1)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4
    x[0, :32] = 0
    got = ops.int_linear(x, q.packed, q.scales, q.zeros, 4, None, 8)
    assert torch.equal(got, ops.int_linear_reference(x, q.packed, q.scales, q.zeros, 4, None, 8))
    want = x.double() @ w.double().t()
    step = x.abs().view(m, k // 32, 32).amax(-1, keepdim=True).expand(m, k // 32, 32).reshape(m, k) / 127
    # the rounding of x meets code * step = w - low, at most the group's range: 2 max |w|
    span = 2 * w.abs().view(n, k // 32, 32).amax(-1, keepdim=True).expand(n, k // 32, 32).reshape(n, k)
    bound = (0.51 * step.double()) @ span.double().t() + 1e-5 * (x.abs().double() @ span.double().t()) + 1e-7
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    fine = (ops.int_linear(x, q.packed, q.scales, q.zeros, 4).double() - want).abs()
    assert err.mean() > 20 * fine.mean() or not x[1:].any()  # coarser than int16 x: the tier is really on
    assert torch.equal(ops.int_linear(x[-1:].contiguous(), q.packed, q.scales, q.zeros, 4, None, 8), got[-1:])


def test_int_linear_int8_activations_do_not_depend_on_threads(ops) -> None:
    q, _ = _int_gemm_case(4, 960, 576, seed=6)
    x = torch.randn(200, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [ops.int_linear(x[:r].contiguous(), q.packed, q.scales, q.zeros, 4, None, 8) for r in (1, 3, 200)]
        torch.set_num_threads(2)
        two = [ops.int_linear(x[:r].contiguous(), q.packed, q.scales, q.zeros, 4, None, 8) for r in (1, 3, 200)]
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(one[0], one[2][:1]) and torch.equal(one[1], one[2][:3])
    with pytest.raises(RuntimeError, match="act_bits must be 16 or 8"):
        ops.int_linear(x, q.packed, q.scales, q.zeros, 4, None, 4)


def test_int_linear_rejects_bad_input(ops) -> None:
    q, _ = _int_gemm_case(4, 48, 64, seed=5)
    x = torch.randn(2, 64)
    assert ops.int_linear(torch.zeros(0, 64), q.packed, q.scales, q.zeros, 4).shape == (0, 48)
    with pytest.raises(RuntimeError, match="contiguous float32, bfloat16 or float16"):
        ops.int_linear(x.double(), q.packed, q.scales, q.zeros, 4)
    with pytest.raises(RuntimeError, match="contiguous float32, bfloat16 or float16"):
        ops.int_linear(torch.randn(64, 2).t(), q.packed, q.scales, q.zeros, 4)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32, bfloat16 or float16 \[N\] = \[48\]"):
        ops.int_linear(x, q.packed, q.scales, q.zeros, 4, torch.zeros(47))
    for bad in (torch.zeros(48, dtype=torch.int32), torch.zeros(48, dtype=torch.float64), torch.zeros(96)[::2]):
        with pytest.raises(RuntimeError, match="bias must be contiguous float32, bfloat16 or float16"):
            ops.int_linear(x, q.packed, q.scales, q.zeros, 4, bad)
    with pytest.raises(RuntimeError, match="not a positive multiple of 32"):
        ops.int_linear(torch.randn(2, 48), q.packed, q.scales, q.zeros, 4)
    with pytest.raises(RuntimeError, match="not a positive multiple of 32"):
        ops.int_linear(torch.randn(2, 0), q.packed[:, :0].contiguous(), q.scales[:, :0].contiguous(),
                       q.zeros[:, :0].contiguous(), 4)
    with pytest.raises(RuntimeError, match="packed must be contiguous uint8"):
        ops.int_linear(x, q.packed.view(torch.int8), q.scales, q.zeros, 4)  # right shape, wrong dtype
    q8, _ = _int_gemm_case(8, 48, 64, seed=6)
    with pytest.raises(RuntimeError, match="zeros must be contiguous, of the scales' shape and dtype"):
        ops.int_linear(x, q8.packed, q8.scales, q.zeros.float(), 8)  # (zeros at 8 bits: Q5_K's lows)
    with pytest.raises(RuntimeError, match="factored scales need K % 256 == 0"):
        ops.int_linear(x, q8.packed, torch.zeros(3, 64, dtype=torch.uint8), None, 8)
    with pytest.raises(RuntimeError, match=r"packed must be contiguous uint8 \[N / 16, K / 4, 32\]"):
        ops.int_linear(torch.randn(2, 128), q.packed, q.scales, q.zeros, 4)
    with pytest.raises(RuntimeError, match="zeros are required"):
        ops.int_linear(x, q.packed, q.scales, None, 4)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.int_linear(x, q.packed, q.scales[:1].contiguous(), q.zeros, 4)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        ops.int_linear(x, q.packed, q.scales, q.zeros, 3)


def _build_target_flags() -> set[str]:
    """The instruction sets the kernels were compiled for, in /proc/cpuinfo's names: the CPU's own
    flags for -march=native, else what the compiler defines for $LOCKGATE_KERNEL_MARCH."""
    if kernels.march() == "native":
        return set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    return kernels.target_flags(kernels.march())


def test_int_linear_builds_the_vector_path_the_cpu_has(ops) -> None:
    # Built with -march=native: the widest path the CPU can run must be compiled in (else large
    # float32 calls would silently fall back to the scalar loop); with $LOCKGATE_KERNEL_MARCH, the
    # widest that target has.
    flags = _build_target_flags()
    if {"avx512bw", "avx512_vnni"} <= flags:
        want = "avx512-vnni"
    elif "avx512bw" in flags:
        want = "avx512bw"
    elif {"avx2", "fma", "f16c", "avx_vnni"} <= flags:
        want = "avx2-vnni"
    elif {"avx2", "fma", "f16c"} <= flags:
        want = "avx2"
    else:
        want = "generic"
    assert ops.int_linear_isa() == want
    assert ops.int_linear_vectorized() == (want != "generic")


@pytest.mark.parametrize("bits", [4, 8])
def test_int_linear_vector_path_equals_the_plain_path(ops, bits: int) -> None:
    # The plain C++ loops (what a CPU without AVX2 runs) do the same arithmetic in the same order:
    # the two give the same numbers, on every tile and row remainder, and on the few-row path
    # (1-6 rows: run_gemv; on AVX-512 16-row blocks shared between threads in tiles of 4 (2
    # beyond 3 rows), on AVX2 passes of at most 3 rows over tiles of 1-2 blocks, plus what is
    # left over). Whatever vector path this CPU builds (int_linear_isa) is held to this.
    for n, k, m in ((80, 288, 130), (16, 32, 3), (960, 576, 9), (960, 576, 1), (112, 96, 2), (80, 288, 3),
                    (3072, 64, 1), (112, 96, 4), (80, 288, 5), (960, 576, 6), (48, 64, 6), (16, 32, 5), (960, 576, 7)):
        q, _ = _int_gemm_case(bits, n, k, seed=n * m)
        x = torch.randn(m, k) * 2
        assert torch.equal(ops.int_linear(x, q.packed, q.scales, q.zeros, bits),
                           ops.int_linear_reference(x, q.packed, q.scales, q.zeros, bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_int_linear_non_finite_and_tiny_x(ops, bits: int) -> None:
    # NaN or inf in a row makes that row NaN (as F.linear would), never a silently finite result,
    # and leaves the other rows alone; a block of values below 1e-30 counts as zeros.
    q, w = _int_gemm_case(bits, 48, 64, seed=7)
    x = torch.randn(4, 64)
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3, :32] = 1e-35
    got = ops.int_linear(x, q.packed, q.scales, q.zeros, bits)
    assert got[1].isnan().all() and got[2].isnan().all()
    good = x[[0, 3]].clone()
    good[1, :32] = 0
    want = good.double() @ w.double().t()
    assert ((got[[0, 3]].double() - want).abs() <= _int_gemm_bound(good, w)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_follows_torch_argmax(ops, dtype: torch.dtype) -> None:
    """Greedy sampling's argmax: the same index as torch.argmax, including its rules for equal
    values (the first), NaN (the first NaN) and all -inf rows (0), on rows of any length (the
    16-lane vector part and the scalar tail) and with a row stride wider than the row."""
    g = torch.Generator().manual_seed(4)
    for v in (1, 5, 16, 17, 100, 49152):
        x = torch.randn(9, v, generator=g).to(dtype)
        if v >= 5:
            x[1, 2] = x[1, v - 1] = x[1].max() + 1  # a tie: the first wins
            x[2, v - 1] = float("nan")  # a NaN in the tail (or the only vector)
            x[3, 0] = x[3, v // 2] = float("nan")  # two NaNs: the first
            x[4] = float("-inf")
            x[5, 3] = float("inf")
            x[6] = 0.0  # all equal: index 0
        if v >= 32:
            x[7, 2] = x[7, 18] = x[7].max() + 1  # a tie within one of the 16 lanes: the first wins
            x[8, 18] = x[8, 3] = x[8].max() + 1  # and across lanes: the smaller index
        got = ops.argmax_rows(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), (v, got, x.argmax(dim=-1))
    wide = torch.randn(4, 80, generator=g).to(dtype)[:, :64]  # rows 80 apart
    assert torch.equal(ops.argmax_rows(wide), wide.argmax(dim=-1))
    assert ops.argmax_rows(torch.zeros(0, 7, dtype=dtype)).shape == (0,)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.argmax_rows(torch.zeros(3, 4, dtype=dtype).t())


def test_work_stealing_computes_every_row_once(ops) -> None:
    """The row loops under steal.h's steal_for (silu_mul, add_rms_norm_, argmax_rows): with 8
    threads on this machine's cores, threads lose their core mid-call and the others take their
    unstarted pieces; every row is still computed exactly once, the same bits as on one thread, at
    row counts that split unevenly (a worker with no rows, a piece of one row)."""
    before = torch.get_num_threads()
    try:
        for rows in (3, 7, 17, 100, 999):
            gen = torch.Generator().manual_seed(rows)
            gu = torch.randn(rows, 2 * 1536, generator=gen).to(torch.bfloat16)
            resid = torch.randn(rows, 576, generator=gen)
            delta = torch.randn(rows, 576, generator=gen)
            w = torch.rand(576, generator=gen) + 0.5
            logits = torch.randn(rows, 4099, generator=gen).to(torch.bfloat16)
            torch.set_num_threads(1)
            want_silu = ops.silu_mul(gu)
            want_resid = resid.clone()
            want_norm = ops.add_rms_norm_(want_resid, delta, w, 1e-5)
            want_arg = ops.argmax_rows(logits)
            assert torch.equal(want_arg, logits.float().argmax(-1))
            torch.set_num_threads(8)
            for _ in range(3):
                assert torch.equal(ops.silu_mul(gu), want_silu)
                r = resid.clone()
                assert torch.equal(ops.add_rms_norm_(r, delta, w, 1e-5), want_norm) and torch.equal(r, want_resid)
                assert torch.equal(ops.argmax_rows(logits), want_arg)
    finally:
        torch.set_num_threads(before)


def test_cpus_to_pin_pins_only_threads_that_fill_the_process_cpus() -> None:
    # The scheduler process pins torch's threads one per CPU only when they are as many as the CPUs
    # it may use (2 or more), and LOCKGATE_PIN_THREADS=0 turns it off.
    from lockgate.engine.process import cpus_to_pin

    assert cpus_to_pin(2, {0, 1}, None) == [0, 1]
    assert cpus_to_pin(4, {5, 1, 3, 2}, "1") == [1, 2, 3, 5]
    assert cpus_to_pin(2, {0, 1}, "0") is None  # opted out
    assert cpus_to_pin(2, {0, 1, 2, 3}, None) is None  # serve --dp: a replica's share of the cores
    assert cpus_to_pin(1, {0}, None) is None  # one thread: nothing to keep apart
    with pytest.raises(ValueError, match="LOCKGATE_PIN_THREADS must be 0 or 1, got 'no'"):
        cpus_to_pin(2, {0, 1}, "no")  # not silently read as "pin"


PIN_CHILD = """
import os, sys, torch
from lockgate import kernels
assert kernels.load(), kernels.error()
cpus = sorted(os.sched_getaffinity(0))[:2]
torch.set_num_threads(2)
for bad, what in (([cpus[0]], "one CPU per torch thread"), ([cpus[0], cpus[0]], "distinct")):
    try:
        torch.ops.lockgate.bind_threads(bad)
    except RuntimeError as e:
        assert what in str(e), e
    else:
        raise AssertionError(f"bind_threads({bad}) did not raise")
tids = torch.ops.lockgate.bind_threads(cpus)
assert len(tids) == 2 and len(set(tids)) == 2 and os.getpid() in tids, tids  # the caller is thread 0
got = [open(f"/proc/self/task/{t}/status").read().split("Cpus_allowed_list:")[1].split()[0] for t in tids]
assert got == [str(c) for c in cpus], (got, cpus)
x = torch.randn(300, 300)
assert torch.allclose(x @ x, (x.double() @ x.double()).float(), atol=1e-3)  # the pinned pool still works
print("pinned", got)
"""


def test_bind_threads_pins_each_torch_thread_to_its_own_cpu(ops) -> None:
    # In a child process (pinning is for a whole process's life): two torch threads, each pinned
    # to one of the first two CPUs this process may use, checked in /proc; wrong CPU lists raise.
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("pinning two threads needs two CPUs; this process may use one")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", PIN_CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pinned" in out.stdout


# ---- f32_linear (f32_gemm.cpp) ----

@pytest.mark.parametrize(("n", "k"), [(960, 576), (13, 77), (49, 1536), (6, 16)])  # tails in N and K; one tile
@pytest.mark.parametrize("bias", [False, True])
def test_f32_linear_is_the_product_and_row_invariant(ops, n: int, k: int, bias: bool) -> None:
    """Every output is x . w (+ b) within float32 summation error (against float64), and a row's
    bits never depend on how many rows share the call, which rows they are, or the thread count."""
    assert ops.f32_linear_available(), "x86-64 CPUs the suite runs on have AVX2 + FMA"
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(130, k, generator=g)
    full = ops.f32_linear(x, w, b)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    torch.testing.assert_close(full.double(), want, atol=1e-4 * k ** 0.5, rtol=1e-5)
    for m in (1, 2, 3, 4, 5, 7, 9, 16, 33):
        for start in (0, 130 - m):
            got = ops.f32_linear(x[start:start + m].contiguous(), w, b)
            assert torch.equal(got, full[start:start + m]), (m, start)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.f32_linear(x, w, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, full)
    assert ops.f32_linear(x[:0].contiguous(), w, b).shape == (0, n)


def test_f32_linear_rejects_bad_input(ops) -> None:
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="float32 x and weight"):
        ops.f32_linear(torch.randn(2, 16, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and weight \[N, K\]"):
        ops.f32_linear(torch.randn(2, 15), w, None)
    with pytest.raises(RuntimeError, match="contiguous x and weight"):
        ops.f32_linear(torch.randn(16, 2).T, w, None)
    with pytest.raises(RuntimeError, match=r"float32 bias \[N\]"):
        ops.f32_linear(torch.randn(2, 16), w, torch.randn(7))
