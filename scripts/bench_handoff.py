#!/usr/bin/env python3
"""Hand-off at the hardware's speed (issue 21): loader, whole-model load, in-memory conversion and
verify, each against the floor measured in the same run on the same bytes.

One synthetic gpt-oss-120b-shaped MXFP4 checkpoint (E=128, H=I=2880, ``--layers`` MoE layers, tiny
attention) is written, repacked to the ``triton`` layout with ``mxconv repack``, and then:

* one layer from page cache, read through one kept ``StagedReader`` and loaded (read + engine wrap,
  what ``load_layer`` does), vs a pinned host -> GPU copy of the same bytes;
* all layers (``load_model``): from page cache and from evicted files (posix_fadvise DONTNEED), vs
  the pinned floor and vs reading the same files sequentially from disk (evicted first), with the
  process's peak RSS growth and the GPU peak over the resident bytes;
* both of those for each staging configuration of ``--read-threads`` / ``--piece-mib`` (comma
  lists, paired: ``--read-threads 8,16 --piece-mib 16,8``), side by side under ``"staging"``;
* in-memory conversion (``convert_layer``) of one layer's bf16 experts on the GPU to the triton and
  marlin layouts vs a device copy of the same bytes (bandwidth = bytes read + written / time);
* ``mxconv verify`` of the output (plain, ``--reference``, ``--kernel --reference``) with both
  checkpoints evicted first, vs reading both once from disk; peak RSS of each verify process.
  Each verify is a new Python process, so its time includes the interpreter and ``import torch``:
  with ``--bytecode write`` (the default) the children may write ``.pyc`` files and one warm-up
  child writes them before the timing, as a pip-installed torch has them; ``--bytecode as-is``
  keeps the environment (a torch without ``.pyc`` and ``PYTHONDONTWRITEBYTECODE=1`` compiles every
  module at each start: 5.1 s vs 2.3 s for ``import torch`` on the H200 machine). The JSON records
  which (``bytecode``).

    MXCONV_TRITON_KERNELS=.kern PYTHONPATH=src python scripts/bench_handoff.py --dir /tmp/h --out h.json
    PYTHONPATH=src python scripts/bench_handoff.py --small --device cpu --dir /tmp/h --out /tmp/h.json
    ... --reuse --skip memory,verify --read-threads 8,16 --piece-mib 16,8   # the loader, two stagings
    ... --reuse --skip load,memory --verify-runs reference,kernel            # verify only
    ... --skip load,memory --verify-runs reference --source bf16             # verify's exact path from bf16
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


def staging_runs(read_threads: str, piece_mib: str) -> list[dict[str, int]]:
    """The staging configurations to time: ``--read-threads`` and ``--piece-mib`` as comma lists,
    paired in order (a single value pairs with every value of the other; empty: the default)."""
    from mxconv.engines.staged_read import StagingOptions

    default = StagingOptions()
    threads = [int(v) for v in read_threads.split(",") if v.strip()] or [default.read_threads]
    pieces = [int(v) for v in piece_mib.split(",") if v.strip()] or [default.piece_bytes >> 20]
    n = max(len(threads), len(pieces))
    if {len(threads), len(pieces)} - {1, n}:
        raise SystemExit(f"--read-threads has {len(threads)} values and --piece-mib {len(pieces)}: give as many, or one")
    return [{"read_threads": threads[i if len(threads) > 1 else 0], "piece_mib": pieces[i if len(pieces) > 1 else 0]}
            for i in range(n)]  # fmt: skip


def bench_load(out: Path, device: torch.device, res: dict[str, Any], runs: list[dict[str, int]]) -> None:
    """The floors once, then each staging configuration of ``runs`` (its figures under
    ``res["staging"]``, in order; the first one's also at the top level, as before)."""
    files = weight_files(out)
    layer_bytes = res["layer_bytes"]
    res["pinned_floor_layer_s"] = pinned_floor(layer_bytes, device)
    res["model_bytes"] = layer_bytes * res["layers"]
    res["pinned_floor_model_s"] = res["pinned_floor_layer_s"] * res["layers"]
    res["staging"] = []
    for run in runs:
        got = dict(run)
        bench_load_with(out, device, res, got)
        res["staging"].append(got)
        print("staging", json.dumps(got), file=sys.stderr)
    res.update({k: v for k, v in res["staging"][0].items() if k not in ("read_threads", "piece_mib")})
    evict_all(out)
    res["disk_read_s"], _ = sequential_read(files)
    res["disk_read_gbps"] = res["model_bytes"] / res["disk_read_s"] / 1e9


def bench_load_with(out: Path, device: torch.device, res: dict[str, Any], got: dict[str, Any]) -> None:
    """One staging configuration: one layer read warm through one kept reader, and loaded (read +
    engine wrap); the whole model warm and cold (evicted), with RSS and GPU peaks."""
    from mxconv.engines.loader import build_engine_layer, read_layer_tensors, resolve_layer
    from mxconv.engines.model_load import load_model
    from mxconv.engines.staged_read import MIB, StagedReader, StagingOptions

    staging = StagingOptions(read_threads=got["read_threads"], piece_bytes=got["piece_mib"] * MIB)
    sequential_read(weight_files(out))  # warm the page cache
    src = resolve_layer(out, 0)
    with StagedReader(device, staging) as reader:
        got["read_layer_warm_s"] = best_of(lambda: read_layer_tensors(src, device, reader=reader), device)
    got["read_layer_warm_vs_floor"] = got["read_layer_warm_s"] / res["pinned_floor_layer_s"]
    if device.type == "cuda":
        got["load_layer_warm_s"] = best_of(lambda: build_engine_layer(src, read_layer_tensors(src, device, staging=staging)), device)
    model_bytes = res["model_bytes"]
    for temp in ("warm", "cold"):
        if temp == "cold":
            evict_all(out)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        with RssPeak() as rss:
            t0 = time.perf_counter()
            model = load_model(out, device=device, staging=staging)
            _sync(device)
            got[f"load_model_{temp}_s"] = time.perf_counter() - t0
        got[f"load_model_{temp}_rss_growth"] = rss.growth
        if device.type == "cuda":
            got[f"load_model_{temp}_gpu_over_resident"] = torch.cuda.max_memory_allocated(device) - before - model_bytes
        del model


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


# Runs ``mxconv`` with argv[1:] and prints the process's peak RSS (KiB) to stderr at exit: its own
# VmHWM (ru_maxrss would be at least this benchmark's RSS when it forked: exec keeps the high-water
# mark of the image it replaces; on a machine without /proc, ru_maxrss is all there is).
_WITH_PEAK = ("import atexit, resource, runpy, sys\n"
              "def peak():\n"
              "    try:\n"
              "        return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
              "    except (OSError, StopIteration):\n"
              "        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              "atexit.register(lambda: sys.stderr.write('MAXRSS %d\\n' % peak()))\n"
              "sys.argv = ['mxconv'] + sys.argv[1:]\n"
              "runpy.run_module('mxconv.cli', run_name='__main__')\n")


def child_env(bytecode: str) -> dict[str, str]:
    """The environment of the timed child processes: as this one's, or (``write``) allowed to write
    ``.pyc`` files, which one warm-up import then writes."""
    env = dict(os.environ)
    if bytecode == "write":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        warm = "import importlib.util, torch, mxconv.cli, mxconv.verify, mxconv.verify.prefetch\n" \
               "if importlib.util.find_spec('triton'): import triton"  # fmt: skip
        subprocess.run([sys.executable, "-c", warm], env=env, check=True)
    return env


def run_peak(args: list[str], env: dict[str, str] | None = None) -> tuple[float, int, int, str]:
    """(seconds, exit code, peak RSS bytes, last stdout line) of ``mxconv ARGS`` in a child process."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _WITH_PEAK, *args], capture_output=True, text=True, env=env)
    s = time.perf_counter() - t0
    peaks = [int(line.split()[1]) * 1024 for line in p.stderr.splitlines() if line.startswith("MAXRSS ")]
    tail = (p.stdout.strip().splitlines() or p.stderr.strip().splitlines() or [""])[-1]
    return s, p.returncode, peaks[-1] if peaks else -1, tail


def bench_verify(src: Path, out: Path, device: torch.device, res: dict[str, Any], which: set[str], bytecode: str) -> None:
    env = child_env(bytecode)
    res["bytecode"] = {"mode": bytecode, "PYTHONDONTWRITEBYTECODE": env.get("PYTHONDONTWRITEBYTECODE")}
    evict_all(src, out)
    res["read_both_s"], res["read_both_bytes"] = sequential_read(weight_files(src) + weight_files(out))
    base = ["verify", str(out), "--device", device.type]
    runs = {"plain": [], "reference": ["--reference", str(src)]}
    if device.type == "cuda":
        runs["kernel"] = ["--reference", str(src), "--kernel"]
    runs = {name: extra for name, extra in runs.items() if name in which}
    for name, extra in runs.items():
        evict_all(src, out)
        s, code, peak, tail = run_peak(base + extra, env)
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
    ap.add_argument("--read-threads", default="",
                    help="load: StagingOptions.read_threads, a comma list to time several (default: the library's)")
    ap.add_argument("--piece-mib", default="",
                    help="load: StagingOptions.piece_bytes in MiB, a comma list paired with --read-threads (default: the library's)")
    ap.add_argument("--verify-runs", default="plain,reference,kernel",
                    help="which verify runs to time (comma list of plain, reference, kernel)")
    ap.add_argument("--bytecode", choices=("write", "as-is"), default="write",
                    help="verify children: write .pyc files (once, before the timing; as an installed torch has them) or keep the environment's setting")
    ap.add_argument("--source", choices=("mxfp4", "bf16"), default="mxfp4",
                    help="the source's experts: MXFP4 (repack moves the bytes; verify --reference compares them) or bf16 "
                         "(repack quantizes them; verify --reference quantizes the reference again, on the GPU, and compares bytes)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the source and output an earlier run left in --dir (e.g. to time another mxconv on them)")
    a = ap.parse_args()
    device, shape, skip = torch.device(a.device), SHAPES["small" if a.small else "120b"], set(a.skip.split(","))
    work = Path(a.dir)
    src, out = work / "src", work / "out"
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "layers": a.layers, "source": a.source, **shape}  # fmt: skip
    if not (a.reuse and (out / "mxconv.json").exists()):
        shutil.rmtree(work, ignore_errors=True)
        t0 = time.perf_counter()
        generate(src, "repack" if a.source == "mxfp4" else "quantize", V=1024, layers=a.layers, device=device, **shape)
        res["generate_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "mxconv.cli", "repack", str(src), str(out), "--backend", "triton",
                        "--device", device.type, "--quiet"], check=True)  # fmt: skip
        res["repack_s"] = time.perf_counter() - t0
    res["layer_bytes"] = sum(f.stat().st_size for f in weight_files(out)) // a.layers  # experts dominate
    if "load" not in skip:
        bench_load(out, device, res, staging_runs(a.read_threads, a.piece_mib))
    if "memory" not in skip:
        bench_in_memory(shape["E"], shape["H"], shape["I"], device, res)
    if "verify" not in skip:
        bench_verify(src, out, device, res, set(a.verify_runs.split(",")), a.bytecode)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
