"""Every committed report's summary tables regenerate from its committed raw files, without a model (issue #39).

Each test reruns what the report's ``reproduce.sh`` ran to make its tables (the function the CLI calls) on the
report's committed raw files (labels, scores, decisions, generations, ...) into ``tmp_path``, and compares:

- CSV: the same header, the same rows in the same order; numeric cells equal within rel 1e-9 or abs 1e-12 (summation
  order moves the last bits across CPUs and BLAS builds), NaN equal to NaN; other cells exactly.
- Markdown and text: line by line; the text between numbers exactly; each printed number within one unit in its last
  printed digit (a float printed with k digits may round the other way on another CPU).
- JSON: the same keys, numbers as in CSV, everything else exactly.

Figures (PNG/PDF) are not compared. ``NOT_REGENERATED`` names each committed table that cannot be made again without a
model, and why (``PARTLY_REGENERATED``: the columns of a compared table that cannot be); ``test_every_table_is_covered``
keeps these and the compared tables a complete list of ``reports/``.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import re
import shutil
from pathlib import Path

import polars as pl
import pytest

from kvdiag.core.io import read_json, read_meta, read_table

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "reports"
REL, ABS = 1e-9, 1e-12  # CSV and JSON floats
TABLE_SUFFIXES = (".csv", ".md", ".tex")

# committed tables no test regenerates: path under reports/ -> why not
NOT_REGENERATED = {
    **{f"suites-fullkv/{f}.txt": "a measurement: SmolLM2's FullKV generations of the suite, graded (measure.py runs "
       "the model, 20-45 min)" for f in ("keys", "countdown", "countdown-adapter", "keys-gemma3",
                                         "countdown-gemma3")},
    **{f"bench/{f}": "a measurement: seconds and memory of runs of the model on this machine"
       for f in ("cpu-mfu.md", "kernels.txt", "label-fast.txt", "label-layer.txt", "label.txt", "scale.csv",
                 "score.txt", "trace.txt", "hybrid-miss-rate-h16.txt", "hybrid-miss-rate-h128.txt",
                 "label-horizon.txt", "evicting-padded.txt", "decisions-h128.txt",
                 "decisions-h128-x16.txt", "decisions-h128-descent.txt", "decisions-h128-reconstruction.txt")},
    **{f"learned-rule/inputs/{d}variants.csv": "the variants' out-of-fold metrics: fit_variants.py fits them on the "
       "training features (runs/learned-rule/fit-all, not committed: the model computes them)"
       for d in ("", "round1/")},
    "learned-rule/inputs/leaderboard-row.md": "kvdiag grade's row of the learned rule (grading runs the model)",
    **{f"fast-labels-horizon/bench-h{h}.txt": "a measurement: kvdiag bench label --method fast (seconds on this "
       "machine); report.md's cost table reads the JSON beside it" for h in (16, 128)},
}
_REPORT_TRACE = ("its Trace section, the Trace's row of the contents, the viewer line and the date: kvdiag report "
                 "reads the run's Trace (not committed); every other line is compared")
PARTLY_REGENERATED = {
    "bench/scale.md": "its memory-growth table: bench_scale computes it from the steps' JSON (runs/, not committed) "
                      "and the model's shape; its steps table is compared with the measured scale.csv",
    "math500-smollm2/report.md": _REPORT_TRACE, "math500-long/report.md": _REPORT_TRACE,
}
COMPARED: set[str] = set()  # filled at import by the tables below: every path under reports/ some test compares


# --------------------------------------------------------------------------- comparison

NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _unit(token: str) -> float:
    """One unit in the last printed digit of a number token (``0.123`` -> 1e-3, ``1.5e-05`` -> 1e-6, ``1,024`` -> 1)."""
    mantissa, _, exponent = token.replace(",", "").lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def same_number_text(got: str, want: str) -> bool:
    if got == want:
        return True
    a, b = float(got.replace(",", "")), float(want.replace(",", ""))
    return abs(a - b) <= min(_unit(got), _unit(want)) * (1 + 1e-9)


def assert_same_text(got: str, want: str, what: str) -> None:
    """Line by line: the text between numbers exactly, each number within one unit in its last printed digit."""
    g, w = got.splitlines(), want.splitlines()
    assert len(g) == len(w), f"{what}: {len(g)} lines regenerated, {len(w)} committed"
    for i, (gl, wl) in enumerate(zip(g, w, strict=True), 1):
        gn, wn = NUMBER.findall(gl), NUMBER.findall(wl)
        assert NUMBER.split(gl) == NUMBER.split(wl) and len(gn) == len(wn), f"{what}:{i}\n  got  {gl}\n  want {wl}"
        for a, b in zip(gn, wn, strict=True):
            assert same_number_text(a, b), f"{what}:{i}: {a} against {b}\n  got  {gl}\n  want {wl}"


def _float(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def same_value(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=REL, abs_tol=ABS)


def assert_same_csv(got: Path, want: Path, what: str) -> None:
    """Header and row order exactly; numeric cells within rel 1e-9 or abs 1e-12, other cells exactly."""
    g, w = list(csv.reader(got.open())), list(csv.reader(want.open()))
    assert g[:1] == w[:1], f"{what}: header {g[:1]} against {w[:1]}"
    assert len(g) == len(w), f"{what}: {len(g) - 1} rows regenerated, {len(w) - 1} committed"
    for i, (gr, wr) in enumerate(zip(g, w, strict=True), 1):
        assert len(gr) == len(wr), f"{what}:{i}: {len(gr)} cells against {len(wr)}"
        for col, a, b in zip(w[0], gr, wr, strict=True):
            fa, fb = _float(a), _float(b)
            ok = a == b or (fa is not None and fb is not None and same_value(fa, fb))
            assert ok, f"{what}:{i} column {col}: {a!r} regenerated, {b!r} committed"


def assert_same_json(got, want, what: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{what}: keys {sorted(got)} vs {sorted(want)}"
        for k in want:
            assert_same_json(got[k], want[k], f"{what}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{what}: {got!r} against {want!r}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_json(a, b, f"{what}[{i}]")
    else:
        assert same_value(got, want), f"{what}: {got!r} regenerated, {want!r} committed"


def assert_same_tables(got_dir: Path, want_dir: Path, names) -> None:
    """Each of ``names`` (a committed table under ``want_dir``) against its regenerated copy in ``got_dir``."""
    for name in names:
        got, want = got_dir / name, want_dir / name
        assert want.is_file(), f"{want} is not committed"
        assert got.is_file(), f"{name} was not regenerated"
        what = str(want.relative_to(ROOT))
        if os.environ.get("KVDIAG_REWRITE_REPORTS") == "1" and not os.environ.get("CI"):  # a deliberate rewrite
            shutil.copyfile(got, want)
            continue
        if name.endswith(".csv"):
            assert_same_csv(got, want, what)
        elif name.endswith(".json"):
            assert_same_json(json.loads(got.read_text()), json.loads(want.read_text()), what)
        else:
            assert_same_text(got.read_text(), want.read_text(), what)


def compared(report: str, names) -> tuple[str, tuple[str, ...]]:
    COMPARED.update((Path(report) / n).as_posix() for n in names)
    return report, tuple(names)


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the reports record their inputs' paths relative to the repository root


def _script(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- the comparison itself


def test_comparison_tolerances(tmp_path):
    want = tmp_path / "want.csv"
    want.write_text("rule,value\na,0.5\nb,NaN\n")
    for text, ok in (("rule,value\na,0.5000000000001\nb,nan\n", True), ("rule,value\na,0.5000001\nb,NaN\n", False),
                     ("rule,value\nb,NaN\na,0.5\n", False), ("rule,value\nA,0.5\nb,NaN\n", False)):
        (tmp_path / "got.csv").write_text(text)
        if ok:
            assert_same_csv(tmp_path / "got.csv", want, "t")
        else:
            with pytest.raises(AssertionError):
                assert_same_csv(tmp_path / "got.csv", want, "t")
    assert same_number_text("0.123", "0.124") and not same_number_text("0.123", "0.125")
    assert same_number_text("1,024", "1,025") and not same_number_text("3.2", "2.16")
    assert same_number_text("1.5e-05", "1.6e-05") and not same_number_text("1.5e-05", "1.7e-05")
    with pytest.raises(AssertionError):
        assert_same_text("| a | 0.5 [0.4, 0.6] |", "| b | 0.5 [0.4, 0.6] |", "t")
    with pytest.raises(AssertionError):
        assert_same_text("p = 0.04", "p = 0.06", "t")
    assert same_value(1.0, 1.0 + 1e-12) and not same_value(1.0, 1.0 + 1e-8) and same_value(float("nan"), float("nan"))


# --------------------------------------------------------------------------- rank-eval

RANK_EVAL_VOLATILE = ("seconds", "reference_note")
RANK_EVAL_TABLES = ("metrics.csv", "paired.csv", "table.md", "table.tex", "budget_curves.csv")
RANK_EVAL = {  # the rank-eval directory -> its committed labels and scores
    **{f"adapter-vs-base/{m}/rank-eval": (f"adapter-vs-base/{m}/labels.parquet", f"adapter-vs-base/{m}/scores.parquet")
       for m in ("base", "adapted")},
    "math500-smollm2/rank-eval": ("math500-smollm2/labels.parquet", "math500-smollm2/scores.parquet"),
    "math500-smollm2/rank-eval-eligible": ("math500-smollm2/labels.parquet", "math500-smollm2/scores.parquet"),
    "math500-long/rank-eval": ("math500-long/labels.parquet", "math500-long/scores.parquet"),
    "kvpress-math500/rank-eval": ("math500-smollm2/labels.parquet", "kvpress-math500/scores_all.parquet"),
}
for _d in RANK_EVAL:
    compared(_d, RANK_EVAL_TABLES)


@pytest.mark.parametrize("run", list(RANK_EVAL))
def test_rank_eval(run, tmp_path):
    from kvdiag.rankeval.run import rank_eval_files

    labels, scores = (REPORTS / p for p in RANK_EVAL[run])
    config = read_json(REPORTS / run / "config.json")
    # the committed raw files are the ones the tables came from
    assert config["inputs"]["labels"]["meta"] == read_meta(labels)
    assert config["inputs"]["scores"]["meta"] == read_meta(scores)
    options = dict(config["config"])
    table_scope = options.pop("table_scope")
    rank_eval_files(labels, scores, tmp_path, table_scope, **options)
    assert_same_tables(tmp_path, REPORTS / run, RANK_EVAL_TABLES)
    # seconds: timing; reference_note: the CLI's --reference auto, which config.json records resolved
    got = {k: v for k, v in read_json(tmp_path / "config.json")["summary"].items() if k not in RANK_EVAL_VOLATILE}
    want = {k: v for k, v in config["summary"].items() if k not in RANK_EVAL_VOLATILE}
    assert_same_json(got, want, f"{run}/config.json summary")


README_TABLES = {"kvpress-math500/README.md": "kvpress-math500/rank-eval/table.md"}  # README -> the table it quotes


@pytest.mark.parametrize("readme", list(README_TABLES))
def test_readme_tables_quote_the_compared_tables(readme):
    """A README's table rows with CIs are rows of a table test_rank_eval regenerates (quoted, not retyped)."""
    lines = (REPORTS / readme).read_text().splitlines()
    rows = [line.strip() for line in lines if line.startswith("| ") and "[" in line]
    table = {line.strip() for line in (REPORTS / README_TABLES[readme]).read_text().splitlines()}
    assert README_TABLES[readme] in COMPARED and rows, readme
    assert not [r for r in rows if r not in table], f"{readme}: rows not in {README_TABLES[readme]}"


