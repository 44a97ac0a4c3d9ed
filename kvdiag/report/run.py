"""``report_files``: one Markdown report and one self-contained HTML page (images embedded) of a run directory.

Run directory layout (every piece optional; the report lists the missing ones and the command that makes each)::

    RUN/
      commands.json      the exact commands run, in order: [{"argv": [...], "cwd", "time", "kvdiag_version"}]
                         (appended by record_command(RUN, argv) — whoever runs a step records it)
      trace/             kvdiag trace --out RUN/trace
      labels.parquet     kvdiag label --trace RUN/trace --out RUN/labels.parquet
      scores.parquet     kvdiag score --trace RUN/trace --labels RUN/labels.parquet --out RUN/scores.parquet
      rank-eval/         kvdiag rank-eval --labels ... --scores ... --out RUN/rank-eval
      figures/           kvdiag figures --trace ... --labels ... --scores ... --out RUN/figures
      report.md, report.html, viewer.html   kvdiag report --run RUN
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import re
import shlex
import time
from pathlib import Path

import numpy as np
import polars as pl
from markdown_it import MarkdownIt

from kvdiag import __version__
from kvdiag.core.errors import UserError
from kvdiag.core.harm import HarmSpec
from kvdiag.core.io import read_csv, write_json
from kvdiag.core.provenance import timestamp
from kvdiag.core.run_layout import LAYOUT, REPORT_FILES, check_run_dir
from kvdiag.core.tables import cell_text, md_table
from kvdiag.figures.run import load_summary as figures_summary
from kvdiag.fit import load_summary as fit_summary
from kvdiag.rankeval.evaluate import PAIRED_SCHEMA
from kvdiag.rankeval.run import load_summary as rank_eval_summary

# piece -> (path in the run, command that makes it)
KL_QUANTILES = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)
HTML_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0
1em;line-height:1.45;color:#222}
table{border-collapse:collapse;margin:0.8em 0;font-size:0.9em}th,td{border:1px solid #ccc;padding:3px 8px}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}pre{background:#f7f7f7;padding:0.7em;overflow-x:auto;
font-size:0.85em}code{font-size:0.9em}h2{border-bottom:1px solid #ddd;padding-bottom:0.2em;margin-top:1.6em}"""


def record_command(run_dir: str | os.PathLike, argv: list[str], cwd: str | os.PathLike | None = None) -> Path:
    """Append one command (``argv`` as run, e.g. ``["kvdiag", "label", "--trace", ...]``) to RUN/commands.json
    (created if missing; written atomically). Returns its path."""
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    path = run / "commands.json"
    commands = _read_commands(path) if path.exists() else []
    commands.append({"argv": [str(a) for a in argv], "cwd": str(cwd or os.getcwd()),
                     "time": timestamp(), "kvdiag_version": __version__})
    return write_json(path, commands)


def _read_commands(path: Path) -> list[dict]:
    try:
        commands = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err.msg}): fix or delete it") from err
    if not isinstance(commands, list) or not all(
            isinstance(c, dict) and isinstance(c.get("argv"), list) and all(isinstance(a, str) for a in c["argv"])
            for c in commands):
        raise UserError(f"{path} is not a list of commands (each an object with its argv): fix or delete it")
    return commands


# --------------------------------------------------------------------------- small Markdown helpers


def _json_block(obj) -> str:
    return "```json\n" + json.dumps(obj, indent=2, default=str) + "\n```\n"


# --------------------------------------------------------------------------- sections


