"""Features against slow, obvious references (dense attention, Python loops) and hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from kvdiag.core.errors import UserError
from kvdiag.scorers import features as F


def dense_attention(q, k, scale):
    """Reference: full causal attention [H, T, T] with repeat_kv (query head h reads KV head h // g)."""
    H, T, _ = q.shape
    g = H // k.shape[0]
    logits = q @ k.repeat_interleave(g, dim=0).transpose(1, 2) * scale
    logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits, dim=-1)


def qkv(H=4, Hkv=2, T=40, d=8, seed=0, spread=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(H, T, d, generator=gen) * spread, torch.randn(Hkv, T, d, generator=gen) * spread,
            torch.randn(Hkv, T, d, generator=gen))


def test_window_attention_matches_dense_rows():
    q, k, _ = qkv()
    t, w = 30, 6
    ref = dense_attention(q[:, :t], k[:, :t], 0.3)[:, t - w : t]
    torch.testing.assert_close(F.window_attention(q[:, :t], k[:, :t], 0.3, w), ref)
    assert F.window_attention(q[:, :3], k[:, :3], 0.3, 8).shape == (4, 3, 3)  # clipped at position 0


def test_read_pressure_by_hand():
    # one KV head, two query heads, two window queries, four entries; candidates {0, 1, 3}
    attn = torch.tensor([
        [[0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.1, 0.4]],  # head 0: mass [0.5, 0.3, 0.4, 0.8], candidates 1.6
        [[0.5, 0.0, 0.5, 0.0], [0.3, 0.3, 0.2, 0.2]],  # head 1: mass [0.8, 0.3, 0.7, 0.2], candidates 1.3
    ])
    cand = torch.tensor([True, True, False, True])
    p = F.read_pressure(attn, cand, num_kv_heads=1)
    expected = ((torch.tensor([0.5, 0.3, 0.4, 0.8]) / 1.6 + torch.tensor([0.8, 0.3, 0.7, 0.2]) / 1.3) / 2)[None]
    torch.testing.assert_close(p, expected)
    assert p[0, cand].sum().item() == pytest.approx(1.0)


def test_mean_cosine_redundancy_matches_pairwise_loop():
    _, k, _ = qkv(T=12)
    cand = torch.rand(12, generator=torch.Generator().manual_seed(3)) > 0.3
    got = F.mean_cosine_redundancy(k, cand)
    idx = cand.nonzero().flatten().tolist()
    for h in range(k.shape[0]):
        for i in range(12):
            others = [j for j in idx if j != i]
            ref = sum(torch.cosine_similarity(k[h, i], k[h, j], dim=0).item() for j in others) / len(others)
            assert got[h, i].item() == pytest.approx(ref, abs=1e-5)


def test_mean_cosine_redundancy_single_candidate_is_zero():
    _, k, _ = qkv(T=5)
    cand = torch.tensor([False, False, True, False, False])
    assert F.mean_cosine_redundancy(k, cand)[:, 2].abs().max().item() < 1e-6


def rkv_cal_similarity_reference(k, threshold=0.5):
    """Literal transcription of R-KV's cal_similarity (retain_direction "last") on the full n × n matrix."""
    kn = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = kn @ kn.transpose(-1, -2)
    n = k.shape[1]
    sim.masked_fill_(torch.eye(n, dtype=torch.bool), 0.0)
    idx = torch.where(sim > threshold, torch.arange(n), torch.zeros(n, dtype=torch.long))
    sim.scatter_(-1, idx.max(dim=-1).values.unsqueeze(-1), 0)
    return sim.mean(dim=-2).softmax(dim=-1)


def test_rkv_redundancy_by_hand():
    # keys (d = 2) chosen so the cosine matrix is simple; see the retain rule row by row
    k = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [1.0, 1.0], [-1.0, 0.0]]])
    c = 1 / math.sqrt(2)
    # row 0: S > 0.5 at j = 2 (1) and 3 (c) -> zero j = 3;  row 1: j = 3 -> zero 3;  row 2: j = 0, 3 -> zero 3;
    # row 3: j = 0, 1, 2 -> zero 2;  row 4: none -> zero column 0 (R-KV's quirk; S_40 was -1)
    after = torch.tensor([[0, 0, 1, 0, -1], [0, 0, 0, 0, 0], [1, 0, 0, 0, -1], [c, c, 0, 0, -c], [0, 0, -1, -c, 0]])
    expected = torch.softmax(after.sum(dim=0) / 5, dim=0)
    torch.testing.assert_close(F.rkv_redundancy(k)[0], expected.float())


@pytest.mark.parametrize("d", [4, 16])  # d = 16: many rows without a near-duplicate (column-0 quirk)
def test_rkv_redundancy_blocks_equal_reference(d):
    _, k, _ = qkv(T=33, d=d)
    k[:, 10] = k[:, 3] * 2  # near-duplicates exercise the retain rule
    k[:, 0] = k[:, 20]  # row 0 with a match
    ref = rkv_cal_similarity_reference(k)
    for block in (256, 5, 1):
        torch.testing.assert_close(F.rkv_redundancy(k, block=block), ref)


def test_value_payload_kinds_by_hand():
    v = torch.tensor([[[3.0, -4.0, 0.0], [1.0, 1.0, 1.0]]])
    torch.testing.assert_close(F.value_payload(v, "l2"), torch.tensor([[5.0, math.sqrt(3)]]))
    torch.testing.assert_close(F.value_payload(v, "l1"), torch.tensor([[7.0, 3.0]]))
    torch.testing.assert_close(F.value_payload(v, "range"), torch.tensor([[7.0, 0.0]]))
    # var: mean -1/3, squared deviations (100 + 121 + 1) / 9, divided by d = 3
    torch.testing.assert_close(F.value_payload(v, "var"), torch.tensor([[222 / 27, 0.0]]))
    with pytest.raises(UserError, match="unknown"):
        F.value_payload(v, "nope")


