"""``mxconv verify --kernel``: the engine's own kernel, fed the files on disk, against the reference.

For every checked layer of a kernel-layout output the backend's engine kernel (the
:class:`~mxconv.engines.runner.EngineRunner` its layout points to; see :mod:`mxconv.engines`) runs
the full MoE forward on the same seeded hidden states and routing as the reference runner.
Its output [T, H] is compared

* with the reference runner on the converted checkpoint's own (inverted) MXFP4 bytes: does the kernel
  read the bytes the way the layout spec says? Bound: :data:`KERNEL_THRESHOLDS` (bf16 activations,
  bf16 GEMM outputs: measured 3.9e-3 - 5.7e-3 relative RMS on an H100);
* with the reference (``--reference`` / ``--reference-outputs``) when one is given: does the engine,
  fed these files, compute what the source computes? Bound: the numerics threshold of the pair
  widened by the kernel's own rounding.

A kernel that cannot run here (no SM90 GPU, kernels not found, an output variant the kernel does not
read) is bad usage (exit 2) naming what is missing; sizes the kernel accepts but computes wrongly
(the layout's ``size_warnings``) are a verification failure (exit 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxconv.engines.loader import HeldTensor, run_kernel_layer
from mxconv.engines.runner import KERNEL_THRESHOLDS, engine_runner, kernel_unavailable, runner_backends
from mxconv.errors import BadInput, LayoutError
from mxconv.experts.kernel_settings import KernelLocations
from mxconv.layouts import get_layout
from mxconv.layouts.base import Layout
from mxconv.verify.reference_moe import Comparison, LayerForward, apart, compare
from mxconv.source.manifest import Manifest

@dataclass
class KernelResult:
    """One layer's kernel check: status "ok" | "FAIL", the two comparisons, and what failed."""

    status: str = "ok"
    vs_converted: Comparison | None = None
    vs_reference: Comparison | None = None
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "vs_converted": self.vs_converted.to_json() if self.vs_converted else None,
            "vs_reference": self.vs_reference.to_json() if self.vs_reference else None,
        }


def kernel_preflight(manifest: Manifest, kernel_locations: KernelLocations | None = None) -> tuple[Layout, list[str]]:
    """The output's layout and the size problems that make its kernel compute wrongly (FAIL).
    BadInput (exit 2) when the kernel cannot run on this machine (kernels looked for at
    ``kernel_locations`` first), naming what is missing."""
    backend = manifest.backend
    if not backend:
        choices = " or ".join(runner_backends())
        raise BadInput(f"VerifyOptions.kernel: a canonical checkpoint has no backend kernel (repack it with RepackOptions.backend {choices})")
    layout = get_layout(backend)
    lay = manifest.layout
    try:
        options = layout.resolve_options(lay.option_values)
    except LayoutError as exc:  # the output's own manifest is damaged: a verification failure (exit 1)
        return layout, [f"the manifest's layout options: {exc}"]
    problems = layout.size_warnings(lay.hidden_size, lay.intermediate_size, options)
    if problems:
        return layout, problems
    unavailable = layout.kernel_unavailable if engine_runner(backend) is None else kernel_unavailable
    reason = unavailable(manifest, "cuda", kernel_locations)
    if reason:
        raise BadInput(f"VerifyOptions.kernel: cannot run the {backend} engine kernel here: {reason}")
    return layout, []


def _bound(threshold: dict[str, float]) -> dict[str, float]:
    """A numerics threshold widened by the kernel's own bf16 rounding."""
    return {
        "rel_rms": threshold["rel_rms"] + KERNEL_THRESHOLDS["rel_rms"],
        "cosine": threshold["cosine"] - (1.0 - KERNEL_THRESHOLDS["cosine"]),
        "topk_agreement": threshold["topk_agreement"],
    }


def _judge(what: str, cmp: Comparison, bound: dict[str, float]) -> list[str]:
    bad = []
    if not cmp.rel_rms <= bound["rel_rms"]:  # NaN fails
        bad.append("{}: relative RMS error {} > {}".format(what, *apart(cmp.rel_rms, bound["rel_rms"])))
    if not cmp.cosine >= bound["cosine"]:
        bad.append("{}: cosine {} < {}".format(what, *apart(cmp.cosine, bound["cosine"])))
    return bad


def check_kernel_layer(root: Path, manifest: Manifest, layer: int, forward: LayerForward,
                       kernel_locations: KernelLocations | None = None,
                       held: list[dict[str, HeldTensor]] | None = None) -> KernelResult:
    """Run the engine kernel of the output at ``root`` on layer ``layer`` and judge it.

    ``forward``: the reference runner on the converted bytes (hidden states, routing, output) and,
    when a reference was given, its output, top-k ids and threshold; ``held`` the layer's tensors
    as verify read them (per rank), handed to the kernel instead of a second read of the files.
    """
    res = KernelResult()
    x, routing = forward.x, forward.routing
    out = run_kernel_layer(root, manifest, layer, x, routing, kernel_locations=kernel_locations, held=held).float().cpu()
    if not bool(torch.isfinite(out).all()):
        res.problems.append(f"layer {layer} kernel: the engine kernel's output holds NaN/Inf")
    res.vs_converted = compare(out, forward.out, routing.ids, routing.ids)
    res.problems += _judge(f"layer {layer} kernel vs the converted bytes", res.vs_converted, KERNEL_THRESHOLDS)
    if forward.reference is not None:
        ref_out, ref_ids, threshold = forward.reference
        res.vs_reference = compare(out, ref_out, routing.ids, ref_ids)
        res.problems += _judge(f"layer {layer} kernel vs the reference", res.vs_reference, _bound(threshold))
    res.status = "FAIL" if res.problems else "ok"
    return res
