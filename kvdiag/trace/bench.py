"""``kvdiag bench trace``: tracing (record q/k/v, logprobs, write the Trace) vs plain ``generate`` with SDPA.

Both generate the same greedy tokens for the same prompts on the same model in one process; the runs
alternate (plain, trace, plain, trace, ...) and the best time of each is kept, so machine noise hits
both alike.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from kvdiag.models import LoadedModel
from kvdiag.prompts import Prompt, encode_prompt
from kvdiag.trace.writer import GenerationSettings, trace_prompts


@dataclass
class TraceBenchResult:
    plain_s: float
    trace_s: float
    tokens: int

    @property
    def ratio(self) -> float:
        return self.trace_s / self.plain_s


@torch.no_grad()
def _plain(lm: LoadedModel, prompts: list[Prompt], settings: GenerationSettings) -> int:
    tok, n = lm.tokenizer, 0
    cfg = GenerationConfig(max_new_tokens=settings.max_new_tokens, do_sample=False, top_k=None,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    for p in prompts:
        ids = torch.tensor([encode_prompt(tok, p, settings.chat, settings.instruction)], device=lm.model.device)
        n += lm.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg).shape[1]
    return n


def run_trace_bench(
    lm: LoadedModel, prompts: list[Prompt], max_new_tokens: int = 128, repeats: int = 2
) -> TraceBenchResult:
    settings = GenerationSettings(max_new_tokens=max_new_tokens)
    plain, traced, tokens = float("inf"), float("inf"), 0
    _plain(lm, prompts[:1], GenerationSettings(max_new_tokens=4))  # warm-up
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = _plain(lm, prompts, settings)
        plain = min(plain, time.perf_counter() - start)
        out = tempfile.mkdtemp(prefix="kvdiag-bench-trace-")
        try:
            start = time.perf_counter()
            trace_prompts(lm, prompts, out, settings, show_progress=False)
            traced = min(traced, time.perf_counter() - start)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    return TraceBenchResult(plain, traced, tokens)
