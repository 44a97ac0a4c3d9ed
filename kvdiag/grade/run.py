"""``kvdiag grade RULE.py|NAME``: one command grades a rule against a fixed, versioned benchmark
(``kvdiag.grade.benchmark``)
and prints its leaderboard row; ``--all`` grades every built-in rule and the gradable kvpress presses and writes the
leaderboard.

A row holds, on the benchmark's Trace (q/k/v rebuilt from the embedded model, its weights hash checked):

- how the rule **ranks** single-entry damage: rank-eval's AUROC, AP, top-k recall, false-safe rate and Spearman
  against the exact labels of every entry, pooled, with cluster-bootstrap CIs over prompts;
- how good its **decisions** are: at each budget of the benchmark, the exact joint damage of the set it evicts
  (``kvdiag.decisions``, per (layer, KV head) selection), its mean with a CI, the regret against ``oracle_greedy``
  (ratio of means, CI), its place among the built-in rules and a paired test against the best of them.

Where the time goes is printed (rebuild + scoring, rank-eval, decisions' set rows).

``horizon`` (``--horizon N|rest``) grades at another horizon than the benchmark's: the decisions' sets are labeled
over N steps (or to the end of each prompt), and the single labels the ranking half needs are the sealed labels'
first N steps of ``kl_steps`` (``kvdiag.label.horizons``: the same teacher-forced continuation) where the benchmark
labeled that far, else labeled exactly at N (every entry of each checkpoint, ``kvdiag.label``). A fixed N that reaches
past the end of a prompt's trace is refused before the model loads. The sealed references and built-in rows measure
the benchmark's horizon, so at another one a row has no regret against ``oracle_greedy``, no place and no paired test
(it says so), and ``--all`` never stores its rows in the benchmark.

The rebuilt q/k/v are the same for every rule, so they are cached (:func:`qkv_cache`) under kvdiag's user cache
(``$KVDIAG_CACHE``), content-addressed by the benchmark's MANIFEST.json, the model and the storage format: a second
grade skips the prefill and reads the same tensors bitwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.errors import UserError
from kvdiag.core.io import read_json, read_table, write_csv, write_json, write_table, write_text
from kvdiag.core.parsing import REST, horizon_steps
from kvdiag.core.schema import KEYS
from kvdiag.core.tables import ci_text, md_table, number_text
from kvdiag.grade import benchmark as bench_mod
from kvdiag.scorers.names import check_rule_source, is_plugin_spec

RANK_METRICS = ("auroc", "ap", "topk_recall", "fsr", "spearman")


def resolve_rules(spec: str | None, rule: str | None, params: dict[str, dict], everything: bool = False) -> dict:
    """name -> Scorer instance: the rule a plugin file (``.py``) or module registers (``rule`` when it registers
    several), or the registered ``spec``; with ``everything``, every built-in rule that runs without a setting and
    every gradable kvpress press. Bad input is one ``UserError`` line."""
    check_rule_source(spec, rule, everything)
    from kvdiag.scorers import SCORERS, get_scorer, load_plugin_rules

    if everything:
        names = [n for n, cls in SCORERS.items() if ":" not in n and cls.in_all]
        try:
            names += SCORERS.expand(["kvpress:all"])
        except UserError:  # kvpress not installed: the built-ins only
            pass
    elif spec is not None and is_plugin_spec(spec):
        found = load_plugin_rules(spec)
        if not found:
            raise UserError(f"{spec} registers no rule: decorate a Scorer dataclass with @register_scorer(\"name\")")
        if rule is None and len(found) > 1:
            raise UserError(f"{spec} registers several rules ({', '.join(found)}): choose one with --rule")
        if rule is not None and rule not in found:
            raise UserError(f"--rule {rule}: {spec} registers {', '.join(found)}")
        names = [rule or found[0]]
    elif spec is not None:
        SCORERS.resolve(spec)
        names = [spec]
    else:
        raise UserError("pass a rule (a .py file, a module or a registered name) or --all")
    stray = [n for n in params if n not in names]
    if stray:
        raise UserError(f"--param {stray[0]}.…: {stray[0]} is not the rule graded ({', '.join(names)})")
    return {n: get_scorer(n, **params.get(n, {})) for n in names}


def _token_scores(head: pl.DataFrame, rules: list[str]) -> pl.DataFrame:
    """Token rows: the mean over layers and KV heads of the head rows (the ``mean_rank`` aggregation)."""
    token = head.group_by("prompt_id", "checkpoint", "position").agg(pl.col(r).mean() for r in rules)
    return token.with_columns(granularity=pl.lit("token"), layer=pl.lit(-1, pl.Int64),
                              kv_head=pl.lit(-1, pl.Int64)).select(*KEYS, *rules)


# --------------------------------------------------------------------------- the rule-independent cache

# bump when what an entry holds or how it is laid out changes: an old entry then has another key and is not read
QKV_CACHE_FORMAT = 1


def qkv_cache_key(bench: bench_mod.Benchmark, tr, lm) -> dict:
    """Everything the rebuilt q/k/v of ``bench``'s Trace depend on: the sealed benchmark (its MANIFEST.json's sha256
    covers every file's), the model's weights and compute dtype, the storage dtype and prefill chunking of the
    rebuild, the device and the torch and kvdiag versions (another build can round the prefill differently). The
    horizon is not in it: q/k/v are the prefill's, whatever the labels' horizon."""
    import torch

    import kvdiag

    return {"format": QKV_CACHE_FORMAT, "kvdiag": kvdiag.__version__, "torch": torch.__version__,
            "manifest_sha256": bench_mod.sha256(bench.file("MANIFEST.json")),
            "weights_hash": lm.info["weights_hash"], "model_dtype": str(lm.dtype), "device": str(lm.device),
            "storage_dtype": str(tr.storage_dtype), "rebuild_chunk": int(tr.rebuild_chunk),
            "trace_fingerprint": tr.fingerprint}


def qkv_cache_dir(bench: bench_mod.Benchmark, key: dict) -> Path:
    """The entry of ``key``: ``CACHE/grade/NAME@VERSION/<sha256 of the key>`` (one folder per benchmark version)."""
    from kvdiag.model.embedded import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    m = bench.manifest
    return cache_dir() / "grade" / f"{m['name']}@{m['version']}" / digest


ENTRY = "entry.json"


def _read_entry(path: Path, key: dict) -> dict | None:
    """pid -> file of a complete entry whose key is ``key`` and whose every file matches the sha256 its entry.json
    records; None when there is none or it fails a check (a flipped byte, a truncated file)."""
    try:
        entry = json.loads((path / ENTRY).read_text())
        if entry.get("key") != key:
            return None
        files = entry["prompts"]
        for f in files.values():
            if bench_mod.sha256(path / f["file"]) != f["sha256"]:
                return None
        return {pid: path / f["file"] for pid, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _build_entry(path: Path, key: dict, tr, lm, show_progress: bool) -> None:
    """Rebuild every prompt's q/k/v (one prefill each) into a temporary folder beside ``path``, then rename it to
    ``path`` in one step: a concurrent grade sees no entry or a whole one, never half."""
    from safetensors.torch import save_file

    from kvdiag.core.progress import progress_bar
    from kvdiag.trace.reader import rebuild_layers

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        prompts = {}
        with progress_bar(show_progress) as bar:
            task = bar.add_task("rebuild q/k/v (cached for the next grade)", total=len(tr.prompt_ids))
            for i, pid in enumerate(tr.prompt_ids):
                layers = rebuild_layers(lm, tr.token_ids(pid), tr.storage_dtype, tr.rebuild_chunk)
                name = f"prompt-{i:04d}.safetensors"  # by index: a prompt id need not be a file name
                save_file({f"{l}.{n}": t.contiguous() for l, qkv in enumerate(layers) for n, t in qkv.items()},
                          str(tmp / name))
                prompts[pid] = {"file": name, "sha256": bench_mod.sha256(tmp / name)}
                bar.advance(task)
        (tmp / ENTRY).write_text(json.dumps({"key": key, "prompts": prompts}, indent=1, sort_keys=True))
        try:
            os.replace(tmp, path)
        except OSError:  # another grade placed its (equal) entry first, or a bad one is in the way: try once more
            if path.exists():
                _discard(path)
            try:
                os.replace(tmp, path)
            except OSError:
                pass  # still taken: a concurrent grade wrote it; ours is removed below, theirs is checked on read
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _discard(path: Path) -> None:
    """Remove an entry that failed its checks: renamed away first, so a reader never opens it half-deleted."""
    gone = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.bad")
    try:
        os.replace(path, gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def qkv_cache(bench: bench_mod.Benchmark, tr, lm, show_progress: bool = True) -> tuple[dict[str, Path], str]:
    """pid -> the verified safetensors of its rebuilt q/k/v (``{layer}.{q|k|v}``), building the entry when it is
    missing or fails its checks (then rebuilt, never used); and what happened (hit, built, rebuilt)."""
    key = qkv_cache_key(bench, tr, lm)
    path = qkv_cache_dir(bench, key)
    found = _read_entry(path, key)
    if found is not None and set(found) == set(tr.prompt_ids):
        return found, "hit"
    how = "built"
    if path.exists():
        _discard(path)
        how = "rebuilt (the entry failed its sha256 checks)"
    _build_entry(path, key, tr, lm, show_progress)
    found = _read_entry(path, key)
    if found is None:  # placed by a concurrent grade and already broken, or an unwritable cache: cannot trust it
        raise UserError(f"the grade cache {path} could not be written and verified; set KVDIAG_CACHE to a writable "
                        "folder or pass --no-cache")
    return found, how


def cached_trace(path: Path, lm, files: dict[str, Path]):
    """A Trace whose rebuilt q/k/v come from the cache's ``files`` (pid -> safetensors) instead of a prefill."""
    from safetensors import safe_open

    from kvdiag.trace import Trace

    class CachedTrace(Trace):
        def _rebuild(self, pid: str, layer: int, names: list[str]):
            if self._rebuilt is None or self._rebuilt[0] != pid:
                self._rebuilt = None  # as Trace: one prompt's tensors held at a time
                with safe_open(str(files[pid]), framework="pt") as f:
                    layers = [{n: f.get_tensor(f"{l}.{n}") for n in "qkv"} for l in range(self.num_layers)]
                self._rebuilt = (pid, layers)
            return {name: self._rebuilt[1][layer][name] for name in names}

    return CachedTrace(path, model=lm)


