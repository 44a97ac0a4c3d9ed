"""The 2025–26 rules (VaSE, CAKE, OBCache, LongFlow) against transcriptions of their official scoring code or a slow
brute-force reference, on tiny random caches; parameters, refusals and live contexts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvdiag.core.errors import UserError
from kvdiag.replay import check_live_scorer, make_scorer
from kvdiag.scorers import ScoreContext, get_scorer
from tests.conftest import random_qkv

H, HKV, T, D = 4, 2, 60, 8
G = H // HKV
SCALE = D**-0.5  # the official codes divide by √d
NEW = ["vase", "cake", "obcache", "longflow"]


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = set(a.tolist()), set(b.tolist())
    return len(a & b) / len(a | b)


def top(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.topk(k).indices


@pytest.fixture
def cache():
    q, k, v = random_qkv(H=H, Hkv=HKV, T=T, d=D, seed=3)
    return q, k, v, ScoreContext(q, k, v, SCALE, prompt_len=10)


# --------------------------------------------------------------------------- VaSE


def official_vase(q, k, v, window, n_large, n_sink, budget, temperature=1.0):
    """Transcribed from terarachang/VaSE ``EvictLayer._run_eviction`` (mode ``range_sink_sample_attn``, ``--smooth``),
    batch of 1: returns the large-value ids, the keep set with the draw replaced by its greedy top-k
    (``select_remaining_based_on_scores``), and the weights the draw samples from, per KV head."""
    queries = q[None, :, -window:]  # the residual query buffer [1, H, W, D]
    k_cand, v_cand = k[None, :, : T - window], v[None, :, : T - window]
    K = budget - window
    v_magnitude = v_cand.amax(-1) - v_cand.amin(-1)
    v_magnitude[..., :n_sink] = float("inf")
    # compute_attention_scores
    b, q_heads, q_len, head_dim = queries.shape
    kv_heads = k_cand.shape[1]
    weights = queries.view(b, kv_heads, q_heads // kv_heads, q_len, head_dim) @ k_cand.unsqueeze(2).transpose(3, 4)
    weights = F.softmax(weights / (math.sqrt(head_dim) * temperature), dim=-1, dtype=torch.float32)
    scores = weights.mean(-2)
    shape = scores.shape
    scores = F.avg_pool1d(scores.view(b, q_heads, -1), kernel_size=5, padding=2, stride=1).view(shape).mean(2)
    ids_large = v_magnitude.topk(n_large, dim=-1).indices
    greedy = scores.clone().scatter_(-1, ids_large, float("-inf")).topk(K - n_large, dim=-1).indices
    scores.scatter_(-1, ids_large, 0.0)
    return ids_large[0], torch.cat([ids_large, greedy], dim=-1)[0], scores[0]


def test_vase_matches_the_official_selection_and_draw_weights(cache):
    q, k, v, ctx = cache
    window, n_large, n_sink, budget = 8, 10, 4, 32
    ids_large, keep, draw = official_vase(q, k, v, window, n_large, n_sink, budget)
    s = get_scorer("vase", window=window, n_large=n_large).scores(ctx)
    m = T - window
    for h in range(HKV):
        cand = s[h, :m]
        assert set(torch.nonzero(cand >= 2.0).flatten().tolist()) == set(ids_large[h].tolist())  # kept for |v|
        assert jaccard(top(cand, budget - window), keep[h]) >= 0.99
        sampled = torch.ones(m, dtype=torch.bool)
        sampled[ids_large[h]] = False
        torch.testing.assert_close(cand[sampled], draw[h, sampled])  # the draw reads the same weights
    assert s[:, :n_sink].amin() > s[:, n_sink:m].amax()  # sinks and the residual window carry the kept score
    assert s[:, m:].amin() > s[:, n_sink:m].amax()


def test_vase_large_entries_rank_by_magnitude_and_kind_switches(cache):
    _, _, v, ctx = cache
    s = get_scorer("vase", window=8, n_large=12, n_sink=0, kind="l2").scores(ctx)[:, : T - 8]
    norms = v[:, : T - 8].norm(dim=-1)
    for h in range(HKV):
        large = torch.nonzero(s[h] >= 2.0).flatten()
        assert set(large.tolist()) == set(norms[h].topk(12).indices.tolist())
        assert torch.equal(large[s[h, large].argsort()], large[norms[h, large].argsort()])
    none = get_scorer("vase", window=8, n_large=0, n_sink=0).scores(ctx)[:, : T - 8]
    assert none.max() <= 1.0  # no large entries: the attention weights alone


# --------------------------------------------------------------------------- CAKE


def official_cake(q, k, window, gamma):
    """Transcribed from antgroup/cakekv ``llama_attn_forward_cake`` (prefill branch): the eviction indicator
    ``hh_score`` [Hkv, t - W], batch of 1."""
    query_states, key_states = q[None], k.repeat_interleave(G, dim=0)[None]  # repeat_kv
    head_dim = q.shape[-1]
    tmp = query_states[..., -window:, :] @ key_states.transpose(2, 3) / math.sqrt(head_dim)
    mask = torch.full((window, window), torch.finfo(tmp.dtype).min)
    cond = torch.arange(window)
    mask.masked_fill_(cond < (cond + 1).view(window, 1), 0)
    tmp[:, :, -window:, -window:] += mask[None, None]
    tmp = F.softmax(tmp, dim=-1, dtype=torch.float32)
    attention_score = tmp[:, :, -window:, :]
    attn_cache = (attention_score.mean(dim=-2) + gamma * attention_score.var(dim=-2))[:, :, :-window]
    attn_cache = F.avg_pool1d(attn_cache, kernel_size=5, padding=5 // 2, stride=1)
    return attn_cache.reshape(1, HKV, G, -1).mean(dim=-2)[0]


@pytest.mark.parametrize("window, gamma", [(32, 200.0), (8, 200.0), (8, 0.0), (16, 50.0)])
def test_cake_keep_set_matches_the_official_indicator(cache, window, gamma):
    q, k, _, ctx = cache
    ref = official_cake(q, k, window, gamma)
    s = get_scorer("cake", window=window, gamma=gamma).scores(ctx)
    m = T - window
    torch.testing.assert_close(s[:, :m], ref)
    for h in range(HKV):
        for budget in (m // 4, m // 2):
            assert jaccard(top(s[h, :m], budget), top(ref[h], budget)) >= 0.99
    assert s[:, m:].amin() > s[:, :m].amax()  # the window is kept


# --------------------------------------------------------------------------- LongFlow


def official_longflow(q, k, v):
    """Transcribed from yisunlp/LongFLow ``triton_kernel/attention.py`` (``evict_fwd_kernel``'s TempLoss and
    ``triton_evict_attention_forward``), batch of 1, all slots valid: the newest query over the whole cache."""
    query = q[:, -1]  # [H, D]
    n_q_heads, head_dim = query.shape
    kv = torch.arange(n_q_heads) // G  # kv_head_idx = pid_h // N_REP
    scores = (query[:, None, :] * k[kv]).sum(-1) * (head_dim**-0.5)
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = probs / probs.sum(-1, keepdim=True)
    temp_loss = (probs[:, :, None] * v[kv]).abs().sum(-1).sum(0)  # atomic_add over the query heads
    final_loss = temp_loss / (n_q_heads * head_dim)
    return final_loss, int(final_loss.argmin())


def test_longflow_matches_the_official_kernel(cache):
    q, k, v, ctx = cache
    ref, evict = official_longflow(q, k, v)
    s = get_scorer("longflow").scores(ctx)
    for h in range(HKV):
        torch.testing.assert_close(s[h], ref)  # one layer-wise score on every KV head
        for budget in (T // 4, T // 2, T - 1):
            assert jaccard(top(s[h], budget), top(ref, budget)) >= 0.99
    assert int(s[0].argmin()) == evict


# --------------------------------------------------------------------------- OBCache against brute force


def window_outputs(q, k, v, window):
    """fp64 [H, W, d] attention outputs of the last ``window`` queries (causal), query head h reading KV head h // G."""
    kk, vv = k.repeat_interleave(G, dim=0), v.repeat_interleave(G, dim=0)
    logits = q[:, -window:] @ kk.transpose(1, 2) * SCALE
    hidden = torch.arange(T)[None, :] > torch.arange(T - window, T)[:, None]
    return torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1) @ vv


