"""``rank_eval``: how well each scorer ranks the candidates of a labels file by eviction damage.

Labels and scores are joined on their keys; each score column is a scorer. Harmful = ``kl_mean``
strictly above the harm threshold. Every metric is reported pooled over all candidates and as a macro
average over checkpoints (eviction decisions are made within one cache, so the ranking within a
checkpoint is what matters), with cluster-bootstrap CIs over prompts and paired differences against a
reference scorer. The metrics are those of ``kvdiag.rankeval.registry`` (each defined once, in
``kvdiag.rankeval.metrics``). Definitions and conventions: docs/rank-eval.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import polars as pl

from kvdiag.core.errors import UserError
from kvdiag.core.harm import HarmSpec
from kvdiag.core.schema import HARM, KEYS, N_BOOT, NOISE_MULT, RHO, keyed
from kvdiag.core.stats import EXACT_BELOW, holm, paired_p_value, percentile_ci, prompt_multiplicities, sign_test
from kvdiag.rankeval.candidates import filter_candidates
from kvdiag.rankeval.metrics import Rankings, _div, eviction_counts, n_evicted, ranking_metrics
from kvdiag.rankeval.registry import METRICS, Counts, Metric, metrics_where

SCOPES = ("pooled", "macro")
# below this many prompts, a percentile bootstrap over prompts has too few clusters to be trusted: warn
FEW_PROMPTS = 10
# bootstrap resamples evaluated together: [N, chunk] float64 arrays of ~1 MB stay in cache
_CHUNK_CELLS = 1 << 17
_MIN_CHUNK = 16  # ... but not so few resamples that per-call overhead dominates


AUTO_REFERENCE = "avokv_e"


@dataclass(frozen=True)
class RankEvalConfig:
    """Every setting of one rank-eval run (written to config.json)."""

    harm: str = HARM  # harmful: kl_mean > threshold; quantile:Q of the evaluated labels, or abs:TAU (nats)
    rho: float = RHO  # eviction fraction: the floor(rho * C) lowest-scored candidates of a checkpoint are evicted
    reference: str | None = "auto"  # scorer of the paired comparisons; None: no paired table; auto: avokv_e if scored
    n_boot: int = N_BOOT  # cluster-bootstrap resamples over prompts (0: no CIs)
    seed: int = 0  # seed of the bootstrap's numpy Generator
    include_unresolved: bool = False  # keep labels at or below their checkpoint's noise floor
    noise_mult: float = NOISE_MULT  # a label is unresolved when kl_mean <= noise_mult * noise_floor
    kl_floor: float = 1e-12  # Spearman uses log(max(kl_mean, kl_floor)) (KL can be exactly 0)
    ci_level: float = 0.95  # percentile bootstrap interval
    granularity: str | None = None  # which granularity to evaluate; None: the only one present
    scorers: tuple[str, ...] | None = None  # score columns to evaluate; None: all of them
    min_age: int | None = None  # evaluate only candidates of age (checkpoint - position) >= min_age
    max_age: int | None = None  # ... and <= max_age
    eligible: str | None = None  # ... and only those this scorer could evict (outside its protected entries)
    rho_grid: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # budget curves: FSR/FNR at each rho

    @property
    def harm_spec(self) -> HarmSpec:
        """Which labels are evaluated and which are harmful (``kvdiag.core.harm``)."""
        return HarmSpec(self.harm, self.noise_mult, self.include_unresolved)


@dataclass
class RankEvalResult:
    """Tables of one run.

    ``metrics``: scorer, metric, scope, value, ci_low, ci_high, n, n_boot, note.
    ``paired``: scorer, reference, metric, scope, value, reference_value, diff, ci_low, ci_high, p_value,
    p_holm, n_boot, test (``sign``: the exact sign test over prompts, below 30; else ``bootstrap``), prompts (those
    that entered the test), note. ``summary``: counts, harm threshold, prevalence, warnings.
    ``replicates[(scorer, metric, scope)] [B]``: the metric on each bootstrap resample; resample b draws
    the p-th prompt (prompt ids sorted) ``mult[b, p]`` times, with
    ``mult = prompt_multiplicities(n_prompts, n_boot, np.random.default_rng(seed))``.
    ``budget_curves``: pooled FSR and FNR at every rho of ``config.rho_grid``, with CIs.
    """

    metrics: pl.DataFrame
    paired: pl.DataFrame
    summary: dict
    config: RankEvalConfig
    scorers: list[str] = field(default_factory=list)
    replicates: dict[tuple[str, str, str], np.ndarray] = field(default_factory=dict, repr=False)
    budget_curves: pl.DataFrame | None = None  # scorer, rho, metric (fsr | fnr), value, ci_low, ci_high (pooled)


@dataclass
class _Data:
    """Joined, filtered rows sorted by (prompt, checkpoint); checkpoint c is rows starts[c]:starts[c+1]."""

    y: np.ndarray  # [N] 1.0 = harmful
    logkl: np.ndarray  # [N]
    scores: dict[str, np.ndarray]  # name -> [N]
    prompt: np.ndarray  # [N] prompt index
    starts: np.ndarray  # [K + 1]
    ckpt_prompt: np.ndarray  # [K] prompt index of each checkpoint
    n_prompts: int


@dataclass
class _Estimate:
    value: float
    reps: np.ndarray  # [B] bootstrap replicates (NaN where undefined)
    n: int  # candidates (pooled) or contributing checkpoints (macro)
    note: str = ""


def check_inputs(labels_meta: dict, scores_meta: dict, flags: tuple[str, str] = ("--labels", "--scores")) -> None:
    """The provenance of a labels and a scores file (``kvdiag.core.io.read_meta``) must fit together: each file
    of its own kind, and both from the same trace when both record its fingerprint. ``flags``: how the command
    names the two inputs (``--auroc``'s LABELS and SCORES for replay)."""
    for meta, want, command, flag in ((labels_meta, "labels", "label", flags[0]),
                                      (scores_meta, "scores", "score", flags[1])):
        kind = meta.get("kind")
        if kind is not None and kind != want:
            raise UserError(f"{flag} is a {kind} table, not {want}: pass the {want}.parquet written by kvdiag "
                            f"{command}")
    fp_l = (labels_meta.get("trace") or {}).get("fingerprint")
    fp_s = (scores_meta.get("trace") or {}).get("fingerprint")
    if fp_l and fp_s and fp_l != fp_s:
        raise UserError(
            f"labels (trace {fp_l}) and scores (trace {fp_s}) come from different traces: score the trace the labels "
            "were made from"
        )


def _validate(cfg: RankEvalConfig) -> None:
    cfg.harm_spec  # noqa: B018  (checks harm and noise_mult)
    if not 0 < cfg.rho < 1:
        raise UserError(f"--rho {cfg.rho} is not an eviction fraction: pass 0 < rho < 1, e.g. 0.5")
    if cfg.n_boot < 0:
        raise UserError(f"--bootstrap {cfg.n_boot} is negative: pass a number of resamples, e.g. {N_BOOT} (0: no CIs)")
    if not 0 < cfg.ci_level < 1:
        raise UserError(f"ci_level {cfg.ci_level} is not a confidence level: pass e.g. 0.95")
    if cfg.kl_floor <= 0:
        raise UserError("kl_floor must be > 0")
    for flag, age in (("--min-age", cfg.min_age), ("--max-age", cfg.max_age)):
        if age is not None and age < 1:
            raise UserError(f"{flag} {age}: ages start at 1 (the newest cached entry); pass a positive age")
    if not cfg.rho_grid or not all(0 < r < 1 for r in cfg.rho_grid):
        raise UserError(f"--rho-grid {','.join(map(str, cfg.rho_grid))}: pass eviction fractions 0 < rho < 1, e.g. "
                        "0.1,0.2,0.5")


def _keyed(df: pl.DataFrame, what: str, fix: str) -> pl.DataFrame:
    df = keyed(df, what, fix)
    dup = df.height - df.select(KEYS).unique().height
    if dup:
        raise UserError(f"{what} has {dup} duplicate rows on ({', '.join(KEYS)}): {fix}")
    return df


def _select_scorers(scores: pl.DataFrame, wanted: tuple[str, ...] | None) -> list[str]:
    columns = [c for c in scores.columns if c not in KEYS]
    if wanted is not None:
        unknown = [c for c in wanted if c not in columns]
        if unknown:
            raise UserError(f"--scorers {', '.join(unknown)} not in the scores file: choose from {', '.join(columns)}")
        columns = list(wanted)
    for c in columns:
        if not scores.schema[c].is_numeric():
            raise UserError(f"scores column {c!r} is {scores.schema[c]}, not a numeric score: leave it out with "
                            "--scorers")
    if not columns:
        raise UserError("the scores file has no score column besides the keys: run kvdiag score first")
    return columns


def _join(labels: pl.DataFrame, scores: pl.DataFrame, cfg: RankEvalConfig, warnings: list[str],
          scores_meta: dict | None = None) -> tuple[pl.DataFrame, list[str], dict]:
    fix = "pass a labels file written by kvdiag label"
    labels = _keyed(labels, "labels", fix)
    for c in ("kl_mean", "noise_floor"):
        if c not in labels.columns:
            raise UserError(f"labels lacks column {c!r}: {fix}")
    scores = _keyed(scores, "scores", "pass a scores file written by kvdiag score")
    names = _select_scorers(scores, cfg.scorers)
    if cfg.granularity is not None:
        present = sorted(labels["granularity"].unique().to_list())
        if cfg.granularity not in present:
            raise UserError(f"--granularity {cfg.granularity} not in the labels: choose from {', '.join(present)}")
        labels = labels.filter(pl.col("granularity") == cfg.granularity)
    labels, candidates = filter_candidates(labels, cfg.min_age, cfg.max_age, cfg.eligible, scores_meta)
    joined = labels.select(*KEYS, _kl=pl.col("kl_mean"), _floor=pl.col("noise_floor")).join(
        scores.select(*KEYS, *names), on=list(KEYS), how="inner"
    )
    if joined.height == 0:
        shared = len(set(labels["prompt_id"].unique()) & set(scores["prompt_id"].unique()))
        raise UserError(
            f"labels ({labels.height} rows) and scores ({scores.height} rows) match on 0 rows of "
            f"({', '.join(KEYS)}); {shared} prompt_ids in common: score the same labels file (kvdiag score --labels "
            "...)"
        )
    grans = sorted(joined["granularity"].unique().to_list())
    if len(grans) > 1:
        raise UserError(f"labels and scores share granularities {', '.join(grans)}: evaluate one with --granularity")
    labels_g = labels.filter(pl.col("granularity") == grans[0]).height
    if joined.height < labels_g:
        warnings.append(f"only {joined.height} of {labels_g} label rows ({grans[0]}) have scores; the rest are not "
                        "evaluated")
    counts = {
        "n_label_rows": labels_g, "n_score_rows": scores.height, "n_matched": joined.height, "granularity": grans[0],
        "candidates": candidates,
    }
    return joined, names, counts


def _prepare(
    labels: pl.DataFrame, scores: pl.DataFrame, cfg: RankEvalConfig, scores_meta: dict | None = None
) -> tuple[_Data, dict]:
    warnings: list[str] = []
    df, names, summary = _join(labels, scores, cfg, warnings, scores_meta)
    for c in names:
        bad = df.select((pl.col(c).is_null() | pl.col(c).cast(pl.Float64).is_nan()).sum()).item()
        if bad == df.height:
            raise UserError(f"scores column {c!r} is NaN for all {bad} matched rows: rescore it or leave it out with "
                            "--scorers")
        if bad:
            raise UserError(f"scores column {c!r} is NaN for {bad} of {df.height} matched rows: rescore it or leave "
                            "it out with --scorers")
    spec = cfg.harm_spec
    n_unresolved = df.select(spec.unresolved("_kl", "_floor").sum()).item()
    df = spec.analysed(df, "_kl", "_floor", "labels").sort("prompt_id", "checkpoint", "position", "layer", "kv_head")

    kl = df["_kl"].to_numpy().astype(float)
    threshold = spec.threshold(kl)
    y = (kl > threshold).astype(float)
    n_pos = int(y.sum())
    if n_pos == 0 or n_pos == len(y):
        which = "no harmful" if n_pos == 0 else "no safe"
        raise UserError(
            f"--harm {cfg.harm} (threshold {threshold:.4g} nats) leaves {which} label among {len(y)} "
            f"(kl_mean from {kl.min():.4g} to {kl.max():.4g}): choose another threshold"
        )
    pids, prompt = np.unique(df["prompt_id"].to_numpy(), return_inverse=True)
    if len(pids) < FEW_PROMPTS and cfg.n_boot:
        warnings.append(f"{len(pids)} prompt(s) only: intervals from a bootstrap over so few clusters are rough "
                        "(label more prompts)")
    ckpt = df["checkpoint"].to_numpy()
    new = np.r_[True, (prompt[1:] != prompt[:-1]) | (ckpt[1:] != ckpt[:-1])]
    starts = np.r_[np.flatnonzero(new), len(y)]
    data = _Data(
        y=y, logkl=np.log(np.maximum(kl, cfg.kl_floor)), scores={c: df[c].cast(pl.Float64).to_numpy() for c in names},
        prompt=prompt, starts=starts, ckpt_prompt=prompt[starts[:-1]], n_prompts=len(pids),
    )
    summary.update(
        n_unresolved=n_unresolved, unresolved_excluded=not cfg.include_unresolved, n_evaluated=len(y),
        n_prompts=len(pids), n_checkpoints=len(starts) - 1, harm_threshold=threshold, n_harmful=n_pos,
        prevalence=n_pos / len(y), scorers=names, warnings=warnings,
    )
    return data, summary


def _macro(v: np.ndarray, defined: np.ndarray, mc: np.ndarray, skipped: dict[str, int]) -> _Estimate:
    """Mean of per-checkpoint values ``v [K]`` over the checkpoints where defined; replicates weight each
    checkpoint by its prompt's multiplicity ``mc [B, K]``."""
    k = int(defined.sum())
    reasons = "; ".join(f"{n} with {why}" for why, n in skipped.items() if n)
    if k == 0:
        return _Estimate(float("nan"), np.full(len(mc), np.nan), 0, f"undefined: no checkpoint qualifies ({reasons})")
    reps = _div(mc[:, defined] @ v[defined], mc[:, defined].sum(axis=1))
    note = f"{len(v) - k} of {len(v)} checkpoints skipped: {reasons}" if k < len(v) else ""
    return _Estimate(float(v[defined].mean()), reps, k, note)


def _ratio(num: np.ndarray, den: np.ndarray, mc: np.ndarray, n: int, undefined: str) -> _Estimate:
    """Pooled ratio of per-checkpoint counts ``sum(num) / sum(den)``."""
    value = float(_div(num.sum(), den.sum()))
    return _Estimate(value, _div(mc @ num, mc @ den), n, "" if np.isfinite(value) else f"undefined: {undefined}")


def _estimates(
    data: _Data, names: list[str], cfg: RankEvalConfig, mult: np.ndarray
) -> dict[str, dict[tuple[str, str], _Estimate]]:
    """Every (metric, scope) estimate of every scorer; ``mult [B, P]`` prompt multiplicities."""
    y, x, starts = data.y, data.logkl, data.starts
    scores = np.stack([data.scores[n] for n in names])  # [S, N]
    n_rows, n_ckpt = len(y), len(starts) - 1
    mc = mult[:, data.ckpt_prompt].astype(float)  # [B, K]

    # per checkpoint (one cache): values computed once; a resample reweights checkpoints
    ckpt = np.repeat(np.arange(n_ckpt), np.diff(starts))  # [N] checkpoint index
    per = {m: v[:, :, 0] for m, v in ranking_metrics(y, scores, x, segments=ckpt).items()}  # [S, K]
    n_c = np.diff(starts).astype(float)
    ev_c = n_evicted(cfg.rho, n_c).astype(float)  # the same for every scorer
    hev_c = np.stack([eviction_counts(y, s, cfg.rho, ckpt)[1] for s in scores])  # [S, K] harmful evicted
    pos_c = np.add.reduceat(y, starts[:-1])
    neg_c = n_c - pos_c

    # why a checkpoint has no macro value: (per-checkpoint mask, macro reason, pooled reason when it holds everywhere)
    rho_note = f"floor(rho*C) = 0 (C < {1 / cfg.rho:.3g})"
    lacks = {"harmful": (pos_c == 0, "no harmful entry", "no harmful entry"),
             "safe": (neg_c == 0, "no safe entry", "no safe entry"),
             "evicted": (ev_c == 0, rho_note, rho_note.replace(" (", " in every checkpoint ("))}

    # pooled ranking metrics: a resample is a row weighting (prompt multiplicity), in chunks of resamples
    rankings = Rankings(y, scores, x)
    point = rankings()
    reps = {m: np.empty((len(names), len(mult))) for m in point}
    chunk = max(_MIN_CHUNK, _CHUNK_CELLS // n_rows)
    for lo in range(0, len(mult), chunk):
        w = mult[lo : lo + chunk].T[data.prompt].astype(float)  # [N, b]
        for m, v in rankings(w).items():
            reps[m][:, lo : lo + chunk] = v[:, 0]

    out = {}
    for j, name in enumerate(names):
        counts = Counts(n=n_c, harmful=pos_c, evicted=ev_c, harmful_evicted=hev_c[j])
        est = {}
        for m in METRICS.values():
            missing = [lacks[need] for need in m.needs]
            qualifies = ~np.any([mask for mask, _, _ in missing], axis=0) if missing else np.ones(n_ckpt, bool)
            skipped = {why: int(mask.sum()) for mask, why, _ in missing}
            if m.kind == "rank":
                v = per[m.name][j]
                skipped["a constant score or KL"] = int((qualifies & ~np.isfinite(v)).sum())
                value = float(point[m.name][j, 0, 0])
                est[(m.name, "pooled")] = _Estimate(value, reps[m.name][j], n_rows,
                                                    "" if np.isfinite(value) else "undefined: constant score or KL")
            else:
                num, den = m.compute(counts)
                v = _div(num, den)
                est[(m.name, "pooled")] = _ratio(num, den, mc, n_rows, "; ".join(pooled for _, _, pooled in missing))
            est[(m.name, "macro")] = _macro(v, qualifies & np.isfinite(v), mc, skipped)
        out[name] = est
    return out


def _ci_note(n_valid: int, cfg: RankEvalConfig, n_prompts: int, what: str = "CI") -> str:
    if cfg.n_boot == 0:
        return "no bootstrap (n_boot = 0)"
    if n_prompts == 1:
        return f"{what} degenerate: 1 prompt"
    if n_valid < cfg.n_boot:
        return f"CI from {n_valid} of {cfg.n_boot} resamples (the others undefined)"
    return ""


def _paired(est: dict, names: list[str], cfg: RankEvalConfig, n_prompts: int, per_prompt: dict | None) -> pl.DataFrame:
    """Differences scorer - reference on the same resamples, and their test: below ``EXACT_BELOW`` prompts the exact
    sign test of the per-prompt differences (``per_prompt``: the estimates with each prompt alone as a resample;
    ``prompts``: those where both are defined), else the bootstrap p-value; Holm-adjusted p-values per (metric,
    scope) over the scorers compared."""
    rows = []
    others = [n for n in names if n != cfg.reference] if cfg.reference is not None else []
    for name in others:
        for metric in (m.name for m in metrics_where("per_scorer")):
            for scope in SCOPES:
                a, ref = est[name][(metric, scope)], est[cfg.reference][(metric, scope)]
                diffs = a.reps - ref.reps
                low, high, n_valid = percentile_ci(diffs, cfg.ci_level)
                diff = a.value - ref.value
                test, entered = ("sign", 0) if per_prompt is not None else ("bootstrap", n_prompts)
                if np.isfinite(diff) and per_prompt is not None:
                    note = _ci_note(n_valid, cfg, n_prompts)
                    mine, theirs = per_prompt[name][(metric, scope)], per_prompt[cfg.reference][(metric, scope)]
                    t = sign_test(mine.reps - theirs.reps)
                    p, entered = (t.p, t.n) if t.n > 1 else (float("nan"), t.n)
                elif np.isfinite(diff):
                    note = _ci_note(n_valid, cfg, n_prompts, "CI and p-value")
                    p = paired_p_value(diffs) if cfg.n_boot and n_prompts > 1 else float("nan")
                else:
                    note, p = "undefined: " + (a.note or ref.note).removeprefix("undefined: "), float("nan")
                rows.append(
                    dict(
                        scorer=name, reference=cfg.reference, metric=metric, scope=scope, value=a.value,
                        reference_value=ref.value, diff=diff, ci_low=low, ci_high=high, p_value=p, n_boot=n_valid,
                        test=test, prompts=entered, note=note,
                    )
                )
    for metric in METRICS:
        for scope in SCOPES:
            family = [r for r in rows if r["metric"] == metric and r["scope"] == scope]
            for r, p_holm in zip(family, holm(np.array([r["p_value"] for r in family])), strict=True):
                r["p_holm"] = float(p_holm)
    return pl.DataFrame(rows, schema=PAIRED_SCHEMA)


def _join_notes(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def rank_eval(labels: pl.DataFrame, scores: pl.DataFrame, config: RankEvalConfig | None = None,
              scores_meta: dict | None = None, **settings) -> RankEvalResult:
    """Rank every scorer of ``scores`` against the oracle labels of ``labels``.

    ``labels``: a labels table (keys + ``kl_mean``, ``noise_floor``); ``scores``: keys + one numeric
    column per scorer. Settings are the fields of ``RankEvalConfig`` (given as ``config`` and/or as
    keyword arguments, e.g. ``rank_eval(l, s, harm="abs:0.01", rho=0.75)``). ``scores_meta`` (the scores file's
    metadata) gives ``eligible`` the parameters its scorer was scored with. Bad input raises ``UserError``.
    """
    cfg = replace(config or RankEvalConfig(), **settings)
    cfg = replace(cfg, scorers=None if cfg.scorers is None else tuple(cfg.scorers), rho_grid=tuple(cfg.rho_grid))
    _validate(cfg)
    t0 = time.perf_counter()
    data, summary = _prepare(labels, scores, cfg, scores_meta)
    names = summary["scorers"]
    if cfg.reference == "auto":  # the paper's rule when it was scored, else no paired table (said in the summary)
        cfg = replace(cfg, reference=AUTO_REFERENCE if AUTO_REFERENCE in names else None)
        summary["reference_note"] = (
            f"paired comparisons against {AUTO_REFERENCE} (--reference auto)"
            if cfg.reference
            else f"no paired comparisons: the scores have no {AUTO_REFERENCE} column (pass --reference NAME)"
        )
    if cfg.reference is not None and cfg.reference not in names:
        raise UserError(f"--reference {cfg.reference} is not a scorer of the scores file: choose from "
                        f"{', '.join(names)}, or none")

    mult = prompt_multiplicities(data.n_prompts, cfg.n_boot, np.random.default_rng(cfg.seed))
    est = _estimates(data, names, cfg, mult)

    rows = []
    for name in names:
        for metric in METRICS:
            for scope in SCOPES:
                e = est[name][(metric, scope)]
                low, high, n_valid = percentile_ci(e.reps, cfg.ci_level)
                note = _join_notes(e.note, _ci_note(n_valid, cfg, data.n_prompts) if np.isfinite(e.value) else "")
                rows.append(
                    dict(
                        scorer=name, metric=metric, scope=scope, value=e.value, ci_low=low, ci_high=high, n=e.n,
                        n_boot=n_valid, note=note,
                    )
                )
    metrics = pl.DataFrame(rows, schema=METRICS_SCHEMA)

    exact = cfg.reference is not None and 1 < data.n_prompts < EXACT_BELOW
    per_prompt = _estimates(data, names, cfg, np.eye(data.n_prompts, dtype=np.int64)) if exact else None
    paired = _paired(est, names, cfg, data.n_prompts, per_prompt)
    curves = _budget_curves(data, names, cfg, mult)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    replicates = {(name, m, scope): e.reps for name in names for (m, scope), e in est[name].items()}
    return RankEvalResult(
        metrics=metrics, paired=paired, summary=summary, config=cfg, scorers=names, replicates=replicates,
        budget_curves=curves,
    )


def _budget_curves(data: _Data, names: list[str], cfg: RankEvalConfig, mult: np.ndarray) -> pl.DataFrame:
    """Pooled FSR@rho and FNR@rho of every scorer at every rho of ``cfg.rho_grid``, with cluster-bootstrap CIs,
    and the random scorer's expected values (FSR = prevalence, FNR = rho)."""
    starts = data.starts
    ckpt = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    mc = mult[:, data.ckpt_prompt].astype(float)
    n_c = np.diff(starts).astype(float)
    pos_c = np.add.reduceat(data.y, starts[:-1])
    curves: list[Metric] = metrics_where("curve")
    prevalence = float(pos_c.sum() / n_c.sum())
    rows = []
    for rho in cfg.rho_grid:
        ev_c = n_evicted(rho, n_c).astype(float)
        for name in names:
            counts = Counts(
                n=n_c, harmful=pos_c, evicted=ev_c,
                harmful_evicted=eviction_counts(data.y, data.scores[name], rho, ckpt)[1],
            )
            for m in curves:
                e = _ratio(*m.compute(counts), mc, len(data.y), "")
                low, high, _ = percentile_ci(e.reps, cfg.ci_level)
                rows.append(dict(scorer=name, rho=rho, metric=m.name, value=e.value, ci_low=low, ci_high=high))
        rows += [
            dict(
                scorer="random (expected)", rho=rho, metric=m.name, value=m.random(prevalence, rho), ci_low=np.nan,
                ci_high=np.nan,
            )
            for m in curves
        ]
    return pl.DataFrame(rows, schema=_CURVES_SCHEMA)


METRICS_SCHEMA = {
    "scorer": pl.String, "metric": pl.String, "scope": pl.String, "value": pl.Float64, "ci_low": pl.Float64,
    "ci_high": pl.Float64, "n": pl.Int64, "n_boot": pl.Int64, "note": pl.String,
}
_CURVES_SCHEMA = {"scorer": pl.String, "rho": pl.Float64, "metric": pl.String, "value": pl.Float64,
                  "ci_low": pl.Float64, "ci_high": pl.Float64}
PAIRED_SCHEMA = {
    "scorer": pl.String, "reference": pl.String, "metric": pl.String, "scope": pl.String, "value": pl.Float64,
    "reference_value": pl.Float64, "diff": pl.Float64, "ci_low": pl.Float64, "ci_high": pl.Float64,
    "p_value": pl.Float64, "p_holm": pl.Float64, "n_boot": pl.Int64, "test": pl.String, "prompts": pl.Int64,
    "note": pl.String,
}
