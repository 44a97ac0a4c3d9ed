"""The learned rule's report from its committed inputs (inputs.py made them from reproduce.sh's runs): every figure is
on prompts the rule was not trained on. Run from the repository root; writes reports/learned-rule/report.md.

Sections: (a) the variants and the ablation (out-of-fold AUROC on the training prompts, held-out AUROC at H = 16
and 128); (b) rank-eval against the 21 built-in rules at H = 16 and 128; (c) decisions: joint damage over the 128
judged steps against the best rule per budget; (d) in the loop: task success and components against the six rules
of reports/replay-suites and reports/replay-math500 (McNemar's exact test, Holm over the six rules of each suite,
budget and component); (e) the sealed benchmark's row.

Statistics through kvdiag.core.stats: cluster-bootstrap CIs over prompts (B = 1000; one checkpoint per held-out prompt
in (b) and (c), 10 clusters), exact sign tests for per-checkpoint comparisons (below 30 clusters), per-checkpoint
ratios as geometric mean with CI, median and wins.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import polars as pl
import torch

from kvdiag.core.harm import HarmSpec
from kvdiag.core.io import read_table
from kvdiag.core.stats import PromptBootstrap, format_p, holm, mcnemar, ratio_summary, sign_test
from kvdiag.core.tables import ci_text, md_table, number_text
from kvdiag.rankeval.metrics import auroc
from kvdiag.scorers.fitted import Boosted, Logistic

HERE = Path("reports/learned-rule")
INPUTS = HERE / "inputs"
HORIZON = Path("reports/horizon-math500/inputs/smollm2")
HORIZONS = (16, 128)
KEEPS = ("keep:0.5", "keep:0.25", "keep:0.125")
BEST_CANDIDATES = ("snapkv", "cake", "obcache")  # the best rules per budget of reports/decisions-math500 at H = 128
SIX = ("streamingllm", "snapkv", "tova", "rkv", "avokv_e", "cake")
SUITES = {"keys": Path("reports/replay-suites/keys"), "countdown": Path("reports/replay-suites/countdown"),
          "recall": Path("reports/replay-suites/recall"), "math500": Path("reports/replay-math500")}
COMPONENTS = ("correct", "copied", "counted", "recalled", "format")
SPEC = HarmSpec(include_unresolved=True)  # harmful: above the 0.9 quantile of the sampled labels at each H
N_BOOT, SEED, LEVEL = 1000, 0, 0.95
LEARNED = "learned"
ROUNDS = {"round 1": "round1", "round 2": "."}  # inputs/<folder>: each round's variants, models and decisions
FINAL = "round 2"  # the round whose chosen variant is the rule


def model_scores(model: dict, feats: pl.DataFrame) -> np.ndarray:
    """[tokens] the rule's token score: the mean over a token's cells of the model's logit of that cell's features
    (``kvdiag score --aggregation mean_raw`` of ``fitted:PATH``), tokens in ``feats``' first-appearance order."""
    rule = (Logistic if model["rule"] == "logistic" else Boosted).from_json(model[model["rule"]])
    x = torch.from_numpy(feats.select(model["features"]).to_numpy().astype(np.float64).T.copy())
    logit = rule(x).numpy()
    token = feats.select("prompt_id", "checkpoint", "position").with_columns(pl.Series("logit", logit))
    return token.group_by("prompt_id", "checkpoint", "position", maintain_order=True).agg(
        pl.col("logit").mean())["logit"].to_numpy()