def test_kvpress_merged_scores():
    """scores_all.parquet is merge_scores.py's join of the committed rule and press scores (values copied: exact)."""
    module = _script("reports/kvpress-math500/merge_scores.py")
    merged, meta = module.merge("reports/math500-smollm2/scores.parquet",
                                "reports/kvpress-math500/scores_kvpress.parquet")
    committed, committed_meta = read_table(REPORTS / "kvpress-math500/scores_all.parquet")
    assert merged.equals(committed) and merged.columns == committed.columns
    assert meta == committed_meta


FIGURE_TABLES = ("blind_spot_points.csv", "blind_spot_stats.csv", "components.csv", "delayed_reads_entries.csv",
                 "delayed_reads_hist.csv", "delayed_reads_stats.csv")
FIGURES = {  # report -> where its read pressure and payload are (its Trace's first reads: figures/first_reads.parquet)
    "math500-smollm2": "scores.features.parquet",  # written by kvdiag score
    "math500-long": "figures/read_pressure_payload.parquet",  # taken from blind_spot_points.csv (trace_parts.py)
}
for _d in FIGURES:
    compared(f"{_d}/figures", FIGURE_TABLES)


@pytest.mark.parametrize("report", list(FIGURES))
def test_figures_without_trace(report, tmp_path):
    """Every figure table (``make_figures``, no Trace) from the committed labels, scores, rank-eval's metrics.csv (as
    ``kvdiag figures --rank-eval``), the read pressure and payload of the analysed labels and the entries' first
    reads: the Trace's part, which reports/trace_parts.py took column for column from the run's CSVs (checked here:
    those columns are compared as copies; every other column, and each statistic, is computed again)."""
    from kvdiag.figures.config import FigureParams
    from kvdiag.figures.run import make_figures
    from kvdiag.rankeval.run import load_metrics

    src, run = REPORTS / report, REPORTS / report / "figures"
    info = read_json(run / "figures.json")
    labels, labels_meta = read_table(src / "labels.parquet")
    scores, scores_meta = read_table(src / "scores.parquet")
    assert info["inputs"]["labels"] == labels_meta and info["inputs"]["scores"] == scores_meta
    assert info["inputs"]["metrics"].startswith("given")  # --rank-eval runs/<run>/rank-eval: committed as rank-eval/
    assert info["argv"][-2] == "--rank-eval" and info["argv"][-1].endswith("/rank-eval")
    parts = _script("reports/trace_parts.py")
    reads = read_table(run / "first_reads.parquet")
    features, features_meta = read_table(src / FIGURES[report])
    made = [(reads, parts.first_reads(run))]
    if FIGURES[report].startswith("figures/"):  # else kvdiag score's own file: every scored row
        made.append(((features, features_meta), parts.pressure_payload(run)))
    for (df, meta), (want, want_meta) in made:
        assert df.equals(want) and meta == want_meta, f"{report}: its {meta['kind']} are not trace_parts.py's"
    make_figures(None, labels, scores, tmp_path, FigureParams(**info["params"]), labels_meta=labels_meta,
                 scores_meta=scores_meta, metrics=load_metrics(src / "rank-eval"),
                 features=(features, {**features_meta, "file": Path(FIGURES[report]).name}), reads=reads)
    assert_same_tables(tmp_path, run, FIGURE_TABLES)
    got = read_json(tmp_path / "figures.json")
    if "read_pressure_payload" in info["inputs"]:
        assert got["inputs"]["read_pressure_payload"] == info["inputs"]["read_pressure_payload"]
    for figure in ("blind_spot", "delayed_reads"):
        assert_same_json(got["summary"][figure], info["summary"][figure], f"{report}/figures.json {figure}")


