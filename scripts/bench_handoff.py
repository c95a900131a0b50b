#!/usr/bin/env python3
"""Hand-off at the hardware's speed (issue 21): loader, whole-model load, in-memory conversion and
verify, each against the floor measured in the same run on the same bytes.

One synthetic gpt-oss-120b-shaped MXFP4 checkpoint (E=128, H=I=2880, ``--layers`` MoE layers, tiny
attention) is written, repacked to the ``triton`` layout with ``mxconv repack``, and then:

* one layer: ``load_layer`` from page cache vs a pinned host -> GPU copy of the same bytes;
* all layers (``load_model``): from page cache and from evicted files (posix_fadvise DONTNEED), vs
  the pinned floor and vs reading the same files sequentially from disk (evicted first), with the
  process's peak RSS growth and the GPU peak over the resident bytes;
* in-memory conversion (``convert_layer``) of one layer's bf16 experts on the GPU to the triton and
  marlin layouts vs a device copy of the same bytes (bandwidth = bytes read + written / time);
* ``mxconv verify`` of the output (plain, ``--reference``, ``--kernel --reference``) with both
  checkpoints evicted first, vs reading both once from disk; peak RSS of each verify process.

    MXCONV_TRITON_KERNELS=.kern PYTHONPATH=src python scripts/bench_handoff.py --dir /tmp/h --out h.json
    PYTHONPATH=src python scripts/bench_handoff.py --small --device cpu --dir /tmp/h --out /tmp/h.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench_disk import evict  # scripts/ is sys.path[0] when a script runs
from bench_e2e import generate

SHAPES = {"120b": dict(E=128, H=2880, I=2880), "small": dict(E=4, H=256, I=256)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fn: Callable[[], Any], device: torch.device, reps: int = 3) -> float:
    """Smallest wall time of ``reps`` calls (seconds), the device synchronized around each."""
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def weight_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.safetensors"))


def evict_all(*roots: Path) -> None:
    for r in roots:
        for f in weight_files(r):
            evict(f)


def sequential_read(files: list[Path]) -> tuple[float, int]:
    """Seconds to read ``files`` once (64 MiB reads, already evicted) and their bytes."""
    buf = bytearray(64 << 20)
    total, t0 = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return time.perf_counter() - t0, total


class RssPeak:
    """Peak resident set size of this process while the block runs (sampled every 5 ms)."""

    def __enter__(self) -> RssPeak:
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @property
    def growth(self) -> int:
        return self.peak - self.base


def pinned_floor(nbytes: int, device: torch.device) -> float:
    """Seconds of one pinned host -> device copy of ``nbytes``."""
    if device.type != "cuda":
        return float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return best_of(lambda: dev.copy_(host, non_blocking=True), device)


def bench_load(out: Path, device: torch.device, res: dict[str, Any]) -> None:
    from mxconv.engines.loader import load_layer
    from mxconv.engines.model_load import load_model

    files = weight_files(out)
    layer_bytes = res["layer_bytes"]
    res["pinned_floor_layer_s"] = pinned_floor(layer_bytes, device)
    sequential_read(files)  # warm the page cache
    wrap = device.type == "cuda"
    if wrap:
        res["load_layer_warm_s"] = best_of(lambda: load_layer(out, 0, device=device), device)
    res["model_bytes"] = model_bytes = layer_bytes * res["layers"]
    res["pinned_floor_model_s"] = res["pinned_floor_layer_s"] * res["layers"]
    for temp in ("warm", "cold"):
        if temp == "cold":
            evict_all(out)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        with RssPeak() as rss:
            t0 = time.perf_counter()
            model = load_model(out, device=device)
            _sync(device)
            res[f"load_model_{temp}_s"] = time.perf_counter() - t0
        res[f"load_model_{temp}_rss_growth"] = rss.growth
        if device.type == "cuda":
            res[f"load_model_{temp}_gpu_over_resident"] = torch.cuda.max_memory_allocated(device) - before - model_bytes
        del model
    evict_all(out)
    res["disk_read_s"], _ = sequential_read(files)
    res["disk_read_gbps"] = model_bytes / res["disk_read_s"] / 1e9


def bench_in_memory(E: int, H: int, I: int, device: torch.device, res: dict[str, Any]) -> None:
    from mxconv.engines.in_memory import ConvertOptions, convert_layer

    g = torch.Generator(device=device).manual_seed(0)
    bf16 = {"w13": torch.randn(E, 2 * I, H, device=device, generator=g).to(torch.bfloat16),
            "w2": torch.randn(E, H, I, device=device, generator=g).to(torch.bfloat16)}  # fmt: skip
    in_bytes = sum(t.numel() * t.element_size() for t in bf16.values())
    copy_s = best_of(lambda: [t.clone() for t in bf16.values()], device)
    res["device_copy_gbps"] = 2 * in_bytes / copy_s / 1e9
    for backend in ("triton", "marlin"):
        opts = ConvertOptions(backend, activation="bf16")
        outs = convert_layer(bf16, opts, row_order="halves")
        out_bytes = sum(t.numel() * t.element_size() for t in outs.values())
        del outs
        s = best_of(lambda: convert_layer(bf16, opts, row_order="halves"), device)
        res[f"in_memory_{backend}_s"] = s
        res[f"in_memory_{backend}_gbps"] = (in_bytes + out_bytes) / s / 1e9
        res[f"in_memory_{backend}_vs_copy"] = res[f"in_memory_{backend}_gbps"] / res["device_copy_gbps"]


# Runs ``mxconv`` with argv[1:] and prints the process's peak RSS (KiB) to stderr at exit.
_WITH_PEAK = ("import atexit, resource, runpy, sys\n"
              "atexit.register(lambda: sys.stderr.write('MAXRSS %d\\n' % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))\n"
              "sys.argv = ['mxconv'] + sys.argv[1:]\n"
              "runpy.run_module('mxconv.cli', run_name='__main__')\n")


def run_peak(args: list[str]) -> tuple[float, int, int, str]:
    """(seconds, exit code, peak RSS bytes, last stdout line) of ``mxconv ARGS`` in a child process."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _WITH_PEAK, *args], capture_output=True, text=True)
    s = time.perf_counter() - t0
    peaks = [int(line.split()[1]) * 1024 for line in p.stderr.splitlines() if line.startswith("MAXRSS ")]
    tail = (p.stdout.strip().splitlines() or p.stderr.strip().splitlines() or [""])[-1]
    return s, p.returncode, peaks[-1] if peaks else -1, tail


