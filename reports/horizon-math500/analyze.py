"""The horizon study from its committed inputs (inputs.py made them from reproduce.sh's runs): how labels, delayed
harm, the rules' AUROC and their joint damage change with the horizon H, each at H = 8 ... 256 derived from the same
rows' per-step KL. Run from the repository root; writes reports/horizon-math500/report.md.

Statistics through kvdiag.stats: cluster-bootstrap CIs over prompts (one checkpoint each, so over checkpoints), exact
sign tests for paired comparisons (10 clusters, below 30), per-cluster ratio summaries, Kendall's tau with its exact
p between orders of rules.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.harm import HarmSpec
from kvdiag.io import read_table
from kvdiag.rankeval.metrics import auroc
from kvdiag.stats import PromptBootstrap, compare, format_p, kendall, sign_test, spearman_ci
from kvdiag.tables import ci_text, md_table, number_text

INPUTS = Path("reports/horizon-math500/inputs")
OUT = Path("reports/horizon-math500")
DECISIONS_H8 = Path("reports/decisions-math500/smollm2/decisions.parquet")  # the same checkpoints at H = 8
HORIZONS = (8, 16, 32, 64, 128, 256)
LONG, SHORT = 256, 16
KEEPS = ("keep:0.5", "keep:0.25", "keep:0.125")
# harmful: above the 0.9 quantile of the sampled labels at each H. Every sampled label is analysed: the noise floor
# is recorded at the run's horizon only (256), not at the shorter ones derived from it
SPEC = HarmSpec(include_unresolved=True)
N_BOOT, SEED, LEVEL = 1000, 0, 0.95
AGE_BINS = (("1-16", 1, 16), ("17-64", 17, 64), ("65-256", 65, 256), ("> 256", 257, 10**9))
OPERATORS = set("+-*/=^()[]{}<>|!\\,.:;")



def token_kind(text: str) -> str:
    """special (a chat-template token), digit (only digits), operator (only operator or punctuation characters),
    space, or word."""
    s = text.strip()
    if not s:
        return "space"
    if s.startswith("<|") and s.endswith("|>"):
        return "special"
    if s.isdigit():
        return "digit"
    if set(s) <= OPERATORS:
        return "operator"
    return "word"


def harmful(labels: pl.DataFrame) -> tuple[pl.DataFrame, dict[int, float]]:
    """labels + ``harm_H`` (kl_H above SPEC's threshold at H) for every H; the thresholds."""
    thr = {h: SPEC.threshold(labels[f"kl_{h}"].to_numpy()) for h in HORIZONS}
    return labels.with_columns(**{f"harm_{h}": pl.col(f"kl_{h}") > thr[h] for h in HORIZONS}), thr


def order_tau(values: dict[int, dict[str, float]], rules: list[str], h: int, higher_better: bool) -> dict:
    """Kendall's tau (exact p) between the rules' values at ``h`` and at LONG (n = rules with both)."""
    a = np.array([values[h][r] for r in rules])
    b = np.array([values[LONG][r] for r in rules])
    return kendall(a, b) if higher_better else kendall(-a, -b)


# --------------------------------------------------------------------------- sections


def spearman_section(lab: pl.DataFrame, boot: PromptBootstrap, thr: dict[int, float]) -> list[str]:
    rows = []
    prompts = lab["prompt_id"].to_numpy()
    long = lab[f"kl_{LONG}"].to_numpy()
    for h in HORIZONS:
        s = spearman_ci(boot, lab[f"kl_{h}"].to_numpy(), long, prompts)
        both = lab.filter(pl.col(f"harm_{LONG}"))
        share, reps = boot.mean(both[f"harm_{h}"].cast(pl.Float64).to_numpy(), both["prompt_id"].to_numpy())
        rows.append([f"H = {h}", f"{s['n']:,}", ci_text(s["spearman"], s["ci_low"], s["ci_high"]),
                     number_text(thr[h], 3), ci_text(share, *boot.ci(reps)),
                     number_text(float(lab[f"kl_{h}"].median()), 3)])
    return ["## (a) Labels at H against labels at H = 256\n",
            md_table(["horizon", "entries", "Spearman with H = 256 [95% CI]", "harm threshold (nats)",
                      "harmful at 256 also harmful at H [95% CI]", "median label (nats)"], rows, "lrrrrr")]


def delayed_section(lab: pl.DataFrame, kept: pl.DataFrame, boot: PromptBootstrap, rules: list[str]) -> list[str]:
    lab = lab.with_columns(
        delayed=pl.col(f"harm_{LONG}") & ~pl.col(f"harm_{SHORT}"),
        transient=pl.col(f"harm_{SHORT}") & ~pl.col(f"harm_{LONG}"),
        where=pl.when(pl.col("position") < pl.col("prompt_len")).then(pl.lit("prompt")).otherwise(pl.lit("generated")),
        kind=pl.col("token_text").map_elements(token_kind, return_dtype=pl.String),
        age_bin=pl.coalesce([pl.when(pl.col("age").is_between(a, b)).then(pl.lit(name)) for name, a, b in AGE_BINS]))
    n, n_long = lab.height, int(lab[f"harm_{LONG}"].sum())
    n_delayed, n_transient = int(lab["delayed"].sum()), int(lab["transient"].sum())
    per = lab.group_by("prompt_id").agg(pl.col("delayed").sum()).sort("prompt_id")
    text = ["## (b) Delayed harm: harmless at H = 16, harmful at H = 256\n",
            f"Of {n:,} sampled entries, {n_long:,} are harmful at H = {LONG}; {n_delayed:,} of them "
            f"({n_delayed / max(n_long, 1):.0%}) are not harmful at H = {SHORT} (delayed harm), at "
            f"{int((per['delayed'] > 0).sum())} of {per.height} checkpoints (per checkpoint: "
            f"{', '.join(map(str, per['delayed'].to_list()))}). The other way, {n_transient:,} entries harmful at "
            f"H = {SHORT} are not at H = {LONG}. Medians: age "
            f"{number_text(float(lab.filter('delayed')['age'].median()), 3)} tokens for the delayed entries, "
            f"{number_text(float(lab['age'].median()), 3)} for all sampled ones; "
            f"their label at H = {SHORT} {number_text(float(lab.filter('delayed')[f'kl_{SHORT}'].median()), 3)} "
            f"nats and at H = {LONG} {number_text(float(lab.filter('delayed')[f'kl_{LONG}'].median()), 3)}.\n",
            "Where they are: per group, the sampled entries, those harmful at 256, and the share of them that is "
            "delayed (95% cluster-bootstrap CI over checkpoints).\n"]
    rows = []
    for col, title in (("where", "prompt or generated"), ("kind", "token kind"), ("age_bin", "age (tokens)")):
        for g in sorted(lab[col].cast(pl.String).unique().to_list()):
            part = lab.filter((pl.col(col).cast(pl.String) == g) & pl.col(f"harm_{LONG}"))
            share, reps = boot.mean(part["delayed"].cast(pl.Float64).to_numpy(), part["prompt_id"].to_numpy())
            n_g = lab.filter(pl.col(col).cast(pl.String) == g).height
            rows.append([title, g, f"{n_g:,}", f"{part.height:,}", f"{int(part['delayed'].sum()):,}",
                         ci_text(share, *boot.ci(reps)) if part.height else "n/a"])
    text.append(md_table(["by", "group", "entries", "harmful at 256", "delayed", "delayed share [95% CI]"], rows,
                         "llrrrr"))
    text.append("\nWhich rules keep them: the share of the (layer, KV head) cells that keep an entry, averaged over "
                "the delayed entries, over every entry harmful at 256, and over all sampled entries (per-head "
                "selection as in decisions; 95% CI over checkpoints for the delayed ones).\n")
    flags = lab.select("prompt_id", "checkpoint", "position", "delayed", f"harm_{LONG}")
    k = kept.join(flags, on=["prompt_id", "checkpoint", "position"])
    rows = []
    for rule in rules:
        cells = [rule]
        for budget in KEEPS[:2]:
            kb = k.filter((pl.col("decision") == rule) & (pl.col("budget") == budget))
            if kb.height == 0:
                cells += ["over budget", "", ""]
                continue
            d = kb.filter("delayed")
            share, reps = boot.mean(d["kept_share"].to_numpy(), d["prompt_id"].to_numpy())
            cells += [ci_text(share, *boot.ci(reps), digits=2),
                      number_text(float(kb.filter(f"harm_{LONG}")["kept_share"].mean()), 2),
                      number_text(float(kb["kept_share"].mean()), 2)]
        rows.append(cells)
    text.append(md_table(["rule", "0.5: delayed", "0.5: harmful at 256", "0.5: all", "0.25: delayed",
                          "0.25: harmful at 256", "0.25: all"], rows, "lrrrrrr"))
    return text


def auroc_section(lab: pl.DataFrame, scores: pl.DataFrame, boot: PromptBootstrap, rules: list[str]) -> list[str]:
    j = lab.join(scores, on=["prompt_id", "checkpoint", "position"]).sort("prompt_id", "checkpoint", "position")
    prompts = j["prompt_id"].to_numpy()
    w = boot.mult[:, [boot.index[p] for p in prompts]].T  # [N, B] prompt multiplicities
    ids = sorted(set(prompts))
    value, cis, per = {}, {}, {}
    for h in HORIZONS:
        y = j[f"harm_{h}"].to_numpy().astype(int)
        value[h], cis[h], per[h] = {}, {}, {}
        for r in rules:
            s = j[r].to_numpy().astype(float)
            value[h][r] = auroc(y, s)
            cis[h][r] = boot.ci(auroc(y, s, w))
            per[h][r] = np.array([auroc(y[prompts == p], s[prompts == p]) for p in ids])
    rows = []
    for r in sorted(rules, key=lambda r: -value[LONG][r]):
        test = sign_test(per[LONG][r] - per[SHORT][r])
        rows.append([r, *[number_text(value[h][r], 3) for h in HORIZONS],
                     ci_text(value[SHORT][r], *cis[SHORT][r]), ci_text(value[LONG][r], *cis[LONG][r]),
                     f"{test.above} of {test.n}", format_p(test.p)])
    text = ["## (c) Each rule's AUROC by horizon\n",
            f"Pooled AUROC of the token score against harmful at H (above the 0.9 quantile of the sampled labels at "
            f"H), {j.height:,} entries at {len(ids)} checkpoints, 95% cluster-bootstrap CIs; the last columns: the "
            f"checkpoints where the rule's AUROC is higher at H = {LONG} than at H = {SHORT}, and the exact sign "
            "test's two-sided p. Rows by AUROC at 256.\n",
            md_table(["rule", *[f"H = {h}" for h in HORIZONS], "H = 16 [95% CI]", "H = 256 [95% CI]",
                      "higher at 256", "sign p"], rows, "l" + "r" * (len(HORIZONS) + 4))]
    rows = []
    for h in HORIZONS[:-1]:
        t = order_tau(value, rules, h, True)
        top = sorted(rules, key=lambda r: -value[h][r])[:3]
        rows.append([f"H = {h}", f"{t['n']}", number_text(t["tau"], 3), format_p(t["p_value"]), ", ".join(top)])
    rows.append([f"H = {LONG}", f"{len(rules)}", "1", "", ", ".join(sorted(rules, key=lambda r: -value[LONG][r])[:3])])
    text.append("\nThe order of the rules by AUROC at H against the order at 256 (Kendall's tau over the rules, "
                "its exact p of no association; n: the rules):\n")
    text.append(md_table(["horizon", "rules", "Kendall tau with 256", "p", "top 3 by AUROC"], rows, "lrrrl"))
    a = per[LONG]["avokv_e"] - per[LONG]["avokv_e_no_delay"] if "avokv_e_no_delay" in rules else None
    if a is not None:
        text.append("")
        for h in (SHORT, LONG):
            t = sign_test(per[h]["avokv_e"] - per[h]["avokv_e_no_delay"])
            text.append(f"- AvoKV-E against its no-delay variant, per-checkpoint AUROC at H = {h}: higher at "
                        f"{t.above} of {t.n} checkpoints, lower at {t.below}, p = {format_p(t.p)} (exact sign test).")
    return text


def damage_section(dec: pl.DataFrame, boot: PromptBootstrap) -> list[str]:
    ok = dec.filter(pl.col("status") == "ok")
    names = sorted(ok["decision"].unique().to_list())
    text = ["## (c) Each rule's joint damage by horizon\n",
            "The exact KL of each decision's whole evicted set (per-head selection), the mean over the checkpoints "
            "where the rule fits the budget (n); every H from the same teacher-forced rows of the run at H = 256. "
            "Rows by damage at 256 (lowest first); 95% cluster-bootstrap CIs.\n"]
    for budget in KEEPS:
        b = ok.filter(pl.col("budget") == budget)
        mean = {h: {} for h in HORIZONS}
        rows = []
        over = [r for r in names if b.filter(pl.col("decision") == r).height == 0]
        for r in [r for r in names if r not in over]:
            d = b.filter(pl.col("decision") == r)
            for h in HORIZONS:
                mean[h][r] = float(d[f"kl_{h}"].mean())
            v, reps = boot.mean(d[f"kl_{LONG}"].to_numpy(), d["prompt_id"].to_numpy())
            v16, reps16 = boot.mean(d[f"kl_{SHORT}"].to_numpy(), d["prompt_id"].to_numpy())
            rows.append((mean[LONG][r], [r, f"{d.height}", *[number_text(mean[h][r], 3) for h in HORIZONS],
                                         ci_text(v16, *boot.ci(reps16)), ci_text(v, *boot.ci(reps))]))
        full = [r for r in names if b.filter(pl.col("decision") == r).height == b["prompt_id"].n_unique()]
        text.append(f"### {budget}\n")
        if over:
            text.append(f"Over the budget at every checkpoint (they protect more entries than it keeps): "
                        f"{', '.join(over)}.\n")
        text.append(md_table(["decision", "n", *[f"H = {h}" for h in HORIZONS], "H = 16 [95% CI]",
                              "H = 256 [95% CI]"], [r for _, r in sorted(rows, key=lambda x: x[0])],
                             "lr" + "r" * (len(HORIZONS) + 2)))
        taus = []
        for h in HORIZONS[:-1]:
            t = order_tau(mean, full, h, False)
            taus.append(f"H = {h}: tau {number_text(t['tau'], 3)} (p = {format_p(t['p_value'])})")
        best = {h: min(full, key=lambda r: mean[h][r]) for h in HORIZONS}
        text.append(f"\nOrder against H = 256, Kendall's tau over the {len(full)} decisions defined at every "
                    f"checkpoint (exact p): {'; '.join(taus)}. Lowest damage: "
                    f"{', '.join(f'{h}: {best[h]}' for h in HORIZONS)}.\n")
    return text


def avokv_section(dec: pl.DataFrame, boot: PromptBootstrap) -> list[str]:
    """AvoKV-E against its no-delay and no-payload variants, per budget and horizon: the per-checkpoint ratio of
    joint damage (geometric mean [CI], median, checkpoints where AvoKV-E is lower) and the exact sign test."""
    ok = dec.filter(pl.col("status") == "ok")
    rows = []
    for other in ("avokv_e_no_delay", "avokv_e_no_payload"):
        for budget in KEEPS:
            a = ok.filter((pl.col("decision") == "avokv_e") & (pl.col("budget") == budget))
            b = ok.filter((pl.col("decision") == other) & (pl.col("budget") == budget))
            j = a.join(b, on=["prompt_id", "checkpoint"], suffix="_o").sort("prompt_id")
            if j.height == 0:
                continue
            for h in HORIZONS:
                c = compare(boot, j[f"kl_{h}"].to_numpy(), j[f"kl_{h}_o"].to_numpy(), j["prompt_id"].to_numpy())
                rt, t = c["ratios"], c["test"]
                rows.append([other, budget, f"H = {h}", f"{t.n}", ci_text(rt["geomean"], *rt["geomean_ci"]),
                             number_text(rt["median"], 3), f"{rt['below']} of {rt['n']}", format_p(t.p)])
    return ["## (c) Does AvoKV-E's delay buffer gain at long horizons?\n",
            "AvoKV-E's joint damage over its variant's at the same checkpoint: the geometric mean of the "
            "per-checkpoint ratios [95% cluster-bootstrap CI], their median, the checkpoints where AvoKV-E's damage is "
            "lower, and the exact two-sided sign test of the paired differences.\n",
            md_table(["against", "budget", "horizon", "n", "damage ratio, geo-mean [95% CI]", "median ratio",
                      "AvoKV-E lower", "sign p"], rows, "lllrrrrr")]


def consistency_section(lab: pl.DataFrame, dec: pl.DataFrame) -> list[str]:
    """The derived H = 8 joint damage against reports/decisions-math500's run at H = 8 (the same checkpoints: the
    same first 520 tokens), where both graded the same decision."""
    if not DECISIONS_H8.is_file():
        return []
    old = (read_table(DECISIONS_H8)[0].filter(pl.col("sample").is_null() & (pl.col("status") == "ok"))
           .select("prompt_id", "checkpoint", "decision", "budget", kl8_old="kl_mean"))
    # future_attention reads the next H queries: a different set at H = 8 and at 256
    j = (dec.filter((pl.col("status") == "ok") & (pl.col("decision") != "future_attention"))
         .join(old, on=["prompt_id", "checkpoint", "decision", "budget"]))
    if j.height == 0:
        return []
    rel = ((j["kl_8"] - j["kl8_old"]).abs() / j["kl8_old"].abs()).to_numpy()
    return ["## Consistency with reports/decisions-math500\n",
            f"The joint damage at H = 8 derived here (the first 8 steps of the H = 256 rows) against the "
            f"decisions-math500 run at H = 8 of the same rules' decisions at the same checkpoints: {j.height} rows "
            f"({j['decision'].n_unique()} decisions), largest relative difference {rel.max():.2g}, median "
            f"{np.median(rel):.2g} (different batch and chunk shapes: float32 rounding).\n"]


FIGURE_RULES = ("cake", "snapkv", "rkv", "avokv_e", "avokv_e_no_delay", "vase", "knorm")


def figure(lab: pl.DataFrame, scores: pl.DataFrame, dec: pl.DataFrame, boot: PromptBootstrap, out: Path) -> None:
    """horizons.png/pdf: Spearman with H = 256 [CI], pooled AUROC and mean joint damage at keep 0.25, against H."""
    from kvdiag.plotting import new_figure, save_figure, style

    j = lab.join(scores, on=["prompt_id", "checkpoint", "position"])
    with style():
        fig, (a, b, c) = new_figure(3, 12, 3.4)
        rho = [spearman_ci(boot, lab[f"kl_{h}"].to_numpy(), lab[f"kl_{LONG}"].to_numpy(), lab["prompt_id"].to_numpy())
               for h in HORIZONS]
        a.errorbar(HORIZONS, [r["spearman"] for r in rho], capsize=3,
                   yerr=[[r["spearman"] - r["ci_low"] for r in rho], [r["ci_high"] - r["spearman"] for r in rho]])
        a.set(xscale="log", xlabel="horizon H (tokens)", ylabel="Spearman with H = 256", title="single-entry labels")
        ok = dec.filter((pl.col("status") == "ok") & (pl.col("budget") == "keep:0.25"))
        for r in FIGURE_RULES:
            b.plot(HORIZONS, [auroc(j[f"harm_{h}"].to_numpy().astype(int), j[r].to_numpy()) for h in HORIZONS],
                   marker="o", label=r)
            c.plot(HORIZONS, [ok.filter(pl.col("decision") == r)[f"kl_{h}"].mean() for h in HORIZONS], marker="o",
                   label=r)
        b.set(xscale="log", xlabel="horizon H (tokens)", ylabel="AUROC (harmful at H)", title="rules' AUROC")
        c.set(xscale="log", yscale="log", xlabel="horizon H (tokens)", ylabel="joint damage (nats per step)",
              title="decisions at keep 0.25")
        c.legend(fontsize=6)
        save_figure(fig, out, "horizons")


def main(inputs: Path = INPUTS, out: Path = OUT) -> None:
    lab, thr = harmful(read_table(inputs / "labels.parquet")[0])
    scores = read_table(inputs / "token_scores.parquet")[0]
    dec = read_table(inputs / "decisions.parquet")[0]
    kept = read_table(inputs / "kept.parquet")[0]
    boot = PromptBootstrap(lab["prompt_id"].unique().to_list(), N_BOOT, SEED, LEVEL)
    rules = sorted(dec.filter(pl.col("kind") == "rule")["decision"].unique().to_list())
    token_rules = [c for c in scores.columns if c not in ("prompt_id", "checkpoint", "position")]
    n_ckpt = lab.select("prompt_id", "checkpoint").n_unique()
    below = int((lab[f"kl_{LONG}"] <= lab["noise_floor"]).sum())
    text = ["# Labels over the rest of the reasoning: the horizon study (SmolLM2-135M, MATH-500)\n",
            f"{n_ckpt} checkpoints (one per problem, after 512 generated tokens), {lab.height:,} sampled entries "
            f"labeled exactly at H = {LONG} (horizons {', '.join(map(str, HORIZONS))} derived from the same rows' "
            f"per-step KL). Harmful at H: above the 0.9 quantile of the sampled labels at H; every label analysed "
            f"({below} are at or below the noise floor of the H = {LONG} run). CIs: {N_BOOT} cluster-bootstrap "
            f"resamples over the {n_ckpt} checkpoints (seed {SEED}).\n"]
    text += spearman_section(lab, boot, thr) + [""]
    text += delayed_section(lab, kept, boot, [*rules, "random_reference", "future_attention"]) + [""]
    text += auroc_section(lab, scores, boot, token_rules) + [""]
    text += damage_section(dec, boot)
    text += avokv_section(dec, boot) + [""]
    text += consistency_section(lab, dec)
    text += ["## The dependency suites\n",
             "The share of the tokens a dependency-suite task needs that are labeled harmful at H = 16 and at `rest` "
             "waits for the suites of issue #43 (not landed).\n"]
    text.append("![Spearman, AUROC and joint damage by horizon](horizons.png)\n")
    (out / "report.md").write_text("\n".join(text))
    figure(lab, scores, dec, boot, out)


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:3]))
