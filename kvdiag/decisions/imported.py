"""``--search-from``: sets of earlier ``kvdiag decisions`` runs as ``oracle_search``'s candidates.

A search is only as good as where it starts, and the best set known at a (checkpoint, budget) may come from another
run: a longer search, a search that read other steps, an older search (reports/decisions-math500/generalisation.md's
pooled table found such sets at 6 of 45). Each ``--search-from`` file gives, at every (checkpoint, budget) it shares
with this run, its lowest set (by its own ``kl_mean``, on the window that run judged): that set is labeled again here,
on this run's read window, and joins the candidates, so the search starts from the best of everything and continues
an earlier search where that is the best.

A file must be a finished ``decisions.parquet`` of the same Trace and selection; every set it gives must be a set
this run could have made at that budget: per (layer, KV head), ``min(kept, visible)`` of the entries the cell's
queries still see kept (a sliding layer's window) and none it cannot see evicted (``kvdiag.decisions.sets.window_set``)
or, for a token set, ``t - kept`` positions. Anything else is refused, before the model loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from kvdiag.core.contracts import belongs, read_decisions
from kvdiag.core.errors import UserError
from kvdiag.decisions.config import DecisionsConfig

if TYPE_CHECKING:  # torch loads with the stage: the CLI checks the files (check_search_from) before
    import torch

# (prompt_id, checkpoint) -> budget name -> [(candidate name, evicted set [E] or [L, Hkv, E])]
Imported = dict[tuple[str, int], dict[str, list[tuple[str, "torch.Tensor"]]]]


def check_search_from(trace, cfg: DecisionsConfig, items: dict[str, list[int]]) -> list[pl.DataFrame]:
    """Per ``cfg.search_from`` file, its lowest labeled set (its own ``kl_mean``) at each (checkpoint, budget) of
    this run (``items``: prompt -> checkpoints): the rows, read without torch. ``trace``: a ``kvdiag.trace.Trace``
    or its ``TraceFiles``. A file that is no decisions table of this Trace, of another selection, or that shares no
    (checkpoint, budget) with the run is a ``UserError`` naming it."""
    sel = str(cfg.selection.deterministic)
    budgets = [b.name for b in cfg.budgets]
    keys = [{"prompt_id": p, "checkpoint": t} for p, ts in items.items() for t in ts]
    out = []
    for path in cfg.search_from:
        what = f"--search-from {path}"
        if Path(path).is_dir():
            raise UserError(f"{what} is a directory: pass the decisions.parquet in it")
        df, meta = read_decisions(path, "--search-from")
        belongs(trace, meta, what)
        if "evicted_mask" not in df.columns:
            raise UserError(f"{what} stores no evicted sets (made before kvdiag stored them): rerun that "
                            "kvdiag decisions")
        rows = df.filter((pl.col("status") == "ok") & pl.col("sample").is_null() & pl.col("kl_mean").is_not_null()
                         & pl.col("evicted_mask").is_not_null() & pl.col("budget").is_in(budgets)
                         & pl.struct("prompt_id", "checkpoint").is_in(keys))
        other = rows.filter(pl.col("selection") != sel)
        if other.height:
            raise UserError(f"{what} holds {other['selection'][0]} sets where this run selects {sel}: pass a run "
                            f"with --selection {sel}")
        if rows.height == 0:
            raise UserError(f"{what} shares no labeled set with this run's checkpoints and budgets "
                            f"({', '.join(budgets)}): pass a run of the same Trace checkpoints and budgets")
        out.append(rows.sort("kl_mean", "decision").group_by("prompt_id", "checkpoint", "budget",
                                                             maintain_order=True).first())
    return out


def read_search_from(trace, cfg: DecisionsConfig, items: dict[str, list[int]]) -> Imported:
    """The candidates ``cfg.search_from`` gives at this run's checkpoints ``items`` and budgets
    (:func:`check_search_from`'s rows, decoded); ``trace``: a ``kvdiag.trace.Trace`` (its recorded attention windows
    check the sets). A set this run could not have made is a ``UserError`` naming its file."""
    from kvdiag.decisions.search import visible_entries
    from kvdiag.decisions.sets import mask_set, unpack_set

    out: Imported = {}
    L, Hkv = trace.num_layers, trace.num_kv_heads
    sel = cfg.selection.deterministic
    budgets = {b.name: b for b in cfg.budgets}
    layers = [trace.layer_attention(l) for l in range(L)]
    for i, (path, best) in enumerate(zip(cfg.search_from, check_search_from(trace, cfg, items), strict=True), 1):
        for r in best.iter_rows(named=True):
            pid, t, b = r["prompt_id"], int(r["checkpoint"]), r["budget"]
            mask = unpack_set(r["evicted_mask"], L, Hkv, t)
            _check_set(mask, budgets[b].entries(t), visible_entries(layers, t), sel.per_token,
                       f"--search-from {path}: {r['decision']}'s set at checkpoint {t} of {pid!r}, {b}")
            evict = mask[0, 0].nonzero()[:, 0] if sel.per_token else mask_set(mask)
            out.setdefault((pid, t), {}).setdefault(b, []).append((f"search_from{i}:{r['decision']}", evict))
    return out


def _check_set(mask: torch.Tensor, kept: int, visible: torch.Tensor, per_token: bool, what: str) -> None:
    """Refuse a set (``mask [L, Hkv, t]``) this run could not have made keeping ``kept`` (``visible [L, t]``)."""
    t = mask.shape[-1]
    if per_token:
        if not (mask == mask[:1, :1]).all() or int(mask[0, 0].sum()) != t - kept:
            raise UserError(f"{what} is not a token set evicting {t - kept} of {t} entries: pass a run of the same "
                            "budgets and selection")
        return
    seen = visible[:, None, :].expand_as(mask)
    want = seen.sum(-1).clamp(max=kept)  # a sliding layer keeps what it still sees, up to the budget
    have = (~mask & seen).sum(-1)
    bad = (have != want) | (mask & ~seen).any(-1)
    if bad.any():
        l, h = bad.nonzero()[0].tolist()
        raise UserError(f"{what} keeps {int(have[l, h])} of the entries layer {l}, KV head {h} sees, or evicts one it "
                        f"cannot see, where this run's sets keep {int(want[l, h])} of them and evict none it cannot: "
                        "pass a run of the same budgets made by this kvdiag")
