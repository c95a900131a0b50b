"""Triton kernels for the backend layouts (trtllm, marlin, aiter): one launch per kernel tensor.

The torch code in ``mxconv.layouts`` is the reference and the CPU path; these kernels produce the
same bytes on CUDA in a single pass over the data (padding fused in, no intermediate copies).
The layout modules call them only for CUDA tensors when :func:`layout_kernels_enabled` says so.

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
* :func:`w16_tiles` - AITER weights: 16x16-byte tiles of gathered rows.
* :func:`s32x8_tiles` - AITER scales: 32x8 scale tiles, two column fills (0 then 0x7F).

Set ``MXCONV_LAYOUT_TRITON=0`` to force the torch path on CUDA (benchmarks, bisecting).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

try:  # triton is optional at import time (CPU-only installs, macOS)
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = exc

ENV_SWITCH = "MXCONV_LAYOUT_TRITON"

# Launch shapes per kernel (block sizes are powers of two), picked by a sweep on an H100 at
# gpt-oss-120b sizes (E=128, H=I=2880).
KERNEL_CONFIG: dict[str, dict[str, int]] = {
    "gather_rows": {"BR": 32, "BW": 128, "num_warps": 8},
    "swizzle_128x4": {"BG": 8, "num_warps": 4},
    "marlin_bf16": {"BK": 64, "num_warps": 8},
    "marlin_fp8": {"BK": 16, "num_warps": 4},
    "transpose_rows": {"BN": 128, "BG": 16, "num_warps": 4},
    "w16_tiles": {"BC": 32, "num_warps": 4},
    "s32x8_tiles": {"BT": 8, "num_warps": 4},
}

@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    return _TRITON_IMPORT_ERROR is None


def layout_kernels_enabled(t: torch.Tensor) -> bool:
    """True when ``t`` is a CUDA tensor, triton imports, and ``MXCONV_LAYOUT_TRITON`` is not "0"."""
    if not t.is_cuda or not _triton_importable():
        return False
    return os.environ.get(ENV_SWITCH, "1").strip() not in ("0", "false", "no", "off")


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_runnable(t: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(f"triton is not importable: {_TRITON_IMPORT_ERROR}")
    if not t.is_cuda and not _interpreter_on():
        raise RuntimeError("the layout kernels need CUDA tensors (or TRITON_INTERPRET=1 for testing)")


def _words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (uint8, last dim contiguous) viewed as ``dtype`` words; copies only when misaligned."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(dtype)
    except RuntimeError:  # storage offset or a row stride not a whole number of words
        return t.contiguous().clone().view(dtype)


def _device_ctx(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _table(tab: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tab.dtype != torch.int32 or tab.device != device:
        tab = tab.to(device=device, dtype=torch.int32)
    return tab.contiguous()


if triton is not None:
    # 32-bit masks, written as signed int32 values (Triton and numpy keep int32 arithmetic in int32).
    _LO_NIBBLES = tl.constexpr(0x0F0F0F0F)
    _HI_NIBBLES = tl.constexpr(-0x0F0F0F10)  # 0xF0F0F0F0
    _EVEN_BYTES = tl.constexpr(0x00FF00FF)
    _ODD_BYTES = tl.constexpr(-0x00FF0100)  # 0xFF00FF00
    _LOW_HALF = tl.constexpr(0x0000FFFF)
    _HIGH_HALF = tl.constexpr(-0x00010000)  # 0xFFFF0000

    @triton.jit
    def _gather_rows_kernel(
        src, dst, tab, R_out, W_in, W_out, s_e, s_r, d_e, d_r, BR: tl.constexpr, BW: tl.constexpr
    ):
        """dst[e, r, w] = src[e, tab[r], w] (w < W_in, tab[r] >= 0) else 0; W in words."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        w = tl.program_id(1) * BW + tl.arange(0, BW)
        e = tl.program_id(2).to(tl.int64)
        r_ok = r < R_out
        s = tl.load(tab + r, mask=r_ok, other=-1)
        m = (s >= 0)[:, None] & (w < W_in)[None, :]
        x = tl.load(src + e * s_e + s[:, None] * s_r + w[None, :], mask=m, other=0)
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
        m = (s >= 0)[:, None] & (c < C_in)[None, :]
        x = tl.load(src + e * s_e + s[:, None] * s_r + c[None, :], mask=m, other=FILL)
        # [r%128//32, r%32, c//4, c%4] -> [c//4, r%32, r%128//32, c%4]
        x = tl.reshape(x, (4, 32, BG, 4))
        x = tl.permute(x, (2, 1, 0, 3))
        x = tl.reshape(x, (BG, 512))
        g = pg * BG + tl.arange(0, BG)
        off = (rt * G_out + g)[:, None] * 512 + tl.arange(0, 512)[None, :]
        tl.store(dst + e * d_e + off, x, mask=(g < G_out)[:, None])

    @triton.jit
    def _byte_transpose4(p, q, r, s):
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
        o0, o1, o2, o3 = _byte_transpose4(p, q, r, s)
        # join twice: [..., a, b] = o_(2a+b), i.e. [w, thc, kt, thr]
        words = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (4, 8, BK, 4))
        words = tl.permute(words, (2, 1, 3, 0))  # [kt, thc, thr, w]
        words = tl.reshape(words, (BK, 128))
        off = kt[:, None] * (2 * N) + nt * 128 + tl.arange(0, 128)[None, :]
        tl.store(dst + e * d_e + off, words, mask=(kt < KT_out)[:, None])

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
        # join twice: [..., a, b] = o_(2a+b), i.e. [w, thc, kt, thr]
        words = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (4, 8, BK, 4))
        words = tl.permute(words, (2, 1, 3, 0))  # [kt, thc, thr, w]
        words = tl.reshape(words, (BK, 128))
        off = kt[:, None] * (4 * N) + nt * 128 + tl.arange(0, 128)[None, :]
        tl.store(dst + e * d_e + off, words, mask=(kt < KT_out)[:, None])

    @triton.jit
    def _transpose_rows_kernel(
        src, dst, tab, N, G_in, G_out, s_e, s_r, d_e, OFFSET: tl.constexpr, BN: tl.constexpr, BG: tl.constexpr
    ):
        """dst[e, g, n] = (src[e, tab[n], g] if tab[n] >= 0 and g < G_in else 0) + OFFSET (bytes)."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        g = tl.program_id(1) * BG + tl.arange(0, BG)
        e = tl.program_id(2).to(tl.int64)
        n_ok = n < N
        s = tl.load(tab + n, mask=n_ok, other=-1)
        m = (s >= 0)[:, None] & (g < G_in)[None, :]
        x = tl.load(src + e * s_e + s[:, None] * s_r + g[None, :], mask=m, other=0)
        if OFFSET != 0:
            x = (x + OFFSET).to(tl.uint8)
        x = tl.trans(x)  # [g, n]
        tl.store(dst + e * d_e + g[:, None] * N + n[None, :], x, mask=(g < G_out)[:, None] & n_ok[None, :])

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
        m = (s >= 0)[:, None] & (c < C_in)[None, :]
        x = tl.load(src + e * s_e + s[:, None] * s_r + c[None, :], mask=m, other=0)
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
    _check_runnable(src)
    E, _, C_in = src.shape
    R_out = int(tab.numel())
    out = torch.empty((E, R_out, cols_out), dtype=torch.uint8, device=src.device)
    if out.numel() == 0:
        return out
    if C_in % 8 or cols_out % 8:
        raise ValueError(f"gather_rows needs byte widths that are multiples of 8, got {C_in} -> {cols_out}")
    s, d = _words(src, torch.int64), out.view(torch.int64)
    tab = _table(tab, src.device)
    cfg = KERNEL_CONFIG["gather_rows"]
    grid = (triton.cdiv(R_out, cfg["BR"]), triton.cdiv(cols_out // 8, cfg["BW"]), E)
    with _device_ctx(src):
        _gather_rows_kernel[grid](
            s, d, tab, R_out, C_in // 8, cols_out // 8, s.stride(0), s.stride(1), d.stride(0), d.stride(1), **cfg
        )
    return out


def swizzle_128x4(src: torch.Tensor, tab: torch.Tensor, cols_out: int, fill: int = 0) -> torch.Tensor:
    """uint8 [E, R_in, C_in] -> [E, len(tab) * cols_out]: rows gathered through ``tab``, columns
    padded to ``cols_out`` with ``fill``, each expert's matrix in 128x4 swizzled order.
    len(tab) % 128 == 0 and cols_out % 4 == 0."""
    _check_runnable(src)
    E, _, C_in = src.shape
    R_out = int(tab.numel())
    if R_out % 128 or cols_out % 4:
        raise ValueError(f"128x4 swizzle needs rows % 128 == 0 and columns % 4 == 0, got [{R_out}, {cols_out}]")
    out = torch.empty((E, R_out * cols_out), dtype=torch.uint8, device=src.device)
    if out.numel() == 0:
        return out
    if src.stride(-1) != 1:
        src = src.contiguous()
    tab = _table(tab, src.device)
    cfg = KERNEL_CONFIG["swizzle_128x4"]
    groups = cols_out // 4
    grid = (R_out // 128, triton.cdiv(groups, cfg["BG"]), E)
    with _device_ctx(src):
        _swizzle128x4_kernel[grid](
            src, out, tab, C_in, groups, src.stride(0), src.stride(1), out.stride(0), FILL=int(fill), **cfg
        )
    return out


def marlin_weights(src: torch.Tensor, tab: torch.Tensor, K: int, activation: str) -> torch.Tensor:
    """uint8 [E, N_in, K_in/2] -> Marlin int32 [E, K/16, 2N] with N = len(tab) rows gathered through
    ``tab`` and the K axis zero-padded to ``K``. bf16: N % 64, K % 16; fp8: N % 32, K % 32
    (and K_in likewise)."""
    _check_runnable(src)
    E, _, half_k_in = src.shape
    K_in = 2 * half_k_in
    N = int(tab.numel())
    kt_size = 16 if activation == "bf16" else 32
    n_tile = 64 if activation == "bf16" else 32
    if activation not in ("bf16", "fp8"):
        raise ValueError(f"unknown Marlin activation {activation!r}")
    if N % n_tile or K % kt_size or K_in % kt_size:
        raise ValueError(f"Marlin {activation} tiles need N % {n_tile} == 0 and K % {kt_size} == 0")
    out = torch.empty((E, K // 16, 2 * N), dtype=torch.int32, device=src.device)
    if out.numel() == 0:
        return out
    s = _words(src, torch.int32)
    tab = _table(tab, src.device)
    cfg = KERNEL_CONFIG[f"marlin_{activation}"]
    kt_in, kt_out = K_in // kt_size, K // kt_size
    grid = (N // n_tile, triton.cdiv(kt_out, cfg["BK"]), E)
    kernel = _marlin_bf16_kernel if activation == "bf16" else _marlin_fp8_kernel
    with _device_ctx(src):
        kernel[grid](s, out, tab, kt_in, kt_out, N, s.stride(0), s.stride(1), out.stride(0), **cfg)
    return out


def transpose_rows(src: torch.Tensor, tab: torch.Tensor, rows_out: int, offset: int = 0) -> torch.Tensor:
    """uint8 [E, R_in, G_in] -> [E, rows_out, len(tab)]: out[e, g, n] = src[e, tab[n], g] (0 for
    padding rows/columns) plus ``offset`` (mod 256)."""
    _check_runnable(src)
    E, _, G_in = src.shape
    N = int(tab.numel())
    out = torch.empty((E, rows_out, N), dtype=torch.uint8, device=src.device)
    if out.numel() == 0:
        return out
    if src.stride(-1) != 1:
        src = src.contiguous()
    tab = _table(tab, src.device)
    cfg = KERNEL_CONFIG["transpose_rows"]
    grid = (triton.cdiv(N, cfg["BN"]), triton.cdiv(rows_out, cfg["BG"]), E)
    with _device_ctx(src):
        _transpose_rows_kernel[grid](
            src, out, tab, N, G_in, rows_out, src.stride(0), src.stride(1), out.stride(0),
            OFFSET=int(offset) % 256, **cfg,
        )  # fmt: skip
    return out


def w16_tiles(src: torch.Tensor, tab: torch.Tensor, cols_out: int) -> torch.Tensor:
    """uint8 [E, R_in, B_in] -> [E, len(tab), cols_out] in AITER's W16 order (16x16-byte tiles,
    row-block-major) of the rows gathered through ``tab`` (zero padding). len(tab) % 16 == 0,
    B_in and cols_out multiples of 16."""
    _check_runnable(src)
    E, _, B_in = src.shape
    R_out = int(tab.numel())
    if R_out % 16 or B_in % 16 or cols_out % 16:
        raise ValueError(f"W16 needs rows and byte widths that are multiples of 16, got {R_out}, {B_in}, {cols_out}")
    out = torch.empty((E, R_out, cols_out), dtype=torch.uint8, device=src.device)
    if out.numel() == 0:
        return out
    s, d = _words(src, torch.int64), out.view(torch.int64)
    tab = _table(tab, src.device)
    cfg = KERNEL_CONFIG["w16_tiles"]
    cb_out = cols_out // 16
    grid = (R_out // 16, triton.cdiv(cb_out, cfg["BC"]), E)
    with _device_ctx(src):
        _w16_kernel[grid](s, d, tab, B_in // 16, cb_out, s.stride(0), s.stride(1), d.stride(0), **cfg)
    return out


def s32x8_tiles(src: torch.Tensor, tab: torch.Tensor, zero_cols: int, cols_out: int, pad: int) -> torch.Tensor:
    """uint8 [E, R_in, C_in] -> [E, len(tab), cols_out] in AITER's S32x8 order. Source columns
    c < C_in of gathered rows keep their bytes, other columns below ``zero_cols`` are 0 (as are
    padding rows there), columns from ``zero_cols`` on are ``pad``. len(tab) % 32 == 0,
    cols_out % 8 == 0."""
    _check_runnable(src)
    E, _, C_in = src.shape
    R_out = int(tab.numel())
    if R_out % 32 or cols_out % 8:
        raise ValueError(f"S32x8 needs rows % 32 == 0 and columns % 8 == 0, got [{R_out}, {cols_out}]")
    out = torch.empty((E, R_out, cols_out), dtype=torch.uint8, device=src.device)
    if out.numel() == 0:
        return out
    if src.stride(-1) != 1:
        src = src.contiguous()
    tab = _table(tab, src.device)
    cfg = KERNEL_CONFIG["s32x8_tiles"]
    tiles = cols_out // 8
    grid = (R_out // 32, triton.cdiv(tiles, cfg["BT"]), E)
    with _device_ctx(src):
        _s32x8_kernel[grid](
            src, out, tab, C_in, zero_cols, tiles, src.stride(0), src.stride(1), out.stride(0), PAD=int(pad), **cfg
        )
    return out


__all__ = [
    "ENV_SWITCH",
    "KERNEL_CONFIG",
    "gather_rows",
    "layout_kernels_enabled",
    "marlin_weights",
    "s32x8_tiles",
    "swizzle_128x4",
    "transpose_rows",
    "w16_tiles",
]
