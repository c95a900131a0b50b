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

MXFP8 experts (vLLM ``Fp8MoeBackend.DEEPGEMM``, SM100): :mod:`mxconv.layouts.deepgemm_mxfp8`, the form the
layout declares in ``weight_forms`` beside the padded stack's MXFP4 one.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.errors import LayoutError
from mxconv.layouts import deepgemm_mxfp8
from mxconv.layouts.activation_quant import ActivationQuant
from mxconv.layouts.padded_stack import PaddedStackLayout, StackForm, Transform
from mxconv.source.manifest import Manifest
from mxconv.source.st_format import torch_dtype

if TYPE_CHECKING:
    import torch

    from mxconv.experts.kernel_settings import KernelLocations

BACKEND_NAME = "deepgemm"
ALIGN = 128  # mxfp4_round_up_hidden_size_and_intermediate_size: DEEPGEMM_MXFP4 -> H and I to 128
PACK = 4  # UE8M0 scales per int32 word
SCALE_DTYPE = "I32"  # safetensors names; mxconv.source.st_format.torch_dtype gives the torch ones


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


def packed_shape(rows: int, cols: int) -> tuple[int, int]:
    """[C/4, N]: the per-expert shape :func:`pack_ue8m0` stores N rows of C scale columns in."""
    return cols // PACK, rows


class DeepgemmLayout(PaddedStackLayout):
    """vLLM 0.33 ``DEEPGEMM_MXFP4`` expert tensors (module docstring; docs/layout-deepgemm.md)."""

    name = BACKEND_NAME
    version = 1
    hidden_align = intermediate_align = ALIGN
    padding_rule = f"both rounded up to {ALIGN}"
    engine_compat = {"vllm": ">=0.33", "deep_gemm": "vendored by vLLM 0.33", "gpu": "SM100 or SM120"}
    forms = {  # DeepGemmFP4Experts: FP8 activations, dynamic per token and 128-wide group
        "fp8": StackForm(
            "DEEPGEMM_MXFP4", scale=Transform.pair(pack_ue8m0, unpack_ue8m0, packed_shape, SCALE_DTYPE),
            notes={
                "scale_format": "ue8m0 packed 4 per int32 (low byte = lowest K block), MN-major",
                "scale_storage": "[E, K/128, N] int32; the engine tensor is stored.transpose(1, 2) = [E, N, K/128]",
                "runtime_env": {"VLLM_USE_DEEP_GEMM_E8M0": "1"},
            },
            # kFp8Dynamic128Sym; the activations' UE8M0 scales packed 4 per int32 on SM100/SM120
            activation_quant=ActivationQuant("dynamic_fp8_per_token_group", "float8_e4m3fn", (1, 128), "ue8m0"),
        ),
    }
    weight_forms = {"mxfp8": deepgemm_mxfp8.MXFP8}  # MXFP8 experts (Fp8MoeBackend.DEEPGEMM); MXFP4: the stack above

    def kernel_unavailable(self, manifest: Manifest, device: Any = "cuda",
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        """DeepGEMM's grouped FP8 x FP4 GEMM needs an SM100/SM120 GPU; mxconv does not drive it."""
        import torch

        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (10, 12):
            return "DeepGEMM's m_grouped_fp8_fp4_gemm_nt_contiguous needs an SM100 or SM120 (Blackwell) GPU"
        return "running the DeepGEMM MXFP4 kernel is not wired up in this version"


LAYOUT = DeepgemmLayout()
