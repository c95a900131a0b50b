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
from typing import BinaryIO

from mxconv.errors import BadInput
from mxconv.sizes import human_bytes
from mxconv.source.regular_files import NotRegular, kind_of, open_regular

SIDE_FILE_LIMIT = 256 * 2**20  # tokenizer.json of the largest vocabularies is ~35 MB


def _refused(path: Path, kind: str) -> BadInput:
    return BadInput(f"{path}: is {kind}; mxconv copies the files beside the weights (tokenizer, configs, chat template) "
                    "only from regular files: replace it with the file itself or remove it")


def _within_limit(path: Path, size: int) -> int:
    if size > SIDE_FILE_LIMIT:
        raise BadInput(f"{path}: is {human_bytes(size)} ({size} bytes), more than the {SIDE_FILE_LIMIT} bytes "
                       "(256 MiB) a file copied beside the weights (tokenizer, configs, chat template) may take; "
                       "remove it from the source")
    return size


def side_file_size(path: Path) -> int | None:
    """The size of side file ``path`` (links followed); None when it is a directory or a dangling link
    (nothing to copy); BadInput when it is not a regular file or is larger than the limit."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise _refused(path, kind_of(st.st_mode))
    return _within_limit(path, st.st_size)


def open_side_file(path: Path) -> tuple[BinaryIO, int]:
    """Side file ``path`` opened for reading (:func:`mxconv.source.regular_files.open_regular`: a FIFO
    or a device is refused without being opened, a name swapped for one since the listing too) and its
    size: ``(file, size)``, with the checks of :func:`side_file_size`. The caller closes the file."""
    try:
        f, size = open_regular(path)
    except NotRegular as exc:
        if stat.S_ISDIR(exc.mode):
            raise BadInput(f"{path}: is a directory, not a file to copy beside the weights") from None
        raise _refused(path, exc.kind) from None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        _within_limit(path, size)
    except BadInput:
        f.close()
        raise
    return f, size
