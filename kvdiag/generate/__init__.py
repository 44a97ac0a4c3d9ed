"""Generation under a kvdiag rule: the positioned cache, the evicting cache for ``model.generate``, and the live
scoring they share with ``kvdiag replay``.

Flat API::

    from kvdiag.generate import EvictingCache, PositionedCache, PositionedLayer, Policy, use_kvdiag_attention

Modules: ``live`` (rules on a live cache), ``policy`` (budget, schedule, the choice at a checkpoint), ``evicting``
(:class:`EvictingCache`). The positioned cache and its attention function live at the floor below every stage,
``kvdiag.cache`` (the Trace recorder uses them too), and are re-exported here. See docs/generate.md.
"""

from kvdiag.cache import PositionedCache, PositionedLayer, QueryWindow, observing, position_mask, use_kvdiag_attention
from kvdiag.generate.evicting import EvictingCache
from kvdiag.generate.live import check_live_scorer, live_scorer_names, make_scorer, score_layer
from kvdiag.generate.policy import Policy, choose, live_scores, prompt_chunks

__all__ = [
    "EvictingCache", "Policy", "PositionedCache", "PositionedLayer", "QueryWindow", "check_live_scorer", "choose",
    "live_scorer_names", "live_scores", "make_scorer", "observing", "position_mask", "prompt_chunks", "score_layer",
    "use_kvdiag_attention",
]
