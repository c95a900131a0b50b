"""Clean stops on SIGINT (Ctrl-C) and SIGTERM.

The CLI wraps every command in :func:`stop_signals`. The first SIGINT or SIGTERM raises
:class:`Interrupted` in the main thread, wherever it is waiting (a read, the GPU, a full write
queue); the conversion then cancels its writer, removes what it wrote (see
:class:`mxconv.output.directory.OutputTarget`) and re-raises, and the CLI prints one line and exits 2, the
contract's code for an interrupted write. Signals that arrive after the first are ignored, so a
second Ctrl-C cannot cut the clean-up short and leave temporary files behind (SIGKILL still stops
the process at once). Inside :func:`deferred_signals` (the final swap of an ``--overwrite``, the
joining of the pipeline's threads) a signal is held until the block ends, then raised.

Once the output is complete (:func:`output_complete`: the manifest is in place, an ``--overwrite``'s
swap done) a signal stops nothing: the run ends as it would have (exit 0) and the CLI notes the
signal (:func:`late_signal`). The CLI's entry module installs the same handler for the whole process
(:func:`process_signals`) before it imports typer, rich and the commands: a signal before a command
has started exits 2 with one line (nothing was written), and one after the command's block (the
process is leaving with its result) is ignored.

``Interrupted`` subclasses ``KeyboardInterrupt``, so code that already stops on Ctrl-C stops on
SIGTERM the same way.
"""

from __future__ import annotations

import signal
import sys
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
    """What the installed handler has seen and where the run is: whether a signal fired, one held by
    a deferral, whether a command's block runs (:func:`stop_signals`) or has run, whether its output
    is complete, and a signal that arrived after that."""

    process = False  # installed for the whole process by the CLI's entry (process_signals)
    installed = False  # inside stop_signals: a signal raises Interrupted
    started = False  # a command's block has begun (under process_signals: before it, a signal exits 2)
    fired = False
    deferring = 0
    pending: int | None = None
    complete = False  # the output is complete: a signal is only noted
    late: int | None = None  # the signal that arrived once the output was complete


def _handler(signum: int, frame: FrameType | None) -> None:
    if _State.fired:
        return  # the first one is being cleaned up after
    if _State.deferring:
        _State.pending = signum
        return
    if _State.complete:
        _State.late = _State.late or signum
        return
    if _State.installed:
        _State.fired = True
        raise Interrupted(signum)
    if _State.started:
        return  # the command's block has ended: the process is leaving with its result
    _State.fired = True
    sys.stderr.write(f"error: interrupted by {signal.Signals(signum).name}; mxconv was starting and had written nothing\n")
    raise SystemExit(2)


@contextmanager
def process_signals() -> Iterator[None]:
    """Install the handler for the length of the block, for the whole process (main thread only):
    the CLI's entry, from before its heavy imports to the exit. Inside it, :func:`stop_signals`
    marks a command's block instead of installing the handler again."""
    if threading.current_thread() is not threading.main_thread() or _State.process:
        yield
        return
    previous = {s: signal.signal(s, _handler) for s in STOP_SIGNALS}
    _State.process, _State.started, _State.fired, _State.complete, _State.late = True, False, False, False, None
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _State.process = False


@contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into :class:`Interrupted` for the length of the block (main thread
    only; elsewhere, or when already installed, the block runs unchanged)."""
    if threading.current_thread() is not threading.main_thread() or _State.installed:
        yield
        return
    previous = None if _State.process else {s: signal.signal(s, _handler) for s in STOP_SIGNALS}
    _State.installed, _State.started, _State.fired, _State.deferring, _State.pending = True, True, False, 0, None
    _State.complete, _State.late = False, None
    try:
        yield
    finally:
        for s, h in (previous or {}).items():
            signal.signal(s, h)
        _State.installed = False


def output_complete() -> None:
    """The run's output is complete (nothing can undo it now): signals from here on are noted, not
    raised, and the run ends as it would have."""
    _State.complete = True


def next_step() -> None:
    """A new piece of work begins inside the command's block (an output is prepared, a verification
    starts): signals raise again, and one noted since an earlier output was complete (a command that
    runs several conversions, ``mxconv demo``) stops the block now, before anything is written."""
    _State.complete = False
    if _State.late is not None and _State.installed and not _State.fired:
        signum, _State.late = _State.late, None
        _State.fired = True
        raise Interrupted(signum)


def late_signal() -> str | None:
    """The name of a signal that arrived after :func:`output_complete` in the last command's block."""
    return None if _State.late is None else signal.Signals(_State.late).name


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
        if _State.complete:
            _State.late = _State.late or signum
            return
        _State.fired = True
        if raise_held:
            raise Interrupted(signum)