FIT = compared("math500-smollm2/fit", ("metrics.csv", "table.md"))


def test_fit_ranking(tmp_path):
    """The fit's rank-eval (``rank_fitted``) of the committed out-of-fold scores beside the rules."""
    from kvdiag.core.io import write_csv, write_text
    from kvdiag.fit import FitConfig, rank_fitted
    from kvdiag.rankeval import to_markdown

    run, tables = FIT
    config = read_json(REPORTS / run / "config.json")
    cfg = FitConfig(**{**config["config"], "features": tuple(config["config"]["features"])})
    labels = read_table(REPORTS / "math500-smollm2/labels.parquet")[0]
    oof = read_table(REPORTS / run / "oof_scores.parquet")[0]
    assert config["inputs"]["labels"] == read_meta(REPORTS / "math500-smollm2/labels.parquet")
    result = rank_fitted(labels, oof, cfg, config["inputs"]["scores"])
    write_csv(result.metrics, tmp_path / "metrics.csv")
    write_text(tmp_path / "table.md", to_markdown(result, "pooled"))
    assert_same_tables(tmp_path, REPORTS / run, tables)
    assert_same_json(result.summary, {k: v for k, v in config["summary"]["rank_eval"].items() if k != "seconds"}
                     | {"seconds": result.summary["seconds"]}, f"{run}/config.json summary.rank_eval")


compared("math500-smollm2/fit", ("importances.csv",))


