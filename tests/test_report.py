"""``kvdiag report``: the Markdown and self-contained HTML report of a run directory; missing pieces; bad input."""

from __future__ import annotations

import base64
import json
import math
import re
import shlex
import shutil

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

import kvdiag.cli.main
from kvdiag.core.errors import UserError
from kvdiag.core.io import write_table
from kvdiag.figures import FigureParams, make_figures
from kvdiag.rankeval import KEYS
from kvdiag.report.run import label_statistics, record_command, report_files
from tests.conftest import synthetic_labels as shared_synthetic_labels


def synthetic_labels(trace, seed: int = 0) -> pl.DataFrame:
    return shared_synthetic_labels(trace, seed)


def table_value(md: str, name: str) -> str:
    """The first value cell of the Markdown table row whose first cell is ``name``."""
    match = re.search(rf"^\| {re.escape(name)} \| ([^|]*) \|", md, re.MULTILINE)
    assert match, name
    return match.group(1).strip()


def as_float(cell: str) -> float:
    return float("nan") if cell == "n/a" else float(cell.replace(",", ""))


@pytest.fixture(scope="module")
def run(tiny_trace, tmp_path_factory):
    """A complete run directory, made the way ``kvdiag demo`` would: each step recorded in commands.json."""
    root = tmp_path_factory.mktemp("report") / "run"
    shutil.copytree(tiny_trace.path, root / "trace")
    labels = synthetic_labels(tiny_trace)
    rng = np.random.default_rng(1)
    scores = labels.select(KEYS).with_columns(**{n: pl.Series(rng.normal(size=labels.height))
                                                 for n in ("attention", "rkv", "avokv_e", "avokv_e_no_payload")})
    prov = {"trace": tiny_trace.provenance}
    write_table(labels, root / "labels.parquet", {"kind": "labels", **prov})
    write_table(scores, root / "scores.parquet", {"kind": "scores", **prov})
    record_command(root, ["kvdiag", "trace", "--model", "tiny:llama", "--out", root / "trace"])
    argv = ["rank-eval", "--labels", str(root / "labels.parquet"), "--scores", str(root / "scores.parquet"),
            "--out", str(root / "rank-eval"), "--bootstrap", "50"]
    assert CliRunner().invoke(kvdiag.cli.main.app, argv).exit_code == 0
    record_command(root, ["kvdiag", *argv])
    fig_argv = ["kvdiag", "figures", "--trace", str(root / "trace"), "--w-obs", "8"]
    make_figures(
        tiny_trace, labels, scores, root / "figures", FigureParams(w_obs=8, w_delay=64, n_boot=20), command=fig_argv
    )
    record_command(root, fig_argv)
    md_path, html_path = report_files(root)
    return {
        "root": root, "labels": labels, "md": md_path.read_text(), "html": html_path.read_text(),
        "paths": (md_path, html_path),
    }


def test_record_command_appends_in_order(tmp_path):
    record_command(tmp_path, ["kvdiag", "label", "--out", tmp_path / "l.parquet"])
    path = record_command(tmp_path, ["kvdiag", "score", "--scorers", "a b"])
    commands = json.loads(path.read_text())
    assert [c["argv"][1] for c in commands] == ["label", "score"]
    assert commands[1]["argv"][-1] == "a b" and commands[0]["kvdiag_version"]


def test_report_describes_the_whole_run(run, tiny_trace):
    md, root = run["md"], run["root"]
    assert run["paths"] == (root / "report.md", root / "report.html")
    for heading in (
        "Contents of the run", "What was traced", "Labels", "Scores", "Ranking metrics (Table 3)", "Figures",
        "Commands and configuration",
    ):
        assert f"## {heading}" in md
    assert "**missing**" not in md and "Warning" not in md
    assert f"same one (fingerprint `{tiny_trace.fingerprint}`)" in md
    for pid in tiny_trace.prompt_ids:
        assert re.search(
            rf"^\| {pid} \| {tiny_trace.prompt_len(pid)} \| \d+ \| {tiny_trace.length(pid)} \|", md, re.MULTILINE
        )
    assert (root / "rank-eval" / "table.md").read_text() in md  # the Table-3-shaped table with CIs, verbatim
    commands = json.loads((root / "commands.json").read_text())
    for c in commands:
        assert shlex.join(c["argv"]) in md
    assert '"w_obs": 8' in md  # the figures' configuration


