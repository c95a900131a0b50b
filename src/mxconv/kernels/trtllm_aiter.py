"""Triton kernels for the backend layouts (trtllm, marlin, aiter): one launch per kernel tensor.

The torch code in ``mxconv.layouts`` is the reference and the CPU path; these kernels produce the
same bytes on CUDA in a single pass over the data (padding fused in, no intermediate copies).
The layout modules call them only for CUDA tensors, when triton imports and the caller's
``KernelChoice`` is AUTO (:func:`mxconv.layouts.gathers.layout_kernels`).

Every kernel reads rows of an *unpadded* canonical stack ``src [E, R_in, W_in]`` through a row
table ``tab`` (int32, one entry per padded/permuted output row: the source row, or -1 for a padding
row), so padding and row permutations cost nothing extra. Columns at or beyond ``W_in`` read as
the padding fill. Programs load a tile in source order (rows x contiguous bytes, coalesced), move
it in registers (``tl.reshape``/``tl.permute``: the compiler goes through shared memory) and
store it in destination order (contiguous). Weights move as 4- or 8-byte words.

Kernels (shapes per expert; E experts on grid axis 2):

* :func:`gather_rows` - trtllm weights: ``out[r, :] = src[tab[r], :]`` plus column padding.
* :func:`swizzle_128x4` - trtllm scales: row gather, column padding, 128x4 swizzle.
* :func:`marlin_weights` - Marlin int32 tile stream (bf16: 16x64 tiles, fp8: 32x32 tiles) built
  straight from packed bytes with nibble masks and a 4x4 byte transpose (no unpack to codes).
* :func:`transpose_rows` - Marlin scales: ``out[g, n] = src[tab[n], g] + offset``.
  (Both Marlin kernels live in :mod:`mxconv.kernels.marlin_triton`, re-exported here.)
* :func:`byte_tile_stream` - Marlin's and humming's MXFP8 weights: 64 x 16 tiles of 8-bit values;
  :func:`humming_nibble_stream` - humming's MXFP4 weights, the same tiles of 4-bit values
  (both in :mod:`mxconv.kernels.byte_tiles`, re-exported here).
* :func:`w16_tiles` - AITER weights: 16x16-byte tiles of gathered rows.
* :func:`s32x8_tiles` - AITER scales: 32x8 scale tiles, two column fills (0 then 0x7F).
"""

from __future__ import annotations

from typing import Any

import torch

from mxconv.kernels.byte_tiles import TileOrder, byte_tile_stream, humming_nibble_stream  # noqa: F401 (the layouts call them through this module)
from mxconv.kernels.marlin_triton import marlin_weights, transpose_rows  # noqa: F401 (the layouts call them through this module)
from mxconv.kernels.triton_common import KERNEL_CONFIG, as_words, gather_operands, kernel_dims, launch
from mxconv.kernels.triton_import import tl, triton

