"""Figure (b): delayed reads — entries with weak reads in their first observation window that are read strongly
later, from the Trace's recorded future queries.

Per labeled entry ``i`` (unique prompt and position; definitions in ``features.first_reads``):

- first observation window: queries ``[i + 1, i + 1 + w_obs)``; entries whose window does not fit in the
  trace are ``unobserved`` and left out;
- ``early``: a strong read inside the first window (``u >= strong_read_mult``, ``u`` = read strength in
  multiples of uniform attention ``1 / (tau + 1)``);
- ``delayed``: no strong read in the first window, a strong read at some later query; delay = first such
  query ``- i``;
- ``never``: no strong read anywhere up to the end of the trace (right-censored: late entries have fewer
  future queries, see ``future_queries``).

Window-only eviction: a rule that protects an entry until it has had a full observation window and then
evicts entries without a strong read in its window compresses at ``t = prompt_len + k·interval`` (k >= 1).
The first such checkpoint after the first window is ``c* = min{t : t >= i + 1 + w_obs}``; the windows it
and later checkpoints see hold no strong read until the first one, so the rule evicts a delayed entry
before its read exactly when ``c* <= first strong read`` (eviction at ``t`` removes ``i`` before query ``t``).

Eviction KL of an entry: the mean ``kl_mean`` over its analysed label rows (each entry counts once).

The first reads (the Trace's part: ``features.trace_first_reads`` columns) are also written as
``first_reads.parquet``, so that the tables can be made again without the Trace (``make_figures(reads=...)``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import polars as pl
import seaborn as sns
from matplotlib import MatplotlibDeprecationWarning

from kvdiag.core import plotting as common
from kvdiag.core.io import write_table
from kvdiag.core.stats import mann_whitney, stat
from kvdiag.figures.config import FigureParams
from kvdiag.figures.registry import Drawn, FigureContext, register_figure

CLASSES = ("early", "delayed", "never", "unobserved")
READ_SETTINGS = ("w_obs", "strong_read_mult", "read_reduce")  # the FigureParams that define the first reads


def read_settings(params: FigureParams) -> dict:
    """The settings ``first_reads.parquet`` is made with (its metadata's ``params``)."""
    return {name: getattr(params, name) for name in READ_SETTINGS}


def classify_reads(reads: pl.DataFrame, w_obs: int, strong_read_mult: float, interval: int) -> pl.DataFrame:
    """``reads`` (``features.trace_first_reads`` columns) with read_class, delay, next_checkpoint,
    evicted_before_read."""
    pos, P = reads["position"].to_numpy(), reads["prompt_len"].to_numpy()
    window_end = pos + 1 + w_obs
    k = np.maximum(1, -((P - window_end) // interval))  # ceil((window_end - P) / interval), at least 1
    return reads.with_columns(
        next_checkpoint=pl.Series(P + k * interval, dtype=pl.Int64),
        read_class=pl.when(~pl.col("window_complete"))
        .then(pl.lit("unobserved"))
        .when(pl.col("first_window_peak") >= strong_read_mult)
        .then(pl.lit("early"))
        .when(pl.col("first_strong_read") >= 0)
        .then(pl.lit("delayed"))
        .otherwise(pl.lit("never")),
    ).with_columns(
        delay=pl.when(pl.col("read_class") == "delayed").then(pl.col("first_strong_read") - pl.col("position")),
        evicted_before_read=pl.when(pl.col("read_class") == "delayed").then(
            pl.col("next_checkpoint") <= pl.col("first_strong_read")
        ),
    )


def delay_histogram(delays: np.ndarray) -> pl.DataFrame:
    """Counts of ``delays`` in power-of-two bins ``[2^k, 2^(k+1))`` spanning them (empty when none)."""
    schema = {"bin_low": pl.Int64, "bin_high": pl.Int64, "count": pl.Int64}
    if not len(delays):
        return pl.DataFrame(schema=schema)
    k0, k1 = int(np.floor(np.log2(delays.min()))), int(np.floor(np.log2(delays.max()))) + 1
    edges = 2 ** np.arange(k0, k1 + 1)
    counts, _ = np.histogram(delays, bins=edges)  # integer edges: [lo, hi) except the last, closed; max < 2^k1
    return pl.DataFrame({"bin_low": edges[:-1], "bin_high": edges[1:], "count": counts}, schema=schema)


def delayed_read_stats(entries: pl.DataFrame, params: FigureParams) -> list[dict]:
    """Stats rows of classified ``entries`` (with a ``kl`` column, null where the entry has no analysed label)."""
    count = {c: entries.filter(pl.col("read_class") == c).height for c in CLASSES}
    delayed = entries.filter(pl.col("read_class") == "delayed")
    weak = count["delayed"] + count["never"]
    rows = [
        stat("n_entries", entries.height, "" if entries.height else "no labeled token-granularity entry"),
        *(stat(f"n_{c}", count[c]) for c in CLASSES),
        stat(
            "share_delayed_of_weak", count["delayed"] / weak if weak else None,
            "" if weak else "no entry with weak reads in its first window",
        ),
        stat("w_obs", params.w_obs),
        stat("strong_read_mult", params.strong_read_mult),
        stat("interval", params.interval),
    ]
    d = delayed["delay"].to_numpy().astype(float)
    none = "" if len(d) else "no delayed-read entry"
    for name, q in (
        ("delay_min", 0.0), ("delay_q25", 0.25), ("delay_median", 0.5), ("delay_q75", 0.75), ("delay_max", 1.0),
    ):
        rows.append(stat(name, np.quantile(d, q) if len(d) else None, none))
    evicted = int(delayed["evicted_before_read"].sum())
    rows += [
        stat("n_evicted_before_read", evicted),
        stat("share_evicted_before_read", evicted / len(d) if len(d) else None, none),
    ]
    kl_d = delayed["kl"].drop_nulls().to_numpy()
    kl_n = entries.filter(pl.col("read_class") == "never")["kl"].drop_nulls().to_numpy()
    rows += [stat("n_kl_delayed", len(kl_d)), stat("n_kl_never", len(kl_n)),
             stat("median_kl_delayed", np.median(kl_d) if len(kl_d) else None),
             stat("median_kl_never", np.median(kl_n) if len(kl_n) else None)]
    mwu, _ = mann_whitney(kl_d, kl_n, params.min_group, "eviction KL of delayed-read vs never-read entries")
    return rows + mwu


def plot_delayed_reads(
    entries: pl.DataFrame, hist: pl.DataFrame, rows: list[dict], params: FigureParams, out_dir: Path
) -> list[Path]:
    """Delay histogram, eviction outcome of a window-only rule, and KL of delayed vs never-read entries."""
    s = common.stats_dict(rows)
    notes = {r["statistic"]: r["note"] for r in rows if r["note"]}
    with common.style():
        fig, (ax1, ax2, ax3) = common.new_figure(3, 12, 3.8)
        if hist.height:
            lo, hi = hist["bin_low"].to_numpy(), hist["bin_high"].to_numpy()
            ax1.bar(
                lo, hist["count"].to_numpy(), width=hi - lo, align="edge", color=sns.color_palette()[0],
                edgecolor="white",
            )
            ax1.set_xscale("log", base=2)
            ax1.axvline(params.interval, color="grey", ls=":", lw=1, label=f"compression interval {params.interval}")
            ax1.legend(fontsize=6)
            ax1.set_title(
                f"delayed reads: n = {int(s['n_delayed'])}, median delay {common.fmt(s['delay_median'])}", fontsize=9
            )
        else:
            common.note_on(ax1, notes.get("delay_median") or "no delayed-read entry", width=45)
            ax1.set_title("delayed reads", fontsize=9)
        ax1.set_xlabel("time to first strong read (queries after the entry)")
        ax1.set_ylabel("entries")

        labels = ["early read", "delayed:\nevicted first", "delayed:\nread first", "never read"]
        counts = [s["n_early"], s["n_evicted_before_read"], s["n_delayed"] - s["n_evicted_before_read"], s["n_never"]]
        sns.barplot(x=labels, y=counts, hue=labels, palette="deep", legend=False, ax=ax2)
        for i, c in enumerate(counts):
            ax2.text(i, c, f"{int(c)}", ha="center", va="bottom", fontsize=7)
        ax2.set_ylabel("labeled entries")
        ax2.tick_params(axis="x", labelsize=7)
        ax2.set_title(f"window-only rule (W_obs = {params.w_obs}) evicts before the read:\n"
                      f"{common.fmt(s['share_evicted_before_read'])} of delayed "
                      f"({int(s['n_evicted_before_read'])}/{int(s['n_delayed'])}); "
                      f"{int(s['n_unobserved'])} unobserved left out", fontsize=8)
        if "share_evicted_before_read" in notes or "n_entries" in notes:
            common.note_on(ax2, notes.get("n_entries") or notes["share_evicted_before_read"], y=0.7, width=45)

        kl = entries.filter(pl.col("read_class").is_in(["delayed", "never"]) & pl.col("kl").is_not_null())
        if kl.height:
            groups = kl["read_class"].to_list()
            y = np.maximum(kl["kl"].to_numpy(), params.log_floor)
            order = [g for g in ("delayed", "never") if g in groups]
            with warnings.catch_warnings():  # seaborn 0.13 passes matplotlib 3.11's deprecated ``vert``
                warnings.simplefilter("ignore", MatplotlibDeprecationWarning)
                sns.boxplot(
                    x=groups, y=y, order=order, hue=groups, hue_order=order, palette="deep", showfliers=False, ax=ax3,
                    legend=False,
                )
            # seaborn jitters with numpy's global RNG: seed it for this call only, so the PNG and PDF are reproducible
            state = np.random.get_state()
            np.random.seed(params.seed)
            sns.stripplot(x=groups, y=y, order=order, color="black", size=2.5, alpha=0.6, ax=ax3)
            np.random.set_state(state)
            ax3.set_yscale("log")
        ax3.set_xlabel(f"delayed: n = {int(s['n_kl_delayed'])}, never read: n = {int(s['n_kl_never'])}")
        ax3.set_ylabel("eviction KL (mean kl_mean, nats)")
        ax3.set_title("eviction KL, Mann-Whitney U (delayed > never):\n"
                      f"p = {common.fmt(s['mwu_p'])}, rank-biserial r = {common.fmt(s['rank_biserial'])}", fontsize=8)
        if "mwu_p" in notes:
            common.note_on(ax3, notes["mwu_p"], width=45)
        fig.suptitle("(b) delayed-read effect", fontsize=10)
        return common.save_figure(fig, out_dir, "delayed_reads")


@register_figure("delayed_reads", "(b) Delayed-read effect",
                 ("delayed_reads_stats.csv", "delayed_reads_hist.csv", "delayed_reads_entries.csv"))
def delayed_reads_figure(ctx: FigureContext) -> Drawn:
    """Classes, stats and figure (b) from ``ctx.reads`` and each entry's mean ``kl_mean`` over its analysed labels:
    delayed_reads.{png,pdf}, delayed_reads_entries.csv, delayed_reads_hist.csv, delayed_reads_stats.csv."""
    params, out_dir = ctx.params, ctx.out
    entry_kl = ctx.analysed.group_by("prompt_id", "position").agg(kl=pl.col("kl_mean").mean())
    reads = ctx.reads.join(entry_kl, on=["prompt_id", "position"], how="left", maintain_order="left")
    entries = classify_reads(reads, params.w_obs, params.strong_read_mult, params.interval)
    hist = delay_histogram(entries.filter(pl.col("read_class") == "delayed")["delay"].to_numpy())
    rows = delayed_read_stats(entries, params)
    files = [out_dir / f"delayed_reads_{name}.csv" for name in ("entries", "hist", "stats")]
    entries.write_csv(files[0])
    hist.write_csv(files[1])
    common.write_stats(rows, files[2])
    reads_file = write_table(ctx.reads, out_dir / "first_reads.parquet",
                             {"kind": "first_reads", "params": read_settings(params), "trace": ctx.reads_trace})
    return Drawn(common.stats_dict(rows), [r["note"] for r in rows if r["note"]],
                 [*plot_delayed_reads(entries, hist, rows, params, out_dir), *files, reads_file])
