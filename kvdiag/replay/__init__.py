"""``kvdiag replay``: decode under a bounded, periodically compacted cache and measure the damage.

Flat API::

    from kvdiag.replay import Policy, decode, teacher_force, full_logprobs, kl_steps, replay, ReplaySettings

The bounded cache, its policy and the live scoring live in ``kvdiag.generate`` (one cache for replay and
``model.generate``). Modules: ``decoding``
(free-running and teacher-forced decoding, the full-cache reference, KL), ``config`` (the sweep's settings and
checks), ``units`` (its work items and their part fingerprints), ``free_running`` and ``teacher_forced`` (the two
modes: items, fingerprints, runner), ``run`` (the sweep).
"""

from __future__ import annotations

from kvdiag.core.lazy import lazy_exports
from kvdiag.core.parsing import Selection

# the module that defines each exported name (a bare name: a submodule of kvdiag.replay)
_HOME = {
    "Policy": "kvdiag.generate.policy", "prompt_chunks": "kvdiag.generate.policy",
    "QueryWindow": "kvdiag.cache.attend", "observing": "kvdiag.cache.attend",
    "check_live_scorer": "kvdiag.generate.live", "live_scorer_names": "kvdiag.generate.live",
    "make_scorer": "kvdiag.generate.live", "score_layer": "kvdiag.generate.live",
    "select_keep": "kvdiag.core.selection",
    "Decoded": "decoding", "decode": "decoding", "full_logprobs": "decoding", "kl_steps": "decoding",
    "teacher_force": "decoding",
    "FreeRunning": "free_running", "check_answer": "free_running",
    "FULL_KV": "run", "replay": "run",
    "ReplaySettings": "config", "check_settings": "config",
    "TeacherForced": "teacher_forced",
}
__all__ = ["Selection", *_HOME]

# Each name loads its module on first use: the CLI checks a replay's settings (``settings``, ``sampling``:
# no torch) before the stage's torch and transformers are imported.
__getattr__ = lazy_exports(__name__, _HOME)
