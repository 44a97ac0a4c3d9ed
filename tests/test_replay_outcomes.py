"""Outcomes against FullKV: final answers, loops, first divergence, fidelity with Wilson or cluster-bootstrap CIs,
and the paired test of the best rule."""

from __future__ import annotations

import math

import polars as pl
import pytest

from kvdiag.replay.outcomes import (
    final_answer,
    first_divergence,
    has_loop,
    outcome_rows,
    paired_tests,
    summarize_outcomes,
    write_outcomes,
)


def test_final_answer_loops_and_divergence():
    assert final_answer("so \\boxed{\\frac{1}{2}} and later \\boxed{3}") == "3"
    assert final_answer("x = \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert final_answer("Code: 4821\n1. 1\nThe code is 4821.") == "4821"
    assert final_answer("1,250 apples") == "1250" and final_answer("no answer") is None
    # cut at the length limit: a box is an answer, the last number of unfinished reasoning is not
    assert final_answer("so 12 + 30 = 42", finished=False) is None
    assert final_answer("\\boxed{42}, and 7", finished=False) == "42"
    assert has_loop([1, 2, 3] * 3, n=3, repeats=3) and not has_loop([1, 2, 3] * 3, n=3, repeats=4)
    assert not has_loop(list(range(100)), n=2, repeats=2)
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1 and first_divergence([1, 2], [1, 2, 3]) == 2


def _row(pid, scorer, budget, text, tokens, sample=0):
    return {"prompt_id": pid, "scorer": scorer, "budget": budget, "sample": sample, "prompt_len": 1,
            "token_ids": [0, *tokens], "text": text, "generated": len(tokens), "correct": None,
            "max_length_hit": False, "stop": "eos", "kl_mean": 0.1, "compressions": 0 if scorer == "full_kv" else 1}


def _frame(samples=1):
    rows = []
    for i in range(10):
        for s in range(samples):
            pid = f"p{i}"
            rows.append(_row(pid, "full_kv", None, f"answer {i}", [1, 2, 3], s))
            rows.append(_row(pid, "good", 64, f"answer {i}", [1, 2, 3], s))  # always FullKV's answer
            keep = i < 4  # bad keeps FullKV's answer on 4 of 10 prompts and diverges at step 1 elsewhere
            rows.append(_row(pid, "bad", 64, f"answer {i if keep else 99}", [1, 2, 3] if keep else [1, 7], s))
    return pl.DataFrame(rows)


def test_fidelity_with_wilson_and_mcnemar():
    out = outcome_rows(_frame())
    bad = out.filter(pl.col("scorer") == "bad")
    assert bad["fidelity"].sum() == 4 and bad["first_divergence"].drop_nulls().to_list() == [1] * 6
    assert bad["length_ratio"].drop_nulls().sort().to_list() == pytest.approx([2 / 3] * 6 + [1.0] * 4)
    s = summarize_outcomes(out, n_boot=200).filter(pl.col("scorer") == "bad").row(0, named=True)
    assert s["fidelity"] == pytest.approx(0.4)
    # Wilson 95 % for 4/10: centre (4 + 1.92) / 13.84, half-width 1.96 * sqrt(4*6/10 + 0.96) / 13.84
    centre, half = (4 + 1.96**2 / 2) / (10 + 1.96**2), 1.96 * math.sqrt(2.4 + 1.96**2 / 4) / (10 + 1.96**2)
    assert s["fidelity_lo"] == pytest.approx(centre - half, abs=1e-3)
    assert s["fidelity_hi"] == pytest.approx(centre + half, abs=1e-3)
    p = paired_tests(out, n_boot=200).row(0, named=True)
    assert (p["best"], p["other"], p["units"]) == ("good", "bad", 10)
    assert p["fidelity_diff"] == pytest.approx(0.6) and p["test"] == "mcnemar"
    assert p["p_value"] == pytest.approx(2 * 0.5**6)
    assert 0 < p["diff_lo"] <= 0.6 <= p["diff_hi"]


def test_exact_suites_compare_the_whole_generation():
    """A suite graded on its whole generation (recall) has the whole text as its answer: stopping after the first
    number FullKV also wrote keeps the last number but is not FullKV's answer."""
    rows = [_row("r0", "full_kv", None, "Code: 4821\n1\n2\nCode: 4821", [1, 2, 3]),
            _row("r0", "short", 64, "Code: 4821", [1]),
            _row("r0", "same", 64, "Code: 4821\n1\n2\nCode: 4821 ", [1, 2, 3])]
    df = pl.DataFrame(rows)
    assert outcome_rows(df).filter(pl.col("scorer") == "short")["fidelity"].to_list() == [True]
    exact = outcome_rows(df, exact={"r0"})
    assert exact.filter(pl.col("scorer") == "short")["fidelity"].to_list() == [False]
    assert exact.filter(pl.col("scorer") == "same")["fidelity"].to_list() == [True]  # stripped


def test_samples_use_the_cluster_bootstrap(tmp_path):
    out = outcome_rows(_frame(samples=3))
    s = summarize_outcomes(out, n_boot=500).filter(pl.col("scorer") == "bad").row(0, named=True)
    assert s["generations"] == 30 and s["fidelity"] == pytest.approx(0.4)
    # clusters of 3 identical samples: the bootstrap width is that of 10 prompts, wider than Wilson on 30 units
    assert s["fidelity_hi"] - s["fidelity_lo"] > 0.35
    p = paired_tests(out, n_boot=200).row(0, named=True)  # several samples: the exact sign test over 10 prompts
    assert (p["test"], p["prompts"], p["units"]) == ("sign", 10, 30) and p["p_value"] == pytest.approx(2 * 0.5**6)
    write_outcomes(_frame(samples=3), tmp_path, n_boot=100)
    text = (tmp_path / "outcomes.md").read_text()
    assert "cluster bootstrap over prompts" in text and "| bad" in text


def test_rates_are_over_compressed_generations_and_the_others_are_counted(tmp_path):
    """A generation that never compressed is FullKV's own (fidelity 1 by construction): it is left out of the rule's
    rates, counted apart, and the table states both counts."""
    df = _frame().with_columns(compressions=pl.when((pl.col("scorer") == "bad") & (pl.col("prompt_id") == "p0"))
                               .then(0).otherwise(pl.col("compressions")))
    s = summarize_outcomes(outcome_rows(df), n_boot=100).filter(pl.col("scorer") == "bad").row(0, named=True)
    assert (s["generations"], s["uncompressed"], s["fidelity_n"]) == (10, 1, 9)
    assert s["fidelity"] == pytest.approx(3 / 9)  # p0 kept FullKV's answer only because it never compressed
    write_outcomes(df, tmp_path, n_boot=100)
    text = (tmp_path / "outcomes.md").read_text()
    assert "| bad | 64 | 9/10 | 9 |" in text and "compressed generations only" in text


def test_generations_without_compressions_are_refused():
    from kvdiag.core.errors import UserError

    with pytest.raises(UserError, match="no compressions column"):
        outcome_rows(_frame().drop("compressions"))


def test_a_budget_no_rule_compressed_at_has_no_paired_test():
    """#55: a budget that holds every prompt whole (no rule compressed there) has nothing to compare: its rows are
    left out of the paired tests (an IndexError, exit 1, before), the other budget's test is unchanged."""
    out = outcome_rows(_frame())
    whole = out.filter(pl.col("scorer") != "full_kv").with_columns(budget=pl.lit(4096, pl.Int64),
                                                                   compressed=pl.lit(False))
    both = pl.concat([out, whole.select(out.columns)])
    assert paired_tests(both, n_boot=200).equals(paired_tests(out, n_boot=200))


def test_without_fullkv_the_rules_outcomes_are_written_and_its_comparisons_left_out(tmp_path):
    """A replay run with --no-full-kv has no FullKV rows: each rule's outcomes (accuracy, loops, length hits, KL) are
    written as with them; fidelity, divergence and the paired fidelity test, which compare with FullKV's
    generation, are not measured (null, no paired.csv) and outcomes.md says why."""
    df = _frame().with_columns(correct=pl.col("text") == pl.lit("answer ") + pl.col("prompt_id").str.slice(1))
    with_full, without = tmp_path / "with", tmp_path / "without"
    with_full.mkdir(), without.mkdir()
    write_outcomes(df, with_full, n_boot=100)
    write_outcomes(df.filter(pl.col("scorer") != "full_kv"), without, n_boot=100)
    assert (with_full / "paired.csv").is_file() and not (without / "paired.csv").exists()
    got, had = (pl.read_csv(d / "outcomes_summary.csv", infer_schema_length=None) for d in (without, with_full))
    assert got["scorer"].to_list() == ["good", "bad"]
    for col in ("correct", "correct_lo", "correct_hi", "loop", "kl_mean", "generations"):
        assert got[col].to_list() == had.filter(pl.col("scorer") != "full_kv")[col].to_list(), col
    assert got["correct"].to_list() == [1.0, 0.4]
    assert got["fidelity"].fill_nan(None).is_null().all() and got["fidelity_n"].to_list() == [0, 0]
    rows = pl.read_csv(without / "outcomes.csv", infer_schema_length=None)
    assert rows.height == 20 and rows["fidelity"].is_null().all() and rows["first_divergence"].is_null().all()
    text = (without / "outcomes.md").read_text()
    assert "without FullKV (--no-full-kv)" in text and "Paired" not in text
    assert "without FullKV" not in (with_full / "outcomes.md").read_text()
