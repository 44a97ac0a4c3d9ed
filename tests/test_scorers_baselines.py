"""Each baseline scorer on hand-made tensors, against its formula computed slowly or by hand."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from kvdiag.scorers import SCORERS, ScoreContext, get_scorer, lazyeviction_score
from kvdiag.scorers.features import AttentionHistory
from tests.conftest import dense_attention, make_scorer, random_qkv

H, HKV, T, D, PROMPT = 4, 2, 24, 6, 8


qkv = partial(random_qkv, H=H, Hkv=HKV, T=T, d=D)


def group_mean(x):
    return x.reshape(HKV, H // HKV, *x.shape[1:]).mean(dim=1)


@pytest.fixture
def case():
    q, k, v = qkv()
    return ScoreContext(q, k, v, 0.3, PROMPT), dense_attention(q, k, 0.3)


def assert_kept(scores, protected):
    assert scores[:, protected].min() > scores[:, ~protected].max()


def test_attention_and_attention_x_age(case):
    ctx, attn = case
    ref = group_mean(attn[:, T - 5 :].mean(dim=1))
    torch.testing.assert_close(get_scorer("attention", window=5).scores(ctx), ref)
    age = torch.arange(T, 0, -1).float()
    torch.testing.assert_close(get_scorer("attention_x_age", window=5).scores(ctx), ref * age)


def test_h2o_normalized_raw_and_recent(case):
    ctx, attn = case
    raw = attn.sum(dim=1)  # every query < t
    seen_by = torch.arange(T, 0, -1).float()  # entry i is seen by the t - i queries tau >= i
    torch.testing.assert_close(get_scorer("h2o").scores(ctx), group_mean(raw / seen_by))
    torch.testing.assert_close(get_scorer("h2o", normalize="false").scores(ctx), group_mean(raw))
    s = get_scorer("h2o", recent_size=3).scores(ctx)
    assert_kept(s, torch.arange(T) >= T - 3)
    torch.testing.assert_close(s[:, : T - 3], group_mean(raw / seen_by)[:, : T - 3])


def test_snapkv_window_sum_avgpool_and_protected_window(case):
    ctx, attn = case
    w, m = 4, T - 4
    summed = attn[:, T - w :, :m].sum(dim=1)  # [H, m]
    padded = torch.nn.functional.pad(summed, (2, 2))
    pooled = torch.stack([padded[:, j : j + 5].sum(dim=1) / 5 for j in range(m)], dim=1)  # zeros count, as avg_pool1d
    s = get_scorer("snapkv", window=w).scores(ctx)
    torch.testing.assert_close(s[:, :m], group_mean(pooled))
    assert_kept(s, torch.arange(T) >= m)
    maxed = torch.stack([padded[:, j : j + 5].amax(dim=1) for j in range(m)], dim=1)
    s_max = get_scorer("snapkv", window=w, pooling="maxpool").scores(ctx)
    torch.testing.assert_close(s_max[:, :m], group_mean(maxed))  # pooled values are >= 0, so zero padding is inert


def test_tova_last_query_mean_over_all_heads(case):
    ctx, attn = case
    s = get_scorer("tova").scores(ctx)
    torch.testing.assert_close(s, attn[:, T - 1].mean(dim=0).expand(HKV, -1))


def test_streamingllm_sinks_then_recency(case):
    ctx, _ = case
    s = get_scorer("streamingllm", n_sink=2).scores(ctx)
    order = s[0].argsort(descending=True, stable=True).tolist()
    assert order == [0, 1] + list(range(T - 1, 1, -1))
    assert_kept(s, torch.arange(T) < 2)


def rkv_case():
    """t = 5, W = 2: candidates 0..2, window queries at 3 and 4; two query heads on one KV head, d = 2, scale 1."""
    k = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [1.0, 1.0], [-1.0, 0.0]]])
    q = torch.zeros(2, 5, 2)
    q[0, 3], q[0, 4] = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    q[1, 3], q[1, 4] = torch.tensor([0.0, 1.0]), torch.tensor([2.0, 0.0])
    return ScoreContext(q, k, torch.ones(1, 5, 2), 1.0, 0)


def rkv_redundancy_by_hand():
    # cosine matrix after R-KV's retain-last rule (see test_features.test_rkv_redundancy_by_hand): column sums
    c = 1 / math.sqrt(2)
    col_mean = torch.tensor([1 + c, c, 0.0, -c, -(2 + c)]) / 5
    return torch.softmax(col_mean, dim=0)


def softmax(xs):
    e = [math.exp(x) for x in xs]
    return [x / sum(e) for x in e]


def test_rkv_by_hand():
    ctx = rkv_case()
    # logits of candidates 0..2 (k0 = (1,0), k1 = (0,2), k2 = (3,0)):
    #   query 3: head 0 (1,0) -> [1, 0, 3], head 1 (0,1) -> [0, 2, 0]; max over the group -> [1, 2, 3]
    #   query 4: head 0 (0,1) -> [0, 2, 0], head 1 (2,0) -> [2, 0, 6]; max over the group -> [2, 2, 6]
    a3, a4 = softmax([1, 2, 3]), softmax([2, 2, 6])
    importance = torch.tensor([(x + y) / 2 for x, y in zip(a3, a4, strict=True)])  # [0.0539, 0.1312, 0.8149]
    red = rkv_redundancy_by_hand()[:3]
    # kernel 1: no pooling
    s1 = get_scorer("rkv", window=2, kernel_size=1).scores(ctx)[0]
    torch.testing.assert_close(s1[:3], 0.1 * importance - 0.9 * red)
    # default kernel 7 max-pools over all three candidates
    s7 = get_scorer("rkv", window=2).scores(ctx)[0]
    torch.testing.assert_close(s7[:3], 0.1 * importance.max() - 0.9 * red)
    assert s7[3:].min() > s7[:3].max()  # the last W are kept
    # mean pooling of the logits: query 3 -> [0.5, 1, 1.5], query 4 -> [1, 1, 3]
    mean_imp = torch.tensor([(x + y) / 2 for x, y in zip(softmax([0.5, 1, 1.5]), softmax([1, 1, 3]), strict=True)])
    s_mean = get_scorer("rkv", window=2, kernel_size=1, pooling="mean").scores(ctx)[0]
    torch.testing.assert_close(s_mean[:3], 0.1 * mean_imp - 0.9 * red)


def test_rkv_defaults_are_official():
    rkv = get_scorer("rkv")
    assert (rkv.window, rkv.kernel_size, rkv.mix_lambda, rkv.pooling, rkv.threshold) == (8, 7, 0.1, "max", 0.5)


def test_lazyeviction_score_by_hand():
    ts = torch.tensor([3.0, 5.0, 0.0])
    mri = torch.tensor([2.0, 0.0, 0.0])
    got = lazyeviction_score(ts, mri, step=5)
    # entry 0: s_freq 2/(1+e^1), s_surv 2/(1+e^(1 + 2/2)); entry 1: never recurred but just hit: s_surv 2/(1+e);
    # entry 2: never recurred, idle 5 steps: ~0
    expected = [2 / (1 + math.e) + 2 / (1 + math.exp(2)), 2 / (1 + math.e), 0.0]
    assert got.tolist() == pytest.approx(expected, abs=1e-4)


def test_lazyeviction_scorer_uses_replayed_state_and_protects_window(case):
    ctx, _ = case
    ts = torch.randint(0, 10, (H, T)).float()
    mri = torch.randint(0, 4, (H, T)).float()
    ctx.cache[("recurrence", 5e-4)] = (ts, mri)  # inject the state; the replay itself is tested in test_features
    s = get_scorer("lazyeviction", window=6).scores(ctx)
    ref = group_mean(lazyeviction_score(ts, mri, T - PROMPT))
    torch.testing.assert_close(s[:, : T - 6], ref[:, : T - 6])
    assert_kept(s, torch.arange(T) >= T - 6)


def test_thinkv_levels_rho_and_representativeness():
    # prompt [0, 2), segments of 2 steps: [2, 4) Transition, [4, 6) Execution, [6, 8) Reasoning (fixed thresholds)
    t = 8
    k = torch.tensor([[1.0, 0.0]] * 2 + [[0.0, 1.0]] * 2 + [[1.0, 1.0]] * 2 + [[2.0, 0.0]] * 2).expand(2, t, 2).clone()
    ctx = ScoreContext(torch.zeros(4, t, 2), k, torch.ones(2, t, 2), 1.0, prompt_len=2)
    sparsity = torch.tensor([0.0, 0.0, 0.9, 0.8, 0.1, 0.2, 0.5, 0.4]).expand(4, t)
    ctx.cache[("sparsity", 0.01)] = sparsity
    thinkv = get_scorer("thinkv", segment_len=2, thresholds="0.3,0.7")
    s = thinkv.scores(ctx)
    # score = -level + 0.25·rho + 0.1·rep; keys of a segment are parallel, so rep = 1
    # prompt: one transition after it (level 1), R: -1 + 0.5 + 0.1; T segment: 0 + 0 + 0.1; E: 0.25 + 0.1; R: 0.5 + 0.1
    expected = torch.tensor([-0.4, -0.4, 0.1, 0.1, 0.35, 0.35, 0.6, 0.6])
    torch.testing.assert_close(s, expected.expand(2, t))
    # a key pointing away from its segment's mean is less representative
    ctx2 = ScoreContext(torch.zeros(4, t, 2), k.clone(), torch.ones(2, t, 2), 1.0, prompt_len=2)
    ctx2.k[:, 7] = torch.tensor([0.0, 1.0])
    ctx2.cache[("sparsity", 0.01)] = sparsity
    s2 = thinkv.scores(ctx2)
    assert s2[0, 7] < s2[0, 6] < 0.6 + 1e-6


def test_knorm_value_norm_vatp(case):
    ctx, attn = case
    torch.testing.assert_close(get_scorer("knorm").scores(ctx), -ctx.k.norm(dim=-1))
    vn = get_scorer("value_norm").scores(ctx)
    torch.testing.assert_close(vn[:, 4:], (ctx.v.amax(-1) - ctx.v.amin(-1))[:, 4:])
    assert_kept(vn, torch.arange(T) < 4)
    vatp = get_scorer("vatp").scores(ctx)
    ref = group_mean(attn.sum(dim=1) / torch.arange(T, 0, -1)) * ctx.v.abs().sum(-1)
    torch.testing.assert_close(vatp[:, 4:], ref[:, 4:])
    assert_kept(vatp, torch.arange(T) < 4)
    window = get_scorer("vatp", base="window", window=3, n_sink=0).scores(ctx)
    torch.testing.assert_close(window, group_mean(attn[:, T - 3 :].mean(1)) * ctx.v.abs().sum(-1))


def test_random_is_seeded_and_candidate_independent(case):
    ctx, _ = case
    a = get_scorer("random").scores(ctx)
    assert ((a >= 0) & (a < 1)).all()
    torch.testing.assert_close(get_scorer("random").scores(ctx), a)
    assert not torch.equal(get_scorer("random", seed=1).scores(ctx), a)
    ctx.candidates = torch.tensor([3, 17])
    torch.testing.assert_close(get_scorer("random")(ctx), a[:, [3, 17]])


@pytest.mark.parametrize("t,prompt_len", [(1, 0), (2, 2), (5, 1), (40, 3)])
def test_every_scorer_is_finite_on_tiny_caches(t, prompt_len):
    q, k, v = qkv(T=t, seed=t)
    ctx = ScoreContext(q, k, v, 0.3, prompt_len)
    for name in SCORERS:
        s = make_scorer(name).scores(ctx)
        assert s.shape == (HKV, t) and torch.isfinite(s).all(), name


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_no_scorer_sees_the_future(name):
    """Scores at t are the same whether the layer's tensors end at t or continue with other data."""
    if name.startswith("test_"):
        pytest.skip("a scorer registered by another test")
    q, k, v = qkv(T=160, seed=4)
    t = 130
    alone = ScoreContext(q[:, :t], k[:, :t], v[:, :t], 0.3, 40, prompt_id="p")
    q2, k2, v2 = qkv(T=160, seed=9)
    q2[:, :t], k2[:, :t], v2[:, :t] = q[:, :t], k[:, :t], v[:, :t]  # same past, different future
    history = AttentionHistory(q2, k2, 0.3)
    shared = ScoreContext(q2[:, :t], k2[:, :t], v2[:, :t], 0.3, 40, prompt_id="p", history=history)
    scorer = make_scorer(
        name, **({"w_obs": 8, "w_delay": 16} if name.startswith("avokv") and name != "avokv_e_no_delay" else {})
    )
    later = ScoreContext(q2[:, :150], k2[:, :150], v2[:, :150], 0.3, 40, prompt_id="p", history=history)
    scorer.scores(later)  # the shared history has streamed past t and must restart
    torch.testing.assert_close(scorer.scores(shared), scorer.scores(alone))
