"""``kvdiag replay``: decode under a bounded, periodically compacted cache and measure the damage.

Flat API::

    from kvdiag.replay import Policy, decode, teacher_force, full_logprobs, kl_steps, replay, ReplaySettings

Modules: ``cache`` (the bounded cache and its policy), ``live`` (scorers on a compacted cache), ``decoding``
(free-running and teacher-forced decoding, the full-cache reference, KL), ``settings`` (the sweep's settings and
checks), ``units`` (its work items and their part fingerprints), ``free_running`` and ``teacher_forced`` (the two
modes: items, fingerprints, runner), ``run`` (the sweep).
"""

from __future__ import annotations

import importlib

from kvdiag.parsing import Selection

# the submodule that defines each exported name
_HOME = {
    "Policy": "cache", "ReplayCache": "cache",
    "Decoded": "decoding", "decode": "decoding", "full_logprobs": "decoding", "kl_steps": "decoding",
    "prompt_chunks": "decoding", "teacher_force": "decoding",
    "FreeRunning": "free_running", "check_answer": "free_running",
    "QueryWindow": "live", "check_live_scorer": "live", "live_scorer_names": "live", "make_scorer": "live",
    "observing": "live", "score_layer": "live", "select_keep": "live",
    "FULL_KV": "run", "replay": "run",
    "ReplaySettings": "settings", "check_settings": "settings",
    "TeacherForced": "teacher_forced",
}
__all__ = ["Selection", *_HOME]


def __getattr__(name: str):
    """Each name loads its submodule on first use: the CLI checks a replay's settings (``settings``, ``sampling``:
    no torch) before the stage's torch and transformers are imported."""
    if name in _HOME:
        return getattr(importlib.import_module(f"kvdiag.replay.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
