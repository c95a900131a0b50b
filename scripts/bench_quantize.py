#!/usr/bin/env python
"""Benchmark the MX quantizers against the device's own copy bandwidth.

For gpt-oss-120b-sized expert stacks (128 x 5760 x 2880 and 128 x 2880 x 2880 bf16) it times

* a plain device copy (``torch.clone`` of a tensor of the same size; read + write bytes),
* the Triton kernels (MXFP4, MXFP8), effective GB/s = (input bytes + data bytes + scale bytes) / time,
* the torch reference path, and torchao's ``to_mx`` when it is importable,

with CUDA events, warm-up and the median of several repetitions, and prints ratios to the copy
bandwidth. ``--small`` uses tiny sizes and also runs on CPU (smoke test). ``--json`` prints one JSON
object instead of the table. ``--sweep`` also times the Triton kernel over launch shapes.

On a machine without CUDA (or ``--device cpu``) it times the CPU torch path instead, on 16 experts of
Qwen3-30B-A3B's stacks (w13 16 x 1536 x 2048, w2 16 x 2048 x 768, bf16): the fast path against the
exact reference computation (``quantize_mx_torch(..., fast=False)``) in cache-sized chunks and in
the 8M-element chunks it ran in before (``exact_8m``: the torch path as it was before the fast path),
the error statistic fused into the quantizer (``error_sums``) against a dequantized
copy, ``dequantize_mx`` and ``first_nonfinite``, with torch's intra-op threads (all cores by default,
``--threads N``); bytes of both paths are checked equal.

Usage (no install needed):  PYTHONPATH=src python scripts/bench_quantize.py [--small] [--json] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mxconv.kernels.mx_triton import quantize_mx_triton, triton_available  # noqa: E402
from mxconv.mx.numerics import dequantize_mx, first_nonfinite, quantize_mx_torch  # noqa: E402

FULL_SHAPES = [(128, 5760, 2880), (128, 2880, 2880)]
SMALL_SHAPES = [(4, 256, 512), (4, 128, 512)]
CPU_SHAPES = [(16, 1536, 2048), (16, 2048, 768)]  # 16 experts of Qwen3-30B-A3B's w13 / w2
# (blocks per tile, warps, tiles per program) tried by --sweep
SWEEP_CONFIGS = [
    (16, 1, 1), (16, 2, 4), (32, 2, 1), (32, 4, 1), (32, 4, 4), (64, 2, 1), (64, 4, 1), (64, 4, 4),
    (64, 8, 1), (128, 4, 1), (128, 4, 2), (128, 8, 1), (256, 4, 1), (256, 8, 1), (512, 8, 1),
]


def time_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def out_bytes(x: torch.Tensor, fmt: str) -> int:
    """Bytes written by a quantizer for x [..., K]: data plus E8M0 scales."""
    n = x.numel()
    return (n // 2 if fmt == "mxfp4" else n) + n // 32


def torchao_quantizer(fmt: str) -> Callable[[torch.Tensor], object] | None:
    """torchao's to_mx in RCEIL mode, or None when torchao's MX formats do not import."""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception:  # noqa: BLE001 - optional comparison
        return None
    elem = torch.float4_e2m1fn_x2 if fmt == "mxfp4" else torch.float8_e4m3fn
    return lambda x: to_mx(x, elem, 32, ScaleCalculationMode.RCEIL)


def bench_shape(shape, device, args) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(shape, device=device, generator=g) * 0.02).to(torch.bfloat16)
    in_bytes = x.numel() * x.element_size()
    res: dict = {"shape": list(shape), "input_bytes": in_bytes}
    copy_ms = time_ms(lambda: x.clone(), device, args.reps, args.warmup)
    res["copy"] = {"ms": copy_ms, "gbps": 2 * in_bytes / copy_ms / 1e6}
    copy_gbps = res["copy"]["gbps"]
    use_triton = triton_available() and device.type == "cuda"
    slow_reps = max(1, min(args.reps, 3))
    for fmt in ("mxfp4", "mxfp8"):
        moved = in_bytes + out_bytes(x, fmt)
        entry: dict = {}
        if use_triton:
            ms = time_ms(lambda: quantize_mx_triton(x, fmt, args.mode), device, args.reps, args.warmup)
            entry["triton"] = {"ms": ms, "gbps": moved / ms / 1e6, "ratio_to_copy": moved / ms / 1e6 / copy_gbps}
            if args.sweep:
                sweep = []
                for bpp, warps, tiles in SWEEP_CONFIGS:
                    def run(bpp=bpp, warps=warps, tiles=tiles):
                        return quantize_mx_triton(
                            x, fmt, args.mode, blocks_per_program=bpp, num_warps=warps, tiles_per_program=tiles
                        )

                    ms = time_ms(run, device, max(3, args.reps // 2), 2)
                    sweep.append({"blocks_per_program": bpp, "num_warps": warps, "tiles_per_program": tiles,
                                  "ms": ms, "ratio_to_copy": moved / ms / 1e6 / copy_gbps})
                entry["triton_sweep"] = sorted(sweep, key=lambda r: r["ms"])
        ms = time_ms(lambda: quantize_mx_torch(x, fmt, args.mode), device, slow_reps, 1)
        entry["torch"] = {"ms": ms, "gbps": moved / ms / 1e6, "ratio_to_copy": moved / ms / 1e6 / copy_gbps}
        ao = torchao_quantizer(fmt)
        if ao is not None:
            try:
                ms = time_ms(lambda: ao(x), device, slow_reps, 1)
                entry["torchao_to_mx"] = {"ms": ms, "gbps": moved / ms / 1e6, "ratio_to_copy": moved / ms / 1e6 / copy_gbps}
            except Exception as exc:  # noqa: BLE001 - report, do not fail the benchmark
                entry["torchao_to_mx"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        res[fmt] = entry
    del x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def bench_cpu_shape(shape, args) -> dict:
    """The CPU torch path on one bf16 stack: fast vs exact, the error statistic, dequantize, scan."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    n = x.numel()
    reps = max(1, args.reps)
    res: dict = {"shape": list(shape), "input_bytes": n * 2}
    copy_ms = time_ms(lambda: x.clone(), x.device, reps, 1)
    res["copy"] = {"ms": copy_ms, "gbps": 2 * n * 2 / copy_ms / 1e6}

    def entry(ms: float, moved: int) -> dict:
        return {"ms": ms, "gelem_s": n / ms / 1e6, "gbps": moved / ms / 1e6}

    res["first_nonfinite"] = entry(time_ms(lambda: first_nonfinite(x), x.device, reps, 1), 2 * n)
    for fmt in ("mxfp4", "mxfp8"):
        moved = 2 * n + out_bytes(x, fmt)
        e: dict = {}
        e["fast"] = entry(time_ms(lambda: quantize_mx_torch(x, fmt, args.mode), x.device, reps, 1), moved)
        e["exact"] = entry(time_ms(lambda: quantize_mx_torch(x, fmt, args.mode, fast=False), x.device,
                                   max(1, min(reps, 2)), 0), moved)
        from mxconv.mx import numerics

        saved = numerics._CHUNK_ELEMS
        numerics._CHUNK_ELEMS = 1 << 23
        try:
            e["exact_8m"] = entry(time_ms(lambda: quantize_mx_torch(x, fmt, args.mode, fast=False), x.device,
                                          max(1, min(reps, 2)), 0), moved)
        finally:
            numerics._CHUNK_ELEMS = saved
        e["speedup"] = e["exact"]["ms"] / e["fast"]["ms"]
        e["speedup_vs_8m"] = e["exact_8m"]["ms"] / e["fast"]["ms"]
        d, s = quantize_mx_torch(x, fmt, args.mode)
        d0, s0 = quantize_mx_torch(x, fmt, args.mode, fast=False)
        e["same_bytes"] = bool(torch.equal(d, d0) and torch.equal(s, s0))
        del d0, s0

        def with_sums():
            sums = [0.0, 0.0]
            quantize_mx_torch(x, fmt, args.mode, error_sums=sums)
            return sums

        def with_copy():  # what a caller does without error_sums: quantize, dequantize, compare
            dd, ss = quantize_mx_torch(x, fmt, args.mode)
            r = x.float()
            return float(dequantize_mx(dd, ss, fmt).sub_(r).square_().sum()), float(r.square().sum())

        e["fast_with_error_sums"] = entry(time_ms(with_sums, x.device, reps, 1), moved)
        e["fast_then_dequantized_error"] = entry(time_ms(with_copy, x.device, reps, 1), moved)
        e["dequantize"] = entry(time_ms(lambda: dequantize_mx(d, s, fmt), x.device, reps, 1), out_bytes(x, fmt) + 4 * n)
        res[fmt] = e
    return res


