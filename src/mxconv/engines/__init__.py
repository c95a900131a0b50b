"""The engines' own MoE kernels, run on the bytes mxconv writes (Hopper, SM90).

* :mod:`mxconv.engines.discover` finds triton_kernels, vLLM's compiled Marlin ops and the GPU;
* :mod:`mxconv.engines.triton_moe` runs triton_kernels' ``matmul_ogs`` on ``--backend triton``
  buffers (wrapped, never re-swizzled);
* :mod:`mxconv.engines.marlin_moe` runs vLLM's ``moe_wna16_marlin_gemm`` on ``--backend marlin``
  tensors as written;
* :mod:`mxconv.engines.loader` reads one layer of an output into those objects.

For ``mxconv verify --kernel``: :func:`kernel_unavailable` says why the kernel cannot run here (or
None), :func:`run_kernel_layer` returns the kernel's output for one layer, summed over TP ranks,
and :data:`KERNEL_THRESHOLDS` is the bound for kernel output vs the fp32 reference on the same
MXFP4 bytes (bf16 activations and outputs). Measured on an H100 (tests/test_engines_gpu.py):
triton 3.9e-3 - 5.1e-3, marlin 5.2e-3 - 5.7e-3 relative RMS; planted layout bugs 0.17 - 0.82.
Nothing here imports torch, triton or vLLM until a function runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mxconv.environment import KernelLocations

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mxconv.families.base import ModelInfo

ENGINE_BACKENDS = ("triton", "marlin")
# Engine kernel (bf16 activations, bf16 GEMM outputs) vs the fp32 reference MoE on the same MXFP4
# weights. bf16 rounding of the input, the intermediate and each GEMM output gives ~2e-3 each.
KERNEL_THRESHOLDS: dict[str, float] = {"rel_rms": 0.02, "cosine": 0.9995, "topk_agreement": 1.0}


def kernel_unavailable(manifest: dict[str, Any], device: Any = "cuda", kernel_locations: KernelLocations | None = None) -> str | None:
    """None when the engine kernel for ``manifest``'s backend can run here, else one line naming
    what is missing (backend without a runner, GPU, kernels, layout variant). The kernels are looked
    for at ``kernel_locations`` first (then the environment, then installed copies)."""
    from mxconv.errors import BadInput

    backend = manifest.get("backend")
    if backend not in ENGINE_BACKENDS:
        return f"no engine kernel runner in mxconv for backend {backend!r} (runners: {', '.join(ENGINE_BACKENDS)})"
    lay = manifest.get("layout") or {}
    where_given = kernel_locations or KernelLocations()
    try:
        from mxconv.engines import discover

        if backend == "triton":
            discover.check_gpu(device, exact=discover.HOPPER, what="triton_kernels' Hopper MX matmul")
            discover.require_triton_generation(discover.find_triton_kernels(where_given.triton_kernels), str(lay.get("triton_layout", "3.5")))
            hp, ip = int(lay.get("padded_hidden_size", 0)), int(lay.get("padded_intermediate_size", 0))
            if hp % 64:
                return (f"hidden size {hp} is not a multiple of 64: triton_kernels' Hopper matmul "
                        "computes wrong results for it; repack with --layout-option pad_hidden=true")  # fmt: skip
            if int(lay.get("num_warps", 8)) == 8 and min(hp, 2 * ip) <= 128:
                return f"output width {min(hp, 2 * ip)} <= 128: triton_kernels' Hopper matmul (num_warps 8) cannot compile for it"
        else:
            discover.check_gpu(device, exact=None, minimum=discover.MARLIN_MIN_CAPABILITY, what="vLLM's Marlin MoE kernel")
            discover.find_marlin_ops(where_given.marlin_ops)
            if lay.get("activation", "bf16") != "bf16":
                return "Marlin with FP8 activations runs on SM89/SM120 only (this output was repacked with --activation fp8)"
            if lay.get("scale_layout", "current") != "current":
                return "legacy Marlin scales (vLLM <= 0.11.2) are not read by vLLM 0.33's kernel"
    except BadInput as exc:
        return str(exc)
    return None


def run_kernel_layer(root: Path, manifest: dict[str, Any], layer: int, hidden: "torch.Tensor", routing: Any,
                     info: "ModelInfo | None" = None, kernel_locations: KernelLocations | None = None) -> "torch.Tensor":  # fmt: skip
    """The engine kernel's MoE output for one layer of the kernel-layout output at ``root``.

    ``hidden`` [T, H] fp32 (any device; run as bf16 on the GPU); ``routing`` has ``ids`` [T, k]
    and ``weights`` [T, k] (e.g. :class:`mxconv.verify.reference_moe.Routing`) or is router logits [T, E];
    ``info`` (default: the manifest's model) gives activation and routing kind. TP outputs: every
    rank is loaded and run in turn and the partial outputs are summed. Returns [T, H] fp32 on
    ``hidden``'s device. BadInput when the kernel cannot run (see :func:`kernel_unavailable`);
    ``kernel_locations``: as there.
    """
    import torch

    from mxconv.engines.loader import load_layer_from_manifest

    tp = int(manifest.get("tp_size") or 1)
    total: torch.Tensor | None = None
    for rank in range(tp):
        eng = load_layer_from_manifest(root, manifest, layer, rank=rank if tp > 1 else None, device="cuda",
                                       kernel_locations=kernel_locations)
        if info is not None:
            eng.info = info
        if isinstance(routing, torch.Tensor):
            y = eng.forward(hidden, logits=routing)
        else:
            y = eng.forward(hidden, routing.ids, routing.weights)
        total = y.float() if total is None else total + y.float()
        del eng
    assert total is not None
    return total.to(hidden.device)
