"""Triton kernel of the 8-bit weight streams (MXFP8 experts, one E4M3 byte a value) that Marlin and
humming both build from 64-row x 16-value tiles:

* Marlin MXFP8 (``gptq_marlin_repack(num_bits=8)``, bf16 activations; docs/layout-marlin.md §13,
  :func:`mxconv.layouts.marlin_mxfp8.repack_bytes`);
* humming MXFP8 (``weight_repack_nk`` with 8-bit B; docs/layout-humming.md,
  :func:`mxconv.layouts.humming_bytemap.repack_bytes`).

Both write, per expert, int32 [K/16, 4N]: the 1024 bytes of tile (k-tile kt, 64-row block nt) are
contiguous at byte ``kt * 16N + nt * 1024``, a fixed permutation of the tile's 64 x 16 values. The
two differ only in that permutation, so one kernel takes it as a constexpr :class:`TileOrder`: a
program loads BK tiles of one row block in source order (rows x contiguous bytes, through the row
table, padding fused in), regroups them with ``tl.reshape``/``tl.permute`` (the compiler goes through
shared memory) and stores them contiguously. Same contract as the other layout kernels
(:mod:`mxconv.kernels.trtllm_aiter`, which re-exports :func:`byte_tile_stream`): the unpadded
canonical stack read through a row table (-1: a zero row), K zero-padded, the torch path's bytes.

humming's 4-bit form (MXFP4 experts) keeps the same 64 x 16 tiles with two values a byte:
:func:`humming_nibble_stream` unpacks the nibbles in registers, permutes them the same way and packs
pairs again (512 bytes a tile).
"""

from __future__ import annotations

from enum import Enum

import torch

from mxconv.kernels.triton_common import KERNEL_CONFIG, gather_operands, kernel_dims, launch
from mxconv.kernels.triton_import import tl, triton


class TileOrder(Enum):
    """Whose byte order inside a 64 x 16 tile (the value is the kernel's constexpr)."""

    # n = 16 j + 8 blk + thc, k = 8 p0 + 2 thr + p1 -> stream (thc, thr, j, blk, p1, p0)
    MARLIN = 0
    # n = 8 kk + ln, k = 8 i5 + 2 lq + i6 -> stream (ln, lq, kk, i6, i5)
    HUMMING = 1


if triton is not None:
    from mxconv.kernels.triton_common import load_rows

    @triton.jit
    def _byte_tiles_kernel(src, dst, tab, K_in, KT_out, N, s_e, s_r, d_e, ORDER: tl.constexpr, BK: tl.constexpr):
        """Row block nt (64 rows) x BK k-tiles of 16 values: dst bytes kt*16N + nt*1024 + i."""
        nt = tl.program_id(0)
        kt = tl.program_id(1) * BK + tl.arange(0, BK)
        e = tl.program_id(2).to(tl.int64)
        rows = tl.load(tab + nt * 64 + tl.arange(0, 64))
        k = tl.program_id(1) * BK * 16 + tl.arange(0, BK * 16)
        x = load_rows(src, e, s_e, s_r, rows, k, K_in, 0)  # [64, BK*16]
        if ORDER == 0:
            x = tl.permute(tl.reshape(x, (4, 2, 8, BK, 2, 4, 2)), (3, 2, 5, 0, 1, 6, 4))
        else:
            x = tl.permute(tl.reshape(x, (8, 8, BK, 2, 4, 2)), (2, 1, 4, 0, 5, 3))
        x = tl.reshape(x, (BK, 1024))
        off = kt[:, None].to(tl.int64) * (16 * N) + nt * 1024 + tl.arange(0, 1024)[None, :]
        tl.store(dst + e * d_e + off, x, mask=(kt < KT_out)[:, None])

    @triton.jit
    def _humming_nibbles_kernel(src, dst, tab, KB_in, KT_out, N, s_e, s_r, d_e, BK: tl.constexpr):
        """Row block nt x BK k-tiles of 16 4-bit values (8 packed bytes a row): dst bytes kt*8N + nt*512 + i.
        Nibble k of a row is byte k // 2's low (even k) or high half; output byte 2*i6 + i4 of word
        16 ln + 4 lq + jj holds the values at n = 16 jj + 8 i4 + ln and k = 2 lq + i6 (low nibble), + 8 (high)."""
        nt = tl.program_id(0)
        kt = tl.program_id(1) * BK + tl.arange(0, BK)
        e = tl.program_id(2).to(tl.int64)
        rows = tl.load(tab + nt * 64 + tl.arange(0, 64))
        kb = tl.program_id(1) * BK * 8 + tl.arange(0, BK * 8)
        x = load_rows(src, e, s_e, s_r, rows, kb, KB_in, 0)  # [64, BK*8] packed bytes
        v = tl.reshape(tl.join(x & 0xF, x >> 4), (64, BK * 16))  # one nibble a lane, in k order
        # n = (jj, i4, ln), k = (r, i5, lq, i6) -> (r, ln, lq, jj, i6, i4, i5); i5 picks the output nibble
        v = tl.reshape(tl.permute(tl.reshape(v, (4, 2, 8, BK, 2, 4, 2)), (3, 2, 5, 0, 6, 1, 4)), (BK, 512, 2))
        low, high = tl.split(v)
        off = kt[:, None].to(tl.int64) * (8 * N) + nt * 512 + tl.arange(0, 512)[None, :]
        tl.store(dst + e * d_e + off, low | (high << 4), mask=(kt < KT_out)[:, None])


