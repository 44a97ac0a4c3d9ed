"""``replay``: the sweep of ``kvdiag replay``. Every (prompt, scorer, budget) is decoded under its policy by the
replay mode (``free_running.FreeRunning`` or ``teacher_forced.TeacherForced``: its items, part fingerprints and
runner) and committed as its own part; the parts make generations.parquet, the Table-2-shaped summary and the budget
figure.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import polars as pl

from kvdiag.core.contracts import FULL_KV
from kvdiag.core.errors import UserError
from kvdiag.core.io import check_writable, write_json
from kvdiag.core.parts import PartStore
from kvdiag.core.progress import progress_bar
from kvdiag.core.provenance import command_line, provenance
from kvdiag.core.schema import HORIZON
from kvdiag.generate.live import check_live_scorer, make_scorer
from kvdiag.generate.policy import Policy
from kvdiag.model.load import LoadedModel, load_model
from kvdiag.model.specs import DEFAULT_MODEL
from kvdiag.replay.config import (
    ReplaySettings,
    check_outcomes,
    check_settings,
    future_window,
    read_outcomes,
    replayed_prompts,
)
from kvdiag.replay.decoding import Decoded
from kvdiag.replay.free_running import FreeRunning
from kvdiag.replay.oracle import ORACLE, ORACLE_FUTURE, FutureRule, OracleRule
from kvdiag.replay.predict import SingleLabelAUROC, single_label_auroc
from kvdiag.replay.teacher_forced import TeacherForced
from kvdiag.replay.units import Unit
from kvdiag.scorers.base import needs_o_proj
from kvdiag.scorers.features import o_proj_weights
from kvdiag.scorers.names import REPLAY_ONLY
from kvdiag.tasks.prompts import Prompt, load_prompts
from kvdiag.tasks.suites import Suite, check_generation_room, select_components, suite_of
from kvdiag.trace import Trace
from kvdiag.trace.manifest import TraceFiles


def build_policies(lm: LoadedModel, settings: ReplaySettings,
                   mode=FreeRunning) -> dict[tuple[str, int | None], Policy | None]:
    """(scorer, budget) -> Policy for the sweep (None: FullKV), each budget checked against the scorer's
    protected windows on a live cache of the model's head shape (bad input: UserError). ``mode``: the replay mode
    (class or instance) whose checks apply."""
    check_settings(settings, mode)
    group, head_dim = lm.attention.num_heads // lm.attention.num_kv_heads, lm.attention.qk_head_dim
    policies: dict[tuple[str, int | None], Policy | None] = {(FULL_KV, None): None} if settings.full_kv else {}
    for name in settings.scorers:
        oracle = name in REPLAY_ONLY
        if name == ORACLE:
            scorer = OracleRule(settings.horizon)
        elif name == ORACLE_FUTURE:
            scorer = FutureRule(future_window(settings))
        else:
            scorer = make_scorer(name, settings.params.get(name), settings.w_obs)
        for budget in settings.budgets:
            policy = Policy(scorer, budget, settings.interval, settings.selection, settings.backend, settings.seed)
            policy.check_model(lm.attention)  # sliding windows: per-token and budgets that evict nothing
            if not oracle:
                check_live_scorer(scorer, budget, settings.interval, group, head_dim)
            policies[(name, budget)] = policy
    return policies


def replay_files(
    settings: ReplaySettings, out: str | os.PathLike, teacher_forced: str | os.PathLike | None = None,
    prompts: str | None = None, limit: int | None = None, model: str | None = None, seed: int = 0,
    dtype: str | None = None, device: str = "cpu", revision: str | None = None, trust_remote_code: bool = False,
    show_progress: bool = True, outcomes: str | os.PathLike | None = None,
    auroc: tuple[str | os.PathLike, str | os.PathLike] | None = None, components: list[str] | None = None,
) -> Path:
    """What ``kvdiag replay`` runs: load the model and :func:`replay` the first ``limit`` prompts of ``prompts``
    (free-running; default ``builtin:arith`` on ``smollm2``) or of the Trace directory ``teacher_forced`` (its model
    unless ``model``, which must be the Trace's). Settings and ``out`` are checked before the model loads.
    ``auroc``: (labels, scores) files of a Trace of the same task, whose rank-eval AUROC per rule is correlated with
    the teacher-forced in-loop KL (``kvdiag.replay.predict.single_label_auroc``). ``components``: the components of
    the builtin suite the components table reports (None: all; ``kvdiag.tasks.suites.select_components``)."""
    check_settings(settings, FreeRunning if teacher_forced is None else TeacherForced)
    check_writable(out, "--out", "dir")
    if outcomes is not None:  # before the model loads
        replayed = None if teacher_forced is None else replayed_prompts(TraceFiles(teacher_forced), limit)
        check_outcomes(outcomes, replayed)
    single = None
    if auroc is not None:
        if teacher_forced is None or not settings.joint:
            raise UserError("--auroc correlates single-label AUROC with teacher-forced joint labels: give it with "
                            "--teacher-forced and --joint")
        single = replayed_auroc(settings, auroc, seed)
    if teacher_forced is not None:
        tr = Trace(teacher_forced)
        had = tr.manifest["model"]
        lm = load_model(
            model or had["spec"], dtype=dtype or had.get("dtype", "float32"), device=device, revision=revision,
            trust_remote_code=trust_remote_code, seed=seed,
        )
        lm.check_model_of(had, "--model", "drop --model")
        tr.check_vocabulary(lm)
        ids = replayed_prompts(tr, limit)
        return replay(
            lm, out, settings, trace=tr, prompt_ids=ids, source=str(teacher_forced), show_progress=show_progress,
            outcomes=outcomes, auroc=single,
        )
    source = prompts or "builtin:arith"
    items = load_prompts(source, limit=limit, seed=seed)
    check_generation_room(items, settings.max_new_tokens, source)
    if components is not None:
        components = select_components(source, components)
    lm = load_model(model or DEFAULT_MODEL, dtype=dtype or "float32", device=device, revision=revision,
                    trust_remote_code=trust_remote_code, seed=seed)
    return replay(lm, out, settings, prompts=items, source=source, show_progress=show_progress,
                  components=components)


def replay(
    lm: LoadedModel, out: str | os.PathLike, settings: ReplaySettings, prompts: list[Prompt] | None = None, trace=None,
    prompt_ids: list[str] | None = None, source: str | None = None, command: str | None = None,
    show_progress: bool = True, outcomes: str | os.PathLike | None = None, auroc: SingleLabelAUROC | None = None,
    components: list[str] | None = None,
) -> Path:
    """Replay ``prompts`` (free-running) or the Trace ``trace`` (teacher-forced) under every (scorer, budget).

    Each (prompt, scorer, budget) is committed to ``out/parts/`` as it finishes; a rerun with the same settings
    reuses finished parts. Writes ``generations.parquet``, ``summary.md``/``summary.csv``, ``budget.png``/``.pdf``
    (+ ``budget.csv``) and ``config.json`` into ``out``; returns ``out``. ``outcomes``: a free-running replay
    directory of the same prompts whose outcomes the teacher-forced joint labels are correlated with; ``auroc``: the
    rules' single-label AUROC, correlated with their in-loop KL; ``components``: those of the prompts' builtin suite
    the components table reports (None: all).
    """
    if (trace is None) == (prompts is None):
        raise ValueError("pass exactly one of prompts (free-running) or trace (teacher-forced)")
    mode = FreeRunning(prompts, source) if trace is None else TeacherForced(trace, prompt_ids, source)
    settings = mode.adjust(settings)
    policies = build_policies(lm, settings, mode)
    items = mode.items(lm, settings)
    out = Path(out)
    parts = PartStore(out / "parts", out)  # each part's fingerprint says what made it: no settings stamp
    config = {
        "kind": "replay_config",
        **provenance(created=True),
        "command": command or command_line(),
        "mode": mode.name,
        "settings": settings.to_json(),
        "scorers": {name: p.scorer.params for (name, budget), p in policies.items() if p is not None},
        "query_window": {name: p.query_window for (name, budget), p in policies.items() if p is not None},
        "model": lm.info,
        "prompts_source": mode.source,
        "trace": mode.provenance,
        "prompt_ids": [it.prompt_id for it in items],
        "graded_whole": [it.prompt_id for it in items if it.check == "exact"],
        "components": components,
        "definitions": DEFINITIONS,
    }
    write_json(out / "config.json", config)
    o_proj = (
        o_proj_weights(lm.model) if any(p is not None and needs_o_proj(p.scorer) for p in policies.values()) else None
    )
    units = mode.units(lm.info, settings, items, policies)
    pending = [u for u in units if not parts.done(u.part, u.fingerprint)]

    def commit(u: Unit, run: Decoded, kl, seconds: float, labels: dict | None = None) -> None:
        row = _row(lm, u, mode, run, kl, seconds, labels)
        meta = {"kind": "replay_part", "fingerprint": u.fingerprint}
        parts.write(u.part, pl.DataFrame([row], schema=ROW_SCHEMA), meta)

    with progress_bar(show_progress) as progress:
        task = progress.add_task("replay", total=len(units), completed=len(units) - len(pending))
        mode.run(lm, settings, policies, pending, o_proj, commit, progress, task)
    parts.merge([u.part for u in units], out / "generations.parquet", {**config, "kind": "replay"})
    summarize_files(out, outcomes, auroc)
    return out


def replayed_auroc(settings: ReplaySettings, auroc: tuple[str | os.PathLike, str | os.PathLike],
                   seed: int = 0) -> SingleLabelAUROC:
    """The single-label AUROC (``auroc``: labels and scores files) of every rule of ``settings`` but the oracles,
    with the parameters the replay runs it with."""
    rules = [n for n in settings.scorers if n not in REPLAY_ONLY]
    params = {n: make_scorer(n, settings.params.get(n), settings.w_obs).params for n in rules}
    return single_label_auroc(*auroc, rules, params, seed=seed)


def generation_outcomes(out: str | os.PathLike) -> pl.DataFrame:
    """Each free-running generation's outcomes (``kvdiag.replay.outcomes.outcome_rows``, the suite's components
    included) from ``out/generations.parquet`` alone, as its metadata says the prompts are graded (a replay run with
    ``--no-full-kv``: its fidelity columns stay empty)."""
    from kvdiag.core.contracts import read_generations
    from kvdiag.replay.outcomes import outcome_rows

    df, meta = read_generations(Path(out) / "generations.parquet", "replay")
    return outcome_rows(df, exact=set(_graded_whole(meta)), suite=_suite(meta))


def summarize_files(out: str | os.PathLike, outcomes: str | os.PathLike | None = None,
                    auroc: SingleLabelAUROC | None = None) -> pl.DataFrame:
    """The tables and the figure of a replay (``kvdiag.replay.figure.write_summary``) from ``out/generations.parquet``
    alone, no model: its metadata holds the settings. ``outcomes``: a free-running replay directory of the same
    prompts (teacher-forced: the decisions-to-outcomes join); ``auroc``: as :func:`replayed_auroc` gives it.
    Returns the Table-2-shaped summary."""
    from kvdiag.core.contracts import read_generations
    from kvdiag.replay.figure import write_summary

    out = Path(out)
    df, meta = read_generations(out / "generations.parquet", "replay")
    s = meta["settings"]
    scorers = ([FULL_KV] if s["full_kv"] else []) + list(s["scorers"])  # the policies' order (build_policies)
    free = None if outcomes is None else read_outcomes(outcomes)
    return write_summary(df, out, scorers, s["budgets"], s.get("horizon", HORIZON), free, auroc,
                         exact=set(_graded_whole(meta)), suite=_suite(meta), selection=s.get("selection"))


def _suite(meta: dict) -> Suite | None:
    """The builtin suite of a free-running replay's prompts, with the components it was asked to report."""
    source = meta.get("prompts_source") if meta.get("mode") == "free" else None
    suite = suite_of(source)
    if suite is None or meta.get("components") is None:
        return suite
    keep = set(select_components(source, meta["components"]))
    return replace(suite, components=tuple(c for c in suite.components if c.name in keep))


