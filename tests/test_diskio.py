"""mxconv.source.diskio: the write-back hint and the one-chunk read-ahead change timing only, never
bytes or errors."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mxconv.source.diskio import MIN_WRITEBACK, read_ahead, start_writeback


def test_read_ahead_yields_everything_in_order_one_ahead() -> None:
    produced: list[int] = []
    seen: list[tuple[int, list[int]]] = []

    def chunks():
        for i in range(5):
            produced.append(i)
            yield i

    with ThreadPoolExecutor(1) as pool:
        for i in read_ahead(chunks(), pool):
            seen.append((i, list(produced)))
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    # while chunk i is handled, chunk i+1 has been (or is being) produced, never i+2
    for i, before in seen:
        assert before[-1] <= i + 1
    with ThreadPoolExecutor(1) as pool:
        assert list(read_ahead(iter(()), pool)) == []


def test_read_ahead_raises_the_producers_error_where_its_chunk_was_due() -> None:
    def chunks():
        yield b"a"
        raise OSError("truncated")

    got = []
    with ThreadPoolExecutor(1) as pool, pytest.raises(OSError, match="truncated"):
        for c in read_ahead(chunks(), pool):
            got.append(c)
    assert got == [b"a"]


def test_read_ahead_closed_early_leaves_no_producer_running() -> None:
    running = threading.Event()
    release = threading.Event()
    finished = []

    def chunks():
        yield 0
        running.set()
        release.wait(5)
        finished.append(1)
        yield 1

    with ThreadPoolExecutor(1) as pool:
        gen = read_ahead(chunks(), pool)
        assert next(gen) == 0
        assert running.wait(5)
        threading.Timer(0.2, release.set).start()
        gen.close()  # waits for the chunk being produced
        assert finished == [1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
def test_start_writeback_is_taken_on_linux_and_skips_small_writes(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    data = os.urandom(MIN_WRITEBACK)
    with open(f, "wb") as fh:
        fh.write(data)
        fh.flush()
        assert start_writeback(fh.fileno(), 0, MIN_WRITEBACK)
        assert not start_writeback(fh.fileno(), 0, MIN_WRITEBACK - 1)
    assert f.read_bytes() == data
    assert not start_writeback(-1, 0, MIN_WRITEBACK)  # a bad descriptor: ignored, False
