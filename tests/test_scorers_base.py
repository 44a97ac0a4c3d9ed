"""Percentile ranks, protection, the registry and ``--param`` parsing."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvdiag.core.errors import UserError
from kvdiag.scorers import (
    SCORERS,
    Scorer,
    get_scorer,
    parse_params,
    percentile_rank,
    protect,
    register_scorer,
    zscore,
)
from kvdiag.scorers.normalization import aggregation_values

BUILTINS = [
    "attention", "attention_x_age", "h2o", "snapkv", "tova", "streamingllm", "rkv", "lazyeviction", "thinkv", "knorm",
    "value_norm", "vatp", "random", "avokv_e", "avokv_e_no_payload", "avokv_e_no_delay", "avokv_e_raw",
    "avokv_e_no_redundancy",
]


def test_every_builtin_is_registered_with_documented_source():
    assert set(BUILTINS) <= set(SCORERS)
    for name in BUILTINS:
        cls = SCORERS[name]
        assert cls.name == name
        assert cls.__doc__ and len(cls.__doc__) > 40


def test_percentile_rank_average_ties_by_hand():
    x = torch.tensor([[0.55, 0.41, 0.55, 0.92]])
    # ranks 2.5, 1, 2.5, 4 -> (rank - 1) / 3
    torch.testing.assert_close(percentile_rank(x), torch.tensor([[0.5, 0.0, 0.5, 1.0]]))


def test_percentile_rank_over_a_mask_and_degenerate_sets():
    x = torch.tensor([[3.0, 1.0, 2.0, 9.0], [0.0, 5.0, 5.0, 1.0]])
    mask = torch.tensor([True, True, True, False])
    got = percentile_rank(x, mask)
    torch.testing.assert_close(got[:, :3], torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.75, 0.75]]))
    assert got[:, 3].isnan().all()
    assert percentile_rank(x, torch.tensor([False, True, False, False]))[:, 1].tolist() == [0.5, 0.5]


def test_zscore_over_mask():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    got = zscore(x, torch.tensor([True, True, True, False]))
    sd = (2 / 3) ** 0.5
    torch.testing.assert_close(got[:, :3], torch.tensor([[-1 / sd, 0.0, 1 / sd]]))
    assert got[0, 3].isnan()
    assert zscore(torch.ones(1, 3), torch.ones(3, dtype=torch.bool)).abs().max() == 0  # constant: 0, not NaN


def test_protect_is_finite_and_strictly_above():
    scores = torch.tensor([[-5.0, -2.0, -9.0, 0.0], [1e6, 3.0, 2.0, 0.0]])
    prot = torch.tensor([False, False, True, True])
    got = protect(scores, prot)
    assert torch.isfinite(got).all()
    assert got[0, 2:].tolist() == [1.0, 1.0]  # m = -2: m + 1 + |m| = 1
    assert got[1, 2:].tolist() == [2e6 + 1, 2e6 + 1]
    assert (got[:, 2:].min(dim=1).values > got[:, :2].max(dim=1).values).all()
    torch.testing.assert_close(protect(scores, torch.zeros(4, dtype=torch.bool)), scores)


def test_aggregation_values():
    s = torch.tensor([[3.0, 1.0, 2.0]])
    assert aggregation_values(s, "mean_rank").tolist() == [[1.0, 0.0, 0.5]]
    assert aggregation_values(s, "mean_raw").tolist() == [[3.0, 1.0, 2.0]]
    with pytest.raises(UserError, match="mean_rank"):
        aggregation_values(s, "median")


def test_get_scorer_converts_param_strings():
    rkv = get_scorer("rkv", mix_lambda="0.07", window="16", pooling="mean")
    assert (rkv.mix_lambda, rkv.window, rkv.pooling) == (0.07, 16, "mean")
    assert get_scorer("h2o", normalize="false").normalize is False
    thinkv = get_scorer("thinkv", thresholds="0.2,0.6", rho="0,1,2")
    assert thinkv.thresholds == (0.2, 0.6) and thinkv.rho == (0.0, 1.0, 2.0)
    assert get_scorer("thinkv", thresholds="none").thresholds is None
    assert get_scorer("avokv_e_no_delay", w_obs="64").w_delay == 64


def test_get_scorer_errors_name_the_fix():
    with pytest.raises(UserError, match="unknown scorer 'nope'.*avokv_e"):
        get_scorer("nope")
    with pytest.raises(UserError, match="no parameter 'lambda'.*mix_lambda"):
        get_scorer("rkv", **{"lambda": "0.1"})
    with pytest.raises(UserError, match="rkv.window=abc"):
        get_scorer("rkv", window="abc")
    with pytest.raises(UserError, match="pooling"):
        get_scorer("rkv", pooling="min")
    with pytest.raises(UserError, match="w_delay"):
        get_scorer("avokv_e", w_obs="64", w_delay="32")  # W_delay >= W_obs
    with pytest.raises(UserError, match="3 comma-separated"):
        get_scorer("thinkv", rho="1,2")


def test_parse_params():
    assert parse_params(["rkv.mix_lambda=0.2", "rkv.window=4", "h2o.normalize=false"]) == {
        "rkv": {"mix_lambda": "0.2", "window": "4"}, "h2o": {"normalize": "false"}}
    for bad in ("rkv=0.2", "mix_lambda", ".x=1", "rkv.=1"):
        with pytest.raises(UserError, match="scorer.key=value"):
            parse_params([bad])


def test_register_scorer_both_forms_and_conflicts():
    @dataclass
    class Doubled(Scorer):
        factor: float = 2.0

        def score(self, ctx):
            return ctx.k.norm(dim=-1) * self.factor

    try:
        register_scorer(Doubled, "test_doubled")
        assert register_scorer(Doubled, "test_doubled") is Doubled  # idempotent
        assert get_scorer("test_doubled", factor="3").factor == 3.0

        @register_scorer("test_doubled_dec")
        @dataclass
        class Other(Doubled):
            pass

        assert SCORERS["test_doubled_dec"] is Other
        with pytest.raises(UserError, match="taken"):
            register_scorer(Other, "test_doubled")
        with pytest.raises(UserError, match="dataclass subclass"):
            register_scorer(int, "test_int")

        @dataclass
        class Unprotected(Scorer):  # overriding scores() would bypass the declared protection
            def scores(self, ctx):
                return ctx.k.norm(dim=-1)

        with pytest.raises(UserError, match=r"overrides scores\(\), the old scorer API: rename it to score\(ctx\)"):
            register_scorer(Unprotected, "test_unprotected")
    finally:
        SCORERS.pop("test_doubled", None)
        SCORERS.pop("test_doubled_dec", None)
