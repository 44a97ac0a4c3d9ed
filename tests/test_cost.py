"""``kvdiag.trace.cost``: the arithmetic of bytes per token matches what a Trace writes, and the shape's matmul count
matches the model's Linear layers. Exact integer comparisons (byte counts), except the token table, which is
compressed Parquet and is checked against its stated bound."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from kvdiag.tasks.prompts import load_prompts
from kvdiag.trace import GenerationSettings, Trace, trace_prompts
from kvdiag.trace.cost import LLAMA_8B, TOKEN_TABLE_BYTES, ModelShape, TraceCost

MODES = ["all", "kv", "none", "1"]


@pytest.fixture(scope="module")
def traces(tiny_llama, tmp_path_factory) -> dict[str, Trace]:
    root = tmp_path_factory.mktemp("cost")
    prompts = load_prompts("builtin:arith", limit=2)
    for mode in MODES:
        settings = GenerationSettings(max_new_tokens=48, chat=False, instruction=None, store=mode)
        trace_prompts(tiny_llama, prompts, root / mode, settings, show_progress=False)
    return {mode: Trace(root / mode) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_stored_tensor_bytes_match_the_arithmetic(traces, tiny_llama, mode):
    tr = traces[mode]
    shape = ModelShape.from_config(tiny_llama.model.config)
    positions = sum(tr.length(pid) for pid in tr.prompt_ids)
    tensor_bytes = header_bytes = 0
    for f in sorted(tr.path.glob("tensors/*/*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            size = sum(st.get_tensor(k).nbytes for k in st.keys())
        tensor_bytes += size
        header_bytes += f.stat().st_size - size
    assert tensor_bytes == shape.stored_bytes(mode) * positions
    assert header_bytes <= 1024 * len(list(tr.path.glob("tensors/*/*.safetensors")))  # per file, not per token
    table = sum(f.stat().st_size for f in [tr.path / "tokens.parquet", *tr.path.glob("parts/*.parquet")])
    assert table <= TOKEN_TABLE_BYTES * positions


def test_matmul_params_count_the_linear_layers(tiny_llama):
    model = tiny_llama.model
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert ModelShape.from_config(model.config).matmul_params == linear


def test_llama_8b_32k_arithmetic():
    """The figures docs/scale.md states."""
    cost = TraceCost(LLAMA_8B, 32768)
    assert LLAMA_8B.stored_bytes("all") == 32 * (32 + 2 * 8) * 128 * 2 == 393_216
    assert LLAMA_8B.stored_bytes("kv") == 131_072 and LLAMA_8B.stored_bytes("none") == 0
    assert cost.disk_bytes("none") <= 1e9  # the bound for the smallest mode
    assert round(cost.disk_bytes("all") / 1e9, 1) == 12.9
    assert len(cost.checkpoints) == 63  # every 512 up to T - horizon


def test_docs_state_the_arithmetic():
    """docs/scale.md's cost table is this module's output (the docs stay true when the model changes)."""
    from pathlib import Path

    from kvdiag.trace.cost import extrapolation

    doc = (Path(__file__).parents[1] / "docs" / "scale.md").read_text()
    for quantity, value in extrapolation(TraceCost(LLAMA_8B, 32768)):
        assert f"| {quantity} | {value} |" in doc


def test_layer_start_ceiling_by_hand():
    """Per token at 512 keys. SmolLM2-135M: a layer 2·(576·64·(2·9 + 2·3) + 3·576·1536) + 4·9·64·512 = 8,257,536
    FLOPs, the LM head 2·576·49,152 = 56,623,104 (~6.9 layers): (30 L + h) / (15.5 L + h) = 1.65. Llama-3.1-8B:
    a layer 444,596,224, the head 1,050,673,152 (~2.4 layers): 1.82."""
    smol = ModelShape(
        "smollm2", layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152
    )
    assert smol.layer_flops(512) == 8_257_536
    assert smol.layer_start_ceiling(512) == pytest.approx(
        (30 * 8_257_536 + 56_623_104) / (15.5 * 8_257_536 + 56_623_104), rel=1e-12
    )
    assert round(smol.layer_start_ceiling(512), 2) == 1.65
    assert LLAMA_8B.layer_flops(512) == 444_596_224
    assert round(LLAMA_8B.layer_start_ceiling(512), 2) == 1.82
    assert smol.layer_start_ceiling(4096) > smol.layer_start_ceiling(
        512
    )  # attention grows with context, the head does not
