"""Time the in-memory bf16 -> ``triton`` (Hopper MXFP4) hand-off of one layer, fused vs unfused vs a
device copy (docs/benchmarks.md, "Fused quantize + triton layout").

    python scripts/bench_fused_triton.py [--experts 128] [--hidden 2880] [--intermediate 2880] [--sweep]

"copy" is a clone of the bf16 experts (2 x their bytes moved); a conversion's rate counts the bf16
bytes read and the kernel bytes written, and "of copy" is that rate over the copy's. The fused and
unfused outputs are compared byte for byte first. ``--sweep`` times the fused kernel's launch shapes.
Needs a CUDA GPU with triton.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from mxconv.engines.in_memory import ConvertOptions, canonical_experts, convert_layer
from mxconv.kernels import triton_fused
from mxconv.layouts import get_layout
from mxconv.layouts.padding import KernelChoice
from mxconv.layouts.triton_bytemap import w13_row_table


def nbytes(ts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--intermediate", type=int, default=2880)
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    E, H, I = a.experts, a.hidden, a.intermediate
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = {"w13": torch.randn(E, 2 * I, H, device="cuda", generator=g).to(torch.bfloat16),
            "w2": torch.randn(E, H, I, device="cuda", generator=g).to(torch.bfloat16)}  # fmt: skip
    opts = ConvertOptions("triton", activation="bf16")
    layout = get_layout("triton")
    lopts = layout.resolve_options()

    def unfused() -> dict[str, torch.Tensor]:
        canon = canonical_experts(bf16, row_order="halves", quant=opts.quant)
        return dict(layout.to_kernel(canon, "bf16", lopts, KernelChoice.AUTO))

    fused = convert_layer(bf16, opts, row_order="halves")
    ref = unfused()
    same = fused.keys() == ref.keys() and all(torch.equal(fused[k], ref[k]) for k in ref)
    moved = nbytes(bf16) + nbytes(fused)
    del fused, ref
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "E": E, "H": H, "I": I, "bytes_equal": same}
    copy_ms = do_bench(lambda: [t.clone() for t in bf16.values()])
    copy_gbps = 2 * nbytes(bf16) / copy_ms / 1e6
    res["copy_ms"], res["copy_GBps"] = round(copy_ms, 3), round(copy_gbps, 1)
    for name, fn in (("fused", lambda: convert_layer(bf16, opts, row_order="halves")), ("unfused", unfused)):
        ms = do_bench(fn)
        res[f"{name}_ms"], res[f"{name}_of_copy"] = round(ms, 3), round(moved / ms / 1e6 / copy_gbps, 3)
    if a.sweep:
        tab = w13_row_table(I, "halves", 2 * I)
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        for br1 in (2, 4, 8):
            for warps in (4, 8):
                triton_fused.KERNEL_CONFIG.update(BR1=br1, num_warps=warps)
                ms = do_bench(lambda: triton_fused.fused_hopper_values(bf16["w13"], tab, H // 2, "rceil", flag))
                res[f"w13_kernel_BR1={br1}_warps={warps}_ms"] = round(ms, 3)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
