"""Rich progress bars for long steps (hashing, converting)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

console = Console()


@contextmanager
def progress_bar(description: str, as_bytes: bool = False) -> Iterator[Callable[..., None]]:
    """Yield a callback `(done, total, *info)` that drives one bar."""
    count = DownloadColumn() if as_bytes else MofNCompleteColumn()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), count, TimeRemainingColumn(), console=console, transient=False
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int, *info: object) -> None:
            bar.update(task, completed=done, total=total)

        yield update
