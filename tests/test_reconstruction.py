"""``oracle_search``'s reconstruction start (kvdiag.decisions.reconstruction) against the slow obvious reference:
each query head's attention recomputed with the evicted keys deleted from its logits, on tiny random models with
sliding windows (gemma3), a logit softcap (gemma2) and sinks (gpt_oss)."""

from __future__ import annotations

import pytest
import torch

from kvdiag.decisions import reconstruction as R
from kvdiag.decisions.search import visible_entries
from kvdiag.label import OracleEngine
from kvdiag.model.adapters import attention_modules, output_projection
from kvdiag.model.load import load_model
from kvdiag.trace.reader import rebuild_layers

T, S = 40, 8  # a checkpoint at t = T - S - 4 reads the S steps after it
MODELS = ["tiny:llama", "tiny:gemma2", "tiny:gemma3", "tiny:gpt_oss"]


def _ids(lm, n: int, seed: int = 0) -> torch.Tensor:
    vocab = lm.model.get_input_embeddings().weight.shape[0]
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def physical_error(x: dict, attention, wo: torch.Tensor, t: int, keep: torch.Tensor) -> torch.Tensor:
    """[Hkv]: sum over each KV head's query heads and the S read steps of ||W_j (o_j(keep) - o_j(all))||^2, each
    output recomputed in float64 from q/k/v with the evicted prefix keys' logits set to -inf (deleted)."""
    q, k, v = (x[n].double() for n in ("q", "k", "v"))
    hq, hkv, d = q.shape[0], k.shape[0], v.shape[-1]
    g = hq // hkv
    qpos, kpos = torch.arange(t, t + S), torch.arange(t + S)
    k, v = k[:, : t + S].repeat_interleave(g, 0), v[:, : t + S].repeat_interleave(g, 0)
    logits = attention.logits(q[:, t : t + S] @ k.transpose(1, 2)).masked_fill(attention.hidden(qpos, kpos), -torch.inf)

    def out(mask: torch.Tensor) -> torch.Tensor:  # mask [Hq, t] True = kept
        hidden = torch.cat([~mask, torch.zeros(hq, S, dtype=torch.bool)], -1)[:, None, :]
        probs = attention.softmax(logits.masked_fill(hidden, -torch.inf), heads_dim=0).double()
        blocks = wo.double().view(wo.shape[0], hq, d).transpose(0, 1)  # [Hq, hidden, d]
        return (probs @ v) @ blocks.transpose(1, 2)  # [Hq, S, hidden]

    diff = out(keep.bool().repeat_interleave(g, 0)) - out(torch.ones(hq, t, dtype=torch.bool))
    return diff.pow(2).sum((1, 2)).view(hkv, g).sum(1)


@pytest.mark.parametrize("spec", MODELS)
def test_each_candidates_cost_is_the_error_of_deleting_it(spec):
    """``_Layer.cost``: the closed-form error of evicting each entry alone from a random keep mask equals the
    physical reference (rtol 1e-4: the closed form takes its attention weights from ``attention_rows``' float32
    softmax, the reference computes in float64); evicted and unmovable entries cost inf; every layer."""
    lm = load_model(spec)
    t = T - S - 4
    x_all = rebuild_layers(lm, _ids(lm, t + S), torch.float32)
    mods = attention_modules(lm.model)
    gen = torch.Generator().manual_seed(1)
    visible = visible_entries(lm.attention.layers, t)
    for l, x in enumerate(x_all):
        attention, wo = lm.attention.layers[l], output_projection(mods[l]).weight.detach()
        layer = R._Layer(x["q"], x["k"], x["v"], attention, wo, t, S)
        hkv = x["k"].shape[0]
        keep = (torch.rand(hkv, t, generator=gen) > 0.3).double()
        movable = visible[l].expand(hkv, t)
        cost = layer.cost(keep, movable)
        assert torch.isinf(cost[~(movable & (keep > 0))]).all()
        for h in range(hkv):
            for i in (movable[h] & (keep[h] > 0)).nonzero()[:, 0].tolist():
                gone = keep.clone()
                gone[h, i] = 0
                want = float(physical_error(x, attention, wo, t, gone)[h])
                assert float(cost[h, i]) == pytest.approx(want, rel=1e-4, abs=1e-12), (spec, l, h, i)


@pytest.mark.parametrize("spec", ["tiny:llama", "tiny:gemma3"])
def test_each_round_evicts_what_deleting_hurts_least(spec, monkeypatch):
    """``reconstruction_set`` one entry a round (CHUNK 1): at every round each cell evicts an entry whose physical
    error (the reference) is the least of the cell's candidates (within 1e-4 relative: float32 weights); each cell
    evicts as many entries its queries see as the start does, and the start's other entries keep their status."""
    monkeypatch.setattr(R, "CHUNK", 1)
    lm = load_model(spec)
    t = T - S - 4
    ids = _ids(lm, T, seed=2)
    engine = OracleEngine(lm, ids, S, batch_size=4)
    L, hkv = engine.num_layers, engine.num_kv_heads
    visible = visible_entries(engine.attention.layers, t)
    movable = visible[:, None].expand(L, hkv, t)
    gen = torch.Generator().manual_seed(3)
    start = (torch.rand(L, hkv, t, generator=gen) < 0.5) & movable
    start[..., 0] |= ~movable[..., 0]  # an entry no query sees, evicted by the start: it stays so
    got = R.reconstruction_set(engine, t, start, movable)
    assert torch.equal((got & movable).sum(-1), (start & movable).sum(-1))
    assert torch.equal(got[~movable], start[~movable])
    layers = rebuild_layers(lm, ids[: t + S], torch.float32)
    mods = attention_modules(lm.model)
    for l, x in enumerate(layers):
        attention, wo = lm.attention.layers[l], output_projection(mods[l]).weight.detach()
        layer = R._Layer(x["q"], x["k"], x["v"], attention, wo, t, S)
        keep = (movable[l] | ~start[l]).double()  # as reconstruction_set starts: every movable entry kept
        for _ in range(int((start[l] & movable[l]).sum(-1).max())):
            count = ((keep == 1) & movable[l]).sum(-1) - (~got[l] & movable[l]).sum(-1)  # still to evict per cell
            after = layer.evict(keep, movable[l], count.clamp(max=1))
            for h in (count > 0).nonzero()[:, 0].tolist():
                chosen = int(((keep[h] == 1) & (after[h] == 0)).nonzero()[0, 0])
                costs = {}
                for i in ((keep[h] == 1) & movable[l, h]).nonzero()[:, 0].tolist():
                    gone = keep.clone()
                    gone[h, i] = 0
                    costs[i] = float(physical_error(x, attention, wo, t, gone)[h])
                assert costs[chosen] <= min(costs.values()) * (1 + 1e-4) + 1e-12, (spec, l, h, chosen)
            keep = after
        assert torch.equal(torch.where(movable[l], keep == 0, start[l]), got[l])  # the rounds are the set's