def test_fit_importances(tmp_path):
    """importances.csv, the out-of-fold scores and model.json's logistic regression from the committed features.parquet
    (``cross_validate``, ``importance_table``: the grouped folds and permutation importances ``fit_features`` runs;
    about 20 s on 2 cores; the 4 min of a whole ``kvdiag fit`` are rank-eval's bootstrap, test_fit_ranking's)."""
    from kvdiag.core.io import write_csv
    from kvdiag.fit import MODELS, FitConfig, cross_validate, importance_table
    from kvdiag.fit.run import _labels_y, _models, _token_labels
    from kvdiag.rankeval import KEYS

    run = REPORTS / "math500-smollm2/fit"
    config = read_json(run / "config.json")
    cfg = FitConfig(**{**config["config"], "features": tuple(config["config"]["features"])})
    labels, y, _ = _labels_y(_token_labels(read_table(REPORTS / "math500-smollm2/labels.parquet")[0]), cfg)
    feats, meta = read_table(run / "features.parquet")
    names = tuple(meta["features"])
    assert names == tuple(config["summary"]["features"]) and feats.select(KEYS).equals(labels.select(KEYS))
    assert (feats["harmful"].to_numpy() == y).all()
    X = feats.select(names).to_numpy().astype(float)
    oof, importance = cross_validate(X, y, labels["prompt_id"].to_numpy(), cfg)
    final = _models(cfg)["fitted_logreg"].fit(X, y)
    write_csv(importance_table(names, final, importance), tmp_path / "importances.csv")
    assert_same_tables(tmp_path, run, ["importances.csv"])
    committed = read_table(run / "oof_scores.parquet")[0]
    assert committed.select(KEYS).equals(labels.select(KEYS))
    for m in MODELS:
        assert all(same_value(a, b) for a, b in zip(oof[m].tolist(), committed[m].to_list(), strict=True)), m
    model = read_json(run / "model.json")
    got = {"mean": final[0].mean_.tolist(), "scale": final[0].scale_.tolist(), "coef": final[-1].coef_[0].tolist(),
           "intercept": float(final[-1].intercept_[0])}
    assert_same_json(got, {k: model[k] for k in got}, "math500-smollm2/fit/model.json")


# --------------------------------------------------------------------------- kvdiag report

REPORT = {  # report -> the run directory's name (the title) and the committed pieces kvdiag report reads
    "math500-smollm2": ("math500", ("labels.parquet", "scores.parquet", "scores.features.parquet", "rank-eval",
                                    "rank-eval-eligible", "figures", "fit", "commands.json")),
    "math500-long": ("math500-long", ("labels.parquet", "scores.parquet", "rank-eval", "figures", "commands.json")),
}
for _d in REPORT:
    compared(_d, ("report.md",))
TRACE_SECTION = "## What was traced"
TRACE_LINES = re.compile(r"^(\| `trace` \||\[viewer\.html\]|`viewer\.html` not written)")
TRACE_MISSING = re.compile(r"^Missing or unreadable: trace; their sections below say so\.\n\n", re.M)
REPORT_DATE = re.compile(r"report made \S+ \S+ UTC")


def _without_trace(text: str) -> str:
    """A report less what only the Trace gives (PARTLY_REGENERATED): its section, its lines, the date."""
    text = REPORT_DATE.sub("report made (date) UTC", TRACE_MISSING.sub("", _without_section(text, TRACE_SECTION)))
    return "\n".join(line for line in text.splitlines() if not TRACE_LINES.match(line)) + "\n"


@pytest.mark.parametrize("report", list(REPORT))
def test_report(report, tmp_path):
    """``kvdiag report`` (``report_files``) of a run directory holding the report's committed pieces, no Trace."""
    from kvdiag.report.run import report_files

    name, pieces = REPORT[report]
    run = tmp_path / name
    run.mkdir()
    for piece in pieces:
        (run / piece).symlink_to(REPORTS / report / piece)
    md, _ = report_files(run, None)
    want = (REPORTS / report / "report.md").read_text()
    assert TRACE_SECTION in want and "Missing or unreadable: trace" in md.read_text()
    assert_same_text(_without_trace(md.read_text()), _without_trace(want), f"reports/{report}/report.md")


# --------------------------------------------------------------------------- math500-long: short against long


README_TAU = {"auroc": "AUROC for the harmful decile", "ap": "AP", "spearman": "Spearman with `kl_mean`"}


def test_math500_long_comparison(tmp_path):
    """compare.py's comparison.md regenerates, and the README's Kendall's taus and exact p-values are its numbers."""
    module = _script("reports/math500-long/compare.py")
    module.main(module.SHORT, module.LONG, tmp_path / "comparison.md")
    assert_same_tables(tmp_path, REPORTS / "math500-long", ["comparison.md"])
    taus = re.findall(r"^## (\w+)\n\nKendall's tau between the two orderings: (\S+) \(exact p = ([^,]+),",
                      (tmp_path / "comparison.md").read_text(), re.M)
    made = {metric: (tau, p) for metric, tau, p in taus}
    readme = (REPORTS / "math500-long/README.md").read_text()
    assert set(made) == set(README_TAU)
    for metric, row in README_TAU.items():
        tau, p = made[metric]
        assert f"| {row} | {tau} (p = {p}) |" in readme, f"math500-long/README.md: {row} is not tau {tau}, p {p}"


COMPARED.add("math500-long/comparison.md")


# --------------------------------------------------------------------------- fast labels


FAST_LABELS = compared("fast-labels-math500", ("summary.csv", "per_checkpoint.csv", "disagreement.csv",
                                               "validation.md"))


def test_fast_labels_validation(tmp_path):
    from kvdiag.label.validate import ValidateConfig, run_validation

    report, tables = FAST_LABELS
    committed = read_json(REPORTS / report / "validation.json")
    exact, scores = committed["inputs"]["exact"], committed["inputs"]["scores"]  # committed files, as given then
    approx = REPORTS / report / "fast-labels.parquet"  # runs/fast8/fast.parquet then, copied here
    run_validation(Path(exact), approx, tmp_path, ValidateConfig(**committed["config"]), Path(scores))
    assert_same_tables(tmp_path, REPORTS / report, tables)
    got = read_json(tmp_path / "validation.json")
    for key in ("config", "summary"):
        assert_same_json(got[key], committed[key], f"{report}/validation.json {key}")


# --------------------------------------------------------------------------- decisions


_SEARCHED = ("summary.csv", "paired.csv", "spearman.csv", "pairs_summary.csv", "stochastic.csv", "headroom.csv",
             "search.csv", "summary.md")
