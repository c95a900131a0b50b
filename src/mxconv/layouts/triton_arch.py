"""Per-GPU storage of the triton_kernels MXFP4 layout (docs/layout-triton.md §10): which value and
scale layout vLLM 0.33's ``_swizzle_mxfp4`` picks on each platform, the sizes they pad to, and
their byte maps (Hopper's live in :mod:`mxconv.layouts.triton_bytemap`).

| arch   | value layout (stored buffer)                  | scale layout (stored buffer)                          |
|--------|-----------------------------------------------|-------------------------------------------------------|
| sm90   | HopperMXValueLayout [E, Np/4, 4*Kbp]          | HopperMXScaleLayout [E, Ns/32, 32*Cp]                 |
| sm100  | BlackwellMXValueLayout [E, N, roundup(K/2, 128)] | BlackwellMXScaleLayout [E, Ns/128, 128*Cp], Ns = roundup(N, 128), Cp = roundup(C, 8) |
| sm120  | same as sm100 (triton_kernels picks by capability >= 10) | same as sm100                              |
| gfx950 | StridedLayout [E, N, K/2] (canonical bytes)   | CDNA4MXScaleLayout [E, N/32, 32*C] (N % 32 == 0, C % 8 == 0) |
| gfx1250 | StridedLayout [E, N, K/2] (canonical bytes)  | aiter shuffle_scale_moe tile, then StridedLayout [E, N/32, 32*C] (C % 4 == 0) |

Engines wrap ``buf.mT`` (and Blackwell's scale as ``buf.view(1, E*Ns/128, Cp/4, 2, 256)``).
torch is imported lazily, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from mxconv.layouts.triton_bytemap import (
    need,
    permute_scales,
    permute_values,
    twiddle_words,
    unpermute_scales,
    unpermute_values,
)
from mxconv.layouts.vllm_backends import Platform, vllm_alignment

if TYPE_CHECKING:
    import torch


class Arch(StrEnum):
    """GPU whose ``_swizzle_mxfp4`` storage an output holds (``--layout-option arch=``).

    Its first four values are :class:`mxconv.layouts.engine_picks.Gpu`'s GPUs. Neither enum is made
    from the other: the sets differ (gfx1250 has no engine-pick rows; ``Gpu.CPU`` has no triton
    storage), an Enum with members cannot be extended by subclassing, and one built by the functional
    API from the other's members hides its members from the type checker.
    tests/test_layout_triton_arch.py checks that the shared names and values agree.
    """

    SM90 = "sm90"
    SM100 = "sm100"
    SM120 = "sm120"
    GFX950 = "gfx950"
    GFX1250 = "gfx1250"


@dataclass(frozen=True)
class ArchSpec:
    """What vLLM 0.33 builds for the TRITON backends on one GPU family."""

    gpu: str  # for the manifest
    value_layout: str  # triton_kernels class names
    scale_layout: str
    value_group: int  # stored value buffer = [E, rows / value_group, value_group * row bytes]
    value_byte_multiple: int | None  # None: the triton_kernels generation decides (Hopper)
    scale_group: int  # stored scale buffer = [E, scale rows / scale_group, scale_group * cols]
    scale_row_multiple: int | None  # None: 32 * num_warps (Hopper)
    scale_col_multiple: int
    platform: Platform  # picks vLLM's padding for TRITON (vllm_backends.vllm_alignment, the one table)
    vllm_backends: tuple[str, ...]

    @property
    def hidden_align(self) -> int:
        """Multiple vLLM rounds the hidden size up to for TRITON here (1: kept as is)."""
        return self._align()[0]

    @property
    def intermediate_align(self) -> int:
        """Multiple vLLM rounds the intermediate size up to for TRITON here."""
        return self._align()[1]

    def _align(self) -> tuple[int, int]:
        align = vllm_alignment("TRITON", "swigluoai", self.platform)  # the OAI Triton experts run swigluoai only
        if align is None:  # TRITON is in the table on every platform: a bug if not (exit 3)
            raise RuntimeError(f"vllm_backends has no TRITON padding for platform {self.platform}")
        return align


ARCHS: dict[Arch, ArchSpec] = {
    Arch.SM90: ArchSpec("SM90 (Hopper)", "HopperMXValueLayout", "HopperMXScaleLayout", 4, None, 32, None, 2,
                        Platform.CUDA, ("TRITON",)),
    Arch.SM100: ArchSpec("SM100/SM103 (datacenter Blackwell)", "BlackwellMXValueLayout", "BlackwellMXScaleLayout",
                         1, 128, 128, 128, 8, Platform.CUDA, ("TRITON",)),
    Arch.SM120: ArchSpec("SM120/SM121 (consumer Blackwell; vLLM ranks TRITON after Marlin there)",
                         "BlackwellMXValueLayout", "BlackwellMXScaleLayout", 1, 128, 128, 128, 8, Platform.CUDA, ("TRITON",)),
    # ROCm: vLLM rounds H and I up to 256 for TRITON (fused_moe/oracle/mxfp4.py); the CDNA4 scale
    # swizzle is used at TP <= 2 only (should_use_cdna4_mx_scale_swizzle). AITER_TRITON_MXFP4_BF16
    # shares the format and interleaves gate/up rows as mxconv does.
    Arch.GFX950: ArchSpec("gfx950 (MI350/MI355, TP <= 2)", "StridedLayout", "CDNA4MXScaleLayout", 1, 1, 32, 32, 8,
                          Platform.ROCM_CDNA4, ("TRITON", "AITER_TRITON_MXFP4_BF16")),
    # gfx1250: strided values and strided scales, the scales first tiled by aiter's shuffle_scale_moe
    # (arch gfx1250, preshuffle_factor 32, scale_kwidth 4; should_use_gfx1250_mx_scale_swizzle, any TP).
    Arch.GFX1250: ArchSpec("gfx1250 (aiter GFX1250_SCALE)", "StridedLayout",
                           "StridedLayout after aiter shuffle_scale_moe(arch=gfx1250, 32, 4)", 1, 1, 32, 32, 4,
                           Platform.ROCM, ("TRITON", "AITER_TRITON_MXFP4_BF16")),
}  # fmt: skip


def spec_of(arch: Arch | str) -> ArchSpec:
    return ARCHS[Arch(arch)]


# ---------------------------------------------------------------------------------------------
# Byte maps of already padded stacks: [E, N, Kbp] values, [E, Ns, Cp] scales -> stored buffers.
# Blackwell scale: source row 128 n0 + 32 r4 + r32, column 4 k0 + k4 -> buffer row n0,
#                  column ((k0*32 + r32)*4 + r4)*4 + k4.
# CDNA4 scale:     source row 32 n0 + 16 n1 + n2, column 8 c0 + 4 c1 + c2 -> buffer row n0,
#                  column (((c0*4 + c2)*16 + n2)*2 + c1)*2 + n1.
# gfx1250 scale:   source row 32 n0 + r32, column 4 k0 + k4 -> buffer row n0, column (k0*32 + r32)*4 + k4.
# ---------------------------------------------------------------------------------------------


def _blackwell_scales(x: torch.Tensor) -> torch.Tensor:
    E, n, c = x.shape
    need(n % 128 == 0 and c % 4 == 0, f"Blackwell scale layout needs rows % 128 == 0 and columns % 4 == 0, got [{n}, {c}]")
    t = x.reshape(E, n // 128, 4, 32, c // 4, 4)  # n0 r4 r32 k0 k4
    return t.permute(0, 1, 4, 3, 2, 5).reshape(E, n // 128, 128 * c)


def _unblackwell_scales(buf: torch.Tensor) -> torch.Tensor:
    E, rows, cols = buf.shape
    need(cols % 512 == 0, f"Blackwell scale buffer [{rows}, {cols}] is not [Ns/128, 128*Cp]")
    t = buf.reshape(E, rows, cols // 512, 32, 4, 4)  # n0 k0 r32 r4 k4
    return t.permute(0, 1, 4, 3, 2, 5).reshape(E, rows * 128, cols // 128)


def _cdna4_scales(x: torch.Tensor) -> torch.Tensor:
    E, n, c = x.shape
    need(n % 32 == 0 and c % 8 == 0, f"CDNA4 scale layout needs rows % 32 == 0 and columns % 8 == 0, got [{n}, {c}]")
    t = x.reshape(E, n // 32, 2, 16, c // 8, 2, 4)  # n0 n1 n2 c0 c1 c2
    return t.permute(0, 1, 4, 6, 3, 5, 2).reshape(E, n // 32, 32 * c)


def _uncdna4_scales(buf: torch.Tensor) -> torch.Tensor:
    E, rows, cols = buf.shape
    need(cols % 256 == 0, f"CDNA4 scale buffer [{rows}, {cols}] is not [N/32, 32*C]")
    t = buf.reshape(E, rows, cols // 256, 4, 16, 2, 2)  # n0 c0 c2 n2 c1 n1
    return t.permute(0, 1, 6, 4, 2, 5, 3).reshape(E, rows * 32, cols // 32)


def _gfx1250_scales(x: torch.Tensor) -> torch.Tensor:
    E, n, c = x.shape
    need(n % 32 == 0 and c % 4 == 0, f"gfx1250 scale layout needs rows % 32 == 0 and columns % 4 == 0, got [{n}, {c}]")
    t = x.reshape(E, n // 32, 32, c // 4, 4)  # n0 r32 k0 k4
    return t.permute(0, 1, 3, 2, 4).reshape(E, n // 32, 32 * c)


def _ungfx1250_scales(buf: torch.Tensor) -> torch.Tensor:
    E, rows, cols = buf.shape
    need(cols % 128 == 0, f"gfx1250 scale buffer [{rows}, {cols}] is not [N/32, 32*C]")
    t = buf.reshape(E, rows, cols // 128, 32, 4)  # n0 k0 r32 k4
    return t.permute(0, 1, 3, 2, 4).reshape(E, rows * 32, cols // 32)


_SCALE_MAPS = {Arch.GFX950: (_cdna4_scales, _uncdna4_scales), Arch.GFX1250: (_gfx1250_scales, _ungfx1250_scales)}


def encode(arch: Arch | str, values: torch.Tensor, scales: torch.Tensor, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded canonical [E, Np, Kbp] values and [E, Ns, Cp] scales -> the stored buffers of ``arch``."""
    a = Arch(arch)
    if a is Arch.SM90:
        return twiddle_words(permute_values(values)), permute_scales(scales, num_warps)
    return values.contiguous(), _SCALE_MAPS.get(a, (_blackwell_scales,))[0](scales)


def decode(arch: Arch | str, values: torch.Tensor, scales: torch.Tensor, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode`: stored buffers -> padded [E, Np, Kbp] values, [E, Ns, Cp] scales."""
    a = Arch(arch)
    if a is Arch.SM90:
        return unpermute_values(twiddle_words(values, inverse=True)), unpermute_scales(scales, num_warps)
    return values, _SCALE_MAPS.get(a, (None, _unblackwell_scales))[1](scales)
