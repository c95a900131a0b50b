"""vLLM CUTLASS MXFP4 MoE layout: the expert tensors vLLM 0.33's ``CutlassExpertsMxfp4``
(``CUTLASS_MXFP4_MXFP4``, MXFP4 weights x dynamic MXFP4 activations, SM100 family) holds after
``CompressedTensorsW4A4Mxfp4MoEMethod.process_weights_after_loading`` (spec: docs/layout-cutlass.md).

Per layer and TP rank (E experts, H hidden, I intermediate); nothing is padded but the scale tiles:

| name             | shape                                    | dtype    | content |
|------------------|------------------------------------------|----------|---------|
| w13_weight       | [E, 2I, H/2]                             | uint8    | canonical bytes, rows as they come |
| w13_weight_scale | [E, roundup(2I, 128), roundup(H/32, 4)]  | uint8    | E8M0, CUTLASS tiles (below) |
| w2_weight        | [E, H, I/2]                              | uint8    | canonical bytes |
| w2_weight_scale  | [E, roundup(H, 128), roundup(I/32, 4)]   | uint8    | as w13 |
| w13_bias         | [E, 2I]                                  | bfloat16 | only with biases (CutlassExpertsMxfp4 never reads them) |
| w2_bias          | [E, H]                                   | bfloat16 | |

Scale tiles (``swizzle_mxfp4_scales``, fused_moe/experts/cutlass_moe.py): one expert's flat [N, C]
scales (C = K/32) are zero-padded to [Np, Cp] = [roundup(N, 128), roundup(C, 4)]; element (m, k)
then sits at byte ``((m // 128 * Cp/4 + k // 4) * 32 + m % 32) * 16 + (m // 32) % 4 * 4 + k % 4``
of the expert's Np * Cp bytes, which are stored viewed as [Np, Cp]. Where N % 128 == 0 and
C % 4 == 0 that is the [E, N, K/32] tensor vLLM holds; otherwise vLLM 0.33 cannot load the
checkpoint (its ``reshape(N, K/32)`` of the padded tiles fails), and the manifest says so.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.errors import LayoutError
from mxconv.experts.padding import check_fill
from mxconv.experts.stack import round_up
from mxconv.layouts.padded_stack import PAD_FILL, PaddedStackLayout, StackForm, Transform
from mxconv.source.manifest import Manifest

if TYPE_CHECKING:
    import torch

    from mxconv.experts.kernel_settings import KernelLocations

BACKEND_NAME = "cutlass"
MX_BLOCK = 32
ROW_TILE = 128  # scale rows per tile: 4 groups of 32
COL_TILE = 4  # scale columns (K blocks of 32) per tile


def tiled_shape(rows: int, cols: int) -> tuple[int, int]:
    """[Np, Cp] that ``rows`` x ``cols`` scales take once tiled: rows to 128, columns to 4."""
    return round_up(rows, ROW_TILE), round_up(cols, COL_TILE)


def _to_tiles(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[E, rows, cols] (rows % 128 == cols % 4 == 0) -> the same bytes in tile order.

    Row m = 128 * mt + 32 * mi + mo and column k = 4 * kt + ki go to flat position
    (mt, kt, mo, mi, ki) of the expert: the 6-d view (e, mt, mi, mo, kt, ki) permuted to that order.
    """
    E = t.shape[0]
    v = t.reshape(E, rows // ROW_TILE, ROW_TILE // MX_BLOCK, MX_BLOCK, cols // COL_TILE, COL_TILE)
    return v.permute(0, 1, 4, 3, 2, 5).contiguous().reshape(E, rows, cols)


def _from_tiles(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`_to_tiles`: the 6-d view (e, mt, kt, mo, mi, ki) back to (e, mt, mi, mo, kt, ki)."""
    E = t.shape[0]
    v = t.reshape(E, rows // ROW_TILE, cols // COL_TILE, MX_BLOCK, ROW_TILE // MX_BLOCK, COL_TILE)
    return v.permute(0, 1, 4, 3, 2, 5).contiguous().reshape(E, rows, cols)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales [E, N, C] uint8 -> CUTLASS tiles [E, Np, Cp] (:func:`tiled_shape`), zero padded;
    each expert's bytes are ``swizzle_mxfp4_scales(scales[e], N, 32 * C)``."""
    import torch

    if scales.dtype != torch.uint8 or scales.dim() != 3:
        raise LayoutError(f"cutlass: scales must be [E, N, K/32] uint8 E8M0 bytes, got {tuple(scales.shape)} {scales.dtype}")
    E, N, C = scales.shape
    Np, Cp = tiled_shape(N, C)
    padded = torch.zeros((E, Np, Cp), dtype=torch.uint8, device=scales.device)
    padded[:, :N, :C] = scales
    return _to_tiles(padded, Np, Cp)


def unswizzle_scales(tiled: torch.Tensor, name: str, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: [E, Np, Cp] tiles -> [E, rows, cols]; LayoutError naming
    ``name`` and the first padding element (unswizzled [E, row, K block] index) that is not zero."""
    Np, Cp = tiled_shape(rows, cols)
    if tuple(tiled.shape[1:]) != (Np, Cp):
        raise LayoutError(f"cutlass: {name} tiles are {tuple(tiled.shape[1:])} per expert, expected {(Np, Cp)}")
    flat = _from_tiles(tiled, Np, Cp)
    check_fill(name, flat[:, rows:], PAD_FILL, (0, rows, 0))
    check_fill(name, flat[:, :rows, cols:], PAD_FILL, (0, 0, cols))
    return flat[:, :rows, :cols].contiguous()


class CutlassLayout(PaddedStackLayout):
    """vLLM 0.33 ``CUTLASS_MXFP4_MXFP4`` expert tensors (module docstring; docs/layout-cutlass.md)."""

    name = BACKEND_NAME
    version = 1
    hidden_align = intermediate_align = 1  # the weights are stored as the checkpoint holds them
    padding_rule = "the weights are not padded, only the scale tiles"
    padding_notes = {"scale_row_align": ROW_TILE, "scale_col_align": COL_TILE}
    engine_compat = {"vllm": ">=0.33", "gpu": "SM100 family (CutlassExpertsMxfp4)"}
    forms = {  # CutlassExpertsMxfp4: (kMxfp4Static, kMxfp4Dynamic) only
        "mxfp4": StackForm(
            "CUTLASS_MXFP4_MXFP4", scale=Transform(swizzle_scales, unswizzle_scales, tiled_shape),
            notes={
                "scale_format": "e8m0",
                "scale_storage": "per expert: swizzle_mxfp4_scales tiles [N/128, K/128, 32, 4, 4] of the zero-padded "
                                 "[roundup(N, 128), roundup(K/32, 4)] scales, viewed as that 2-d shape",
            },
        ),
    }

    def kernel_unavailable(self, manifest: Manifest, device: Any = "cuda",
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        """vLLM's CUTLASS MXFP4 grouped GEMM needs an SM100-family GPU; mxconv does not drive it."""
        import torch

        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (10, 11):
            return ("vLLM's CutlassExpertsMxfp4 (cutlass_mxfp4_moe_mm) needs an SM100-family (Blackwell) GPU "
                    "and vLLM's compiled _C ops")
        return "running vLLM's CUTLASS MXFP4 MoE kernel is not wired up in this version"


LAYOUT = CutlassLayout()