DECISIONS = {  # run -> the tables its summary writes (committed)
    "decisions-math500/smollm2": _SEARCHED,
    "decisions-math500/gemma3": _SEARCHED,
    "decisions-math500/smollm2-stochastic": ("summary.csv", "paired.csv", "stochastic.csv", "summary.md"),
    # #54: judged on 128 steps, the references reading the first 8 (held out: the 120 after them)
    "decisions-math500/smollm2-h128": ("summary.csv", "paired.csv", "spearman.csv", "headroom.csv", "search.csv",
                                       "held_out.csv", "summary.md"),
    # #54: every reference reading the whole 128 steps, so oracle_search is at most every decision there (SmolLM2's by
    # the descent; -reach10: the same run by the swap search it replaced; -recombined: by the search of dfe37b9, with
    # cell-wise recombination)
    "decisions-math500/smollm2-h128-search": ("summary.csv", "paired.csv", "headroom.csv", "search.csv", "summary.md"),
    "decisions-math500/smollm2-h128-search-reach10": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                      "summary.md"),
    "decisions-math500/smollm2-h128-search-recombined": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                         "summary.md"),
    "decisions-math500/gemma3-h128-search": ("summary.csv", "paired.csv", "headroom.csv", "search.csv", "summary.md"),
    # the same SmolLM2 run at keep 0.25 by the descent from the reconstruction set
    "decisions-math500/smollm2-h128-search-reconstruction": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                             "summary.md"),
    "decisions-math500/gemma3-h128-search-reach5": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                    "summary.md"),
    "decisions-math500/gemma3-h128-search-recombined": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                        "summary.md"),
    # #54's generalisation check: every reference reading the first 64 of the 128 steps judged (held out: the 64 after)
    "decisions-math500/smollm2-h128-half": ("summary.csv", "paired.csv", "headroom.csv", "search.csv", "held_out.csv",
                                            "summary.md"),
    "decisions-math500/gemma3-h128-half": ("summary.csv", "paired.csv", "headroom.csv", "search.csv", "held_out.csv",
                                           "summary.md"),
    # the same by the descent (the first by dfe37b9's search)
    "decisions-math500/smollm2-h128-half-descent": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                    "held_out.csv", "summary.md"),
    "decisions-math500/gemma3-h128-half-descent": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                   "held_out.csv", "summary.md"),
    # #54: the 128-step search started from every committed run's lowest set as well (--search-from)
    "decisions-math500/smollm2-h128-search-from": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                   "summary.md"),
    "decisions-math500/gemma3-h128-search-from": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                  "summary.md"),
    # #54: the 128-step search rerun (3 prompts) after recombination stopped at half the seconds
    "decisions-math500/smollm2-h128-search-split": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                    "summary.md"),
    # #54: the same rerun after oracle_search dropped recombination for swaps alone
    "decisions-math500/smollm2-h128-search-swaps": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                    "summary.md"),
    # #54: the same rerun after the swaps left entries of large attention weight alone while others remain
    "decisions-math500/smollm2-h128-search-reach": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                    "summary.md"),
    "decisions-math500/gemma3-h128-search-reach": ("summary.csv", "paired.csv", "headroom.csv", "search.csv",
                                                   "summary.md"),
}
for _d, _t in DECISIONS.items():
    compared(_d, _t)


def _without_section(text: str, heading: str) -> str:
    """``text`` less the Markdown section that starts at ``heading`` (up to the next ``## ``)."""
    start = text.find(heading + "\n")
    if start < 0:
        return text
    end = text.find("\n## ", start + len(heading))
    return text[:start] + ("" if end < 0 else text[end + 1:])


@pytest.mark.parametrize("run", list(DECISIONS))
def test_decisions_summary(run, tmp_path):
    """``kvdiag decisions``' summary (``summarize_files``) from the committed decisions.parquet and pairs.parquet, and
    for the AUROC-vs-decision Spearman the token scores and labels the run shipped in inputs/."""
    from kvdiag.decisions.summary import INPUTS, summarize_files

    src = REPORTS / run
    for f in ("decisions.parquet", "pairs.parquet", "config.json", *INPUTS.values()):
        if (src / f).is_file():
            (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / f, tmp_path / f)
    summarize_files(tmp_path)
    tables = DECISIONS[run]
    assert_same_tables(tmp_path, src, tables)
    assert_same_json(read_json(tmp_path / "summary.json"), read_json(src / "summary.json"), f"{run}/summary.json")
    for extra in {"pairs_summary.csv", "stochastic.csv", "spearman.csv", "headroom.csv", "search.csv",
                  "held_out.csv"} - set(tables):
        assert not (tmp_path / extra).is_file() or not (tmp_path / extra).read_text().strip(), f"{run}/{extra}"


# --------------------------------------------------------------------------- replay


REPLAY = {  # run -> the tables its summary writes (committed)
    "replay-math500": ("summary.md", "summary.csv", "budget.csv", "outcomes.md", "outcomes.csv",
                       "outcomes_summary.csv", "paired.csv"),
    "replay-recall": ("summary.md", "summary.csv", "budget.csv", "outcomes.md", "outcomes.csv",
                      "outcomes_summary.csv", "paired.csv", "components.md", "components.csv",
                      "components_paired.csv"),
    "replay-smollm2": ("summary.md", "summary.csv", "budget.csv", "outcomes.md", "outcomes.csv",
                       "outcomes_summary.csv", "paired.csv"),
    "replay-smollm2-smoke": ("summary.md", "summary.csv", "budget.csv", "outcomes.md", "outcomes.csv",
                             "outcomes_summary.csv", "paired.csv"),
    "replay-tf-math500": ("summary.md", "summary.csv", "budget.csv", "decisions.md", "compressions.csv",
                          "correlations.csv", "regret.csv", "beaten.csv"),
    # the same replay with oracle_future's window the rest of the trace (#54: the regret against it)
    "replay-tf-math500/rest": ("summary.md", "summary.csv", "budget.csv", "decisions.md", "compressions.csv",
                               "correlations.csv", "regret.csv", "beaten.csv"),
    "replay-gemma3/recall": ("summary.md", "summary.csv", "budget.csv", "outcomes.md", "outcomes.csv",
                             "outcomes_summary.csv", "paired.csv", "components.md", "components.csv",
                             "components_paired.csv"),
    "replay-gemma3/math": ("summary.md", "summary.csv", "budget.csv", "outcomes.md", "outcomes.csv",
                           "outcomes_summary.csv", "paired.csv"),
}
# suite replays with needed tokens (#43)
SUITE_TABLES = ("summary.md", "summary.csv", "budget.csv", "outcomes.md", "outcomes.csv", "outcomes_summary.csv",
                "paired.csv", "components.md", "components.csv", "components_paired.csv", "needed.md", "needed.csv")
