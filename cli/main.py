"""Entry point of the ``kvdiag`` console script.

Each command lives in its own module of ``cli/`` and is registered here. User errors
(``kvdiag.errors.UserError``) print one line and exit with code 2, without a traceback.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console

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

# command name -> module in cli/ that defines a function of the same name (``-`` -> ``_``)
COMMANDS = ["trace", "label", "score", "rank-eval", "figures", "report", "replay", "demo"]
BENCHES = ["trace", "label", "score", "kernels"]


def _register() -> None:
    for name in COMMANDS:
        mod_name = name.replace("-", "_")
        try:
            mod = importlib.import_module(f"cli.{mod_name}")
        except ModuleNotFoundError as err:
            if err.name != f"cli.{mod_name}":
                raise
            continue
        app.command(name)(getattr(mod, mod_name))
    for name in BENCHES:
        try:
            mod = importlib.import_module(f"cli.bench_{name}")
        except ModuleNotFoundError as err:
            if err.name != f"cli.bench_{name}":
                raise
            continue
        bench_app.command(name)(getattr(mod, f"bench_{name}"))


_register()


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, standalone_mode=True)
    except UserError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
