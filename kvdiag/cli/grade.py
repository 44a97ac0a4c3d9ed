"""``kvdiag grade RULE.py|NAME``: grade a rule against a fixed, versioned benchmark; ``--all``: the leaderboard."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from kvdiag.cli import common
from kvdiag.core.progress import plain_console


def grade(
    rule_spec: str | None = typer.Argument(None, help="a .py file or module that registers a rule, or a registered "
                                           "rule name (kvpress:<Press> and fitted:PATH included)"),
    bench: str = typer.Option("math500-smollm2@1", "--bench", help="benchmark NAME@VERSION shipped in "
                              "data/kvdiag-bench (or its directory)"),
    rule: str | None = common.flag("--rule", None, "the rule to grade when the plugin registers several"),
    param: list[str] | None = common.flag("--param", None, "rule.key=value, repeatable"),
    out: Path | None = common.flag("--out", None, "output directory (default runs/grade/<rule>)"),
    all_: bool = typer.Option(False, "--all", help="grade every built-in rule and gradable kvpress press: the "
                              "leaderboard (the first run of a benchmark version also stores them in it)"),
    leaderboard: Path | None = typer.Option(None, "--leaderboard", help="with --all: also write the leaderboard "
                                            "Markdown here (e.g. reports/leaderboard.md)"),
    horizon: str | None = common.flag("--horizon", None, "grade at N teacher-forced steps or rest (to the end "
                                       "of each prompt) instead of the benchmark's horizon; no regret or place "
                                       "against its sealed rows then"),
    no_cache: bool = typer.Option(False, "--no-cache", help="rebuild q/k/v by a prefill instead of reading (and "
                                  "writing) the rule-independent cache under $KVDIAG_CACHE"),
    quiet: bool = common.Quiet,
) -> None:
    """Grade a rule on a shipped benchmark: how it ranks single-entry damage, and the exact joint damage of its
    decisions at the benchmark's budgets, against the oracle and the built-in rules; prints its leaderboard row."""
    from kvdiag.core.errors import UserError
    from kvdiag.core.io import read_json
    from kvdiag.core.parsing import parse_params
    from kvdiag.scorers.fitted_file import check_fitted, fitted_paths, trace_evaluation
    from kvdiag.scorers.names import check_rule_source, is_plugin_spec
    from kvdiag.scorers.plugin_check import check_plugin_files

    if all_ == (rule_spec is not None):
        raise UserError("pass a rule to grade (a .py file, a module or a registered name) or --all, not both")
    if leaderboard is not None and not all_:
        raise UserError("--leaderboard applies with --all only; drop it")
    check_rule_source(rule_spec, rule, all_)
    if rule_spec is not None and is_plugin_spec(rule_spec):
        check_plugin_files([rule_spec])  # what its source shows, before its import pulls in torch
    params = parse_params(param)
    from kvdiag.core.stats import format_test
    from kvdiag.grade import benchmark as bench_mod
    from kvdiag.grade.run import RANK_METRICS, grade_files  # the stage, once the arguments are checked

    if fitted_paths([rule_spec] if rule_spec else [], params):  # against the benchmark's prompts and model
        manifest = read_json(bench_mod.load(bench).file("trace/manifest.json"), "the benchmark's trace manifest")
        check_fitted([rule_spec], params, trace_evaluation(manifest, f"--bench {bench}"))
    if horizon is not None:  # refused on the benchmark's own files, before transformers is imported
        from kvdiag.grade.run import horizon_plan

        horizon_plan(bench_mod.load(bench), horizon)
    common.quiet_transformers()
    name = "all" if all_ else Path(rule_spec).stem
    res = grade_files(rule_spec, bench, out or Path("runs/grade") / name, rule=rule, params=params,
                      everything=all_, leaderboard=leaderboard, show_progress=not quiet, horizon=horizon,
                      cache=not no_cache)
    budgets = [k.split("@", 1)[1] for k in res["rows"][0] if k.startswith("joint@") and not k.endswith("_ci")]
    table = Table(title=f"kvdiag grade on {res['rows'][0]['bench']}")
    for col in ["rule", *RANK_METRICS, *(f"joint @ {b}" for b in budgets)]:
        table.add_column(col, justify="left" if col == "rule" else "right")

    def cell(row, key):
        v, ci = row.get(key), row.get(f"{key}_ci")
        if v is None or v != v:
            return "n/a"
        return f"{v:.3g}" + ("" if not ci or ci[0] != ci[0] else f" [{ci[0]:.3g}, {ci[1]:.3g}]")

    for row in res["rows"]:
        table.add_row(row["rule"], *(cell(row, m) for m in RANK_METRICS),
                      *(f"{cell(row, f'joint@{b}')} ({row.get(f'decided@{b}')})" for b in budgets))
    console = plain_console()
    console.print(table)
    for row in res["rows"] if not all_ else []:
        for b in budgets:
            extra = [f"regret vs oracle_greedy: per checkpoint {cell(row, f'regret_geomean@{b}')}x (ratio of means "
                     f"{cell(row, f'regret@{b}')}x)"] if f"regret@{b}" in row else []
            if f"place@{b}" in row:
                extra.append(f"place {row[f'place@{b}']}")
            if f"vs_best@{b}" in row:
                v = row[f"vs_best@{b}"]
                extra.append(f"vs best ({v['best']}): {v['diff']:+.3g} [{v['ci'][0]:+.3g}, {v['ci'][1]:+.3g}], "
                             + format_test(v))
            if extra:
                console.print(f"{row['rule']} @ {b}: " + "; ".join(extra), highlight=False)
        if row.get("horizon_note"):
            console.print(f"{row['rule']}: {row['horizon_note']}", highlight=False)
        if not row.get("ranks", True):
            console.print(f"{row['rule']}: {row['note']}", highlight=False)
    console.print("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in res["timings"].items()), highlight=False)
