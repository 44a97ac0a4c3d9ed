"""``kvdiag replay``: decode under a bounded, periodically compacted cache and measure the damage.

Flat API::

    from kvdiag.replay import Policy, decode, teacher_force, full_logprobs, kl_steps, replay, ReplaySettings

Modules: ``cache`` (the bounded cache and its policy), ``live`` (scorers on a compacted cache), ``decoding``
(free-running and teacher-forced decoding, the full-cache reference, KL), ``run`` (the sweep).
"""

from kvdiag.replay.cache import Policy, ReplayCache
from kvdiag.replay.decoding import Decoded, decode, full_logprobs, kl_steps, prompt_chunks, teacher_force
from kvdiag.replay.live import (
    QueryWindow,
    check_live_scorer,
    live_scorer_names,
    make_scorer,
    observing,
    score_layer,
    select_keep,
)
from kvdiag.replay.run import FULL_KV, ReplaySettings, check_answer, check_settings, replay

__all__ = [
    "FULL_KV", "Decoded", "Policy", "QueryWindow", "ReplayCache", "ReplaySettings", "check_answer", "check_live_scorer",
    "check_settings", "decode", "full_logprobs", "kl_steps", "live_scorer_names", "make_scorer", "observing",
    "prompt_chunks", "replay", "score_layer", "select_keep", "teacher_force",
]