class _Run:
    """The pieces of a run directory, each loaded once; ``status[piece]`` says present / missing / unreadable."""

    def __init__(self, run: Path):
        self.run = run
        self.status: dict[str, str] = {}
        self.trace = self._load("trace", self._trace)
        self.labels = self._load("labels", lambda p: self._table(p, "labels"))
        self.scores = self._load("scores", lambda p: self._table(p, "scores"))
        self.rank_eval = self._load("rank-eval", rank_eval_summary)
        self.figures = self._load("figures", figures_summary)
        self.commands = self._load("commands", _read_commands)
        self.unread: dict[str, str] = {}  # optional pieces (fit/, decisions/, ...) that could not be read -> why

    def _load(self, piece: str, loader):
        path = self.run / LAYOUT[piece][0]
        if not path.exists():
            self.status[piece] = "missing"
            return None
        try:
            value = loader(path)
        except (UserError, OSError, ValueError) as err:
            self.status[piece] = f"unreadable: {err}"
            return None
        self.status[piece] = "present"
        return value

    @staticmethod
    def _trace(path: Path):
        from kvdiag.trace import Trace

        return Trace(path)

    @staticmethod
    def _table(path: Path, what: str):
        from kvdiag.core.io import read_table

        return read_table(path, what)

    def optional(self, rel: str, loader):
        """``loader(RUN/rel)`` of an optional piece outside the layout (None when missing or unreadable)."""
        path = self.run / rel
        if not path.exists():
            return None
        try:
            return loader(path)
        except (UserError, OSError, ValueError) as err:  # its section says so (:meth:`unreadable`)
            self.unread[rel] = str(err)
            return None

    def unreadable(self, rel: str, heading: str, command: str) -> str:
        """The section (under ``heading``) of an optional piece that :meth:`optional` could not read ('' when it was
        read or is absent)."""
        if rel not in self.unread:
            return ""
        return f"{heading}\n\n`{rel}/` is unreadable: {self.unread[rel]}; `{command}` rewrites it.\n"


def _contents(r: _Run) -> str:
    rows = []
    for piece, (rel, command) in LAYOUT.items():
        status = r.status[piece]
        rows.append(
            [
                f"`{rel}`", status if status == "present" else f"**{status}**",
                "" if status == "present" else f"`{command}`",
            ]
        )
    out = "## Contents of the run\n\n" + md_table(["piece", "status", "to make it"], rows, "lll")
    missing = [p for p, s in r.status.items() if s != "present"]
    if missing:
        out += f"\nMissing or unreadable: {', '.join(missing)}; their sections below say so.\n"
    return out + _consistency(r)


def _fingerprints(r: _Run) -> dict[str, str]:
    """Which Trace each piece says it was made from."""
    fps = {}
    if r.trace is not None:
        fps["trace"] = r.trace.fingerprint
    for piece, loaded in (("labels", r.labels), ("scores", r.scores)):
        if loaded is not None and (fp := (loaded[1].get("trace") or {}).get("fingerprint")):
            fps[piece] = fp
    if r.rank_eval is not None:
        for what, info in r.rank_eval["config"].get("inputs", {}).items():
            if fp := ((info.get("meta") or {}).get("trace") or {}).get("fingerprint"):
                fps[f"rank-eval {what}"] = fp
    if r.figures is not None and (fp := ((r.figures.get("inputs") or {}).get("trace") or {}).get("fingerprint")):
        fps["figures"] = fp
    return fps


def _consistency(r: _Run) -> str:
    fps = _fingerprints(r)
    if not fps:
        return "\nNo piece records a Trace fingerprint: consistency not checked.\n"
    if len(set(fps.values())) == 1:
        return f"\nAll pieces that record a Trace come from the same one (fingerprint `{next(iter(fps.values()))}`).\n"
    listing = ", ".join(f"{k}: `{v}`" for k, v in fps.items())
    return (
        f"\n**Warning: the pieces come from different Traces** ({listing}); rerun the mismatched steps on one Trace.\n"
    )


