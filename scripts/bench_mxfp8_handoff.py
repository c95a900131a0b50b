"""Time the in-memory hand-off of one MoE layer to the MXFP8 forms (``convert_layer`` to humming's
and marlin's MXFP8 layouts: vLLM 0.33 Fp8MoeBackend.HUMMING / MARLIN) against an HBM device copy of
the same bytes, in one run, and print one JSON line.

    python scripts/bench_mxfp8_handoff.py                # gpt-oss-120b-shaped layer on the GPU (E 128, H = I = 2880)
    python scripts/bench_mxfp8_handoff.py --small        # a tiny layer on the CPU: a smoke test of the script

Per backend: ``bf16`` (float experts quantized to MXFP8, then laid out) and ``mxfp8`` (canonical MXFP8
bytes, float8_e4m3fn values + E8M0 scales, laid out untouched: the refit of an MXFP8 checkpoint).
"copy" is a clone of the input (2 x its bytes moved); a conversion's rate counts its input bytes read
plus its kernel bytes written, and ``*_vs_copy`` is that rate over the copy's rate. The best of
``--reps`` timed calls after one warm-up; the converted bytes are compared with the CPU path's on the
first experts (the full-size check is tests/test_loader_mxfp8_gpu.py). On an H200 it runs in well
under a minute.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch
from _args import parser

from mxconv.engines.in_memory import ConvertOptions, canonical_experts, convert_layer
from mxconv.run.options import QuantOptions

BACKENDS = ("humming", "marlin")


def nbytes(ts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


def best_of(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Smallest wall time of ``reps`` calls (seconds) after one warm-up, the device synchronized around each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def same_as_cpu(backend: str, inputs: dict[str, torch.Tensor], opts: ConvertOptions) -> bool:
    """Whether the device's conversion of the first two experts equals the CPU path's, byte for byte."""
    part = {k: v[:2] for k, v in inputs.items()}
    dev = convert_layer(part, opts)
    cpu = convert_layer({k: v.cpu() for k, v in part.items()}, opts)
    return set(dev) == set(cpu) and all(
        torch.equal(dev[k].cpu().contiguous().view(torch.uint8), cpu[k].contiguous().view(torch.uint8)) for k in cpu)


def main() -> None:
    ap = parser(__doc__, experts=128)
    ap.add_argument("--small", action="store_true", help="E 4, H = I = 256 on the CPU (a smoke test)")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    E, H, I = (4, 256, 256) if a.small else (a.experts, a.hidden, a.intermediate)
    device = torch.device("cpu" if a.small or not torch.cuda.is_available() else "cuda")
    t_start = time.perf_counter()
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = {"w13": torch.randn(E, 2 * I, H, device=device, generator=g).to(torch.bfloat16),
            "w2": torch.randn(E, H, I, device=device, generator=g).to(torch.bfloat16)}  # fmt: skip
    canon = canonical_experts(bf16, quant=QuantOptions("mxfp8"))
    mxfp8 = {"w13": canon.w13.view(torch.float8_e4m3fn), "w13_scale": canon.w13_scale,
             "w2": canon.w2.view(torch.float8_e4m3fn), "w2_scale": canon.w2_scale}  # fmt: skip
    res: dict[str, Any] = {"bench": "mxfp8_handoff", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "E": E, "H": H, "I": I, "reps": a.reps}  # fmt: skip
    for name, inputs in (("bf16", bf16), ("mxfp8", mxfp8)):
        in_bytes = nbytes(inputs)
        copy_s = best_of(lambda: [t.clone() for t in inputs.values()], device, a.reps)
        res[f"copy_{name}_s"], res[f"copy_{name}_gbps"] = copy_s, 2 * in_bytes / copy_s / 1e9
        for backend in BACKENDS:
            opts = ConvertOptions(backend, quant=QuantOptions("mxfp8") if name == "bf16" else None)
            key = f"{backend}_from_{name}"
            out_bytes = nbytes(convert_layer(inputs, opts))
            s = best_of(lambda: convert_layer(inputs, opts), device, a.reps)
            rate = (in_bytes + out_bytes) / s / 1e9
            res.update({f"{key}_s": s, f"{key}_gbps": rate, f"{key}_vs_copy": rate / res[f"copy_{name}_gbps"],
                        f"{key}_in_bytes": in_bytes, f"{key}_out_bytes": out_bytes})  # fmt: skip
            if device.type == "cuda":
                res[f"{key}_bytes_equal_cpu"] = same_as_cpu(backend, inputs, opts)
    res["wall_s"] = time.perf_counter() - t_start
    print(json.dumps(res))


if __name__ == "__main__":
    main()
