"""The scorer zoo: one small dataclass per eviction rule, registered by name; higher score = keep.

Flat API::

    from kvdiag.scorers import SCORERS, get_scorer, register_scorer, Scorer, ScoreContext, score_trace

Modules: ``base`` (the Scorer template: raw ``score()``, declared ``protected()`` entries and needs), ``context``
(ScoreContext), ``registry`` (SCORERS, register_scorer, get_scorer, plugins), ``normalization`` (percentile rank,
z-score, protection, aggregations), ``run`` (score_trace), ``bench``, one module per rule.
"""

from kvdiag.scorers.base import QueryWindowScorer, Scorer, check_scores, needs_o_proj
from kvdiag.scorers.context import HistoryUnavailable, ScoreContext
from kvdiag.scorers.normalization import AGGREGATIONS, percentile_rank, protect, zscore
from kvdiag.scorers.registry import (
    ENTRY_POINT_GROUP,
    SCORERS,
    get_scorer,
    load_plugin_rules,
    load_plugins,
    parse_params,
    register_scorer,
    resolve_scorers,
    scorer_names,
)

# isort: off
# importing each module registers its scorer(s), in this order (the columns of `--scorers all`)
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
from kvdiag.scorers.vase import VaSE
from kvdiag.scorers.cake import CAKE
from kvdiag.scorers.obcache import OBCache
from kvdiag.scorers.longflow import LongFlow
from kvdiag.scorers.fitted import Fitted  # not in --scorers all: needs --param fitted.path=model.json
from kvdiag.scorers import kvpress_press  # noqa: F401  (registers the kvpress: resolver; kvpress loads on first use)
# isort: on

from kvdiag.scorers.run import KEY_COLUMNS, checkpoint_keys, default_checkpoints, score_trace

__all__ = [
    "AGGREGATIONS", "ENTRY_POINT_GROUP", "KEY_COLUMNS", "SCORERS",
    "AttentionScorer", "AttentionXAge", "AvoKVE", "AvoKVENoDelay", "AvoKVENoPayload", "AvoKVENoRedundancy",
    "AvoKVERaw", "CAKE", "Fitted", "H2O", "HistoryUnavailable", "KNorm", "LazyEviction", "LongFlow", "OBCache",
    "QueryWindowScorer", "RKV", "RandomScorer", "ScoreContext", "Scorer", "SnapKV", "StreamingLLM", "TOVA",
    "ThinKVProxy", "VATP", "VaSE", "ValueNorm",
    "avokv_score", "check_scores", "checkpoint_keys", "default_checkpoints", "get_scorer", "lazyeviction_score",
    "load_plugin_rules", "load_plugins", "needs_o_proj", "parse_params", "percentile_rank", "protect",
    "register_scorer", "resolve_scorers", "rkv_importance", "score_trace", "scorer_names", "zscore",
]
