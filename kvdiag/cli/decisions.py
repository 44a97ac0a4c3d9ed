"""``kvdiag decisions``: the exact joint damage of the set each rule evicts under each budget."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli import common
from kvdiag.core import parsing
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console


def decisions(
    ctx: typer.Context,
    trace: Path = common.flag("--trace", ..., "Trace directory written by kvdiag trace"),
    scores: Path = common.flag("--scores", ..., "scores.parquet with head rows of every cached entry at each "
                                "checkpoint (kvdiag score --checkpoints ... --granularity head)"),
    out: Path = common.flag("--out", ..., "output directory (decisions.parquet, summary.md, figure; parts/)"),
    labels: Path | None = common.flag("--labels", None, "exact single labels of every entry at the same "
                                       "checkpoints (kvdiag label --candidates all): oracle_single, additivity, pairs"),
    keep: list[str] | None = common.flag("--keep", None, "keep fractions in (0, 1), comma-separated, repeatable, "
                                          "e.g. 0.5,0.25,0.125 " + common.BUDGET_TERMS),
    budget: list[str] | None = common.flag("--budget", None, "or budgets: entries kept per layer and KV head "
                                            + common.BUDGET_TERMS),
    selection: str = common.flag("--selection", "per-head", "per-head (each layer and KV head keeps its own top "
                                  "B, as replay), per-token (one keep set) or stochastic[:TAU] (each layer and KV "
                                  "head draws its evictions from softmax(-rank / TAU), beside the per-head set)"),
    draws: int | None = typer.Option(None, "--draws", "--samples", help="stochastic selection: draws per (rule, "
                                     "budget, checkpoint) (default 4; --samples is the deprecated name)"),
    horizon: str | None = common.flag("--horizon", None, "teacher-forced steps per joint label, N or rest (to "
                                       "the end of each prompt; default: the labels' horizon, else 16)"),
    scorers: list[str] | None = common.flag("--scorers", None, "score columns to grade, comma-separated, "
                                             "repeatable (default: all)"),
    references: list[str] | None = typer.Option(None, "--references", help="oracle_single, oracle_greedy, fast, "
                                                "random, future_attention, oracle_search (default: the first four; "
                                                "oracle_single only with --labels)"),
    read_window: str | None = typer.Option(None, "--read-window", help="the first N steps of the judged window "
                                           "(--horizon) the references that read the future (oracle_single's labels, "
                                           "fast, oracle_greedy, oracle_search, future_attention) choose on; the "
                                           "steps after them are held out; N or rest (with --horizon rest); default: "
                                           "the whole judged window"),
    future_window: str | None = typer.Option(None, "--future-window", help="future_attention: the future queries "
                                             "read, N or rest (to the end of the prompt); default: --read-window"),
    search_rows: int = common.flag("--search-rows", 512, "oracle_search: sets labeled per (checkpoint, budget) "
                                    "beyond its candidates' (a descent step each, and the result's exact row)"),
    search_seconds: float = common.flag("--search-seconds", 120.0, "oracle_search: no new step after this "
                                         "many seconds per (checkpoint, budget) (0: no time bound)"),
    search_from: list[Path] | None = typer.Option(
        None, "--search-from", metavar="PARQUET", help="oracle_search: also start from the lowest set of this "
        "earlier run's decisions.parquet (the same Trace and selection) at each checkpoint and budget it shares with "
        "this run, labeled again here; repeatable (continues an earlier search)"),
    greedy_chunk: float = typer.Option(0.125, "--greedy-chunk", help="oracle_greedy evicts ceil(F * t) entries per "
                                       "step, relabelling the survivors each step"),
    pairs: int = typer.Option(1, "--pairs", help="per checkpoint, the most damaging sets searched for superadditive "
                              "pairs (0: none)"),
    pair_candidates: int = typer.Option(16, "--pair-candidates", help="harmless members of such a set paired"),
    infeasible: str = typer.Option("refuse", "--infeasible", help="a rule protecting more entries than a budget "
                                   "keeps: refuse (exit 2) or skip (recorded as undefined)"),
    reference: str = typer.Option("best", "--reference", help="paired comparisons against: best (the best rule at "
                                  "each budget), a decision name, or none"),
    bootstrap: int = common.Bootstrap,
    seed: int = common.Seed,
    harm: str = common.Harm,
    noise_mult: float = common.NoiseMult,
    include_unresolved: bool = common.IncludeUnresolved,
    batch_size: int = common.flag("--batch-size", 16, "set rows per forward"),
    backend: str = common.flag("--backend", "auto", "attention kernel: auto | torch | triton"),
    model: str | None = common.flag("--model", None, "the Trace's model (default: its manifest's)"),
    dtype: str | None = common.flag("--dtype", None, "default: the Trace's"),
    device: str = common.Device,
    quiet: bool = common.Quiet,
) -> None:
    """Label the set each rule evicts under each budget exactly and compare the decisions with oracle references."""
    check_outputs({"--out": (out, "dir")}, {"--trace": trace, "--scores": scores, "--labels": labels,
                                           "--search-from": search_from})
    from kvdiag.core.errors import UserError
    from kvdiag.core.harm import HarmSpec
    from kvdiag.core.io import check_table
    from kvdiag.core.schema import HORIZON
    from kvdiag.decisions import REFERENCES, DecisionsConfig, budgets_from  # light: the config, not the stage
    from kvdiag.decisions.config import DEFAULT_REFERENCES, check_reference, checkpoints_of, rule_columns
    from kvdiag.trace.manifest import TraceFiles

    if draws is not None and not selection.startswith("stochastic"):
        raise UserError(f"--draws applies to --selection stochastic[:TAU] only (got --selection {selection}); "
                        "drop it")
    budgets = budgets_from(parsing.parse_list(keep, "--keep", float, low=0, high=1, strict=True, example="0.5,0.25"),
                           parsing.parse_list(budget, "--budget", int, low=1, example="64,128"))
    refs = parsing.parse_list(references, "--references", str, choices=REFERENCES) or list(DEFAULT_REFERENCES)
    if labels is None and references is None:
        refs = [r for r in refs if r != "oracle_single"]  # by default it joins only when labels can define it
    if "oracle_search" not in refs:
        common.refuse_given(ctx, ["search_rows", "search_seconds", "search_from"],
                            "without oracle_search in --references")
    label_meta = check_table(labels, "--labels") if labels is not None else {}
    if horizon is None and read_window is None:
        horizon = (label_meta.get("config") or {}).get("horizon")
    cfg = DecisionsConfig(
        budgets=budgets, selection=selection, samples=4 if draws is None else draws, horizon=horizon or HORIZON,
        rules=tuple(parsing.parse_list(scorers, "--scorers", str)) or None, references=tuple(refs),
        greedy_chunk=greedy_chunk, pairs=pairs, pair_candidates=pair_candidates, infeasible=infeasible, seed=seed,
        n_boot=bootstrap, reference=reference, batch_size=batch_size, backend=backend,
        harm=HarmSpec(harm, noise_mult, include_unresolved), read_window=read_window, future_window=future_window,
        search_rows=search_rows, search_seconds=search_seconds, search_from=tuple(search_from or ()),
    )
    parsing.check_backend(backend, device)
    parsing.check_device_name(device)
    if dtype is not None:
        parsing.check_dtype(dtype)
    trace_files = TraceFiles(trace)
    from kvdiag.core.contracts import belongs, read_labels, read_scores  # polars and pyarrow: only now
    # the scores' and labels' contracts (readable, keyed, finite, unique keys) and the Trace of each, before torch
    score_df, score_meta = read_scores(scores)
    belongs(trace_files, score_meta, f"--scores {scores}")
    if labels is not None:
        read_labels(labels)
        belongs(trace_files, label_meta, f"--labels {labels}")
    check_reference(cfg, rule_columns(score_df, cfg.rules))
    if model is not None:  # another model than the Trace's, told from names and configs before anything loads
        from kvdiag.model.specs import check_model_spec, check_trace_model

        check_trace_model(check_model_spec(model), trace_files.manifest["model"])
        trace_files.check_vocabulary_of(model)
    items = checkpoints_of(score_df, trace_files, cfg)[0]
    cfg.check_future(trace_files.manifest, items)
    if cfg.search_from:  # each file a decisions table of this Trace and selection, sharing a checkpoint and budget
        from kvdiag.decisions.imported import check_search_from

        check_search_from(trace_files, cfg, items)
    from kvdiag.decisions import decisions_files  # the stage: torch and the model, once the arguments are checked

    common.quiet_transformers()
    path = decisions_files(trace, scores, out, cfg, labels=labels, model=model, dtype=dtype, device=device,
                           show_progress=not quiet)
    plain_console(stderr=True).print(f"decisions written to {path} (decisions.parquet, summary.md, decisions.png)")
    if not quiet:
        plain_console().print((path / "summary.md").read_text(), markup=False, highlight=False)

