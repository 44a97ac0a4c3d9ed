"""``kvdiag bench trace``: tracing (record q/k/v, logprobs, write the Trace) vs plain ``generate`` with SDPA.

Both generate the same greedy tokens for the same prompts on the same model in one process; the runs
alternate (plain, trace, plain, trace, ...) and the best time of each is kept, so machine noise hits
both alike. Both run the same matmuls (``kvdiag.trace.cost.ModelShape.generation_flops``: the prefill, then one
forward per generated token; recording copies tensors, it multiplies nothing), so ``flops`` over each time is
that method's achieved FLOP/s; batch-1 decoding reads every weight once per token and is bound by memory
bandwidth, so its MFU is low by nature.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from kvdiag.model.load import LoadedModel
from kvdiag.tasks.prompts import Prompt, encode_prompt
from kvdiag.trace.cost import ModelShape
from kvdiag.trace.writer import GenerationSettings, trace_prompts


@dataclass
class TraceBenchResult:
    plain_s: float
    trace_s: float
    tokens: int  # prompt + generated tokens, all prompts
    flops: float = 0.0  # matmul FLOPs of one run over all prompts (the same for both methods)

    @property
    def ratio(self) -> float:
        return self.trace_s / self.plain_s


@torch.no_grad()
def _plain(lm: LoadedModel, prompts: list[Prompt], settings: GenerationSettings) -> list[tuple[int, int]]:
    """Plain greedy ``generate`` of each prompt; returns (prompt tokens, generated tokens) per prompt."""
    tok, lengths = lm.tokenizer, []
    cfg = GenerationConfig(max_new_tokens=settings.max_new_tokens, do_sample=False, top_k=None,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    for p in prompts:
        ids = torch.tensor([encode_prompt(tok, p, settings.chat, settings.instruction)], device=lm.model.device)
        total = lm.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg).shape[1]
        lengths.append((ids.shape[1], total - ids.shape[1]))
    return lengths


def run_trace_bench(
    lm: LoadedModel, prompts: list[Prompt], max_new_tokens: int = 128, repeats: int = 2
) -> TraceBenchResult:
    settings = GenerationSettings(max_new_tokens=max_new_tokens)
    plain, traced, lengths = float("inf"), float("inf"), []
    _plain(lm, prompts[:1], GenerationSettings(max_new_tokens=4))  # warm-up
    for _ in range(repeats):
        start = time.perf_counter()
        lengths = _plain(lm, prompts, settings)
        plain = min(plain, time.perf_counter() - start)
        out = tempfile.mkdtemp(prefix="kvdiag-bench-trace-")
        try:
            start = time.perf_counter()
            trace_prompts(lm, prompts, out, settings, show_progress=False)
            traced = min(traced, time.perf_counter() - start)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    shape = ModelShape.from_config(lm.model.config)
    return TraceBenchResult(plain, traced, sum(p + g for p, g in lengths),
                            sum(shape.generation_flops(p, g) for p, g in lengths))
