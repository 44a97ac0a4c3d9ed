"""``random:<name>`` models: the shapes of real reasoning models with random weights, on a reduced layer count
(and vocabulary, so a test holds ~1 GB): they trace, label and bench like any model, say they are random in every
output, refuse bad specs and MLA in one line, and are refused by reports."""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch
from typer.testing import CliRunner

from kvdiag.cli.main import app, main
from kvdiag.core.errors import UserError
from kvdiag.model.load import RANDOM, check_not_random, is_random, load_model, parse_random_spec, random_config
from kvdiag.trace.cost import ModelShape

SPEC = "random:llama-3.1-8b:layers=1,vocab=512"  # Llama-3.1-8B's layer (4096 wide, 32/8 heads of 128), ~0.9 GB fp32


@pytest.fixture(scope="module")
def llama():
    return load_model(SPEC)


@pytest.fixture(scope="module")
def trace(llama, tmp_path_factory):
    from kvdiag.tasks.prompts import load_prompts
    from kvdiag.trace import GenerationSettings, Trace, trace_prompts

    path = tmp_path_factory.mktemp("random") / "trace"
    settings = GenerationSettings(max_new_tokens=6, chat=False, instruction=None)
    trace_prompts(llama, load_prompts("builtin:arith", limit=1), path, settings, show_progress=False)
    return Trace(path)


def test_the_model_has_the_real_shapes_and_says_it_is_random(llama):
    info = llama.info
    assert (info["num_layers"], info["num_heads"], info["num_kv_heads"], info["head_dim"]) == (1, 32, 8, 128)
    assert llama.model.config.hidden_size == 4096 and llama.model.config.intermediate_size == 14336
    assert info["random"]["name"] == "llama-3.1-8b" and info["random"]["of_layers"] == 32
    assert info["random"]["use"] == "random weights: benchmark only"
    assert is_random(info) and not is_random({"spec": "smollm2", "weights_hash": "x"})
    # dense model: the cost model's weights are exactly the Linear layers'
    linear = sum(m.weight.numel() for m in llama.model.modules() if isinstance(m, torch.nn.Linear))
    assert ModelShape.from_config(llama.model.config).matmul_params == linear


