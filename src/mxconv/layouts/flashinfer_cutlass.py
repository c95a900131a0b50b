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

from mxconv.layouts.base import EmptyOptions, LayoutBase
from mxconv.layouts.canonical import (
    CanonicalExperts,
    KernelTensors,
    LayoutSizes,
    TensorSpec,
    bias_specs,
    check_block_sizes,
    check_kernel_tensors,
    check_padded_sizes,
    in_kernel_order,
    round_up,
)
from mxconv.layouts.flashinfer_cutlass_bytemap import (
    sm90_scale_fold,
    sm90_scale_unfold,
    sm90_weight_deinterleave,
    sm90_weight_interleave,
)
from mxconv.layouts.padding import KernelChoice, pad_canonical, unpad_canonical
from mxconv.layouts.trtllm_bytemap import swizzle_128x4, unswizzle_128x4
from mxconv.source.st_format import torch_dtype
from mxconv.source.manifest import Manifest

if TYPE_CHECKING:
    import torch

BACKEND_NAME = "flashinfer-cutlass"
LAYOUT_VERSION = 1
MX_BLOCK = 32
ALIGN = 128  # FLASHINFER_CUTLASS_MXFP4_*: H and I rounded up to 128
PAD_FILL = 0
BIAS_DTYPE = "BF16"
ACTIVATIONS = ("bf16", "mxfp8")
ARCH = {"bf16": "sm90", "mxfp8": "sm100"}
VLLM_BACKENDS = {"bf16": "FLASHINFER_CUTLASS_MXFP4_BF16", "mxfp8": "FLASHINFER_CUTLASS_MXFP4_MXFP8"}
ENGINE_COMPAT = {"vllm": ">=0.33", "flashinfer": ">=0.7.2"}


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


