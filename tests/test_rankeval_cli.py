"""``kvdiag rank-eval``: files written, Table-3-shaped output, exit code 2 on bad input."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from kvdiag.cli.main import app, main
from kvdiag.core.io import write_table
from kvdiag.rankeval import KEYS


@pytest.fixture
def inputs(tmp_path):
    rng = np.random.default_rng(0)
    n = 4 * 2 * 30
    labels = pl.DataFrame(
        {
            "prompt_id": np.repeat([f"p{i}" for i in range(4)], 60),
            "checkpoint": np.tile(np.repeat([256, 384], 30), 4), "position": np.tile(np.arange(30), 8),
            "granularity": "token", "layer": -1, "kv_head": -1, "kl_mean": np.exp(rng.normal(-5, 2, n)),
            "noise_floor": 0.0,
        }
    )
    logkl = np.log(labels["kl_mean"].to_numpy())
    scores = labels.select(KEYS).with_columns(
        attention=pl.Series(logkl + rng.normal(0, 3, n)), avokv_e=pl.Series(logkl + rng.normal(0, 1, n))
    )
    trace = {"path": "trace", "fingerprint": "f00"}
    lp = write_table(labels, tmp_path / "labels.parquet", {"kind": "labels", "trace": trace})
    sp = write_table(scores, tmp_path / "scores.parquet", {"kind": "scores", "trace": trace})
    return lp, sp


def test_cli_writes_tables_and_config(inputs, tmp_path):
    lp, sp = inputs
    out = tmp_path / "eval"
    res = CliRunner().invoke(
        app,
        [
            "rank-eval", "--labels", str(lp), "--scores", str(sp), "--out", str(out), "--bootstrap", "50", "--rho",
            "0.25",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "AUROC" in res.output and "avokv_e" in res.output
    assert sorted(p.name for p in out.iterdir()) == [
        "budget_curves.csv", "budget_curves.pdf", "budget_curves.png", "config.json", "metrics.csv", "paired.csv",
        "table.md", "table.tex",
    ]
    metrics = pl.read_csv(out / "metrics.csv")
    assert metrics.columns[:6] == ["scorer", "metric", "scope", "value", "ci_low", "ci_high"]
    assert metrics.height == 2 * 7 * 2
    paired = pl.read_csv(out / "paired.csv")
    assert set(paired["scorer"]) == {"attention"} and set(paired["reference"]) == {"avokv_e"}
    md = (out / "table.md").read_text().splitlines()
    assert md[0].startswith("| Score | AUROC | AP | Top-k recall | False-safe rate | Spearman |")
    assert [line.split(" | ")[0] for line in md[2:4]] == ["| attention", "| avokv_e"]
    assert r"\toprule" in (out / "table.tex").read_text()
    config = json.loads((out / "config.json").read_text())
    assert (
        config["config"]["rho"] == 0.25
        and config["config"]["n_boot"] == 50
        and config["config"]["harm"] == "quantile:0.9"
    )
    assert config["inputs"]["labels"]["path"] == str(lp.resolve())
    assert config["summary"]["n_evaluated"] == 240
    assert [w.split(":")[0] for w in config["summary"]["warnings"]] == ["4 prompt(s) only"]
    assert "4 prompt(s) only" in res.output


def test_cli_reference_none_and_scorer_subset(inputs, tmp_path):
    lp, sp = inputs
    out = tmp_path / "eval"
    res = CliRunner().invoke(
        app, ["rank-eval", "--labels", str(lp), "--scores", str(sp), "--out", str(out), "--bootstrap", "0",
              "--reference", "none", "--scorers", "attention", "--table-scope", "macro"]
    )
    assert res.exit_code == 0, res.output
    assert set(pl.read_csv(out / "metrics.csv")["scorer"]) == {"attention"}
    assert pl.read_csv(out / "paired.csv").height == 0
    assert "macro averages over checkpoints" in (out / "table.md").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--harm", "quantile:2"], "--harm 'quantile:2' is not"),
        (["--reference", "h2o"], "--reference h2o is not a scorer"), (["--table-scope", "both"], "--table-scope both"),
    ],
)
def test_cli_user_errors_exit_2(inputs, tmp_path, capsys, args, message):
    lp, sp = inputs
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "rank-eval", "--labels", str(lp), "--scores", str(sp), "--out", str(tmp_path / "o"), "--bootstrap", "0",
                *args,
            ]
        )
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.replace("\n", "")


def test_cli_missing_file_exits_2(inputs, tmp_path):
    _, sp = inputs
    with pytest.raises(SystemExit) as exc:
        main(
            ["rank-eval", "--labels", str(tmp_path / "nope.parquet"), "--scores", str(sp), "--out", str(tmp_path / "o")]
        )
    assert exc.value.code == 2