def brute_force_saliency(q, k, v, window, target, eps=1e-5):
    """``Σ_τ ‖Δo_τ‖²`` when entry j's value and/or key is scaled by ``1 − ε``, divided by ``ε²`` (the second-order
    term OBD keeps; exact for the value), per query head, mean over the group -> [Hkv, t - W], fp64."""
    q, k, v = q.double(), k.double(), v.double()
    base = window_outputs(q, k, v, window)
    out = torch.zeros(HKV, T - window, dtype=torch.float64)
    for j in range(T - window):
        k2, v2 = k.clone(), v.clone()
        if target in ("key", "kv"):
            k2[:, j] *= 1 - eps
        if target in ("value", "kv"):
            v2[:, j] *= 1 - eps
        damage = ((window_outputs(q, k2, v2, window) - base) ** 2).sum(dim=(1, 2)) / eps**2  # [H]
        out[:, j] = damage.reshape(HKV, G).mean(dim=1)
    return out


@pytest.mark.parametrize("target", ["value", "key", "kv"])
def test_obcache_saliency_is_the_output_change_to_second_order(cache, target):
    q, k, v, ctx = cache
    window = 6
    ref = brute_force_saliency(q, k, v, window, target).float()
    s = get_scorer("obcache", window=window, target=target).scores(ctx)
    torch.testing.assert_close(s[:, : T - window], ref, rtol=2e-3, atol=1e-6)
    assert s[:, T - window :].amin() > s[:, : T - window].amax()