if triton is not None:
    from mxconv.kernels.triton_common import load_rows

    @triton.jit
    def _gather_rows_kernel(
        src, dst, tab, R_out, W_in, W_out, s_e, s_r, d_e, d_r, BR: tl.constexpr, BW: tl.constexpr
    ):
        """dst[e, r, w] = src[e, tab[r], w] (w < W_in, tab[r] >= 0) else 0; W in words."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        w = tl.program_id(1) * BW + tl.arange(0, BW)
        e = tl.program_id(2).to(tl.int64)
        r_ok = r < R_out
        x = load_rows(src, e, s_e, s_r, tl.load(tab + r, mask=r_ok, other=-1), w, W_in, 0)
        tl.store(dst + e * d_e + r[:, None] * d_r + w[None, :], x, mask=r_ok[:, None] & (w < W_out)[None, :])

    @triton.jit
    def _swizzle128x4_kernel(src, dst, tab, C_in, G_out, s_e, s_r, d_e, FILL: tl.constexpr, BG: tl.constexpr):
        """One 128-row tile x BG groups of 4 columns: gather rows, pad columns, 128x4 swizzle.

        Slot of (r, c) in the tile: (c//4)*512 + (r%32)*16 + (r%128//32)*4 + c%4.
        """
        rt = tl.program_id(0)
        pg = tl.program_id(1)
        e = tl.program_id(2).to(tl.int64)
        s = tl.load(tab + rt * 128 + tl.arange(0, 128))
        c = pg * (4 * BG) + tl.arange(0, 4 * BG)
        x = load_rows(src, e, s_e, s_r, s, c, C_in, FILL)
        # [r%128//32, r%32, c//4, c%4] -> [c//4, r%32, r%128//32, c%4]
        x = tl.reshape(x, (4, 32, BG, 4))
        x = tl.permute(x, (2, 1, 0, 3))
        x = tl.reshape(x, (BG, 512))
        g = pg * BG + tl.arange(0, BG)
        off = (rt * G_out + g)[:, None] * 512 + tl.arange(0, 512)[None, :]
        tl.store(dst + e * d_e + off, x, mask=(g < G_out)[:, None])

    @triton.jit
    def _w16_kernel(src, dst, tab, CB_in, CB_out, s_e, s_r, d_e, BC: tl.constexpr):
        """One 16-row block x BC 16-byte chunks: dst chunk (rb*CB_out + cb)*16 + rr <- src row
        tab[rb*16 + rr], chunk cb (zero when padding). Words are int64 (2 per chunk)."""
        rb = tl.program_id(0)
        cb = tl.program_id(1) * BC + tl.arange(0, BC)
        e = tl.program_id(2).to(tl.int64)
        s = tl.load(tab + rb * 16 + tl.arange(0, 16))
        col = (2 * cb)[:, None] + tl.arange(0, 2)[None, :]  # [cb, h]
        m = (s >= 0)[:, None, None] & ((cb < CB_in)[:, None] & (col >= 0))[None, :, :]
        x = tl.load(src + e * s_e + s[:, None, None] * s_r + col[None, :, :], mask=m, other=0)  # [rr, cb, h]
        x = tl.permute(x, (1, 0, 2))  # [cb, rr, h]
        x = tl.reshape(x, (BC, 32))
        off = (rb * CB_out + cb)[:, None] * 32 + tl.arange(0, 32)[None, :]
        tl.store(dst + e * d_e + off, x, mask=(cb < CB_out)[:, None])

    @triton.jit
    def _s32x8_kernel(
        src, dst, tab, C_in, C_zero, T_out, s_e, s_r, d_e, PAD: tl.constexpr, BT: tl.constexpr
    ):
        """One 32-row tile x BT tiles of 8 columns. Value of (r, c): src[tab[r], c] when tab[r] >= 0
        and c < C_in; 0 when c < C_zero; PAD beyond. In-tile slot of (r, c) with r%32 = 16b + i,
        c%8 = 4f + g: ((g*16 + i)*2 + f)*2 + b."""
        rt = tl.program_id(0)
        pt = tl.program_id(1)
        e = tl.program_id(2).to(tl.int64)
        s = tl.load(tab + rt * 32 + tl.arange(0, 32))
        c = pt * (8 * BT) + tl.arange(0, 8 * BT)
        x = load_rows(src, e, s_e, s_r, s, c, C_in, 0)
        x = tl.where((c < C_zero)[None, :], x, PAD).to(tl.uint8)
        x = tl.reshape(x, (2, 16, BT, 2, 4))  # [b, i, t, f, g]
        x = tl.permute(x, (2, 4, 1, 3, 0))  # [t, g, i, f, b]
        x = tl.reshape(x, (BT, 256))
        t = pt * BT + tl.arange(0, BT)
        off = (rt * T_out + t)[:, None] * 256 + tl.arange(0, 256)[None, :]
        tl.store(dst + e * d_e + off, x, mask=(t < T_out)[:, None])


# ---------------------------------------------------------------------------------------------
# Launchers. ``src`` is the unpadded canonical stack [E, R_in, W_in] (uint8, last dim contiguous);
# ``tab`` the int32 row table (any integer dtype/device is accepted and converted).
# ---------------------------------------------------------------------------------------------


def gather_rows(src: torch.Tensor, tab: torch.Tensor, cols_out: int) -> torch.Tensor:
    """uint8 [E, R_in, C_in] -> [E, len(tab), cols_out]: row r = src row tab[r] (zeros for -1),
    columns beyond C_in zero. C_in and cols_out must be multiples of 8."""
    E, C_in, R_out = kernel_dims(src, tab)
    out, src, tab = gather_operands(src, tab, (E, R_out, cols_out))
    if out.numel() == 0:
        return out
    if C_in % 8 or cols_out % 8:
        raise ValueError(f"gather_rows needs byte widths that are multiples of 8, got {C_in} -> {cols_out}")
    s, d = as_words(src, torch.int64), out.view(torch.int64)
    cfg = KERNEL_CONFIG["gather_rows"]
    grid = (triton.cdiv(R_out, cfg["BR"]), triton.cdiv(cols_out // 8, cfg["BW"]), E)
    launch(
        _gather_rows_kernel, grid, src,
        s, d, tab, R_out, C_in // 8, cols_out // 8, s.stride(0), s.stride(1), d.stride(0), d.stride(1), **cfg
    )
    return out


def swizzle_128x4(src: torch.Tensor, tab: torch.Tensor, cols_out: int, fill: int = 0) -> torch.Tensor:
    """uint8 [E, R_in, C_in] -> [E, len(tab) * cols_out]: rows gathered through ``tab``, columns
    padded to ``cols_out`` with ``fill``, each expert's matrix in 128x4 swizzled order.
    len(tab) % 128 == 0 and cols_out % 4 == 0."""
    E, _, R_out = kernel_dims(src, tab)
    if R_out % 128 or cols_out % 4:
        raise ValueError(f"128x4 swizzle needs rows % 128 == 0 and columns % 4 == 0, got [{R_out}, {cols_out}]")
    return _scale_tiles(
        _swizzle128x4_kernel, ("swizzle_128x4", "BG"), src, tab, (E, R_out * cols_out), 128, cols_out // 4, FILL=int(fill)
    )


def w16_tiles(src: torch.Tensor, tab: torch.Tensor, cols_out: int) -> torch.Tensor:
    """uint8 [E, R_in, B_in] -> [E, len(tab), cols_out] in AITER's W16 order (16x16-byte tiles,
    row-block-major) of the rows gathered through ``tab`` (zero padding). len(tab) % 16 == 0,
    B_in and cols_out multiples of 16."""
    E, B_in, R_out = kernel_dims(src, tab)
    if R_out % 16 or B_in % 16 or cols_out % 16:
        raise ValueError(f"W16 needs rows and byte widths that are multiples of 16, got {R_out}, {B_in}, {cols_out}")
    out, src, tab = gather_operands(src, tab, (E, R_out, cols_out))
    if out.numel() == 0:
        return out
    s, d = as_words(src, torch.int64), out.view(torch.int64)
    cfg = KERNEL_CONFIG["w16_tiles"]
    cb_out = cols_out // 16
    grid = (R_out // 16, triton.cdiv(cb_out, cfg["BC"]), E)
    launch(_w16_kernel, grid, src, s, d, tab, B_in // 16, cb_out, s.stride(0), s.stride(1), d.stride(0), **cfg)
    return out


def s32x8_tiles(src: torch.Tensor, tab: torch.Tensor, zero_cols: int, cols_out: int, pad: int) -> torch.Tensor:
    """uint8 [E, R_in, C_in] -> [E, len(tab), cols_out] in AITER's S32x8 order. Source columns
    c < C_in of gathered rows keep their bytes, other columns below ``zero_cols`` are 0 (as are
    padding rows there), columns from ``zero_cols`` on are ``pad``. len(tab) % 32 == 0,
    cols_out % 8 == 0."""
    E, _, R_out = kernel_dims(src, tab)
    if R_out % 32 or cols_out % 8:
        raise ValueError(f"S32x8 needs rows % 32 == 0 and columns % 8 == 0, got [{R_out}, {cols_out}]")
    return _scale_tiles(
        _s32x8_kernel, ("s32x8_tiles", "BT"), src, tab, (E, R_out, cols_out), 32, cols_out // 8, zero_cols, PAD=int(pad)
    )


def _scale_tiles(
    kernel: Any, config: tuple[str, str], src: torch.Tensor, tab: torch.Tensor, out_shape: tuple[int, ...],
    tile_rows: int, groups: int, *args: Any, **consts: Any,
) -> torch.Tensor:
    """Launch a scale-tile kernel (:func:`swizzle_128x4`, :func:`s32x8_tiles`) and return its
    ``out`` (uint8 ``out_shape``): one program per ``tile_rows`` rows x a block of the ``groups``
    column groups x expert (``config``: the ``KERNEL_CONFIG`` entry and its block-size key), called
    as ``kernel(src, out, tab, C_in, *args, groups, src.stride(0), src.stride(1), out.stride(0), **consts)``."""
    out, src, tab = gather_operands(src, tab, out_shape)
    if out.numel() == 0:
        return out
    name, block = config
    cfg = KERNEL_CONFIG[name]
    grid = (tab.numel() // tile_rows, triton.cdiv(groups, cfg[block]), src.shape[0])
    launch(
        kernel, grid, src,
        src, out, tab, src.shape[2], *args, groups, src.stride(0), src.stride(1), out.stride(0), **consts, **cfg
    )
    return out


__all__ = ["gather_rows", "s32x8_tiles", "swizzle_128x4", "w16_tiles"]
