"""The tracer: recording changes nothing, records post-RoPE q/k, and the Trace round-trips."""

from __future__ import annotations

import json

import pytest
import torch

from kvdiag.model.attention import attention_rows
from kvdiag.trace.hooks import Recorder, recording
from tests.conftest import make_trace


def _ids(lm, n=24):
    return torch.tensor([lm.tokenizer("Ava has 12 apples. Then Ava buys 3 more apples.").input_ids[:n]])


@torch.no_grad()
def test_tracer_logits_equal_plain_sdpa(tiny_model):
    model = tiny_model.model
    ids = _ids(tiny_model)
    assert model.config._attn_implementation == "sdpa"
    ref = model(ids).logits
    ref_short = model(ids[:, :-1]).logits  # same shape as the recorded prefill: GEMM blocking depends on it
    rec = Recorder(model.config.num_hidden_layers, torch.float32)
    with recording(model, rec):
        out = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], cache=out.past_key_values, position_ids=torch.tensor([[ids.shape[1] - 1]]))
    assert model.config._attn_implementation == "sdpa"  # restored
    # the recording path builds its own mask and calls SDPA itself, so the last bits may differ on some CPUs:
    # fp32 logits of magnitude <~10 agree within 1e-5 absolute
    torch.testing.assert_close(out.logits, ref_short, rtol=0, atol=1e-5)
    torch.testing.assert_close(step.logits[:, -1], ref[:, -1], rtol=0, atol=1e-5)
    assert rec.layer(0)["q"].shape[1] == ids.shape[1]


@torch.no_grad()
def test_recomputed_attention_equals_eager_weights(tiny_model):
    """Exact in fp32 storage; the fp16 storage tolerance is 2e-3 absolute on probabilities."""
    model = tiny_model.model
    ids = _ids(tiny_model)
    T = ids.shape[1]
    rec = Recorder(model.config.num_hidden_layers, torch.float32)
    rec16 = Recorder(model.config.num_hidden_layers, torch.float16)
    with recording(model, rec):
        model(ids)
    with recording(model, rec16):
        model(ids)
    model.set_attn_implementation("eager")
    try:
        eager = model(ids, output_attentions=True).attentions  # per layer [1, H, T, T]
    finally:
        model.set_attn_implementation("sdpa")
    scale = model.model.layers[0].self_attn.scaling
    for layer, ref in enumerate(eager):
        for r, atol in ((rec, 1e-5), (rec16, 2e-3)):
            qkv = r.layer(layer)
            got = attention_rows(qkv["q"], qkv["k"], torch.arange(T), scale)
            torch.testing.assert_close(got, ref[0].float(), rtol=0, atol=atol)


