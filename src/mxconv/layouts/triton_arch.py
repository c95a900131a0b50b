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

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from mxconv.errors import BadInput
from mxconv.layouts.description import LayoutDescription
from mxconv.layouts.triton_bytemap import (
    need,
    permute_scales,
    permute_values,
    twiddle_words,
    unpermute_scales,
    unpermute_values,
)
from mxconv.layouts.vllm_backends import CDNA4_SCALE_MAX_TP, Platform, vllm_alignment

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


_BLACKWELL = (_blackwell_scales, _unblackwell_scales)


# (row multiple, row-byte multiple) of the value layout per triton_kernels generation
VALUE_PADDING = {"3.5": (16, 32), "3.6": (64, 64), "3.8": (64, 64)}  # 3.8: the same bytes as 3.6 (spec §0)
ENGINE_COMPAT = {
    ("3.5", 4): "0.33 (vendored triton_kernels 3.5.1 API, scale K/32 padded to 4 on SM90)",
    ("3.5", 1): "0.12-0.14 (vendored triton_kernels 3.5.1 API, no scale K/32 pad)",
    ("3.6", 1): "0.20 (vendored triton_kernels 3.6 generation, no scale K/32 pad)",
    ("3.6", 4): "0.33 with a site-packages triton_kernels of the 3.6 generation (not validated)",
    ("3.8", 4): "triton_kernels 3.8 (matmul API): the 3.6 bytes; vLLM 0.33 runs 3.8 on ROCm only (spec §0)",
    ("3.8", 1): "triton_kernels 3.8 (matmul API): the 3.6 bytes, no scale K/32 pad (spec §0)",
}


@dataclass(frozen=True, kw_only=True)
class TritonDescription(LayoutDescription):
    """The keys of a triton output's manifest ``layout`` that the engine runner reads, as
    :meth:`ArchSpec.description` writes them. An output written before a key existed lacks it; the
    defaults are what such outputs hold: the sm90 storage of triton_kernels 3.5 with vLLM's
    num_warps 8, the scale's K/32 padded to 4 and the intermediate size to 64."""

    arch: str = "sm90"  # an Arch value: the GPU whose storage the output holds
    triton_layout: str | None = "3.5"  # triton_kernels value-layout generation (None: the arch ignores it)
    num_warps: int | None = 8  # HopperMXScaleLayout num_warps (None: the arch ignores it)
    scale_k_align: int = 4  # the scale's K/32 axis padded to this multiple
    intermediate_align: int = 64  # a TP rank's intermediate share is rounded up to this

    reader: ClassVar[str] = "the triton engine runner"

    def hopper_storage(self) -> tuple[str, int, int]:
        """(triton_layout, num_warps, scale_k_align) of an sm90 storage, which records them all;
        BadInput naming the field recorded as null."""
        if self.triton_layout is None or self.num_warps is None:
            null = "triton_layout" if self.triton_layout is None else "num_warps"
            raise BadInput(f"manifest layout.{null}: null, but the sm90 storage (layout.arch {self.arch!r}) records it; "
                           f"{self.reader} needs it")  # fmt: skip
        return self.triton_layout, self.num_warps, self.scale_k_align