def _tile_stream(kernel: object, src: torch.Tensor, tab: torch.Tensor, K: int, bits: int, config: str, **constexprs: int) -> torch.Tensor:
    """What both launchers share: the checks, the output int32 [E, K/16, (bits/2) N] and one program per
    (64-row block, BK k-tiles, expert)."""
    E, width, N = kernel_dims(src, tab)
    K_in = width * 8 // bits
    if N % 64 or K % 16 or K_in > K:
        raise ValueError(f"{bits}-bit weight tiles need N % 64 == 0, K % 16 == 0 and K_in <= K (N={N}, K={K}, K_in={K_in})")
    out, src, tab = gather_operands(src, tab, (E, K // 16, 2 * bits * N))
    if out.numel() == 0:
        return out.view(torch.int32)
    cfg = KERNEL_CONFIG[config]
    grid = (N // 64, triton.cdiv(K // 16, cfg["BK"]), E)
    launch(kernel, grid, src, src, out, tab, width, K // 16, N, src.stride(0), src.stride(1), out.stride(0), **constexprs, **cfg)
    return out.view(torch.int32)


def byte_tile_stream(src: torch.Tensor, tab: torch.Tensor, K: int, order: TileOrder) -> torch.Tensor:
    """uint8 [E, N_in, K_in] (one 8-bit value a byte) -> int32 [E, K/16, 4N]: the N = len(tab) rows
    gathered through ``tab`` (-1: zeros), K zero-padded to ``K``, laid out in ``order``'s tiles.
    N % 64 == 0 and K % 16 == 0."""
    return _tile_stream(_byte_tiles_kernel, src, tab, K, 8, "byte_tiles", ORDER=order.value)


def humming_nibble_stream(src: torch.Tensor, tab: torch.Tensor, K: int) -> torch.Tensor:
    """uint8 [E, N_in, K_in/2] (two 4-bit values a byte, low nibble = even k) -> humming's int32 words
    [E, K/16, 2N] (:func:`mxconv.layouts.humming_bytemap.repack_weights`): the N = len(tab) rows gathered
    through ``tab`` (-1: zeros), K zero-padded to ``K``. N % 64 == 0 and K % 16 == 0."""
    return _tile_stream(_humming_nibbles_kernel, src, tab, K, 4, "nibble_tiles")


__all__ = ["TileOrder", "byte_tile_stream", "humming_nibble_stream"]
