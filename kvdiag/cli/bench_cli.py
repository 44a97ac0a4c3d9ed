"""``kvdiag bench cli``: how fast the CLI answers (``--help``, and one bad input per command) as a ratio to
``python -c "import torch, transformers"`` on this machine, each the best of N fresh interpreters timed in one run."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table

from kvdiag.cli import common
from kvdiag.core.progress import plain_console

TARGET = 0.25  # issue #39: a refusal (or --help) in under 1/4 of the torch + transformers import

# one bad input per command, each refused by its argument checks (no file is needed; {tmp} is an empty folder)
REFUSALS: dict[str, list[str]] = {
    "trace": ["trace", "--max-new-tokens", "0", "--out", "{tmp}/t"],
    "label": ["label", "--trace", "{tmp}/no-trace", "--out", "{tmp}/l.parquet"],
    "score": ["score", "--trace", "{tmp}/no-trace", "--checkpoints", "default", "--out", "{tmp}/s.parquet"],
    "rank-eval": ["rank-eval", "--labels", "{tmp}/no.parquet", "--scores", "{tmp}/no.parquet", "--out", "{tmp}/r"],
    "figures": ["figures", "--trace", "{tmp}/no-trace", "--labels", "{tmp}/no.parquet", "--scores",
                "{tmp}/no.parquet", "--out", "{tmp}/f"],
    "report": ["report", "--run", "{tmp}/no-run", "--out", "{tmp}/rep"],
    "replay": ["replay", "--scorers", "rkv", "--budget", "0", "--out", "{tmp}/rp"],
    "decisions": ["decisions", "--trace", "{tmp}/no-trace", "--scores", "{tmp}/no.parquet", "--keep", "0.5", "--out",
                  "{tmp}/d"],
    "grade": ["grade", "knorm", "--rule", "tova"],
    "fit": ["fit", "--trace", "{tmp}/no-trace", "--labels", "{tmp}/no.parquet", "--folds", "1", "--out", "{tmp}/fit"],
    "demo": ["demo", "--model", "tiny:nope", "--out", "{tmp}/demo"],
    "validate-labels": ["validate-labels", "--exact", "{tmp}/no.parquet", "--approx", "{tmp}/no.parquet", "--out",
                        "{tmp}/v"],
    "bench trace": ["bench", "trace", "--max-new-tokens", "0"],
    "bench label": ["bench", "label", "--prefix", "0"],
    "bench score": ["bench", "score", "--trace", "{tmp}/no-trace"],
    "bench kernels": ["bench", "kernels", "--dtype", "float8"],
    "bench scale": ["bench", "scale", "--lengths", "many", "--out", "{tmp}/scale"],
    "bench peak": ["bench", "peak", "--seconds", "nan"],
    "bench replay": ["bench", "replay", "--samples", "2"],
    "bench cli": ["bench", "cli", "--repeats", "0"],
    "bench padded": ["bench", "padded", "--repeats", "0"],
}
RUN = ("import json, sys\nfrom kvdiag.cli.main import main\ntry:\n    main(json.loads(sys.argv[1]))\n"
       "except SystemExit as exc:\n"
       "    print('EXIT', json.dumps([exc.code, 'torch' in sys.modules]), file=sys.__stderr__)")


def _best(cmd: list[str], repeats: int) -> tuple[float, int, bool | None]:
    """(best wall seconds of ``repeats`` runs of ``cmd``, its exit code, whether torch was imported (None: unknown))."""
    best, code, torch_in = float("inf"), 0, None
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        best = min(best, time.perf_counter() - start)
        code = proc.returncode
        for line in proc.stderr.splitlines():
            if line.startswith("EXIT "):
                code, torch_in = json.loads(line[5:])
    return best, code, torch_in


def bench_cli(
    repeats: int = common.flag("--repeats", 5, "fresh interpreters per measurement (best reported)", min=1),
    out: Path | None = common.flag("--out", None, "also write the result as JSON here"),
) -> None:
    """Time `kvdiag --help` and one bad input per command against importing torch and transformers."""
    from kvdiag.core.guard import check_outputs

    check_outputs({"--out": out})
    with tempfile.TemporaryDirectory() as tmp:
        base, _, _ = _best([sys.executable, "-c", "import torch, transformers"], repeats)
        rows = [("--help", *_best([sys.executable, "-c", RUN, json.dumps(["--help"])], repeats))]
        for name, argv in REFUSALS.items():
            rows.append((name, *_best([sys.executable, "-c", RUN, json.dumps([a.format(tmp=tmp) for a in argv])],
                                      repeats)))
    table = Table(title=f"bench cli: best of {repeats} fresh interpreters; import torch, transformers = {base:.3f} s; "
                        f"target ratio < {TARGET}")
    for col in ("command", "seconds", "ratio to import", "exit", "torch imported"):
        table.add_column(col, justify="left" if col == "command" else "right")
    for name, s, code, torch_in in rows:
        table.add_row(name, f"{s:.3f}", f"{s / base:.3f}", str(code), "?" if torch_in is None else str(torch_in))
    plain_console().print(table)
    ratios = [s / base for _, s, _, _ in rows]
    plain_console().print(f"worst ratio {max(ratios):.3f}, median {sorted(ratios)[len(ratios) // 2]:.3f} "
                    f"({sum(r < TARGET for r in ratios)}/{len(ratios)} under {TARGET})", highlight=False)
    if out is not None:
        from kvdiag.core.io import write_json

        write_json(out, {"import_torch_transformers_s": base, "repeats": repeats, "target": TARGET,
                         "rows": [{"command": n, "seconds": s, "ratio": s / base, "exit": c, "torch_imported": t}
                                  for n, s, c, t in rows]})
