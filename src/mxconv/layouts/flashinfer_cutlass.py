"""FlashInfer CUTLASS MXFP4 MoE layout: the expert tensors vLLM 0.33 holds after loading for
``FLASHINFER_CUTLASS_MXFP4_BF16`` (SM90, BF16 activations, W4A16 mixed-input GEMM) and
``FLASHINFER_CUTLASS_MXFP4_MXFP8`` (SM100, MXFP8 activations). Spec: docs/layout-flashinfer-cutlass.md.

The activation picks the variant (each vLLM backend runs on one architecture only:
``FlashInferExperts._supports_quant_scheme``): ``bf16`` = SM90, ``mxfp8`` = SM100.

Per layer and TP rank, Hp = roundup(H, 128), Ip = roundup(I, 128) (vLLM's
``mxfp4_round_up_hidden_size_and_intermediate_size``), every padding byte zero:

1. pad (halves: each half on its own; interleaved: pairs appended), then put w13 in
   [up; gate] ("w31") half order: interleaved rows are de-interleaved first, halves swapped;
2. bf16: weights through :func:`sm90_weight_interleave`, scales through :func:`sm90_scale_fold`;
   mxfp8: weights as they are, each expert's scale matrix 128x4-swizzled in place of its shape;
3. biases as bfloat16, w13 bias in the same [up; gate] order.

| name             | bf16 (SM90)                   | mxfp8 (SM100)              | dtype |
|------------------|-------------------------------|----------------------------|-------|
| w13_weight       | [E, 2Ip, Hp/2] interleaved    | [E, 2Ip, Hp/2]             | uint8 |
| w13_weight_scale | [E, 2Ip/64, Hp/128, 16, 16]   | [E, 2Ip, Hp/32] swizzled   | uint8 |
| w2_weight        | [E, Hp, Ip/2] interleaved     | [E, Hp, Ip/2]              | uint8 |
| w2_weight_scale  | [E, Hp/64, Ip/128, 16, 16]    | [E, Hp, Ip/32] swizzled    | uint8 |
| w13_bias, w2_bias| [E, 2Ip], [E, Hp]             | same                       | bfloat16 |

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.layouts.flashinfer_cutlass_bytemap import (
    SCALE_FOLD_COLS,
    SCALE_FOLD_ROWS,
    sm90_scale_fold,
    sm90_scale_unfold,
    sm90_weight_deinterleave,
    sm90_weight_interleave,
)
from mxconv.layouts.description import ActivationDescription
from mxconv.layouts.padded_stack import PaddedStackLayout, RowMap, StackForm, Transform
from mxconv.layouts.scale_swizzle import swizzle_128x4, unswizzle_128x4
from mxconv.source.manifest import Manifest

if TYPE_CHECKING:
    import torch

    from mxconv.experts.kernel_settings import KernelLocations

BACKEND_NAME = "flashinfer-cutlass"
ALIGN = 128  # FLASHINFER_CUTLASS_MXFP4_*: H and I rounded up to 128
ARCH = {"bf16": "sm90", "mxfp8": "sm100"}
VLLM_BACKENDS = {"bf16": "FLASHINFER_CUTLASS_MXFP4_BF16", "mxfp8": "FLASHINFER_CUTLASS_MXFP4_MXFP8"}


def to_w31(t: torch.Tensor, row_order: str) -> torch.Tensor:
    """A padded w13-like stack [E, 2Ip, ...] in ``row_order`` -> [up rows; gate rows]."""
    import torch

    if row_order == "interleaved":
        gate, up = t[:, 0::2], t[:, 1::2]
    else:
        gate, up = t.chunk(2, dim=1)
    return torch.cat([up, gate], dim=1).contiguous()


def from_w31(t: torch.Tensor, row_order: str) -> torch.Tensor:
    """Inverse of :func:`to_w31`."""
    import torch

    up, gate = t.chunk(2, dim=1)
    if row_order == "interleaved":
        return torch.stack([gate, up], dim=2).reshape(t.shape).contiguous()
    return torch.cat([gate, up], dim=1).contiguous()


def _swizzled(s: torch.Tensor) -> torch.Tensor:
    E, R, C = s.shape
    return swizzle_128x4(s).reshape(E, R, C)


def _unswizzled(s: torch.Tensor) -> torch.Tensor:
    E, R, C = s.shape
    return unswizzle_128x4(s.reshape(E, R * C), R, C)


def _folded_shape(rows: int, cols: int) -> tuple[int, ...]:
    """[R/64, C/4, 16, 16]: the per-expert shape :func:`sm90_scale_fold` stores R x C scales in."""
    return rows // SCALE_FOLD_ROWS, cols // SCALE_FOLD_COLS, 16, 16


W31 = RowMap(to_w31, from_w31, "up_gate_halves")
SM90 = StackForm(
    VLLM_BACKENDS["bf16"], w13_rows=W31,
    weight=Transform.pair(sm90_weight_interleave, sm90_weight_deinterleave),
    scale=Transform.pair(sm90_scale_fold, sm90_scale_unfold, _folded_shape),
    notes={"arch": ARCH["bf16"], "weight_order": "sm90 mixed-gemm fp4 interleave",
           "scale_format": "e8m0 uint8, sm90 folded [E, R/64, C/4, 16, 16]"},
)
SM100 = StackForm(
    VLLM_BACKENDS["mxfp8"], w13_rows=W31, scale=Transform.pair(_swizzled, _unswizzled),
    notes={"arch": ARCH["mxfp8"], "weight_order": "as quantized", "scale_format": "e8m0 uint8, 128x4 swizzled"},
)


class FlashinferCutlassLayout(PaddedStackLayout):
    """vLLM 0.33 ``FLASHINFER_CUTLASS_MXFP4_*`` expert tensors (module docstring)."""

    name = BACKEND_NAME
    version = 1
    hidden_align = intermediate_align = ALIGN
    padding_rule = f"both rounded up to {ALIGN}"
    engine_compat = {"vllm": ">=0.33", "flashinfer": ">=0.7.2"}
    forms = {"bf16": SM90, "mxfp8": SM100}

    def kernel_unavailable(self, manifest: Manifest, device: Any = "cuda",
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        """Why mxconv cannot run FlashInfer's CUTLASS fused MoE on these bytes here."""
        import torch

        activation = ActivationDescription.from_layout(manifest.layout).activation or self.activations[0]
        arch = ARCH.get(activation, "sm90")
        if not torch.cuda.is_available():
            return f"FlashInfer's CUTLASS MXFP4 MoE for activation {activation} needs an {arch.upper()} GPU"
        major, minor = torch.cuda.get_device_capability()
        if (arch == "sm90" and (major, minor) != (9, 0)) or (arch == "sm100" and major < 10):
            return (f"FlashInfer's CUTLASS MXFP4 MoE for activation {activation} needs an {arch.upper()} GPU "
                    f"(this one is sm{major}{minor})")
        return ("FlashInfer's CUTLASS fused MoE is a JIT build from the flashinfer wheel's sources; mxconv does not "
                "build or drive it (scripts/fi_cutlass_kernel_pack.py and scripts/fi_cutlass_kernel_run.sh build it and run "
                "tests/test_flashinfer_cutlass_gpu.py on an output, outside verify)")


LAYOUT = FlashinferCutlassLayout()