# --------------------------------------------------------------------------- grading


def grade(bench: bench_mod.Benchmark, rules: dict, lm, out: Path, show_progress: bool = True,
          horizon: int | str | None = None, cache: bool = True) -> dict:
    """Grade ``rules`` on ``bench`` (at ``horizon``: :func:`horizon_plan`; None: the benchmark's); writes ``out/``
    (scores, rank-eval metrics, decisions) and returns the rows, the per-checkpoint joint damages and the timings.
    ``cache``: read the rebuilt q/k/v from :func:`qkv_cache` (built on first use) rather than a prefill per prompt."""
    from kvdiag.core.contracts import read_labels
    from kvdiag.core.harm import HarmSpec
    from kvdiag.core.stats import PromptBootstrap
    from kvdiag.decisions import DecisionsConfig, decide
    from kvdiag.scorers import checkpoint_keys, score_trace
    from kvdiag.trace import Trace

    timings: dict[str, float] = {}
    s = bench.settings
    tr = Trace(bench.file("trace"), model=lm)
    cache_note = "off"
    if cache and tr.store.get("mode") == "none":  # a Trace that stores its tensors has nothing to rebuild
        start = time.perf_counter()
        files, cache_note = qkv_cache(bench, tr, lm, show_progress)
        timings[f"q/k/v cache ({cache_note})"] = time.perf_counter() - start
        tr = cached_trace(bench.file("trace"), lm, files)
    labels, labels_meta = read_labels(bench.file("labels.parquet"), "benchmark labels")
    refs = read_table(bench.file("references.parquet"), "benchmark references")[0]
    cps = {pid: sorted(g["checkpoint"].unique().to_list()) for (pid,), g in labels.group_by("prompt_id")}
    plan = horizon_plan(bench, horizon)
    if plan is not None:  # another horizon: the single labels at it, and no sealed comparison
        start = time.perf_counter()
        labels, labels_meta = labels_at(plan, labels, labels_meta, tr, lm, out, show_progress)
        timings[f"single labels at horizon {plan['horizon']}"] = time.perf_counter() - start
        refs = None
    start = time.perf_counter()
    head, meta = score_trace(tr, keys=checkpoint_keys(tr, cps, ["head"]), scorers=rules, progress=show_progress)
    timings["rebuild + score"] = time.perf_counter() - start
    names = list(rules)
    write_table(head, out / "scores-head.parquet", meta)
    start = time.perf_counter()
    harm = s.get("harm") or {}
    token = _token_scores(head, names)
    write_table(token, out / "scores.parquet", meta)  # the ranking half's input (reports/leaderboard.scores.parquet)
    result, ranks = rank_half(labels, token, names, s)
    timings["rank-eval"] = time.perf_counter() - start
    write_csv(result.metrics, out / "metrics.csv")
    budgets = tuple(_budget(b) for b in s["budgets"])
    cfg = DecisionsConfig(budgets=budgets, selection=s["selection"], horizon=s["horizon"] if plan is None
                          else plan["horizon"], references=(),
                          pairs=0, infeasible="skip", seed=int(s["seed"]), n_boot=int(s.get("n_boot", 1000)),
                          harm=HarmSpec.from_config(harm))
    start = time.perf_counter()
    golden = None
    if cache:  # each prompt's full-cache runs: the same for every rule graded on this benchmark
        from kvdiag.label.golden_store import GoldenStore

        key = {**qkv_cache_key(bench, tr, lm), "golden": {"horizon": cfg.horizon, "batch_size": cfg.batch_size,
                                                          "backend": cfg.backend}}
        golden = GoldenStore(qkv_cache_dir(bench, key), key)
    decide(tr, lm, head, meta, out / "decisions", cfg, labels, labels_meta, show_progress, golden=golden)
    timings["decisions (set rows)"] = time.perf_counter() - start
    dec = read_table(out / "decisions" / "decisions.parquet")[0].select(
        "prompt_id", "checkpoint", "decision", "budget", "status", "kl_mean")
    boot = PromptBootstrap(labels["prompt_id"].unique().to_list(), int(s.get("n_boot", 1000)), int(s["seed"]), 0.95)
    builtins = read_table(bench.file(bench_mod.BUILTINS))[0] if bench.has_builtins and plan is None else None
    at = {} if plan is None else {"horizon": str(plan["horizon"]), "horizon_note": plan["note"]}
    rows = [{**_rank_part(name, rules[name].params, result, ranks[name]),
             **_decision_part(name, dec, refs, builtins, boot, [b.name for b in budgets]),
             "bench": bench.name, **at} for name in names]  # a user-built benchmark's rows say so
    return {"rows": rows, "decisions": dec, "timings": timings, "cache": cache_note}