class Data:
    """The held-out labels (``harm_H`` per H), the rules' and every variant's token scores on them, the bootstrap."""

    def __init__(self, inputs: Path = INPUTS):
        lab = read_table(HORIZON / "labels.parquet")[0]
        self.thr = {h: SPEC.threshold(lab[f"kl_{h}"].to_numpy()) for h in HORIZONS}
        lab = lab.with_columns(**{f"harm_{h}": pl.col(f"kl_{h}") > self.thr[h] for h in HORIZONS})
        rules = read_table(HORIZON / "token_scores.parquet")[0]
        feats = pl.read_parquet(inputs / "heldout_features.parquet")
        key = ["prompt_id", "checkpoint", "position"]
        self.variants = {r: pl.read_csv(inputs / d / "variants.csv") for r, d in ROUNDS.items()}
        chosen = {r: json.loads((inputs / d / "chosen.json").read_text()) for r, d in ROUNDS.items()}
        self.chosen = {r: c["variant"] for r, c in chosen.items()}
        self.best_variant = {r: c.get("best_variant", c["variant"]) for r, c in chosen.items()}
        models = {f"{r}/{v}": json.loads((inputs / d / "models" / f"{v}.json").read_text())
                  for r, d in ROUNDS.items() for v in self.variants[r]["variant"]}
        tokens = feats.select(key).unique(maintain_order=True)
        scores = tokens.with_columns(pl.Series(v, model_scores(m, feats)) for v, m in models.items())
        scores = scores.with_columns(pl.col(f"{FINAL}/{self.chosen[FINAL]}").alias(LEARNED))
        self.j = lab.join(rules, on=key).join(scores, on=key).sort(key)
        self.rules = [c for c in rules.columns if c not in key]
        self.prompts = self.j["prompt_id"].to_numpy()
        self.ids = sorted(set(self.prompts))
        self.boot = PromptBootstrap(self.ids, N_BOOT, SEED, LEVEL)
        self.w = self.boot.mult[:, [self.boot.index[p] for p in self.prompts]].T  # [N, B]

    def auroc(self, col: str, h: int) -> tuple[float, tuple[float, float], np.ndarray]:
        """Pooled AUROC of ``col`` against harmful at ``h``, its CI, its per-checkpoint values."""
        y, s = self.j[f"harm_{h}"].to_numpy().astype(int), self.j[col].to_numpy().astype(float)
        per = np.array([auroc(y[self.prompts == p], s[self.prompts == p]) for p in self.ids])
        return auroc(y, s), self.boot.ci(auroc(y, s, self.w)), per


def variants_section(d: Data, rnd: str, what: str) -> list[str]:
    rows = []
    for r in d.variants[rnd].iter_rows(named=True):
        held = [d.auroc(f"{rnd}/{r['variant']}", h) for h in HORIZONS]
        mark = (" (the rule)" if r["variant"] == d.chosen[rnd] else "") + (
            " (best variant)" if r["variant"] == d.best_variant[rnd] != d.chosen[rnd] else "")
        rows.append([r["variant"] + mark,
                     r.get("ablation_of") or "", r["rows"], r["model"], str(r["features"]),
                     ci_text(r["oof_auroc"], r["oof_ci_low"], r["oof_ci_high"]),
                     *[ci_text(a, *ci) for a, ci, _ in held]])
    return [f"Each variant fitted on {what} (H = 128; harmful: above the 0.9 quantile of the training labels). "
            "Out-of-fold AUROC: 5 folds grouped by prompt over the 16 training prompts, 95% cluster-bootstrap CI "
            "over them. The best variant has the highest out-of-fold AUROC of the variants; the ablation rows are it "
            "without one feature group; the rule has the highest out-of-fold AUROC of all the rows (all chosen on "
            "training data only; round 1 chose among the variants alone). "
            "Held-out AUROC: the 240 sampled entries of the 10 held-out checkpoints against harmful at H (above the "
            "0.9 quantile of their labels at H), 95% cluster-bootstrap CI over checkpoints.\n",
            md_table(["variant", "ablation of", "rows", "model", "features", "out-of-fold AUROC (training)",
                      "held-out AUROC, H = 16", "held-out AUROC, H = 128"], rows, "lllllrrr"), ""]


def rank_section(d: Data) -> list[str]:
    text = ["## (d) Rank-eval on the held-out checkpoints\n"]
    for h in HORIZONS:
        res = {c: d.auroc(c, h) for c in [LEARNED, *d.rules]}
        order = sorted(res, key=lambda c: -res[c][0])
        best = next(c for c in order if c != LEARNED)
        rows = []
        for c in order:
            test = sign_test(res[LEARNED][2] - res[c][2]) if c != LEARNED else None
            rows.append([c if c != LEARNED else f"**learned ({d.chosen[FINAL]})**", ci_text(res[c][0], *res[c][1]),
                         "" if test is None else f"{test.above} of {test.n}",
                         "" if test is None else format_p(test.p)])
        t = sign_test(res[LEARNED][2] - res[best][2])
        text += [f"### H = {h}\n",
                 f"Pooled AUROC (harmful: above {number_text(d.thr[h], 3)} nats, the 0.9 quantile), {d.j.height} "
                 f"entries at {len(d.ids)} checkpoints; 'learned higher': the checkpoints where the learned rule's "
                 "AUROC is above the row's (n: checkpoints with harmful and harmless entries), exact sign test. "
                 f"Against the best rule ({best}): higher at {t.above} of {t.n}, p = {format_p(t.p)}.\n",
                 md_table(["rule", "AUROC [95% CI]", "learned higher", "sign p"], rows, "lrrr"), ""]
    return text


