"""The horizon study from its committed inputs (inputs.py made them from reproduce.sh's runs, one folder per model):
how labels, delayed harm, the rules' AUROC and their joint damage change with the horizon H, each at H = 8 ... 256
derived from the same rows' per-step KL. Every table has a model column; the figure one row of panels per model.
Run from the repository root; writes reports/horizon-math500/report.md.

Statistics through kvdiag.core.stats, per model: cluster-bootstrap CIs over prompts (one checkpoint each, so over
checkpoints: 10 for SmolLM2, 5 for gemma3), exact sign tests for paired comparisons (below 30 clusters), per-cluster
ratio summaries, Kendall's tau with its exact p between orders of rules.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.harm import HarmSpec
from kvdiag.core.io import read_table
from kvdiag.core.stats import PromptBootstrap, compare, format_p, kendall, sign_test, spearman_ci
from kvdiag.core.tables import ci_text, md_table, number_text
from kvdiag.rankeval.metrics import auroc

INPUTS = Path("reports/horizon-math500/inputs")
OUT = Path("reports/horizon-math500")
MODELS = {"smollm2": "SmolLM2-135M", "gemma3": "gemma3-270m"}  # inputs/<name>/, in the tables' order
# the same checkpoints at H = 8 (the same first 520 tokens of each trace)
DECISIONS_H8 = Path("reports/decisions-math500")
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


class Model:
    """One model's committed inputs (``name``: the inputs folder and the tables' model column), its labels with
    ``harm_H`` and thresholds per H, and its bootstrap over checkpoints. (A plain class: tests/test_reports.py loads
    this script outside sys.modules, where a dataclass cannot resolve its module.)"""

    def __init__(self, name: str, lab: pl.DataFrame, thr: dict[int, float], scores: pl.DataFrame,
                 dec: pl.DataFrame, kept: pl.DataFrame, boot: PromptBootstrap):
        self.name, self.lab, self.thr, self.scores, self.dec, self.kept, self.boot = (name, lab, thr, scores, dec,
                                                                                      kept, boot)

    @property
    def rules(self) -> list[str]:
        return sorted(self.dec.filter(pl.col("kind") == "rule")["decision"].unique().to_list())

    @property
    def token_rules(self) -> list[str]:
        return [c for c in self.scores.columns if c not in ("prompt_id", "checkpoint", "position")]

    @property
    def checkpoints(self) -> int:
        return self.lab.select("prompt_id", "checkpoint").n_unique()


def load(inputs: Path, name: str) -> Model:
    d = inputs / name
    lab, thr = harmful(read_table(d / "labels.parquet")[0])
    return Model(name, lab, thr, read_table(d / "token_scores.parquet")[0], read_table(d / "decisions.parquet")[0],
                 read_table(d / "kept.parquet")[0], PromptBootstrap(lab["prompt_id"].unique().to_list(), N_BOOT, SEED,
                                                                    LEVEL))


# --------------------------------------------------------------------------- sections


def spearman_section(models: list[Model]) -> list[str]:
    rows = []
    for m in models:
        lab, boot = m.lab, m.boot
        prompts = lab["prompt_id"].to_numpy()
        long = lab[f"kl_{LONG}"].to_numpy()
        for h in HORIZONS:
            s = spearman_ci(boot, lab[f"kl_{h}"].to_numpy(), long, prompts)
            both = lab.filter(pl.col(f"harm_{LONG}"))
            share, reps = boot.mean(both[f"harm_{h}"].cast(pl.Float64).to_numpy(), both["prompt_id"].to_numpy())
            rows.append([m.name, f"H = {h}", f"{s['n']:,}", ci_text(s["spearman"], s["ci_low"], s["ci_high"]),
                         number_text(m.thr[h], 3), ci_text(share, *boot.ci(reps)),
                         number_text(float(lab[f"kl_{h}"].median()), 3)])
    return ["## (a) Labels at H against labels at H = 256\n",
            md_table(["model", "horizon", "entries", "Spearman with H = 256 [95% CI]", "harm threshold (nats)",
                      "harmful at 256 also harmful at H [95% CI]", "median label (nats)"], rows, "llrrrrr")]


def delayed_section(models: list[Model]) -> list[str]:
    text = ["## (b) Delayed harm: harmless at H = 16, harmful at H = 256\n"]
    where_rows, keep_rows = [], []
    for m in models:
        boot = m.boot
        lab = m.lab.with_columns(
            delayed=pl.col(f"harm_{LONG}") & ~pl.col(f"harm_{SHORT}"),
            transient=pl.col(f"harm_{SHORT}") & ~pl.col(f"harm_{LONG}"),
            where=pl.when(pl.col("position") < pl.col("prompt_len")).then(pl.lit("prompt"))
            .otherwise(pl.lit("generated")),
            kind=pl.col("token_text").map_elements(token_kind, return_dtype=pl.String),
            age_bin=pl.coalesce([pl.when(pl.col("age").is_between(a, b)).then(pl.lit(name))
                                 for name, a, b in AGE_BINS]))
        n, n_long = lab.height, int(lab[f"harm_{LONG}"].sum())
        n_delayed, n_transient = int(lab["delayed"].sum()), int(lab["transient"].sum())
        per = lab.group_by("prompt_id").agg(pl.col("delayed").sum()).sort("prompt_id")
        text.append(
            f"- **{m.name}**: of {n:,} sampled entries, {n_long:,} are harmful at H = {LONG}; {n_delayed:,} of them "
            f"({n_delayed / max(n_long, 1):.0%}) are not harmful at H = {SHORT} (delayed harm), at "
            f"{int((per['delayed'] > 0).sum())} of {per.height} checkpoints (per checkpoint: "
            f"{', '.join(map(str, per['delayed'].to_list()))}). The other way, {n_transient:,} entries harmful at "
            f"H = {SHORT} are not at H = {LONG}. Medians: age "
            f"{number_text(float(lab.filter('delayed')['age'].median()), 3)} tokens for the delayed entries, "
            f"{number_text(float(lab['age'].median()), 3)} for all sampled ones; "
            f"their label at H = {SHORT} {number_text(float(lab.filter('delayed')[f'kl_{SHORT}'].median()), 3)} "
            f"nats and at H = {LONG} {number_text(float(lab.filter('delayed')[f'kl_{LONG}'].median()), 3)}.")
        for col, title in (("where", "prompt or generated"), ("kind", "token kind"), ("age_bin", "age (tokens)")):
            for g in sorted(lab[col].cast(pl.String).unique().to_list()):
                part = lab.filter((pl.col(col).cast(pl.String) == g) & pl.col(f"harm_{LONG}"))
                share, reps = boot.mean(part["delayed"].cast(pl.Float64).to_numpy(), part["prompt_id"].to_numpy())
                n_g = lab.filter(pl.col(col).cast(pl.String) == g).height
                where_rows.append([m.name, title, g, f"{n_g:,}", f"{part.height:,}", f"{int(part['delayed'].sum()):,}",
                                   ci_text(share, *boot.ci(reps)) if part.height else "n/a"])
        flags = lab.select("prompt_id", "checkpoint", "position", "delayed", f"harm_{LONG}")
        k = m.kept.join(flags, on=["prompt_id", "checkpoint", "position"])
        for rule in [*m.rules, "random_reference", "future_attention"]:
            cells = [m.name, rule]
            for budget in KEEPS[:2]:
                kb = k.filter((pl.col("decision") == rule) & (pl.col("budget") == budget))
                if kb.height == 0:
                    cells += ["over budget", "", ""]
                    continue
                d = kb.filter("delayed")
                share, reps = boot.mean(d["kept_share"].to_numpy(), d["prompt_id"].to_numpy())
                cells += [ci_text(share, *boot.ci(reps), digits=2) if d.height else "n/a",
                          number_text(float(kb.filter(f"harm_{LONG}")["kept_share"].mean()), 2),
                          number_text(float(kb["kept_share"].mean()), 2)]
            keep_rows.append(cells)
    text.append("\nWhere they are: per group, the sampled entries, those harmful at 256, and the share of them that "
                "is delayed (95% cluster-bootstrap CI over checkpoints).\n")
    text.append(md_table(["model", "by", "group", "entries", "harmful at 256", "delayed", "delayed share [95% CI]"],
                         where_rows, "lllrrrr"))
    text.append("\nWhich rules keep them: the share of the (layer, KV head) cells that keep an entry, averaged over "
                "the delayed entries, over every entry harmful at 256, and over all sampled entries (per-head "
                "selection as in decisions; 95% CI over checkpoints for the delayed ones).\n")
    text.append(md_table(["model", "rule", "0.5: delayed", "0.5: harmful at 256", "0.5: all", "0.25: delayed",
                          "0.25: harmful at 256", "0.25: all"], keep_rows, "llrrrrrr"))
    return text


def auroc_section(models: list[Model]) -> list[str]:
    rows, tau_rows, avokv = [], [], []
    described = []
    for m in models:
        boot, rules = m.boot, m.token_rules
        j = m.lab.join(m.scores, on=["prompt_id", "checkpoint", "position"]).sort("prompt_id", "checkpoint",
                                                                                   "position")
        prompts = j["prompt_id"].to_numpy()
        w = boot.mult[:, [boot.index[p] for p in prompts]].T  # [N, B] prompt multiplicities
        ids = sorted(set(prompts))
        described.append(f"{m.name} {j.height:,} entries at {len(ids)} checkpoints")
        value, cis, per = {}, {}, {}
        for h in HORIZONS:
            y = j[f"harm_{h}"].to_numpy().astype(int)
            value[h], cis[h], per[h] = {}, {}, {}
            for r in rules:
                s = j[r].to_numpy().astype(float)
                value[h][r] = auroc(y, s)
                cis[h][r] = boot.ci(auroc(y, s, w))
                per[h][r] = np.array([auroc(y[prompts == p], s[prompts == p]) for p in ids])
        for r in sorted(rules, key=lambda r: -value[LONG][r]):
            test = sign_test(per[LONG][r] - per[SHORT][r])
            rows.append([m.name, r, *[number_text(value[h][r], 3) for h in HORIZONS],
                         ci_text(value[SHORT][r], *cis[SHORT][r]), ci_text(value[LONG][r], *cis[LONG][r]),
                         f"{test.above} of {test.n}", format_p(test.p)])
        for h in HORIZONS[:-1]:
            t = order_tau(value, rules, h, True)
            top = sorted(rules, key=lambda r: -value[h][r])[:3]
            tau_rows.append([m.name, f"H = {h}", f"{t['n']}", number_text(t["tau"], 3), format_p(t["p_value"]),
                             ", ".join(top)])
        tau_rows.append([m.name, f"H = {LONG}", f"{len(rules)}", "1", "",
                         ", ".join(sorted(rules, key=lambda r: -value[LONG][r])[:3])])
        if "avokv_e_no_delay" in rules:
            for h in (SHORT, LONG):
                t = sign_test(per[h]["avokv_e"] - per[h]["avokv_e_no_delay"])
                avokv.append(f"- {m.name}: AvoKV-E against its no-delay variant, per-checkpoint AUROC at H = {h}: "
                             f"higher at {t.above} of {t.n} checkpoints, lower at {t.below}, p = {format_p(t.p)} "
                             "(exact sign test).")
    text = ["## (c) Each rule's AUROC by horizon\n",
            f"Pooled AUROC of the token score against harmful at H (above the 0.9 quantile of the sampled labels at "
            f"H), {'; '.join(described)}, 95% cluster-bootstrap CIs; the last columns: the checkpoints where the "
            f"rule's AUROC is higher at H = {LONG} than at H = {SHORT} (n: those with harmful and harmless entries at "
            "both), and the exact sign test's two-sided p. Rows by AUROC at 256 per model.\n",
            md_table(["model", "rule", *[f"H = {h}" for h in HORIZONS], "H = 16 [95% CI]", "H = 256 [95% CI]",
                      "higher at 256", "sign p"], rows, "ll" + "r" * (len(HORIZONS) + 4))]
    text.append("\nThe order of the rules by AUROC at H against the order at 256 (Kendall's tau over the rules, "
                "its exact p of no association; n: the rules):\n")
    text.append(md_table(["model", "horizon", "rules", "Kendall tau with 256", "p", "top 3 by AUROC"], tau_rows,
                         "llrrrl"))
    if avokv:
        text += [""] + avokv
    return text


def damage_section(models: list[Model]) -> list[str]:
    text = ["## (c) Each rule's joint damage by horizon\n",
            "The exact KL of each decision's whole evicted set (per-head selection), the mean over the checkpoints "
            "where the rule fits the budget (n); every H from the same teacher-forced rows of the run at H = 256. "
            "Rows by damage at 256 (lowest first) per model; 95% cluster-bootstrap CIs.\n"]
    for budget in KEEPS:
        rows, notes = [], []
        for m in models:
            ok = m.dec.filter(pl.col("status") == "ok")
            names = sorted(ok["decision"].unique().to_list())
            b = ok.filter(pl.col("budget") == budget)
            mean = {h: {} for h in HORIZONS}
            model_rows = []
            over = [r for r in names if b.filter(pl.col("decision") == r).height == 0]
            for r in [r for r in names if r not in over]:
                d = b.filter(pl.col("decision") == r)
                for h in HORIZONS:
                    mean[h][r] = float(d[f"kl_{h}"].mean())
                v, reps = m.boot.mean(d[f"kl_{LONG}"].to_numpy(), d["prompt_id"].to_numpy())
                v16, reps16 = m.boot.mean(d[f"kl_{SHORT}"].to_numpy(), d["prompt_id"].to_numpy())
                model_rows.append((mean[LONG][r], [m.name, r, f"{d.height}",
                                                   *[number_text(mean[h][r], 3) for h in HORIZONS],
                                                   ci_text(v16, *m.boot.ci(reps16)), ci_text(v, *m.boot.ci(reps))]))
            rows += [r for _, r in sorted(model_rows, key=lambda x: x[0])]
            full = [r for r in names if b.filter(pl.col("decision") == r).height == b["prompt_id"].n_unique()]
            if over:
                notes.append(f"{m.name}: over the budget at every checkpoint (they protect more entries than it "
                             f"keeps): {', '.join(over)}.")
            taus = []
            for h in HORIZONS[:-1]:
                t = order_tau(mean, full, h, False)
                taus.append(f"H = {h}: tau {number_text(t['tau'], 3)} (p = {format_p(t['p_value'])})")
            best = {h: min(full, key=lambda r: mean[h][r]) for h in HORIZONS}
            notes.append(f"{m.name}: order against H = 256, Kendall's tau over the {len(full)} decisions defined at "
                         f"every checkpoint (exact p): {'; '.join(taus)}. Lowest damage: "
                         f"{', '.join(f'{h}: {best[h]}' for h in HORIZONS)}.")
        text.append(f"### {budget}\n")
        text.append(md_table(["model", "decision", "n", *[f"H = {h}" for h in HORIZONS], "H = 16 [95% CI]",
                              "H = 256 [95% CI]"], rows, "llr" + "r" * (len(HORIZONS) + 2)))
        text.append("\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    return text


def avokv_section(models: list[Model]) -> list[str]:
    """AvoKV-E against its no-delay and no-payload variants, per model, budget and horizon: the per-checkpoint ratio
    of joint damage (geometric mean [CI], median, checkpoints where AvoKV-E is lower) and the exact sign test."""
    rows = []
    for m in models:
        ok = m.dec.filter(pl.col("status") == "ok")
        for other in ("avokv_e_no_delay", "avokv_e_no_payload"):
            for budget in KEEPS:
                a = ok.filter((pl.col("decision") == "avokv_e") & (pl.col("budget") == budget))
                b = ok.filter((pl.col("decision") == other) & (pl.col("budget") == budget))
                j = a.join(b, on=["prompt_id", "checkpoint"], suffix="_o").sort("prompt_id")
                if j.height == 0:
                    continue
                for h in HORIZONS:
                    c = compare(m.boot, j[f"kl_{h}"].to_numpy(), j[f"kl_{h}_o"].to_numpy(), j["prompt_id"].to_numpy())
                    rt, t = c["ratios"], c["test"]
                    rows.append([m.name, other, budget, f"H = {h}", f"{t.n}",
                                 ci_text(rt["geomean"], *rt["geomean_ci"]), number_text(rt["median"], 3),
                                 f"{rt['below']} of {rt['n']}", format_p(t.p)])
    return ["## (c) Does AvoKV-E's delay buffer gain at long horizons?\n",
            "AvoKV-E's joint damage over its variant's at the same checkpoint: the geometric mean of the "
            "per-checkpoint ratios [95% cluster-bootstrap CI], their median, the checkpoints where AvoKV-E's damage is "
            "lower, and the exact two-sided sign test of the paired differences (n: checkpoints).\n",
            md_table(["model", "against", "budget", "horizon", "n", "damage ratio, geo-mean [95% CI]",
                      "median ratio", "AvoKV-E lower", "sign p"], rows, "llllrrrrr")]


def consistency_section(models: list[Model]) -> list[str]:
    """The derived H = 8 joint damage against reports/decisions-math500's run at H = 8 (the same checkpoints: the
    same first 520 tokens), where both graded the same decision."""
    lines = []
    for m in models:
        path = DECISIONS_H8 / m.name / "decisions.parquet"
        if not path.is_file():
            continue
        old = (read_table(path)[0].filter(pl.col("sample").is_null() & (pl.col("status") == "ok"))
               .select("prompt_id", "checkpoint", "decision", "budget", kl8_old="kl_mean"))
        # future_attention reads the next H queries: a different set at H = 8 and at 256
        j = (m.dec.filter((pl.col("status") == "ok") & (pl.col("decision") != "future_attention"))
             .join(old, on=["prompt_id", "checkpoint", "decision", "budget"]))
        if j.height == 0:
            lines.append(f"- {m.name}: no decision in common.")
            continue
        rel = ((j["kl_8"] - j["kl8_old"]).abs() / j["kl8_old"].abs()).to_numpy()
        lines.append(f"- {m.name}: {j.height} rows ({j['decision'].n_unique()} decisions), largest relative "
                     f"difference {rel.max():.2g}, median {np.median(rel):.2g}.")
    if not lines:
        return []
    return ["## Consistency with reports/decisions-math500\n",
            "The joint damage at H = 8 derived here (the first 8 steps of the H = 256 rows) against the "
            "decisions-math500 run at H = 8 of the same rules' decisions at the same checkpoints (different batch "
            "and chunk shapes: float32 rounding):\n", *lines, ""]


FIGURE_RULES = ("cake", "snapkv", "rkv", "avokv_e", "avokv_e_no_delay", "vase", "knorm")


def figure(models: list[Model], out: Path) -> None:
    """horizons.png/pdf, one row per model: Spearman with H = 256 [CI], pooled AUROC and mean joint damage at keep
    0.25, against H."""
    from matplotlib.figure import Figure

    from kvdiag.core.plotting import save_figure, style

    with style():
        fig = Figure(figsize=(12, 3.4 * len(models)), layout="constrained")
        grid = fig.subplots(len(models), 3, squeeze=False)
        for m, (a, b, c) in zip(models, grid, strict=True):
            lab = m.lab
            j = lab.join(m.scores, on=["prompt_id", "checkpoint", "position"])
            rho = [spearman_ci(m.boot, lab[f"kl_{h}"].to_numpy(), lab[f"kl_{LONG}"].to_numpy(),
                               lab["prompt_id"].to_numpy()) for h in HORIZONS]
            a.errorbar(HORIZONS, [r["spearman"] for r in rho], capsize=3,
                       yerr=[[r["spearman"] - r["ci_low"] for r in rho], [r["ci_high"] - r["spearman"] for r in rho]])
            a.set(xscale="log", xlabel="horizon H (tokens)", ylabel="Spearman with H = 256",
                  title=f"{MODELS[m.name]}: single-entry labels")
            ok = m.dec.filter((pl.col("status") == "ok") & (pl.col("budget") == "keep:0.25"))
            for r in FIGURE_RULES:
                b.plot(HORIZONS, [auroc(j[f"harm_{h}"].to_numpy().astype(int), j[r].to_numpy()) for h in HORIZONS],
                       marker="o", label=r)
                c.plot(HORIZONS, [ok.filter(pl.col("decision") == r)[f"kl_{h}"].mean() for h in HORIZONS],
                       marker="o", label=r)
            b.set(xscale="log", xlabel="horizon H (tokens)", ylabel="AUROC (harmful at H)",
                  title=f"{MODELS[m.name]}: rules' AUROC")
            c.set(xscale="log", yscale="log", xlabel="horizon H (tokens)", ylabel="joint damage (nats per step)",
                  title=f"{MODELS[m.name]}: decisions at keep 0.25")
            c.legend(fontsize=6)
        save_figure(fig, out, "horizons")


def main(inputs: Path = INPUTS, out: Path = OUT) -> None:
    models = [load(inputs, name) for name in MODELS if (inputs / name).is_dir()]
    setup = []
    for m in models:
        below = int((m.lab[f"kl_{LONG}"] <= m.lab["noise_floor"]).sum())
        setup.append(f"- {MODELS[m.name]} (`{m.name}`): {m.checkpoints} checkpoints (one per problem, after 512 "
                     f"generated tokens), {m.lab.height:,} sampled entries labeled exactly at H = {LONG} ({below} at "
                     f"or below the noise floor of the H = {LONG} run); CIs: {N_BOOT} cluster-bootstrap resamples "
                     f"over its {m.checkpoints} checkpoints (seed {SEED}).")
    text = ["# Labels over the rest of the reasoning: the horizon study (MATH-500)\n",
            f"Horizons {', '.join(map(str, HORIZONS))} derived from the same rows' per-step KL. Harmful at H: above "
            "the 0.9 quantile of one model's sampled labels at H; every label analysed. Each model's statistics "
            "are over its own checkpoints (clusters); below 30 clusters the paired tests are exact sign tests.\n",
            *setup, ""]
    text += spearman_section(models) + [""]
    text += delayed_section(models) + [""]
    text += auroc_section(models) + [""]
    text += damage_section(models)
    text += avokv_section(models) + [""]
    text += consistency_section(models)
    text += ["## The dependency suites\n",
             "The share of the tokens a dependency-suite task needs that are labeled harmful at H = 16 and at `rest` "
             "waits for the suites of issue #43 (not landed).\n"]
    text.append("![Spearman, AUROC and joint damage by horizon](horizons.png)\n")
    (out / "report.md").write_text("\n".join(text))
    figure(models, out)


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:3]))
