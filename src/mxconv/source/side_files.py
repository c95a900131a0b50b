"""The small files a checkpoint carries beside its weights (tokenizer, generation config, chat
template, README) and that an output copies along: what a source may hold under those names.

A side file is read only if it is a regular file (links are followed: the Hugging Face cache links
every snapshot file to a blob) of at most :data:`SIDE_FILE_LIMIT` bytes. A FIFO, a device or a socket
under such a name would make the copy wait forever or read without end, a file above the limit is
no tokenizer: both are refused (BadInput, exit 2) naming the file and the rule, when the source is
opened, before anything is written. The size is taken from the open file, so a name swapped for
something else between the listing and the copy is refused too (:func:`open_side_file`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mxconv.errors import BadInput
from mxconv.sizes import human_bytes

SIDE_FILE_LIMIT = 256 * 2**20  # tokenizer.json of the largest vocabularies is ~35 MB


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _checked_size(path: Path, st: os.stat_result) -> int | None:
    """``st``'s size when it is a regular file within the limit; None for a directory."""
    if stat.S_ISDIR(st.st_mode):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{path}: is {_kind(st.st_mode)}; mxconv copies the files beside the weights (tokenizer, "
                       "configs, chat template) only from regular files: replace it with the file itself or remove it")
    if st.st_size > SIDE_FILE_LIMIT:
        raise BadInput(f"{path}: is {human_bytes(st.st_size)} ({st.st_size} bytes), more than the {SIDE_FILE_LIMIT} bytes "
                       "(256 MiB) a file copied beside the weights (tokenizer, configs, chat template) may take; "
                       "remove it from the source")
    return st.st_size


def side_file_size(path: Path) -> int | None:
    """The size of side file ``path`` (links followed); None when it is a directory or a dangling link
    (nothing to copy); BadInput when it is not a regular file or is larger than the limit."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read it ({exc.strerror or exc})") from None
    return _checked_size(path, st)


def open_side_file(path: Path) -> tuple[int, int]:
    """Open side file ``path`` for reading without waiting (a FIFO opens at once, then is refused):
    ``(fd, size)``, the checks of :func:`side_file_size` made on the open file. The caller closes ``fd``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        size = _checked_size(path, os.fstat(fd))
        if size is None:
            raise BadInput(f"{path}: is a directory, not a file to copy beside the weights")
    except BaseException:
        os.close(fd)
        raise
    return fd, size
