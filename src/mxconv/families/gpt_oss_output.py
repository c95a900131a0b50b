"""The quantized output of the gpt-oss reader (``quantize``): the published gpt-oss MXFP4 tensors and
config (``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``) and mxconv's MXFP8 variant of
them, as a mixin of :class:`mxconv.families.gpt_oss.GptOssReader` (see its module docstring).

The MXFP8 variant has no ``quant_method`` that a loader reads correctly: ``"mxfp8"`` (what mxconv wrote
before) is taken by transformers' fine-grained FP8 loader, which finds none of its tensors and leaves the
experts randomly initialised, and a name transformers does not know only makes it warn and do the same.
So the config says ``"quant_method": null`` and names the format under mxconv's own key
(:data:`FORMAT_KEY`): transformers then refuses to load it ("no `quant_method` attribute"), vLLM and
SGLang stop at start-up, and mxconv reads it (and its older ``"mxfp8"`` outputs).

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from mxconv.errors import BadInput
from mxconv.experts.tensors import TensorSpec
from mxconv.families.base import MoELayer, MoELayerRef
from mxconv.families.quant_config import MX_FORMATS

if TYPE_CHECKING:
    import torch

MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
# Bytes per 32-element block in the blocks tensors.
BLOCK_BYTES = {"mxfp4": 16, "mxfp8": 32}
# Why quantize --format fp8-block refuses gpt-oss (read in vLLM 0.33.0's models/gpt_oss.py): a config with
# quant_method "fp8" goes to GptOssModel._load_weights_other, the BF16 path. It takes every name containing
# ".w13_weight" for the transposed [E, H, 2I] BF16 weight, so "...w13_weight_scale_inv" is narrowed on its
# last axis by 2 * TP rank and transposed like a weight (misread, or a shape error); no branch reads a
# block scale. transformers' GptOss experts are fused [E, H, 2I] parameters with no fine-grained FP8 variant.
FP8_BLOCK_REFUSAL = (
    "gpt-oss: QuantOptions.fmt fp8-block is not written for gpt-oss, because no loader reads a block-FP8 gpt-oss: vLLM "
    "0.33's gpt-oss loader sends quant_method 'fp8' to its BF16 path (_load_weights_other), which treats "
    "'.w13_weight_scale_inv' as a transposed weight; transformers has no fine-grained FP8 gpt-oss experts. "
    "Use QuantOptions.fmt mxfp4 / mxfp8, or repack for an engine backend"
)
# mxconv's key for the MX format of a gpt-oss config whose quant_method is null (MXFP8, see above).
FORMAT_KEY = "mxconv_quant_method"


def method_fields(fmt: str) -> dict[str, Any]:
    """The ``quant_method`` entries of a gpt-oss output config: ``"mxfp4"`` as published, or, for MXFP8,
    ``null`` plus :data:`FORMAT_KEY` (no loader misreads it; see the module docstring)."""
    return {"quant_method": "mxfp4"} if fmt == "mxfp4" else {"quant_method": None, FORMAT_KEY: fmt}


def config_format(qc: dict[str, Any]) -> Any:
    """The MX format a gpt-oss ``quantization_config`` names: its ``quant_method``, or, when that is
    null, :data:`FORMAT_KEY` (older mxconv MXFP8 outputs say ``"quant_method": "mxfp8"``)."""
    method = qc.get("quant_method")
    return qc.get(FORMAT_KEY) if method is None else method


class GptOssOutput:
    """``quantized_specs`` / ``quantized_tensors`` / ``quantization_config`` of
    :class:`~mxconv.families.gpt_oss.GptOssReader` (they use its ``ckpt``, ``_plan`` and ``layer_format``)."""

    def format_refusal(self, fmt: str) -> str | None:
        return FP8_BLOCK_REFUSAL if fmt == "fp8-block" else None

    def quantized_specs(self, ref: MoELayerRef, fmt: str) -> dict[str, TensorSpec]:
        why = self.format_refusal(fmt)
        if why:
            raise BadInput(why)
        if fmt not in MX_FORMATS:
            raise ValueError(f"unknown MX format {fmt!r} (expected one of {MX_FORMATS})")
        plan = self._plan()
        E, H, I = plan["E"], plan["H"], plan["I"]
        p = ref.module_prefix + ".experts"
        data_dtype = "U8" if fmt == "mxfp4" else "F8_E4M3"
        nb = BLOCK_BYTES[fmt]
        specs: dict[str, TensorSpec] = {}
        for proj, n, k in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            specs[f"{p}.{proj}_blocks"] = TensorSpec((E, n, k // 32, nb), data_dtype)
            specs[f"{p}.{proj}_scales"] = TensorSpec((E, n, k // 32), "U8")
            bias = self.ckpt.info(f"{p}.{proj}_bias")
            specs[f"{p}.{proj}_bias"] = TensorSpec(tuple(bias.shape), bias.dtype)
        return specs

    def quantized_tensors(self, layer: MoELayer) -> dict[str, torch.Tensor]:
        """MX canonical layer (interleaved rows, source biases) -> published gpt-oss tensors.

        ``*_blocks``: the packed data viewed as ``[E, N, K/32, 16]`` (mxfp4, uint8) or
        ``[E, N, K/32, 32]`` (mxfp8, float8_e4m3fn); ``*_scales`` unchanged; biases unchanged.
        """
        import torch

        if layer.w13_mx is None or layer.w2_mx is None:
            raise ValueError("quantized_tensors needs an MX-quantized layer (w13_mx and w2_mx)")
        if layer.row_order != "interleaved":
            raise ValueError(f"gpt-oss keeps interleaved gate/up rows, got row order {layer.row_order!r}")
        if layer.w13_bias is None or layer.w2_bias is None:
            raise ValueError("gpt-oss layers carry expert biases; the MoELayer has none")
        p = layer.ref.module_prefix + ".experts"
        out: dict[str, torch.Tensor] = {}
        for proj, stack, bias in (("gate_up_proj", layer.w13_mx, layer.w13_bias), ("down_proj", layer.w2_mx, layer.w2_bias)):
            if stack.fmt not in MX_FORMATS:
                raise ValueError(f"unknown MX format {stack.fmt!r}")
            E, n, kb = stack.data.shape
            nb = BLOCK_BYTES[stack.fmt]
            data = stack.data.contiguous().reshape(E, n, kb // nb, nb)
            if stack.fmt == "mxfp8":
                data = data.view(torch.float8_e4m3fn)
            out[f"{p}.{proj}_blocks"] = data
            out[f"{p}.{proj}_scales"] = stack.scales.contiguous()
            out[f"{p}.{proj}_bias"] = bias.contiguous()
        return out

    def quantization_config(self, fmt: str, scale_rounding: str, skipped: Sequence[MoELayerRef] = ()) -> dict[str, Any]:
        """The published config; each ``skipped`` layer (left BF16) adds ``{module_prefix}.experts``
        to ``modules_to_not_convert`` (transformers then keeps that layer's experts unquantized)."""
        if fmt not in MX_FORMATS:
            raise ValueError(f"unknown MX format {fmt!r} (expected one of {MX_FORMATS})")
        modules = list(MODULES_TO_NOT_CONVERT)
        for ref in sorted(skipped, key=lambda r: r.layer):
            kind = self.layer_format(ref)
            if kind in MX_FORMATS:
                raise ValueError(
                    f"{ref.module_prefix}.experts: {kind} layers cannot be listed as not converted next to {fmt} ones"
                )
            modules.append(f"{ref.module_prefix}.experts")
        return {**method_fields(fmt), "modules_to_not_convert": modules}
