"""CPU AMX MXFP4 MoE layout: the expert tensors vLLM 0.33's ``CPU`` backend (``CPUExpertsMxfp4``,
x86 with AMX) holds after loading (spec: docs/layout-cpu.md).

vLLM's ``prepare_mxfp4_moe_layer_for_cpu`` passes the padded checkpoint tensors through its CPU ops
``convert_weight_packed`` (VNNI prepack, sgl-kernels ``pack_vnni<uint8_t>``) and
``convert_scale_packed``; both keep the shape and dtype and only move bytes (weights: nibbles too).
Per layer and TP rank (E experts, H hidden, I intermediate), Hp = roundup(H, 32), Ip = roundup(I, 32):

| name             | shape           | dtype   | content |
|------------------|-----------------|---------|---------|
| w13_weight       | [E, 2Ip, Hp/2]  | uint8   | VNNI-packed: per 32-row block, [Hp/2, 32] bytes (see :func:`pack_weight`) |
| w13_weight_scale | [E, 2Ip, Hp/32] | uint8   | E8M0 bytes, per 32-row block [Hp/32, 32] (see :func:`pack_scale`) |
| w2_weight        | [E, Hp, Ip/2]   | uint8   | as w13 |
| w2_weight_scale  | [E, Hp, Ip/32]  | uint8   | as w13 |
| w13_bias         | [E, 2Ip]        | float32 | only with biases (vLLM casts them to float32) |
| w2_bias          | [E, Hp]         | float32 | |

Rows keep the order they are loaded in (vLLM's CPU branch does not reorder): gpt-oss interleaved
(its SWIGLUOAI kernel step reads gate/up pairs), halves for SiLU/GELU checkpoints (first half gate).
All padding is zero (vLLM allocates the parameters with ``torch.zeros``).

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.errors import LayoutError
from mxconv.layouts.padded_stack import PaddedStackLayout, StackForm, Transform
from mxconv.source.manifest import Manifest

if TYPE_CHECKING:
    import torch

    from mxconv.experts.kernel_settings import KernelLocations

BACKEND_NAME = "cpu"
BLOCK_N = 32  # sgl-kernels gemm.h block_size_n() = 2 * TILE_N: rows packed together
ALIGN = 32  # mxfp4_round_up_hidden_size_and_intermediate_size: CPU -> H and I to 32 ("BLOCK_N=32")


def _blocks(t: torch.Tensor, what: str) -> tuple[int, int, int]:
    """(E, rows / BLOCK_N, columns) of a uint8 [E, rows, columns] tensor; LayoutError otherwise."""
    import torch

    if t.dim() != 3 or t.dtype != torch.uint8:
        raise LayoutError(f"cpu: {what} must be a uint8 [E, rows, columns] tensor, got {tuple(t.shape)} {t.dtype}")
    E, N, C = t.shape
    if N % BLOCK_N:
        raise LayoutError(f"cpu: {what} has {N} rows, not a multiple of the {BLOCK_N}-row pack block")
    return E, N // BLOCK_N, C


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """Canonical E2M1 bytes [E, N, C] (C = K/2, low nibble = even k) -> convert_weight_packed's bytes.

    Per expert and block of 32 rows (nb), byte column c: the 64 nibbles of the block's rows at
    elements (2c, 2c+1), in order (row 0: 2c, 2c+1; row 1: ...), fill 32 bytes at storage offset
    ``nb*32*C + c*32``: byte j holds nibble j low and nibble j+32 high.
    """
    import torch

    E, NB, C = _blocks(w, "weight")
    nib = torch.stack((w & 0xF, w >> 4), dim=-1).view(E, NB, BLOCK_N, C, 2)
    seq = nib.permute(0, 1, 3, 2, 4).reshape(E, NB, C, 2 * BLOCK_N)
    return (seq[..., :BLOCK_N] | (seq[..., BLOCK_N:] << 4)).reshape(E, NB * BLOCK_N, C).contiguous()


def unpack_weight(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_weight`: packed [E, N, C] uint8 -> canonical [E, N, C] uint8."""
    import torch

    E, NB, C = _blocks(p, "packed weight")
    q = p.reshape(E, NB, C, BLOCK_N)
    seq = torch.cat((q & 0xF, q >> 4), dim=-1).view(E, NB, C, BLOCK_N, 2)
    nib = seq.permute(0, 1, 3, 2, 4)
    return (nib[..., 0] | (nib[..., 1] << 4)).reshape(E, NB * BLOCK_N, C).contiguous()


def pack_scale(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes [E, N, G] -> convert_scale_packed's [E, N, G] storage: per 32-row block, [G, 32]."""
    E, NB, G = _blocks(s, "scale")
    return s.reshape(E, NB, BLOCK_N, G).transpose(2, 3).reshape(E, NB * BLOCK_N, G).contiguous()


def unpack_scale(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_scale`."""
    E, NB, G = _blocks(p, "packed scale")
    return p.reshape(E, NB, G, BLOCK_N).transpose(2, 3).reshape(E, NB * BLOCK_N, G).contiguous()


class CpuLayout(PaddedStackLayout):
    """vLLM 0.33 ``CPU`` MXFP4 expert tensors (module docstring; docs/layout-cpu.md)."""

    name = BACKEND_NAME
    version = 1
    hidden_align = intermediate_align = ALIGN
    padding_rule = f"both rounded up to {ALIGN}"
    bias_dtype = "F32"  # the CPU branch of convert_*_to_mxfp4_moe_kernel_format: bias.to(torch.float32)
    engine_compat = {"vllm": ">=0.32", "cpu": "x86-64 with AMX, vLLM CPU build"}
    forms = {  # CPUExpertsMxfp4: W4A16, (kMxfp4Static, None)
        "bf16": StackForm(
            "CPU", weight=Transform.pair(pack_weight, unpack_weight), scale=Transform.pair(pack_scale, unpack_scale),
            notes={
                "weight_packing": "convert_weight_packed (uint8): per 32-row block [K/2, 32] bytes, "
                                  "byte j = nibble j | nibble j+32 << 4 of the block's row-major (row, k) pairs",
                "scale_packing": "convert_scale_packed: per 32-row block [K/32, 32] E8M0 bytes",
            },
        ),
    }

    def kernel_unavailable(self, manifest: Manifest, device: Any = "cuda",
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        """vLLM's fused_experts_cpu needs AMX and a vLLM CPU build; mxconv has no runner for it."""
        return ("vLLM's CPU MXFP4 MoE kernel (CPUExpertsMxfp4: torch.ops._C.fused_experts_cpu) needs an x86 CPU "
                "with AMX and a vLLM CPU build, and mxconv has no runner for it yet; `verify` (without VerifyOptions.kernel) "
                "checks these bytes by inverting the packing")


LAYOUT = CpuLayout()
