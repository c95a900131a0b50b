#!/usr/bin/env python3
"""``--format fp8-block`` on the GPU (issue 22 item 6): the MXFP4 -> block-FP8 re-encode of one
gpt-oss-120b-sized layer as a fraction of the device's copy bandwidth, and the share of exact 128x128
blocks on gpt-oss-shaped MXFP4.

* Re-encode: the torch path (``mxconv.mx.fp8_block.mxfp4_to_fp8_block``) and the Triton kernel
  ``quantize`` runs on CUDA (``mxconv.kernels.fp8_block_triton``) on gate_up [128, 5760, 2880] and
  down [128, 2880, 2880] MXFP4 stacks on the device, timed with CUDA events (median of ``--reps``
  after a warm-up). Bytes moved = MXFP4 read (data + scales) + E4M3 and fp32 scale_inv written;
  "copy" = a device-to-device copy of the same number of bytes; the ratio is re-encode GB/s / copy
  GB/s (target >= 0.9). The Triton amax/448 path is timed too, from bf16 weights of the same shapes
  (2 bytes read, 1 written per element).
* Exact blocks: (a) random MXFP4 with gpt-oss-like scale bytes (every group's byte drawn from
  ``--scale-lo .. --scale-hi``), (b) "real-model-like": Gaussian and Student-t (nu=3) weights with
  outlier rows quantized to MXFP4 by mxconv (``even`` scales), the weights docs/numerics.md's table uses.

    python scripts/bench_fp8_block.py --reps 5 --json bench-fp8.json
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_repack import timeit

from mxconv.kernels.fp8_block_triton import (
    float_to_fp8_block_triton,
    mxfp4_to_fp8_block_triton,
)
from mxconv.kernels.quantize import mxfp4_to_fp8_block as reencode
from mxconv.kernels.quantize import quantize_mx
from mxconv.mx.fp8_block import mxfp4_to_fp8_block

GATE_UP = (128, 5760, 2880)
DOWN = (128, 2880, 2880)


def _timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` on the GPU (scripts/bench_repack.py's timer), after a warm-up."""
    return timeit(fn, torch.device("cuda"), reps)


def _random_mx(shape: tuple[int, int, int], lo: int, hi: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    E, N, K = shape
    data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev)
    return data, torch.randint(lo, hi + 1, (E, N, K // 32), dtype=torch.uint8, device=dev)


def _ratio(moved: int, t: float, tc: float) -> dict:
    return {"seconds": t, "gb_per_s": moved / t / 1e9, "copy_gb_per_s": moved / tc / 1e9, "fraction_of_copy": tc / t}


def _copy_seconds(moved: int, reps: int) -> float:
    """A device-to-device copy that reads and writes moved/2 bytes each: ``moved`` bytes in all."""
    buf = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    tc = _timed(lambda src=buf, to=dst: to.copy_(src), reps)
    del buf, dst
    torch.cuda.empty_cache()
    return tc


def bench_layer(reps: int, lo: int, hi: int, paths: tuple[str, ...]) -> dict:
    """Per projection and path: the MXFP4 re-encode (torch: mxconv.mx.fp8_block; triton: the kernel
    quantize runs on CUDA) and, for triton, the amax/448 path from bf16 weights, against copy bandwidth."""
    out: dict = {}
    for name, shape in (("gate_up", GATE_UP), ("down", DOWN)):
        data, scales = _random_mx(shape, lo, hi, "cuda")
        E, N, K = shape
        sinv_bytes = 4 * E * -(-N // 128) * -(-K // 128)
        moved = data.numel() + scales.numel() + E * N * K + sinv_bytes
        tc = _copy_seconds(moved, reps)
        for path in paths:
            fn = mxfp4_to_fp8_block if path == "torch" else mxfp4_to_fp8_block_triton
            out[f"{name} mxfp4 {path}"] = _ratio(moved, _timed(lambda d=data, s=scales, f=fn: f(d, s), reps), tc)
        del data, scales
        torch.cuda.empty_cache()
        if "triton" in paths:
            w = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
            moved = 2 * w.numel() + w.numel() + sinv_bytes
            t = _timed(lambda x=w: float_to_fp8_block_triton(x), reps)
            out[f"{name} bf16 triton"] = _ratio(moved, t, _copy_seconds(moved, reps))
            del w
            torch.cuda.empty_cache()
    return out


def exact_share(lo: int, hi: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {}
    data, scales = _random_mx((8, 5760, 2880), lo, hi, "cuda")
    r = reencode(data, scales)
    res["random_gpt_oss_shaped"] = float(r.exact.float().mean())
    shape = (8, 2880, 2880)
    for kind in ("gaussian", "student_t3", "outlier_rows"):
        if kind == "student_t3":
            w = torch.distributions.StudentT(3.0).sample(shape).to("cuda") * 0.02
        else:
            w = torch.randn(shape, device="cuda", generator=g) * 0.02
        if kind == "outlier_rows":
            w[:, ::97] *= 50
        d, s = quantize_mx(w, "mxfp4", "even")
        res[kind] = float(reencode(d, s).exact.float().mean())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--scale-lo", type=int, default=118, help="smallest E8M0 byte of the random MXFP4 (gpt-oss: ~115-125)")
    ap.add_argument("--scale-hi", type=int, default=125)
    ap.add_argument("--paths", default="torch,triton", help="re-encode paths to time: torch, triton or both")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "reencode": bench_layer(a.reps, a.scale_lo, a.scale_hi, tuple(a.paths.split(","))), "exact_share": exact_share(a.scale_lo, a.scale_hi)}
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
