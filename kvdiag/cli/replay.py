"""``kvdiag replay``: decode with a bounded cache compacted on a schedule, and measure the damage."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli import common
from kvdiag.core import parsing
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console
from kvdiag.core.schema import CHECKPOINT_INTERVAL, HORIZON


def replay(
    ctx: typer.Context,
    scorers: list[str] = common.flag("--scorers", ..., "Scorer name(s), comma-separated and "
                                      "repeatable, e.g. rkv,attention,avokv_e (--scorer is the deprecated name). "
                                      "Teacher-forced only: oracle (greedy on exact labels, per-token) and "
                                      "oracle_future (per cell, what the full-cache run's next queries attend most; "
                                      "--param oracle_future.window=N|rest, default interval + horizon).",
                                      names=("--scorers", "--scorer")),
    budget: list[str] = common.flag("--budget", ["256"], "KV budget(s): entries kept per layer and KV head, "
        "comma-separated and repeatable for a sweep, e.g. 128,256 " + common.BUDGET_TERMS + "."),
    interval: int = common.flag("--interval", CHECKPOINT_INTERVAL, "Generated tokens between compressions "
                                                                         "(R-KV: 128)."),
    w_obs: int | None = common.flag("--w-obs", None, "Observation window for every scorer's window/w_obs "
                                                           "(default: each scorer's own)."),
    selection: str = common.flag("--selection", "per-head", "per-head (each layer and KV head keeps its own top "
                                  "B, R-KV), per-token (one keep set) or stochastic[:TAU] (each layer and KV head "
                                  "draws its evictions, softmax(-rank/TAU); seeded by --seed)."),
    max_new_tokens: int = common.flag("--max-new-tokens", 512, "Generation cap; stopping there is a max-length "
                                                                     "hit."),
    teacher_forced: Path | None = typer.Option(None, "--teacher-forced", help="Trace directory: replay its tokens and "
        "report per-step KL instead of generating."),
    samples: int = common.flag("--samples", 1, "Free-running: generations per prompt (needs --temperature); "
                                "sample s of every policy shares FullKV's random draws."),
    temperature: float | None = common.flag("--temperature", None, "Free-running: sample at this temperature "
                                             "(default: greedy)."),
    top_p: float = common.flag("--top-p", 1.0, "Free-running: nucleus of the sampling (needs --temperature)."),
    batch_size: int = common.flag("--batch-size", 16, "Free-running: generations decoded together (rows of one "
                                   "prompt length and budget); changes no token."),
    horizon: int = common.flag("--horizon", HORIZON, "Teacher-forced: steps of the exact labels (each "
                                "compression's joint damage; the oracle policy).", **common.HORIZON_STEPS),
    outcomes: Path | None = typer.Option(None, "--outcomes", help="Teacher-forced: a free-running replay directory "
                                         "of the same prompts; correlate the joint labels with its fidelity."),
    auroc: tuple[Path, Path] | None = typer.Option(None, "--auroc", help="Teacher-forced: LABELS SCORES (kvdiag label "
                                                   "and kvdiag score of a Trace of the same task, every replayed rule "
                                                   "scored); correlate each rule's single-label AUROC with its "
                                                   "in-loop KL."),
    joint: bool = typer.Option(True, "--joint/--no-joint", help="Teacher-forced: label each compression's whole "
                               "evicted set exactly (joint_kl)."),
    out: Path = common.flag("--out", Path("runs/replay"), "Output directory (a rerun with the same settings "
                                                                "reuses finished parts)."),
    model: str | None = common.flag("--model", None, "Model (default: smollm2; with --teacher-forced the "
                                                           "Trace's model)."),
    prompts: str | None = common.flag("--prompts", None, "file.jsonl, file.txt or builtin:<suite>[:N[:LENGTH]] "
                                       "(arith, the default; recall); not with --teacher-forced."),
    limit: int | None = common.Limit,
    components: str | None = typer.Option(None, "--components", help="Free-running, builtin suites: the components "
                                          "the components table reports beside the task component (default: all)."),
    param: list[str] | None = common.flag("--param", None, "scorer.key=value, repeatable (e.g. "
                                                                 "rkv.mix_lambda=0.07)."),
    plugin: list[str] | None = common.flag("--plugin", None, "Module (or .py file) whose import registers "
                                                                   "scorers, repeatable."),
    full_kv: bool = typer.Option(True, "--full-kv/--no-full-kv", help="Also generate with the full cache (the FullKV "
                                                                      "reference row)."),
    kl: bool = typer.Option(True, "--kl/--no-kl", help="Free-running: KL of each generation against a full-cache "
                                                       "forward of it."),
    chat: bool = common.flag("--chat", True, "Apply the tokenizer's chat template."),
    instruction: str | None = common.flag("--instruction", None, "Text appended to each prompt (default: "
                                                                       "step-by-step + \\boxed{})."),
    no_instruction: bool = common.flag("--no-instruction", False, "Append nothing to the prompts."),
    backend: str = common.flag("--backend", "auto", "Compaction kernel: auto | torch | triton."),
    seed: int = common.Seed,
    dtype: str | None = common.flag("--dtype", None, "float32 (default) | float16 | bfloat16; with "
                                                           "--teacher-forced the Trace's dtype."),
    device: str = common.Device,
    revision: str | None = common.Revision,
    trust_remote_code: bool = common.TrustRemoteCode,
    quiet: bool = common.Quiet,
) -> None:
    """Generate (or teacher-force a Trace) under a KV budget compacted every --interval tokens; write
    generations.parquet, a Table-2-shaped summary and an accuracy/KL-vs-budget figure."""
    check_outputs({"--out": (out, "dir")}, {"--teacher-forced": teacher_forced, "--outcomes": outcomes,
                                           "--auroc": auroc, "--prompts": prompts, "--plugin": plugin})
    from kvdiag.core.io import check_table
    from kvdiag.model.specs import DEFAULT_MODEL, check_model_spec, context_of, spec_model_type, spec_windows
    from kvdiag.model.token_count import light_counter
    from kvdiag.replay.config import ReplaySettings, check_budgets, check_options, check_outcomes, replayed_prompts
    from kvdiag.scorers.fields import check_live_names, check_params
    from kvdiag.scorers.fitted_file import Evaluation, check_fitted, trace_evaluation
    from kvdiag.scorers.names import ORACLE, REPLAY_ONLY, check_scorer_names
    from kvdiag.scorers.plugin_check import check_plugin_files
    from kvdiag.tasks.prompts import DEFAULT_INSTRUCTION, load_prompts
    from kvdiag.tasks.suites import check_generation_room, select_components
    from kvdiag.trace.manifest import TraceFiles

    if teacher_forced is not None:  # the Trace fixes the tokens: generation settings cannot apply
        common.refuse_given(
            ctx, ["prompts", "max_new_tokens", "full_kv", "kl", "chat", "instruction", "no_instruction", "samples",
                  "temperature", "top_p", "batch_size", "components"],
            "with --teacher-forced (the Trace's tokens are replayed)",
        )
    else:  # exact labels need the Trace's future tokens
        common.refuse_given(ctx, ["horizon", "joint", "outcomes", "auroc"],
                            "without --teacher-forced (they need a Trace)")
    if no_instruction:
        common.refuse_given(ctx, ["instruction"], "with --no-instruction")
    # the checks that need no scorer class, model or tensor, before torch is imported (the rest: check_settings)
    settings = ReplaySettings(
        scorers=parsing.parse_list(scorers, "--scorers", str), interval=interval,
        budgets=parsing.parse_list(budget, "--budget", int, low=1, high=common.MAX_ENTRIES, example="128,256"),
        w_obs=w_obs, selection=selection, max_new_tokens=max_new_tokens, full_kv=full_kv,
        kl=kl, chat=chat, instruction=None if no_instruction else (instruction or DEFAULT_INSTRUCTION),
        params=parsing.parse_params(param), backend=backend, seed=seed, samples=samples, temperature=temperature,
        top_p=top_p, batch_size=batch_size, horizon=horizon, joint=joint,
    )
    check_options(settings, "free" if teacher_forced is None else "teacher_forced")
    check_plugin_files(plugin)
    if not plugin:
        check_scorer_names(settings.scorers, also=REPLAY_ONLY)
    check_params({k: v for k, v in settings.params.items() if k != ORACLE})  # the built-ins' (scorer_fields)
    check_live_names(settings.scorers)
    if model is not None:
        check_model_spec(model)
    if dtype is not None:
        parsing.check_dtype(dtype)
    parsing.check_device_name(device)
    parsing.check_backend(backend, device)
    if teacher_forced is not None:
        trace_files = TraceFiles(teacher_forced)
        if model is not None:
            trace_files.check_vocabulary_of(model, revision)
        recorded = trace_files.manifest["model"].get("attention") or {}
        check_budgets(settings, spec_windows(model, revision) if model is not None else recorded.get("windows"))
        check_fitted(settings.scorers, settings.params, trace_evaluation(
            trace_files.manifest, f"--teacher-forced {teacher_forced}", replayed_prompts(trace_files, limit)))
        if outcomes is not None:
            check_outcomes(outcomes, replayed_prompts(trace_files, limit))
        if auroc is not None:
            from kvdiag.rankeval.evaluate import check_inputs  # polars and numpy: only now

            check_inputs(check_table(auroc[0], "--auroc LABELS"), check_table(auroc[1], "--auroc SCORES"),
                         ("--auroc LABELS", "--auroc SCORES"))
    else:
        spec = model or DEFAULT_MODEL
        check_budgets(settings, spec_windows(spec, revision))
        source = prompts or "builtin:arith"
        items = load_prompts(source, limit=limit, seed=seed)
        check_fitted(settings.scorers, settings.params, Evaluation(
            f"--prompts {source}", {p.prompt_id: p.text for p in items}, spec, spec_model_type(spec, revision)))
        check_generation_room(items, max_new_tokens, source)  # a lower bound on any model's count
        counter = light_counter(spec, revision)
        if counter is not None:  # the exact counts, as the stage takes them once the model loads
            counter.check_room(items, max_new_tokens, context_of(spec, revision), source, chat, settings.instruction)
        if components is not None:
            components = select_components(source, parsing.parse_list(components, "--components", str))
    from kvdiag.replay.run import replay_files  # the stage: torch, once the arguments are checked
    from kvdiag.scorers import load_plugins

    common.quiet_transformers()
    load_plugins(plugin or ())
    path = replay_files(
        settings, out, teacher_forced=teacher_forced, prompts=prompts, limit=limit, model=model, seed=seed, dtype=dtype,
        device=device, revision=revision, trust_remote_code=trust_remote_code, show_progress=not quiet,
        outcomes=outcomes, auroc=auroc, components=components,
    )
    plain_console(stderr=True).print(f"replay written to {path} (generations.parquet, summary.md, budget.png)")
    if not quiet:
        plain_console().print((path / "summary.md").read_text())
