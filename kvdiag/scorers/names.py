"""The built-in scorers' names, importable without torch (``kvdiag.scorers`` imports it): the CLI refuses an
unknown ``--scorers`` name before any heavy import. tests/test_bad_input.py checks that this list is the registry's."""

from __future__ import annotations

import os

from kvdiag.core.errors import UserError

BUILTIN_SCORERS = (
    "attention", "attention_x_age", "h2o", "snapkv", "tova", "streamingllm", "rkv", "lazyeviction", "thinkv", "knorm",
    "value_norm", "vatp", "random", "avokv_e", "avokv_e_no_payload", "avokv_e_no_delay", "avokv_e_raw",
    "avokv_e_no_redundancy", "vase", "cake", "obcache", "longflow", "fitted",
)
ENTRY_POINT_GROUP = "kvdiag.scorers"  # installed plugins (kvdiag.scorers.registry loads them)
PREFIXES = ("fitted:", "kvpress:")  # names made on first use by a resolver (kvdiag.scorers.fitted, kvpress_press)
# the per-entry features of the fitted rule (the keys of kvdiag.scorers.entry_features.FEATURES)
ENTRY_FEATURES = ("window_attention", "newest_attention", "cumulative_attention", "recurrence", "key_norm",
                  "value_norm", "redundancy", "log_age", "is_prompt", "log_position", "relative_position",
                  "cell_layer", "cell_kv_head",
                  "rank_snapkv", "rank_cake", "rank_tova", "rank_avokv_e", "rank_vase", "rank_rkv", "rank_obcache")
CELL_FEATURES = ("cell_layer", "cell_kv_head")  # constant within a (layer, KV head) cell: fitted on cell rows only
AGGREGATIONS = ("mean_rank", "mean_raw")  # the keys of kvdiag.scorers.AGGREGATIONS
ORACLE = "oracle"  # the policy name of replay's exact-label policy (teacher-forced only), not a scorer
# replay's future-attention policy (teacher-forced only): per (layer, KV head), what the full-cache run's future reads
ORACLE_FUTURE = "oracle_future"
REPLAY_ONLY = (ORACLE, ORACLE_FUTURE)


def check_scorer_names(names: list[str], flag: str = "--scorers", also: tuple[str, ...] = ()) -> None:
    """Refuse a name that is no built-in scorer, ``all`` or a prefixed name (a plugin's names are checked once it
    is loaded: call this only without --plugin)."""
    for name in names:
        if name != "all" and name not in BUILTIN_SCORERS + also and not name.startswith(PREFIXES):
            raise UserError(f"{flag}: unknown scorer {name!r}: use one of {', '.join(BUILTIN_SCORERS)} (or a name "
                            f"starting with {', '.join(PREFIXES)}; or load yours with --plugin)")


def check_eligible(name: str | None, known=BUILTIN_SCORERS) -> None:
    """``--eligible`` names a registered scorer (``known``; the CLI's rank-eval loads no plugin: the built-ins),
    whose ``protected()`` picks the candidates."""
    if name is not None and name not in known:
        raise UserError(f"--eligible {name}: not a registered scorer; use one of {', '.join(known)}")


def check_rule_source(spec: str | None, rule: str | None, everything: bool = False) -> None:
    """``--rule`` picks among a plugin's rules: with a registered name there would be two sources of the rule, and
    one would be graded silently."""
    if not everything and spec is not None and rule is not None and not is_plugin_spec(spec):
        raise UserError(f"--rule {rule} applies to a plugin that registers several rules; {spec} is a registered "
                        f"name: grade {rule} or {spec}, and drop --rule")


def is_plugin_spec(spec: str) -> bool:
    """A rule given as a plugin (a ``.py`` file or a path), not a registered name; a prefixed name
    (``fitted:dir/model.json``, ``kvpress:<Press>``) is a name, its path notwithstanding."""
    prefixed = ":" in spec.split(os.sep, 1)[0] and not os.path.exists(spec)
    return not prefixed and (spec.endswith(".py") or os.sep in spec)
