"""Superadditive pairs: two entries each harmless alone (single label at or below the harm threshold) whose joint
eviction is harmful (above it). Searched inside the most damaging sets of each checkpoint, where joint damage runs
far above the sum of single labels, and described by what the two entries share: a near-duplicate key (cosine over
the layers' and KV heads' keys), the same token, adjacency.
"""

from __future__ import annotations

import itertools

import polars as pl
import torch

from kvdiag.decisions.config import RANDOM_REFERENCE

PAIR_SCHEMA = {
    "prompt_id": pl.String, "checkpoint": pl.Int64, "decision": pl.String, "budget": pl.String, "i": pl.Int64,
    "j": pl.Int64, "single_i": pl.Float64, "single_j": pl.Float64, "pair_kl": pl.Float64, "superadditive": pl.Boolean,
    "same_token": pl.Boolean, "adjacent": pl.Boolean, "key_cosine": pl.Float64,
}
NEAR_DUPLICATE = 0.9  # a key cosine (mean over layers and KV heads) at or above this is a near-duplicate key


def set_members(row: dict, num_cells: int) -> list[int]:
    """The positions of a decision's set: its token set, or (a per-head set) the positions at least half of the
    ``num_cells`` (layer, KV head) cells evict."""
    if row["evicted_positions"] is not None:
        return list(row["evicted_positions"])
    return [i for i, n in enumerate(row["evicted_heads"]) if 2 * n >= num_cells]


def key_cosines(prefix, positions: list[int]) -> torch.Tensor:
    """[M, M] cosine of the entries' keys, mean over layers and KV heads; prefix[l] = (k, v) [Hkv, t, d]."""
    idx = torch.tensor(positions)
    total = 0.0
    for k, _ in prefix:
        keys = torch.nn.functional.normalize(k[:, idx.to(k.device)].float(), dim=-1)  # [Hkv, M, d]
        total = total + (keys @ keys.transpose(1, 2)).mean(0).cpu()
    return total / len(prefix)


def superadditive_pairs(engine, pid: str, t: int, table: pl.DataFrame, singles: torch.Tensor, threshold: float,
                        cfg, lm, progress=None) -> pl.DataFrame:
    """Every pair of ``cfg.pair_candidates`` harmless members (the largest single labels at or below ``threshold``)
    of the ``cfg.pairs`` most damaging non-random sets in ``table`` (this checkpoint's decisions), labeled exactly as
    a two-entry set row; returns the pairs in ``PAIR_SCHEMA``."""
    L, Hkv = engine.num_layers, engine.num_kv_heads
    ranked = table.filter((pl.col("status") == "ok") & ~pl.col("decision").is_in(["random", RANDOM_REFERENCE]))
    ranked = ranked.sort("kl_mean", descending=True, maintain_order=True)  # ties (equal sets): the table's order
    ids = engine.ids.cpu()
    prefix, _ = engine.golden(t)
    rows = []
    for row in ranked.head(cfg.pairs).iter_rows(named=True):
        members = [i for i in set_members(row, L * Hkv) if float(singles[i]) <= threshold]
        members = sorted(members, key=lambda i: -float(singles[i]))[: cfg.pair_candidates]
        if len(members) < 2:
            continue
        cos = key_cosines(prefix, members)
        pairs = list(itertools.combinations(range(len(members)), 2))
        kl = engine.label_sets(t, [torch.tensor([members[a], members[b]]) for a, b in pairs], progress)[0]["kl"]
        for (a, b), value in zip(pairs, kl.double().mean(1).tolist(), strict=True):
            i, j = members[a], members[b]
            rows.append({"prompt_id": pid, "checkpoint": t, "decision": row["decision"], "budget": row["budget"],
                         "i": i, "j": j, "single_i": float(singles[i]), "single_j": float(singles[j]),
                         "pair_kl": value, "superadditive": value > threshold,
                         "same_token": bool(ids[i] == ids[j]), "adjacent": abs(i - j) == 1,
                         "key_cosine": float(cos[a, b])})
    return pl.DataFrame(rows, schema=PAIR_SCHEMA)
