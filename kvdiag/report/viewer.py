"""``build_viewer``: ``viewer.html``, one self-contained page (vanilla JS, no network) showing a run's trace token by
token, coloured by oracle damage at a chosen checkpoint, with each rule's eviction decision at a chosen ρ or budget.

The page embeds its data once as compact JSON; the script renders the tokens of a prompt once and recolours them by
swapping class names (docs/report.md, "Token viewer"). Conventions follow ``rank-eval``: harmful = ``kl_mean`` strictly
above
the ``--harm`` threshold of the evaluated labels (resolved, scored token labels); a rule evicts the ``floor(ρ·C)``
lowest-scored candidates of a checkpoint, a tie group straddling the boundary evicted at random (shown as partly evicted
with its probability). Unlike rank-eval, C counts every scored candidate of the checkpoint, unresolved ones included:
the viewer shows the decision the rule makes in the cache, where labels are unknown.
"""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.errors import UserError
from kvdiag.core.harm import HarmSpec
from kvdiag.core.schema import HARM, KEYS, NOISE_MULT, RHO

KL_BINS = 10  # colour bins of the log-KL scale (the stylesheet defines .k0 ... .k9)
# JSON numbers: 4 significant digits are enough to colour and to read, and keep a 4k-token page small
_DIGITS = 4


@dataclass(frozen=True)
class ViewerSettings:
    """How labels are classified and where the eviction control starts (defaults: rank-eval's)."""

    harm: str = HARM  # harmful: kl_mean > threshold; quantile:Q of the evaluated labels, or abs:TAU
    noise_mult: float = NOISE_MULT  # unresolved: kl_mean <= noise_mult * noise_floor
    include_unresolved: bool = False  # whether unresolved labels enter the harm threshold (rank-eval's flag)
    rho: float = RHO  # initial eviction fraction

    @property
    def harm_spec(self) -> HarmSpec:
        return HarmSpec(self.harm, self.noise_mult, self.include_unresolved)

    @classmethod
    def from_configs(cls, rank_eval: dict | None = None, figures: dict | None = None) -> ViewerSettings:
        """rank-eval's settings (``config.json["config"]``), else the figures' (``figures.json["params"]``), else
        defaults."""
        spec, _ = HarmSpec.from_configs(("rank-eval", rank_eval), ("figures", figures))
        return cls(**spec.to_config(), rho=float((rank_eval or figures or {}).get("rho", RHO)))


def _round(x: np.ndarray) -> list[float]:
    return [float(f"{v:.{_DIGITS}g}") for v in x]