def _trace_section(r: _Run) -> str:
    out = "## What was traced\n\n"
    if r.trace is None:
        return out + f"The Trace is {r.status['trace']}: `{LAYOUT['trace'][1]}`.\n"
    m = r.trace.manifest
    model = m.get("model", {})
    gen = m.get("generation", {})
    out += md_table(["setting", "value"], [
        ["model", f"`{model.get('spec')}` ({model.get('architecture', '?')}, dtype {model.get('dtype')}, device "
                  f"{model.get('device')})"],
        ["weights / config hash", f"{model.get('weights_hash')} / {model.get('config_hash')}"],
        ["layers × query heads × KV heads × head dim", f"{m['num_layers']} × {m['num_heads']} × {m['num_kv_heads']} × "
                                                       f"{m['head_dim']}"],
        ["attention", str(m.get("attn_implementation"))],
        ["storage dtype", str(m.get("storage_dtype"))],
        ["generation", ", ".join(f"{k}={v}" for k, v in gen.items())],
        ["prompts source", str(m.get("prompts_source"))],
        ["Trace fingerprint", f"`{r.trace.fingerprint}`"],
    ], "ll")
    prompts = m.get("prompts", {})
    rows = [
        [
            pid, p.get("prompt_len"), p.get("generated", p["length"] - p["prompt_len"]), p.get("length"),
            str(p.get("stop", "")),
        ]
        for pid, p in prompts.items()
    ]
    total = sum(p["length"] for p in prompts.values())
    out += f"\n{len(prompts)} prompts, {total:,} positions in all.\n\n"
    return out + md_table(["prompt", "prompt tokens", "generated", "length T", "stop"], rows, "lrrrl")


def _harm(r: _Run) -> tuple[HarmSpec, str]:
    """The harm settings and where they come from (rank-eval's config, else the figures', else defaults)."""
    return HarmSpec.from_configs(
        ("rank-eval's settings", r.rank_eval["config"].get("config", {}) if r.rank_eval is not None else None),
        ("the figures' settings", r.figures.get("params", {}) if r.figures is not None else None),
    )


def label_statistics(labels: pl.DataFrame, spec: HarmSpec | None = None) -> dict[str, dict]:
    """Per granularity: counts, noise floors (one per checkpoint), the kl_mean distribution, unresolved labels
    (``spec.unresolved``) and the harm threshold and prevalence over the analysed ones (``spec.analysed``)."""
    spec = spec or HarmSpec()
    out = {}
    for (gran,), df in labels.sort("granularity").group_by("granularity", maintain_order=True):
        kl = df["kl_mean"].to_numpy().astype(float)
        floors = (
            df.group_by("prompt_id", "checkpoint")
            .agg(pl.col("noise_floor").first())["noise_floor"]
            .to_numpy()
            .astype(float)
        )
        unresolved = df.select(spec.unresolved().alias("u"))["u"].to_numpy()
        resolved = spec.analysed(df, require=False)["kl_mean"].to_numpy().astype(float)
        threshold = spec.threshold(resolved)
        s = {
            "rows": df.height, "prompts": df["prompt_id"].n_unique(), "checkpoints": len(floors),
            "candidates per checkpoint (median)": float(df.group_by("prompt_id", "checkpoint").len()["len"].median()),
            "noise floor min": floors.min(), "noise floor median": float(np.median(floors)),
            "noise floor max": floors.max(), "kl_mean mean": kl.mean(),
            **{f"kl_mean q{q:g}": float(np.quantile(kl, q)) for q in KL_QUANTILES}, "unresolved": int(unresolved.sum()),
            "unresolved share": float(unresolved.mean()), "harm threshold": threshold,
            "harmful": int((resolved > threshold).sum()) if len(resolved) else 0,
            "prevalence": float((resolved > threshold).mean()) if len(resolved) else float("nan"),
        }
        out[gran] = s
    return out


def _label_stats(r: _Run) -> tuple[dict[str, dict] | None, str]:
    """``label_statistics`` of the run's labels under its harm settings (once: the headline and the Labels section
    both show it), or None and why not."""
    if "label_stats" not in r.__dict__:
        spec, _ = _harm(r)
        try:
            r.label_stats = (label_statistics(r.labels[0], spec), "")
        except UserError as err:  # labels the harm settings cannot analyse (no noise floor, NaN kl_mean)
            r.label_stats = (None, str(err))
    return r.label_stats


# a random scorer is the chance reference of the ranking, not a rule: never the headline's best rule
_REFERENCE = pl.col("scorer").str.starts_with("random")