def test_headline_leads_with_the_findings_of_the_tables_below(run):
    """The report opens with what was found (before set-up and provenance), and every figure it states is the one a
    table further down shows: the best rule by AUROC is found here from the Table-3 rows, not from the headline."""
    md, page = run["md"], run["html"]
    assert re.findall(r"^## (.+)$", md, re.MULTILINE)[:2] == ["Findings", "Contents of the run"]
    assert page.index("<h2>Findings</h2>") < page.index("<h2>Contents of the run</h2>") < page.index("<h2>Labels</h2>")
    head, rest = md.split("## Findings", 1)[1].split("## Contents of the run", 1)
    table = rest.split("## Ranking metrics (Table 3)", 1)[1]
    auroc = dict(re.findall(r"^\| (\w+) \| (\d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\]) \|", table, re.MULTILINE))
    assert len(auroc) == 4  # the four scored rules, each with its CI
    ranked = sorted(auroc, key=lambda name: float(auroc[name].split()[0]), reverse=True)
    assert f"the best rule by AUROC is `{ranked[0]}` {auroc[ranked[0]]} (95% cluster-bootstrap CI" in head
    assert f"next `{ranked[1]}` {auroc[ranked[1]]}" in head and "of 4 rules" in head
    n = int(re.search(r"n = ([\d,]+) candidates", head).group(1).replace(",", ""))
    assert f"on {n:,} candidates" in table  # the n of table.md's caption
    stats = {name: table_value(rest, name) for name in ("harmful", "rows", "prompts", "prevalence", "harm threshold")}
    assert f"{stats['harmful']} harmful of {stats['rows']} labels over {stats['prompts']} prompts" in head
    assert f"prevalence {stats['prevalence']} " in head and f"harm threshold {stats['harm threshold']} nats" in head
    assert int(stats["harmful"]) > 0  # a headline of zeros would match the table trivially


def test_label_statistics_match_an_independent_computation(run):
    md, labels = run["md"], run["labels"]
    kl = labels["kl_mean"].to_numpy()
    unresolved = kl <= labels["noise_floor"].to_numpy()
    resolved = np.sort(kl[~unresolved])
    h = (len(resolved) - 1) * 0.9
    threshold = resolved[int(h)] + (h - int(h)) * (resolved[int(h) + 1] - resolved[int(h)])
    expected = {
        "rows": labels.height, "checkpoints": 4, "unresolved": int(unresolved.sum()),
        "noise floor min": 1e-4, "noise floor max": 2e-4, "kl_mean q0.5": float(np.median(kl)),
        "harm threshold": threshold, "harmful": int((resolved > threshold).sum()),
        "prevalence": float((resolved > threshold).mean()),
    }
    assert expected["unresolved"] > 0
    for name, value in expected.items():
        assert as_float(table_value(md, name)) == pytest.approx(value, rel=1e-3), name
    stats = label_statistics(labels)["token"]
    assert stats["kl_mean q0.99"] == pytest.approx(float(np.quantile(kl, 0.99)))


def test_figure_statistics_in_the_report_are_the_csv_numbers(run):
    md, fig = run["md"], run["root"] / "figures"
    for csv in ("blind_spot_stats.csv", "delayed_reads_stats.csv"):
        stats = pl.read_csv(fig / csv, schema_overrides={"value": pl.Float64, "note": pl.String})
        for r in stats.iter_rows(named=True):
            shown = as_float(table_value(md.split(f"[{csv}]", 1)[1], r["statistic"]))
            assert (math.isnan(shown) and math.isnan(r["value"])) or shown == pytest.approx(r["value"], rel=1e-3), r[
                "statistic"
            ]
    comp = pl.read_csv(fig / "components.csv", schema_overrides={"note": pl.String})
    auroc = comp.filter((pl.col("scorer") == "avokv_e") & (pl.col("metric") == "auroc")).row(0, named=True)
    assert table_value(md, "AvoKV-E") == f"{auroc['value']:.3f} [{auroc['ci_low']:.3f}, {auroc['ci_high']:.3f}]"
    assert table_value(md, "− rank norm. (raw)") == "n/a"  # not scored: said so, not dropped


def test_html_is_self_contained(run):
    page, fig = run["html"], run["root"] / "figures"
    sources = re.findall(r'<img src="([^"]+)"', page)
    # blind spot, delayed reads, components, rank-eval's budget curves
    assert len(sources) == 4 and all(s.startswith("data:image/png;base64,") for s in sources)
    embedded = {base64.b64decode(s.split(",", 1)[1]) for s in sources}
    assert embedded == {(fig / f"{n}.png").read_bytes() for n in ("blind_spot", "delayed_reads", "components")} | {
        (run["root"] / "rank-eval" / "budget_curves.png").read_bytes()}
    assert page.count("<table>") >= 6 and "<h2>Ranking metrics (Table 3)</h2>" in page