def copy_line(r: dict, ms: str, gbps: str) -> str:
    """The line that opens one shape's results: the shape, its bf16 size and what a plain copy takes
    (``ms`` and ``gbps``: the format specs of the two numbers)."""
    shape = "x".join(map(str, r["shape"]))
    c = r["copy"]
    return f"\n{shape} bf16 ({r['input_bytes'] / 1e9:.2f} GB): copy {c['ms']:{ms}} ms = {c['gbps']:{gbps}} GB/s"


def print_cpu_table(report: dict) -> None:
    print(f"CPU torch path: {report['device']}, {report['threads']} threads, torch {report['torch']}, mode {report['mode']}")
    for r in report["results"]:
        print(copy_line(r, ".1f", ".1f") + f"; first_nonfinite {r['first_nonfinite']['ms']:.1f} ms "
              f"({r['first_nonfinite']['gelem_s']:.2f} Gelem/s)")
        for fmt in ("mxfp4", "mxfp8"):
            e = r[fmt]
            for key in ("exact_8m", "exact", "fast", "fast_with_error_sums", "fast_then_dequantized_error", "dequantize"):
                v = e[key]
                print(f"  {fmt} {key:28s} {v['ms']:9.1f} ms {v['gelem_s']:6.3f} Gelem/s {v['gbps']:6.2f} GB/s")
            print(f"  {fmt} fast vs exact: {e['speedup']:.1f}x, vs exact in 8M chunks (before): "
                  f"{e['speedup_vs_8m']:.1f}x, same bytes: {e['same_bytes']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke test; runs on CPU)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mode", default="rceil", choices=("rceil", "floor", "even"))
    ap.add_argument("--sweep", action="store_true", help="also time Triton launch shapes")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads on the CPU (default: all cores)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    shapes = SMALL_SHAPES if args.small else FULL_SHAPES
    if device.type == "cpu" and not args.small:
        import os
        import platform

        report = {
            "device": f"{platform.machine()} CPU, {os.cpu_count()} cores", "threads": torch.get_num_threads(),
            "torch": torch.__version__, "mode": args.mode,
            "results": [bench_cpu_shape(s, args) for s in CPU_SHAPES],
        }
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            print_cpu_table(report)
        return 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "device": name,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "mode": args.mode,
        "triton_used": triton_available() and device.type == "cuda",
        "results": [bench_shape(s, device, args) for s in shapes],
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001
        return None


def print_table(report: dict) -> None:
    print(f"device: {report['device']}  torch {report['torch']}  triton {report['triton']}  mode {report['mode']}")
    for r in report["results"]:
        print(copy_line(r, ".3f", ".0f"))
        for fmt in ("mxfp4", "mxfp8"):
            for impl in ("triton", "torch", "torchao_to_mx"):
                e = r[fmt].get(impl)
                if e is None:
                    continue
                if "error" in e:
                    print(f"  {fmt:6s} {impl:14s} error: {e['error']}")
                    continue
                print(f"  {fmt:6s} {impl:14s} {e['ms']:9.3f} ms {e['gbps']:8.0f} GB/s  {100 * e['ratio_to_copy']:5.1f}% of copy")
            for s in r[fmt].get("triton_sweep", [])[:6]:
                print(f"    sweep blocks/tile {s['blocks_per_program']:3d} warps {s['num_warps']} "
                      f"tiles/program {s['tiles_per_program']}: "
                      f"{s['ms']:.3f} ms {100 * s['ratio_to_copy']:.1f}%")


if __name__ == "__main__":
    sys.exit(main())
