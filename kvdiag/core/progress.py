"""The progress display of every long stage (trace, label, score, figures, replay): one layout."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def progress_bar(enabled: bool = True, remaining: bool = False) -> Progress:
    """A rich ``Progress`` (use it as a context manager): description, bar, done/total, elapsed time and, with
    ``remaining``, the time left. Disabled (``enabled=False``) it draws nothing and its calls cost nothing."""
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    return Progress(*columns, *([TimeRemainingColumn()] if remaining else []), disable=not enabled)
