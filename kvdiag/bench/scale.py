"""``kvdiag bench scale``: time, peak memory and disk of every stage as traces grow (T = 1k .. 8k).

Each step is the real command (``python -m kvdiag trace|label|score|figures ...``) in a child process of
its own, so its peak resident memory (``ru_maxrss`` from ``os.wait4``) is that command's alone. Per length T
(prompt P tokens, ``T - P`` generated, end-of-sequence held off with ``--min-new-tokens``): a trace per
``--store`` mode, one label checkpoint at ``t = T - 64`` (64 candidates, horizon 16) on the ``all`` Trace,
``score --scorers all`` on every mode's Trace (a ``kv``/``none`` Trace rebuilds its missing tensors: that
cost shows here) and ``figures``. A baseline trace of one token gives the fixed cost (model, runtime), so
the growth of trace memory per token can be read against the KV cache and the recorded rows
(``kvdiag.trace.cost``). Each finished step is kept as ``steps/<name>.json``: a rerun continues (a step without
its record runs again from scratch).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.io import check_writable, writable_dir, write_csv, write_json, write_text
from kvdiag.core.parsing import LABEL_BACK, check_context, check_length_room
from kvdiag.core.tables import frame_table
from kvdiag.model.load import PEAK_AFTER_LOAD_ENV
from kvdiag.trace.cost import ModelShape
from kvdiag.trace.writer import STORAGE_DTYPES

STAGES = ("trace", "label", "score", "figures")
CANDIDATES = 64
HORIZON = 16


@dataclass
class Step:
    name: str  # e.g. "T4096/trace-all"
    stage: str  # trace | label | score | figures
    length: int  # T
    store: str  # the Trace's --store mode
    seconds: float
    peak_rss_mb: float  # the whole process: max(load, work)
    disk_mb: float | None  # the Trace directory (trace steps)
    load_peak_mb: float | None = None  # the peak up to the end of the model load
    work_peak_mb: float | None = None  # the peak after the load (its high-water mark restarted there)


@dataclass
class ScalePlan:
    model: str
    prompts: str
    lengths: list[int]
    stores: list[str]
    out: Path
    dtype: str = "float32"

    def validate(self, prompt_len: int, context: int | None) -> None:
        """Every length fits a label checkpoint after the prompt and the model's context (bad input otherwise)."""
        for T in self.lengths:
            check_length_room(T, prompt_len)
            check_context(T, context, "--lengths", f"give lengths <= {context}")


def _disk_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def _run(argv: list[str], log: Path) -> tuple[float, float, float | None]:
    """Run ``python -m kvdiag ARGV`` to the end: (seconds, load peak MB, work peak MB). The child writes its
    load peak and restarts its high-water mark after loading the model (``kvdiag.model.load``,
    ``$KVDIAG_PEAK_AFTER_LOAD``), so its ``ru_maxrss`` is then the work's peak alone; a step that loads no
    model gives (seconds, None, whole peak). A failure is a bug of the step."""
    load_file = log.with_suffix(".load_peak")
    load_file.unlink(missing_ok=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvdiag", *argv], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, PEAK_AFTER_LOAD_ENV: str(load_file)})
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"bench scale: `kvdiag {' '.join(argv)}` failed; see {log}")
    load_peak = float(load_file.read_text()) if load_file.exists() else None
    return seconds, load_peak, usage.ru_maxrss / 1024  # KiB on Linux


def run_scale_bench(plan: ScalePlan, prompt_len: int, report: Callable[[Step], None] = lambda s: None) -> None:
    """Run the steps of ``plan`` not yet recorded in ``steps/`` (``report`` sees each step, recorded or run), in
    order: baseline, then per length the traces, the label, the scores and the figures."""
    out = plan.out
    (out / "steps").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)

    def step(name: str, stage: str, T: int, store: str, argv: list[str], trace: Path | None = None) -> None:
        done = out / "steps" / f"{name.replace('/', '__')}.json"
        if done.exists():
            s = Step(**json.loads(done.read_text()))
        else:
            # a step killed before its record may have finished its output: a rerun would then only skip it
            target = Path(argv[argv.index("--out") + 1])
            for stale in (target, target.with_name(target.name + ".parts")):
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
            seconds, load_peak, work_peak = _run(argv, out / "logs" / f"{name.replace('/', '__')}.log")
            s = Step(
                name, stage, T, store, seconds, max(load_peak or 0.0, work_peak), _disk_mb(trace) if trace else None,
                load_peak, work_peak if load_peak is not None else None,
            )
            write_json(done, asdict(s))
        report(s)

    common = ["--model", plan.model, "--prompts", plan.prompts, "--limit", "1", "--dtype", plan.dtype, "--quiet"]
    base = out / "baseline" / "trace"
    step("baseline/trace-none", "trace", prompt_len + 1, "none",
         ["trace", *common, "--max-new-tokens", "1", "--store", "none", "--out", str(base)], base)
    for T in plan.lengths:
        G, run = T - prompt_len, out / f"T{T}"
        for store in plan.stores:
            trace = run / f"trace-{store}"
            step(
                f"T{T}/trace-{store}",
                "trace",
                T,
                store,
                [
                    "trace", *common, "--max-new-tokens", str(G), "--min-new-tokens", str(G), "--store", store, "--out",
                    str(trace),
                ],
                trace,
            )
        first = run / f"trace-{plan.stores[0]}"
        labels = run / "labels.parquet"
        step(f"T{T}/label", "label", T, plan.stores[0],
             ["label", "--trace", str(first), "--checkpoints", str(T - LABEL_BACK), "--candidates", str(CANDIDATES),
              "--horizon", str(HORIZON), "--out", str(labels), "--quiet"])
        for store in plan.stores:
            step(f"T{T}/score-{store}", "score", T, store,
                 ["score", "--trace", str(run / f"trace-{store}"), "--labels", str(labels), "--scorers", "all",
                  "--out", str(run / f"scores-{store}.parquet")])
        step(
            f"T{T}/figures",
            "figures",
            T,
            plan.stores[0],
            [
                "figures", "--trace", str(first), "--labels", str(labels), "--scores",
                str(run / f"scores-{plan.stores[0]}.parquet"), "--out", str(run / "figures"),
            ],
        )