def test_obcache_value_removal_is_exact(cache):
    q, k, v, ctx = cache
    window = 4
    base = window_outputs(q.double(), k.double(), v.double(), window)
    s = get_scorer("obcache", window=window, target="value").scores(ctx)
    for j in (0, 17, T - window - 1):
        v2 = v.double().clone()
        v2[:, j] = 0.0  # remove the value outright
        damage = ((window_outputs(q.double(), k.double(), v2, window) - base) ** 2).sum(dim=(1, 2))
        torch.testing.assert_close(s[:, j], damage.reshape(HKV, G).mean(dim=1).float(), rtol=1e-4, atol=1e-7)


def test_obcache_pooling():
    q, k, v = random_qkv(H=2, Hkv=2, T=T, d=D, seed=1)  # one query head per KV head: pooling acts on the score
    ctx = ScoreContext(q, k, v, SCALE, prompt_len=10)
    raw = get_scorer("obcache", window=6).scores(ctx)[:, : T - 6]
    for pooling, pool in (("maxpool", F.max_pool1d), ("avgpool", F.avg_pool1d)):
        pooled = get_scorer("obcache", window=6, pooling=pooling).scores(ctx)[:, : T - 6]
        torch.testing.assert_close(pooled, pool(raw[:, None], 7, 1, 3)[:, 0])


# --------------------------------------------------------------------------- parameters, refusals, live contexts


@pytest.mark.parametrize("name", NEW)
def test_unknown_parameter_is_one_line(name):
    with pytest.raises(UserError, match=f"scorer {name} has no parameter 'nope'") as err:
        get_scorer(name, nope="1")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, params", [
    ("vase", {"window": "0"}), ("vase", {"n_large": "-1"}), ("vase", {"kind": "max"}), ("vase", {"n_sink": "-2"}),
    ("vase", {"kernel_size": "0"}), ("vase", {"temperature": "0"}), ("vase", {"temperature": "nan"}),
    ("cake", {"window": "0"}), ("cake", {"gamma": "-1"}), ("cake", {"kernel_size": "0"}),
    ("obcache", {"window": "0"}), ("obcache", {"target": "both"}), ("obcache", {"pooling": "sum"}),
    ("cake", {"gamma": "lots"}),
])
def test_bad_values_are_refused_in_one_line(name, params):
    with pytest.raises(UserError) as err:
        get_scorer(name, **params)
    assert "\n" not in str(err.value) and name in str(err.value)


def test_defaults_are_the_official_ones():
    vase = get_scorer("vase")
    assert (vase.window, vase.n_large, vase.kind, vase.n_sink, vase.kernel_size, vase.temperature) == (
        64, 256, "range", 4, 5, 1.0)
    cake = get_scorer("cake")
    assert (cake.window, cake.gamma, cake.kernel_size) == (32, 200.0, 5)
    assert get_scorer("longflow").params == {} and get_scorer("longflow").query_window == 1


@pytest.mark.parametrize("name", NEW)
def test_runs_on_a_live_cache(name):
    scorer = make_scorer(name)
    assert not scorer.needs_history and not scorer.needs_model
    check_live_scorer(scorer)


@pytest.mark.parametrize("name, params", [
    ("vase", {"window": 8, "n_large": 10}), ("cake", {}), ("obcache", {"target": "kv"}), ("longflow", {}),
])
def test_live_context_over_the_full_cache_equals_the_trace_scorer(name, params):
    q, k, v = random_qkv(H=H, Hkv=HKV, T=T, d=D, seed=5)
    w = 40
    scorer = get_scorer(name, **params)
    full = scorer.scores(ScoreContext(q, k, v, 0.3, 20))
    live = scorer.scores(ScoreContext(q[:, T - w :], k, v, 0.3, 20, positions=torch.arange(T), checkpoint=T))
    torch.testing.assert_close(full, live, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NEW)
def test_tiny_caches_are_finite(name):
    for t in (1, 2, 5, 33, 70):
        q, k, v = random_qkv(H=H, Hkv=HKV, T=t, d=D, seed=t)
        s = get_scorer(name).scores(ScoreContext(q, k, v, 0.3, min(t, 3)))
        assert s.shape == (HKV, t) and torch.isfinite(s).all()
