"""One writer per OUTPUT: the lock a run holds from its first look at OUTPUT to its last change.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on ``OUTPUT/.mxconv-lock``
(:data:`~mxconv.source.file_names.LOCK_NAME`), taken before any check that decides what to write or
delete (empty? an interrupted run? a live writer?), so that of two runs started together exactly one
goes on and the other stops (BadInput, exit 2) naming the first's pid, which the file holds. It lives
inside OUTPUT, not beside it, because OUTPUT's parent may not be writable, and OUTPUT itself is
never renamed (an ``--overwrite`` moves the entries inside it), so the lock covers the swap too.

The kernel drops a flock when its holder dies, however it dies: a run killed with SIGKILL leaves the
file, and the next run takes the lock on it and writes its own pid. A run removes the file when it
releases the lock; a run that opened the file just before that finds, once it holds a lock, that the
name no longer leads to the file it locked, and starts again with the new one. On a filesystem that
cannot flock, the file alone is the lock (:func:`_take_file`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from mxconv.errors import BadInput
from mxconv.source.file_names import LOCK_NAME
from mxconv.source.in_progress import marker_pid, marker_text, pid_in, process_alive

_ATTEMPTS = 200  # a lock file being replaced or written by its new holder is waited for, briefly
_PAUSE = 0.005
_NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK}  # a filesystem that cannot flock


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _open(path: Path) -> int | None:
    """The lock file opened (created if missing), never through a link; None when the name held
    something else (a link, a FIFO), which is removed: the caller tries again."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            os.unlink(path)
            return None
    except FileNotFoundError:
        pass
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link made since the lstat
            return None
        raise


def _holder(fd: int) -> int | None:
    try:
        return pid_in(os.pread(fd, 4096, 0).decode(errors="replace"))
    except OSError:
        return None


def _write_pid(fd: int) -> None:
    text = marker_text(os.getpid()).encode()
    os.pwrite(fd, text, 0)
    os.ftruncate(fd, len(text))


def _busy(directory: Path, holder: int | None) -> BadInput:
    who = f"pid {holder}" if holder is not None else "its pid unknown"
    return BadInput(f"OUTPUT {directory} is being written by another mxconv run ({who}); wait for it or choose "
                    "another directory")


def _take_file(directory: Path, path: Path) -> int:
    """The lock on a filesystem without flock (Lustre mounted without it, NFS without a lock daemon):
    the file itself, created with ``O_EXCL`` and holding its run's pid; a file whose pid is dead is
    removed and made again. Two runs that find the same dead pid at the same moment could both go on:
    the price of a filesystem that cannot lock."""
    holder: int | None = None
    for attempt in range(_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            try:
                holder = marker_pid(path)
            except OSError:
                holder = None
            if holder is not None and process_alive(holder):
                raise _busy(directory, holder) from None
            if holder is None and attempt < _ATTEMPTS // 10:
                time.sleep(_PAUSE)  # made an instant ago: its pid is being written
                continue
            os.unlink(path)  # its run is gone
            continue
        _write_pid(fd)
        return fd
    raise _busy(directory, holder)


class OutputLock:
    """The held lock on one output directory (see the module docstring); :meth:`release` gives it up."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, directory: Path) -> OutputLock:
        """Take the lock of existing directory ``directory``; BadInput naming the pid of the run that
        holds it. OSError when the lock file cannot be made (the caller reports it as a write error)."""
        path = directory / LOCK_NAME
        holder: int | None = None
        for _ in range(_ATTEMPTS):
            fd = _open(path)
            if fd is None:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                if holder is not None and process_alive(holder):
                    break
                time.sleep(_PAUSE)  # its holder has just taken it and is writing its pid
                continue
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _NO_FLOCK:
                    raise
                return cls(_take_file(directory, path), path)
            if not _same_file(fd, path):  # released and removed (or replaced) since we opened it
                os.close(fd)
                continue
            _write_pid(fd)
            return cls(fd, path)
        raise _busy(directory, holder)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file and give up the lock (safe to call twice)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)
