"""The progress display of every long stage (trace, label, score, figures, replay): one layout; and the console
every command prints with."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def progress_bar(enabled: bool = True, remaining: bool = False) -> Progress:
    """A rich ``Progress`` (use it as a context manager): description, bar, done/total, elapsed time and, with
    ``remaining``, the time left. Disabled (``enabled=False``) it draws nothing and its calls cost nothing."""
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    return Progress(*columns, *([TimeRemainingColumn()] if remaining else []), disable=not enabled)


PIPED_WIDTH = 240  # columns of a table written to a file or pipe


def plain_console(stderr: bool = False, width: int | None = None, soft_wrap: bool = False) -> Console:
    """The console every command prints with: strings as given (a path, prompt id or rule name is never read as
    markup, an emoji code or highlighted: ``[red]x[/red].parquet`` prints as such), and a table piped to a file at
    full width (rich would cut it at 80 columns)."""
    stream = sys.stderr if stderr else sys.stdout
    if width is None and not stream.isatty():
        width = PIPED_WIDTH
    return Console(stderr=stderr, width=width, soft_wrap=soft_wrap, markup=False, emoji=False, highlight=False)
