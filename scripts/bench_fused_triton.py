"""Time the in-memory bf16 -> ``triton`` (Hopper MXFP4) hand-off of one layer, fused vs unfused vs a
device copy (docs/benchmarks.md, "Fused quantize + triton layout").

    python scripts/bench_fused_triton.py [--experts 128] [--hidden 2880] [--intermediate 2880] [--sweep] [--profile]

"copy" is a clone of the bf16 experts (2 x their bytes moved); a conversion's rate counts the bf16
bytes read and the kernel bytes written, and "of copy" is that rate over the copy's. The fused and
unfused outputs are compared byte for byte first. ``--sweep`` first times the fused kernel's launch
shapes on w13 (and the plain quantizer there, its streaming bound) and keeps the fastest for the rest.
The same experts in gpt-oss' own [E, H, 2I] / [E, I, H] layout go through ``convert_layer`` too,
and w13's transposed copy is timed (torch's, and the Triton tile transpose per tile shape).
``--profile`` lists the GPU work of three fused calls in order (torch.profiler), each with the idle
time before it: what a call spends on the host before and between its launches.
Needs a CUDA GPU with triton.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from mxconv.engines.in_memory import ConvertOptions, canonical_experts, convert_layer
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.kernels import triton_fused
from mxconv.kernels.mx_triton import quantize_mx_triton
from mxconv.layouts import get_layout
from mxconv.layouts.triton_bytemap import w13_row_table


def nbytes(ts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--intermediate", type=int, default=2880)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--profile", action="store_true")
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

    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "E": E, "H": H, "I": I}
    if a.sweep:
        res.update(sweep(bf16["w13"], I))
    res.update(parts(bf16, H, I))
    fused = convert_layer(bf16, opts, row_order="halves")
    ref = unfused()
    same = fused.keys() == ref.keys() and all(torch.equal(fused[k], ref[k]) for k in ref)
    moved = nbytes(bf16) + nbytes(fused)
    del fused, ref
    res["kernel_config"], res["bytes_equal"] = dict(triton_fused.KERNEL_CONFIG), same
    copy_ms = do_bench(lambda: [t.clone() for t in bf16.values()])
    copy_gbps = 2 * nbytes(bf16) / copy_ms / 1e6
    res["copy_ms"], res["copy_GBps"] = round(copy_ms, 3), round(copy_gbps, 1)
    for name, fn in (("fused", lambda: convert_layer(bf16, opts, row_order="halves")), ("unfused", unfused)):
        ms = do_bench(fn)
        res[f"{name}_ms"], res[f"{name}_of_copy"] = round(ms, 3), round(moved / ms / 1e6 / copy_gbps, 3)
    res.update(gpt_oss_naming(bf16, opts, copy_gbps))
    if a.profile:
        res["profile"] = gpu_timeline(lambda: convert_layer(bf16, opts, row_order="halves"))
    print(json.dumps(res, indent=1))


def gpt_oss_naming(bf16: dict[str, torch.Tensor], opts: ConvertOptions, copy_gbps: float) -> dict[str, object]:
    """The same experts in gpt-oss' own layout (gate_up_proj [E, H, 2I], down_proj [E, I, H]):
    convert_layer on them (made row-contiguous first), and that transposed copy of w13 by torch and
    by ``transposed_copy`` per tile shape (ms; "of copy" over its 2 x bytes)."""
    from mxconv.kernels import triton_common

    raw = {"gate_up_proj": bf16["w13"].transpose(1, 2).contiguous(), "down_proj": bf16["w2"].transpose(1, 2).contiguous()}
    res: dict[str, object] = {"gpt_oss_naming_convert_ms": round(do_bench(lambda: convert_layer(raw, opts)), 3)}
    view = raw["gate_up_proj"].transpose(1, 2)
    moved = 2 * view.numel() * view.element_size()
    ms = do_bench(lambda: view.contiguous())
    res["w13_transpose_torch_ms"], res["w13_transpose_torch_of_copy"] = round(ms, 3), round(moved / ms / 1e6 / copy_gbps, 3)
    default = dict(triton_common.KERNEL_CONFIG["transposed_copy"])
    for br, bc, warps in ((64, 64, 4), (128, 64, 8), (64, 128, 8), (32, 32, 4), (128, 128, 8)):
        triton_common.KERNEL_CONFIG["transposed_copy"] = {"BR": br, "BC": bc, "num_warps": warps}
        ms = do_bench(lambda: triton_common.transposed_copy(view))
        res[f"w13_transpose_triton_{br}x{bc}x{warps}_ms"] = round(ms, 3)
        res[f"w13_transpose_triton_{br}x{bc}x{warps}_of_copy"] = round(moved / ms / 1e6 / copy_gbps, 3)
    triton_common.KERNEL_CONFIG["transposed_copy"] = default
    return res


def gpu_timeline(fn, calls: int = 3) -> list[str]:
    """The GPU activities of ``calls`` calls of ``fn`` in order: "name ms (idle before: ms)"."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
    lines, prev = [], None
    for e in events:
        idle = "" if prev is None else f" (idle before: {(e.time_range.start - prev) / 1e3:.3f} ms)"
        lines.append(f"{e.name[:48]} {(e.time_range.end - e.time_range.start) / 1e3:.3f} ms{idle}")
        prev = e.time_range.end
    return lines