def test_weights_are_seeded_and_identified_by_their_hash(llama):
    again = load_model(SPEC)
    assert again.weights_hash == llama.weights_hash and llama.is_model_of(again.info, config=True)
    for (name, a), (_, b) in zip(llama.model.state_dict().items(), again.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    other = load_model(SPEC + ",seed=1")
    assert other.weights_hash != llama.weights_hash


def test_trace_manifest_says_random(trace):
    manifest = json.loads((trace.path / "manifest.json").read_text())
    assert is_random(manifest["model"]) and manifest["model"]["random"]["layers"] == 1
    pid = trace.prompt_ids[0]
    assert trace.length(pid) == trace.prompt_len(pid) + 6


def test_label_a_checkpoint(trace, llama, tmp_path):
    from kvdiag.label import LabelConfig, label_trace, read_labels

    pid = trace.prompt_ids[0]
    t = trace.prompt_len(pid) + 2
    cfg = LabelConfig(checkpoints=str(t), horizon=3, candidates="4")
    out = label_trace(trace, llama, tmp_path / "labels.parquet", cfg, show_progress=False)
    df, meta = read_labels(out)
    assert df.height == 4 and df["checkpoint"].unique().to_list() == [t]
    assert (df["kl_mean"] >= 0).all() and df["noise_floor"][0] < 1e-4
    assert is_random(meta["model"])


def test_bench_label_runs_with_flops(llama):
    from kvdiag.label.bench import run_label_bench, run_layer_start_bench

    rows = run_label_bench(llama, prefix_len=24, n=3, horizon=2, repeats=1)
    assert [r.flops > 0 and r.seconds > 0 for r in rows] == [True] * 3
    engine, naive, _ = rows
    assert engine.flops / naive.flops == pytest.approx(4 / 3)  # the engine's null row
    layer = run_layer_start_bench(llama, "layer", prefix_len=24, n=2, horizon=2, repeats=1)
    assert layer.rows[0].flops == layer.rows[1].flops  # one layer: layer start skips nothing


def test_bench_label_cli_marks_random_and_prints_mfu():
    result = CliRunner().invoke(app, ["bench", "label", "--model", SPEC, "--prefix", "16", "--n", "2", "--horizon",
                                      "2", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    assert "random weights" in result.output and "MFU" in result.output and "matmul peak" in result.output


def test_report_refusal_helper():
    check_not_random({"spec": "smollm2", "weights_hash": "x"}, "--run r")
    with pytest.raises(UserError, match="^random weights: benchmark only") as err:
        check_not_random({"spec": SPEC, "random": {"name": "llama-3.1-8b"}}, "--run r")
    assert "\n" not in str(err.value)


def test_deepseek_v3_is_refused_in_one_line():
    with pytest.raises(UserError, match="multi-head latent attention") as err:
        load_model("random:deepseek-v3")  # refused from its config: nothing of its 671B parameters is built
    assert "\n" not in str(err.value) and "random:deepseek-v3" in str(err.value)


@pytest.mark.parametrize("spec, message", [
    ("random:llama-3", "not a random model spec"),
    ("random:llama-3.1-8b:layers=0", "outside 1..32"),
    ("random:qwen3-8b:layers=37", "outside 1..36"),
    ("random:llama-3.1-8b:layers=2,layers=3", "each at most once"),
    ("random:llama-3.1-8b:depth=2", "not one of layers=N"),
    ("random:llama-3.1-8b:layers=two", "not one of layers=N"),
    ("random:llama-3.1-8b:vocab=100", "outside 259..128256"),
    ("random:llama-3.1-8b:layers=2:vocab=512", "not a random model spec"),
])
def test_bad_specs_are_refused_in_one_line(spec, message):
    with pytest.raises(UserError, match=message) as err:
        load_model(spec)
    assert "\n" not in str(err.value)


def test_a_model_larger_than_memory_is_refused_before_it_is_built(monkeypatch):
    import kvdiag.model.load as models

    monkeypatch.setattr(models, "_available_bytes", lambda device: 2**30)
    with pytest.raises(UserError, match="GiB are free"):
        load_model("random:llama-3.1-8b")


def test_bad_spec_exits_2_from_the_cli():
    with pytest.raises(SystemExit) as exc:
        main(["bench", "label", "--model", "random:nope", "--repeats", "1"])
    assert exc.value.code == 2


@pytest.mark.parametrize("name", [n for n in RANDOM if n != "deepseek-v3"])
def test_configs_have_the_families_attention(name):
    """From the config alone (no weights): windows, sinks and the cost model's MoE and window accounting."""
    from kvdiag.model.adapters import family_of, layer_windows

    cfg = random_config(parse_random_spec(f"random:{name}"))
    mt, fam = family_of(cfg)
    windows = layer_windows(cfg, fam)
    shape = ModelShape.from_config(cfg)
    if name == "gemma-3-4b":
        assert windows == [None if (i + 1) % 6 == 0 else 1024 for i in range(34)] and shape.head_dim == 256
    elif name == "gpt-oss-20b":
        assert fam.sinks and windows == [128, None] * 12
        assert (shape.active_experts, shape.router) == (4, 32)
        # a sliding layer reads at most 128 keys: attention FLOPs of 12 sliding + 12 full layers
        assert shape.forward_flops(4096) - 2 * shape.matmul_params == 4 * 64 * 64 * (12 * 128 + 12 * 4096)
    else:
        assert windows == [None] * cfg.num_hidden_layers and mt in ("llama", "qwen2", "qwen3")


def test_gemma3_random_model_runs_its_sliding_layers():
    lm = load_model("random:gemma-3-4b:layers=2,vocab=300")
    assert [l.window for l in lm.attention.layers] == [1024, 1024]
    assert type(lm.model).__name__ == "Gemma3ForCausalLM" and len(lm.tokenizer) == 300
    with torch.no_grad():
        logits = lm.model(torch.arange(20)[None]).logits
    assert logits.shape == (1, 20, 300) and torch.isfinite(logits).all()
    df = pl.DataFrame({"kl_mean": [1e-6, 2e-6], "noise_floor": [1e-5, 1e-5]})
    from kvdiag.label.run import noise_floor_warning

    assert "most labels are numerical noise" in noise_floor_warning(df, "bfloat16")
    assert noise_floor_warning(df.with_columns(noise_floor=pl.lit(1e-9)), "float32") is None
    assert "--dtype float32" in noise_floor_warning(df, "bfloat16")
    assert "--dtype float32" not in noise_floor_warning(df, "float32")  # already float32: no advice to switch


def test_report_refuses_a_random_model_run(tmp_path, capsys):
    """`kvdiag report` on a run whose Trace has random weights: one line, exit 2, nothing written."""
    import json

    import kvdiag.cli.main
    from kvdiag.model.load import load_model
    from tests.conftest import make_trace

    run = tmp_path / "run"
    make_trace(load_model("random:llama-3.1-8b:layers=1,vocab=512"), run / "trace", n_prompts=1, max_new_tokens=4)
    assert json.loads((run / "trace" / "manifest.json").read_text())["model"]["random"]
    with pytest.raises(SystemExit) as exit_:
        kvdiag.cli.main.main(["report", "--run", str(run)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "random weights: benchmark only" in err and len(err.splitlines()) == 1
    assert not (run / "report.md").exists()
