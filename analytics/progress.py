"""Progress for long commands (``bench routing``, ``replay``, ``report``): a bar or a spinner on
stderr when it is a terminal (or ``KVGATE_PROGRESS=1``), nothing in logs and pipes."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["shown", "status", "tracked"]

T = TypeVar("T")


def shown() -> bool:
    flag = os.environ.get("KVGATE_PROGRESS")
    if flag is not None:
        return flag not in ("", "0", "false", "no")
    return sys.stderr.isatty()


def tracked(items: Iterable[T], total: int, what: str) -> Iterator[T]:
    """``items`` as they come, with a bar counting them against ``total``."""
    if not shown():
        yield from items
        return
    columns = (TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        for item in items:
            yield item
            bar.advance(task)


@contextlib.contextmanager
def status(what: str) -> Iterator[None]:
    """A spinner saying what runs (a long step without countable parts)."""
    if not shown():
        yield
        return
    with Console(stderr=True).status(what):
        yield