def bench_verify(src: Path, out: Path, device: torch.device, res: dict[str, Any]) -> None:
    evict_all(src, out)
    res["read_both_s"], res["read_both_bytes"] = sequential_read(weight_files(src) + weight_files(out))
    base = ["verify", str(out), "--device", device.type]
    runs = {"plain": [], "reference": ["--reference", str(src)]}
    if device.type == "cuda":
        runs["kernel"] = ["--reference", str(src), "--kernel"]
    for name, extra in runs.items():
        evict_all(src, out)
        s, code, peak, tail = run_peak(base + extra)
        res[f"verify_{name}_s"], res[f"verify_{name}_rc"], res[f"verify_{name}_peak_rss"] = s, code, peak
        res[f"verify_{name}_verdict"] = tail
        res[f"verify_{name}_vs_read_both"] = s / res["read_both_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="work directory (source and output are written here)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="E=4, H=I=256 (smoke test)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: load, memory, verify")
    ap.add_argument("--out", required=True, help="JSON results")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the source and output an earlier run left in --dir (e.g. to time another mxconv on them)")
    a = ap.parse_args()
    device, shape, skip = torch.device(a.device), SHAPES["small" if a.small else "120b"], set(a.skip.split(","))
    work = Path(a.dir)
    src, out = work / "src", work / "out"
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "layers": a.layers, **shape}  # fmt: skip
    if not (a.reuse and (out / "mxconv.json").exists()):
        shutil.rmtree(work, ignore_errors=True)
        t0 = time.perf_counter()
        generate(src, "repack", V=1024, layers=a.layers, device=device, **shape)
        res["generate_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "mxconv.cli", "repack", str(src), str(out), "--backend", "triton",
                        "--device", device.type, "--quiet"], check=True)  # fmt: skip
        res["repack_s"] = time.perf_counter() - t0
    res["layer_bytes"] = sum(f.stat().st_size for f in weight_files(out)) // a.layers  # experts dominate
    if "load" not in skip:
        bench_load(out, device, res)
    if "memory" not in skip:
        bench_in_memory(shape["E"], shape["H"], shape["I"], device, res)
    if "verify" not in skip:
        bench_verify(src, out, device, res)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