def decisions_section(path: Path) -> list[str]:
    """The learned rule against the best rule per budget on the held-out checkpoints (``path``: decisions rows)."""
    dec = pl.read_parquet(path).filter(pl.col("kind") == "rule")
    (name,) = [c for c in dec["decision"].unique().to_list() if c.startswith("fitted")]
    rows = []
    boot = PromptBootstrap(dec["prompt_id"].unique().to_list(), N_BOOT, SEED, LEVEL)
    for keep in KEEPS:
        b = dec.filter(pl.col("budget") == keep)
        means = {r: b.filter(pl.col("decision") == r)["kl_mean"].mean() for r in BEST_CANDIDATES}
        best = min(means, key=means.get)
        mine = b.filter(pl.col("decision") == name)
        pair = (mine.select("prompt_id", "checkpoint", pl.col("kl_mean").alias("x"))
                .join(b.filter(pl.col("decision") == best).select("prompt_id", "checkpoint",
                                                                   pl.col("kl_mean").alias("y")),
                      on=["prompt_id", "checkpoint"]).sort("prompt_id"))
        x, y, p = pair["x"].to_numpy(), pair["y"].to_numpy(), pair["prompt_id"].to_numpy()
        rs = ratio_summary(boot, x, y, p)
        t = sign_test(np.log(x) - np.log(y))
        sink = np.mean([heads[0] for heads in mine["evicted_heads"].to_list()])
        rows.append([keep, number_text(float(x.mean()), 3), number_text(float(sink), 3), best,
                     number_text(float(y.mean()), 3), ci_text(rs["geomean"], *rs["geomean_ci"]),
                     number_text(rs["median"], 3), f"{t.below} of {t.n}", format_p(t.p)])
    return ["Joint damage (mean KL over the 128 judged steps, nats) of the set each rule evicts, per-head selection, "
            "at the 10 held-out checkpoints; 'position 0 evicted': of the (layer, KV head) cells, mean over "
            "checkpoints. The best rule per budget: the lowest mean among SnapKV, CAKE and OBCache (the best rules "
            "of reports/decisions-math500 at H = 128), picked on these checkpoints, which favours it. learned / best: "
            "per-checkpoint ratios, geometric mean [95% cluster-bootstrap CI], median; 'learned lower': checkpoints "
            "where the learned rule's damage is lower, exact sign test.\n",
            md_table(["budget", "learned: mean damage", "position 0 evicted (cells)", "best rule", "its mean damage",
                      "learned / best [95% CI]", "median", "learned lower", "sign p"], rows, "lrrlrrrrr"), ""]


