"""Achieved FLOP/s and MFU: the FLOP counts of ``kvdiag.trace.cost`` checked by hand, the measured peak, and the bench
commands that print them. No timing is asserted: only that the numbers exist and the arithmetic holds."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from kvdiag.cli.main import app, main
from kvdiag.kernels.peak import Peak, matmul_peak
from kvdiag.trace.cost import ModelShape

SMOL = ModelShape("smollm2", layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152)


def test_row_flops_by_hand():
    """One row of H = 2 tokens at checkpoint 10: queries at 10 and 11 read 11 and 12 keys."""
    layer = 2 * (576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536)
    attn = 4 * 9 * 64
    head = 2 * 576 * 49152
    assert SMOL.row_flops(10, 2) == 30 * layer * 2 + 30 * attn * (11 + 12) + 2 * head
    # from layer 20: the ten layers 20..29 and the head
    assert SMOL.row_flops(10, 2, start=20) == 10 * layer * 2 + 10 * attn * (11 + 12) + 2 * head
    # the same counts as forward_flops, token by token
    assert SMOL.row_flops(10, 2) == pytest.approx(SMOL.forward_flops(11) + SMOL.forward_flops(12), rel=1e-12)


def test_generation_flops_by_hand():
    """A prompt of 3 tokens (keys 1, 2, 3; LM head once), then 2 more forwards at contexts 4 and 5 for 3 new
    tokens."""
    layers = 30 * 2 * (576 * 64 * 24 + 3 * 576 * 1536)
    attn = 30 * 4 * 9 * 64
    head = 2 * 576 * 49152
    want = 3 * layers + attn * (1 + 2 + 3) + head + SMOL.forward_flops(4) + SMOL.forward_flops(5)
    assert SMOL.generation_flops(3, 3) == want


def test_windows_and_experts_in_the_counts():
    sw = ModelShape("sw", 2, 4, 2, 16, 64, 128, 300, windows=(8, None))
    full = ModelShape("full", 2, 4, 2, 16, 64, 128, 300)
    assert full.forward_flops(100) - sw.forward_flops(100) == 4 * 4 * 16 * (100 - 8)
    moe = ModelShape("moe", 1, 4, 2, 16, 64, 128, 300, active_experts=2, router=8)
    assert moe.layer_params == 64 * 16 * 12 + 2 * 3 * 64 * 128 + 64 * 8


def test_shape_from_config_of_a_moe_and_a_hybrid_model():
    from kvdiag.model.load import load_model

    oss = load_model("tiny:gpt_oss")
    shape = ModelShape.from_config(oss.model.config)
    assert (shape.active_experts, shape.router) == (2, 4) and shape.windows == (8, None)
    gemma = ModelShape.from_config(load_model("tiny:gemma3_cg").model.config)  # a nested text config
    assert gemma.windows == (8, None) and gemma.hidden == 64


def test_peak_is_measured_and_mfu_is_a_ratio():
    p = matmul_peak("cpu", torch.float32, size=128, seconds=0.01, min_calls=2)
    assert p.calls >= 2 and p.flops_per_s > 0 and p.dtype == "float32"
    assert Peak("cpu", "float32", 1, 1, 1e9).mfu(5e8, 1.0) == 0.5


def test_bench_peak_cli():
    result = CliRunner().invoke(app, ["bench", "peak", "--dtype", "float32,bfloat16", "--size", "64", "--seconds",
                                      "0.01"])
    assert result.exit_code == 0, result.output
    assert "float32" in result.output and "bfloat16" in result.output and "GFLOP/s" in result.output


@pytest.mark.parametrize("args", [["--dtype", "float64"], ["--size", "-1"], ["--device", "tpu"]])
def test_bench_peak_bad_input_exits_2(args):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "peak", *args])
    assert exc.value.code == 2


def test_bench_label_trace_and_kernels_print_mfu():
    runner = CliRunner()
    label = runner.invoke(app, ["bench", "label", "--model", "tiny:llama", "--prefix", "32", "--n", "3", "--horizon",
                                "2", "--repeats", "1"])
    assert label.exit_code == 0, label.output
    assert "MFU" in label.output and "matmul peak, measured in this run" in label.output
    layer = runner.invoke(app, ["bench", "label", "--model", "tiny:llama", "--prefix", "32", "--n", "2", "--horizon",
                                "2", "--repeats", "1", "--granularity", "layer"])
    assert layer.exit_code == 0 and "MFU" in layer.output, layer.output
    trace = runner.invoke(app, ["bench", "trace", "--model", "tiny:llama", "--limit", "1", "--max-new-tokens", "4",
                                "--repeats", "1"])
    assert trace.exit_code == 0 and "MFU" in trace.output, trace.output
    kernels = runner.invoke(app, ["bench", "kernels", "--n", "2", "--prefix", "16", "--window", "2", "--heads", "2",
                                  "--kv-heads", "1", "--head-dim", "8", "--trace-len", "32", "--repeats", "1"])
    assert kernels.exit_code == 0 and "MFU" in kernels.output and "GB/s" in kernels.output, kernels.output


def test_gpu_from_a_gpu_check_results_file(tmp_path):
    import json

    from kvdiag.core.errors import UserError
    from kvdiag.trace.cost import GPU

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"summary": {"gpu": "NVIDIA H200", "bf16_peak_tflops": 700.0,
                                            "label_engine_mfu": 0.55}}))
    gpu = GPU.from_gpu_check(path)
    assert (gpu.name, gpu.tflops, gpu.compute_efficiency) == ("NVIDIA H200", 700.0, 0.55)
    path.write_text(json.dumps({"summary": {"gpu": "cpu (dry run)", "bf16_peak_tflops": 0.004,
                                            "label_engine_mfu": None}}))
    with pytest.raises(UserError, match="dry run"):
        GPU.from_gpu_check(path)