def _ranking_finding(r: _Run) -> str | None:
    """The best-ranking rule by AUROC (rank-eval's metrics.csv, in the scope of its table.md), with its CI and n, the
    runner-up, the random reference and the paired difference against rank-eval's reference rule: the same numbers,
    formatted the same way, as the Ranking metrics section's table below."""
    from kvdiag.core.stats import format_p
    from kvdiag.rankeval.run import load_metrics
    from kvdiag.rankeval.tables import _fmt

    cfg = r.rank_eval["config"].get("config", {})
    scope = cfg.get("table_scope", "pooled")
    try:
        metrics = load_metrics(r.run / LAYOUT["rank-eval"][0], "--run")
    except (UserError, OSError, ValueError) as err:
        return f"- **Ranking:** rank-eval's metrics.csv cannot be read ({err})."
    auroc = metrics.filter((pl.col("metric") == "auroc") & (pl.col("scope") == scope) & pl.col("value").is_not_nan())
    rules = auroc.filter(~_REFERENCE)
    if rules.is_empty():
        return "- **Ranking:** no rule has a defined AUROC (metrics.csv's note column says why)."
    ranked = rules.sort("value", descending=True, maintain_order=True).to_dicts()
    best = ranked[0]

    def shown(row: dict) -> str:
        return f"`{row['scorer']}` {_fmt(row['value'], row['ci_low'], row['ci_high'])}"

    ci = f"{cfg['ci_level']:.0%} cluster-bootstrap CI over prompts" if cfg.get("n_boot") else "no CI (no bootstrap)"
    out = (f"- **Ranking (rank-eval, {scope}):** the best rule by AUROC is {shown(best)} ({ci}; n = {best['n']:,} "
           f"{'candidates' if scope == 'pooled' else 'checkpoints'}) of {len(ranked)} rules")
    if len(ranked) > 1:
        out += f"; next {shown(ranked[1])}"
        if not math.isnan(best["ci_low"]) and best["ci_low"] <= ranked[1]["value"]:  # a top that is not separated
            out += " (the best rule's CI covers the next rule's AUROC: their order is not resolved)"
    reference = auroc.filter(_REFERENCE).to_dicts()
    if reference:
        out += f"; the random reference {shown(reference[0])}"
    out += "."
    paired = r.run / LAYOUT["rank-eval"][0] / "paired.csv"
    if paired.is_file():  # the paired difference rank-eval already tested: best rule against its reference rule
        p = read_csv(paired, PAIRED_SCHEMA, "--run", "re-run kvdiag rank-eval",
                     keys=("scorer", "reference", "metric", "scope")).filter(
            (pl.col("scorer") == best["scorer"]) & (pl.col("metric") == "auroc") & (pl.col("scope") == scope))
        if p.height:
            d = p.row(0, named=True)
            p_text = ("" if d["p_value"] is None else
                      f", p = {format_p(d['p_value'])} ({d['test']} test; Holm {format_p(d['p_holm'])})")
            out += (f" Against the reference rule `{d['reference']}` ({_fmt(d['reference_value'], math.nan, math.nan)}"
                    f"): ΔAUROC {_fmt(d['diff'], d['ci_low'], d['ci_high'])}{p_text}, over {d['prompts']} prompts "
                    "(`rank-eval/paired.csv`).")
    return out


def _labels_finding(r: _Run) -> str | None:
    """How many labels, how many harmful and the threshold: the Labels section's statistics, formatted as its table
    formats them."""
    stats, why = _label_stats(r)
    if stats is None:
        return f"- **Labels:** the label statistics cannot be computed: {why}."
    parts = []
    for gran, s in stats.items():
        c = {k: cell_text(v) for k, v in s.items()}
        parts.append(f"{gran}: {c['harmful']} harmful of {c['rows']} labels over {c['prompts']} prompts and "
                     f"{c['checkpoints']} checkpoints (prevalence {c['prevalence']} of the analysed labels; harm "
                     f"threshold {c['harm threshold']} nats; {c['unresolved']} unresolved)")
    return "- **Labels:** " + "; ".join(parts) + "."