def replay_section(inputs: Path = INPUTS) -> list[str]:
    rows, ran = [], []
    for suite, where in SUITES.items():
        path = inputs / f"replay-{suite}.parquet"
        if not path.is_file():
            continue
        mine = pl.read_parquet(path)
        ran.append(f"{suite} {mine.select('prompt_id', 'sample').n_unique()} (prompt, sample) pairs")
        theirs = pl.read_csv(where / "outcomes.csv", infer_schema_length=None).filter(pl.col("scorer").is_in(SIX))
        comps = [c for c in COMPONENTS if c in mine.columns and mine[c].null_count() < mine.height]
        for budget in sorted(mine["budget"].unique().to_list()):
            a = mine.filter(pl.col("budget") == budget)
            for comp in comps:
                ps, cells = [], []
                for rule in SIX:
                    b = theirs.filter((pl.col("scorer") == rule) & (pl.col("budget") == budget))
                    j = a.select("prompt_id", "sample", pl.col(comp).alias("x")).join(
                        b.select("prompt_id", "sample", pl.col(comp).alias("y")), on=["prompt_id", "sample"])
                    j = j.drop_nulls()
                    x, y = j["x"].to_numpy().astype(bool), j["y"].to_numpy().astype(bool)
                    ps.append(mcnemar(x, y))
                    cells.append((rule, int(y.sum()), int(x.sum()), len(j), int((x & ~y).sum()), int((~x & y).sum())))
                adj = holm(np.array(ps))
                kx, n = cells[0][2], cells[0][3]
                rows.append([suite, str(budget), comp, f"{kx}/{n}",
                             *[f"{ky}/{m} (+{w} −{lost}; {format_p(p)})"
                               for (_, ky, _, m, w, lost), p in zip(cells, adj, strict=True)]])
    if not rows:
        return ["## (e) In the loop\n", "Not run yet (no replay inputs)."]
    return ["## (e) In the loop\n",
            "Free-running replay of the rule on the held-out suites with the settings of reports/replay-suites (keys, "
            "countdown with its LoRA adapter, recall; greedy) and reports/replay-math500 (temperature 0.6, top-p 0.95, "
            "per-token selection), without FullKV; run here: " + "; ".join(ran) + ". Its outcomes are paired by "
            "(prompt, sample) with each of the six rules' committed outcomes there. McNemar's exact test, Holm over "
            "the six rules of each suite, budget and component. A rule's cell: its successes of n (+won −lost: pairs "
            "only the learned rule passed / only the rule passed; the Holm-adjusted p).\n",
            md_table(["suite", "budget", "component", "learned", *SIX], rows, "lrlr" + "r" * len(SIX))]


def grade_section(inputs: Path = INPUTS) -> list[str]:
    path = inputs / "leaderboard-row.md"
    if not path.is_file():
        return []
    return ["## (f) The sealed benchmark\n", "`kvdiag grade` of the learned rule on math500-smollm2@1 (its horizon, 8 "
            "steps; the benchmark's prompts are none of the training prompts):\n", path.read_text().strip()]


def cost_section(inputs: Path = INPUTS) -> list[str]:
    b = json.loads((inputs / "bench-score.json").read_text())
    sec = b["scorer_seconds_per_checkpoint"]
    base = sec["snapkv"]
    rows = [[name, number_text(v, 3), number_text(v / base, 3)] for name, v in sec.items()]
    return ["## (g) Scoring cost\n",
            f"`kvdiag bench score` (one run, {b['checkpoints']} checkpoints of {b['layers']} layers, {b['entries']:,} "
            f"entries; peak RSS {b['peak_rss_mib']:.0f} MiB): seconds per checkpoint and the ratio to SnapKV's in the "
            "same run (shared features are charged to the first scorer that needs them: SnapKV, listed first).\n",
            md_table(["scorer", "s / checkpoint", "/ SnapKV"], rows, "lrr")]


def main(inputs: Path = INPUTS, out: Path = HERE) -> None:
    d = Data(inputs)
    text = ["# The learned rule, held out\n", "Generated by analyze.py from inputs/ (README.md says how they were "
            "made).\n",
            "## (a) Round 1: exact labels of a uniform sample\n",
            *variants_section(d, "round 1", "1,024 exact labels, a seeded uniform sample of 32 entries at each of the "
                              "32 training checkpoints"),
            "Its rule's decisions on the held-out checkpoints:\n",
            *decisions_section(inputs / "round1" / "decisions.parquet"),
            "## (b) Round 2: every entry, exact where it is harmful\n",
            *variants_section(d, "round 2", "hybrid labels of every entry at the 32 training checkpoints (exact for "
                              "the "
                              "top 10 % by the fast label and a uniform audit of 32, the fast label elsewhere)"),
            "## (c) Decisions on the held-out checkpoints\n", "The rule:\n",
            *decisions_section(inputs / "decisions.parquet"),
            f"Round 2's best variant ({d.best_variant[FINAL]}), whose decisions were seen before the ablations "
            "entered the choice of the rule:\n",
            *decisions_section(inputs / "decisions-best-variant.parquet")]
    for section in (rank_section(d), replay_section(inputs), grade_section(inputs), cost_section(inputs)):
        text += section + [""]
    (out / "report.md").write_text("\n".join(text).rstrip() + "\n")


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:]))