def horizon_plan(b: bench_mod.Benchmark, horizon: int | str | None) -> dict | None:
    """How ``grade`` gets to ``horizon`` on ``b`` (torch-free; run before the model loads): None where it gives every
    checkpoint the steps of the benchmark's own labels (or is None); else {horizon, derive (the sealed labels hold
    those steps: their ``kl_steps`` are cut), note}. A fixed N past the end of a prompt's trace is a ``UserError``."""
    if horizon is None:
        return None
    from kvdiag.trace.manifest import TraceFiles

    tf = TraceFiles(b.file("trace"))
    have = pl.read_parquet(b.file("labels.parquet"), columns=["prompt_id", "checkpoint", "horizon"], glob=False).unique(
        ["prompt_id", "checkpoint"])
    room = min((tf.length(pid) - t, pid, t) for pid, t in have.select("prompt_id", "checkpoint").iter_rows())
    if horizon != REST and horizon > room[0]:
        raise UserError(f"--horizon {horizon} reaches past the end of the benchmark {b.name}'s trace: prompt "
                        f"{room[1]} ends {room[0]} tokens after its checkpoint {room[2]}; use --horizon <= {room[0]} "
                        "or rest")
    steps = [horizon_steps(horizon, t, tf.length(pid)) for pid, t in have.select("prompt_id", "checkpoint").iter_rows()]
    own = have["horizon"].to_list()
    if steps == own:
        return None
    derive = all(s <= h for s, h in zip(steps, own, strict=True))
    note = (f"graded at horizon {horizon}, the benchmark's labels at horizon {b.settings['horizon']}: its single "
            + ("labels are the sealed labels' first steps (kl_steps; noise floors as sealed)" if derive
               else "labels were labeled exactly at this horizon")
            + "; the sealed references and built-in rows measure the benchmark's horizon, so this row has no regret "
            "against oracle_greedy, place or paired test")
    return {"horizon": horizon, "derive": derive, "note": note}


