"""The 128x4 scale swizzle FlashInfer's MXFP4 MoE kernels read their E8M0 block scales in (the TRT-LLM-gen
layout's step C, docs/layout-trtllm.md, and the FlashInfer CUTLASS layout's scales): shared vocabulary of
the trtllm and flashinfer-cutlass backends, which do not import each other.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mxconv.errors import LayoutError
from mxconv.experts.stack import round_up

if TYPE_CHECKING:
    import torch

SF_TILE_ROWS = 128  # 128x4 scale swizzle tile
SF_TILE_COLS = 4


# ---------------------------------------------------------------------------------------------
# Step C: 128x4 scale swizzle (per expert). Element (r, c) of a [R, C] matrix, padded to
# (Rp, Cp) = (roundup(R, 128), roundup(C, 4)), lands at
#   off(r, c) = ((r//128)*(Cp/4) + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4.
# ---------------------------------------------------------------------------------------------


def swizzled_scale_size(rows: int, cols: int) -> int:
    """Elements in one expert's swizzled buffer: roundup(rows, 128) * roundup(cols, 4)."""
    return round_up(rows, SF_TILE_ROWS) * round_up(cols, SF_TILE_COLS)


def swizzle_offsets(rows: int, cols: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``off(r, c)`` for every element of a [rows, cols] matrix: LongTensor [rows, cols]."""
    import torch

    Cp = round_up(cols, SF_TILE_COLS)
    r = torch.arange(rows, dtype=torch.long, device=device)[:, None]
    c = torch.arange(cols, dtype=torch.long, device=device)[None, :]
    tile = (r // SF_TILE_ROWS) * (Cp // SF_TILE_COLS) + c // SF_TILE_COLS
    return tile * 512 + (r % 32) * 16 + ((r % SF_TILE_ROWS) // 32) * 4 + c % SF_TILE_COLS


def swizzle_slot_coords(rows: int, cols: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, c) held by every slot p of one expert's swizzled buffer (spec §10), padding included.

    Returns two LongTensors [Rp*Cp]; entries with r >= rows or c >= cols are padding slots.
    """
    import torch

    Cp = round_up(cols, SF_TILE_COLS)
    p = torch.arange(swizzled_scale_size(rows, cols), dtype=torch.long, device=device)
    row_tile, q = p // (SF_TILE_ROWS * Cp), p % (SF_TILE_ROWS * Cp)
    r = SF_TILE_ROWS * row_tile + 32 * ((q % 16) // 4) + (q % 512) // 16
    c = SF_TILE_COLS * (q // 512) + q % 4
    return r, c


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Swizzle each trailing [R, C] matrix of ``scales`` ([..., R, C], any dtype) into its 128x4 order.

    Pads to (roundup(R, 128), roundup(C, 4)) with the zero bit pattern, then reorders
    [Rp/128, 4, 32, Cp/4, 4] -> (row tile, col tile, row in group, 32-row group, col in tile).
    Returns a contiguous tensor [..., Rp*Cp] of the same dtype (one flat buffer per matrix).
    """
    import torch

    *lead, R, C = scales.shape
    Rp, Cp = round_up(R, SF_TILE_ROWS), round_up(C, SF_TILE_COLS)
    if (Rp, Cp) != (R, C):
        padded = torch.zeros((*lead, Rp, Cp), dtype=scales.dtype, device=scales.device)
        padded[..., :R, :C] = scales
        scales = padded
    tiles = scales.reshape(-1, Rp // SF_TILE_ROWS, 4, 32, Cp // SF_TILE_COLS, SF_TILE_COLS)
    swizzled = tiles.permute(0, 1, 4, 3, 2, 5)
    return swizzled.reshape(*lead, Rp * Cp).contiguous()


def unswizzle_128x4(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4`: [..., Rp*Cp] -> [..., rows, cols] (padding slots dropped)."""
    *lead, n = buffer.shape
    Rp, Cp = round_up(rows, SF_TILE_ROWS), round_up(cols, SF_TILE_COLS)
    if n != Rp * Cp:
        raise LayoutError(f"swizzled scale buffer has {n} elements per matrix, expected {Rp * Cp}")
    tiles = buffer.reshape(-1, Rp // SF_TILE_ROWS, Cp // SF_TILE_COLS, 32, 4, SF_TILE_COLS)
    matrix = tiles.permute(0, 1, 4, 3, 2, 5).reshape(*lead, Rp, Cp)
    return matrix[..., :rows, :cols].contiguous()