def _headline(r: _Run) -> str:
    """What the run found, before how it was set up: the figures below that answer the question (best rule by AUROC
    with its CI and n, the label statistics), each stated as the section it comes from states it."""
    lines = []
    if r.rank_eval is not None:
        lines.append(_ranking_finding(r))
    else:
        lines.append(f"- **Ranking:** rank-eval is {r.status['rank-eval']}, so no rule is ranked yet "
                     f"(`{LAYOUT['rank-eval'][1]}`).")
    if r.labels is not None:
        lines.append(_labels_finding(r))
    fit = r.optional("fit", fit_summary)
    if fit is not None:
        s = fit["config"]["summary"]
        lines.append(f"- **Fitted ceiling:** `kvdiag fit` on {len(s['features'])} features, {s['n']:,} entries "
                     f"({s['n_harmful']} harmful), {s['folds']} folds grouped by prompt; its AUROCs are in the fitted "
                     "ceiling table below.")
    return ("## Findings\n\nWhat this run found; each figure is the one its section below states (set-up and "
            "provenance follow).\n\n" + "\n".join(lines) + "\n")


def _labels_section(r: _Run) -> str:
    out = "## Labels\n\n"
    if r.labels is None:
        return out + f"The labels are {r.status['labels']}: `{LAYOUT['labels'][1]}`.\n"
    df, meta = r.labels
    cfg = meta.get("config", {})
    if meta.get("label"):
        out += f"Label: {meta['label']}.\n\n"
    if cfg:
        out += "Settings: " + ", ".join(f"{k} = {v}" for k, v in cfg.items()) + ".\n\n"
    spec, source = _harm(r)
    stats, why = _label_stats(r)
    if stats is None:
        return out + f"The label statistics cannot be computed: {why}.\n"
    grans = list(stats)
    names = list(next(iter(stats.values()))) if stats else []
    out += md_table(["statistic", *grans], [[n, *(stats[g][n] for g in grans)] for n in names], "l" + "r" * len(grans))
    over = "every label" if spec.include_unresolved else "the resolved labels"
    return out + (f"\nNoise floor: the KL of a null eviction at each checkpoint. Unresolved: kl_mean <= "
                  f"{spec.noise_mult:g} × noise floor. Harmful: kl_mean above the threshold of `{spec.harm}` over "
                  f"{over} ({source}).\n")


def _scores_section(r: _Run) -> str:
    out = "## Scores\n\n"
    if r.scores is None:
        return out + f"The scores are {r.status['scores']}: `{LAYOUT['scores'][1]}`.\n"
    df, meta = r.scores
    scorers = meta.get("scorers") or {c: {} for c in df.columns if df.schema[c].is_float()}
    out += f"{df.height:,} rows; aggregation `{meta.get('aggregation', '?')}`"
    out += f" ({meta['aggregation_doc']}).\n\n" if meta.get("aggregation_doc") else ".\n\n"
    rows = [
        [f"`{name}`", ", ".join(f"{k}={v}" for k, v in (params or {}).items()) or "—"]
        for name, params in scorers.items()
    ]
    return out + md_table(["scorer", "parameters"], rows, "ll")


def _rank_eval_section(r: _Run, rel: str) -> str:
    out = "## Ranking metrics (Table 3)\n\n"
    if r.rank_eval is None:
        return out + f"rank-eval is {r.status['rank-eval']}: `{LAYOUT['rank-eval'][1]}`.\n"
    cfg = r.rank_eval["config"]
    out += r.rank_eval["table.md"] or "*table.md is missing.*\n"
    warnings = cfg.get("summary", {}).get("warnings") or []
    if warnings:
        out += "\n" + "\n".join(f"- warning: {w}" for w in warnings) + "\n"
    out += (
        "\nAll metrics with their CIs and notes: `rank-eval/metrics.csv`; paired differences: `rank-eval/paired.csv`.\n"
    )
    if r.rank_eval["has_budget_curves"]:
        out += (f"\n### Budget curves\n\nFSR@ρ and FNR@ρ over a grid of ρ (one ρ hides where rules cross); dashed: the "
                "random scorer. Numbers: `rank-eval/budget_curves.csv`.\n\n![budget "
                f"curves]({rel}/rank-eval/budget_curves.png)\n")
    eligible = r.optional("rank-eval-eligible", rank_eval_summary)
    if eligible is not None and eligible["table.md"] is not None:
        summary = eligible["config"].get("summary", {})
        out += (f"\n### Table 3 on an eligible candidate set\n\nCandidates: {summary.get('candidates', '?')} "
                f"({summary.get('n_evaluated', '?')} of the labels). The paper's Table 3 ranks S_i(t) on eligible "
                f"candidates only; every rule is ranked here on the same set. Outputs: `rank-eval-eligible/`.\n\n")
        out += eligible["table.md"]
    return out + _ceiling_section(r)


