"""Block-FP8 output of the per-expert families (``quantize --format fp8-block``): what DeepSeek-V3,
Qwen3-FP8 and GLM-FP8 checkpoints ship, so that vLLM's Fp8 MoE method and transformers' fine-grained
FP8 loader read it as it is.

* Tensors, per expert and projection, under the source names: ``weight`` F8_E4M3 ``[N, K]`` and
  ``weight_scale_inv`` F32 ``[ceil(N/128), ceil(K/128)]`` (``W = fp32(weight) * scale_inv``); gate and
  up keep tile grids of their own (a projection with N not a multiple of 128 has partial edge tiles).
* ``quantization_config``: ``{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
  weight_block_size: [128, 128], modules_to_not_convert: [...]}``. ``modules_to_not_convert`` names
  every other Linear module of the checkpoint exactly (attention, router, shared experts, dense MLPs,
  lm_head), and the fused-MoE module ``...layers.L.mlp.experts`` of every MoE layer ``--include`` /
  ``--ignore`` left in float: vLLM's Fp8Config matches it exactly (it reads ``ignored_layers``, else
  this key; a listed FusedMoE gets the unquantized method) and transformers from the start of the
  name; without it both would build FP8 modules for the bf16 ones.

:class:`BlockFP8Output` is mixed into :class:`~mxconv.families.per_expert.PerExpertReader` before the
compressed-tensors output and handles ``fp8-block`` only (the MX formats go on to it).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Sequence

from mxconv.experts.tensors import TensorSpec
from mxconv.families.base import MoELayer, MoELayerRef
from mxconv.families.quant_config import FLOAT_DTYPES

if TYPE_CHECKING:
    import torch

FP8_BLOCK = "fp8-block"
TILE = 128


def fp8_block_config(not_converted: list[str]) -> dict[str, Any]:
    """The DeepSeek-V3 style ``quantization_config`` of a block-FP8 output."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [TILE, TILE],
        "modules_to_not_convert": not_converted,
    }


class BlockFP8Output:
    """Mixin: block-FP8 expert tensors and config for a per-expert family reader (its ``expert_name``,
    ``_plan``, ``moe_module``, ``proj_names``, ``ckpt``)."""

    def quantized_specs(self, ref: MoELayerRef, fmt: str) -> dict[str, TensorSpec]:
        if fmt != FP8_BLOCK:
            return super().quantized_specs(ref, fmt)  # type: ignore[misc]
        specs: dict[str, TensorSpec] = {}
        for e, proj, n, k in self._plan().expert_projections():
            specs[self.expert_name(ref.module_prefix, e, proj, "weight")] = TensorSpec((n, k), "F8_E4M3")
            specs[self.expert_name(ref.module_prefix, e, proj, "weight_scale_inv")] = TensorSpec((-(-n // TILE), -(-k // TILE)), "F32")
        return specs

    def quantized_tensors(self, layer: MoELayer) -> dict[str, torch.Tensor]:
        """Per-expert ``weight`` / ``weight_scale_inv`` of a block-FP8 layer (``w13_fp8`` parts gate,
        up; ``w2_fp8`` down); MX layers go to the compressed-tensors output."""
        if layer.w13_fp8 is None or layer.w2_fp8 is None:
            return super().quantized_tensors(layer)  # type: ignore[misc]
        out: dict[str, torch.Tensor] = {}
        parts = [*layer.w13_fp8.parts, *layer.w2_fp8.parts]
        if len(parts) != 3:
            raise ValueError(f"{layer.ref.module_prefix}: block-FP8 output needs gate, up and down parts, got {len(parts)}")
        for e in range(parts[0][0].shape[0]):
            for proj, (data, scale_inv) in enumerate(parts):
                # a group of experts (memory budget) names them from the layer's first_expert on
                out[self.expert_name(layer.ref.module_prefix, layer.first_expert + e, proj, "weight")] = data[e].clone()
                out[self.expert_name(layer.ref.module_prefix, layer.first_expert + e, proj, "weight_scale_inv")] = scale_inv[e].clone()
        return out

    def quantization_config(self, fmt: str, scale_rounding: str, skipped: Sequence[MoELayerRef] = ()) -> dict[str, Any]:
        if fmt != FP8_BLOCK:
            return super().quantization_config(fmt, scale_rounding, skipped)  # type: ignore[misc]
        left = []
        for ref in skipped:  # MoE layers --include/--ignore leave in float: their fused-MoE module, exactly
            if self.layer_format(ref) not in FLOAT_DTYPES.values():
                raise ValueError(f"{ref.module_prefix}.experts: a block-FP8 output lists only float MoE layers as not converted")
            left.append(f"{ref.module_prefix}.experts")
        return fp8_block_config(sorted(set(self.fp8_not_converted()) | set(left)))

    def fp8_not_converted(self) -> list[str]:
        """Every Linear module (a 2-D ``.weight``) that is not a routed expert, by its exact name."""
        projs = "|".join(map(re.escape, self.proj_names))
        expert = re.compile(rf".*{re.escape(self.moe_module)}\.experts\.\d+\.({projs})$")
        modules = {n[: -len(".weight")] for n, info in self.ckpt.tensors.items() if n.endswith(".weight") and len(info.shape) == 2}
        return sorted(m for m in modules if not expert.match(m))
