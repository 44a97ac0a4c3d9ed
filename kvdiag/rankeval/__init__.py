"""Rank evaluation: how well eviction scores predict oracle eviction damage (``kvdiag rank-eval``)."""

from kvdiag.rankeval.bootstrap import holm, paired_p_value, percentile_ci, prompt_multiplicities
from kvdiag.rankeval.evaluate import (
    KEYS,
    METRICS,
    SCOPES,
    RankEvalConfig,
    RankEvalResult,
    check_inputs,
    harm_threshold,
    parse_harm,
    rank_eval,
    unresolved,
)
from kvdiag.rankeval.metrics import (
    Rankings,
    auroc,
    average_precision,
    eviction_counts,
    n_evicted,
    ranking_metrics,
    spearman,
    topk_recall,
)
from kvdiag.rankeval.tables import TABLE3_COLUMNS, caption, to_latex, to_markdown

__all__ = [
    "KEYS",
    "METRICS",
    "SCOPES",
    "TABLE3_COLUMNS",
    "RankEvalConfig",
    "RankEvalResult",
    "Rankings",
    "auroc",
    "average_precision",
    "caption",
    "check_inputs",
    "eviction_counts",
    "harm_threshold",
    "holm",
    "n_evicted",
    "paired_p_value",
    "parse_harm",
    "percentile_ci",
    "prompt_multiplicities",
    "rank_eval",
    "ranking_metrics",
    "spearman",
    "to_latex",
    "to_markdown",
    "topk_recall",
    "unresolved",
]
