"""``kvdiag bench scale``: time, peak memory and disk of trace/label/score/figures at growing T."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli import common
from kvdiag.core import parsing
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console
from kvdiag.model.specs import check_model_spec, known_shape


def bench_scale(
    model: str = common.Model,
    prompts: str = common.Prompts,
    lengths: list[str] = typer.Option(["1024,2048,4096,8192"], "--lengths", help="trace lengths T, comma-separated "
                                                                                 "(repeatable)"),
    store: list[str] = common.flag("--store", ["all", "kv", "none"], "store mode to trace, repeatable: all | kv "
                                                                           "| none | LAYERS"),
    dtype: str = common.Dtype,
    out: Path = common.flag("--out", ..., "work directory (Traces, steps/, logs/) and its tables scale.md, "
                                                "scale.csv"),
) -> None:
    """Trace (per store mode), label, score and figures at each length T, each in a process of its own."""
    check_outputs({"--out": (out, "dir")}, {"--prompts": prompts})
    lengths, stores = parsing.parse_lengths(parsing.listed(lengths)), parsing.parse_stores(store)
    for T in lengths:  # every prompt has a token: the room a length needs before the tokenizer counts them
        parsing.check_length_room(T, 1, at_least=True)
    check_model_spec(model)
    if shape := known_shape(model):  # a tiny family or a local config.json: its context, before torch
        for T in lengths:
            context = shape["max_position_embeddings"]
            parsing.check_context(T, context, "--lengths", f"give lengths <= {context}")
    from kvdiag.bench import scale  # the stage (torch, transformers), once the arguments are checked

    common.quiet_transformers()
    plan = scale.ScalePlan(model, prompts, lengths, stores, out, dtype)
    console = plain_console()
    text = scale.bench_scale(plan, lambda s: console.print(
        f"{s.name}: {s.seconds:.1f} s, peak {s.peak_rss_mb:.0f} MB"
        + (f" (after the load {s.work_peak_mb:.0f} MB)" if s.work_peak_mb is not None else "") + (f", {s.disk_mb:.1f} "
            "MB on disk" if s.disk_mb else "")))
    console.print(text)