REPLAY.update({f"replay-suites/{suite}": SUITE_TABLES for suite in ("keys", "countdown", "recall", "keys-interval128")})
# teacher-forced replays of the suites' Traces (#43): the rules and oracle_future, oracle_future with window rest, and
# per-token selection with the exact-label oracle
TF_TABLES = ("summary.md", "summary.csv", "budget.csv", "tf_task.md", "tf_task.csv")
REPLAY.update({f"replay-suites/tf/{run}": TF_TABLES for run in (
    *(r for suite in ("keys", "countdown") for r in (suite, f"{suite}-rest", f"{suite}-per-token")),
    "countdown-oracle-h80")})
for _d, _t in REPLAY.items():
    compared(_d, _t)
# teacher-forced: the free-running replay its outcomes join (None: no join), and the labels and scores of its
# single-label AUROC. replay-tf-math500 selects per (layer, KV head) and replay-math500 ran per token: their decisions
# differ, so no outcome joins them
REPLAY_TF_INPUTS = {run: (None, "math500-smollm2/labels.parquet", "math500-smollm2/scores.parquet")
                    for run in ("replay-tf-math500", "replay-tf-math500/rest")}


@pytest.mark.parametrize("run", list(REPLAY))
def test_replay_summary(run, tmp_path):
    """``kvdiag replay``'s tables (``summarize_files``) from the committed generations.parquet alone."""
    from kvdiag.replay.run import ReplaySettings, replayed_auroc, summarize_files

    shutil.copy(REPORTS / run / "generations.parquet", tmp_path)
    outcomes = auroc = None
    if run in REPLAY_TF_INPUTS:
        free, labels, scores = REPLAY_TF_INPUTS[run]
        settings = ReplaySettings(**read_json(REPORTS / run / "config.json")["settings"])
        auroc = replayed_auroc(settings, (REPORTS / labels, REPORTS / scores), settings.seed)
        outcomes = None if free is None else REPORTS / free
    summarize_files(tmp_path, outcomes, auroc)
    tables = REPLAY[run]
    assert_same_tables(tmp_path, REPORTS / run, tables)
    made = {p.name for p in tmp_path.iterdir() if p.suffix in TABLE_SUFFIXES}
    assert made <= set(tables), f"{run}: regenerated tables not committed: {sorted(made - set(tables))}"


# --------------------------------------------------------------------------- leaderboard

LEADERBOARD = compared(".", ("leaderboard.csv", "leaderboard.md"))
BENCH = "math500-smollm2@1"


def _md_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]


LEADERBOARD_SCORES = REPORTS / "leaderboard.scores.parquet"  # kvdiag grade --all's OUT/scores.parquet
# single-rule kvdiag grade runs listed after the sealed rows, as graded (their rows.json)
LEADERBOARD_GRADED = [Path("reports/learned-rule/inputs/grade.json")]


def test_leaderboard(tmp_path):
    """``kvdiag.grade.run.rewrite_leaderboard``: the leaderboard's decisions half recomputed from the benchmark's
    committed
    builtins.parquet and references.parquet, its ranking half (rank-eval's AUROC, AP, top-k recall, FSR, Spearman and
    whether a rule ranks at all) from the benchmark's labels and the committed token scores of every rule; every
    table cell compared with the committed files. Only the rules and their params come from the csv."""
    from kvdiag.grade.run import rewrite_leaderboard

    for name in LEADERBOARD[1]:
        shutil.copy(REPORTS / name, tmp_path / name)
    (tmp_path / "leaderboard.md").write_text("")  # rewritten whole, not edited
    pl.read_csv(REPORTS / "leaderboard.csv", infer_schema_length=None).select("rule", "params").write_csv(
        tmp_path / "leaderboard.csv")  # every other column is recomputed
    rewrite_leaderboard(BENCH, tmp_path / "leaderboard.md", LEADERBOARD_SCORES, LEADERBOARD_GRADED)
    assert_same_tables(tmp_path, REPORTS, LEADERBOARD[1])
    assert "fitted:reports/learned-rule/model.json" in (tmp_path / "leaderboard.md").read_text()


# --------------------------------------------------------------------------- hybrid labels

HYBRID = compared("hybrid-labels-math500", ("report.md",))


HYBRID_INPUTS = REPORTS / "hybrid-labels-math500/inputs"  # inputs.py's copies of what analyze.py reads


def test_hybrid_analysis(tmp_path):
    """analyze.py's report.md from its committed inputs (the columns and rows of reproduce.sh's outputs it reads,
    written by inputs.py) and the committed bench JSON; the exact labels among them are the shipped benchmark's."""
    report, (name,) = HYBRID
    out = tmp_path / "out"
    out.mkdir()
    for f in (REPORTS / report).glob("bench-*.json"):
        shutil.copy(f, out)
    module = _script(f"reports/{report}/inputs.py")
    for file, (columns, _) in module.FILES.items():
        assert read_table(HYBRID_INPUTS / file)[0].columns == columns, file
    exact = read_table(HYBRID_INPUTS / "smollm2-labels-all.parquet")[0]
    bench = read_table(ROOT / "data/kvdiag-bench" / BENCH / "labels.parquet")[0]
    assert exact.equals(bench.filter(pl.col("granularity") == "token").select(exact.columns))
    _script(f"reports/{report}/analyze.py").main(HYBRID_INPUTS, out)
    assert_same_tables(out, REPORTS / report, [name])


