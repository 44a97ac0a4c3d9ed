"""The paper's Table 3 layout (one row per scorer) in Markdown and LaTeX (booktabs)."""

from __future__ import annotations

import math

import polars as pl

from kvdiag.core.tables import markdown_table
from kvdiag.rankeval.evaluate import RankEvalResult
from kvdiag.rankeval.registry import metrics_where

_LATEX_HEADERS = {"Top-k recall": "Top-$k$ recall"}
_LATEX_SPECIAL = {c: "\\" + c for c in "&%$#_{}"} | {
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "\\": r"\textbackslash{}",
    "<": r"\textless{}",  # OT1 font encoding prints < and > as inverted marks
    ">": r"\textgreater{}",
}


def _cells(result: RankEvalResult, scope: str) -> tuple[dict[tuple[str, str], tuple[float, float, float]], bool]:
    """(scorer, metric) -> (value, ci_low, ci_high), and whether any value is undefined."""
    rows = result.metrics.filter(pl.col("scope") == scope).iter_rows(named=True)
    cells = {(r["scorer"], r["metric"]): (r["value"], r["ci_low"], r["ci_high"]) for r in rows}
    undefined = any(math.isnan(cells[(s, m.name)][0]) for s in result.scorers for m in metrics_where("table"))
    return cells, undefined


def _fmt(value: float, low: float, high: float) -> str:
    if math.isnan(value):
        return "n/a"
    if math.isnan(low):
        return f"{value:.3f}"
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def caption(result: RankEvalResult, scope: str = "pooled", undefined: bool = False) -> str:
    """One-paragraph caption: candidates, harm threshold and prevalence, rho, scope and CI method."""
    s, c = result.summary, result.config
    unresolved = (
        f"; {s['n_unresolved']} labels below their noise floor excluded"
        if s["unresolved_excluded"] and s["n_unresolved"]
        else ""
    )
    ci = (
        f"{c.ci_level:.0%} cluster-bootstrap CIs over prompts (B = {c.n_boot})" if c.n_boot else "no confidence "
            "intervals (no bootstrap)"
    )
    how = "pooled over all candidates" if scope == "pooled" else "macro averages over checkpoints"
    text = (
        f"Oracle ranking quality against the {s['granularity']}-eviction KL label on {s['n_evaluated']:,} candidates "
        f"({s['n_prompts']} prompts, {s['n_checkpoints']} checkpoints{unresolved}; "
        f"{s.get('candidates', 'all candidates')}). "
        f"Harmful: kl_mean > {s['harm_threshold']:.4g} nats ({c.harm}), prevalence {s['prevalence']:.3f}. "
        f"False-safe rate: share of the evicted entries that are harmful when the lowest-scored rho = {c.rho:g} "
        f"of each checkpoint is evicted. Metrics {how}; {ci}."
    )
    return text + (" n/a: undefined (see the note column of metrics.csv)." if undefined else "")


def to_markdown(result: RankEvalResult, scope: str = "pooled") -> str:
    """The Table-3-shaped table (the metrics flagged ``table``) as Markdown, caption below."""
    cells, undefined = _cells(result, scope)
    columns = metrics_where("table")
    rows = [[name, *(_fmt(*cells[(name, m.name)]) for m in columns)] for name in result.scorers]
    table = markdown_table(["Score", *(m.title for m in columns)], rows)
    return table + f"\n*{caption(result, scope, undefined)}*\n"


def latex_escape(text: str) -> str:
    """Escape LaTeX special characters (scorer names contain underscores)."""
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def to_latex(result: RankEvalResult, scope: str = "pooled", label: str = "tab:rank-eval") -> str:
    """The Table-3-shaped table as a LaTeX ``table`` with booktabs rules (needs ``\\usepackage{booktabs}``)."""
    cells, undefined = _cells(result, scope)
    columns = metrics_where("table")
    headers = " & ".join(_LATEX_HEADERS.get(m.title, m.title) for m in columns)
    body = []
    for name in result.scorers:
        row = []
        for m in columns:
            value, low, high = cells[(name, m.name)]
            cell = _fmt(value, float("nan"), float("nan"))
            if not (math.isnan(value) or math.isnan(low)):
                cell += rf" {{\scriptsize [{low:.3f}, {high:.3f}]}}"
            row.append(cell)
        body.append(f"{latex_escape(name)} & " + " & ".join(row) + r" \\")
    return "\n".join(
        [
            r"\begin{table}[t]", r"\centering", r"\small", r"\begin{tabular}{l" + "c" * len(columns) + "}", r"\toprule",
            f"Score & {headers} \\\\", r"\midrule", *body, r"\bottomrule", r"\end{tabular}",
            rf"\caption{{{latex_escape(caption(result, scope, undefined))}}}", rf"\label{{{label}}}", r"\end{table}",
            "",
        ]
    )
