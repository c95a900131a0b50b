"""Clean stops on SIGINT (Ctrl-C) and SIGTERM.

The CLI wraps every command in :func:`stop_signals`. The first SIGINT or SIGTERM raises
:class:`Interrupted` in the main thread, wherever it is waiting (a read, the GPU, a full write
queue); the conversion then cancels its writer, removes what it wrote (see
:class:`mxconv.output_dir.OutputTarget`) and re-raises, and the CLI prints one line and exits 2, the
contract's code for an interrupted write. Signals that arrive after the first are ignored, so a
second Ctrl-C cannot cut the clean-up short and leave temporary files behind (SIGKILL still stops
the process at once). Inside :func:`deferred_signals` (the final swap of an ``--overwrite``, the
joining of the pipeline's threads) a signal is held until the block ends, then raised.

``Interrupted`` subclasses ``KeyboardInterrupt``, so code that already stops on Ctrl-C stops on
SIGTERM the same way.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived. ``note`` says what the interrupted work left on disk."""

    def __init__(self, signum: int, note: str = "") -> None:
        self.signum = signum
        self.signame = signal.Signals(signum).name
        self.note = note
        super().__init__(f"interrupted by {self.signame}")


class _State:
    """What the installed handler has seen: whether it fired, and a signal held by a deferral."""

    installed = False
    fired = False
    deferring = 0
    pending: int | None = None


def _handler(signum: int, frame: FrameType | None) -> None:
    if _State.fired:
        return  # the first one is being cleaned up after
    if _State.deferring:
        _State.pending = signum
        return
    _State.fired = True
    raise Interrupted(signum)


@contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into :class:`Interrupted` for the length of the block (main thread
    only; elsewhere, or when already installed, the block runs unchanged)."""
    if threading.current_thread() is not threading.main_thread() or _State.installed:
        yield
        return
    previous = {s: signal.signal(s, _handler) for s in STOP_SIGNALS}
    _State.installed, _State.fired, _State.deferring, _State.pending = True, False, 0, None
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _State.installed = False


@contextmanager
def deferred_signals(raise_held: bool = True) -> Iterator[None]:
    """Hold SIGINT/SIGTERM while the block runs; when it ends normally, raise :class:`Interrupted`
    for a held one (or, with ``raise_held=False``, when the caller is already failing, drop it and
    ignore later ones too). Without :func:`stop_signals` installed this changes nothing."""
    _State.deferring += 1
    try:
        yield
    finally:
        _State.deferring -= 1
    if not _State.deferring and _State.pending is not None and not _State.fired:
        signum, _State.pending = _State.pending, None
        _State.fired = True
        if raise_held:
            raise Interrupted(signum)