def test_missing_pieces_are_listed(run, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(run["root"] / "labels.parquet", partial / "labels.parquet")
    (partial / "figures").mkdir()  # started but unfinished: no figures.json
    md = report_files(partial)[0].read_text()
    assert table_value(md, "`labels.parquet`") == "present"
    assert table_value(md, "`trace`") == "**missing**"
    assert table_value(md, "`figures`").startswith("**unreadable: figures.json is missing")
    assert "kvdiag rank-eval --labels RUN/labels.parquet" in md and "commands were not recorded" in md
    head = md.split("## Contents of the run", 1)[0]
    assert "rank-eval is missing, so no rule is ranked yet" in head and "**Labels:**" in head  # found: what is there
    assert as_float(table_value(md, "rows")) == run["labels"].height


def test_pieces_from_different_traces_are_flagged(run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(run["root"], other)
    info = json.loads((other / "figures" / "figures.json").read_text())
    info["inputs"]["trace"]["fingerprint"] = "feedfacefeedface"
    (other / "figures" / "figures.json").write_text(json.dumps(info))
    md = report_files(other, tmp_path / "elsewhere")[0].read_text()
    assert "Warning: the pieces come from different Traces" in md and "figures: `feedfacefeedface`" in md
    assert "](../other/figures/blind_spot.png)" in md  # images relative to the report's own directory


def test_bad_run_directory(tmp_path, capsys, run):
    with pytest.raises(UserError, match="not a directory"):
        report_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no kvdiag run piece"):
        report_files(tmp_path / "empty")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="not a writable directory"):
        report_files(run["root"], blocker / "out")
    with pytest.raises(SystemExit) as err:
        kvdiag.cli.main.main(["report", "--run", str(tmp_path / "empty")])
    assert err.value.code == 2 and "holds no kvdiag run piece" in capsys.readouterr().err


def test_cli_report(run, tmp_path):
    result = CliRunner().invoke(kvdiag.cli.main.app, ["report", "--run", str(run["root"]), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.html").stat().st_size > 100_000 and "## Figures" in (tmp_path / "report.md").read_text()


# a piece of the run edited by hand -> what the report says (a refusal, or the piece shown unreadable); each of these
# ended in "internal error" (polars' NoDataError, ColumnNotFoundError, ComputeError; AttributeError, KeyError)
HOSTILE = {
    "rank-eval/metrics.csv": ("", "unread", "metrics.csv cannot be read \\(--run .* is not the table kvdiag writes"),
    "rank-eval/config.json": ("[1, 2]", "unread", "rank-eval is unreadable: config.json .* is not the JSON object"),
    "figures/figures.json": ("42", "unread", "figures.json .* is not the JSON object kvdiag figures writes"),
    "commands.json": ("[1]", "unread", "is not a list of commands \\(each an object with its argv\\)"),
    "figures/blind_spot_stats.csv": ("x\n1\n", "refused", "blind_spot_stats.csv lacks the column\\(s\\) statistic, "
                                                          "value, note; re-run kvdiag figures"),
    "figures/components.csv": ("", "refused", "components.csv is not the table kvdiag writes \\(NoDataError"),
    "rank-eval/paired.csv": ('q\n"\n', "refused", "paired.csv is not the table kvdiag writes \\(ComputeError"),
}


@pytest.mark.parametrize("piece", list(HOSTILE))
def test_a_hand_edited_piece_is_refused_or_shown_unreadable(run, tmp_path, piece):
    """Each file the report reads beyond the tables' contracts: an empty, foreign or truncated one is one line
    naming the file and the command that rewrites it (exit 2), or, for a piece the report lists, that piece shown
    unreadable with the reason (the rest of the report written)."""
    text, outcome, message = HOSTILE[piece]
    edited = tmp_path / "run"
    shutil.copytree(run["root"], edited)
    (edited / piece).write_text(text)
    if outcome == "refused":
        with pytest.raises(UserError, match=message):
            report_files(edited, tmp_path / "out")
        assert not (tmp_path / "out" / "report.md").exists()
    else:
        md = report_files(edited, tmp_path / "out")[0].read_text()
        assert re.search(message, md), md[:2000]


def test_an_unreadable_optional_piece_is_said_not_dropped(run, tmp_path):
    """fit/ and decisions/ are optional: absent, their sections are left out; present but unreadable (a config.json
    of another shape: the fit section's KeyError was 'internal error'), their section says why instead of vanishing."""
    edited = tmp_path / "run"
    shutil.copytree(run["root"], edited)
    (edited / "fit").mkdir()
    (edited / "fit" / "config.json").write_text('{"summary": {"n": 3}}')
    (edited / "fit" / "table.md").write_text("")
    (edited / "fit" / "importances.csv").write_text("feature\nx\n")
    (edited / "decisions").mkdir()
    for name, text in (("config.json", "{}"), ("summary.md", "# s\n"), ("summary.json", "3")):
        (edited / "decisions" / name).write_text(text)
    md = report_files(edited, tmp_path / "out")[0].read_text()
    assert "`fit/` is unreadable: config.json" in md and "not the object kvdiag fit writes" in md
    assert "`decisions/` is unreadable: " in md and "summary.json is not the JSON object kvdiag decisions" in md
    assert "`fit/` is unreadable" not in run["md"] and "## Decisions" not in run["md"]  # absent: no section
