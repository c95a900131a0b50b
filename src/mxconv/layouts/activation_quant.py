"""How vLLM quantizes the hidden states it hands a layout's experts: :class:`ActivationQuant`, a layout's
declared fact per activation (and, for a :class:`~mxconv.layouts.forms.FormsLayout`, per weight form).

A layout's ``--activation`` names what its kernel tensors are laid out for; what the engine does to the
hidden states before (or inside) the expert GEMMs mostly follows from that name (:func:`by_activation`:
``bf16`` none, ``mxfp8`` / ``mxfp4`` dynamic MX per 1x32, ``fp8`` dynamic FP8 per token, Marlin's
W4A8-FP8). Where vLLM 0.33 does otherwise, the layout or its form declares it in ``activation_quant``
(activation -> :class:`ActivationQuant`): the MXFP8 method's forms (``Mxfp8MethodForm``: the quant
config is ``kMxfp8Dynamic`` whoever quantizes: aiter inside fused_moe, DeepGemmExperts before, the XPU
kernel from the bf16 hidden states it is handed), triton's W4A8 (``kFp8StaticTensorSym``: the stored
input scales) and deepgemm's MXFP4 form (``kFp8Dynamic128Sym`` with UE8M0 scales). The engine quant
config (:mod:`mxconv.output.engine_quant_config`) reads it through ``Layout.activation_quantization``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

__all__ = ["ActivationQuant", "DYNAMIC_MXFP8", "NONE", "STATIC_FP8_PER_TENSOR", "by_activation", "declared_or_named"]

MX_GROUP = (1, 32)


@dataclass(frozen=True)
class ActivationQuant:
    """How the engine quantizes MoE inputs: ``scheme`` (``mxconv.output.engine_quant_config.ACT_SCHEMES``),
    element ``dtype``, ``group_shape`` ([1, 32] MX, [1, 128] per token group, [1, -1] per token, [-1, -1]
    per tensor) and ``scale_format`` ("e8m0" | "ue8m0" | "float32")."""

    scheme: str
    dtype: str | None = None
    group_shape: tuple[int, int] | None = None
    scale_format: str | None = None


NONE = ActivationQuant("none")
DYNAMIC_MXFP8 = ActivationQuant("dynamic_mxfp8", "float8_e4m3fn", MX_GROUP, "e8m0")
DYNAMIC_MXFP4 = ActivationQuant("dynamic_mxfp4", "float4_e2m1fn", MX_GROUP, "e8m0")
# Marlin W4A8-FP8: QuantFP8(static=False, GroupShape.PER_TOKEN)
DYNAMIC_FP8_PER_TOKEN = ActivationQuant("dynamic_fp8_per_token", "float8_e4m3fn", (1, -1), "float32")
# kFp8StaticTensorSym: one stored float32 scalar per input (the source's static input scales)
STATIC_FP8_PER_TENSOR = ActivationQuant("static_fp8_per_tensor", "float8_e4m3fn", (-1, -1), "float32")
UNKNOWN = ActivationQuant("unknown")

_BY_NAME = {"bf16": NONE, "mxfp8": DYNAMIC_MXFP8, "mxfp4": DYNAMIC_MXFP4, "fp8": DYNAMIC_FP8_PER_TOKEN}


def by_activation(activation: str | None) -> ActivationQuant:
    """What the activation's name says (None, a canonical output: weight-only, nothing quantized)."""
    return NONE if activation is None else _BY_NAME.get(activation, UNKNOWN)


def declared_or_named(declared: Mapping[str, ActivationQuant], activation: str) -> ActivationQuant:
    """``declared[activation]`` (a layout's or form's ``activation_quant``), else :func:`by_activation`."""
    return declared.get(activation) or by_activation(activation)
