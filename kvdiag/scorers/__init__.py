"""The scorer zoo: one small dataclass per eviction rule, registered by name; higher score = keep.

Flat API::

    from kvdiag.scorers import SCORERS, get_scorer, register_scorer, Scorer, ScoreContext, score_trace

Modules: ``base`` (the Scorer template: raw ``score()``, declared ``protected()`` entries and needs), ``context``
(ScoreContext), ``registry`` (SCORERS, register_scorer, get_scorer, plugins), ``normalization`` (percentile rank,
z-score, protection, aggregations), ``run`` (score_trace), ``bench``, one module per rule, and ``zoo`` (imports
every rule). Importable without torch: ``names`` (the built-in names), ``fields`` (their parameters),
``plugin_check`` (a plugin file read as source) and ``fitted_file`` (the fitted rule's file and its held-out check),
which the CLI checks its arguments with before torch loads.
"""

from kvdiag.core.lazy import lazy_exports

# the submodule that defines each exported name; the zoo (every built-in rule) is imported before any of them
_HOME = {
    "AGGREGATIONS": "normalization", "percentile_rank": "normalization", "protect": "normalization",
    "zscore": "normalization",
    "QueryWindowScorer": "base", "Scorer": "base", "check_scores": "base", "needs_o_proj": "base",
    "HistoryUnavailable": "context", "ScoreContext": "context",
    "ENTRY_POINT_GROUP": "registry", "SCORERS": "registry", "get_scorer": "registry", "load_plugin_rules": "registry",
    "load_plugins": "registry", "parse_params": "registry", "register_scorer": "registry",
    "resolve_scorers": "registry", "scorer_names": "registry",
    "KEY_COLUMNS": "run", "checkpoint_keys": "run", "default_checkpoints": "run", "score_trace": "run",
    "AttentionScorer": "attention", "AttentionXAge": "attention_x_age", "H2O": "h2o", "SnapKV": "snapkv",
    "TOVA": "tova", "StreamingLLM": "streamingllm", "RKV": "rkv", "rkv_importance": "rkv",
    "LazyEviction": "lazyeviction", "lazyeviction_score": "lazyeviction", "ThinKVProxy": "thinkv", "KNorm": "knorm",
    "ValueNorm": "value_norm", "VATP": "vatp", "RandomScorer": "random_scorer", "AvoKVE": "avokv_e",
    "avokv_score": "avokv_e", "AvoKVENoDelay": "avokv_e_ablations", "AvoKVENoPayload": "avokv_e_ablations",
    "AvoKVENoRedundancy": "avokv_e_ablations", "AvoKVERaw": "avokv_e_ablations", "VaSE": "vase", "CAKE": "cake",
    "OBCache": "obcache", "LongFlow": "longflow", "Fitted": "fitted",
}
__all__ = sorted(_HOME)

__getattr__ = lazy_exports(__name__, _HOME, first="kvdiag.scorers.zoo")
