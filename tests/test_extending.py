"""docs/extending.md's metric and figure examples, run as printed: each is one file whose registration makes it
part of rank-eval (metrics.csv, paired.csv) or of the figures."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from kvdiag.figures import FIGURES, FigureContext, FigureParams
from kvdiag.rankeval import METRICS, rank_eval

DOCS = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def example(first_line: str) -> str:
    """The indented ```python block of docs/extending.md that starts with ``first_line``, dedented."""
    for block in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.DOTALL):
        lines = [line.removeprefix("   ") for line in block.splitlines()]
        if lines[0] == first_line:
            return "\n".join(lines)
    raise AssertionError(f"no example starting with {first_line!r} in {DOCS}")


@pytest.fixture
def registries():
    metrics, figures = dict(METRICS), dict(FIGURES)
    yield
    for registry, before in ((METRICS, metrics), (FIGURES, figures)):
        registry.clear()
        registry.update(before)


@pytest.fixture
def tables():
    """Labels and scores of 5 prompts × 8 checkpoints × 10 candidates: ``a`` tracks the KL, ``b`` is noise."""
    rng = np.random.default_rng(0)
    n = 400
    keys = pl.DataFrame({"prompt_id": [f"p{i % 5}" for i in range(n)], "checkpoint": [500 + i // 50 for i in range(n)],
                         "position": list(range(n)), "granularity": "token", "layer": -1, "kv_head": -1})
    kl = rng.exponential(size=n)
    labels = keys.with_columns(kl_mean=pl.Series(kl), noise_floor=pl.lit(0.0))
    scores = keys.with_columns(a=pl.Series(kl + 0.5 * rng.normal(size=n)), b=pl.Series(rng.normal(size=n)))
    return labels, scores


def test_metric_example_is_computed_listed_and_compared(registries, tables):
    exec(example("# kvdiag/rankeval/safe_evicted.py"), {})
    labels, scores = tables
    result = rank_eval(labels, scores, n_boot=50, reference="a")
    m = result.metrics.filter(pl.col("metric") == "safe_evicted")
    assert m.height == 4 and m["note"].to_list() == [""] * 4
    # brute force: at each checkpoint evict the floor(0.5 C) lowest-scored (no ties), count the safe ones
    harmful = labels["kl_mean"] > result.summary["harm_threshold"]
    for scorer in ("a", "b"):
        df = labels.with_columns(harmful=harmful, s=scores[scorer]).sort("s")
        evicted = (
            df.group_by("prompt_id", "checkpoint")
            .agg(pl.all().head(pl.len() // 2))
            .explode(pl.exclude("prompt_id", "checkpoint"))
        )
        want = (~evicted["harmful"]).sum() / (~harmful).sum()
        got = m.filter(scorer=scorer, scope="pooled")["value"].item()
        assert got == pytest.approx(want, abs=1e-12), scorer
    assert "safe_evicted" in result.paired["metric"].to_list()
    assert list(METRICS)[-1] == "safe_evicted"


def test_figure_example_draws_into_the_output(registries, tables, tmp_path):
    exec(example("# kvdiag/figures/kl_by_age.py"), {})
    labels, scores = tables
    drawn = FIGURES["kl_by_age"].draw(FigureContext(None, labels, scores, FigureParams(), tmp_path))
    assert drawn.result["n"] == labels.height and drawn.notes == []
    assert sorted(f.name for f in drawn.files) == ["kl_by_age.pdf", "kl_by_age.png", "kl_by_age_stats.csv"]
    assert all(f.is_file() for f in drawn.files)


def test_scorer_example_declares_protection_and_replay_refuses_it(tmp_path, capsys):
    """docs/extending.md's rule with sinks and a history, run as printed: its sinks get the kept score, the declaration
    drives rank-eval's --eligible, and replay refuses it (exit 2, one line) before a model loads."""
    import torch

    from kvdiag.cli.main import main
    from kvdiag.rankeval.candidates import filter_candidates
    from kvdiag.scorers import SCORERS, ScoreContext, load_plugins
    from tests.conftest import random_qkv

    plugin = tmp_path / "sinks_and_sums.py"
    header = "# sinks_and_sums.py: kvdiag score --plugin sinks_and_sums.py --scorers sinks_and_sums ..."
    plugin.write_text(example(header))
    before = dict(SCORERS)
    try:
        load_plugins([str(plugin)])
        rule = SCORERS["sinks_and_sums"]()
        q, k, v = random_qkv(T=40)
        scores = rule.scores(ScoreContext(q, k, v, 8**-0.5, prompt_len=10))
        assert scores[:, :4].min() > scores[:, 4:].max() and bool((scores[:, :4] == scores[:, :1]).all())
        labels = pl.DataFrame({"checkpoint": [40] * 6, "position": [0, 3, 4, 10, 20, 39]})
        kept, _ = filter_candidates(labels, None, None, "sinks_and_sums", None)
        assert kept["position"].to_list() == [4, 10, 20, 39]
        with pytest.raises(SystemExit) as exit_:
            main(["replay", "--plugin", str(plugin), "--scorers", "sinks_and_sums", "--model", "tiny:llama",
                  "--out", str(tmp_path / "r")])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
        assert "sinks_and_sums needs the attention of every past query (it declares needs_history)" in err
        assert not (tmp_path / "r").exists()
        assert torch.equal(rule.protected(torch.tensor([40, 1]), torch.tensor([0, 39])), torch.tensor([True, False]))
    finally:
        SCORERS.clear()
        SCORERS.update(before)