def labels_at(plan: dict, labels: pl.DataFrame, meta: dict, tr, lm, out: Path, show_progress: bool
              ) -> tuple[pl.DataFrame, dict]:
    """The benchmark's single labels at ``plan``'s horizon (:func:`horizon_plan`), written to ``out/labels.parquet``:
    the sealed rows' first N steps of ``kl_steps`` (kl_mean, kl_max, kl_steps, horizon cut; js_mean, nll_delta,
    top1_flips, which are not per step, null) where they hold them, else every entry labeled exactly at N."""
    from kvdiag.label.config import LabelConfig

    H = plan["horizon"]
    cfg = LabelConfig(checkpoints="every:1", horizon=H, candidates="all", w_obs=0)
    if plan["derive"]:
        steps = pl.col("length") - pl.col("checkpoint") if H == REST else pl.lit(H, pl.Int64)
        lengths = pl.DataFrame({"prompt_id": tr.prompt_ids, "length": [tr.length(p) for p in tr.prompt_ids]})
        cut = (labels.join(lengths, on="prompt_id").with_columns(horizon=steps)
               .with_columns(kl_steps=pl.col("kl_steps").list.head(pl.col("horizon")))
               .with_columns(kl_mean=pl.col("kl_steps").list.mean(), kl_max=pl.col("kl_steps").list.max(),
                             js_mean=None, nll_delta=None, top1_flips=None).select(labels.columns)
               .cast(labels.schema))
        how = f"the sealed labels' first steps of kl_steps ({plan['note']})"
    else:
        from kvdiag.label.engine import OracleEngine
        from kvdiag.label.run import label_item

        parts = []
        for (pid,), g in labels.group_by("prompt_id", maintain_order=True):
            ids = tr.token_ids(pid)
            engine = OracleEngine(lm, ids, H, cfg.batch_size, cfg.backend, chunk=cfg.chunk)
            parts += [label_item(engine, tr, pid, t, cfg, ids) for t in sorted(g["checkpoint"].unique().to_list())]
        cut = pl.concat(parts).select(labels.columns).cast(labels.schema)
        how = f"labeled exactly at horizon {H}, every entry of the benchmark's checkpoints"
    new_meta = {**meta, "config": {**(meta.get("config") or {}), "horizon": H}, "label": how}
    write_table(cut, out / "labels.parquet", new_meta)
    return cut, new_meta


