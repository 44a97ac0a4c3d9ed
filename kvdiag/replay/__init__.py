"""``kvdiag replay``: decode under a bounded, periodically compacted cache and measure the damage.

Flat API::

    from kvdiag.replay import Policy, decode, teacher_force, full_logprobs, kl_steps, replay, ReplaySettings

The bounded cache, its policy and the live scoring live in ``kvdiag.generate`` (one cache for replay and
``model.generate``). Modules: ``decoding``
(free-running and teacher-forced decoding, the full-cache reference, KL), ``settings`` (the sweep's settings and
checks), ``units`` (its work items and their part fingerprints), ``free_running`` and ``teacher_forced`` (the two
modes: items, fingerprints, runner), ``run`` (the sweep).
"""

from kvdiag.generate import (
    Policy,
    QueryWindow,
    check_live_scorer,
    live_scorer_names,
    make_scorer,
    observing,
    prompt_chunks,
    score_layer,
)
from kvdiag.parsing import Selection
from kvdiag.replay.decoding import Decoded, decode, full_logprobs, kl_steps, teacher_force
from kvdiag.replay.free_running import FreeRunning, check_answer
from kvdiag.replay.run import FULL_KV, replay
from kvdiag.replay.settings import ReplaySettings, check_settings
from kvdiag.replay.teacher_forced import TeacherForced
from kvdiag.selection import select_keep

__all__ = [
    "FULL_KV", "Decoded", "FreeRunning", "Policy", "QueryWindow", "ReplaySettings", "Selection",
    "TeacherForced", "check_answer", "check_live_scorer", "check_settings", "decode", "full_logprobs", "kl_steps",
    "live_scorer_names", "make_scorer", "observing", "prompt_chunks", "replay", "score_layer", "select_keep",
    "teacher_force",
]
