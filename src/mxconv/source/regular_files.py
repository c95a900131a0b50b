"""Opening a file that may be anything: the one way mxconv opens a file it did not just write.

A name in a checkpoint or an output may be a FIFO (an open for reading would wait for a writer), a
device (``/dev/zero`` reads without end), a directory, a socket, or a link. :func:`open_regular`
opens it only once it is known to be a regular file: ``stat``-ed before the open (``lstat`` with
``follow=False``), so that nothing else is ever opened; opened non-blocking (and with ``O_NOFOLLOW``
with ``follow=False``); and ``fstat``-ed again, so that something swapped in between is caught. What
is read of it is bounded (:func:`read_at_most`, :func:`read_exactly`). Callers say what a refusal means in their own words:
a BadInput naming the file and the rule (config, index, manifest, shards, side files), or "not the
file mxconv wrote" (the old output's manifest and files, the in-progress marker).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO, Iterator

from mxconv.errors import BadInput

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words, for one that is not a regular file ("a FIFO", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


class NotRegular(Exception):
    """``path`` is no regular file: ``mode`` is its type, ``kind`` that in words (:func:`kind_of`)."""

    def __init__(self, path: Path, mode: int) -> None:
        super().__init__(f"{path}: {kind_of(mode)}")
        self.path, self.mode, self.kind = path, mode, kind_of(mode)


def open_regular(path: str | Path, *, follow: bool = True) -> tuple[BinaryIO, int]:
    """``path`` opened for reading, and its size, once it is a regular file (see the module
    docstring); ``follow=False``: a link is refused too, never followed. NotRegular for anything
    else; OSError where it cannot be stat-ed or opened (FileNotFoundError: nothing there)."""
    path = Path(path)
    st = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(path, st.st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    f = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced between the stat and the open
        f.close()
        raise NotRegular(path, st.st_mode)
    return f, st.st_size


def read_at_most(f: BinaryIO, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``f``: more than ``limit`` says the file is (or grew) past the bound."""
    return f.read(limit + 1)


def read_exactly(f: BinaryIO, size: int, chunk: int, truncated: str) -> Iterator[bytes]:
    """The next ``size`` bytes of ``f``, in pieces of at most ``chunk`` bytes; BadInput(``truncated``)
    where the file ends before them (one that became shorter as it was read)."""
    left = size
    while left:
        data = f.read(min(chunk, left))
        if not data:
            raise BadInput(truncated)
        left -= len(data)
        yield data
