"""The compute side of ``quantize --targets linear``: a layer's linear layers read on the reader
threads and quantized to MXFP8 on the device, with the same kernels and scale rounding as the
experts (:func:`mxconv.run.compute.quantize_stack`); the selection and planning side is
:mod:`mxconv.run.linears`.

torch is imported lazily, in the functions that compute.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from mxconv.errors import BadInput
from mxconv.run.compute import ErrorStats, RunStats, quantize_stack, to_host
from mxconv.run.linears import FP8_BLOCK, LINEAR_FORMAT, LinearRef, source_float
from mxconv.run.options import QuantOptions
from mxconv.run.pipeline import ComputeFn, LoadFn, WorkItem
from mxconv.source.checkpoint import Checkpoint

if TYPE_CHECKING:
    import torch

    from mxconv.run.plan import Plan


def load_linears(ckpt: Checkpoint, refs: list[LinearRef]) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """module -> (weight as stored, fp32 scale_inv or None), on the CPU."""
    return {r.module: (ckpt.read(r.weight), ckpt.read(r.source_names[1]).float() if r.block else None) for r in refs}


def quantize_linears(refs: list[LinearRef], data: dict[str, tuple[torch.Tensor, torch.Tensor | None]], quant: QuantOptions,
                     stats: ErrorStats, device: torch.device) -> dict[str, torch.Tensor]:
    """One layer's linears -> ``{module}.weight`` (float8_e4m3fn) and ``.weight_scale`` (uint8) on the
    host. NaN/Inf are refused (naming weight and index) unless ``quant.allow_nonfinite``."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for r in refs:
        w, sinv = data[r.module]
        x = source_float(w, sinv, r.block, device).unsqueeze(0)
        where = (lambda name: lambda idx: f"{name} [{idx[1]}, {idx[2]}]")(r.weight)
        if r.out_format == FP8_BLOCK:
            out.update(_fp8_block_linear(r, x.float(), stats))
            continue
        st = quantize_stack((1, *r.shape), lambda e0, e1, x=x: x[e0:e1], LINEAR_FORMAT, quant, where, stats, device)
        out[r.weight] = to_host(st.data[0]).view(torch.float8_e4m3fn)
        out[f"{r.module}.weight_scale"] = to_host(st.scales[0])
        del x, st
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


def _fp8_block_linear(r: LinearRef, x: torch.Tensor, stats: ErrorStats) -> dict[str, torch.Tensor]:
    """One linear [1, N, K] fp32 -> ``weight`` E4M3 and ``weight_scale_inv`` fp32 (amax/448 per 128x128
    tile) on the host; a NaN/Inf value is refused (a tile scale cannot carry it)."""
    from mxconv.kernels.quantize import float_to_fp8_block
    from mxconv.mx.numerics import dequantize_fp8_block, first_nonfinite

    idx = first_nonfinite(x)
    if idx is not None:
        raise BadInput(f"non-finite value {x[idx].item()} in {r.weight} [{idx[1]}, {idx[2]}]; block-FP8 tile scales "
                       "cannot carry it (QuantOptions.allow_nonfinite applies to the MX formats)")
    q = float_to_fp8_block(x)
    stats.add(x, dequantize_fp8_block(q.data, q.scale_inv, (128, 128)))
    return {r.weight: to_host(q.data[0]), f"{r.module}.weight_scale_inv": to_host(q.scale_inv[0])}


def linear_load(plan: Plan, load: LoadFn) -> LoadFn:
    """The pipeline's load step, taking the plan's "linear" items too."""
    return lambda item: load_linears(plan.ckpt, item.payload) if item.kind == "linear" else load(item)


def linear_compute(plan: Plan, compute: ComputeFn, device: torch.device, stats: RunStats) -> ComputeFn:
    """The pipeline's compute step, taking the plan's "linear" items too."""

    def run(item: WorkItem, data: Any) -> list[dict[str, torch.Tensor]]:
        if item.kind != "linear":
            return compute(item, data)
        t0 = time.perf_counter()
        out = [quantize_linears(item.payload, data, plan.quant, stats.errors, device)]
        stats.compute_seconds += time.perf_counter() - t0
        return out

    return run