def rank_half(labels: pl.DataFrame, token: pl.DataFrame, names: list[str], settings: dict) -> tuple[object, dict]:
    """rank-eval of the rules ``names`` (columns of the token scores ``token``) on the benchmark's ``labels`` with its
    ``settings`` (harm, bootstrap), and :func:`ranking_rules`: what each row's ranking half is made of."""
    from kvdiag.rankeval import rank_eval

    harm = settings.get("harm") or {}
    result = rank_eval(labels, token, n_boot=int(settings.get("n_boot", 1000)), seed=int(settings["seed"]),
                       reference=None, scorers=tuple(names), harm=harm.get("harm", "quantile:0.9"),
                       noise_mult=float(harm.get("noise_mult", 1.0)),
                       include_unresolved=bool(harm.get("include_unresolved", False)))
    return result, ranking_rules(token, labels, names)


NO_RANKING = "all ties: every labeled entry of every checkpoint has the same score, so it ranks nothing"


def ranking_rules(token: pl.DataFrame, labels: pl.DataFrame, names: list[str]) -> dict[str, bool]:
    """rule -> whether its token scores differ somewhere among the labeled entries of one checkpoint (a rule whose
    scores all tie gets AUROC 0.5 with a zero-width CI from ties alone, not from ranking)."""
    keyed = token.join(labels.select(KEYS), on=list(KEYS), how="semi")
    distinct = keyed.group_by("prompt_id", "checkpoint").agg(pl.col(r).n_unique() for r in names)
    return {r: bool((distinct[r] > 1).any()) for r in names}


def _budget(name: str):
    from kvdiag.decisions import Budget

    return Budget.parse(name)


def _mean_ci(boot, df: pl.DataFrame) -> tuple[float, float, float]:
    value, reps = boot.mean(df["kl_mean"].to_numpy(), df["prompt_id"].to_numpy())
    return (value, *boot.ci(reps))


def _rank_part(name: str, params: dict, result, ranks: bool) -> dict:
    """A row's ranking half: rank-eval's pooled metrics with CIs, and whether the rule ranks at all."""
    m = result.metrics.filter((pl.col("scorer") == name) & (pl.col("scope") == "pooled"))
    row: dict = {"rule": name, "params": params, "ranks": ranks, "note": "" if ranks else NO_RANKING}
    for metric in RANK_METRICS:
        r = m.filter(pl.col("metric") == metric)
        if r.height:
            r = r.row(0, named=True)
            row[metric], row[f"{metric}_ci"] = r["value"], [r["ci_low"], r["ci_high"]]
    return row


def _decision_part(name: str, dec: pl.DataFrame, refs: pl.DataFrame | None, builtins: pl.DataFrame | None, boot,
                   budgets: list[str]) -> dict:
    """A row's decisions half (module docstring): per budget the joint damage with its CI, the regret against
    oracle_greedy, the place among the built-in rules and the paired test against the best of them
    (``kvdiag.core.stats.compare``: exact sign test below 30 prompts). ``dec``: prompt_id, checkpoint, decision, budget,
    kl_mean rows of the rule; ``refs`` or ``builtins`` None: no regret, or no place and test."""
    from kvdiag.core.stats import compare, ratio_summary

    row: dict = {}
    for b in budgets:
        mine = dec.filter((pl.col("decision") == name) & (pl.col("budget") == b))
        ok = mine.filter(pl.col("kl_mean").is_not_null())
        value, low, high = _mean_ci(boot, ok) if ok.height else (float("nan"),) * 3
        row[f"joint@{b}"], row[f"joint@{b}_ci"], row[f"decided@{b}"] = value, [low, high], f"{ok.height}/{mine.height}"
        greedy = None if refs is None else refs.filter((pl.col("decision") == "oracle_greedy")
                                                       & (pl.col("budget") == b))
        both = None if greedy is None else ok.join(greedy.select("prompt_id", "checkpoint", g="kl_mean"),
                                                   on=["prompt_id", "checkpoint"])
        if both is not None and both.height:
            x, xr = boot.mean(both["kl_mean"].to_numpy(), both["prompt_id"].to_numpy())
            y, yr = boot.mean(both["g"].to_numpy(), both["prompt_id"].to_numpy())
            with np.errstate(invalid="ignore", divide="ignore"):
                row[f"regret@{b}"], row[f"regret@{b}_ci"] = x / y, list(boot.ci(xr / yr))
            r = ratio_summary(boot, both["kl_mean"].to_numpy(), both["g"].to_numpy(), both["prompt_id"].to_numpy())
            row[f"regret_geomean@{b}"], row[f"regret_geomean@{b}_ci"] = r["geomean"], r["geomean_ci"]
        if builtins is not None:
            lb = builtins.filter(pl.col("budget") == b)
            means = lb.group_by("rule").agg(pl.col("kl_mean").mean(), n=pl.len(),
                                            ok=pl.col("kl_mean").is_not_null().sum())
            complete = means.filter(pl.col("n") == pl.col("ok")).sort("kl_mean", "rule")
            if complete.height and ok.height == mine.height:
                better = complete.filter(pl.col("kl_mean") < value).height
                row[f"place@{b}"] = f"{better + 1} of {complete.height + (name not in complete['rule'])}"
                best = complete.row(0, named=True)["rule"]
                if best != name:
                    other = lb.filter(pl.col("rule") == best).select("prompt_id", "checkpoint", o="kl_mean")
                    p = ok.join(other, on=["prompt_id", "checkpoint"])
                    c = compare(boot, p["kl_mean"].to_numpy(), p["o"].to_numpy(), p["prompt_id"].to_numpy())
                    t = c["test"]
                    row[f"vs_best@{b}"] = {"best": best, "diff": c["diff"], "ci": c["diff_ci"], **t.as_dict(),
                                           "resolution": t.resolution}
    return row