def sweep(w13: torch.Tensor, I: int) -> dict[str, float]:
    """w13's fused kernel per launch shape (ms), the quantizer alone; leaves the fastest shape set."""
    tab = w13_row_table(I, "halves", 2 * I, w13.device)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    geo = triton_fused.HopperScales(-(-len(tab) // 256) * 256, -(-w13.shape[-1] // 128) * 4, 8)  # as convert_layer's
    res = {"w13_quantize_only_ms": round(do_bench(lambda: quantize_mx_triton(w13, "mxfp4")), 3)}
    best: tuple[float, dict[str, int]] = (float("inf"), {})
    for br0, br1, warps, iters, maxnreg in SHAPES:
        cfg = {"BR0": br0, "BR1": br1, "num_warps": warps, "ITERS": iters, "maxnreg": maxnreg}
        triton_fused.KERNEL_CONFIG.update(cfg)
        try:
            ms = do_bench(lambda: triton_fused.fused_hopper_values(w13, tab, w13.shape[-1] // 2, "rceil", flag, geo))
        except Exception as exc:  # noqa: BLE001 - a shape this Triton cannot build is reported, not fatal
            res["w13_fused_" + ",".join(f"{k}={v}" for k, v in cfg.items()) + "_error"] = repr(exc)[:200]
            continue
        res["w13_fused_" + ",".join(f"{k}={v}" for k, v in cfg.items()) + "_ms"] = round(ms, 3)
        best = min(best, (ms, cfg), key=lambda t: t[0])
    triton_fused.KERNEL_CONFIG.update(best[1])
    return res


def parts(bf16: dict[str, torch.Tensor], H: int, I: int) -> dict[str, float]:
    """The fused layer's launches one by one (ms): each fused kernel (values and scales)."""
    from mxconv.layouts.triton_bytemap import w2_row_table

    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    tabs = {"w13": w13_row_table(I, "halves", 2 * I, "cuda"), "w2": w2_row_table(H, H, "cuda")}
    res = {}
    for w, tab in tabs.items():
        x = bf16[w]
        geo = triton_fused.HopperScales(-(-len(tab) // 256) * 256, -(-x.shape[-1] // 128) * 4, 8)  # as convert_layer's
        res[f"{w}_fused_kernel_ms"] = round(do_bench(
            lambda x=x, tab=tab, geo=geo: triton_fused.fused_hopper_values(x, tab, x.shape[-1] // 2, "rceil", flag, geo)), 3)
    return res


# (BR0, BR1, num_warps, ITERS, maxnreg)
SHAPES = [(1, 1, 1, 1, 0), (1, 1, 1, 1, 64), (1, 1, 1, 5, 0), (1, 1, 1, 3, 64), (1, 1, 1, 5, 64), (1, 1, 1, 9, 64),
          (1, 1, 1, 9, 48), (2, 1, 2, 5, 0), (2, 1, 2, 5, 64), (2, 1, 2, 9, 48), (2, 1, 2, 9, 40), (2, 1, 2, 9, 32),
          (4, 1, 4, 5, 0), (4, 1, 4, 9, 40), (1, 2, 2, 5, 0)]  # fmt: skip


if __name__ == "__main__":
    main()
