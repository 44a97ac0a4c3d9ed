"""The built-in scorers' names, importable without torch (``kvdiag.scorers`` imports it): the CLI refuses an
unknown ``--scorers`` name before any heavy import. tests/test_bad_input.py checks that this list is the registry's."""

from __future__ import annotations

from kvdiag.errors import UserError

BUILTIN_SCORERS = (
    "attention", "attention_x_age", "h2o", "snapkv", "tova", "streamingllm", "rkv", "lazyeviction", "thinkv", "knorm",
    "value_norm", "vatp", "random", "avokv_e", "avokv_e_no_payload", "avokv_e_no_delay", "avokv_e_raw",
    "avokv_e_no_redundancy", "vase", "cake", "obcache", "longflow", "fitted",
)
PREFIXES = ("fitted:", "kvpress:")  # names made on first use by a resolver (kvdiag.scorers.fitted, kvpress_press)
# the per-entry features of the fitted rule (the keys of kvdiag.scorers.entry_features.FEATURES)
ENTRY_FEATURES = ("window_attention", "newest_attention", "cumulative_attention", "recurrence", "key_norm",
                  "value_norm", "redundancy", "log_age", "is_prompt")
AGGREGATIONS = ("mean_rank", "mean_raw")  # the keys of kvdiag.scorers.AGGREGATIONS
REPLAY_ONLY = ("oracle",)  # replay's teacher-forced oracle policy, not a scorer


def check_scorer_names(names: list[str], flag: str = "--scorers", also: tuple[str, ...] = ()) -> None:
    """Refuse a name that is no built-in scorer, ``all`` or a prefixed name (a plugin's names are checked once it
    is loaded: call this only without --plugin)."""
    for name in names:
        if name != "all" and name not in BUILTIN_SCORERS + also and not name.startswith(PREFIXES):
            raise UserError(f"{flag}: unknown scorer {name!r}: use one of {', '.join(BUILTIN_SCORERS)} (or a name "
                            f"starting with {', '.join(PREFIXES)}; or load yours with --plugin)")
