"""``kvdiag bench padded`` (#58) without timing anything: the pairs' order, ratios and summary on made-up seconds, the
batch it builds, and one tiny run through the CLI (its JSON's shape and the token check; no timed assertion)."""

from __future__ import annotations

import json

import pytest
import torch

from kvdiag.cli import bench_padded
from kvdiag.cli.main import main
from kvdiag.generate import bench
from kvdiag.generate.bench import PaddedBenchResult, Run, abba, pair_ratios, summarize


def test_pairs_alternate_abba():
    assert abba(4) == [("padded", "unpadded"), ("unpadded", "padded"), ("padded", "unpadded"),
                       ("unpadded", "padded")]
    assert abba(1) == [("padded", "unpadded")]


def test_ratio_median_and_range_on_made_up_seconds():
    # (padded s, unpadded s): the same tokens, so the tokens/s ratio padded / unpadded is unpadded s / padded s
    seconds = [(10.0, 9.0), (8.0, 8.0), (9.0, 10.8), (12.0, 9.6), (10.0, 9.5)]
    ratios = pair_ratios(seconds)
    assert ratios == pytest.approx([0.9, 1.0, 1.2, 0.8, 0.95])
    s = summarize(ratios)
    assert s["median"] == pytest.approx(0.95) and s["min"] == pytest.approx(0.8) and s["max"] == pytest.approx(1.2)
    assert s["pairs"] == 5 and s["at_target"] == 4  # 0.9 counts: at or above
    assert s["median_meets_target"] and not s["min_meets_target"]
    assert not summarize([0.85, 0.89, 0.95])["median_meets_target"]


def test_result_reports_each_pair_and_both_sides():
    pairs = [{"padded": Run(2.0, 3.0, 0.5), "unpadded": Run(1.8, 3.3, 0.4)},
             {"unpadded": Run(2.0, 4.0, 0.4), "padded": Run(2.5, 4.0, 0.5)}]
    r = PaddedBenchResult([96, 54], 10, pairs, ["padded", "unpadded"], {"padded": 5.0, "unpadded": 4.0}, 300.0,
                          250.0, 2)
    assert r.tokens == 20
    assert r.ratios == pytest.approx([0.9, 0.8]) and r.cpu_ratios == pytest.approx([1.1, 1.0])
    assert r.tokens_per_s("padded") == pytest.approx([10.0, 8.0])
    s = r.summary()
    assert s["median"] == pytest.approx(0.85) and s["cpu_median"] == pytest.approx(1.05)
    assert s["padded_checkpoint_s_median"] == pytest.approx(0.5)
    j = r.to_json()
    assert [p["first"] for p in j["pairs"]] == ["padded", "unpadded"]
    assert j["pairs"][1]["unpadded_tokens_per_s"] == pytest.approx(10.0) and j["prompt_len"] == 96
    assert json.loads(json.dumps(j)) == j  # plain JSON


def test_the_batch_pads_each_row_on_the_left():
    inputs = bench.batch(49152)
    ids, mask = inputs["padded"]
    full, ones = inputs["unpadded"]
    L = max(bench.LENGTHS)
    assert ids.shape == full.shape == (8, L) and bool(ones.all())
    assert mask.sum(1).tolist() == list(bench.LENGTHS)
    for row, n in enumerate(bench.LENGTHS):  # the same ids where not padded, padding masked on the left
        assert torch.equal(ids[row, L - n:], full[row, L - n:]) and bool((ids[row, : L - n] == bench.PAD_ID).all())
        assert bool((mask[row, : L - n] == 0).all()) and bool((mask[row, L - n:] == 1).all())
    # the former reports/bench/evicting_padded.py's ids: torch.manual_seed(0); torch.randint(100, 20000, (8, 96))
    assert torch.equal(full, torch.randint(100, 20000, (8, 96), generator=torch.Generator().manual_seed(0)))
    assert int(bench.batch(259)["unpadded"][0].max()) < 259  # a small vocabulary bounds the ids
    assert bench_padded.LENGTHS == bench.LENGTHS  # the CLI's copy (checked before torch loads)


def test_a_tiny_run_through_the_cli(tmp_path, capsys):
    out = tmp_path / "padded.json"
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "padded", "--model", "tiny:llama", "--repeats", "2", "--max-new-tokens", "4", "--out",
              str(out)])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert "ratio padded/unpadded tokens/s: median" in printed and "over 2 ABBA pairs" in printed
    j = json.loads(out.read_text())
    assert j["kind"] == "bench_padded" and j["tokens_per_run"] == 8 * 4 and j["repeats"] == 2
    assert [p["first"] for p in j["pairs"]] == ["padded", "unpadded"]
    assert j["same_tokens"] == 8  # every padded row wrote its prompt's tokens alone
    assert all(p["ratio"] > 0 and p["padded_seconds"] > 0 for p in j["pairs"])
    assert j["summary"]["min"] <= j["summary"]["median"] <= j["summary"]["max"]
