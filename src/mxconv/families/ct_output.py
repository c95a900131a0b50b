"""compressed-tensors output of per-expert families (``mxconv quantize``; see per_expert's docstring).

:class:`CompressedTensorsOutput` is mixed into :class:`~mxconv.families.per_expert.PerExpertReader`:
it writes an MX canonical layer as per-expert Linear tensors under the source names
(``weight_packed`` + ``weight_scale`` for mxfp4, ``weight`` F8_E4M3 + ``weight_scale`` for mxfp8) and
builds the ``quantization_config`` (one config group, an ``ignore`` list covering every other Linear).
It relies on the reader's ``expert_name``, ``layer_prefix``, ``layer_format``, ``_plan`` and the
class attributes ``moe_module``, ``proj_names``, ``ignore_patterns``.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Sequence

from mxconv.experts.tensors import TensorSpec
from mxconv.families.base import MoELayer, MoELayerRef
from mxconv.families.quant_config import CT_FORMATS, MX_FORMATS, UNCONVERTED_KEY, ct_matches, quantization_dict

if TYPE_CHECKING:
    import torch


class CompressedTensorsOutput:
    """Mixin: compressed-tensors MX tensors and config for a per-expert family reader."""

    def quantized_specs(self, ref: MoELayerRef, fmt: str) -> dict[str, TensorSpec]:
        if fmt not in MX_FORMATS:
            raise ValueError(f"unknown MX format {fmt!r} (expected one of {MX_FORMATS})")
        specs: dict[str, TensorSpec] = {}
        for e, proj, n, k in self._plan().expert_projections():
            if fmt == "mxfp4":
                specs[self.expert_name(ref.module_prefix, e, proj, "weight_packed")] = TensorSpec((n, k // 2), "U8")
            else:
                specs[self.expert_name(ref.module_prefix, e, proj, "weight")] = TensorSpec((n, k), "F8_E4M3")
            specs[self.expert_name(ref.module_prefix, e, proj, "weight_scale")] = TensorSpec((n, k // 32), "U8")
        return specs

    def quantized_tensors(self, layer: MoELayer) -> dict[str, torch.Tensor]:
        """Split an MX canonical layer into per-expert compressed-tensors Linear tensors.

        Needs ``w13_mx``/``w2_mx`` (same format) in "halves" order. Each output tensor is a fresh
        contiguous copy (safetensors refuses tensors that share storage).
        """
        import torch

        if layer.w13_mx is None or layer.w2_mx is None:
            raise ValueError("quantized_tensors needs an MX-quantized layer (w13_mx and w2_mx)")
        if layer.row_order != "halves":
            raise ValueError(f"{self.name} writes gate/up halves, got row order {layer.row_order!r}")
        fmt = layer.w13_mx.fmt
        if fmt not in MX_FORMATS or layer.w2_mx.fmt != fmt:
            raise ValueError(f"inconsistent MX formats {layer.w13_mx.fmt!r} / {layer.w2_mx.fmt!r}")
        prefix = layer.ref.module_prefix
        E, two_i = layer.w13_mx.data.shape[:2]
        I = two_i // 2
        out: dict[str, torch.Tensor] = {}
        data_param = "weight_packed" if fmt == "mxfp4" else "weight"
        for e in range(E):
            pieces = (
                (0, layer.w13_mx, slice(0, I)),
                (1, layer.w13_mx, slice(I, 2 * I)),
                (2, layer.w2_mx, slice(None)),
            )
            for proj, stack, rows in pieces:
                data = stack.data[e, rows].clone()
                if fmt == "mxfp8":
                    data = data.view(torch.float8_e4m3fn)
                # a group of experts (memory budget) names them from the layer's first_expert on
                out[self.expert_name(prefix, layer.first_expert + e, proj, data_param)] = data
                out[self.expert_name(prefix, layer.first_expert + e, proj, "weight_scale")] = stack.scales[e, rows].clone()
        return out

    def ct_targets(self) -> list[str]:
        """compressed-tensors targets: the per-expert Linear names and vLLM's fused-MoE module."""
        moe = re.escape(self.moe_module)
        projs = "|".join(map(re.escape, self.proj_names))
        return [rf"re:.*{moe}\.experts\.\d+\.({projs})$", rf"re:.*{moe}\.experts$"]

    def ct_ignore(self) -> list[str]:
        """Compact ignore list: the family regexes that match some non-expert Linear of this
        checkpoint, plus the name of any other 2-D ``.weight`` module none of them covers."""
        targets = [re.compile(t[3:]) for t in self.ct_targets()]
        modules = sorted(
            {
                n[: -len(".weight")]
                for n, info in self.ckpt.tensors.items()
                if n.endswith(".weight") and len(info.shape) == 2
            }
        )
        others = [m for m in modules if not any(t.match(m) for t in targets)]
        used = [p for p in self.ignore_patterns if p == "lm_head" or any(ct_matches(m, [p]) for m in others)]
        extra = [m for m in others if not ct_matches(m, used)]
        return used + extra

    def ct_layer_pattern(self, layer: int) -> str:
        """``ignore`` entry for one MoE layer left unconverted: its per-expert Linear modules and its
        fused-MoE module (``...layers.L.{moe}.experts``), under any parent-module prefix."""
        rel = re.escape(self.layer_prefix("", layer))
        projs = "|".join(map(re.escape, self.proj_names))
        return rf"re:(?:.*\.)?{rel}\.experts(?:\.\d+\.(?:{projs}))?$"

    def quantization_config(self, fmt: str, scale_rounding: str, skipped: Sequence[MoELayerRef] = ()) -> dict[str, Any]:
        """compressed-tensors config (see the module docstring); ``skipped`` layers (float or
        block-FP8, left unconverted) are added to ``ignore``, one pattern per layer, and block-FP8
        ones get the source's block-FP8 config under ``mxconv_unconverted_quantization_config``."""
        if fmt not in MX_FORMATS:
            raise ValueError(f"unknown MX format {fmt!r} (expected one of {MX_FORMATS})")
        ignore = self.ct_ignore()
        unconverted: dict[str, Any] | None = None
        for ref in sorted(skipped, key=lambda r: r.layer):
            kind = self.layer_format(ref)
            if kind in MX_FORMATS:
                raise ValueError(
                    f"{ref.module_prefix}.experts: {kind} layers cannot be listed as not converted next to {fmt} ones"
                )
            ignore.append(self.ct_layer_pattern(ref.layer))
            if kind == "fp8_block" and unconverted is None:
                qc = quantization_dict(self.ckpt) or {}
                unconverted = dict(qc if qc.get("quant_method") == "fp8" else qc.get(UNCONVERTED_KEY) or {})
                if unconverted.get("quant_method") != "fp8":
                    raise ValueError(f"{ref.module_prefix}.experts: block-FP8 layer without a block-FP8 config")
        return {
            "quant_method": "compressed-tensors",
            "format": CT_FORMATS[fmt],
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {"targets": self.ct_targets(), **ct_group(fmt)},
            },
            "ignore": ignore,
            "kv_cache_scheme": None,
            "mxconv_scale_rounding": scale_rounding,
            **({UNCONVERTED_KEY: unconverted} if unconverted is not None else {}),
        }


def ct_group(fmt: str) -> dict[str, Any]:
    """A compressed-tensors config group of MX weights (``targets`` left to the caller): the
    MXFP4A16 / MXFP8A16 presets' weight arguments (float, 4/8 bits, group 32, symmetric, uint8 E8M0
    scales), no activation quantization, the format's name."""
    weights = {
        "num_bits": 4 if fmt == "mxfp4" else 8,
        "type": "float",
        "symmetric": True,
        "group_size": 32,
        "strategy": "group",
        "dynamic": False,
        "scale_dtype": "torch.uint8",
    }
    return {"weights": weights, "input_activations": None, "output_activations": None, "format": CT_FORMATS[fmt]}