def _tie_ranks(s: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Per candidate: how many scored candidates score strictly lower (-1: not scored), the size of its tie group,
    and the number scored. Eviction at n takes the candidates with ``lo + size <= n`` and, of the group with
    ``lo < n < lo + size``, ``n - lo`` chosen at random (metrics.py's tie convention)."""
    ok = np.isfinite(s)
    srt = np.sort(s[ok])
    lo = np.searchsorted(srt, s, "left")
    size = np.searchsorted(srt, s, "right") - lo
    return np.where(ok, lo, -1), np.where(ok, size, 0), int(ok.sum())


def _figure_marks(figures_dir: Path | None) -> tuple[dict, dict, list[str]]:
    """Delayed-read entries ``{prompt: {position: [first strong read, delay, evicted before read]}}`` and blind-spot
    points ``{prompt: {checkpoint: [[position, read pressure, value payload], ...]}}`` from the figures' CSVs."""
    delayed: dict = {}
    blind: dict = {}
    notes = []
    if figures_dir is None:
        return delayed, blind, ["no figures/: delayed-read and blind-spot marks are off (kvdiag figures)"]
    entries, points = figures_dir / "delayed_reads_entries.csv", figures_dir / "blind_spot_points.csv"
    try:
        if entries.is_file():
            df = pl.read_csv(entries, glob=False).filter(pl.col("read_class") == "delayed")
            for r in df.iter_rows(named=True):
                delayed.setdefault(r["prompt_id"], {})[int(r["position"])] = [
                    int(r["first_strong_read"]), int(r["delay"]), bool(r["evicted_before_read"])]
        else:
            notes.append(f"{entries.name} is missing: no delayed-read marks")
        if points.is_file():
            df = pl.read_csv(points, glob=False).filter(pl.col("blind_spot"))
            for r in df.iter_rows(named=True):
                blind.setdefault(r["prompt_id"], {}).setdefault(int(r["checkpoint"]), []).append(
                    [int(r["position"]), *_round(np.array([r["read_pressure"], r["value_payload"]]))])
        else:
            notes.append(f"{points.name} is missing: no blind-spot marks")
    except (pl.exceptions.PolarsError, KeyError, TypeError, ValueError) as err:
        raise UserError(f"{figures_dir}: a figures CSV is unreadable ({type(err).__name__}: {err}); rerun kvdiag "
                        "figures") from err
    return delayed, blind, notes


def viewer_data(
    tokens: pl.DataFrame, prompt_lens: dict[str, int], labels: pl.DataFrame, scores: pl.DataFrame | None = None,
    settings: ViewerSettings = ViewerSettings(), figures_dir: str | os.PathLike | None = None,
    title: str = "kvdiag token viewer", decisions: pl.DataFrame | None = None, cells: int = 1,
) -> dict:
    """The page's data. ``tokens``: prompt_id, position, token_id (token_text if present) of every prompt in
    ``prompt_lens`` (prompt id -> prompt length); ``labels``: kvdiag label's table; ``scores``: kvdiag score's;
    ``decisions``: kvdiag decisions' table (each decision's evicted set and joint damage per checkpoint), whose
    sets span ``cells`` (layer, KV head) pairs."""
    spec = settings.harm_spec
    labels = labels.filter(pl.col("granularity") == "token").filter(pl.col("prompt_id").is_in(list(prompt_lens)))
    if labels.height == 0:
        raise UserError("the labels hold no token-granularity label of the Trace's prompts: label with --granularity "
                        "token")
    labels = labels.with_columns(pl.col("layer").fill_null(-1), pl.col("kv_head").fill_null(-1))
    rules: list[str] = []
    if scores is not None:
        rules = [c for c in scores.columns if c not in KEYS and scores.schema[c].is_numeric()]
        # prefixed: a score column may share a name with a label column
        labels = labels.join(
            scores.select(*KEYS, *(pl.col(r).alias(f"score:{r}") for r in rules)), on=list(KEYS), how="left"
        )
    labels = labels.with_columns(_unres=spec.unresolved()).sort("prompt_id", "checkpoint", "position")

    # harm threshold over rank-eval's evaluated rows: scored (when there are scores) and resolved (unless included)
    evaluated = spec.analysed(labels, what="token labels", require=False)
    if rules:
        evaluated = evaluated.filter(pl.any_horizontal(pl.col(f"score:{r}").is_not_null() for r in rules))
    kl_eval = evaluated["kl_mean"].to_numpy().astype(float)
    threshold = spec.threshold(kl_eval)
    resolved_kl = labels.filter(~pl.col("_unres"))["kl_mean"].to_numpy().astype(float)
    positive = resolved_kl[resolved_kl > 0]
    lo, hi = (np.log10(np.quantile(positive, [0.01, 1.0])) if len(positive) else (-12.0, 0.0))

    delayed, blind, notes = _figure_marks(Path(figures_dir) if figures_dir is not None else None)
    if decisions is not None:
        from kvdiag.decisions.summary import distinct_names

        # one row per (decision, budget, checkpoint): the deterministic sets (stochastic draws are summary material)
        decisions = distinct_names(decisions.filter(pl.col("sample").is_null()) if "sample" in decisions.columns
                                   else decisions)
    dec_index = _decision_index(decisions)
    text_col = "token_text" if "token_text" in tokens.columns else None
    prompts = []
    labeled = set(labels["prompt_id"].unique())
    if unlabeled := [pid for pid in prompt_lens if pid not in labeled]:
        notes.append(f"{len(unlabeled)} prompt(s) without token labels left out: {', '.join(unlabeled)}")
    for pid, plen in prompt_lens.items():
        if pid not in labeled:
            continue
        tok = tokens.filter(pl.col("prompt_id") == pid).sort("position")
        ids = tok["token_id"].to_list()
        texts = tok[text_col].to_list() if text_col else [None] * len(ids)
        # an empty piece (special or partial byte) would be unhoverable: show its id
        shown = [t if t else f"⟨{i}⟩" for t, i in zip(texts, ids, strict=True)]
        ckpts = []
        for (t,), g in labels.filter(pl.col("prompt_id") == pid).group_by("checkpoint", maintain_order=True):
            kl = g["kl_mean"].to_numpy().astype(float)
            unres = g["_unres"].to_numpy()
            harmful = (kl > threshold) & (settings.include_unresolved | ~unres)
            c = {
                "t": int(t), "floor": _round(g["noise_floor"].to_numpy()[:1].astype(float))[0],
                "pos": g["position"].to_list(), "kl": _round(kl),
                "st": np.where(harmful, 1, np.where(unres, 2, 0)).tolist(),
                "age": g["age"].to_list() if "age" in g.columns else (int(t) - g["position"]).to_list(),
                "flips": g["top1_flips"].fill_null(-1).to_list() if "top1_flips" in g.columns else [-1] * g.height,
                "lo": [], "sz": {}, "n": [],
            }
            for k, rule in enumerate(rules):
                lo_r, size, n = _tie_ranks(g[f"score:{rule}"].cast(pl.Float64).fill_null(float("nan")).to_numpy())
                c["lo"].append(lo_r.tolist())
                c["n"].append(n)
                if (size > 1).any():  # sizes only where ties exist: most rules have none
                    c["sz"][k] = size.tolist()
            c["dec"] = _decision_sets(decisions, pid, int(t), dec_index, cells) if decisions is not None else []
            ckpts.append(c)
        prompts.append({"id": pid, "plen": int(plen), "tokens": shown, "ckpts": ckpts,
                        "dr": delayed.get(pid, {}), "bs": blind.get(pid, {})})
    return {
        "meta": {
            "title": title, "harm": settings.harm, "threshold": None if math.isnan(threshold) else threshold,
            "noise_mult": settings.noise_mult, "include_unresolved": settings.include_unresolved, "rho": settings.rho,
            "n_evaluated": len(kl_eval), "log_lo": float(lo), "log_hi": float(max(hi, lo + 1e-6)), "bins": KL_BINS,
            "rules": rules, "notes": notes, "figures": figures_dir is not None,
            "decisions": [f"{d} at {b}" for d, b in dec_index],
        },
        "prompts": prompts,
    }


def _decision_index(decisions: pl.DataFrame | None) -> list[tuple[str, str]]:
    """(decision, budget) pairs in the viewer's order: every budget of a decision together."""
    if decisions is None or decisions.height == 0:
        return []
    pairs = decisions.select("decision", "budget").unique(maintain_order=True)
    return [(d, b) for d in pairs["decision"].unique(maintain_order=True) for b in
            pairs.filter(pl.col("decision") == d)["budget"].to_list()]


def _decision_sets(decisions: pl.DataFrame, pid: str, t: int, index: list[tuple[str, str]], cells: int) -> list:
    """Per (decision, budget) of ``index`` at checkpoint ``t``: [kl_mean, sum of singles, evicted-share string] or
    None. The string has one digit per position < t: the share of the ``cells`` (layer, KV head)s that evict it,
    0..9 (9: all of them; a token set is all or nothing)."""
    rows = {(r["decision"], r["budget"]): r for r in
            decisions.filter((pl.col("prompt_id") == pid) & (pl.col("checkpoint") == t)).iter_rows(named=True)}
    out = []
    for key in index:
        r = rows.get(key)
        if r is None or r["kl_mean"] is None:
            out.append(None)
            continue
        # 9 only when every cell evicts it, 1..8 when some do: a partly evicted entry never looks kept or gone
        share = "".join("9" if n >= cells else str(min(8, max(1, round(9 * n / cells)))) if n else "0"
                        for n in r["evicted_heads"])
        out.append([float(f"{r['kl_mean']:.{_DIGITS}g}"),
                    None if r["sum_single"] is None else float(f"{r['sum_single']:.{_DIGITS}g}"), share])
    return out


def viewer_html(data: dict) -> str:
    """The page: the template with its stylesheet, script and data inlined (no external reference)."""
    static = resources.files("kvdiag.report") / "viewer_static"
    page = (static / "viewer.html").read_text()
    # "<" only occurs inside JSON strings, where \u003c is the same character: no "</script>" can end the block early
    blob = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    return (page.replace("/*KVDIAG_CSS*/", (static / "viewer.css").read_text())
                .replace("/*KVDIAG_JS*/", (static / "viewer.js").read_text())
                .replace("KVDIAG_TITLE", html.escape(data["meta"]["title"]))
                .replace("KVDIAG_DATA", blob))


def build_viewer(
    trace, labels: pl.DataFrame | None, scores: pl.DataFrame | None, out: str | os.PathLike, *,
    labels_meta: dict | None = None, scores_meta: dict | None = None, settings: ViewerSettings = ViewerSettings(),
    figures_dir: str | os.PathLike | None = None, title: str | None = None, decisions: pl.DataFrame | None = None,
) -> Path:
    """Write ``out`` (viewer.html) for a Trace, its labels and (optionally) scores and figures directory.

    Inputs that do not belong together are refused as in ``kvdiag figures`` (``check_figure_inputs``).
    """
    from kvdiag.core.io import write_text
    from kvdiag.figures import check_figure_inputs

    if trace is None:
        raise UserError("the viewer needs the Trace (RUN/trace): kvdiag trace --out RUN/trace")
    if labels is None:
        raise UserError("the viewer needs the labels (RUN/labels.parquet): kvdiag label --trace RUN/trace --out "
                        "RUN/labels.parquet")
    labels = check_figure_inputs(trace, labels, scores, labels_meta, scores_meta)
    lens = {pid: trace.prompt_len(pid) for pid in trace.prompt_ids}
    data = viewer_data(trace.tokens, lens, labels, scores, settings, figures_dir,
                       title or f"kvdiag token viewer: {trace.manifest['model'].get('spec', '?')}", decisions,
                       trace.num_layers * trace.num_kv_heads)
    return write_text(out, viewer_html(data))
