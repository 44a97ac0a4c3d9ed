"""The scorer zoo: one small dataclass per eviction rule, registered by name; higher score = keep.

Flat API::

    from kvdiag.scorers import SCORERS, get_scorer, register_scorer, Scorer, ScoreContext, score_trace

Modules: ``context`` (ScoreContext), ``registry`` (Scorer, register_scorer, get_scorer), ``normalization``
(percentile rank, z-score, protection, aggregations), ``run`` (score_trace), ``bench``, one module per rule.
"""

from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.normalization import AGGREGATIONS, percentile_rank, protect, zscore
from kvdiag.scorers.registry import SCORERS, Scorer, get_scorer, parse_params, register_scorer, scorer_names

# importing each module registers its scorer(s), in this order
from kvdiag.scorers.attention import AttentionScorer
from kvdiag.scorers.attention_x_age import AttentionXAge
from kvdiag.scorers.h2o import H2O
from kvdiag.scorers.snapkv import SnapKV
from kvdiag.scorers.tova import TOVA
from kvdiag.scorers.streamingllm import StreamingLLM
from kvdiag.scorers.rkv import RKV, rkv_importance
from kvdiag.scorers.lazyeviction import LazyEviction, lazyeviction_score
from kvdiag.scorers.thinkv import ThinKVProxy
from kvdiag.scorers.knorm import KNorm
from kvdiag.scorers.value_norm import ValueNorm
from kvdiag.scorers.vatp import VATP
from kvdiag.scorers.random_scorer import RandomScorer
from kvdiag.scorers.avokv_e import AvoKVE, avokv_score
from kvdiag.scorers.avokv_e_ablations import AvoKVENoDelay, AvoKVENoPayload, AvoKVENoRedundancy, AvoKVERaw
from kvdiag.scorers.fitted import Fitted  # not in --scorers all: needs --param fitted.path=model.json
from kvdiag.scorers.run import (
    ENTRY_POINT_GROUP,
    KEY_COLUMNS,
    checkpoint_keys,
    default_checkpoints,
    load_plugins,
    resolve_scorers,
    score_trace,
)

__all__ = [
    "AGGREGATIONS", "ENTRY_POINT_GROUP", "KEY_COLUMNS", "SCORERS",
    "AttentionScorer", "AttentionXAge", "AvoKVE", "AvoKVENoDelay", "AvoKVENoPayload", "AvoKVENoRedundancy",
    "AvoKVERaw", "Fitted", "H2O", "KNorm", "LazyEviction", "RKV", "RandomScorer", "ScoreContext", "Scorer", "SnapKV",
    "StreamingLLM", "TOVA", "ThinKVProxy", "VATP", "ValueNorm",
    "avokv_score", "checkpoint_keys", "default_checkpoints", "get_scorer", "lazyeviction_score", "load_plugins",
    "parse_params", "percentile_rank", "protect", "register_scorer", "resolve_scorers", "rkv_importance",
    "score_trace", "scorer_names", "zscore",
]
