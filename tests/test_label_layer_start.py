"""Layer start is exact: a row that evicts from one layer, run from that layer on the null row's hidden states,
equals the same row run through the full depth, on every tiny family (windows, softcap, sinks, rotary per layer
type, logit scaling and softcap all stay the model's own)."""

from __future__ import annotations

import functools

import pytest
import torch

from kvdiag.label import OracleEngine, candidate_rows
from kvdiag.model.adapters import capturing_layer_inputs, decoder_layers, starting_at_layer
from kvdiag.model.load import load_model
from tests.test_conformance import CANDIDATES, EXACT_FAMILIES, HORIZON, LENGTH, T_CKPT


@functools.cache
def model(name):
    return load_model(f"tiny:{name}")


@pytest.mark.parametrize("name", EXACT_FAMILIES)
def test_layer_start_equals_full_depth(name):
    """Same rows, same batch shapes, different path (the layers below are skipped): KL within 1e-5 nats absolute
    + 1e-4 relative in fp32, NLL delta the same, top-1 flips equal. (Layer start = physical deletion is
    ``test_conformance.test_labels_equal_physical_deletion``, which runs the engine with layer start on.)"""
    lm = model(name)
    ids = torch.randint(0, 250, (LENGTH,), generator=torch.Generator().manual_seed(0))
    start = OracleEngine(lm, ids, horizon=HORIZON, batch_size=8, layer_start=True)
    full = OracleEngine(lm, ids, horizon=HORIZON, batch_size=8, layer_start=False)
    for granularity in ("layer", "head"):
        rows = candidate_rows(CANDIDATES, granularity, start.num_layers, start.num_kv_heads)
        a, na = start.label(T_CKPT, rows)
        b, nb = full.label(T_CKPT, rows)
        torch.testing.assert_close(a["kl"], b["kl"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a["nll_delta"], b["nll_delta"], rtol=1e-4, atol=1e-5)
        assert torch.equal(a["flips"], b["flips"]) and abs(na - nb) <= 1e-6
        assert a["kl"][[r.layer == start.num_layers - 1 for r in rows]].sum() > 0  # the top layer's rows run


def test_starting_at_a_layer_reproduces_the_forward(tiny_llama):
    """The model's own forward from layer l on the captured input of layer l gives the same logits as the whole
    forward (1e-5 absolute, fp32), and the layers below l do not run at all."""
    m = tiny_llama.model
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), capturing_layer_inputs(m) as inputs:
        want = m(ids).logits
    assert len(inputs) == len(decoder_layers(m)) == 2
    calls = []
    hook = decoder_layers(m)[0].mlp.register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad(), starting_at_layer(m, 1, inputs[1]):
            got = m(ids).logits
    finally:
        hook.remove()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not calls
    with torch.no_grad():  # and the model is restored afterwards
        torch.testing.assert_close(m(ids).logits, want, rtol=0, atol=1e-5)


def test_layer_start_bench_times_both_methods_batch_by_batch():
    """``kvdiag bench label --granularity head``: both methods label the same rows in the same number of batches,
    timed in alternation; every repeat gives a ratio; the labels agree within the layer-start tolerance."""
    from typer.testing import CliRunner

    from kvdiag.cli.main import app
    from kvdiag.label.bench import run_layer_start_bench

    lm = model("llama")
    res = run_layer_start_bench(lm, "head", prefix_len=24, n=4, horizon=4, repeats=2)
    L, Hkv = lm.attention.num_layers, lm.attention.num_kv_heads
    assert res.labeled == 4 * L * Hkv and len(res.ratios) == 2 and all(r > 0 for r in res.ratios)
    assert [r.method for r in res.rows] == ["layer start (from the evicted layer)", "full depth (before layer start)"]
    assert all(r.seconds > 0 and r.tokens_per_s > 0 for r in res.rows)
    assert res.max_abs_diff <= 1e-5
    out = CliRunner().invoke(
        app,
        [
            "bench", "label", "--model", "tiny:llama", "--granularity", "layer", "--prefix", "24", "--n", "4",
            "--horizon", "4", "--repeats", "1",
        ],
    )
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert f"({4 * L} rows)" in text and "per repeat:" in text and "labels differ by at most" in text
