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
    for block in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S):
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
        evicted = df.group_by("prompt_id", "checkpoint").agg(pl.all().head(pl.len() // 2)).explode(pl.exclude("prompt_id", "checkpoint"))
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
