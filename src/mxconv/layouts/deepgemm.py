"""DeepGEMM MXFP4 MoE layout: the expert tensors vLLM 0.33's ``DEEPGEMM_MXFP4`` backend holds after
loading (spec: docs/layout-deepgemm.md; FP8 activations x MXFP4 weights on SM100/SM120).

Per layer and TP rank (E experts, H hidden, I intermediate), Hp = roundup(H, 128), Ip = roundup(I, 128):

| name             | shape             | dtype | content |
|------------------|-------------------|-------|---------|
| w13_weight       | [E, 2Ip, Hp/2]    | uint8 | canonical bytes, zero-padded (halves: each half on its own) |
| w13_weight_scale | [E, Hp/128, 2Ip]  | int32 | packed UE8M0, MN-major: word [e, j, n] = scale bytes (n, 4j..4j+3), low byte first |
| w2_weight        | [E, Hp, Ip/2]     | uint8 | canonical bytes, zero-padded |
| w2_weight_scale  | [E, Ip/128, Hp]   | int32 | as w13 |
| w13_bias         | [E, 2Ip]          | bfloat16 | only with biases; passed through by vLLM (its kernel never reads them) |
| w2_bias          | [E, Hp]           | bfloat16 | |

The scale tensors are the storage of the engine's tensor: vLLM holds ``stored.transpose(1, 2)``
(shape [E, N, K/128], strides (N*K/128, 1, N)), which is what DeepGEMM's
``get_mn_major_tma_aligned_packed_ue8m0_tensor`` returns. The E8M0 -> fp32 -> UE8M0 round trip on
the way (``_upcast_e8m0_to_fp32``, then the pack's ``bits >> 23``) gives back every byte, 0 and
0xFF included. Weights keep the row order they come in (vLLM's DeepGEMM path does not reorder).
All padding is zero (vLLM allocates the parameters with ``torch.zeros``).

MXFP8 experts (vLLM ``Fp8MoeBackend.DEEPGEMM``, SM100): :mod:`mxconv.layouts.deepgemm_mxfp8`.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.environment import KernelLocations
from mxconv.errors import LayoutError
from mxconv.layouts import deepgemm_mxfp8
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
from mxconv.layouts.padding import KernelChoice, pad_canonical, unpad_canonical
from mxconv.source.st_format import torch_dtype
from mxconv.source.manifest import Manifest

if TYPE_CHECKING:
    import torch

BACKEND_NAME = "deepgemm"
LAYOUT_VERSION = 1
MX_BLOCK = 32
ALIGN = 128  # mxfp4_round_up_hidden_size_and_intermediate_size: DEEPGEMM_MXFP4 -> H and I to 128
PACK = 4  # UE8M0 scales per int32 word
PAD_FILL = 0
SCALE_DTYPE = "I32"  # safetensors names; mxconv.source.st_format.torch_dtype gives the torch ones
BIAS_DTYPE = "BF16"
ACTIVATIONS = ("fp8",)  # DeepGemmFP4Experts: FP8 activations, dynamic per token and 128-wide group
VLLM_BACKEND = "DEEPGEMM_MXFP4"


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes [E, N, C] uint8 (C % 4 == 0) -> packed words [E, C/4, N] int32, MN-major.

    Word [e, j, n] holds scales[e, n, 4j + q] in byte q (q = 0 least significant), i.e. its
    little-endian bytes are scales[e, n, 4j : 4j + 4].
    """
    import torch

    E, N, C = scales.shape
    if scales.dtype != torch.uint8:
        raise LayoutError(f"deepgemm: scales must be uint8 E8M0 bytes, got {scales.dtype}")
    if C % PACK:
        raise LayoutError(f"deepgemm: {C} scale columns do not pack into int32 words of {PACK}")
    words = scales.reshape(E, N, C // PACK, PACK).permute(0, 2, 1, 3).contiguous()
    return words.view(torch_dtype(SCALE_DTYPE)).reshape(E, C // PACK, N)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: [E, C/4, N] int32 -> [E, N, C] uint8."""
    import torch

    E, J, N = packed.shape
    if packed.dtype != torch_dtype(SCALE_DTYPE):
        raise LayoutError(f"deepgemm: packed scales must be int32, got {packed.dtype}")
    raw = packed.contiguous().view(torch.uint8).reshape(E, J, N, PACK)
    return raw.permute(0, 2, 1, 3).reshape(E, N, J * PACK).contiguous()


class DeepgemmLayout(LayoutBase):
    """vLLM 0.33 ``DEEPGEMM_MXFP4`` expert tensors (module docstring; docs/layout-deepgemm.md)."""

    name = BACKEND_NAME
    version = LAYOUT_VERSION
    activations: tuple[str, ...] = ACTIVATIONS
    vllm_backends = {"fp8": (VLLM_BACKEND,)}
    vllm_mxfp8_backends = {deepgemm_mxfp8.ACTIVATION: (deepgemm_mxfp8.VLLM_BACKEND,)}  # Fp8MoeBackend (deepgemm_mxfp8)
    weight_formats = ("mxfp4", deepgemm_mxfp8.WEIGHT_FORMAT)

    def kernel_unavailable(self, manifest: Manifest, kernel_locations: KernelLocations | None = None) -> str | None:
        """DeepGEMM's grouped FP8 x FP4 GEMM needs an SM100/SM120 GPU; mxconv does not drive it."""
        import torch

        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (10, 12):
            return "DeepGEMM's m_grouped_fp8_fp4_gemm_nt_contiguous needs an SM100 or SM120 (Blackwell) GPU"
        return "running the DeepGEMM MXFP4 kernel is not wired up in this version"

    def padded_sizes(
        self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
        options: EmptyOptions | None = None, *, weight_format: str = "mxfp4",
    ) -> tuple[int, int]:
        """(Hp, Ip) = (roundup(H, 128), roundup(I, 128)) for one rank (MXFP8: (H, I)); LayoutError unless H and I
        are positive multiples of 32 and the row order and activation are known."""
        if weight_format == deepgemm_mxfp8.WEIGHT_FORMAT:
            return deepgemm_mxfp8.padded_sizes(hidden_size, intermediate_size, row_order, activation)
        self.check_activation(activation)
        check_block_sizes(BACKEND_NAME, hidden_size, intermediate_size, row_order, MX_BLOCK)
        return round_up(hidden_size, ALIGN), round_up(intermediate_size, ALIGN)

    def _checked(self, sizes: LayoutSizes, activation: str) -> tuple[int, int]:
        """(Hp, Ip) of ``sizes``; LayoutError if its padded sizes are not this layout's."""
        want = self.padded_sizes(sizes.hidden_size, sizes.intermediate_size, sizes.row_order, activation)
        return check_padded_sizes(BACKEND_NAME, sizes, want, f"both rounded up to {ALIGN}")

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: EmptyOptions) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the stored tensors (table in the module docstring)."""
        if sizes.weight_format == deepgemm_mxfp8.WEIGHT_FORMAT:
            return deepgemm_mxfp8.kernel_specs(sizes, activation)
        Hp, Ip = self._checked(sizes, activation)
        E = sizes.num_experts
        return in_kernel_order({
            "w13_weight": TensorSpec((E, 2 * Ip, Hp // 2), "U8"),
            "w13_weight_scale": TensorSpec((E, Hp // (MX_BLOCK * PACK), 2 * Ip), SCALE_DTYPE),
            "w2_weight": TensorSpec((E, Hp, Ip // 2), "U8"),
            "w2_weight_scale": TensorSpec((E, Ip // (MX_BLOCK * PACK), Hp), SCALE_DTYPE),
            **bias_specs(sizes, Hp, Ip, BIAS_DTYPE),
        })

    def to_kernel(self, c: CanonicalExperts, activation: str, options: EmptyOptions,
                  kernel_choice: KernelChoice = KernelChoice.AUTO) -> KernelTensors:  # fmt: skip
        """Canonical stack -> stored kernel tensors on ``c``'s device: zero padding to (Hp, Ip),
        weights as they are, scales packed by :func:`pack_ue8m0`, biases as bfloat16 (torch ops only:
        ``kernel_choice`` has nothing to pick here)."""
        if c.weight_format == deepgemm_mxfp8.WEIGHT_FORMAT:
            return deepgemm_mxfp8.to_kernel(c, activation)
        c.validate()
        Hp, Ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation)
        p = pad_canonical(c, Hp, Ip, scale_fill=PAD_FILL)
        out: KernelTensors = {"w13_weight": p.w13.contiguous(), "w13_weight_scale": pack_ue8m0(p.w13_scale)}
        if p.w13_bias is not None:
            out["w13_bias"] = p.w13_bias.to(torch_dtype(BIAS_DTYPE)).contiguous()
        out.update({"w2_weight": p.w2.contiguous(), "w2_weight_scale": pack_ue8m0(p.w2_scale)})
        if p.w2_bias is not None:
            out["w2_bias"] = p.w2_bias.to(torch_dtype(BIAS_DTYPE)).contiguous()
        return out

    def from_kernel(
        self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: EmptyOptions
    ) -> CanonicalExperts:
        """Stored tensors -> canonical (unpadded) stack; biases come back as bfloat16.

        LayoutError for a missing/unexpected tensor, a wrong shape or dtype, tensors on different
        devices, or padding that is not zero (tensor and first index named, in the unpacked
        [E, rows, K/2 or K/32] view).
        """
        if sizes.weight_format == deepgemm_mxfp8.WEIGHT_FORMAT:
            return deepgemm_mxfp8.from_kernel(k, sizes, activation)
        specs = self.kernel_specs(sizes, activation, options)
        check_kernel_tensors(BACKEND_NAME, k, specs)
        padded = CanonicalExperts(
            w13=k["w13_weight"],
            w13_scale=unpack_ue8m0(k["w13_weight_scale"]),
            w2=k["w2_weight"],
            w2_scale=unpack_ue8m0(k["w2_weight_scale"]),
            w13_bias=k.get("w13_bias"),
            w2_bias=k.get("w2_bias"),
            row_order=sizes.row_order,
        )
        return unpad_canonical(padded, sizes.hidden_size, sizes.intermediate_size, scale_fill=PAD_FILL, check=True)

    def describe(self, sizes: LayoutSizes, activation: str, options: EmptyOptions) -> dict[str, Any]:
        """Manifest ``layout`` fields owned by this backend (kernel_params are added by the caller)."""
        if sizes.weight_format == deepgemm_mxfp8.WEIGHT_FORMAT:
            return deepgemm_mxfp8.describe(sizes, activation)
        self._checked(sizes, activation)
        return {
            "name": self.name,
            "version": self.version,
            "engine_compat": {"vllm": ">=0.33", "deep_gemm": "vendored by vLLM 0.33", "gpu": "SM100 or SM120"},
            "activation": activation,
            "vllm_moe_backend": VLLM_BACKEND,
            "padding": {"hidden_align": ALIGN, "intermediate_align": ALIGN, "fill": PAD_FILL},
            "w13_kernel_row_order": sizes.row_order,
            "scale_format": "ue8m0 packed 4 per int32 (low byte = lowest K block), MN-major",
            "scale_storage": "[E, K/128, N] int32; the engine tensor is stored.transpose(1, 2) = [E, N, K/128]",
            "bias_dtype": "bfloat16",
            "runtime_env": {"VLLM_USE_DEEP_GEMM_E8M0": "1"},
        }


LAYOUT = DeepgemmLayout()
