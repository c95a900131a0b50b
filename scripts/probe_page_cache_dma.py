#!/usr/bin/env python3
"""Can the GPU copy a layer straight from the page cache, without the staged reader's host copy?
(issue 21's warm-loader floor; docs/benchmarks.md, session 5.)

For a file already in the page cache (the script reads it once first):

* the device attributes that would let a kernel read pageable memory (HMM) at all;
* ``cudaHostRegister`` (read-only | mapped) of an ``mmap`` of the file's first ``--gb`` GB, on
  1, 8 or 16 threads in chunks, then the copy to the GPU from those pages and the unregister;
* the same pipelined: one thread registers ``--chunk-mib`` chunks while the caller copies each one
  registered, for one layer and for ``--layers`` consecutive layers (unregistering at the end or
  after each layer);

each against the pinned host -> GPU copy of the same bytes (the floor). Prints JSON.

    python scripts/probe_page_cache_dma.py --file /tmp/big.bin --gb 1.637 --layers 8
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import queue
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

READ_ONLY_MAPPED = 0x08 | 0x02  # cudaHostRegisterReadOnly | cudaHostRegisterMapped
ATTRIBUTES = {"pageableMemoryAccess": 88, "hostRegisterSupported": 99, "pageableMemoryAccessUsesHostPageTables": 100,
              "hostRegisterReadOnlySupported": 113}  # fmt: skip


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (ctypes calls release the GIL, so threads really run in parallel)."""
    with open("/proc/self/maps") as maps:
        rt = ctypes.CDLL(next(line.split()[-1] for line in maps if "libcudart" in line))
    rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    rt.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    return rt


def synced_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) * 1e3, 1)


def floor_ms(dev: torch.Tensor) -> float:
    """Best of 3 pinned host -> GPU copies of ``dev``'s size."""
    pinned = torch.empty(dev.numel(), dtype=torch.uint8, pin_memory=True)
    return min(synced_ms(lambda: dev.copy_(pinned, non_blocking=True)) for _ in range(3))


def register_then_copy(rt, host: torch.Tensor, dev: torch.Tensor, size: int, threads: int, chunk: int) -> dict:
    """Register [0, size) in chunks on ``threads`` threads, copy each chunk, unregister (ms each)."""
    base, offs = host.data_ptr(), list(range(0, size, chunk))
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        errors = set(pool.map(lambda o: rt.cudaHostRegister(base + o, min(chunk, size - o), READ_ONLY_MAPPED), offs))
        t1 = time.perf_counter()
        if errors != {0}:
            return {"register_errors": sorted(errors)}
        ends = [min(o + chunk, size) for o in offs]  # each copy within one registration
        copy = synced_ms(lambda: [dev[o:e].copy_(host[o:e], non_blocking=True) for o, e in zip(offs, ends)])
        t2 = time.perf_counter()
        list(pool.map(lambda o: rt.cudaHostUnregister(base + o), offs))
        t3 = time.perf_counter()
    return {"register_ms": round((t1 - t0) * 1e3, 1), "copy_ms": copy, "unregister_ms": round((t3 - t2) * 1e3, 1)}


def pipelined(rt, host: torch.Tensor, dev: torch.Tensor, begin: int, end: int, chunk: int) -> tuple[float, list[int]]:
    """Register [begin, end) chunk by chunk on a thread while copying each chunk registered: (ms, chunk offsets)."""
    base, todo, done = host.data_ptr(), queue.Queue(), []

    def register() -> None:
        for o in range(begin, end, chunk):
            todo.put((o, rt.cudaHostRegister(base + o, min(chunk, end - o), READ_ONLY_MAPPED)))
        todo.put(None)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    th = threading.Thread(target=register)
    th.start()
    while (item := todo.get()) is not None:
        o, err = item
        if err:
            raise RuntimeError(f"cudaHostRegister failed ({err}) at offset {o}")
        dev[o : min(o + chunk, end)].copy_(host[o : min(o + chunk, end)], non_blocking=True)
        done.append(o)
    torch.cuda.synchronize()
    th.join()
    return (time.perf_counter() - t0) * 1e3, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", required=True, help="a file of at least --gb x --layers GB (read once to cache it)")
    ap.add_argument("--gb", type=float, default=1.637, help="one layer's bytes, GiB")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--chunk-mib", type=int, default=64)
    a = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*non-writable.*")  # torch.frombuffer of a read-only mmap
    size = int(a.gb * (1 << 30)) // (2 << 20) * (2 << 20)
    torch.zeros(1, device="cuda")
    rt = cudart()
    res: dict[str, object] = {"device": torch.cuda.get_device_name()}
    for name, code in ATTRIBUTES.items():
        v = ctypes.c_int(-1)
        res[name] = v.value if rt.cudaDeviceGetAttribute(ctypes.byref(v), code, 0) == 0 else "error"
    with open(a.file, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    fd = os.open(a.file, os.O_RDONLY)
    m = mmap.mmap(fd, size * a.layers, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    host = torch.frombuffer(m, dtype=torch.uint8)
    dev = torch.empty(size * a.layers, dtype=torch.uint8, device="cuda")
    res["floor_layer_ms"] = floor_ms(dev[:size])
    for threads, chunk_mib in ((1, 256), (8, 64), (16, 64)):
        res[f"register_{threads}_threads_{chunk_mib}MiB"] = [register_then_copy(rt, host, dev, size, threads, chunk_mib << 20) for _ in range(3)]
    chunk = a.chunk_mib << 20
    one = []
    for _ in range(3):
        ms, offs = pipelined(rt, host, dev, 0, size, chunk)
        t0 = time.perf_counter()
        for o in offs:
            rt.cudaHostUnregister(host.data_ptr() + o)
        one.append({"load_ms": round(ms, 1), "unregister_ms": round((time.perf_counter() - t0) * 1e3, 1)})
    res["pipelined_one_layer"] = one
    for per_layer in (False, True):
        t0, offs = time.perf_counter(), []
        for i in range(a.layers):
            _, got = pipelined(rt, host, dev, i * size, (i + 1) * size, chunk)
            if per_layer:
                for o in got:
                    rt.cudaHostUnregister(host.data_ptr() + o)
            else:
                offs += got
        t1 = time.perf_counter()
        for o in offs:
            rt.cudaHostUnregister(host.data_ptr() + o)
        res[f"pipelined_{a.layers}_layers_unregister_{'per_layer' if per_layer else 'at_end'}"] = {
            "load_ms": round((t1 - t0) * 1e3, 1), "then_unregister_ms": round((time.perf_counter() - t1) * 1e3, 1),
            "floor_ms": round(res["floor_layer_ms"] * a.layers, 1)}  # fmt: skip
    sample = [(i * size + o, 16 << 20) for i in range(a.layers) for o in (0, size - (16 << 20))]
    res["bytes_equal_sampled"] = all(torch.equal(dev[o : o + n].cpu(), host[o : o + n]) for o, n in sample)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