# --------------------------------------------------------------------------- outputs


def _ci(value, ci) -> str:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "n/a"
    low, high = ci if ci else (float("nan"), float("nan"))
    return number_text(value, 3) if low is None or np.isnan(low) else ci_text(value, low, high)


def _intro(b: bench_mod.Benchmark, horizon: str | None = None) -> str:
    """What the leaderboard's numbers are, from the benchmark's manifest (graded at ``horizon``: None, its own)."""
    m, st = b.manifest, b.settings
    at = (f"horizon {st['horizon']}" if horizon is None else
          f"graded at horizon {horizon} (the benchmark's labels: {st['horizon']}; no / greedy column applies)")
    return (f"`kvdiag grade --all --bench {m['name']}@{m['version']}`: {m['trace']['prompts']} prompts of "
            f"{m['model']['spec']} "
            f"({m['model']['dtype']}), {m['checkpoints']} checkpoints, exact labels of {m['labels']:,} entries, "
            f"{at}, `{st['selection']}` selection. AUROC, AP and FSR (false-safe rate): how each "
            f"rule ranks the single-entry labels (harmful: {st['harm']['harm']}). joint @ budget: the mean exact joint "
            "damage (nats) of the set the rule evicts there, over the checkpoints it could decide (decided / all). "
            "/ greedy: that damage over oracle_greedy's, per checkpoint (the geometric mean of the checkpoints' "
            "ratios, with its CI; in parentheses the ratio of means). oracle_greedy evicts token sets (the same "
            "positions in every layer and KV head), so a rule choosing per head can beat it (ratio < 1). 95% "
            f"cluster-bootstrap CIs over prompts (B = {st['n_boot']}). Sorted by the tightest budget's joint damage; "
            "rules not decided at every checkpoint there are listed apart. The benchmark's Trace holds tokens only: "
            "grade rebuilds q/k/v by one prefill, so a rule's scores can differ in their last bits from those on a "
            "Trace that stored its generation's q/k/v, a near-tie in a per-head top-k can flip, and the joint damage "
            "of that (different) set differs; the same set gets the same label bitwise.")


def leaderboard_table(rows: list[dict], budgets: list[str]) -> tuple[list[str], list[list]]:
    headers = ["rule", "AUROC", "AP", "FSR", *(f"joint @ {b}" for b in budgets), *(f"/ greedy @ {b}" for b in budgets)]
    out = []
    for r in rows:
        out.append([r["rule"] + ("" if r.get("ranks", True) else " (all ties: ranks nothing)"),
                    _ci(r.get("auroc"), r.get("auroc_ci")), _ci(r.get("ap"), r.get("ap_ci")),
                    _ci(r.get("fsr"), r.get("fsr_ci")),
                    *(_ci(r.get(f"joint@{b}"), r.get(f"joint@{b}_ci")) + f" ({r.get(f'decided@{b}')})"
                      for b in budgets),
                    *(_ci(r.get(f"regret_geomean@{b}"), r.get(f"regret_geomean@{b}_ci"))
                      + ("" if r.get(f"regret@{b}") is None else f" ({number_text(r[f'regret@{b}'], 3)})")
                      for b in budgets)])
    return headers, out


def _defined(row: dict, b: str) -> bool:
    """Whether the rule decided every checkpoint at budget ``b`` (its joint damage there is over all of them)."""
    decided, total = str(row.get(f"decided@{b}", "0/1")).split("/")
    v = row.get(f"joint@{b}")
    return decided == total and v is not None and v == v


