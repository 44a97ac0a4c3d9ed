"""Conformance matrix: every model family kvdiag knows, on a tiny random model, is exact or refused in one line.

Exact means, for each family (``kvdiag.model.load.TINY``; semantics from ``kvdiag.model.adapters``):
- trace: the recorded continuation is the model's own greedy decoding (its default attention implementation),
  and attention recomputed from the recorded q/k (``Trace.attention``) equals the model's eager attention
  weights (``output_attentions=True``) within 1e-5;
- label: token, layer and head granularity equal the slow reference (stock eager attention, entry physically
  deleted, absolute-position masks) within 1e-4 relative + 1e-6 nats; entries outside a sliding layer's window
  label exactly 0 at that layer.
Adding a family = one adapter entry (``kvdiag.model.adapters.FAMILIES``) + one tiny model line + one line here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from types import SimpleNamespace

import pytest
import torch

from kvdiag.core.errors import UserError
from kvdiag.label import OracleEngine, Row, candidate_rows, divergences
from kvdiag.label.reference import reference_logprobs, reference_set_logprobs
from kvdiag.model.adapters import FAMILIES, LayerAttention, check_kwargs, family_of
from kvdiag.model.attention import attn_implementation
from kvdiag.model.load import load_model

EXACT = "exact"
MLA = "multi-head latent attention"
MATRIX = {  # tiny spec -> EXACT or the refusal's key phrase
    "llama": EXACT,
    "qwen2": EXACT,
    "qwen3": EXACT,
    "qwen3_moe": EXACT,
    "mistral": EXACT,  # no window
    "mistral_sw": EXACT,  # window 8 on every layer
    "phi3": EXACT,  # partial rotary
    "olmo2": EXACT,
    "granite": EXACT,  # attention_multiplier as the scale
    "cohere": EXACT,
    "smollm3": EXACT,  # NoPE layers
    "gpt_neox": EXACT,  # no num_key_value_heads in its config
    "gemma2": EXACT,  # softcap 5, sliding + full layers
    "gemma3": EXACT,  # sliding + full layers
    "gemma3_cg": EXACT,  # Gemma3ForConditionalGeneration, nested text config
    "gpt_oss": EXACT,  # sinks (3..5), sliding + full layers
    "deepseek_v2": MLA,
    "deepseek_v3": MLA,
}
EXACT_FAMILIES = [k for k, v in MATRIX.items() if v == EXACT]
REFUSED = [k for k, v in MATRIX.items() if v != EXACT]

T_CKPT, HORIZON, LENGTH = 30, 4, 40
# 0 and 5 lie outside a window of 8 at checkpoint 30 (i <= t - window), 21..23 at its edge, 29 the newest
CANDIDATES = [0, 5, 21, 22, 23, 29]
PROMPT = "Q: 12+7=?\n"  # 10 byte tokens; 30 new tokens cross a window of 8


@functools.cache
def model(name):
    return load_model(f"tiny:{name}")


def test_matrix_covers_every_family():
    from kvdiag.model.load import TINY

    assert set(MATRIX) == set(TINY)
    families = {model_type for model_type in FAMILIES}
    covered = {"gemma3_text" if k.startswith("gemma3") else k.removesuffix("_sw") for k in MATRIX}
    assert families == covered


# ---- trace -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.txt"
    path.write_text(PROMPT)
    return path


@pytest.mark.parametrize("name", EXACT_FAMILIES)
def test_trace_equals_the_model(name, prompts_file, tmp_path):
    from kvdiag.tasks.prompts import load_prompts
    from kvdiag.trace import GenerationSettings, Trace, trace_prompts

    lm = model(name)
    settings = GenerationSettings(
        max_new_tokens=LENGTH - len(PROMPT), chat=False, instruction=None, storage_dtype="float32"
    )
    trace_prompts(lm, load_prompts(str(prompts_file)), tmp_path / "t", settings, show_progress=False)
    trace = Trace(tmp_path / "t")
    pid = trace.prompt_ids[0]
    ids = trace.token_ids(pid)
    P = trace.prompt_len(pid)
    # the recorded continuation is the model's own greedy decoding with its default attention
    greedy = lm.model.generate(ids[None, :P], attention_mask=torch.ones(1, P, dtype=torch.long), do_sample=False,
                               max_new_tokens=len(ids) - P, min_new_tokens=len(ids) - P)[0]
    assert torch.equal(greedy[: len(ids)], ids)
    # attention recomputed from the recorded q/k = the model's eager attention weights
    with attn_implementation(lm.model, "eager"), torch.no_grad():
        weights = lm.model(ids[None], output_attentions=True).attentions
    T = len(ids)
    for layer in range(trace.num_layers):
        got = trace.attention(pid, layer, torch.arange(T))
        torch.testing.assert_close(got, weights[layer][0].float(), rtol=0, atol=1e-5)
    # the manifest records the semantics
    att = json.loads((tmp_path / "t" / "manifest.json").read_text())["model"]["attention"]
    ma = lm.attention
    assert att["windows"] == [l.window for l in ma.layers]
    assert att["sinks"] == (name == "gpt_oss") and att["softcap"] == (name == "gemma2")
    assert att["qk_head_dim"] == att["v_head_dim"] == 16


# ---- label -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXACT_FAMILIES)
def test_labels_equal_physical_deletion(name):
    lm = model(name)
    ids = torch.randint(0, 250, (LENGTH,), generator=torch.Generator().manual_seed(0))
    eng = OracleEngine(lm, ids, horizon=HORIZON, batch_size=8)
    prefix, logp_full = eng.golden(T_CKPT)
    targets = eng.ids[T_CKPT + 1 : T_CKPT + HORIZON + 1]
    total = 0.0
    for granularity in ("token", "layer", "head"):
        rows = candidate_rows(CANDIDATES, granularity, eng.num_layers, eng.num_kv_heads)
        got, noise = eng.label(T_CKPT, rows)
        assert 0 <= noise <= 1e-6
        for j, row in enumerate(rows):
            ref = reference_logprobs(lm.model, eng.ids, T_CKPT, HORIZON, prefix, row)
            want = divergences(logp_full, ref[None], targets)
            torch.testing.assert_close(
                got["kl"][j], want["kl"][0], rtol=1e-4, atol=1e-6, msg=lambda m, row=row: f"{name} {row}: {m}"
            )
            assert got["flips"][j] == want["flips"][0]
            window = lm.attention.layers[row.layer].window if row.layer >= 0 else None
            if window is not None and row.position <= T_CKPT - window:
                assert (got["kl"][j] == 0).all()  # invisible to every horizon query of that layer
        total += float(got["kl"].mean())
    assert total > 1e-4  # the evictions really do something


@pytest.mark.parametrize("name", EXACT_FAMILIES)
def test_set_labels_equal_physical_deletion(name):
    """Joint labels of evicted sets (decisions' set rows: many exclusions per row, through the same kernel) equal
    deleting the set from a copied cache: a token set (the same entries from every layer and head, deleted
    physically) and a per-head set (its own entries per layer and KV head, hidden per head in the reference), within
    1e-4 relative + 1e-6 nats, on every exact family."""
    lm = model(name)
    ids = torch.randint(0, 250, (LENGTH,), generator=torch.Generator().manual_seed(0))
    eng = OracleEngine(lm, ids, horizon=HORIZON, batch_size=3)
    prefix, logp_full = eng.golden(T_CKPT)
    targets = eng.ids[T_CKPT + 1 : T_CKPT + HORIZON + 1]
    gen = torch.Generator().manual_seed(1)
    L, Hkv = eng.num_layers, eng.num_kv_heads
    per_head = torch.stack([torch.stack([torch.randperm(T_CKPT, generator=gen)[:12] for _ in range(Hkv)])
                            for _ in range(L)])  # [L, Hkv, 12]: a different set per layer and KV head
    per_head[0, 0, -2:] = -1  # padding: one head evicts fewer
    sets = [torch.tensor(CANDIDATES), torch.randperm(T_CKPT, generator=gen)[:20], per_head, torch.tensor([-1])]
    got, noise = eng.label_sets(T_CKPT, sets)
    assert 0 <= noise <= 1e-6 and got["kl"].shape == (len(sets), HORIZON)
    for j, evict in enumerate(sets):
        ref = reference_set_logprobs(lm.model, eng.ids, T_CKPT, HORIZON, prefix, evict)
        want = divergences(logp_full, ref[None], targets)
        torch.testing.assert_close(got["kl"][j], want["kl"][0], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, j=j: f"{name} set {j}: {m}")
        assert got["flips"][j] == want["flips"][0]
    assert float(got["kl"][:3].mean()) > 1e-4 and float(got["kl"][3].max()) <= 1e-6  # the empty set is a null row
    # a one-entry set is the single label of that entry
    single, _ = eng.label(T_CKPT, [Row(CANDIDATES[2])])
    one, _ = eng.label_sets(T_CKPT, [torch.tensor([CANDIDATES[2]])])
    torch.testing.assert_close(one["kl"], single["kl"], rtol=1e-5, atol=1e-7)


def test_windows_make_labels_zero_outside_and_nonzero_inside():
    """On the all-sliding Mistral, an entry outside the window of every horizon query is 0 at every granularity;
    one inside is not."""
    lm = model("mistral_sw")
    ids = torch.randint(0, 250, (LENGTH,), generator=torch.Generator().manual_seed(0))
    eng = OracleEngine(lm, ids, horizon=HORIZON)
    got, _ = eng.label(T_CKPT, [Row(T_CKPT - 8), Row(T_CKPT - 7), Row(T_CKPT - 8, 1, 0)])
    assert (got["kl"][0] == 0).all() and (got["kl"][2] == 0).all()
    assert got["kl"][1].max() > 1e-6


@pytest.mark.parametrize("name", ["gpt_oss", "gemma2", "mistral_sw"])
def test_semantics_the_model_passes_must_match_the_adapter(name):
    """A spec without the sinks / softcap / window the layer passes to attention is refused, never computed."""
    lm = model(name)
    eng = OracleEngine(lm, torch.arange(LENGTH) % 250, horizon=HORIZON)
    plain = [LayerAttention(l.scale) for l in eng.attention.layers]
    eng.attention = dataclasses.replace(eng.attention, layers=plain)
    eng.invisible = lambda t, row: False
    with pytest.raises(UserError, match="adapter"):
        eng.label(T_CKPT, [Row(3)])


def test_gemma3_conditional_generation_is_its_text_model():
    from kvdiag.model.load import _tiny

    cg, _ = _tiny("gemma3_cg", 0)
    lm = model("gemma3_cg")
    assert type(cg).__name__ == "Gemma3ForConditionalGeneration" and type(lm.model).__name__ == "Gemma3ForCausalLM"
    ids = torch.randint(0, 250, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, cg(input_ids=ids).logits, rtol=0, atol=1e-5)


# ---- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REFUSED)
def test_refused_in_one_line(name):
    with pytest.raises(UserError) as err:
        load_model(f"tiny:{name}")
    msg = str(err.value)
    assert "\n" not in msg and name in msg and MATRIX[name] in msg


def test_unknown_architecture_is_refused_before_weights(tmp_path):
    from transformers import BloomConfig

    BloomConfig(n_layer=2, hidden_size=64, n_head=4).save_pretrained(tmp_path)  # no weights at all
    with pytest.raises(UserError, match="'bloom'.*not known") as err:
        load_model(str(tmp_path))
    assert "\n" not in str(err.value)


def test_config_transformers_cannot_read_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "not_a_model_type", "architectures": ["X"]}')
    with pytest.raises(UserError, match="config cannot be read") as err:
        load_model(str(tmp_path))
    assert "\n" not in str(err.value)


def test_unsupported_attention_is_refused():
    chunked = SimpleNamespace(model_type="qwen3", num_hidden_layers=2, sliding_window=8,
                              layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(UserError, match="chunked_attention"):
        family_of(chunked)
    layer = SimpleNamespace(layer_idx=0)
    spec = LayerAttention(0.25, window=8)
    check_kwargs(layer, spec, {"sliding_window": 8, "position_ids": None}, "label")  # known, consistent
    with pytest.raises(UserError, match="does not honour"):
        check_kwargs(layer, spec, {"block_mask": object()}, "label")
    with pytest.raises(UserError, match="sliding_window=16"):
        check_kwargs(layer, spec, {"sliding_window": 16}, "label")
