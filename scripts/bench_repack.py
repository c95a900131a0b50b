#!/usr/bin/env python3
"""Benchmark the backend layouts on a gpt-oss-120b-sized MXFP4 expert stack (one MoE layer).

For each backend (default activation, or all with --all-activations) it times, on the same
tensors in the same run:
  * mxconv's batched transform (``Layout.to_kernel`` over the whole [E, ...] stack; on CUDA the
    Triton layout kernels),
  * the device's own copy bandwidth (a clone of the same bytes) -> fraction of copy speed,
  * the load-time way engines do it: one expert at a time in a Python loop, each expert going
    through the torch transform (what vLLM's per-expert index/shuffle calls amount to)
    -> speed-up of batching,
  * on CUDA also: the batched torch path (``to_kernel(..., KernelChoice.TORCH)``: "torch ms") and the
    per-expert loop through the kernels ("loop-k ms").
Also checks that batched and per-expert bytes are identical, and (on CUDA) that CUDA == CPU bytes
on the first and last expert of the stack.

    PYTHONPATH=src python scripts/bench_repack.py            # E=128, H=I=2880 (gpt-oss-120b)
    PYTHONPATH=src python scripts/bench_repack.py --small    # quick CPU smoke test
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from _args import parser
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import CanonicalExperts
from mxconv.layouts import backend_names, get_layout


def make_stack(E: int, H: int, I: int, device: torch.device, bias: bool = True) -> CanonicalExperts:
    g = torch.Generator(device=device).manual_seed(0)
    u8 = dict(dtype=torch.uint8, device=device, generator=g)
    return CanonicalExperts(
        w13=torch.randint(0, 256, (E, 2 * I, H // 2), **u8),
        w13_scale=torch.randint(110, 130, (E, 2 * I, H // 32), **u8),
        w2=torch.randint(0, 256, (E, H, I // 2), **u8),
        w2_scale=torch.randint(110, 130, (E, H, I // 32), **u8),
        w13_bias=torch.randn(E, 2 * I, device=device, generator=g).to(torch.bfloat16) if bias else None,
        w2_bias=torch.randn(E, H, device=device, generator=g).to(torch.bfloat16) if bias else None,
        row_order="interleaved",
    )


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def timeit(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` (CUDA events on GPU, perf_counter on CPU), after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def expert(c: CanonicalExperts, e: int) -> CanonicalExperts:
    s = slice(e, e + 1)
    return CanonicalExperts(c.w13[s], c.w13_scale[s], c.w2[s], c.w2_scale[s],
                            None if c.w13_bias is None else c.w13_bias[s],
                            None if c.w2_bias is None else c.w2_bias[s], c.row_order)


def bench_one(layout, backend: str, act: str, c: CanonicalExperts, in_bytes: int, copy_gbs: float,
              device: torch.device, reps: int, cuda: bool) -> dict:
    out = layout.to_kernel(c, act, None)
    out_bytes = nbytes(out.values())
    t_batched = timeit(lambda: layout.to_kernel(c, act, None), device, reps)
    t_torch = None
    if cuda:
        t_torch = timeit(lambda: layout.to_kernel(c, act, None, KernelChoice.TORCH), device, reps)

    def loop(choice: KernelChoice) -> list[dict[str, torch.Tensor]]:
        return [layout.to_kernel(expert(c, e), act, None, choice) for e in range(c.num_experts)]

    # the engines' way: per-expert torch ops
    t_loop = timeit(lambda: loop(KernelChoice.TORCH), device, max(1, reps // 2))
    per = loop(KernelChoice.TORCH)
    t_loop_k = timeit(lambda: loop(KernelChoice.AUTO), device, max(1, reps // 2)) if cuda else None
    same = True
    for k, v in out.items():
        cat = torch.cat([p[k] for p in per], dim=0)  # dim 0 is experts (or E*N rows for 2-D scales)
        same &= bool(torch.equal(cat.view(torch.uint8), v.view(torch.uint8)))
    del per
    cpu_same = None
    if cuda:
        cpu_same = True
        for e in sorted({0, c.num_experts - 1}):
            sub = expert(c, e)
            k_gpu = layout.to_kernel(sub, act, None)
            sub_cpu = sub.to("cpu")  # non-blocking device->host copy: wait for it before reading
            torch.cuda.synchronize()
            k_cpu = layout.to_kernel(sub_cpu, act, None)
            cpu_same &= all(torch.equal(k_gpu[k].cpu().view(torch.uint8), k_cpu[k].view(torch.uint8)) for k in k_cpu)
    gbs = (in_bytes + out_bytes) / t_batched / 1e9
    return {
        "backend": backend,
        "activation": act,
        "in_bytes": in_bytes,
        "out_bytes": out_bytes,
        "batched_s": t_batched,
        "batched_gb_s": gbs,
        "fraction_of_copy_bw": gbs / copy_gbs,
        "per_expert_loop_s": t_loop,
        "speedup_vs_per_expert_loop": t_loop / t_batched,
        "per_expert_bytes_identical": same,
        "cuda_equals_cpu": cpu_same,
        "batched_torch_path_s": t_torch,
        "per_expert_loop_kernels_s": t_loop_k,
    }


def main() -> None:
    ap = parser(__doc__, experts=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="E=4, H=I=256: a CPU smoke test")
    ap.add_argument("--all-activations", action="store_true", help="every activation, not only the default")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.small:
        args.experts, args.hidden, args.intermediate, args.reps = 4, 256, 256, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    c = make_stack(args.experts, args.hidden, args.intermediate, device)
    in_bytes = nbytes([c.w13, c.w13_scale, c.w2, c.w2_scale, c.w13_bias, c.w2_bias])
    blob = torch.empty(in_bytes, dtype=torch.uint8, device=device)
    copy_s = timeit(lambda: blob.clone(), device, args.reps)
    copy_gbs = 2 * in_bytes / copy_s / 1e9
    rows = []
    cuda = device.type == "cuda"
    for backend in backend_names():
        layout = get_layout(backend)
        for act in layout.activations if args.all_activations else layout.activations[:1]:
            rows.append(bench_one(layout, backend, act, c, in_bytes, copy_gbs, device, args.reps, cuda))
    doc = {
        "device": name,
        "shape": {"E": args.experts, "H": args.hidden, "I": args.intermediate},
        "copy_gb_s": copy_gbs,
        "backends": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"device: {name}; stack E={args.experts} H={args.hidden} I={args.intermediate}; "
          f"input {in_bytes / 1e9:.3f} GB; copy bandwidth {copy_gbs:.0f} GB/s (read+write)")
    print(f"{'backend':8} {'act':6} {'ms':>9} {'GB/s':>8} {'of copy':>8} {'loop ms':>9} {'speed-up':>9} {'same':>5} {'cuda==cpu':>9}"
          f" {'torch ms':>9} {'loop-k ms':>9}")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1e3 * v:.2f}"

    for r in rows:
        print(f"{r['backend']:8} {r['activation']:6} {1e3 * r['batched_s']:9.2f} {r['batched_gb_s']:8.1f} "
              f"{100 * r['fraction_of_copy_bw']:7.1f}% {1e3 * r['per_expert_loop_s']:9.1f} {r['speedup_vs_per_expert_loop']:8.1f}x "
              f"{str(r['per_expert_bytes_identical']):>5} {str(r['cuda_equals_cpu']):>9}"
              f" {ms(r['batched_torch_path_s']):>9} {ms(r['per_expert_loop_kernels_s']):>9}")


if __name__ == "__main__":
    main()