def leaderboard_order(rows: list[dict], budgets: list[str]) -> tuple[list[dict], list[dict]]:
    """(rows decided at every checkpoint of the tightest budget, sorted by their joint damage there; the others,
    undefined there, sorted by the tightest budget where they are defined): undefined is no place, not the worst."""
    tight = budgets[-1]
    ranked = sorted((r for r in rows if _defined(r, tight)), key=lambda r: (r[f"joint@{tight}"], r["rule"]))
    rest = [r for r in rows if r not in ranked]

    def key(r):
        defined = [i for i, b in enumerate(budgets) if _defined(r, b)]
        return (-max(defined), r[f"joint@{budgets[max(defined)]}"], r["rule"]) if defined else (1, 0.0, r["rule"])

    return ranked, sorted(rest, key=key)


def leaderboard_markdown(b: bench_mod.Benchmark, rows: list[dict]) -> str:
    """leaderboard.md: the intro, the rules decided everywhere at the tightest budget (sorted there), then apart
    those not decided everywhere there; rules whose scores all tie are marked."""
    budgets = list(b.settings["budgets"])
    ranked, rest = leaderboard_order(rows, budgets)
    headers, table = leaderboard_table(ranked, budgets)
    intro = _intro(b, rows[0].get("horizon"))
    text = f"# Leaderboard: {b.name}\n\n{intro}\n\n" + md_table(headers, table, "l" + "r" * (len(headers) - 1))
    if rest:
        headers, table = leaderboard_table(rest, budgets)
        text += (f"\n\n## Not decided at every checkpoint of {budgets[-1]}\n\nThese rules protect more entries than "
                 f"{budgets[-1]} leaves somewhere (decided / all < 1): they have no place at that budget, so they are "
                 "listed apart, sorted by the tightest budget where they decided every checkpoint.\n\n"
                 + md_table(headers, table, "l" + "r" * (len(headers) - 1)))
    ties = [r["rule"] for r in rows if not r.get("ranks", True)]
    if ties:
        text += (f"\n\n{', '.join(ties)}: {NO_RANKING}; its AUROC of 0.5 and AP at the prevalence come from the ties, "
                 "and its decisions from the selection's tie-breaking, not from its scores.")
    return text + "\n"


ROW_MD = "leaderboard-row.md"


def leaderboard_rows_markdown(b: bench_mod.Benchmark, rows: list[dict]) -> str:
    """``rows`` as a Markdown table with reports/leaderboard.md's columns and cells (:func:`leaderboard_table`), in
    its order, to paste into it; no intro (the leaderboard has it)."""
    budgets = list(b.settings["budgets"])
    ranked, rest = leaderboard_order(rows, budgets)
    headers, table = leaderboard_table(ranked + rest, budgets)
    return md_table(headers, table, "l" + "r" * (len(headers) - 1)).rstrip("\n") + "\n"


def write_leaderboard(b: bench_mod.Benchmark, rows: list[dict], paths: list[Path]) -> None:
    """leaderboard.md and leaderboard.csv (one flat row per rule, in the markdown's order) at each of ``paths``."""
    ranked, rest = leaderboard_order(rows, list(b.settings["budgets"]))
    text = leaderboard_markdown(b, rows)
    flat = pl.DataFrame([_flat(r) for r in ranked + rest], infer_schema_length=None)
    for path in paths:
        write_text(path, text)
        write_csv(flat, path.with_suffix(".csv"))


