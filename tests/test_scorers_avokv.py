"""AvoKV-E: the paper's Table 5 worked example, the full scorer against a slow reference, the ablations."""

from __future__ import annotations

import pytest
import torch

from kvdiag.scorers import ScoreContext, avokv_score, get_scorer, percentile_rank
from tests.conftest import dense_attention, random_qkv

# Table 5 of the AvoKV-E paper: four tokens at one checkpoint, all eligible
TOKENS = ["I", "cook", "dinner", "myself"]
P = torch.tensor([[0.04, 0.81, 0.02, 0.05]])
R = torch.tensor([[0.55, 0.41, 0.55, 0.92]])
B = torch.tensor([[0.55, 0.62, 2.10, 1.20]])


def test_table5_percentile_ranks_by_hand():
    # p ranks 2, 4, 1, 3; r ranks 2.5, 1, 2.5, 4 (tie of "I" and "dinner" averaged); b ranks 1, 2, 4, 3
    torch.testing.assert_close(percentile_rank(P), torch.tensor([[1 / 3, 1.0, 0.0, 2 / 3]]))
    torch.testing.assert_close(percentile_rank(R), torch.tensor([[0.5, 0.0, 0.5, 1.0]]))
    torch.testing.assert_close(percentile_rank(B), torch.tensor([[0.0, 1 / 3, 1.0, 2 / 3]]))


def test_table5_scores_follow_design_formula():
    eligible = torch.ones(4, dtype=torch.bool)
    s = avokv_score(P, R, B, eligible)  # λ_p = λ_r = λ_b = 1 (our defaults)
    # S = N(p) - N(r) + N(b): I 1/3 - 1/2 + 0, cook 1 - 0 + 1/3, dinner 0 - 1/2 + 1, myself 2/3 - 1 + 2/3
    torch.testing.assert_close(s, torch.tensor([[-1 / 6, 4 / 3, 1 / 2, 1 / 3]]))
    assert [round(x, 2) for x in s[0].tolist()] == [-0.17, 1.33, 0.5, 0.33]
    order = [TOKENS[i] for i in s[0].argsort(descending=True)]
    assert order == ["cook", "dinner", "myself", "I"]  # low-attention "dinner" is kept for its payload
    # weights are parameters: λ_p = 2, λ_r = 0.5, λ_b = 0
    torch.testing.assert_close(
        avokv_score(P, R, B, eligible, 2.0, 0.5, 0.0), torch.tensor([[2 / 3 - 0.25, 2.0, -0.25, 4 / 3 - 0.5]])
    )


def test_table5_ablations():
    eligible = torch.ones(4, dtype=torch.bool)
    torch.testing.assert_close(
        avokv_score(P, R, B, eligible, lambda_b=0.0), torch.tensor([[1 / 3 - 0.5, 1.0, -0.5, -1 / 3]])
    )
    torch.testing.assert_close(avokv_score(P, R, B, eligible, lambda_r=0.0), torch.tensor([[1 / 3, 4 / 3, 1.0, 4 / 3]]))
    z = lambda x: (x - x.mean()) / x.std(unbiased=False)
    torch.testing.assert_close(avokv_score(P, R, B, eligible, normalization="zscore"), z(P) - z(R) + z(B))


def test_ineligible_entries_are_kept_above_every_eligible_one():
    eligible = torch.tensor([True, True, False, True])
    s = avokv_score(P, R, B, eligible)
    # ranks over the three eligible entries only: p (0.04, 0.81, 0.05) -> 0, 1, 0.5; r (0.55, 0.41, 0.92) -> 0.5, 0, 1;
    # b (0.55, 0.62, 1.20) -> 0, 0.5, 1
    torch.testing.assert_close(s[0, [0, 1, 3]], torch.tensor([-0.5, 1.5, 0.5]))
    assert s[0, 2].item() == pytest.approx(1.5 + 1 + 1.5)


def ranks(values):
    """Slow average-tie percentile ranks."""
    n = len(values)
    return [(sum(v < x for v in values) + (sum(v == x for v in values) - 1) / 2) / (n - 1) for x in values]


def test_full_scorer_matches_slow_reference():
    q, k, v = random_qkv(H=4, Hkv=2, T=20, d=6, seed=5)
    t, w_obs, w_delay = 20, 3, 6
    ctx = ScoreContext(q, k, v, 0.4, prompt_len=5)
    got = get_scorer("avokv_e", w_obs=w_obs, w_delay=w_delay).scores(ctx)
    attn = dense_attention(q, k, 0.4)[:, t - w_obs :]
    cand = [i for i in range(t) if t - i > w_delay]
    assert cand == list(range(14))
    for kv in range(2):
        p, r, b = [], [], []
        for i in cand:
            share = [attn[h, :, i].sum() / attn[h][:, cand].sum() for h in (2 * kv, 2 * kv + 1)]
            p.append(float(sum(share) / 2))
            r.append(
                sum(torch.cosine_similarity(k[kv, i], k[kv, j], dim=0).item() for j in cand if j != i) / (len(cand) - 1)
            )
            b.append(v[kv, i].norm().item())
        expected = [a - c + e for a, c, e in zip(ranks(p), ranks(r), ranks(b), strict=True)]
        assert got[kv, cand].tolist() == pytest.approx(expected, abs=1e-5)
        assert got[kv, 14:].min() > got[kv, cand].max()  # the delay buffer is kept


def test_ablation_classes_change_one_thing():
    q, k, v = random_qkv(T=200, seed=2)
    ctx = ScoreContext(q, k, v, 0.3, prompt_len=50)
    full = get_scorer("avokv_e")
    assert (full.w_obs, full.w_delay, full.lambda_p, full.lambda_r, full.lambda_b) == (32, 128, 1.0, 1.0, 1.0)
    assert get_scorer("avokv_e_no_payload").lambda_b == 0.0
    assert get_scorer("avokv_e_no_redundancy").lambda_r == 0.0
    assert get_scorer("avokv_e_raw").normalization == "zscore"
    no_delay = get_scorer("avokv_e_no_delay")
    assert no_delay.w_delay == no_delay.w_obs == 32
    s = no_delay.scores(ctx)
    assert s[:, 200 - 32 :].min() > s[:, : 200 - 32].max()  # only W_obs entries are protected
    torch.testing.assert_close(no_delay.scores(ctx), get_scorer("avokv_e", w_delay=32).scores(ctx))
    torch.testing.assert_close(
        get_scorer("avokv_e_no_payload").scores(ctx), get_scorer("avokv_e", lambda_b=0.0).scores(ctx)
    )


def test_payload_options():
    q, k, v = random_qkv(T=40, seed=1)
    ctx = ScoreContext(q, k, v, 0.3, prompt_len=10)
    only_b = get_scorer("avokv_e", w_obs=4, w_delay=8, lambda_p=0.0, lambda_r=0.0, payload="range")
    s = only_b.scores(ctx)
    rng = v.amax(-1) - v.amin(-1)
    torch.testing.assert_close(s[:, :32], percentile_rank(rng[:, :32]))