def _graded_whole(meta: dict) -> list[str]:
    """The prompts graded on their whole generation: recorded in the metadata, else (replays before it was) looked up
    in the prompt source."""
    if "graded_whole" in meta:
        return meta["graded_whole"]
    if meta["mode"] != "free":
        return []
    source = meta.get("prompts_source")
    if source is None:
        raise UserError("generations.parquet records neither graded_whole nor prompts_source: rerun kvdiag replay")
    ids = set(meta["prompt_ids"])
    return [p.prompt_id for p in load_prompts(source) if p.prompt_id in ids and p.check == "exact"]


DEFINITIONS = {
    "budget": "entries kept per (layer, KV head) after each compaction",
    "peak_kv": "most cache entries (per layer and KV head) any query attended, prompt included",
    "mean_kv": "mean cache entries attended by the queries that produced the generated tokens",
    "compression_steps": "absolute checkpoints t at which a compaction ran (cache held [0, t)'s survivors)",
    "kl": "KL(P_full || P_policy) per generated position, nats; P_full from a full-cache forward of the same "
          "tokens",
    "prefill": "the prompt counts toward the budget and is compressed (chunked when longer than budget + "
               "interval)",
    "sample": "free-running: the generation's sample index; sample s of every policy shares FullKV's random draws",
    "joint_kl": "teacher-forced: per compression, the exact label of the whole evicted set (every entry of [0, t) "
                "the cache lacks, per layer and KV head): mean KL(P_full || P_evicted) over the next `horizon` "
                "tokens (fewer at the end)",
    "label_seconds": "teacher-forced: seconds spent on exact labels (joint labels, and the oracle's per-entry labels) "
                     "and on oracle_future's future attention",
    "oracle_future": "teacher-forced: per (layer, KV head), keeps the entries the full-cache run's next `window` "
                     "queries attend most (the next compression plus the label horizon by default)",
}


