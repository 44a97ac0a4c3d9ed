"""Entry point of the ``kvdiag`` console script.

Each command lives in its own module of ``cli/`` and is registered here. How a run ends:

- bad input (``kvdiag.core.errors.UserError``, a usage error, or an option given twice): one line, exit 2;
- a bug (any other exception): one line naming the log file that holds the traceback, exit 1
  (``--debug`` anywhere on the command line prints the traceback instead);
- Ctrl-C: one line, exit 130.

Every line is printed as plain text (no rich markup or emoji codes in user-supplied strings: ``[red]x[/red].jsonl``
and ``tiny:LLAMA`` are printed as given); Python warnings raised during a command are one ``warning:`` line each.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from kvdiag.cli import common
from kvdiag.core.allocator import reuse_freed_memory
from kvdiag.core.errors import UserError
from kvdiag.core.io import FULL
from kvdiag.core.progress import plain_console

DEBUG_FLAG = "--debug"
INTERRUPTED = 130  # the exit code of a run stopped by Ctrl-C (128 + SIGINT)

app = typer.Typer(
    name="kvdiag",
    help="Counterfactual oracle labels and diagnostics for KV-cache eviction. "
         f"Add {DEBUG_FLAG} anywhere to print the traceback of an internal error.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from kvdiag import __version__

        typer.echo(f"kvdiag {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                      help="print kvdiag's version and exit", rich_help_panel="Options")) -> None:
    # the root options (the commands are registered below); the help text is the app's
    del version


bench_app = typer.Typer(help="Benchmarks: ratios measured in one run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

# the commands, after the apps they join
from kvdiag.cli.bench_cli import bench_cli
from kvdiag.cli.bench_decisions import bench_decisions
from kvdiag.cli.bench_kernels import bench_kernels
from kvdiag.cli.bench_label import bench_label
from kvdiag.cli.bench_padded import bench_padded
from kvdiag.cli.bench_peak import bench_peak
from kvdiag.cli.bench_replay import bench_replay
from kvdiag.cli.bench_scale import bench_scale
from kvdiag.cli.bench_score import bench_score
from kvdiag.cli.bench_trace import bench_trace
from kvdiag.cli.decisions import decisions
from kvdiag.cli.demo import demo
from kvdiag.cli.figures import figures
from kvdiag.cli.fit import fit
from kvdiag.cli.grade import grade
from kvdiag.cli.label import label
from kvdiag.cli.rank_eval import rank_eval
from kvdiag.cli.replay import replay
from kvdiag.cli.report import report
from kvdiag.cli.score import score
from kvdiag.cli.trace import trace
from kvdiag.cli.validate_labels import validate_labels

for _name, _fn in [("trace", trace), ("label", label), ("score", score), ("rank-eval", rank_eval), ("figures", figures),
                   ("report", report), ("replay", replay), ("decisions", decisions), ("grade", grade), ("fit", fit),
                   ("demo", demo),
                   ("validate-labels", validate_labels)]:
    app.command(_name)(_fn)
for _name, _fn in [
    ("trace", bench_trace), ("label", bench_label), ("score", bench_score), ("kernels", bench_kernels),
    ("scale", bench_scale), ("peak", bench_peak), ("replay", bench_replay), ("cli", bench_cli),
    ("decisions", bench_decisions), ("padded", bench_padded),
]:
    bench_app.command(_name)(_fn)


def root_command():
    """The click command of ``kvdiag``, every option in its --help panel (:func:`common.arrange_help`)."""
    command = typer.main.get_command(app)
    common.arrange_help(command)
    return command


def resolve_command(argv: list[str]):
    """(the (sub)command ``argv`` runs, its names, the index of its first argument)."""
    return common.resolve_command(root_command(), argv)


def report_bug(err: BaseException, argv: list[str]) -> Path | None:
    """Write the traceback of an unexpected exception to a log file; returns its path (None if none could be
    written)."""
    text = f"kvdiag {' '.join(argv)}\n\n" + "".join(traceback.format_exception(err))
    name = f"kvdiag-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    from kvdiag.model.embedded import cache_dir  # the one definition of kvdiag's user cache ($KVDIAG_CACHE)

    for folder in (cache_dir() / "logs", Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
            return folder / name
        except OSError:
            continue
    return None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def error_console() -> Console:
    """The console of the one-line errors and warnings (kvdiag.core.progress.plain_console, on stderr)."""
    return plain_console(stderr=True, soft_wrap=True)


def say(console: Console, tag: str, style: str, text: str) -> None:
    """One line: ``tag`` styled, then ``text`` verbatim (user input is never read as markup)."""
    console.print(Text.assemble((tag, style), " ", _one_line(text)))


def _warnings_to(console: Console):
    """``warnings.showwarning`` replacement: each warning is one ``warning:`` line (no source path or code line)."""

    def show(message, category, filename, lineno, file=None, line=None):
        say(console, "warning:", "bold yellow", f"{message} ({category.__name__})")

    return show


def handle_bug(err: BaseException, argv: list[str], debug: bool, console: Console) -> None:
    """A bug, not bad input: one line naming the log file that holds the traceback, exit 1 (``--debug``: raise)."""
    if debug:
        raise err
    log = report_bug(err, argv)
    where = f"the traceback is in {log}" if log else "no log file could be written"
    say(console, "internal error", "bold red", f"(a bug in kvdiag, not your input): {type(err).__name__}: "
        f"{_one_line(err)[:300]}; {where}; rerun with {DEBUG_FLAG} to print it")
    sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv
    argv = [a for a in argv if a != DEBUG_FLAG]
    err_console = error_console()
    reuse_freed_memory()
    shown = warnings.showwarning
    warnings.showwarning = _warnings_to(err_console)
    try:
        code = common.invoke(root_command(), argv)
        if code == INTERRUPTED:  # typer turns Ctrl-C into Exit(130), which click returns: no command returns 130
            raise KeyboardInterrupt
    except UserError as err:
        say(err_console, "error:", "bold red", str(err))
        sys.exit(2)
    except typer.TyperException as err:  # usage errors: unknown or missing options, wrong value types
        if type(err).__name__ == "NoArgsIsHelpError":  # `kvdiag` or `kvdiag bench` alone: the help
            Console().print(err.ctx.get_help() if getattr(err, "ctx", None) else "", highlight=False)  # rich help
            sys.exit(0)
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        say(err_console, "error:", "bold red",
            f"{message} (see {' '.join(['kvdiag', *resolve_command(argv)[1]])} --help)")
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        say(err_console, "interrupted:", "bold red", "finished parts are kept; rerun the same command to continue")
        sys.exit(INTERRUPTED)
    except OSError as err:
        if err.errno not in FULL or debug:  # a write outside kvdiag.core.io on a full disk is no bug either
            handle_bug(err, argv, debug, err_console)
        say(err_console, "error:", "bold red", f"{os.strerror(err.errno)} ({_one_line(err)[:300]}); free space "
            "and rerun the same command to continue")
        sys.exit(2)
    except Exception as err:  # a bug, not bad input
        handle_bug(err, argv, debug, err_console)
    finally:
        warnings.showwarning = shown
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