def memory_growth(steps: list[Step], shape: ModelShape, dtype: str, storage_dtype: str = "float16") -> pl.DataFrame:
    """Per store mode traced at two or more lengths: the growth of the trace's work peak RSS (after the model
    load) per token, beside the arithmetic bound KV cache (compute dtype) + recorded rows (storage dtype) per
    token. First the least-squares slope over every length, then each interval of consecutive lengths
    ``(peak_b - peak_a) / (T_b - T_a)``: at short T the peak is the RSS the load leaves (which differs between
    runs by up to ~0.1 GB), so the intervals are noisy where the trace's own memory is small; the slope is not."""
    kv, rows = shape.kv_cache_bytes(STORAGE_DTYPES[dtype].itemsize), []
    traces = [
        s for s in steps if s.stage == "trace" and not s.name.startswith("baseline") and s.work_peak_mb is not None
    ]
    for store in sorted({s.store for s in traces}):
        pts = sorted((s.length, s.work_peak_mb * 2**20) for s in traces if s.store == store)
        if len(pts) < 2:
            continue
        stored = shape.stored_bytes(store, storage_dtype)
        lengths, peaks = zip(*pts, strict=True)
        fits = [("least squares over " + ",".join(map(str, lengths)), float(np.polyfit(lengths, peaks, 1)[0]))]
        fits += [(f"{Ta} -> {Tb}", (pb - pa) / (Tb - Ta)) for (Ta, pa), (Tb, pb) in itertools.pairwise(pts)]
        for what, growth in fits:  # bytes per token
            rows.append({"store": store, "T": what, "measured KB/token": round(growth / 1e3, 1),
                         "KV cache KB/token": round(kv / 1e3, 1), "recorded rows KB/token": round(stored / 1e3, 1),
                         "measured / (KV + rows)": round(growth / (kv + stored), 2)})
    return pl.DataFrame(rows)


def steps_table(steps: list[Step]) -> pl.DataFrame:
    """One row per (T, stage, store): seconds, peak RSS, disk."""
    return pl.DataFrame([asdict(s) for s in steps]).select(
        pl.col("length").alias("T"), "stage", "store", pl.col("seconds").round(1), pl.col("peak_rss_mb").round(0),
        pl.col("load_peak_mb").round(0), pl.col("work_peak_mb").round(0), pl.col("disk_mb").round(1))


def _growth_text(growth: pl.DataFrame) -> str:
    return frame_table(growth) if growth.height else "(no store mode traced at two lengths yet)\n"


def bench_scale(plan: ScalePlan, report: Callable[[Step], None] = lambda s: None) -> str:
    """Check ``plan`` against the model (bad input before any step), run it, write ``scale.csv`` and ``scale.md``
    into ``plan.out``; returns the Markdown."""
    from kvdiag.model.load import load_model
    from kvdiag.tasks.prompts import encode_prompt, load_prompts

    check_writable(plan.out, "--out", "dir")  # bad input is refused before a model loads or a file is written
    prompt = load_prompts(plan.prompts, limit=1)[0]
    lm = load_model(plan.model, dtype=plan.dtype)  # the prompt length and the shape only: each step loads its own
    prompt_len = len(encode_prompt(lm.tokenizer, prompt))
    plan.validate(prompt_len, getattr(lm.model.config, "max_position_embeddings", None))
    shape = ModelShape.from_config(lm.model.config, plan.model)
    del lm
    writable_dir(plan.out)
    run_scale_bench(plan, prompt_len, report)
    # the tables hold every finished step in the directory: runs of other lengths or modes add to them
    steps = sorted((Step(**json.loads(f.read_text())) for f in (plan.out / "steps").glob("*.json")),
                   key=lambda s: (s.length, STAGES.index(s.stage), s.store))
    table = steps_table(steps)
    write_csv(table, plan.out / "scale.csv")
    text = (f"bench scale: {plan.model} {plan.dtype}, prompt of {prompt_len} tokens, T - {prompt_len} generated "
            f"(greedy, end-of-sequence held off); each step is the kvdiag command in a process of its own "
            "(peak_rss = its ru_maxrss over the whole process; load_peak = up to the end of the model load; "
            "work_peak = after "
            f"it, the high-water mark restarted there; disk = the Trace directory).\n\n{frame_table(table)}\n"
            "Trace memory growth per token (work_peak: least-squares slope over the lengths, then each interval) "
            f"against the arithmetic bound, KV cache ({plan.dtype}) + recorded rows (float16), from "
            "kvdiag.trace.cost:\n\n"
            f"{_growth_text(memory_growth(steps, shape, plan.dtype))}")
    write_text(plan.out / "scale.md", text)
    return text
