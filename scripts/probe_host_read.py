#!/usr/bin/env python3
"""The host side of the warm loader's floor (issue 21): how fast the page cache can be copied into
host buffers at all, next to the pinned host -> GPU copy of the same bytes (the floor).

For a file already in the page cache, its first ``--gb`` GB are read with ``os.preadv`` on N threads
(pieces of P MiB) into one buffer of each kind, with no copy to the GPU:

* ``pinned``: ``torch.empty(pin_memory=True)`` (cudaHostAlloc, what the staged reader uses);
* ``pageable``: a plain torch CPU tensor;
* ``mmap_thp`` / ``mmap_plain``: an anonymous mmap (with / without MADV_HUGEPAGE) registered with
  ``cudaHostRegister``, so the GPU can DMA from it like pinned memory.

Then per kind the H2D copy from it, and a double-buffered pipeline (2 x 128 MiB staging buffers of
that kind, the read of one overlapping the copy of the other), the staged reader's scheme in small.

    python scripts/probe_host_read.py --file /tmp/big.bin --gb 1.7 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

MIB = 1 << 20
HUGE = 2 * MIB


def mmap_buffer(size: int, huge: bool) -> tuple[mmap.mmap, torch.Tensor, int]:
    """An anonymous mmap of ``size`` bytes (2 MiB aligned, touched), registered with CUDA: (map, view, error code)."""
    rounded = -(-size // HUGE) * HUGE
    m = mmap.mmap(-1, rounded + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    start = (-t.data_ptr()) % HUGE
    t = t[start : start + rounded]
    t.fill_(1)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    return m, t[:size], int(err)


class Reader:
    """Reads the file's bytes [base, base + n) into a buffer with ``threads`` preadv calls of ``piece`` bytes."""

    def __init__(self, path: str, threads: int) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.pool = ThreadPoolExecutor(threads)

    def read(self, buf: torch.Tensor, base: int, n: int, piece: int) -> None:
        view = memoryview(buf.numpy())

        def one(off: int) -> None:
            k = min(piece, n - off)
            if os.preadv(self.fd, [view[off : off + k]], base + off) != k:
                raise OSError("short read")

        list(self.pool.map(one, range(0, n, piece)))


def best_ms(fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 2)


def pipeline(reader: Reader, bufs: list[torch.Tensor], dev: torch.Tensor, chunk: int, piece: int) -> None:
    """Chunks of the file into ``dev`` through ``bufs`` in turn: a chunk's read overlaps the previous copy."""
    stream, events = torch.cuda.Stream(), [None] * len(bufs)
    for i, off in enumerate(range(0, dev.numel(), chunk)):
        j = i % len(bufs)
        if events[j] is not None:
            events[j].synchronize()
        n = min(chunk, dev.numel() - off)
        reader.read(bufs[j], off, n, piece)
        with torch.cuda.stream(stream):
            dev[off : off + n].copy_(bufs[j][:n], non_blocking=True)
            events[j] = torch.cuda.Event()
            events[j].record(stream)
    stream.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", required=True, help="a file of at least --gb GB (read once first to warm it)")
    ap.add_argument("--gb", type=float, default=1.7)
    ap.add_argument("--threads", default="8,16,32")
    ap.add_argument("--piece-mib", default="2,8,32")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    n = int(a.gb * 1e9)
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "bytes": n, "cores": os.cpu_count()}
    kinds = {"pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True), "pageable": torch.empty(n, dtype=torch.uint8)}
    staging = {"pinned": [torch.empty(128 * MIB, dtype=torch.uint8, pin_memory=True) for _ in range(2)]}
    keep = []
    for name, huge in (("mmap_thp", True), ("mmap_plain", False)):
        m, t, err = mmap_buffer(n, huge)
        bufs = [mmap_buffer(128 * MIB, huge) for _ in range(2)]
        keep += [m, *bufs]
        res[f"{name}_register_error"] = err
        kinds[name], staging[name] = t, [b[1] for b in bufs]
    for t in kinds.values():
        t.fill_(1)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    Reader(a.file, 16).read(kinds["pinned"], 0, n, 8 * MIB)  # the page cache warm
    for threads in (int(v) for v in a.threads.split(",")):
        reader = Reader(a.file, threads)
        for piece in (int(v) for v in a.piece_mib.split(",")):
            for name, buf in kinds.items():
                res[f"read_{name}_t{threads}_p{piece}_ms"] = best_ms(lambda r=reader, b=buf, p=piece: r.read(b, 0, n, p * MIB))
    reader = Reader(a.file, 16)
    for name, buf in kinds.items():
        res[f"h2d_{name}_ms"] = best_ms(lambda b=buf: dev.copy_(b, non_blocking=True), 5)
        if name in staging:
            res[f"pipeline_2x128_{name}_ms"] = best_ms(lambda s=staging[name]: pipeline(reader, s, dev, 128 * MIB, 8 * MIB))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
