"""W4A8 on MI355 (vLLM ``AITER_MXFP4_FP8``): the triton layout's ``--activation fp8`` with ``arch=gfx950``.

vLLM 0.33 (``fused_moe/oracle/mxfp4.py``, ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``, the
``AITER_MXFP4_FP8`` branch) runs the gfx950 ``_swizzle_mxfp4`` on the weights (the bytes of
``arch=gfx950``), casts the biases to float32, and reduces each static FP8 input scale
(``w13_input_scale``, ``w2_input_scale``: float32 ``[E]``, one per expert, loaded from a Quark
checkpoint) to ``.max().to(float32)``, warning once when the experts' values differ; the kernel's
``InFlexData(scale=...)`` takes that 0-dim scalar (the layer parameter itself keeps its ``[E]``
values, which the kernel does not read). mxconv stores the scalars the kernel takes: 0-dim float32
``w13_input_scale`` and ``w2_input_scale`` per layer (the same on every TP rank), and the manifest
records the reduction. Spec: docs/layout-triton.md §10.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts, InputScales
from mxconv.experts.tensors import TensorSpec

if TYPE_CHECKING:
    import torch

    from mxconv.layouts.triton_arch import ArchSpec

W4A8_ACTIVATION = "fp8"
INPUT_SCALE_NAMES = ("w13_input_scale", "w2_input_scale")
INPUT_SCALE_DTYPE = "F32"
REDUCTION = "max over the layer's experts, float32 (vLLM 0.33 AITER_MXFP4_FP8: InFlexData scale)"


def check_w4a8(activation: str, spec: ArchSpec) -> None:
    """LayoutError when ``--activation fp8`` is asked for on a GPU whose :class:`ArchSpec` has no W4A8
    (vLLM runs it on gfx950, MI355, only)."""
    if activation == W4A8_ACTIVATION and not spec.w4a8:
        raise LayoutError(
            f"triton: RepackOptions.activation fp8 (vLLM AITER_MXFP4_FP8, W4A8) runs on gfx950 only; got arch {spec.arch} "
            f"(set RepackOptions.layout_options arch=gfx950)"
        )


def input_scale_specs(activation: str) -> dict[str, TensorSpec]:
    """The two 0-dim float32 input-scale tensors of a W4A8 output; none for other activations."""
    if activation != W4A8_ACTIVATION:
        return {}
    return {name: TensorSpec((), INPUT_SCALE_DTYPE) for name in INPUT_SCALE_NAMES}


def input_scale_tensors(c: CanonicalExperts, activation: str) -> dict[str, torch.Tensor]:
    """``{w13_input_scale, w2_input_scale}``: ``c.input_scales`` reduced as vLLM does (on ``c``'s device)."""
    if activation != W4A8_ACTIVATION:
        return {}
    if c.input_scales is None:
        raise LayoutError("triton: RepackOptions.activation fp8 needs the source's static FP8 input scales "
                          "(w13_input_scale / w2_input_scale); this layer has none")  # fmt: skip
    w13, w2 = c.input_scales.reduced()
    return {"w13_input_scale": w13.to(c.device), "w2_input_scale": w2.to(c.device)}


def stored_input_scales(k: dict[str, torch.Tensor], experts: int, activation: str) -> InputScales | None:
    """The stored scalars as :class:`InputScales` (each expert given the layer's value, so laying them
    out again gives the same bytes); None for other activations."""
    if activation != W4A8_ACTIVATION:
        return None
    w13, w2 = (k[name].reshape(1).expand(experts).clone() for name in INPUT_SCALE_NAMES)
    return InputScales(w13, w2, INPUT_SCALE_NAMES)


def describe_w4a8(activation: str) -> dict[str, Any]:
    """Manifest ``layout`` fields of a W4A8 output (empty for other activations)."""
    if activation != W4A8_ACTIVATION:
        return {}
    return {"vllm_moe_backend": "AITER_MXFP4_FP8",
            "input_scales": {"tensors": list(INPUT_SCALE_NAMES), "dtype": "float32", "shape": [],
                             "reduction": REDUCTION, "activation_dtype": "float8_e4m3fn (static per tensor)"}}  # fmt: skip
