"""Entry point of the ``kvdiag`` console script.

Each command lives in its own module of ``cli/`` and is registered here. User errors
(``kvdiag.errors.UserError``) print one line and exit with code 2, without a traceback.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from kvdiag.allocator import reuse_freed_memory
from kvdiag.errors import UserError

app = typer.Typer(
    name="kvdiag",
    help="Counterfactual oracle labels and diagnostics for KV-cache eviction.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks: ratios measured in one run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

from cli.bench_kernels import bench_kernels  # noqa: E402  (after the apps exist)
from cli.bench_label import bench_label  # noqa: E402
from cli.bench_score import bench_score  # noqa: E402
from cli.bench_trace import bench_trace  # noqa: E402
from cli.demo import demo  # noqa: E402
from cli.figures import figures  # noqa: E402
from cli.label import label  # noqa: E402
from cli.rank_eval import rank_eval  # noqa: E402
from cli.replay import replay  # noqa: E402
from cli.report import report  # noqa: E402
from cli.score import score  # noqa: E402
from cli.trace import trace  # noqa: E402

for _name, _fn in [("trace", trace), ("label", label), ("score", score), ("rank-eval", rank_eval), ("figures", figures),
                   ("report", report), ("replay", replay), ("demo", demo)]:
    app.command(_name)(_fn)
for _name, _fn in [("trace", bench_trace), ("label", bench_label), ("score", bench_score), ("kernels", bench_kernels)]:
    bench_app.command(_name)(_fn)


def main(argv: list[str] | None = None) -> None:
    reuse_freed_memory()
    try:
        app(args=argv, standalone_mode=True)
    except UserError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
