"""Triton kernels of the Marlin layout (docs/layout-marlin.md), one launch per kernel tensor:

* :func:`marlin_weights` - the int32 tile stream (bf16: 16x64 tiles, fp8: 32x32 tiles) built
  straight from packed bytes with nibble masks and a 4x4 byte transpose (no unpack to codes);
* :func:`transpose_rows` - scales: ``out[g, n] = src[tab[n], g] + offset``.

Same contract as :mod:`mxconv.kernels.trtllm_aiter` (which re-exports both): rows of the unpadded
canonical stack read through a row table, padding fused in, the same bytes as the torch path.
"""

from __future__ import annotations

import torch

from mxconv.kernels.triton_common import KERNEL_CONFIG, as_words, gather_operands, kernel_dims, launch
from mxconv.kernels.triton_import import tl, triton

if triton is not None:
    from mxconv.kernels.triton_common import load_rows

    # 32-bit masks, written as signed int32 values (Triton and numpy keep int32 arithmetic in int32).
    _LO_NIBBLES = tl.constexpr(0x0F0F0F0F)
    _HI_NIBBLES = tl.constexpr(-0x0F0F0F10)  # 0xF0F0F0F0
    _EVEN_BYTES = tl.constexpr(0x00FF00FF)
    _ODD_BYTES = tl.constexpr(-0x00FF0100)  # 0xFF00FF00
    _LOW_HALF = tl.constexpr(0x0000FFFF)
    _HIGH_HALF = tl.constexpr(-0x00010000)  # 0xFFFF0000

    @triton.jit
    def byte_transpose4(p, q, r, s):
        """4x4 byte transpose of int32 words: returns (o0, o1, o2, o3), byte k of o_t = byte t of
        the k-th argument."""
        t0 = (p & _EVEN_BYTES) | ((q << 8) & _ODD_BYTES)  # p0 q0 p2 q2
        t1 = ((p >> 8) & _EVEN_BYTES) | (q & _ODD_BYTES)  # p1 q1 p3 q3
        t2 = (r & _EVEN_BYTES) | ((s << 8) & _ODD_BYTES)  # r0 s0 r2 s2
        t3 = ((r >> 8) & _EVEN_BYTES) | (s & _ODD_BYTES)  # r1 s1 r3 s3
        o0 = (t0 & _LOW_HALF) | (t2 << 16)
        o1 = (t1 & _LOW_HALF) | (t3 << 16)
        o2 = ((t0 >> 16) & _LOW_HALF) | (t2 & _HIGH_HALF)
        o3 = ((t1 >> 16) & _LOW_HALF) | (t3 & _HIGH_HALF)
        return o0, o1, o2, o3

    @triton.jit
    def _store_stream(out, o0, o1, o2, o3, kt, nt, row_words, KT_out, BK: tl.constexpr):
        """Store the tile's output words o_thr [w, thc, kt] (thr = 0..3) as words
        ``kt*row_words + nt*128 + thc*16 + thr*4 + w`` of one expert's stream ``out``."""
        # join twice: [..., a, b] = o_(2a+b), i.e. [w, thc, kt, thr]
        words = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (4, 8, BK, 4))
        words = tl.permute(words, (2, 1, 3, 0))  # [kt, thc, thr, w]
        words = tl.reshape(words, (BK, 128))
        off = kt[:, None] * row_words + nt * 128 + tl.arange(0, 128)[None, :]
        tl.store(out + off, words, mask=(kt < KT_out)[:, None])

    @triton.jit
    def _marlin_bf16_kernel(src, dst, tab, KT_in, KT_out, N, s_e, s_r, d_e, BK: tl.constexpr):
        """One 64-row tile nt x BK k-tiles of 16 (bf16 activations, 16x64 weight tiles).

        src: int32 words [E, N_in, K_in/8] (word 2kt+j0 of a row holds bytes kt*8 + 4*j0 + thr,
        thr = 0..3). Rows n = nt*64 + w*16 + j1*8 + thc. Output word kt*2N + nt*128 + thc*16 +
        thr*4 + w has bytes (A.lo|B.lo<<4, C.lo|D.lo<<4, A.hi|B.hi<<4, C.hi|D.hi<<4) with
        A/B = byte thr of words (2kt, 2kt+1) of row j1=0 and C/D the same of row j1=1.
        """
        nt = tl.program_id(0)
        kt = tl.program_id(1) * BK + tl.arange(0, BK)
        e = tl.program_id(2).to(tl.int64)
        n0 = nt * 64 + tl.arange(0, 4)[:, None] * 16 + tl.arange(0, 8)[None, :]  # [w, thc], j1 = 0
        s0 = tl.load(tab + n0)
        s1 = tl.load(tab + n0 + 8)
        col = (2 * kt)[:, None] + tl.arange(0, 2)[None, :]  # [kt, j0]
        k_ok = (kt < KT_in)[:, None] & (col >= 0)
        base = src + e * s_e
        x0 = tl.load(
            base + s0[:, :, None, None] * s_r + col[None, None, :, :],
            mask=(s0 >= 0)[:, :, None, None] & k_ok[None, None, :, :],
            other=0,
        )
        x1 = tl.load(
            base + s1[:, :, None, None] * s_r + col[None, None, :, :],
            mask=(s1 >= 0)[:, :, None, None] & k_ok[None, None, :, :],
            other=0,
        )
        a, b = tl.split(x0)  # [w, thc, kt]: bytes A (j0 = 0), B (j0 = 1)
        c, d = tl.split(x1)
        p = (a & _LO_NIBBLES) | ((b << 4) & _HI_NIBBLES)  # A.lo | B.lo << 4
        q = (c & _LO_NIBBLES) | ((d << 4) & _HI_NIBBLES)  # C.lo | D.lo << 4
        r = ((a >> 4) & _LO_NIBBLES) | (b & _HI_NIBBLES)  # A.hi | B.hi << 4
        s = ((c >> 4) & _LO_NIBBLES) | (d & _HI_NIBBLES)  # C.hi | D.hi << 4
        o0, o1, o2, o3 = byte_transpose4(p, q, r, s)
        _store_stream(dst + e * d_e, o0, o1, o2, o3, kt, nt, 2 * N, KT_out, BK)

    @triton.jit
    def _marlin_fp8_kernel(src, dst, tab, KT_in, KT_out, N, s_e, s_r, d_e, BK: tl.constexpr):
        """One 32-row tile nt x BK k-tiles of 32 (fp8 activations, 32x32 weight tiles).

        src: int32 words [E, N_in, K_in/8] (words 4kt..4kt+3 of a row = bytes kt*16 .. +15).
        Rows n = nt*32 + w*8 + thc. Output word kt*4N + nt*128 + thc*16 + thr*4 + w has bytes
        (A.lo|B.lo<<4, A.hi|B.hi<<4, C.lo|D.lo<<4, C.hi|D.hi<<4), A = byte 2thr, C = byte 2thr+1,
        B = byte 8+2thr, D = byte 9+2thr of the 16-byte chunk kt.
        """
        nt = tl.program_id(0)
        kt = tl.program_id(1) * BK + tl.arange(0, BK)
        e = tl.program_id(2).to(tl.int64)
        n = nt * 32 + tl.arange(0, 4)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [w, thc]
        sr = tl.load(tab + n)
        col = (4 * kt)[:, None, None] + 2 * tl.arange(0, 2)[None, :, None] + tl.arange(0, 2)[None, None, :]
        k_ok = (kt < KT_in)[:, None, None] & (col >= 0)  # [kt, u, v]: word 4kt + 2u + v
        x = tl.load(
            src + e * s_e + sr[:, :, None, None, None] * s_r + col[None, None, :, :, :],
            mask=(sr >= 0)[:, :, None, None, None] & k_ok[None, None, :, :, :],
            other=0,
        )
        even, odd = tl.split(x)  # [w, thc, kt, u]: words (0, 2) and (1, 3)
        z0, z2 = tl.split(even)
        z1, z3 = tl.split(odd)
        # per word pair (low bytes, high bytes) -> L (lo nibbles) and H (hi nibbles) words whose
        # byte 2t' / 2t'+1 belong to thr = 2*(word index) + t'
        l01 = (z0 & _LO_NIBBLES) | ((z2 << 4) & _HI_NIBBLES)
        h01 = ((z0 >> 4) & _LO_NIBBLES) | (z2 & _HI_NIBBLES)
        l23 = (z1 & _LO_NIBBLES) | ((z3 << 4) & _HI_NIBBLES)
        h23 = ((z1 >> 4) & _LO_NIBBLES) | (z3 & _HI_NIBBLES)
        # interleave bytes: out bytes (L.b0, H.b0, L.b1, H.b1) for thr even, (L.b2, H.b2, L.b3, H.b3) odd
        e0 = (l01 & _EVEN_BYTES) | ((h01 << 8) & _ODD_BYTES)  # L0 H0 L2 H2
        f0 = ((l01 >> 8) & _EVEN_BYTES) | (h01 & _ODD_BYTES)  # L1 H1 L3 H3
        e1 = (l23 & _EVEN_BYTES) | ((h23 << 8) & _ODD_BYTES)
        f1 = ((l23 >> 8) & _EVEN_BYTES) | (h23 & _ODD_BYTES)
        o0 = (e0 & _LOW_HALF) | (f0 << 16)  # L0 H0 L1 H1
        o1 = ((e0 >> 16) & _LOW_HALF) | (f0 & _HIGH_HALF)  # L2 H2 L3 H3
        o2 = (e1 & _LOW_HALF) | (f1 << 16)
        o3 = ((e1 >> 16) & _LOW_HALF) | (f1 & _HIGH_HALF)
        _store_stream(dst + e * d_e, o0, o1, o2, o3, kt, nt, 4 * N, KT_out, BK)

    @triton.jit
    def _transpose_rows_kernel(
        src, dst, tab, N, G_in, G_out, s_e, s_r, d_e, OFFSET: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr
    ):
        """dst[e, g, n] = (src[e, tab[n], g] if tab[n] >= 0 and g < G_in else 0) + OFFSET (bytes)."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        g = tl.program_id(1) * BG + tl.arange(0, BG)
        e = tl.program_id(2).to(tl.int64)
        n_ok = n < N
        x = load_rows(src, e, s_e, s_r, tl.load(tab + n, mask=n_ok, other=-1), g, G_in, 0)
        if OFFSET != 0:
            x = (x + OFFSET).to(tl.uint8)
        x = tl.trans(x)  # [g, n]
        tl.store(dst + e * d_e + g[:, None] * N + n[None, :], x, mask=(g < G_out)[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Launchers. ``src`` is the unpadded canonical stack [E, R_in, W_in] (uint8, last dim contiguous);
# ``tab`` the int32 row table (any integer dtype/device is accepted and converted).
# ---------------------------------------------------------------------------------------------


def marlin_weights(src: torch.Tensor, tab: torch.Tensor, K: int, activation: str) -> torch.Tensor:
    """uint8 [E, N_in, K_in/2] -> Marlin int32 [E, K/16, 2N] with N = len(tab) rows gathered through
    ``tab`` and the K axis zero-padded to ``K``. bf16: N % 64, K % 16; fp8: N % 32, K % 32
    (and K_in likewise)."""
    E, half_k_in, N = kernel_dims(src, tab)
    K_in = 2 * half_k_in
    kt_size = 16 if activation == "bf16" else 32
    n_tile = 64 if activation == "bf16" else 32
    if activation not in ("bf16", "fp8"):
        raise ValueError(f"unknown Marlin activation {activation!r}")
    if N % n_tile or K % kt_size or K_in % kt_size:
        raise ValueError(f"Marlin {activation} tiles need N % {n_tile} == 0 and K % {kt_size} == 0")
    out, src, tab = gather_operands(src, tab, (E, K // 16, 2 * N), torch.int32)
    if out.numel() == 0:
        return out
    s = as_words(src, torch.int32)
    cfg = KERNEL_CONFIG[f"marlin_{activation}"]
    kt_in, kt_out = K_in // kt_size, K // kt_size
    grid = (N // n_tile, triton.cdiv(kt_out, cfg["BK"]), E)
    kernel = _marlin_bf16_kernel if activation == "bf16" else _marlin_fp8_kernel
    launch(kernel, grid, src, s, out, tab, kt_in, kt_out, N, s.stride(0), s.stride(1), out.stride(0), **cfg)
    return out


def transpose_rows(src: torch.Tensor, tab: torch.Tensor, rows_out: int, offset: int = 0) -> torch.Tensor:
    """uint8 [E, R_in, G_in] -> [E, rows_out, len(tab)]: out[e, g, n] = src[e, tab[n], g] (0 for
    padding rows/columns) plus ``offset`` (mod 256)."""
    E, G_in, N = kernel_dims(src, tab)
    out, src, tab = gather_operands(src, tab, (E, rows_out, N))
    if out.numel() == 0:
        return out
    cfg = KERNEL_CONFIG["transpose_rows"]
    grid = (triton.cdiv(N, cfg["BN"]), triton.cdiv(rows_out, cfg["BG"]), E)
    launch(
        _transpose_rows_kernel, grid, src,
        src, out, tab, N, G_in, rows_out, src.stride(0), src.stride(1), out.stride(0),
        OFFSET=int(offset) % 256, **cfg,
    )
    return out


__all__ = ["marlin_weights", "transpose_rows"]