def rewrite_leaderboard(bench: str, path: str | os.PathLike, scores: str | os.PathLike | None = None,
                        graded: Sequence[str | os.PathLike] = ()) -> list[dict]:
    """Rewrite a committed leaderboard (``path``: leaderboard.md beside its leaderboard.csv) without a model: the
    decisions half recomputed from the benchmark's sealed ``builtins.parquet`` and ``references.parquet`` (the joint
    damages ``kvdiag grade --all`` stored); the ranking half recomputed from ``scores`` (the token scores
    ``kvdiag grade --all`` wrote, its ``OUT/scores.parquet``: reports/leaderboard.scores.parquet) or, without it,
    carried from the csv. ``graded``: the ``rows.json`` of single-rule ``kvdiag grade`` runs (rules outside the
    sealed set, e.g. a fitted rule), listed after the leaderboard as they were graded: their joint damages are in no
    sealed file, so they are carried, not recomputed (leaderboard.csv keeps the sealed rows only)."""
    from kvdiag.core.stats import PromptBootstrap

    b = bench_mod.load(bench)
    if not b.has_builtins:
        raise UserError(f"--bench {bench}: no builtins.parquet yet; grade it with kvdiag grade --all first")
    path = Path(path)
    old = pl.read_csv(path.with_suffix(".csv"), infer_schema_length=None, glob=False)
    s = b.settings
    labels = read_table(b.file("labels.parquet"), "benchmark labels")[0]
    refs = read_table(b.file("references.parquet"), "benchmark references")[0]
    builtins = read_table(b.file(bench_mod.BUILTINS))[0]
    boot = PromptBootstrap(labels["prompt_id"].unique().to_list(), int(s.get("n_boot", 1000)), int(s["seed"]), 0.95)
    dec = builtins.rename({"rule": "decision"})
    result = ranks = None
    if scores is not None:
        token, meta = read_table(scores, "the leaderboard's scores")
        if (meta.get("trace") or {}).get("fingerprint") != b.manifest["trace"]["fingerprint"]:
            raise UserError(f"{scores} scored another Trace than {b.name}'s: pass OUT/scores.parquet of kvdiag grade "
                            f"--all --bench {bench}")
        missing = [r for r in old["rule"] if r not in token.columns]
        if missing:
            raise UserError(f"{scores} lacks the leaderboard's rule(s) {', '.join(missing)}: pass OUT/scores.parquet "
                            f"of the kvdiag grade --all that wrote {path}")
        result, ranks = rank_half(labels, token, old["rule"].to_list(), s)
    rows = []
    for r in old.iter_rows(named=True):
        if result is not None:
            rank = _rank_part(r["rule"], r["params"], result, ranks[r["rule"]])
        else:
            rank = {"rule": r["rule"], "params": r["params"], "ranks": r["ranks"], "note": r["note"] or ""}
            for metric in RANK_METRICS:
                if r.get(metric) is not None:
                    rank[metric], rank[f"{metric}_ci"] = r[metric], [r[f"{metric}_ci_low"], r[f"{metric}_ci_high"]]
        rows.append({**rank, **_decision_part(r["rule"], dec, refs, builtins, boot, list(s["budgets"]))})
    write_leaderboard(b, rows, [path])
    if graded:
        extra = [row for g in graded for row in read_json(g, "a kvdiag grade rows.json")["rows"]]
        names = ", ".join(f"`{Path(g).as_posix()}`" for g in graded)
        write_text(path, path.read_text() + "\n## Graded beside the sealed rows\n\n`kvdiag grade RULE` of rules "
                   f"outside the built-in set, as each run graded them ({names}): their joint damages are in no sealed "
                   "file, so these rows are carried, not recomputed.\n\n" + leaderboard_rows_markdown(b, extra))
    return rows


def grade_files(spec: str | None, bench: str, out: str | os.PathLike, rule: str | None = None,
                params: dict | None = None, everything: bool = False, leaderboard: str | os.PathLike | None = None,
                show_progress: bool = True, horizon: int | str | None = None, cache: bool = True) -> dict:
    """What ``kvdiag grade`` runs: every input checked before the model loads, then :func:`grade` (at ``horizon``:
    :func:`horizon_plan`; ``cache``: :func:`qkv_cache`). Writes ``out/rows.json``, the metrics' CSV and
    ``out/leaderboard-row.md``: the rows in the leaderboard's Markdown format."""
    from kvdiag.core.guard import check_outputs

    check_outputs({"--out": (out, "dir"), "--leaderboard": leaderboard,
                   "--leaderboard (its CSV)": None if leaderboard is None else Path(leaderboard).with_suffix(".csv")},
                  {"--bench": bench_mod.resolve(bench), "RULE": spec if spec and spec.endswith(".py") else None})
    b = bench_mod.load(bench)
    plan = horizon_plan(b, horizon)
    rules = resolve_rules(spec, rule, params or {}, everything)
    from kvdiag.model.load import load_model  # torch: after the checks that need none
    start = time.perf_counter()
    lm = load_model(b.manifest["model"]["spec"], dtype=b.manifest["model"].get("dtype", "float32"))
    bench_mod.check_model(b, lm)
    load_s = time.perf_counter() - start
    res = grade(b, rules, lm, Path(out), show_progress, None if plan is None else plan["horizon"], cache)
    res["timings"] = {"model load": load_s, **res["timings"]}
    write_json(Path(out) / "rows.json", {"bench": b.name, "rows": res["rows"], "timings": res["timings"]})
    write_text(Path(out) / ROW_MD, leaderboard_rows_markdown(b, res["rows"]))
    if everything:
        joint = res["decisions"].rename({"decision": "rule"})
        if not b.has_builtins and plan is None:  # the first --all of a version completes it (at its own horizon)
            write_table(joint, b.file(bench_mod.BUILTINS), {"kind": "builtins", "bench": b.name})
            bench_mod.seal(b.path, b.manifest)
        write_leaderboard(b, res["rows"],
                          [Path(out) / "leaderboard.md", *([Path(leaderboard)] if leaderboard is not None else [])])
    return res


def _flat(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if k == "params":
            out[k] = str(v)
        elif isinstance(v, list):
            out[f"{k}_low"], out[f"{k}_high"] = v
        elif isinstance(v, dict):
            out.update({f"{k}_{kk}": (str(vv) if isinstance(vv, list) else vv) for kk, vv in v.items()})
        else:
            out[k] = v
    return out


__all__ = ["RANK_METRICS", "ROW_MD", "grade", "grade_files", "leaderboard_rows_markdown", "leaderboard_table",
           "qkv_cache", "rank_half", "resolve_rules", "rewrite_leaderboard"]
