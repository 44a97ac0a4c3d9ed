"""``decide``: the exact joint label of the set each rule evicts under each budget, at every checkpoint of a scores
file; ``decisions_files``: the same from files (what ``kvdiag decisions`` runs).

Work items are ``(prompt, checkpoint)``; each is one atomic part in ``OUT/parts/`` (``kvdiag.core.parts``), so an
interrupted run keeps its finished checkpoints and the same command continues. At a checkpoint ``t``:

1. every rule's per-(layer, KV head) scores of the whole cache ``[0, t)`` (the scores file's head rows) give its keep
   set under each budget through ``kvdiag.core.selection.select_keep``, as replay's compaction does;
2. the references give theirs: ``oracle_single`` (largest exact single labels), ``oracle_greedy``
(``sets.greedy_sets``),
   ``fast`` (largest Fisher labels), ``random``;
3. every set is one row of ``OracleEngine.label_sets``: the H recorded tokens teacher-forced with the whole set
   evicted, KL to the full cache on the full vocabulary (exact as a physical deletion of the set);
4. the most damaging sets are searched for superadditive pairs (``kvdiag.decisions.interactions``).
"""

from __future__ import annotations

import os
import warnings
import zlib
from pathlib import Path

import numpy as np
import polars as pl
import torch

from kvdiag.core.contracts import DECISION_SCHEMA, belongs
from kvdiag.core.errors import UserError
from kvdiag.core.io import check_writable, table_sha256, write_json
from kvdiag.core.parts import PartStore, check_stamp, part_name
from kvdiag.core.progress import progress_bar
from kvdiag.core.provenance import provenance
from kvdiag.decisions.config import RANDOM_REFERENCE, DecisionsConfig, check_reference, checkpoints_of, rule_columns
from kvdiag.decisions.imported import read_search_from
from kvdiag.decisions.interactions import PAIR_SCHEMA, superadditive_pairs
from kvdiag.decisions.search import candidate, search, visible_entries
from kvdiag.decisions.sets import (
    greedy_sets,
    head_label_set,
    label_set,
    mask_set,
    pack_set,
    protected_count,
    random_set,
    rule_set,
)
from kvdiag.model.attention import future_attention

STATUS = {"ok": "labeled", "nothing_evicted": "the budget keeps every entry: nothing is evicted (label 0)",
          "over_budget": "the rule protects more entries than the budget keeps: no decision (--infeasible skip)",
          "no_candidate": "oracle_search had no labeled set of that budget to start from (every rule over budget)"}


# --------------------------------------------------------------------------- inputs


def rule_instances(names: list[str], scores_meta: dict) -> dict:
    """name -> the Scorer the column was made with (its ``protected()`` declaration), or None when the metadata does
    not record it (then nothing counts as protected)."""
    from kvdiag.scorers import get_scorer

    params = scores_meta.get("scorers") or {}
    out = {}
    for name in names:
        out[name] = get_scorer(name, **params[name]) if name in params else None
    return out


def check_oracle_single(labels: pl.DataFrame | None, items: dict[str, list[int]], cfg: DecisionsConfig) -> None:
    """oracle_single needs the exact label of every entry at every checkpoint (``labels``: token rows)."""
    if "oracle_single" not in cfg.references:
        return
    missing = [(pid, t) for pid, ts in items.items() for t in ts if single_labels(labels, pid, t) is None]
    if missing:
        pid, t = missing[0]
        raise UserError(f"oracle_single needs exact labels of every entry at every checkpoint; --labels "
                        f"{'is not given' if labels is None else f'lacks some at checkpoint {t} of {pid!r}'}: label "
                        "them with kvdiag label --candidates all --checkpoints (the scores' checkpoints), or drop "
                        "oracle_single from --references")


def single_labels(labels: pl.DataFrame | None, pid: str, t: int) -> torch.Tensor | None:
    """[t] exact single kl_mean of every entry [0, t) (token rows), or None when the labels lack some."""
    if labels is None:
        return None
    rows = labels.filter((pl.col("prompt_id") == pid) & (pl.col("checkpoint") == t)).sort("position")
    if rows.height != t or rows["position"].to_list() != list(range(t)):
        return None
    return torch.tensor(rows["kl_mean"].to_numpy(), dtype=torch.float64)