@dataclass(frozen=True)
class ArchSpec:
    """The triton layout's variant object for one GPU family: what vLLM 0.33 builds for the TRITON
    backends there, the sizes it pads to and its byte maps. This class is a fixed storage (Blackwell,
    ROCm), which none of the layout's Hopper options shape; :class:`HopperSpec` is the one they do."""

    arch: Arch
    gpu: str  # for the manifest
    value_layout: str  # triton_kernels class names
    scale_layout: str
    value_group: int  # stored value buffer = [E, rows / value_group, value_group * row bytes]
    value_byte_multiple: int  # value row bytes padded to this (Hopper: its generation decides)
    scale_group: int  # stored scale buffer = [E, scale rows / scale_group, scale_group * cols]
    scale_row_multiple: int  # scale rows padded to this (Hopper: 32 * num_warps)
    scale_col_multiple: int
    platform: Platform  # picks vLLM's padding for TRITON (vllm_backends.vllm_alignment, the one table)
    vllm_backends: tuple[str, ...]
    scale_maps: tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None = field(
        default=None, repr=False)  # (stored from padded, padded from stored) scales; Hopper: its own methods
    max_tp: int | None = None  # the largest TP at which vLLM keeps this scale storage (None: any)
    w4a8: bool = False  # vLLM runs W4A8 (AITER_MXFP4_FP8, --activation fp8) on this GPU
    options_shape_bytes: ClassVar[bool] = False  # triton_layout / num_warps / scale_k_align shape the bytes
    layout_kernels: ClassVar[bool] = False  # mxconv's Triton layout kernels (and the fused pass) write it
    warns_unaligned_hidden: ClassVar[bool] = False  # its matmul computes wrong results for H % 64 != 0

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

    def value_padding(self, generation: str) -> tuple[int, int]:
        """(row multiple, row-byte multiple) of the value buffer under triton_kernels ``generation``."""
        return 1, self.value_byte_multiple

    def scale_k_align(self, given: int) -> int:
        """The multiple the scale's K/32 axis is zero-padded to, ``given`` the option's value."""
        return 1

    def scale_rows_multiple(self, num_warps: int) -> int:
        return self.scale_row_multiple

    def layout_num_warps(self, num_warps: int) -> int | None:
        """The scale layout's num_warps for the manifest (None: the storage does not depend on it)."""
        return None

    def encode(self, values: torch.Tensor, scales: torch.Tensor, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded canonical [E, Np, Kbp] values and [E, Ns, Cp] scales -> the stored buffers."""
        assert self.scale_maps is not None
        return values.contiguous(), self.scale_maps[0](scales)

    def decode(self, values: torch.Tensor, scales: torch.Tensor, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`encode`: stored buffers -> padded [E, Np, Kbp] values, [E, Ns, Cp] scales."""
        assert self.scale_maps is not None
        return values, self.scale_maps[1](scales)

    def engine_compat(self, generation: str, scale_k_align: int) -> dict[str, str]:
        """The manifest's ``engine_compat`` (``torch`` added by the layout)."""
        return {"vllm": f"0.33 on {self.gpu}", "triton_kernels": "3.5, 3.6 and 3.8 store these bytes", "gpu": self.gpu}

    def description(self, generation: str, num_warps: int, scale_k_align: int) -> TritonDescription:
        """The runner's keys of the manifest for the layout's options: the Hopper options' values where
        they shape the bytes, else None (scale_k_align: 1)."""
        return TritonDescription(arch=self.arch, triton_layout=generation if self.options_shape_bytes else None,
                                 num_warps=self.layout_num_warps(num_warps), scale_k_align=self.scale_k_align(scale_k_align),
                                 intermediate_align=self.intermediate_align)  # fmt: skip

    def storage_fields(self, d: TritonDescription, generation: str) -> dict[str, Any]:
        """The manifest's storage fields, those the runner reads from ``d`` (:meth:`description`)."""
        rows, row_bytes = self.value_padding(generation)
        return {"triton_layout": d.triton_layout,
                "value_padding": {"rows": rows, "row_bytes": row_bytes}, "bit_twiddle": self.options_shape_bytes,
                "num_warps": d.num_warps, "scale_k_align": d.scale_k_align,
                "split_k": 1 if self.options_shape_bytes else None}  # fmt: skip


@dataclass(frozen=True)
class HopperSpec(ArchSpec):
    """SM90: the Hopper value layout (padding per triton_kernels generation, value permutation, bit
    twiddle) and scale layout (rows to 32 * num_warps, vLLM's K/32 pad to scale_k_align)."""

    options_shape_bytes: ClassVar[bool] = True
    layout_kernels: ClassVar[bool] = True
    warns_unaligned_hidden: ClassVar[bool] = True

    def value_padding(self, generation: str) -> tuple[int, int]:
        return VALUE_PADDING[generation]

    def scale_k_align(self, given: int) -> int:
        return given  # vLLM pads the scale's K/32 axis on SM90 only

    def scale_rows_multiple(self, num_warps: int) -> int:
        return 32 * num_warps

    def layout_num_warps(self, num_warps: int) -> int | None:
        return num_warps

    def encode(self, values: torch.Tensor, scales: torch.Tensor, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
        return twiddle_words(permute_values(values)), permute_scales(scales, num_warps)

    def decode(self, values: torch.Tensor, scales: torch.Tensor, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
        return unpermute_values(twiddle_words(values, inverse=True)), unpermute_scales(scales, num_warps)

    def engine_compat(self, generation: str, scale_k_align: int) -> dict[str, str]:
        return {"vllm": ENGINE_COMPAT[(generation, scale_k_align)], "triton_kernels": f"{generation} generation",
                "gpu": self.gpu}  # fmt: skip


ARCHS: dict[Arch, ArchSpec] = {
    Arch.SM90: HopperSpec(Arch.SM90, "SM90 (Hopper)", "HopperMXValueLayout", "HopperMXScaleLayout", 4, 1, 32, 1, 2,
                          Platform.CUDA, ("TRITON",)),
    Arch.SM100: ArchSpec(Arch.SM100, "SM100/SM103 (datacenter Blackwell)", "BlackwellMXValueLayout",
                         "BlackwellMXScaleLayout", 1, 128, 128, 128, 8, Platform.CUDA, ("TRITON",), _BLACKWELL),
    Arch.SM120: ArchSpec(Arch.SM120, "SM120/SM121 (consumer Blackwell; vLLM ranks TRITON after Marlin there)",
                         "BlackwellMXValueLayout", "BlackwellMXScaleLayout", 1, 128, 128, 128, 8, Platform.CUDA,
                         ("TRITON",), _BLACKWELL),
    # ROCm: vLLM rounds H and I up to 256 for TRITON (fused_moe/oracle/mxfp4.py); the CDNA4 scale
    # swizzle is used at TP <= 2 only (should_use_cdna4_mx_scale_swizzle). AITER_TRITON_MXFP4_BF16
    # shares the format and interleaves gate/up rows as mxconv does.
    Arch.GFX950: ArchSpec(Arch.GFX950, "gfx950 (MI350/MI355, TP <= 2)", "StridedLayout", "CDNA4MXScaleLayout", 1, 1,
                          32, 32, 8, Platform.ROCM_CDNA4, ("TRITON", "AITER_TRITON_MXFP4_BF16"),
                          (_cdna4_scales, _uncdna4_scales), max_tp=CDNA4_SCALE_MAX_TP, w4a8=True),
    # gfx1250: strided values and strided scales, the scales first tiled by aiter's shuffle_scale_moe
    # (arch gfx1250, preshuffle_factor 32, scale_kwidth 4; should_use_gfx1250_mx_scale_swizzle, any TP).
    Arch.GFX1250: ArchSpec(Arch.GFX1250, "gfx1250 (aiter GFX1250_SCALE)", "StridedLayout",
                           "StridedLayout after aiter shuffle_scale_moe(arch=gfx1250, 32, 4)", 1, 1, 32, 32, 4,
                           Platform.ROCM, ("TRITON", "AITER_TRITON_MXFP4_BF16"), (_gfx1250_scales, _ungfx1250_scales)),
}  # fmt: skip


def spec_of(arch: Arch | str) -> ArchSpec:
    """The variant object of ``arch`` (an :class:`Arch` or its string)."""
    return ARCHS[Arch(arch)]


def encode(arch: Arch | str, values: torch.Tensor, scales: torch.Tensor, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded canonical [E, Np, Kbp] values and [E, Ns, Cp] scales -> the stored buffers of ``arch``."""
    return spec_of(arch).encode(values, scales, num_warps)


def decode(arch: Arch | str, values: torch.Tensor, scales: torch.Tensor, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode`: stored buffers -> padded [E, Np, Kbp] values, [E, Ns, Cp] scales."""
    return spec_of(arch).decode(values, scales, num_warps)
