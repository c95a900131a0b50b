"""Keeping the disk busy: start write-back as bytes are written, read the next chunk while this one
is written.

Measured on the GPU machine (``scripts/bench_disk.py``): the disk gives about 0.9 GB/s of writes and
1.5-1.65 GB/s of reads and writes together. Two things kept mxconv below that:

* Written bytes sat in the page cache until a shard was complete (fsync) or the kernel's
  background threshold (10 % of memory, ~12 GB there) was crossed, so the disk wrote nothing
  during the first seconds of a run and the last shard's flush was a tail of seconds at the end.
  :func:`start_writeback` asks the kernel to start writing a range out now (``sync_file_range``
  with ``SYNC_FILE_RANGE_WRITE``: it starts I/O and does not wait for it), so writes leave at the
  disk's pace from the first chunk on and the final fsync has little left to do.
* A byte-for-byte copy read a chunk, then wrote it, then read the next: the disk did one or the
  other. :func:`read_ahead` reads chunk k+1 on a helper thread while chunk k is written.

Both only change timing, never bytes; where ``sync_file_range`` is missing (not Linux) it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, TypeVar

SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start write-out of dirty pages in the range, do not wait
MIN_WRITEBACK = 1 << 20  # smaller writes (headers) are left to the final fsync

T = TypeVar("T")


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if os.uname().sysname != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SFR = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Start writing bytes [offset, offset + nbytes) of ``fd`` to disk without waiting; True when
    the kernel took the request. A hint only: failures are ignored (the shard's fsync still runs)."""
    if _SFR is None or nbytes < MIN_WRITEBACK:
        return False
    return _SFR(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) == 0


def read_ahead(chunks: Iterator[T], pool: ThreadPoolExecutor) -> Iterator[T]:
    """Yield ``chunks`` in order, producing the next one on ``pool`` while the caller works on this
    one (one chunk ahead: one more chunk in memory). An exception of the producer is raised where
    the chunk would have been yielded; the producer is never left running when this ends."""
    pending: Future | None = pool.submit(next, chunks, _END)
    try:
        while True:
            item = pending.result()
            if item is _END:
                pending = None
                return
            pending = pool.submit(next, chunks, _END)
            yield item  # type: ignore[misc]
    finally:
        if pending is not None and not pending.cancel():
            try:  # running: let it finish before the caller closes what it reads from
                pending.result()
            except BaseException:  # noqa: BLE001 - the caller is already leaving with its own exception
                pass


_END: object = object()
