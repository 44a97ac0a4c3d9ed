"""Rank evaluation: how well eviction scores predict oracle eviction damage (``kvdiag rank-eval``).

The metrics are registered by name (``METRICS``, ``register_metric``); built-ins in ``metrics.py``.
"""

from kvdiag.core.harm import HarmSpec, harm_threshold, parse_harm, unresolved
from kvdiag.core.stats import holm, paired_p_value, percentile_ci, prompt_multiplicities
from kvdiag.rankeval.evaluate import KEYS, SCOPES, RankEvalConfig, RankEvalResult, check_inputs, rank_eval
from kvdiag.rankeval.metrics import (
    Rankings,
    TieStats,
    auroc,
    average_precision,
    eviction_counts,
    n_evicted,
    ranking_metrics,
    spearman,
    topk_recall,
)
from kvdiag.rankeval.registry import METRICS, Counts, Metric, metrics_where, register_metric
from kvdiag.rankeval.tables import caption, to_latex, to_markdown

__all__ = [
    "KEYS", "METRICS", "SCOPES", "Counts", "HarmSpec", "Metric", "RankEvalConfig", "RankEvalResult", "Rankings",
    "TieStats", "auroc", "average_precision", "caption", "check_inputs", "eviction_counts", "harm_threshold", "holm",
    "metrics_where", "n_evicted", "paired_p_value", "parse_harm", "percentile_ci", "prompt_multiplicities", "rank_eval",
    "ranking_metrics", "register_metric", "spearman", "to_latex", "to_markdown", "topk_recall", "unresolved",
]
