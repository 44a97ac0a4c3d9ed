"""Eviction kernels: torch reference vs slow obvious references; Triton vs the torch reference.

Tolerances (max abs error; outputs are O(1)):
- torch reference vs the float64 slow reference, fp32 inputs: 1e-5.
- Triton vs torch reference (which computes in fp32 from the same inputs):
  fp32 atol = rtol = 1e-5; fp16 atol = rtol = 2e-3 (probabilities and outputs rounded to fp16);
  bf16 atol = rtol = 2e-2 (CUDA only: the Triton interpreter does not support bf16 ``tl.dot``, it
  multiplies the raw bit patterns, triton-lang/triton#11584); compact_kv is exact in every dtype.

Triton tests run on CPU under ``TRITON_INTERPRET=1`` in a child pytest process
(``test_triton_kernels_under_interpreter``): the interpreter must be chosen before triton itself is
imported (triton's own library functions are decorated at import), so it cannot be switched on inside
a process that may already hold a compiled-mode triton, and must not leak into other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvdiag import kernels
from kvdiag.cli.main import app, main
from kvdiag.core.errors import UserError
from kvdiag.kernels import torch_ref
from kvdiag.kernels.bench import run_kernel_bench

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def slow_shared_prefix_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, exclude, scale,
                                 window=None, softcap=None, sinks=None):
    """Per row and KV head: physically delete the excluded prefix entries, append the row's suffix,
    causal softmax attention in float64. exclude [N, Hkv, E] (-1 = none). Positions are absolute (prefix
    entry i at i, the suffix right after the prefix) and survive the deletion: with a ``window`` the query at
    position tau sees keys at positions > tau - window; ``softcap`` c: logits c·tanh(l/c); ``sinks [H]``:
    one extra logit per query head, appended to the softmax and dropped."""
    N, H, W, d = q.shape
    Hkv, P, _ = prefix_k.shape
    S = suffix_k.shape[2]
    g = H // Hkv
    out = torch.empty(N, H, W, d, dtype=torch.float64)
    for n in range(N):
        for kv in range(Hkv):
            gone = set(exclude[n, kv].tolist()) - {-1}
            kept = torch.tensor([i for i in range(P) if i not in gone], dtype=torch.long)
            k = torch.cat([prefix_k[kv, kept], suffix_k[n, kv]]).double()
            v = torch.cat([prefix_v[kv, kept], suffix_v[n, kv]]).double()
            key_pos = torch.cat([kept, P + torch.arange(S)])
            # query w sits at position P + S - W + w and sees every entry up to itself (within the window)
            own = P + S - W + torch.arange(W)
            hidden = key_pos[None, :] > own[:, None]
            if window is not None:
                hidden |= key_pos[None, :] <= own[:, None] - window
            for h in range(kv * g, (kv + 1) * g):
                logits = q[n, h].double() @ k.T * scale
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                logits = logits.masked_fill(hidden, float("-inf"))
                if sinks is not None:
                    logits = torch.cat([logits, torch.full((W, 1), float(sinks[h]), dtype=torch.float64)], -1)
                    out[n, h] = logits.softmax(-1)[:, :-1] @ v
                else:
                    out[n, h] = logits.softmax(-1) @ v
    return out


def rand_case(N, H, Hkv, W, S, P, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return r(N, H, W, d), r(Hkv, P, d), r(Hkv, P, d), r(N, Hkv, S, d), r(N, Hkv, S, d)


def exclusions(kind, N, Hkv, P, seed=0):
    """Exclusion tensors of every accepted form: None, [N, 0], [N, E], [N, Hkv, E], with -1 and repeats."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "empty":
        return torch.empty(N, 0, dtype=torch.long)
    if kind == "all_minus_one":
        return torch.full((N, 3), -1)
    if kind == "shared":
        ex = torch.randint(0, P, (N, 4), generator=gen)
        ex[0, 1] = ex[0, 0]  # a repeat
        ex[-1, 2] = -1
        return ex
    if kind == "per_head":
        ex = torch.randint(-1, P, (N, Hkv, 3), generator=gen)
        ex[0, 0] = torch.tensor([0, 0, P - 1])  # first and last entry, repeated
        return ex
    if kind in ("set", "per_head_set"):  # decisions' set rows: more than SCATTER_MAX_E entries (the mask path)
        e = max(torch_ref.SCATTER_MAX_E + 1, P // 2)
        heads = 1 if kind == "set" else Hkv
        ex = torch.stack([torch.stack([torch.randperm(P, generator=gen)[:e] for _ in range(heads)]) for _ in range(N)])
        ex[0, 0, :3] = torch.tensor([0, 0, -1])  # a repeat and padding inside a set
        if N > 1:
            ex[1, :, e // 2 :] = -1  # rows of one batch evict sets of different sizes
        return ex[:, 0] if kind == "set" else ex
    raise ValueError(kind)


# ---- torch reference -----------------------------------------------------------------------------

SHAPES = {  # N, H, Hkv, W, S, P, d
    "gqa": (4, 6, 2, 5, 5, 37, 16),
    "gqa_9_3_w1": (3, 9, 3, 1, 1, 50, 32),
    "mha_long_suffix": (3, 4, 4, 3, 7, 20, 8),  # S > W: queries are the last W suffix positions
    "mqa": (2, 4, 1, 4, 4, 11, 16),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["none", "empty", "all_minus_one", "shared", "per_head", "set", "per_head_set"])
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_torch_shared_prefix_attention_equals_physical_deletion(shape, kind, chunk):
    N, H, Hkv, W, S, P, d = SHAPES[shape]
    q, pk, pv, sk, sv = rand_case(N, H, Hkv, W, S, P, d)
    ex = exclusions(kind, N, Hkv, P)
    out = kernels.shared_prefix_attention(q, pk, pv, sk, sv, ex, 0.3, backend="torch", chunk=chunk)
    want = slow_shared_prefix_attention(q, pk, pv, sk, sv, kernels.normalize_exclude(ex, N, Hkv, q.device), 0.3)
    assert out.dtype == q.dtype and out.shape == (N, H, W, d)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_torch_shared_prefix_attention_edges():
    N, H, Hkv, W, S, P, d = 2, 4, 2, 3, 3, 6, 8
    q, pk, pv, sk, sv = rand_case(N, H, Hkv, W, S, P, d, seed=1)
    # a row that excludes the whole prefix attends to its suffix only
    everything = torch.arange(P).expand(N, P)
    out = kernels.shared_prefix_attention(q, pk, pv, sk, sv, everything, 0.5, backend="torch")
    alone = kernels.shared_prefix_attention(q, pk[:, :0], pv[:, :0], sk, sv, None, 0.5, backend="torch")
    torch.testing.assert_close(out, alone, atol=1e-6, rtol=1e-6)
    # a huge logit on an excluded entry must not leak (the -inf mask, not a large negative number)
    spiky = pk.clone()
    spiky[:, 2] = 1e4 * q[0, 0, 0]
    ex = torch.full((N, 1), 2)
    out = kernels.shared_prefix_attention(q, spiky, pv, sk, sv, ex, 0.5, backend="torch")
    torch.testing.assert_close(out, kernels.shared_prefix_attention(q, pk, pv, sk, sv, ex, 0.5, backend="torch"))
    # default scale is d ** -0.5; low-precision inputs come back in their dtype
    half = [t.half() for t in (q, pk, pv, sk, sv)]
    out = kernels.shared_prefix_attention(*half, ex)
    assert out.dtype == torch.float16
    want = slow_shared_prefix_attention(*half, kernels.normalize_exclude(ex, N, Hkv, q.device), d**-0.5)
    torch.testing.assert_close(out.double(), want, atol=TOL[torch.float16], rtol=TOL[torch.float16])


# layer semantics (kvdiag.model.adapters.LayerAttention): window (None / 1 / inside the prefix / beyond it), softcap,
# sinks
SEMANTICS = {
    "window_1": dict(window=1), "window_7": dict(window=7), "window_wide": dict(window=1000),
    "softcap": dict(softcap=2.0), "sinks": dict(sinks="large"), "all": dict(window=9, softcap=3.0, sinks="large"),
}


def semantics(name, H, seed=0):
    sem = dict(SEMANTICS[name])
    if sem.get("sinks") == "large":  # GPT-OSS-like sink logits of 3..5: they take real mass
        sem["sinks"] = 3 + 2 * torch.rand(H, generator=torch.Generator().manual_seed(seed))
    return sem


@pytest.mark.parametrize("shape", ["gqa", "mha_long_suffix"])
@pytest.mark.parametrize("name", SEMANTICS)
@pytest.mark.parametrize("chunk", [None, 1])
def test_torch_shared_prefix_attention_semantics_equal_physical_deletion(shape, name, chunk):
    N, H, Hkv, W, S, P, d = SHAPES[shape]
    q, pk, pv, sk, sv = rand_case(N, H, Hkv, W, S, P, d)
    q = q * 3  # peaked logits, so that a softcap of 2-3 changes them
    ex = kernels.normalize_exclude(exclusions("per_head", N, Hkv, P), N, Hkv, q.device)
    sem = semantics(name, H)
    out = kernels.shared_prefix_attention(q, pk, pv, sk, sv, ex, 0.3, backend="torch", chunk=chunk, **sem)
    want = slow_shared_prefix_attention(q, pk, pv, sk, sv, ex, 0.3, **sem)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    plain = slow_shared_prefix_attention(q, pk, pv, sk, sv, ex, 0.3)
    if name != "window_wide":
        assert (want - plain).abs().max() > 1e-3  # the semantics matter in this case


def test_window_makes_excluding_an_invisible_entry_a_no_op():
    """An entry outside the window of every query: excluding it changes nothing, bit for bit."""
    N, H, Hkv, W, S, P, d = 1, 4, 2, 3, 3, 30, 16
    q, pk, pv, sk, sv = rand_case(N, H, Hkv, W, S, P, d)
    # the first query sits at P = 30 and sees keys > 30 - 8 = 22
    a = kernels.shared_prefix_attention(q, pk, pv, sk, sv, None, 0.3, backend="torch", window=8)
    b = kernels.shared_prefix_attention(q, pk, pv, sk, sv, torch.tensor([[22]]), 0.3, backend="torch", window=8)
    c = kernels.shared_prefix_attention(q, pk, pv, sk, sv, torch.tensor([[23]]), 0.3, backend="torch", window=8)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_torch_shared_prefix_attention_reads_the_prefix_in_place():
    """The prefix is never copied per row: no intermediate comes near N copies of it."""
    N, H, Hkv, W, S, P, d = 8, 4, 2, 2, 2, 512, 16
    q, pk, pv, sk, sv = rand_case(N, H, Hkv, W, S, P, d)
    with torch.profiler.profile(profile_memory=True) as prof:
        kernels.shared_prefix_attention(q, pk, pv, sk, sv, torch.zeros(N, 1, dtype=torch.long), 0.3, backend="torch")
    # largest legitimate intermediate: the logits [Hkv, N*g*W, P] = N*Hkv*P*16 bytes here
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < biggest < N * Hkv * P * d * 4 / 2


def test_compact_kv_torch():
    keys, values = torch.randn(3, 40, 8), torch.randn(3, 40, 8)
    keep = torch.stack([torch.randperm(40)[:17].sort().values for _ in range(3)])
    k, v = kernels.compact_kv(keys, values, keep, backend="torch")
    assert torch.equal(k, torch.stack([keys[h][keep[h]] for h in range(3)]))
    assert torch.equal(v, torch.stack([values[h][keep[h]] for h in range(3)]))
    k, _ = kernels.compact_kv(keys.half(), values.half(), keep[:, :0], backend="torch")
    assert k.shape == (3, 0, 8) and k.dtype == torch.float16


# ---- dispatcher -----------------------------------------------------------------------------------


def test_dispatcher_backends(monkeypatch):
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "torch"
    want = "triton" if kernels.triton_available() else "torch"
    assert kernels.resolve_backend("auto", torch.device("cuda")) == want  # no CUDA tensor needed to decide
    with pytest.raises(UserError, match="unknown kernel backend"):
        kernels.resolve_backend("cuda", torch.device("cpu"))
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(UserError, match=r"kvdiag\[cuda\]"):
        kernels.resolve_backend("triton", torch.device("cpu"))


def test_auto_keeps_fp32_attention_on_torch(monkeypatch):
    """auto: Triton for 16-bit attention on CUDA, torch for fp32 (the H200 measured Triton's fp32 4.5-9.4x slower);
    compaction and an explicit 'triton' are unchanged."""
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    cuda = torch.device("cuda")
    assert kernels.attention_backend("auto", cuda, torch.bfloat16) == "triton"
    assert kernels.attention_backend("auto", cuda, torch.float16) == "triton"
    assert kernels.attention_backend("auto", cuda, torch.float32) == "torch"
    assert kernels.attention_backend("triton", cuda, torch.float32) == "triton"
    assert kernels.attention_backend("auto", torch.device("cpu"), torch.bfloat16) == "torch"
    assert kernels.resolve_backend("auto", cuda) == "triton"


def test_triton_backend_refuses_cpu_tensors_without_interpreter(monkeypatch):
    tk = pytest.importorskip("kvdiag.kernels.triton_kernels")
    monkeypatch.setattr(tk, "_interpreted", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        kernels.compact_kv(
            torch.zeros(1, 4, 2), torch.zeros(1, 4, 2), torch.zeros(1, 2, dtype=torch.long), backend="triton"
        )


def test_shapes_are_checked():
    q, pk, pv, sk, sv = rand_case(2, 4, 2, 3, 3, 10, 8)
    assert kernels.normalize_exclude(torch.zeros(2, 3, dtype=torch.long), 2, 2, q.device).stride(1) == 0
    with pytest.raises(ValueError, match="exclude"):
        kernels.shared_prefix_attention(q, pk, pv, sk, sv, torch.zeros(3, 1, dtype=torch.long), 0.3)
    with pytest.raises(ValueError, match="S>=W"):
        kernels.shared_prefix_attention(q, pk, pv, sk[:, :, :2], sv[:, :, :2], None, 0.3)
    with pytest.raises(ValueError, match="multiple"):
        kernels.shared_prefix_attention(q[:, :3], pk, pv, sk, sv, None, 0.3)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.shared_prefix_attention(q.half(), pk, pv, sk, sv, None, 0.3)


# ---- Triton (interpreter on CPU, in a child process) ------------------------------------------------


def test_triton_kernels_under_interpreter():
    """Runs ``TestTritonInterpreted`` in a fresh process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this process is the interpreter run")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", f"{Path(__file__).resolve()}::TestTritonInterpreted", "-q",
         "-p", "no:cacheprovider"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]


# (N, H, Hkv, W, S, P, d, block_n, exclusions)
TRITON_CASES = {
    # GQA, exclusions on both sides of every 16-key block boundary, per KV head
    "gqa_boundaries": (2, 6, 2, 4, 4, 50, 16, 16, torch.tensor([[[15, 16, 31, 32], [47, 48, 49, -1]]] * 2)),
    # W = 1 decode step, P not a multiple of the block, shared exclusions with repeats and -1
    "w1_ragged": (2, 9, 3, 1, 1, 200, 32, 32, torch.tensor([[0, 64, 199], [-1, 63, 63]])),
    # g*W = 80 rows -> two row blocks; no exclusions; head dim not a power of two; S > W
    "row_blocks": (2, 4, 1, 20, 23, 37, 24, 16, None),
    # empty exclusion list, d = 64, MHA
    "mha_empty": (2, 2, 2, 3, 3, 70, 64, 32, torch.empty(2, 0, dtype=torch.long)),
    # decisions' set rows: 40 of 70 entries per (row, KV head), different per head, padded with -1
    "per_head_sets": (2, 6, 2, 4, 4, 70, 16, 16, exclusions("per_head_set", 2, 2, 70, seed=3)),
}


@pytest.fixture(scope="module")
def tk():
    """The Triton kernels, interpreted: only in the TRITON_INTERPRET=1 child."""
    if not INTERPRETED:
        pytest.skip("run in a TRITON_INTERPRET=1 child by test_triton_kernels_under_interpreter")
    from kvdiag.kernels import triton_kernels

    assert triton_kernels._interpreted()
    return triton_kernels


class TestTritonInterpreted:
    @pytest.mark.parametrize("case", TRITON_CASES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_shared_prefix_attention(self, tk, case, dtype):
        N, H, Hkv, W, S, P, d, block_n, ex = TRITON_CASES[case]
        inputs = rand_case(N, H, Hkv, W, S, P, d, dtype)
        ex = kernels.normalize_exclude(ex, N, Hkv, torch.device("cpu"))
        out = tk.shared_prefix_attention(*inputs, ex, 0.3, block_n=block_n)
        want = torch_ref.shared_prefix_attention(*inputs, ex, 0.3)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])

    @pytest.mark.parametrize("name", SEMANTICS)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_shared_prefix_attention_semantics(self, tk, name, dtype):
        """Per-layer window (crossing 16-key blocks), per-head sink logits, tanh softcap: Triton = torch ref."""
        N, H, Hkv, W, S, P, d, block_n, ex = TRITON_CASES["gqa_boundaries"]
        q, pk, pv, sk, sv = rand_case(N, H, Hkv, W, S, P, d, dtype)
        q = (q.float() * 3).to(dtype)
        ex = kernels.normalize_exclude(ex, N, Hkv, torch.device("cpu"))
        sem = semantics(name, H)
        out = tk.shared_prefix_attention(q, pk, pv, sk, sv, ex, 0.3, block_n=block_n, **sem)
        want = torch_ref.shared_prefix_attention(q, pk, pv, sk, sv, ex, 0.3, **sem)
        torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
        if dtype == torch.float32:
            slow = slow_shared_prefix_attention(q, pk, pv, sk, sv, ex, 0.3, **sem)
            torch.testing.assert_close(out.double(), slow, atol=1e-5, rtol=1e-5)

    def test_shared_prefix_attention_dispatch(self, tk):
        N, H, Hkv, W, S, P, d = 2, 4, 2, 2, 2, 20, 16
        inputs = rand_case(N, H, Hkv, W, S, P, d)
        ex = torch.tensor([[3], [19]])
        out = kernels.shared_prefix_attention(*inputs, ex, 0.3, backend="triton")
        want = slow_shared_prefix_attention(*inputs, kernels.normalize_exclude(ex, N, Hkv, torch.device("cpu")), 0.3)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_compact_kv(self, tk, dtype):
        keys, values = torch.randn(3, 90, 24).to(dtype), torch.randn(3, 90, 24).to(dtype)
        keep = torch.stack([torch.randperm(90)[:37].sort().values for _ in range(3)])  # 37: ragged blocks
        k, v = tk.compact_kv(keys, values, keep, block_b=16)
        k_ref, v_ref = torch_ref.compact_kv(keys, values, keep)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not kernels.triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_on_cuda(dtype):
    N, H, Hkv, W, S, P, d = 8, 32, 8, 16, 16, 1000, 128
    inputs = [t.cuda() for t in rand_case(N, H, Hkv, W, S, P, d, dtype)]
    ex = torch.randint(-1, P, (N, Hkv, 3)).cuda()
    out = kernels.shared_prefix_attention(*inputs, ex, d**-0.5, backend="triton")
    want = kernels.shared_prefix_attention(*inputs, ex, d**-0.5, backend="torch")
    torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    keys = inputs[1]
    keep = torch.arange(0, P, 3, device="cuda").expand(Hkv, -1)
    got_ref = (kernels.compact_kv(keys, inputs[2], keep, backend="triton"), torch_ref.compact_kv(keys, inputs[2], keep))
    for got, ref in zip(*got_ref, strict=True):
        assert torch.equal(got, ref)


# ---- bench ------------------------------------------------------------------------------------------

SMALL = ["--n", "3", "--prefix", "40", "--window", "4", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
         "--exclude", "2", "--trace-len", "64", "--repeats", "1"]


def test_bench_kernels_rows_agree_with_the_reference():
    rows = run_kernel_bench("cpu", 3, 40, 4, 4, 2, 16, 2, 64, 0.5, torch.float32, 1, 0)
    assert {(r.op, r.impl) for r in rows} == {
        (op, impl) for op in ("shared_prefix_attention", "compact_kv") for impl in ("torch", "obvious")
    }
    for r in rows:
        assert r.ms > 0 and r.max_err < 1e-5, r


def test_bench_kernels_cli():
    result = CliRunner().invoke(app, ["bench", "kernels", *SMALL])
    assert result.exit_code == 0, result.output
    for word in ("shared_prefix_attention", "compact_kv", "obvious", "speed-up"):
        assert word in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("args", [["--device", "cuda"], ["--dtype", "float64"], ["--heads", "5"]])
def test_bench_kernels_bad_input_exits_2(args):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "kernels", *SMALL, *args])
    assert exc.value.code == 2