def _ceiling_section(r: _Run) -> str:
    """The fitted ceiling (``kvdiag fit`` in RUN/fit), when present."""
    fit = r.optional("fit", fit_summary)
    if fit is None:
        return r.unreadable("fit", "\n### Fitted ceiling for feature-based rules", "kvdiag fit")
    s, imp = fit["config"]["summary"], fit["importances"]
    rows = [[f["feature"], f"{f['logreg_std_coef']:+.3f}", f"{f['logreg_permutation_auroc_drop']:.4f}",
             f"{f['gbt_permutation_auroc_drop']:.4f}"] for f in imp.iter_rows(named=True)]
    return (f"\n### Fitted ceiling for feature-based rules\n\n`kvdiag fit`: logistic regression (`fitted_logreg`) and "
            f"gradient-boosted trees (`fitted_gbt`) predict the harmful label from {len(s['features'])} per-entry "
            "features; "
            f"each entry's score comes from a model that never saw its prompt ({s['folds']} folds grouped by prompt, "
            f"{s['n']:,} entries, {s['n_harmful']} harmful). Ranked by rank-eval beside the rules; paired differences "
            f"against `fitted_logreg`. An upper reference for rules built on these features under this label, not a "
            f"policy claim.\n\n" + fit["table.md"] +
            "\nFeature importances (standardized logistic-regression coefficient; mean drop of out-of-fold AUROC when "
            "the feature is permuted):\n\n" +
            md_table(["feature", "logreg coef", "logreg Δ AUROC", "trees Δ AUROC"], rows, "lrrr"))


def _stats_table(path: Path) -> str:
    from kvdiag.core.plotting import STATS_SCHEMA

    df = read_csv(path, STATS_SCHEMA, "--run", "re-run kvdiag figures", keys=("statistic",))
    return md_table(
        ["statistic", "value", "note"],
        [[r["statistic"], r["value"], r["note"] or ""] for r in df.iter_rows(named=True)], "lrl",
    )


def _components_table(path: Path) -> str:
    from kvdiag.figures.components import RANDOM_SCORER, TABLE_SCHEMA
    from kvdiag.rankeval import metrics_where

    df = read_csv(path, TABLE_SCHEMA, "--run", "re-run kvdiag figures", keys=("scorer", "variant", "metric", "scope"))
    cells = {(r["variant"], r["metric"]): r for r in df.filter(pl.col("scorer") != RANDOM_SCORER).iter_rows(named=True)}

    def cell(r: dict | None) -> str:
        if r is None or math.isnan(r["value"]):
            return "n/a"
        return f"{r['value']:.3f}" + ("" if math.isnan(r["ci_low"]) else f" [{r['ci_low']:.3f}, {r['ci_high']:.3f}]")

    variants = list(dict.fromkeys(v for v, _ in cells))
    metrics = metrics_where("figure")
    rows = [[v, *(cell(cells.get((v, m.name))) for m in metrics)] for v in variants]
    return md_table(["Variant", *(m.title for m in metrics)], rows, "l" + "r" * len(metrics))