MISS_RATE = compared("hybrid-labels-math500", ("miss-rate.md",))


def test_miss_rate_frontier(tmp_path):
    """miss_rate.py's frontier (the Fisher ranking's exact share -> measured miss rate, and --miss-rate R's rounds
    over 20 audit seeds) from the committed exact and fast labels of every entry and the committed cost benches."""
    report, (name,) = MISS_RATE
    out = tmp_path / "out"
    out.mkdir()
    for f in (REPORTS / report).glob("bench-*.json"):
        shutil.copy(f, out)
    _script(f"reports/{report}/miss_rate.py").main(HYBRID_INPUTS, out)
    assert_same_tables(out, REPORTS / report, [name])


HORIZON = compared("horizon-math500", ("report.md",))
HORIZON_INPUTS = REPORTS / "horizon-math500/inputs"


def test_horizon_study(tmp_path):
    """analyze.py's report.md from its committed inputs, one folder per model (labels, token scores, decisions and
    kept shares at every horizon, derived by inputs.py from the H = 256 runs' kl_steps) and reports/decisions-math500's
    decisions at H = 8 (its consistency check)."""
    report, (name,) = HORIZON
    want = {"labels.parquet": {"prompt_id", "checkpoint", "position", "age", "noise_floor", "prompt_len", "token_text",
                               *(f"kl_{h}" for h in (8, 16, 32, 64, 128, 256))},
            "decisions.parquet": {"prompt_id", "checkpoint", "decision", "kind", "budget", "status", "kl_256"},
            "kept.parquet": {"prompt_id", "checkpoint", "decision", "budget", "position", "kept_share"}}
    checkpoints = {"smollm2": 10, "gemma3": 5}
    for model, n in checkpoints.items():
        for file, columns in want.items():
            table = read_table(HORIZON_INPUTS / model / file)[0]
            assert columns <= set(table.columns), (model, file)
            assert table["prompt_id"].n_unique() == n, (model, file)
    text = (REPORTS / report / name).read_text()
    assert all(f"| {model} |" in text for model in checkpoints), "a model missing from the report's tables"
    out = tmp_path / "out"
    out.mkdir()
    _script(f"reports/{report}/analyze.py").main(HORIZON_INPUTS, out)
    assert_same_tables(out, REPORTS / report, [name])


LEARNED = compared("learned-rule", ("report.md",))
LEARNED_INPUTS = REPORTS / "learned-rule/inputs"


def test_learned_rule(tmp_path):
    """analyze.py's report.md from the committed inputs (each variant's model, the held-out entries' cell features,
    the decisions rows, the replay outcomes, the grade row) and reports/horizon-math500's held-out labels and rules'
    scores; the committed rule is the chosen variant, trained on prompts none of the held-out ones."""
    report, (name,) = LEARNED
    rule = json.loads((REPORTS / report / "model.json").read_text())
    chosen = json.loads((LEARNED_INPUTS / "chosen.json").read_text())["variant"]
    variant = json.loads((LEARNED_INPUTS / "models" / f"{chosen}.json").read_text())
    assert rule["kind"] == "kvdiag_fitted_rule" and rule["rule"] == variant["rule"]
    assert rule["features"] == variant["features"] and rule[rule["rule"]] == variant[variant["rule"]]
    trained = {p["id"] for p in rule["trained_on"]["prompts"]}
    held = set(pl.read_parquet(LEARNED_INPUTS / "heldout_features.parquet")["prompt_id"].unique().to_list())
    assert len(trained) == 16 and len(held) == 10 and not trained & held
    assert rule["trained_on"]["horizon"] == 128
    _script(f"reports/{report}/analyze.py").main(LEARNED_INPUTS, tmp_path)
    assert_same_tables(tmp_path, REPORTS / report, [name])


RATIO = compared("replay-suites", ("ratio.md", "ratio.csv"))


def test_suites_accuracy_against_compression_ratio(tmp_path):
    """ratio.py: the suites' task accuracy against kvpress's compression ratio, from the committed generations."""
    _script("reports/replay-suites/ratio.py").main(REPORTS / "replay-suites", tmp_path)
    assert_same_tables(tmp_path, REPORTS / "replay-suites", RATIO[1])
    full = pl.read_csv(tmp_path / "ratio.csv").filter(pl.col("scorer") == "full_kv")
    assert full.height == 3 and (full["ratio_max"].abs() < 1e-9).all()  # the definition: FullKV removes nothing


INTERVAL = compared("replay-suites", ("interval.md",))


def test_keys_interval(tmp_path):
    """interval.py's interval.md (keys at interval 64 against 128) from the two committed generations files."""
    _script("reports/replay-suites/interval.py").main(REPORTS / "replay-suites", tmp_path)
    assert_same_tables(tmp_path, REPORTS / "replay-suites", ["interval.md"])


FAST_HORIZON = compared("fast-labels-horizon", ("report.md",))


def test_fast_labels_horizon(tmp_path):
    """analyze.py's report.md from the committed inputs (exact labels to H = 128, fast labels at 16 and 128) and the
    bench JSONs."""
    _script("reports/fast-labels-horizon/analyze.py").main(REPORTS / "fast-labels-horizon/inputs", tmp_path)
    assert_same_tables(tmp_path, REPORTS / "fast-labels-horizon", ["report.md"])


TF_MATH500_WINDOWS = compared("replay-tf-math500", ("windows.md", "windows.csv"))


def test_teacher_forced_math500_windows(tmp_path):
    """replay-tf-math500/windows.py's tables (every policy against the rest-window oracle_future) from the two
    committed generations.parquet alone."""
    _script("reports/replay-tf-math500/windows.py").main(REPORTS / "replay-tf-math500", tmp_path)
    assert_same_tables(tmp_path, REPORTS / "replay-tf-math500", TF_MATH500_WINDOWS[1])


