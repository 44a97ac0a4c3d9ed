"""A/B of the Trace recorder's generation cache in one process (issue #44): the positioned cache with blocks
(``kvdiag.cache.PositionedCache.for_model(model, capacity=...)``, now) against the recorder's former
``PreallocatedLayer`` cache (``kvdiag/trace/kv_cache.py`` at 38e8fd5, read from git). The runs alternate (new, old,
new, old, ...); the best time of each is kept and peak RSS is read around each call. Tokens are compared too.

    nice -n 10 python reports/bench/trace_cache_ab.py [--limit 2] [--max-new-tokens 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
import types

import torch

import kvdiag.trace.writer as writer
from kvdiag.cache import PositionedCache, append_rows
from kvdiag.kernels.bench import cpu_peak_probe, peak_mb
from kvdiag.model.load import load_model
from kvdiag.tasks.prompts import load_prompts
from kvdiag.trace import GenerationSettings, Trace, trace_prompts

OLD = "38e8fd5"


def old_cache_class():
    """The former recorder cache, its module text from git (its ``append_rows`` import pointed at today's)."""
    src = subprocess.run(["git", "show", f"{OLD}:kvdiag/trace/kv_cache.py"], capture_output=True, text=True,
                         check=True).stdout
    src = src.replace("from kvdiag.trace.hooks import append_rows\n", "")
    mod = types.ModuleType("old_kv_cache")
    mod.append_rows = append_rows
    exec(compile(src, "old_kv_cache.py", "exec"), mod.__dict__)

    class Old:
        @staticmethod
        def for_model(model, capacity):
            return mod.preallocated_cache(model.config, capacity)

    return Old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", default="builtin:arith")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    lm = load_model(args.model)
    prompts = load_prompts(args.prompts, limit=args.limit)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    arms = {"positioned": PositionedCache, "preallocated_38e8fd5": old_cache_class()}
    times = {name: [] for name in arms}
    peaks: dict[str, float] = {}
    tokens: dict[str, list] = {}
    reset = cpu_peak_probe()
    trace_prompts(lm, prompts[:1], tempfile.mkdtemp(prefix="kvdiag-ab-warm-"), GenerationSettings(max_new_tokens=4),
                  show_progress=False)
    for _ in range(args.repeats):
        for name, cls in arms.items():
            writer.PositionedCache = cls
            out = tempfile.mkdtemp(prefix="kvdiag-ab-")
            try:
                def run(out=out, name=name):
                    start = time.perf_counter()
                    trace_prompts(lm, prompts, out, settings, show_progress=False)
                    times[name].append(time.perf_counter() - start)

                peak = peak_mb(run, torch.device("cpu"), reset)
                peaks[name] = max(peaks.get(name, 0.0), peak or 0.0)
                trace = Trace(out)
                tokens[name] = [trace.token_ids(p).tolist() for p in trace.prompt_ids]
            finally:
                shutil.rmtree(out, ignore_errors=True)
    writer.PositionedCache = PositionedCache
    best = {name: min(t) for name, t in times.items()}
    result = {
        "model": args.model, "prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "threads": torch.get_num_threads(), "seconds": times, "best_s": best,
        "ratio_positioned_over_old": best["positioned"] / best["preallocated_38e8fd5"], "peak_rss_mb": peaks,
        "tokens": sum(len(t) for t in tokens["positioned"]),
        "same_tokens": tokens["positioned"] == tokens["preallocated_38e8fd5"],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
