"""Where ``mxconv`` writes for people and for logs: the two consoles, styled lines, progress.

On a terminal rich sizes tables to the window and draws live progress bars. Piped or redirected
(``mxconv inspect X | cat``, ``> log``, CI), the output is read by scripts and people after the
fact: tables are never cut to a width (every cell whole, no "…"), and progress is plain lines
(each tenth of the bytes of a conversion, each step of a verify) instead of a bar redrawn in
place.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rich.console import Console, ConsoleDimensions
from rich.progress import (
    BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from mxconv import sizes
from mxconv.cli.flags import in_cli_words

# Width of a console that is not a terminal: wider than any cell or line mxconv prints, so rich
# neither wraps nor crops; tables still take only the width their cells need.
UNBOUNDED_WIDTH = 1_000_000


class _Console(Console):
    """A rich console sized by the terminal when it writes to one, and unbounded otherwise."""

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)  # type: ignore[attr-defined]
        return size if self.is_terminal else ConsoleDimensions(UNBOUNDED_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


# Markup off: messages carry tensor shapes ("[256, 32]") and user paths that rich would otherwise read
# as markup tags (dropping them, or raising on "[/"). Styles go through :func:`say` / rich Text.
err = _Console(stderr=True, markup=False)
out = _Console(markup=False)


def say(console: Console, label: str, style: str, message: str = "") -> None:
    """Print ``label message`` on one logical line: the label styled, the message as given but for the
    library's setting names, said by their flags (:func:`mxconv.cli.flags.in_cli_words`): errors,
    warnings, notes and verdicts all come through here."""
    line = Text(in_cli_words(label), style=style)
    if message:
        line.append(" " + in_cli_words(message))
    console.print(line, highlight=False, soft_wrap=True)


def _tenths(total: int, label: str) -> Callable[[int], None]:
    """Byte progress for a log: a line each time another tenth of ``total`` is done, e.g.
    "repack gpt-oss: bf16 -> mxfp4 trtllm: 40% (1.60 GB of 4.00 GB, 12.3 s)". Called from the
    pipeline's threads, hence the lock."""
    lock = threading.Lock()
    start = time.monotonic()
    state = {"done": 0, "shown": 0}

    def advance(n: int) -> None:
        with lock:
            state["done"] += n
            tenth = min(10, state["done"] * 10 // max(total, 1))
            if tenth <= state["shown"]:
                return
            state["shown"] = tenth
            say(err, f"{label}: {10 * tenth}% ({sizes.human_bytes(state['done'])} of {sizes.human_bytes(total)}, "
                     f"{time.monotonic() - start:.1f} s)", "")

    return advance


@contextmanager
def progress(total: int, label: str, quiet: bool) -> Iterator[Any]:
    """Progress over ``total`` bytes on stderr: yields ``advance(nbytes)`` (None when quiet)."""
    if quiet:
        yield None
        return
    if not err.is_terminal:
        yield _tenths(total, label)
        return
    prog = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=False),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,
    )
    with prog:
        task = prog.add_task(label, total=max(total, 1))
        yield lambda n: prog.advance(task, n)


@contextmanager
def step_progress(label: str, quiet: bool) -> Iterator[Any]:
    """Progress over the steps of a long check on stderr: yields ``on_step(what, done, total)``
    (None when quiet); for a log, one line per step, e.g. "verify OUT: layer 3 (4/10)"."""
    if quiet:
        yield None
        return
    if not err.is_terminal:
        yield lambda what, done, total: say(err, f"{label}: {what} ({done}/{total})", "")
        return
    prog = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err, transient=False)
    with prog:
        task = prog.add_task(label, total=None)

        def on_step(what: str, done: int, total: int) -> None:
            prog.update(task, description=f"{label}: {what}", completed=done, total=total)

        yield on_step