def head_scores(scores: pl.DataFrame, rules: list[str], pid: str, t: int, L: int, Hkv: int) -> dict[str, torch.Tensor]:
    """rule -> [L, Hkv, t] its scores of every entry at checkpoint ``t`` of ``pid`` (higher = keep)."""
    rows = scores.filter((pl.col("prompt_id") == pid) & (pl.col("checkpoint") == t) & (pl.col("granularity") == "head"))
    rows = rows.sort("layer", "kv_head", "position")
    return {r: torch.from_numpy(rows[r].to_numpy().astype(np.float64).reshape(L, Hkv, t)) for r in rules}


def check_stochastic(rules: dict, cfg: DecisionsConfig) -> None:
    """Stochastic selection needs a graded score to draw from: refuse a rule that declares none."""
    for rule in rules.values():
        if rule is not None:
            cfg.selection.check_rule(rule)


def check_protection(rules: dict, items: dict[str, list[int]], cfg: DecisionsConfig) -> dict[str, dict[str, int]]:
    """Refuse (``infeasible=refuse``) a rule whose declared protected entries exceed a budget at some checkpoint, as
    replay refuses such a budget; returns rule -> {budget: checkpoints where it does}."""
    over: dict[str, dict[str, int]] = {}
    for name, rule in rules.items():
        for pid, ts in items.items():
            for t in ts:
                n = protected_count(rule, t)
                for b in cfg.budgets:
                    if n > b.entries(t):
                        if cfg.infeasible == "refuse":
                            raise UserError(
                                f"{name} always keeps {n} entries at checkpoint {t} of {pid!r}, more than {b.name} "
                                "keeps "
                                f"({b.entries(t)}); drop it with --scorers, raise the budget, score it with smaller "
                                "windows (--param), or pass --infeasible skip to record those decisions as undefined")
                        over.setdefault(name, {}).setdefault(b.name, 0)
                        over[name][b.name] += 1
    return over


# --------------------------------------------------------------------------- one checkpoint