class FlashinferCutlassLayout(LayoutBase):
    """vLLM 0.33 ``FLASHINFER_CUTLASS_MXFP4_*`` expert tensors (module docstring)."""

    name = BACKEND_NAME
    version = LAYOUT_VERSION
    activations: tuple[str, ...] = ACTIVATIONS
    vllm_backends = {act: (name,) for act, name in VLLM_BACKENDS.items()}

    def kernel_unavailable(self, manifest: Manifest) -> str | None:
        """Why mxconv cannot run FlashInfer's CUTLASS fused MoE on these bytes here."""
        import torch

        activation = str(manifest.layout.extra.get("activation", ACTIVATIONS[0]))
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

    def padded_sizes(
        self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
        options: EmptyOptions | None = None,
    ) -> tuple[int, int]:
        """(Hp, Ip) = (roundup(H, 128), roundup(I, 128)); LayoutError unless H and I are positive
        multiples of 32 and the row order and activation are known."""
        self.check_activation(activation)
        check_block_sizes(BACKEND_NAME, hidden_size, intermediate_size, row_order, MX_BLOCK)
        return round_up(hidden_size, ALIGN), round_up(intermediate_size, ALIGN)

    def _checked(self, sizes: LayoutSizes, activation: str) -> tuple[int, int]:
        want = self.padded_sizes(sizes.hidden_size, sizes.intermediate_size, sizes.row_order, activation)
        return check_padded_sizes(BACKEND_NAME, sizes, want, f"both rounded up to {ALIGN}")

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: EmptyOptions) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the stored tensors (table in the module docstring)."""
        Hp, Ip = self._checked(sizes, activation)
        E = sizes.num_experts
        if activation == "bf16":
            s13 = (E, 2 * Ip // 64, Hp // 128, 16, 16)
            s2 = (E, Hp // 64, Ip // 128, 16, 16)
        else:
            s13, s2 = (E, 2 * Ip, Hp // MX_BLOCK), (E, Hp, Ip // MX_BLOCK)
        return in_kernel_order({
            "w13_weight": TensorSpec((E, 2 * Ip, Hp // 2), "U8"),
            "w13_weight_scale": TensorSpec(s13, "U8"),
            "w2_weight": TensorSpec((E, Hp, Ip // 2), "U8"),
            "w2_weight_scale": TensorSpec(s2, "U8"),
            **bias_specs(sizes, Hp, Ip, BIAS_DTYPE),
        })

    def to_kernel(self, c: CanonicalExperts, activation: str, options: EmptyOptions,
                  kernel_choice: KernelChoice = KernelChoice.AUTO) -> KernelTensors:  # fmt: skip
        """Canonical stack -> stored kernel tensors on ``c``'s device (torch ops only: ``kernel_choice``
        has nothing to pick here)."""
        c.validate()
        Hp, Ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation)
        p = pad_canonical(c, Hp, Ip, scale_fill=PAD_FILL)
        w13, s13 = to_w31(p.w13, p.row_order), to_w31(p.w13_scale, p.row_order)
        if activation == "bf16":
            out: KernelTensors = {
                "w13_weight": sm90_weight_interleave(w13), "w13_weight_scale": sm90_scale_fold(s13),
                "w2_weight": sm90_weight_interleave(p.w2), "w2_weight_scale": sm90_scale_fold(p.w2_scale),
            }
        else:
            out = {"w13_weight": w13, "w13_weight_scale": _swizzled(s13),
                   "w2_weight": p.w2.contiguous(), "w2_weight_scale": _swizzled(p.w2_scale)}
        if p.w13_bias is not None:
            out["w13_bias"] = to_w31(p.w13_bias.to(torch_dtype(BIAS_DTYPE)), p.row_order)
        if p.w2_bias is not None:
            out["w2_bias"] = p.w2_bias.to(torch_dtype(BIAS_DTYPE)).contiguous()
        return in_kernel_order(out)

    def from_kernel(
        self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: EmptyOptions
    ) -> CanonicalExperts:
        """Stored tensors -> canonical (unpadded) stack; biases come back as bfloat16. LayoutError for
        a missing/unexpected tensor, a wrong shape or dtype, mixed devices, or non-zero padding."""
        check_kernel_tensors(BACKEND_NAME, k, self.kernel_specs(sizes, activation, options))
        if activation == "bf16":
            w13, s13 = sm90_weight_deinterleave(k["w13_weight"]), sm90_scale_unfold(k["w13_weight_scale"])
            w2, s2 = sm90_weight_deinterleave(k["w2_weight"]), sm90_scale_unfold(k["w2_weight_scale"])
        else:
            w13, s13 = k["w13_weight"], _unswizzled(k["w13_weight_scale"])
            w2, s2 = k["w2_weight"], _unswizzled(k["w2_weight_scale"])
        order = sizes.row_order
        padded = CanonicalExperts(
            w13=from_w31(w13, order), w13_scale=from_w31(s13, order), w2=w2, w2_scale=s2,
            w13_bias=from_w31(k["w13_bias"], order) if sizes.has_bias else None,
            w2_bias=k["w2_bias"] if sizes.has_bias else None, row_order=order,
        )
        return unpad_canonical(padded, sizes.hidden_size, sizes.intermediate_size, scale_fill=PAD_FILL, check=True)

    def describe(self, sizes: LayoutSizes, activation: str, options: EmptyOptions) -> dict[str, Any]:
        """Manifest ``layout`` fields owned by this backend (kernel_params are added by the caller)."""
        self._checked(sizes, activation)
        sm90 = activation == "bf16"
        return {
            "name": self.name,
            "version": self.version,
            "engine_compat": dict(ENGINE_COMPAT),
            "activation": activation,
            "arch": ARCH[activation],
            "vllm_moe_backend": VLLM_BACKENDS[activation],
            "padding": {"hidden_align": ALIGN, "intermediate_align": ALIGN, "fill": PAD_FILL},
            "w13_kernel_row_order": "up_gate_halves",
            "weight_order": "sm90 mixed-gemm fp4 interleave" if sm90 else "as quantized",
            "scale_format": "e8m0 uint8, sm90 folded [E, R/64, C/4, 16, 16]" if sm90 else "e8m0 uint8, 128x4 swizzled",
            "bias_dtype": "bfloat16",
        }


LAYOUT = FlashinferCutlassLayout()
