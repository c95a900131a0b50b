#!/usr/bin/env python3
"""What the machine's disk and CPU give a conversion, measured alone: read, write (fsync'd) and
both at once, plus sha256 and the NaN/Inf scan per core. It explains `bench_e2e.py`'s floor: a run
whose floor is write-bound gains nothing from reading ahead, and one whose writer is slower than
the disk is held back by its hashing thread, not by the disk.

    python scripts/bench_disk.py --dir /tmp/bench --gb 6 [--json]

Page cache is evicted (posix_fadvise DONTNEED after fsync) before every read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from pathlib import Path

CHUNK = 64 << 20


def evict(p: Path) -> None:
    """Drop ``p`` from the page cache (after an fsync), so the next read comes from the disk."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_file(p: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` in 64 MiB chunks and fsync."""
    buf = memoryview(os.urandom(CHUNK))
    t0 = time.perf_counter()
    with open(p, "wb", buffering=0) as fh:
        done = 0
        while done < nbytes:
            done += fh.write(buf[: min(CHUNK, nbytes - done)])
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


def read_file(p: Path) -> float:
    buf = memoryview(bytearray(CHUNK))
    t0 = time.perf_counter()
    with open(p, "rb", buffering=0) as fh:
        while fh.readinto(buf):
            pass
    return time.perf_counter() - t0


def hash_rate(nbytes: int = 1 << 30) -> float:
    buf = memoryview(os.urandom(CHUNK))
    h = hashlib.sha256()
    t0 = time.perf_counter()
    for _ in range(nbytes // CHUNK):
        h.update(buf)
    return nbytes / (time.perf_counter() - t0)


def cpu_facts() -> dict:
    model, flags = "?", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    vm = {}
    for k in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes"):
        try:
            vm[k] = int(Path(f"/proc/sys/vm/{k}").read_text())
        except (OSError, ValueError):
            pass
    return {"cpu": model, "cores": os.cpu_count(), "sha_ni": "sha_ni" in flags, "vm": vm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mxconv-bench"))
    ap.add_argument("--gb", type=float, default=6.0, help="bytes per file, GB")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    n = int(args.gb * 1e9) // CHUNK * CHUNK
    a, b = args.dir / "disk-a.bin", args.dir / "disk-b.bin"
    doc: dict = cpu_facts()
    doc["bytes"] = n
    doc["write_GBps"] = n / write_file(a, n) / 1e9
    evict(a)
    doc["read_GBps"] = n / read_file(a) / 1e9
    evict(a)
    times: dict[str, float] = {}
    t_read = threading.Thread(target=lambda: times.__setitem__("r", read_file(a)))
    t0 = time.perf_counter()
    t_read.start()
    times["w"] = write_file(b, n)
    t_read.join()
    both = time.perf_counter() - t0
    doc["both_read_GBps"] = n / times["r"] / 1e9
    doc["both_write_GBps"] = n / times["w"] / 1e9
    doc["both_total_GBps"] = 2 * n / both / 1e9
    doc["sha256_GBps"] = hash_rate() / 1e9
    for p in (a, b):
        p.unlink()
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        for k, v in doc.items():
            print(f"{k:18} {v:.3f}" if isinstance(v, float) else f"{k:18} {v}")


if __name__ == "__main__":
    main()