def _decide_checkpoint(engine, reader, fisher, lm, pid: str, t: int, scores: dict[str, torch.Tensor], rules: dict,
                       singles: torch.Tensor | None, cfg: DecisionsConfig, harm_threshold: float,
                       progress, future: torch.Tensor | None = None,
                       imported: dict[str, list[tuple[str, torch.Tensor]]] | None = None
                       ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """One checkpoint's set rows, judged by ``engine`` (the judged window); ``reader``: the engine of the window the
    references that read the future choose on (``engine`` itself when the two are one window); ``imported``: budget
    -> the ``--search-from`` sets (name, set) that join ``oracle_search``'s candidates there."""
    L, Hkv = engine.num_layers, engine.num_kv_heads
    read = reader.steps(t)  # steps oracle_single's labels, fast, oracle_greedy and oracle_search read
    kept = {b.name: b.entries(t) for b in cfg.budgets}
    stochastic = cfg.selection.stochastic
    deterministic = cfg.selection.deterministic  # what the references and the comparison use
    # [L, t]: a sliding layer's budget counts only what it still sees
    visible = visible_entries(engine.attention.layers, t)
    window = None if bool(visible.all()) or deterministic.per_token else visible
    decisions: list[dict] = []  # one per set row: its fields, its set
    for name, values in scores.items():
        rule = rules.get(name)
        n_prot = protected_count(rule, t)
        protected = rule.protected(t - torch.arange(t), torch.arange(t)) if rule is not None else None
        for b, k in kept.items():
            status = "over_budget" if n_prot > k else ("nothing_evicted" if k >= t else "ok")
            evict = rule_set(values, k, deterministic, visible=window) if status != "over_budget" else None
            decisions.append(dict(decision=name, kind="rule", budget=b, kept=k, protected=n_prot, status=status,
                                  set=evict, sample=None, draw_seed=None))
            for draw in range(cfg.samples if stochastic else 0):  # seeded draws: the same whatever else runs
                seed = zlib.crc32(f"{cfg.seed}:{pid}:{t}:{name}:{b}:{draw}".encode())
                gen = torch.Generator().manual_seed(seed)
                evict = (rule_set(values, k, cfg.selection, protected, gen) if status != "over_budget" else None)
                decisions.append(dict(decision=name, kind="rule", budget=b, kept=k, protected=n_prot,
                                      status=status, set=evict, sample=draw, draw_seed=seed))
    refs = cfg.references
    if "oracle_single" in refs:
        for b, k in kept.items():
            decisions.append(dict(decision="oracle_single", kind="reference", budget=b, kept=k, protected=0,
                                  status="ok" if k < t else "nothing_evicted", set=label_set(singles, k),
                                  sample=None, draw_seed=None, read_steps=read))
    if "fast" in refs:
        a, _ = fisher.effects(t)  # [K, L, Hkv, t] linearized effects on the sampled log-likelihoods
        for b, k in kept.items():
            if deterministic.per_token:
                est = a.double().sum((1, 2)).pow(2).mean(0)  # [t]: a token row sums its cells' effects
                evict = label_set(est, k)
            else:
                evict = head_label_set(a.double().pow(2).mean(0), k, window)  # [L, Hkv, t]: each cell's own
            decisions.append(dict(decision="fast", kind="reference", budget=b, kept=k, protected=0,
                                  status="ok" if k < t else "nothing_evicted", set=evict, sample=None, draw_seed=None,
                                  read_steps=fisher.steps(t)))
    if future is not None:  # [L, Hkv, t]: keep what the future queries read most
        future_steps = cfg.window(t, engine.T)
        for b, k in kept.items():
            evict = (label_set(future.sum((0, 1)), k) if deterministic.per_token
                     else head_label_set(future, k, window))
            decisions.append(dict(decision="future_attention", kind="reference", budget=b, kept=k, protected=0,
                                  status="ok" if k < t else "nothing_evicted", set=evict, sample=None, draw_seed=None,
                                  read_steps=future_steps))
    if "random" in refs:
        for b, k in kept.items():
            evict = random_set(t, k, deterministic, L, Hkv, cfg.seed, pid, window)
            decisions.append(dict(decision=RANDOM_REFERENCE, kind="reference", budget=b, kept=k, protected=0,
                                  status="ok" if k < t else "nothing_evicted", set=evict, sample=None, draw_seed=None))
    greedy_cost = None
    if "oracle_greedy" in refs:
        greedy, greedy_cost = greedy_sets(reader, t, list(kept.values()), cfg.greedy_chunk, progress)
        for b, k in kept.items():
            decisions.append(dict(decision="oracle_greedy", kind="reference", budget=b, kept=k, protected=0,
                                  status="ok" if k < t else "nothing_evicted", set=greedy[k], sample=None,
                                  draw_seed=None, read_steps=read))
    todo = [d for d in decisions if d["set"] is not None]
    res, noise = engine.label_sets(t, [d["set"] for d in todo], progress)
    for j, d in enumerate(todo):
        d["label"] = {key: val[j] for key, val in res.items()}
    if "oracle_search" in refs:  # from the best labeled set of each budget, in the deterministic action space
        starts = [d for d in todo if d["sample"] is None]
        if reader is engine:
            read_labels = [d["label"] for d in starts]
        else:  # the search reads only its window: its candidates are labeled there too
            got, _ = reader.label_sets(t, [d["set"] for d in starts], progress)
            read_labels = [{key: val[j] for key, val in got.items()} for j in range(len(starts))]
        given = [(b, name, evict) for b, sets in (imported or {}).items() for name, evict in sets]
        extra = []  # (budget, Candidate): earlier runs' sets, labeled here on the window the search reads
        if given:
            got, _ = reader.label_sets(t, [evict for _, _, evict in given], progress)
            extra = [(b, candidate(name, evict, {key: val[j] for key, val in got.items()}, L, Hkv, t))
                     for j, (b, name, evict) in enumerate(given)]
        for b, k in kept.items():
            cands = [candidate(d["decision"], d["set"], lab, L, Hkv, t) for d, lab in zip(starts, read_labels,
                                                                                          strict=True)
                     if d["budget"] == b] + [c for eb, c in extra if eb == b]
            if not cands:
                decisions.append(dict(decision="oracle_search", kind="reference", budget=b, kept=k, protected=0,
                                      status="no_candidate", set=None, sample=None, draw_seed=None))
                continue
            found = search(reader, t, cands, deterministic.per_token, cfg.search_rows, cfg.search_seconds, visible)
            evict = found.mask[0, 0].nonzero()[:, 0] if deterministic.per_token else mask_set(found.mask)
            decisions.append(dict(decision="oracle_search", kind="reference", budget=b, kept=k, protected=0,
                                  status="ok" if k < t else "nothing_evicted", set=evict, sample=None,
                                  draw_seed=None, label=found.label, read_steps=read, cost_rows=found.rows,
                                  cost_seconds=found.seconds, search_start=found.start,
                                  search_converged=found.converged,
                                  search_improvement=found.improvement))
        searched = [d for d in decisions if d["decision"] == "oracle_search" and d["set"] is not None]
        if reader is not engine and searched:  # judged on the whole window, the steps they did not read included:
            got, _ = engine.label_sets(t, [d["set"] for d in searched])  # one call, one full-cache and null run
            for j, d in enumerate(searched):
                d["label"] = {key: val[j] for key, val in got.items()}
    rows = []
    for d in decisions:
        evict, label = d.pop("set"), d.pop("label", None)
        d.setdefault("read_steps", 0)  # the rules and random read no step after the checkpoint
        if label is not None:
            kl = label["kl"].double()
            d.update(kl_mean=float(kl.mean()), kl_max=float(kl.max()), kl_steps=kl.tolist(),
                     js_mean=float(label["js"].double().mean()), nll_delta=float(label["nll_delta"].double().mean()),
                     top1_flips=int(label["flips"]))
        token = evict is not None and evict.dim() == 1
        heads = torch.zeros(t, dtype=torch.long)
        if evict is not None:
            full = evict.expand(L, Hkv, -1) if token else evict
            full = full[full >= 0]  # a per-head set's padding
            heads.index_add_(0, full.reshape(-1), torch.ones(full.numel(), dtype=torch.long))
        if d["decision"] == "oracle_greedy" and greedy_cost is not None:
            d.update(cost_rows=greedy_cost["rows"], cost_seconds=greedy_cost["seconds"])
        rows.append({
            "prompt_id": pid, "checkpoint": t, **d, "evicted": t - d["kept"],
            "selection": str(cfg.selection if d["sample"] is not None else deterministic),
            "horizon": engine.steps(t), "noise_floor": noise,
            "sum_single": float(singles[evict].sum()) if token and singles is not None else None,
            "evicted_positions": evict.tolist() if token else None, "evicted_heads": heads.tolist(),
            "evicted_mask": pack_set(evict, L, Hkv, t) if evict is not None else None,
        })
    table = pl.DataFrame(rows, schema=DECISION_SCHEMA)
    pairs = pl.DataFrame(schema=PAIR_SCHEMA)
    if cfg.pairs and singles is not None:
        pairs = superadditive_pairs(engine, pid, t, table, singles, harm_threshold, cfg, lm, progress)
    return table, pairs


# --------------------------------------------------------------------------- the run


def _keep(writer, engine, t: int):
    """Hand the golden run checkpoint ``t`` used to ``writer``; a checkpoint that ran none (no set was labeled)
    leaves the prompt unstored (running it now would change the rounding of the later checkpoints)."""
    if writer is None:
        return None
    run = engine.stored_golden(t)
    if run is None:
        writer.discard()
        return None
    writer.add(t, run)
    return writer


def parts_stamp(fingerprint: str, weights_hash: str, cfg: DecisionsConfig, rules: list[str], scores: pl.DataFrame,
                labels: pl.DataFrame | None) -> dict:
    """What changes a part's content: the Trace, its model's weights, the settings, the rules graded and the
    contents of the scores and the token labels (``labels``: their token rows) -- a rerun given other ones (a scores
    file remade) is refused, not mixed with parts made from these; config.json names them as ``inputs``."""
    return {"trace": fingerprint, "model": weights_hash, **cfg.settings(), "rules": rules,
            "inputs": {"scores_sha256": table_sha256(scores),
                       "labels_sha256": table_sha256(labels) if labels is not None else None}}


def decide(trace, lm, scores: pl.DataFrame, scores_meta: dict, out: str | os.PathLike, cfg: DecisionsConfig,
           labels: pl.DataFrame | None = None, labels_meta: dict | None = None, show_progress: bool = True,
           golden=None) -> Path:
    """Grade every rule's decisions at every checkpoint of ``scores`` and write ``OUT/decisions.parquet`` and
    ``OUT/pairs.parquet`` (parts in ``OUT/parts``; a rerun continues). Inputs are checked before any work.
    ``golden``: a ``kvdiag.label.golden_store.GoldenStore`` whose stored full-cache runs replace the engine's own
    (``kvdiag grade``: they do not depend on the rule graded), and which keeps the runs it did not have."""
    from kvdiag.label.engine import OracleEngine
    from kvdiag.label.fast import FisherLabeler, FisherParams

    out = Path(out)
    belongs(trace, scores_meta, "--scores")
    if labels is not None:
        belongs(trace, labels_meta or {}, "--labels")
        labels = labels.filter(pl.col("granularity") == "token")
    names = rule_columns(scores, cfg.rules)
    items, short = checkpoints_of(scores, trace, cfg)
    if short:
        warnings.warn(f"{len(short)} checkpoint(s) of the scores file leave no room for the horizon of {cfg.horizon} "
                      f"tokens before the end of their prompt (e.g. {short[0][1]} of {short[0][0]!r}): left out",
                      stacklevel=2)
    check_oracle_single(labels, items, cfg)
    cfg.check_future(trace.manifest, items)
    imported = read_search_from(trace, cfg, items) if cfg.search_from else {}
    rules = rule_instances(names, scores_meta)
    check_stochastic(rules, cfg)
    over = check_protection(rules, items, cfg)
    if any(b.entries(t) >= t for b in cfg.budgets for ts in items.values() for t in ts):
        warnings.warn("a budget keeps every entry at some checkpoint: those rows record zero evictions", stacklevel=2)
    spec = cfg.harm
    threshold = None if labels is None else spec.threshold(spec.analysed(labels, require=False)["kl_mean"].to_numpy())
    stamp = parts_stamp(trace.fingerprint, lm.info["weights_hash"], cfg, names, scores, labels)
    meta = {"kind": "decisions", **provenance(), "trace": trace.provenance, "model": lm.info,
            "inputs": stamp["inputs"],
            "config": {**cfg.settings(), "rules": names, "n_boot": cfg.n_boot, "reference": cfg.reference},
            "rules": {n: (r.params if r is not None else None) for n, r in rules.items()},
            "labels": {"method": ((labels_meta or {}).get("config") or {}).get("method", "exact"),
                       "label": (labels_meta or {}).get("label")} if labels is not None else None,
            "harm": {**spec.to_config(), "threshold": threshold}, "over_budget": over, "status": STATUS,
            "left_out": [{"prompt_id": pid, "checkpoint": t, "why": "no room for the horizon"} for pid, t in short]}
    parts = PartStore(out / "parts", out)
    parts.stamp("config.json", stamp)
    L, Hkv = trace.num_layers, trace.num_kv_heads
    all_items = [(pid, t) for pid, ts in items.items() for t in ts]
    todo = {pid: [t for t in ts if not parts.done(part_name(pid, f"{t:07d}"))] for pid, ts in items.items()}
    with progress_bar(show_progress, remaining=True) as bar:
        task = bar.add_task("decisions: checkpoints", total=len(all_items),
                            completed=len(all_items) - sum(map(len, todo.values())))
        rows_task = bar.add_task("  set rows", total=None)
        for pid, ts in items.items():
            if not todo[pid]:
                continue
            ids = trace.token_ids(pid)
            engine = OracleEngine(lm, ids, cfg.horizon, cfg.batch_size, cfg.backend)
            reader = (engine if cfg.read_horizon == cfg.horizon
                      else OracleEngine(lm, ids, cfg.read_horizon, cfg.batch_size, cfg.backend))
            fisher = (FisherLabeler(lm, ids, cfg.read_horizon, FisherParams(), cfg.seed)
                      if "fast" in cfg.references else None)
            stored = golden.load(pid, ts) if golden is not None else None
            writer = golden.writer(pid) if golden is not None and stored is None else None
            for t in ts:
                if stored is not None:
                    engine.use_golden(t, *stored[t])
                if t not in todo[pid]:
                    # extend the caches in the same steps as an uninterrupted run: the same rounding, the same labels
                    engine.golden(t)
                    if reader is not engine:
                        reader.golden(t)
                    writer = _keep(writer, engine, t)
                    if fisher is not None:
                        fisher.golden(t)
                    continue
                bar.reset(rows_task, total=None, description=f"  {pid} @ {t}")
                future = (future_attention(trace, pid, t, cfg.window(t, trace.length(pid)))
                          if "future_attention" in cfg.references else None)
                table, pairs = _decide_checkpoint(
                    engine, reader, fisher, lm, pid, t, head_scores(scores, names, pid, t, L, Hkv), rules,
                    single_labels(labels, pid, t), cfg, threshold, lambda k: bar.advance(rows_task, k), future,
                    imported.get((pid, t)))
                parts.write(part_name(pid, "pairs", f"{t:07d}"), pairs, meta)  # the pairs first: the table marks done
                parts.write(part_name(pid, f"{t:07d}"), table, meta)
                bar.advance(task)
                writer = _keep(writer, engine, t)
            if writer is not None:
                writer.commit()
    names_done = [part_name(pid, f"{t:07d}") for pid, t in all_items]
    parts.merge(names_done, out / "decisions.parquet", meta, sort=["prompt_id", "checkpoint", "decision", "budget"],
                schema=DECISION_SCHEMA)
    parts.merge([part_name(pid, "pairs", f"{t:07d}") for pid, t in all_items], out / "pairs.parquet", meta,
                schema=PAIR_SCHEMA)
    write_json(out / "config.json", {"command": "decisions", **meta})
    return out


def decisions_files(trace: str | os.PathLike, scores: str | os.PathLike, out: str | os.PathLike, cfg: DecisionsConfig,
                    labels: str | os.PathLike | None = None, model: str | None = None, dtype: str | None = None,
                    device: str = "cpu", show_progress: bool = True) -> Path:
    """What ``kvdiag decisions`` runs: read and check the inputs (before the model loads), grade, summarize."""
    from kvdiag.core.contracts import read_labels, read_scores
    from kvdiag.decisions.summary import summarize_files
    from kvdiag.model.load import load_model
    from kvdiag.model.specs import check_trace_model
    from kvdiag.trace import Trace

    check_writable(out, "--out", "dir")
    tr = Trace(trace)
    score_df, score_meta = read_scores(scores)
    label_df, label_meta = read_labels(labels) if labels is not None else (None, None)
    if label_meta is not None:
        label_horizon = (label_meta.get("config") or {}).get("horizon")
        if label_horizon is not None and label_horizon != cfg.read_horizon:
            flag = "--horizon" if cfg.read_window is None else "--read-window"
            raise UserError(f"{flag} {cfg.read_horizon} differs from the labels' horizon {label_horizon}: "
                            "oracle_single reads the labels and is judged against the joint labels of the same "
                            f"steps; pass {flag} {label_horizon}")
    # every check that needs no model, before it loads
    belongs(tr, score_meta, f"--scores {scores}")
    if label_meta is not None:
        belongs(tr, label_meta, f"--labels {labels}")
    names = rule_columns(score_df, cfg.rules)
    check_reference(cfg, names)
    items, _ = checkpoints_of(score_df, tr, cfg)
    check_oracle_single(None if label_df is None else label_df.filter(pl.col("granularity") == "token"), items, cfg)
    cfg.check_future(tr.manifest, items)
    if cfg.search_from:
        read_search_from(tr, cfg, items)
    rules = rule_instances(names, score_meta)
    check_stochastic(rules, cfg)
    check_protection(rules, items, cfg)
    had = tr.manifest["model"]
    if model is not None:
        check_trace_model(model, had)
    # a rerun into parts made with other settings or inputs: refused now, not after the load (the model must be the
    # Trace's, so its weights hash is the Trace's)
    check_stamp(Path(out) / "parts", "config.json", parts_stamp(
        tr.fingerprint, had["weights_hash"], cfg, names, score_df,
        None if label_df is None else label_df.filter(pl.col("granularity") == "token")))
    lm = load_model(model or had["spec"], dtype=dtype or had.get("dtype", "float32"), device=device)
    lm.check_model_of(had, "--model", "drop --model")
    tr.check_vocabulary(lm)
    decide(tr, lm, score_df, score_meta, out, cfg, label_df, label_meta, show_progress)
    summarize_files(out, labels=labels, scores=scores)
    return Path(out)