def _figures_section(r: _Run, rel: str) -> str:
    from kvdiag.figures import FIGURES

    out = "## Figures\n\n"
    if r.figures is None:
        return out + f"The figures are {r.status['figures']}: `{LAYOUT['figures'][1]}`.\n"
    fig_dir = r.run / "figures"
    params = r.figures.get("params", {})
    out += "Parameters: " + ", ".join(f"{k} = {v}" for k, v in params.items()) + " (docs/figures.md).\n\n"
    for name, figure in FIGURES.items():
        title, csvs = figure.title, figure.csvs
        out += f"### {title}\n\n"
        png = fig_dir / f"{name}.png"
        if png.is_file():
            out += f"![{title}]({rel}/figures/{name}.png)\n\n"
            out += (
                f"[PDF]({rel}/figures/{name}.pdf) · " + " · ".join(f"[{c}]({rel}/figures/{c})" for c in csvs) + "\n\n"
            )
        else:
            out += f"**{name}.png is missing** from figures/.\n\n"
        main = fig_dir / csvs[0]
        if main.is_file():
            out += _components_table(main) if name == "components" else _stats_table(main)
            out += "\n"
    notes = r.figures.get("summary", {}).get("notes") or []
    if notes:
        out += "### Notes\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    return out


def _decisions_section(r: _Run, rel: str) -> str:
    """The decisions (``kvdiag decisions`` in RUN/decisions), when present: its summary, one heading level down."""
    from kvdiag.decisions import load_summary

    d = r.optional("decisions", load_summary)
    if d is None:
        return r.unreadable("decisions", "## Decisions", "kvdiag decisions")
    body = d["summary.md"].split("\n", 1)[1] if d["summary.md"].startswith("# ") else d["summary.md"]
    body = "\n".join(("#" + line) if line.startswith("## ") else line for line in body.splitlines())
    out = ("## Decisions: the joint damage of each rule's evicted set\n\n`kvdiag decisions` (docs/decisions.md): "
           "every rule's evicted set under each budget, labeled exactly as one eviction of the whole set, against "
           "the reference decisions. Outputs: `decisions/`.\n" + body + "\n")
    if d["has_figure"]:
        out += f"\n![joint damage against the budget]({rel}/decisions/decisions.png)\n"
    return out


def _decisions_table(r: _Run):
    """RUN/decisions/decisions.parquet for the viewer, or None."""
    from kvdiag.core.io import read_table

    return r.optional("decisions/decisions.parquet", lambda p: read_table(p, "decisions")[0])


def _viewer_section(r: _Run, out: Path) -> str:
    """Write ``viewer.html`` (kvdiag.report.viewer) beside the report and link it, or say why it could not be
    written."""
    from kvdiag.report.viewer import ViewerSettings, build_viewer

    out_md = "## Token viewer\n\n"
    settings = ViewerSettings.from_configs(
        (r.rank_eval or {}).get("config", {}).get("config"), (r.figures or {}).get("params")
    )
    try:
        build_viewer(r.trace, r.labels and r.labels[0], r.scores and r.scores[0], out / "viewer.html",
                     labels_meta=r.labels and r.labels[1], scores_meta=r.scores and r.scores[1], settings=settings,
                     figures_dir=r.run / "figures" if r.figures is not None else None, decisions=_decisions_table(r))
    except UserError as err:
        return out_md + f"`viewer.html` not written: {err}\n"
    return out_md + ("[viewer.html](viewer.html): the trace token by token, coloured by each candidate's oracle label "
                     "at a chosen checkpoint, with the entries each rule evicts at a chosen ρ or budget, the misses "
                     "among them, and the delayed-read and blind-spot entries of the figures (one self-contained page; "
                     "docs/report.md, section Token viewer).\n")