ROW_SCHEMA = {
    "prompt_id": pl.String, "scorer": pl.String, "budget": pl.Int64, "sample": pl.Int64, "mode": pl.String,
    "prompt_len": pl.Int64, "token_ids": pl.List(pl.Int64), "text": pl.String, "generated": pl.Int64,
    "stop": pl.String, "max_length_hit": pl.Boolean, "answer": pl.String, "correct": pl.Boolean, "peak_kv": pl.Int64,
    "mean_kv": pl.Float64, "compressions": pl.Int64, "compression_steps": pl.List(pl.Int64),
    "kl_mean": pl.Float64, "kl_max": pl.Float64, "kl_steps": pl.List(pl.Float64), "joint_kl": pl.List(pl.Float64),
    "label_seconds": pl.Float64, "label_rows": pl.Int64, "seconds": pl.Float64,
    # builtin suites with needed tokens (kvdiag.replay.free_running.needed_columns); null elsewhere
    "needed_where": pl.List(pl.String), "needed_positions": pl.List(pl.Int64), "kept_steps": pl.List(pl.Int64),
    "needed_kept": pl.List(pl.List(pl.Float64)), "final_line_at": pl.Int64,
    # teacher-forced (kvdiag.replay.teacher_forced): per step, the policy's top-1 token is the full cache's; on a
    # builtin suite, whether it is at every token where the final line writes what the answer needs (null: the
    # Trace's final line lacks it), and the share of those tokens where it is
    "top1_agree": pl.List(pl.Boolean), "tf_task": pl.Boolean, "tf_needed_agree": pl.Float64,
}


def _row(lm: LoadedModel, u: Unit, mode, run: Decoded, kl, seconds: float, labels: dict | None) -> dict:
    it = u.item
    text = lm.tokenizer.decode(run.token_ids[run.prompt_len :], skip_special_tokens=True)
    return {
        "prompt_id": it.prompt_id, "scorer": u.scorer, "budget": u.budget, "sample": u.sample, "mode": mode.name,
        "prompt_len": run.prompt_len, "token_ids": run.token_ids, "text": text, "generated": run.generated,
        "stop": run.stop, "answer": it.answer, "peak_kv": run.peak_kv, "mean_kv": run.mean_kv,
        "compressions": len(run.compressions), "compression_steps": run.compressions,
        "kl_mean": None if kl is None else float(kl.mean()), "kl_max": None if kl is None else float(kl.max()),
        "kl_steps": None if kl is None else kl.tolist(), **mode.outcome(run, it, text),
        "label_seconds": None if labels is None else labels["seconds"],
        "label_rows": None if labels is None else labels["rows"], "seconds": seconds,
    }
