"""What vLLM's conversion to kernel format returns where that is more than the stored tensors: built
from the stored bytes with mxconv's engine wrappers (named by :mod:`.mappings`' ``build``).

Each builder is called as ``build(mapping, tensors, layer, manifest)`` with the layer's stored tensors
(names of :data:`~.mappings.CONVERTED_ORDER`), vLLM's MoE layer and the output's manifest, and returns
the six objects vLLM's ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format`` (vLLM 0.33) returns for
that backend, with the same side effects on the layer. GPU only: nothing here runs on the CPU build.
"""

from __future__ import annotations

from typing import Any

import torch

from mxconv.errors import BadInput
from mxconv.source.manifest import Manifest

_WEIGHTS = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")


def triton_kernels_objects(mapping: Any, t: dict[str, torch.Tensor], layer: Any, manifest: Manifest) -> tuple[Any, ...]:
    """TRITON: the stored buffers wrapped, not copied, as triton_kernels Tensors and PrecisionConfigs
    (:func:`mxconv.engines.triton_moe.wrap_matrix`, what ``verify --kernel`` runs on an H200), and the
    four weight/scale parameters deleted from the layer as vLLM's conversion deletes them. Hopper
    (sm90) storage only, as mxconv's triton runner."""
    from mxconv.engines import discover
    from mxconv.engines.triton_moe import MatrixGeometry, _arch_refusal, constrain_hopper, wrap_matrix
    from mxconv.layouts.triton_arch import TritonDescription

    d = TritonDescription.from_layout(manifest.layout)  # the triton layout's own describe() keys, typed
    refusal = _arch_refusal(d)
    if refusal is not None:
        raise BadInput(f"mxconv's vLLM plugin: {refusal}")
    tk = discover.find_triton_kernels()
    gen, warps, align = d.hopper_storage()
    # vLLM's padded sizes for this rank: its parameters, before they are deleted
    e, hp, ip = int(layer.w2_weight.shape[0]), int(layer.w2_weight.shape[1]), 2 * int(layer.w2_weight.shape[2])
    w13, pc13 = wrap_matrix(tk, t["w13_weight"], t["w13_weight_scale"], MatrixGeometry(e, 2 * ip, hp, gen, warps, align), "w13")
    w2, pc2 = wrap_matrix(tk, t["w2_weight"], t["w2_weight_scale"], MatrixGeometry(e, hp, ip, gen, warps, align), "w2")
    constrain_hopper(tk)
    for name in _WEIGHTS:
        delattr(layer, name)
    return w13, w2, pc13, pc2, t.get("w13_bias"), t.get("w2_bias")


def aiter_shuffled(mapping: Any, t: dict[str, torch.Tensor], layer: Any, manifest: Manifest) -> tuple[Any, ...]:
    """AITER: the stored (already shuffled) uint8 weights viewed as ``torch.float4_e2m1fn_x2`` and
    flagged ``is_shuffled`` as vLLM's conversion leaves them; scales and float32 biases as stored."""
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is None:
        raise BadInput("mxconv's vLLM plugin: this torch has no float4_e2m1fn_x2, which vLLM's AITER backend holds")
    w13, w2 = t["w13_weight"].view(fp4), t["w2_weight"].view(fp4)
    for w in (w13, w2):
        w.is_shuffled = True  # type: ignore[attr-defined]
    return w13, w2, t["w13_weight_scale"], t["w2_weight_scale"], t.get("w13_bias"), t.get("w2_bias")