def _commands_section(r: _Run) -> str:
    out = "## Commands and configuration\n\n"
    if r.commands:
        out += "The commands that produced this run, in order (`commands.json`):\n\n```bash\n"
        out += (
            "".join(f"# {c.get('time', '')}  (cwd {c.get('cwd', '?')})\n{shlex.join(c['argv'])}\n" for c in r.commands)
            + "```\n\n"
        )
    else:
        out += f"`commands.json` is {r.status['commands']}: the exact commands were not recorded (record them with "
        out += "`kvdiag.report.run.record_command(RUN, argv)`); the configurations below determine the outputs.\n\n"
        if r.figures is not None and r.figures.get("argv"):
            out += f"The figures were made by:\n\n```bash\n{shlex.join(r.figures['argv'])}\n```\n\n"
    def pick(meta: dict, keys: tuple[str, ...]) -> dict:
        return {k: meta[k] for k in keys if k in meta}

    configs = []
    if r.labels is not None:
        configs.append(("labels (`labels.parquet` metadata)", pick(r.labels[1], ("config", "model", "trace"))))
    if r.scores is not None:
        configs.append(
            ("scores (`scores.parquet` metadata)", pick(r.scores[1], ("scorers", "aggregation", "source", "trace")))
        )
    if r.rank_eval is not None:
        configs.append(("rank-eval (`rank-eval/config.json`)", r.rank_eval["config"].get("config", {})))
    if r.figures is not None:
        configs.append(("figures (`figures/figures.json`)", r.figures.get("params", {})))
    for title, cfg in configs:
        out += f"**{title}**\n\n" + _json_block(cfg) + "\n"
    return out


# --------------------------------------------------------------------------- Markdown -> HTML


def markdown_to_html(markdown: str, base: Path, title: str) -> str:
    """A self-contained HTML page: Markdown rendered by markdown-it (tables on), local PNG images embedded as
    base64 data URIs (paths relative to ``base``)."""
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)

    def embed(match: re.Match) -> str:
        src = html.unescape(match.group(1))
        path = (base / src).resolve()
        if src.startswith(("data:", "http:", "https:")) or not path.is_file():
            return match.group(0)
        data = base64.b64encode(path.read_bytes()).decode()
        return f'src="data:image/png;base64,{data}"'

    body = re.sub(r'src="([^"]+\.png)"', embed, body)
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta "
            f"charset=\"utf-8\">\n<title>{html.escape(title)}</title>\n"
            f"<style>\n{HTML_STYLE}\n</style>\n</head>\n<body>\n{body}</body>\n</html>\n")


def report_files(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write ``report.md``, ``report.html`` (self-contained) and ``viewer.html`` (kvdiag.report.viewer) for the run
    directory
    ``run_dir`` (layout: module docstring) into ``out_dir`` (default: the run directory). Returns ``(md_path,
    html_path)``.

    Missing or unreadable pieces are listed and skipped; pieces made from different Traces are flagged.
    A run directory that does not exist or holds no piece at all is a ``UserError``.
    """
    from kvdiag.core.guard import check_creatable, check_outputs
    from kvdiag.core.io import writable_dir

    run = check_run_dir(run_dir)
    folder = check_creatable(out_dir or run, "--out", "dir")
    check_outputs({f"--out ({name})": folder / name for name in REPORT_FILES},  # the run directory holds the inputs
                  {f"--run {rel}": run / rel for rel, _ in LAYOUT.values() if rel != "commands.json"})
    r = _Run(run)
    if r.trace is not None:
        from kvdiag.model.load import check_not_random

        check_not_random(r.trace.manifest["model"], f"--run {run}")
    out = writable_dir(out_dir or run, "--out")
    rel = os.path.relpath(run.resolve(), out.resolve()).replace(os.sep, "/")
    title = f"kvdiag report: {run.resolve().name}"
    md = "\n".join(section for section in [
        f"# {title}\n",
        # relative, so a committed report names no path of the machine that made it
        f"Run directory `{rel}` (relative to this report); report made {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by "
        f"kvdiag {__version__}.\n",
        _headline(r),  # what was found first; set-up and provenance after
        _contents(r), _trace_section(r), _labels_section(r), _scores_section(r), _rank_eval_section(r, rel),
        _figures_section(r, rel), _decisions_section(r, rel), _viewer_section(r, out), _commands_section(r),
    ] if section)  # an optional section that is absent adds nothing
    md_path, html_path = out / "report.md", out / "report.html"
    md_path.write_text(md)
    html_path.write_text(markdown_to_html(md, out, title))
    return md_path, html_path