@torch.no_grad()
def test_recorded_q_k_are_post_rope_and_post_norm(tiny_model):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model.model
    ids = _ids(tiny_model)
    T = ids.shape[1]
    rec = Recorder(model.config.num_hidden_layers, torch.float32)
    with recording(model, rec):
        hs = model(ids, output_hidden_states=True).hidden_states
    layer = 1
    attn = model.model.layers[layer].self_attn
    x = model.model.layers[layer].input_layernorm(hs[layer])
    d = attn.head_dim
    q = attn.q_proj(x).view(1, T, -1, d).transpose(1, 2)
    k = attn.k_proj(x).view(1, T, -1, d).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3: RMS norm per head before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = model.model.rotary_emb(x, torch.arange(T)[None])
    q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
    got = rec.layer(layer)
    torch.testing.assert_close(got["q"], q_rot[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["k"], k_rot[0], rtol=0, atol=1e-5)
    assert (got["q"] - q[0]).abs().max() > 1e-2  # really rotated, not the raw projection


def test_gqa_head_mapping():
    """Query head h reads KV head h // g: a key that only KV head 1 makes attractive draws heads 2, 3."""
    H, Hkv, T, d = 4, 2, 5, 8
    q = torch.zeros(H, T, d)
    q[:, :, 0] = 1.0
    k = torch.zeros(Hkv, T, d)
    k[1, 2, 0] = 50.0  # key 2 of KV head 1 dominates for any query that uses KV head 1
    a = attention_rows(q, k, torch.arange(T), scale=1.0)
    assert torch.all(a[2:, 4, 2] > 0.99)  # heads 2, 3 -> KV head 1
    torch.testing.assert_close(a[:2, 4], torch.full((2, T), 1 / T))  # heads 0, 1 -> KV head 0 (uniform)


def test_trace_round_trip_and_resume(tiny_llama, tmp_path):
    path = tmp_path / "tr"
    tr1 = make_trace(tiny_llama, path, n_prompts=1, max_new_tokens=12)
    first = path / "tensors" / "arith000" / "layer_000.safetensors"
    mtime = first.stat().st_mtime_ns
    tr = make_trace(tiny_llama, path, n_prompts=2, max_new_tokens=12)  # continues: only arith001 is new
    assert first.stat().st_mtime_ns == mtime
    assert tr.prompt_ids == ["arith000", "arith001"] and tr.fingerprint != tr1.fingerprint
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["model"]["weights_hash"] == tiny_llama.weights_hash
    # tokens.parquet holds the sequence; re-running the model on it reproduces the stored q/k/v and logprobs
    ids = tr.token_ids("arith001")
    T, P = tr.length("arith001"), tr.prompt_len("arith001")
    assert ids.shape == (T,) and T > P
    rec = Recorder(tiny_llama.model.config.num_hidden_layers, torch.float32)
    with torch.no_grad(), recording(tiny_llama.model, rec):
        logits = tiny_llama.model(ids[None]).logits[0]
    for layer in range(tr.num_layers):
        stored = tr.layer("arith001", layer)
        for name in ("q", "k", "v"):
            torch.testing.assert_close(getattr(stored, name), rec.layer(layer)[name], rtol=0, atol=1e-4)
    toks = tr.tokens.filter(tr.tokens["prompt_id"] == "arith001").sort("position")
    logp = torch.log_softmax(logits[P - 1 : T - 1], -1).gather(1, ids[P:, None]).squeeze(1)
    torch.testing.assert_close(
        torch.tensor(toks["logprob"].to_list()[P:], dtype=torch.float32), logp, rtol=0, atol=1e-4
    )
    assert toks["is_prompt"].to_list() == [True] * P + [False] * (T - P)


def test_truncated_trace_is_a_clear_error(tiny_llama, tmp_path):
    from kvdiag.core.errors import UserError
    from kvdiag.trace import Trace

    tr = make_trace(tiny_llama, tmp_path / "tr", n_prompts=1, max_new_tokens=4)
    (tmp_path / "tr" / "tensors" / "arith000" / "layer_001.safetensors").unlink()
    with pytest.raises(UserError, match="missing"):
        Trace(tmp_path / "tr").layer("arith000", 1)
    with pytest.raises(UserError, match="not a Trace"):
        Trace(tmp_path)
    assert tr.length("arith000") > 0


def test_a_token_beyond_the_vocabulary_is_refused(tiny_llama, tiny_trace, tmp_path, monkeypatch):
    """tokens.parquet edited to hold a token id the model has no embedding for (the embedding lookup failed
    mid-run, IndexError): refused when the Trace is read, where the model's config tells its vocabulary (before
    torch: tiny:llama's byte vocabulary); where only a load tells (a .gguf, random:), by every stage that feeds the
    Trace's tokens to a model: label, decisions, teacher-forced replay, and the Trace's own model that rebuilds the
    tensors it does not store (score, figures, fit). Another ``--model`` (``label --force``) whose config's
    vocabulary is smaller is refused before it loads."""
    import json
    import shutil

    import polars as pl

    from kvdiag.core.errors import UserError
    from kvdiag.label import LabelConfig, label_trace
    from kvdiag.model import specs
    from kvdiag.trace import Trace
    from kvdiag.trace.manifest import TraceFiles

    copy = tmp_path / "trace"
    shutil.copytree(tiny_trace.path, copy)
    size = tiny_llama.model.get_input_embeddings().num_embeddings
    assert specs.spec_vocabulary("tiny:llama") == size  # the light config's vocabulary is the loaded model's
    tokens = pl.read_parquet(copy / "tokens.parquet")
    tokens.with_columns(pl.when(pl.int_range(pl.len()) == 3).then(size).otherwise("token_id").alias("token_id")) \
        .write_parquet(copy / "tokens.parquet")
    Trace(tiny_trace.path).check_vocabulary(tiny_llama)  # the Trace as written fits
    with pytest.raises(UserError, match=f"token id {size}, beyond the vocabulary of its model tiny:llama"):
        TraceFiles(copy)
    monkeypatch.setattr(specs, "spec_vocabulary", lambda spec, revision=None: None)  # only a load can tell
    tr = Trace(copy)
    with pytest.raises(UserError, match=f"token id {size}, beyond the vocabulary"):
        tr.check_vocabulary(tiny_llama)
    with pytest.raises(UserError, match="beyond the vocabulary"):
        tr.use_model(tiny_llama)  # the rebuild of what the Trace does not store (score)
    with pytest.raises(UserError, match="beyond the vocabulary"):
        label_trace(Trace(copy), tiny_llama, tmp_path / "l.parquet", LabelConfig(checkpoints="every:10", w_obs=10,
                                                                               horizon=2, candidates="4"),
                    show_progress=False)
    monkeypatch.undo()
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    files = TraceFiles(tiny_trace.path)
    files.check_vocabulary_of("tiny:llama")
    top = int(files.tokens["token_id"].max())
    assert top >= 100  # the byte tokens of the arithmetic prompts
    with pytest.raises(UserError, match=f"--model {small} has a vocabulary of 100 tokens and the Trace .* holds "
                                        f"token id {top}"):
        files.check_vocabulary_of(str(small))


def test_stored_tensors_of_other_shapes_are_refused(tiny_trace, tmp_path):
    """A layer file whose q, k or v has other heads or head dims than the manifest says (an edited or foreign file of
    the right length): the scorers' shape errors were 'internal error'; the reader names the shapes."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kvdiag.core.errors import UserError
    from kvdiag.trace import Trace
    from kvdiag.trace.writer import layer_file

    copy = tmp_path / "trace"
    shutil.copytree(tiny_trace.path, copy)
    pid = Trace(copy).prompt_ids[0]
    path = layer_file(copy, pid, 0)
    tensors = load_file(str(path))
    assert Trace(copy).layer(pid, 0).k.shape == tensors["k"].shape  # as written, it reads
    save_file({**tensors, "k": tensors["k"][:1].contiguous()}, str(path))  # one KV head of two
    with pytest.raises(UserError, match=r"layer 0 of .* holds q, k, v of shapes .*\(1, \d+, 16\).* manifest says"):
        Trace(copy).layer(pid, 0)


def test_non_finite_tensors_are_refused_on_read_and_never_written(tiny_trace, tmp_path):
    """A NaN or inf in a stored q/k/v (a flipped byte; a value past float16's range): score refused it blaming the
    scorer, figures wrote its figures from NaN attention (silently wrong). The reader refuses it naming layer,
    tensor and position; the writer never writes one: a model whose values overflow the storage dtype is refused
    with --storage-dtype float32 as the fix, and nothing of that prompt is left in the Trace."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from kvdiag.core.errors import UserError
    from kvdiag.model.load import load_model
    from kvdiag.trace import Trace
    from kvdiag.trace.writer import layer_file
    from tests.conftest import make_trace

    copy = tmp_path / "trace"
    shutil.copytree(tiny_trace.path, copy)
    pid = Trace(copy).prompt_ids[0]
    path = layer_file(copy, pid, 1)
    tensors = load_file(str(path))
    q = tensors["q"].clone()
    q[0, 5, 0] = float("nan")
    save_file({**tensors, "q": q}, str(path))
    with pytest.raises(UserError, match="layer 1 of .* holds a q value that is not finite or past 3e\\+14 at "
                                        "position 5 \\(stored in"):
        Trace(copy).layer(pid, 1)
    Trace(copy).layer(pid, 0)  # the other layer reads

    lm = load_model("tiny:llama")
    with torch.no_grad():
        lm.model.model.layers[0].self_attn.v_proj.weight.mul_(1e6)  # v past float16's 65504
    out = tmp_path / "overflow"
    with pytest.raises(UserError, match="layer 0's v holds a value that is not finite in torch.float16 or past .* "
                                        "--storage-dtype float32"):
        make_trace(lm, out, n_prompts=1, max_new_tokens=4, storage_dtype="float16")
    assert not list((out / "tensors").glob("*/layer_*.safetensors"))
