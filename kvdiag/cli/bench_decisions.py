"""``kvdiag bench decisions``: what ``oracle_search`` costs per (checkpoint, budget) and what it gains over the best
candidate set, at the effort and at ``--scale`` times it (is the search converged?)."""

from __future__ import annotations

import typer
from rich.table import Table

from kvdiag.cli import common
from kvdiag.core import parsing
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console


def bench_decisions(
    model: str = common.Model,
    prefix: int = common.flag("--prefix", 640, "the checkpoint t (a prefix of real text)"),
    horizon: int = common.flag("--horizon", 16, "teacher-forced tokens per joint label", **common.HORIZON_STEPS),
    keep: list[str] = common.flag("--keep", ["0.5"], "keep fractions in (0, 1), comma-separated"),
    scorers: list[str] = common.flag("--scorers", ["snapkv,tova,h2o,streamingllm,knorm"], "the rules whose sets "
                                      "are candidates (with fast and future_attention)"),
    selection: str = common.flag("--selection", "per-head", "per-head | per-token"),
    search_rows: int = common.flag("--search-rows", 512, "oracle_search's sets labeled per budget (a descent "
                                    "step each)"),
    search_seconds: float = common.flag("--search-seconds", 120.0, "oracle_search's time per budget (0: none)"),
    scale: int = typer.Option(4, "--scale", help="also search at this multiple of the effort"),
    out: str = common.flag("--out", None, "also write the result as JSON here"),
    dtype: str = common.Dtype,
    device: str = common.Device,
) -> None:
    """oracle_search's rows, seconds and improvement over the best candidate per budget, at 1x and --scale x."""
    check_outputs({"--out": out})
    from kvdiag.core.errors import UserError
    from kvdiag.decisions.config import Budget, DecisionsConfig

    fractions = parsing.parse_list(keep, "--keep", float, low=0, high=1, strict=True, example="0.5,0.25")
    names = parsing.parse_list(scorers, "--scorers", str)
    if prefix < 2 or scale < 1:
        raise UserError("--prefix >= 2 and --scale >= 1, e.g. --prefix 640 --scale 4")
    cfg = DecisionsConfig(budgets=tuple(Budget("keep", f) for f in fractions), selection=selection, horizon=horizon,
                          search_rows=search_rows, search_seconds=search_seconds)
    if cfg.selection.stochastic:
        raise UserError("--selection stochastic: oracle_search searches a deterministic action space; use per-head or "
                        "per-token")
    parsing.check_device_name(device)
    from kvdiag.decisions.bench import run_search_bench
    from kvdiag.decisions.search import CONVERGED, gain
    from kvdiag.model.load import load_model

    common.quiet_transformers()
    lm = load_model(model, dtype=dtype, device=device)
    res = run_search_bench(lm, prefix, horizon, tuple(fractions), tuple(names), search_rows, search_seconds, scale,
                           str(cfg.selection))
    table = Table(title=f"oracle_search on {lm.spec} at t = {prefix} (H = {horizon}, {cfg.selection}; candidates "
                        f"built in {res['setup_seconds']:.1f} s)")
    for col in ("keep", "effort", "rows", "seconds", "converged", "start", "start kl", "reconstruction", "search kl",
                "improvement", "relative"):
        table.add_column(col, justify="left" if col == "start" else "right")
    for r in res["rows"]:
        table.add_row(f"{r['keep']:g}", f"{r['effort']}x", str(r["rows"]), f"{r['seconds']:.1f}",
                      "yes" if r["converged"] else "no", r["start"], f"{r['start_kl']:.4g}",
                      "-" if r["reconstruction_kl"] is None else f"{r['reconstruction_kl']:.4g}", f"{r['kl']:.4g}",
                      f"{r['improvement']:.3g}", f"{r['relative']:.1%}")
    plain_console().print(table)
    for f in fractions:  # the convergence figure: what the scaled effort took off the 1x search's label
        one, more = (next(r for r in res["rows"] if r["keep"] == f and r["effort"] == e) for e in (1, scale))
        took = gain(one["kl"], more["kl"])
        plain_console().print(f"keep {f:g}: {scale}x the effort took {took:.2%} off the 1x search's label "
                              f"({'converged' if took < CONVERGED else 'not converged'}: the bar is "
                              f"{CONVERGED * 100:g} %)")
        steps = more["quarters"]  # the scaled search's own curve: at each 4x of its steps
        if len(steps) > 1:
            plain_console().print(
                f"keep {f:g}, the {scale}x search after "
                + ", ".join(f"{q['rows']} step{'' if q['rows'] == 1 else 's'} ({q['seconds']:.0f} s): {q['kl']:.4g}"
                           for q in steps)
                + "; each 4x more steps took " + ", ".join(f"{q['gain']:.1%}" for q in steps[:-1]) + " off")
    if out is not None:
        from pathlib import Path

        from kvdiag.core.io import write_json

        write_json(Path(out), res)