def test_value_payload_wo_l2_matches_explicit_projection():
    H, Hkv, T, d, hidden = 4, 2, 6, 3, 5
    _, _, v = qkv(H, Hkv, T, d)
    o_proj = torch.randn(hidden, H * d, generator=torch.Generator().manual_seed(1))
    got = F.value_payload(v, "wo_l2", o_proj, H)
    for kv in range(Hkv):
        for i in range(T):
            norms = [(o_proj[:, h * d : (h + 1) * d] @ v[kv, i]).norm() for h in range(kv * 2, kv * 2 + 2)]
            assert got[kv, i].item() == pytest.approx(sum(norms).item() / 2, rel=1e-5)
    with pytest.raises(UserError, match="needs the model"):
        F.value_payload(v, "wo_l2")


def test_pooling_same_size():
    x = torch.tensor([[1.0, 5.0, 2.0, 0.0, 0.0, 3.0]])
    torch.testing.assert_close(F.max_pool(x, 3), torch.tensor([[5.0, 5.0, 5.0, 2.0, 3.0, 3.0]]))
    torch.testing.assert_close(F.avg_pool(x, 3), torch.tensor([[6.0, 8.0, 7.0, 2.0, 3.0, 3.0]]) / 3)


# --------------------------------------------------------------------------- streamed history


def test_column_sum_matches_dense_prefix_sums_any_order_and_chunking():
    q, k, _ = qkv(T=50)
    dense = dense_attention(q, k, 0.25)
    hist = F.AttentionHistory(q, k, 0.25, chunk_elements=4 * 50 * 3)  # ~3 queries per chunk
    for t in (20, 37, 50, 11):  # the last one goes backwards and restarts the stream
        got = hist.get(("colsum",), lambda: F.ColumnSum(4, 50), t).snapshot(t)
        torch.testing.assert_close(got, dense[:, :t, :t].sum(dim=1))


def recurrence_reference(probs, prompt_len, alpha, t):
    """Step-by-step replay of LazyEviction's update (one query per decode step), as in the official loop."""
    H, T, _ = probs.shape
    ts = [[max(j - prompt_len, 0) for j in range(T)] for _ in range(H)]
    mri = [[0.0] * T for _ in range(H)]
    for tau in range(prompt_len, t):
        step = tau - prompt_len + 1
        for h in range(H):
            for j in range(tau + 1):
                if probs[h, tau, j] >= alpha:
                    mri[h][j] = max(mri[h][j], step - ts[h][j])
                    ts[h][j] = step
    return torch.tensor(ts)[:, :t].float(), torch.tensor(mri)[:, :t]


def test_recurrence_matches_step_loop():
    q, k, _ = qkv(H=2, Hkv=1, T=40, spread=1.5)
    dense = dense_attention(q, k, 0.3)
    alpha, P = 0.06, 9
    hist = F.AttentionHistory(q, k, 0.3, chunk_elements=2 * 40 * 4)
    for t in (25, 40):
        ts, mri = hist.get(("rec", alpha), lambda: F.Recurrence(2, 40, P, alpha), t).snapshot(t)
        ts_ref, mri_ref = recurrence_reference(dense, P, alpha, t)
        torch.testing.assert_close(ts, ts_ref)
        torch.testing.assert_close(mri, mri_ref)
    assert mri.max() > 1  # the case exercises real recurrences


def test_tracker_registered_late_replays_the_past():
    q, k, _ = qkv(T=30)
    dense = dense_attention(q, k, 0.2)
    hist = F.AttentionHistory(q, k, 0.2)
    hist.get(("colsum",), lambda: F.ColumnSum(4, 30), 20)
    sp = hist.get(("sparsity", 0.01), lambda: F.Sparsity(4, 30, 0.01), 25).snapshot(25)
    colsum = hist.get(("colsum",), lambda: F.ColumnSum(4, 30), 25).snapshot(25)
    torch.testing.assert_close(colsum, dense[:, :25, :25].sum(dim=1))
    for tau in (0, 7, 24):
        row = dense[:, tau, : tau + 1]
        ref = (row < 0.01 * row.amax(dim=-1, keepdim=True)).float().mean(dim=-1)
        torch.testing.assert_close(sp[:, tau], ref)


def test_history_refuses_checkpoint_beyond_queries():
    q, k, _ = qkv(T=10)
    with pytest.raises(ValueError, match="beyond"):
        F.AttentionHistory(q, k, 0.2).get(("colsum",), lambda: F.ColumnSum(4, 10), 11)


def test_thought_segments_by_hand():
    # prompt of 2 tokens, segments of 2 steps: [2, 4) sparse (T), [4, 6) dense (E), [6, 8) middling (R)
    sparsity = torch.tensor([0.0, 0.0, 0.9, 0.8, 0.1, 0.2, 0.5, 0.4])
    segment, classes = F.thought_segments(sparsity, prompt_len=2, segment_len=2, thresholds=(0.3, 0.7))
    assert segment.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert classes.tolist() == [F.REASONING, F.TRANSITION, F.EXECUTION, F.REASONING]
    # default tertile thresholds of the segment means (0.85, 0.15, 0.45) give the same classes
    assert F.thought_segments(sparsity, 2, 2)[1].tolist() == classes.tolist()