DECISIONS_GENERALISATION = compared("decisions-math500", ("generalisation.md", "generalisation.csv",
                                                           "generalisation-best-known.csv",
                                                           "generalisation-current-known.csv",
                                                           "generalisation-split.csv",
                                                           "generalisation-swaps.csv",
                                                           "generalisation-reach.csv",
                                                           "generalisation-gemma3-reach.csv",
                                                           "generalisation-search.csv",
                                                           "generalisation-gemma3-search.csv",
                                                           "generalisation-reconstruction.csv",
                                                           "generalisation-descent.csv",
                                                           "generalisation-gemma3-descent.csv",
                                                           "generalisation-descent-half.csv",
                                                           "generalisation-gemma3-descent-half.csv",
                                                           "generalisation-held-out-descent.csv",
                                                           "generalisation-pooled-known.csv",
                                                           "generalisation-search-from.csv"))


def test_decisions_generalisation(tmp_path):
    """decisions-math500/generalisation.py's tables (#54's generalisation check: each reference chosen on steps 0-63
    against the same reference chosen on 0-127, both judged on 64-127, and the searches' reruns) from the committed
    runs' decisions.parquet."""
    _script("reports/decisions-math500/generalisation.py").main(REPORTS / "decisions-math500", tmp_path)
    assert_same_tables(tmp_path, REPORTS / "decisions-math500", DECISIONS_GENERALISATION[1])


TF_REPORT = compared("replay-suites/tf", ("report.md", "regret.csv"))


def test_teacher_forced_suites_report(tmp_path):
    """tf/analyze.py's report.md and regret.csv (the policies' KL against oracle_future_rest's) from the committed
    teacher-forced and free-running generations alone."""
    _script("reports/replay-suites/tf/analyze.py").main(REPORTS / "replay-suites/tf", REPORTS / "replay-suites",
                                                        tmp_path, plot=False)
    assert_same_tables(tmp_path, REPORTS / "replay-suites/tf", TF_REPORT[1])


ADAPTER = compared("adapter-vs-base", ("report.md",))


def test_adapter_vs_base(tmp_path):
    """analyze.py's report.md from the committed labels (each model's, and the base Trace's under the adapted model)
    and the two rank-eval metrics tables (test_rank_eval regenerates those)."""
    _script("reports/adapter-vs-base/analyze.py").main(REPORTS / "adapter-vs-base", tmp_path)
    assert_same_tables(tmp_path, REPORTS / "adapter-vs-base", ["report.md"])


NEEDED_LABELS = compared("replay-suites/labels", ("report.md",))
NEEDED_LABELS_INPUTS = REPORTS / "replay-suites/labels/inputs"


def test_needed_token_labels(tmp_path):
    """analyze.py's report.md from its committed inputs (one folder per suite: the labels of the sampled entries and
    of the needed tokens at every horizon, inputs.py's) and the replay's committed needed.csv (its ground truth)."""
    report, (name,) = NEEDED_LABELS
    suites = sorted(p.name for p in NEEDED_LABELS_INPUTS.iterdir() if p.is_dir())
    assert "keys" in suites
    for suite in suites:
        table = read_table(NEEDED_LABELS_INPUTS / suite / "labels.parquet")[0]
        assert {"prompt_id", "checkpoint", "position", "sampled", "where", "kl_16", "kl_rest"} <= set(table.columns)
        assert table["sampled"].any() and table["where"].is_not_null().any(), suite
    out = tmp_path / "out"
    out.mkdir()
    _script(f"reports/{report}/analyze.py").main(NEEDED_LABELS_INPUTS, out)
    assert_same_tables(out, REPORTS / report, [name])


GPU_CHECK = compared("gpu-check", ("results.md",))


def test_gpu_check_results():
    """results.md of the H200 run is ``render_markdown`` of its committed results.json, which passed 7 of 7."""
    from kvdiag.bench.gpu_check import render_markdown

    res = read_json(REPORTS / "gpu-check/results.json")
    assert not res["dry_run"] and [s["status"] for s in res["steps"]] == ["pass"] * 7
    assert render_markdown(res) == (REPORTS / "gpu-check/results.md").read_text()


# --------------------------------------------------------------------------- bench


SCALE = compared("bench", ("scale.md",))


def test_scale_steps_table():
    """scale.md's steps table is ``frame_table`` of the measured steps, which scale.csv holds (as bench_scale writes
    both from one table)."""
    from kvdiag.core.tables import frame_table

    report, (name,) = SCALE
    steps = pl.read_csv(REPORTS / report / "scale.csv")
    assert steps.height and steps.columns[:3] == ["T", "stage", "store"]
    assert frame_table(steps) in (REPORTS / report / name).read_text()


# --------------------------------------------------------------------------- scripts and coverage


def test_report_scripts_import():
    """Every script under reports/ imports against today's API (hybrid's analyze.py needs runs/ to run)."""
    scripts = sorted(p.relative_to(ROOT).as_posix() for p in REPORTS.rglob("*.py"))
    assert scripts, "no report script found"
    for path in scripts:
        module = _script(path)
        assert callable(getattr(module, "main", None)), f"{path} has no main()"


def test_every_table_is_covered():
    """Each committed table under reports/ is compared by a test above or named in NOT_REGENERATED with its reason."""
    committed = {p.relative_to(REPORTS).as_posix() for p in REPORTS.rglob("*")
                 if p.is_file() and (p.suffix in TABLE_SUFFIXES or p.suffix == ".txt") and p.name != "README.md"}
    assert not COMPARED & set(NOT_REGENERATED), sorted(COMPARED & set(NOT_REGENERATED))
    assert set(PARTLY_REGENERATED) <= COMPARED
    assert committed - COMPARED - set(NOT_REGENERATED) == set(), "tables no test covers"
    assert (COMPARED | set(NOT_REGENERATED)) - committed == set(), "listed tables that are not committed"

