"""The in-progress marker: the file an mxconv run keeps in the directory it is writing.

The marker (:data:`~mxconv.source.file_names.IN_PROGRESS`) names the writing process. A reader of a
directory (open a source, inspect, verify) asks :func:`live_writer` whether an mxconv run is writing
it now; :mod:`mxconv.output.directory` writes the marker with :func:`marker_text` and checks other
runs with the same helpers, so the text's format lives in one place.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mxconv.source.file_names import IN_PROGRESS
from mxconv.source.regular_files import NotRegular, open_regular, read_at_most

_MARKER_PID = re.compile(r"\(pid (\d+)\)")
_MARKER_LIMIT = 4096  # a marker is one line


def marker_text(pid: int) -> str:
    """The marker's contents for a run of process ``pid`` (read back by :func:`marker_pid`)."""
    return f"an mxconv run (pid {pid}) is writing this directory; it is incomplete until mxconv.json exists\n"


def pid_in(text: str) -> int | None:
    """The pid that marker text (:func:`marker_text`) names, None when it names none."""
    m = _MARKER_PID.search(text)
    return int(m.group(1)) if m else None


def marker_pid(marker: Path) -> int | None:
    """The pid a marker file names, None when it names none or is no regular file (mxconv writes
    neither a link nor a FIFO there: :func:`~mxconv.source.regular_files.open_regular` without
    following); OSError when it cannot be read. Reads at most 4 kB."""
    try:
        f, _size = open_regular(marker, follow=False)
    except NotRegular:
        return None
    with f:
        return pid_in(read_at_most(f, _MARKER_LIMIT).decode(errors="replace"))


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a number no pid can be
        return False
    except PermissionError:
        return True
    return True


def live_writer(directory: Path) -> int | None:
    """The pid of a running mxconv, other than this process, that is writing ``directory`` now (its
    in-progress marker names a live process), else None."""
    marker = directory / IN_PROGRESS
    try:
        pid = marker_pid(marker)
    except OSError:
        return None
    return pid if pid is not None and pid != os.getpid() and process_alive(pid) else None
