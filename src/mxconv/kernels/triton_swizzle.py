"""Triton kernels of the ``triton`` backend: triton_kernels' Hopper MX value and scale layouts
(spec: docs/layout-triton.md §3-4), one launch per stored tensor.

The torch functions of ``mxconv.layouts.triton`` are the reference and the CPU path; these kernels
give the same bytes on CUDA in one pass: rows are read through a row table (padding and the gate/up
interleave cost nothing extra), loaded as coalesced tiles in source order, rearranged in registers
and stored contiguously in buffer order.

* :func:`hopper_values` - weights: row gather, value permutation and the bit twiddle.
* :func:`hopper_scales` - scales: row gather, column zero padding and the scale permutation.

``mxconv.layouts.triton`` calls them only for CUDA tensors, when triton imports and the caller's
``KernelChoice`` is AUTO (``KernelChoice.TORCH`` forces the torch path); with ``TRITON_INTERPRET=1``
they also run on CPU tensors (tests).
"""

from __future__ import annotations

import torch

from mxconv.kernels.triton_common import as_words, gather_operands, kernel_dims, launch
from mxconv.kernels.triton_import import tl, triton

# Launch shapes (powers of two): BR1 = 32-byte column blocks per value program, BK0 = scale
# column pairs per scale program.
KERNEL_CONFIG: dict[str, dict[str, int]] = {
    "hopper_values": {"BR1": 8, "num_warps": 4},
    "hopper_scales": {"BK0": 8, "num_warps": 4},
}

if triton is not None:
    from mxconv.kernels.marlin_triton import byte_transpose4

    @triton.jit
    def _twiddle(w):
        """Spec §3 bit twiddle of int32 words, as masked shifts grouped by distance (the groups of
        ``mxconv.layouts.triton.TWIDDLE_GROUPS``; masks apply after the shift)."""
        out = (w >> 16) & 0x7
        out |= (w >> 15) & 0xC00
        out |= (w >> 13) & 0x4000
        out |= (w >> 11) & 0x2000
        out |= (w >> 10) & 0x200
        out |= (w >> 5) & 0x38
        out |= (w >> 4) & 0x70000
        out |= (w >> 3) & 0xC000000
        out |= (w >> 1) & 0x40000000
        out |= (w << 1) & 0x20001000
        out |= (w << 2) & 0x2000000
        out |= (w << 6) & 0x1C0
        out |= (w << 7) & 0x380000
        out |= (w << 12) & 0x8000
        out |= (w << 13) & 0x10000000
        out |= (w << 18) & 0x1C00000
        out |= (w << 24) & -0x80000000  # bit 31
        return out

    @triton.jit
    def _hopper_value_kernel(src, dst, tab, U_in, Q_out, s_e, s_r, d_e, d_r, BR1: tl.constexpr):
        """One 16-row source block r0 x BR1 blocks of 32 bytes (r1).

        src: int32 words [E, R_in, Kb_in/4]; word u = 8 r1 + 2 a1 + w1 of source row n holds bytes
        32 r1 + 8 a1 + 4 w1 + t1 (t1 = byte in word). Kernel rows n = 16 r0 + 8 w0 + 2 t0 + s0 come
        from source rows tab[n]. dst: int32 words [E, Np/4, Kbp]; word q = 32 r1 + 16 s0 + 4 t1 + a1
        of row 4 r0 + t0 holds bytes (A, C, B, D) = (w0, w1) = (0,0), (1,0), (0,1), (1,1), twiddled.
        """
        r0 = tl.program_id(0)
        e = tl.program_id(2).to(tl.int64)
        ts = tl.arange(0, 8)  # 2 t0 + s0
        sr0 = tl.load(tab + r0 * 16 + ts)  # w0 = 0
        sr1 = tl.load(tab + r0 * 16 + 8 + ts)  # w0 = 1
        blk = tl.program_id(1) * BR1 * 8 + tl.arange(0, 4 * BR1) * 2  # 8 r1 + 2 a1
        u = blk[:, None] + tl.arange(0, 2)[None, :]  # [(r1, a1), w1]
        u_ok = (u < U_in)[None, :, :]
        base = src + e * s_e
        x0 = tl.load(base + sr0[:, None, None] * s_r + u[None, :, :], mask=(sr0 >= 0)[:, None, None] & u_ok, other=0)
        x1 = tl.load(base + sr1[:, None, None] * s_r + u[None, :, :], mask=(sr1 >= 0)[:, None, None] & u_ok, other=0)
        store_hopper_words(x0, x1, dst + e * d_e, r0, tl.program_id(1), Q_out, d_r, BR1)

    @triton.jit
    def store_hopper_words(x0, x1, dst, r0, p1, Q_out, d_r, BR1: tl.constexpr):
        """The value permutation, bit twiddle and contiguous store of the 16-row block r0 x column
        blocks [p1 BR1, p1 BR1 + BR1) (one program of :func:`_hopper_value_kernel`): x0 / x1 int32
        [8, 4 BR1, 2] are the source words [(t0, s0), (r1, a1), w1] of kernel rows w0 = 0 / 1;
        ``dst`` points at the expert's buffer (int32 words, rows d_r apart, Q_out words a row)."""
        a, b = tl.split(x0)  # [(t0, s0), (r1, a1)]: w0 = 0, w1 = 0 / 1
        c, d = tl.split(x1)  # w0 = 1
        o0, o1, o2, o3 = byte_transpose4(a, c, b, d)  # o_t1 = bytes t1 of (a, c, b, d)
        o0, o1, o2, o3 = _twiddle(o0), _twiddle(o1), _twiddle(o2), _twiddle(o3)
        words = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (4, 2, BR1, 4, 4))  # t0 s0 r1 a1 t1
        words = tl.reshape(tl.permute(words, (0, 2, 1, 4, 3)), (4, BR1 * 32))  # t0, (r1 s0 t1 a1)
        q = p1 * BR1 * 32 + tl.arange(0, BR1 * 32)
        off = (r0 * 4 + tl.arange(0, 4))[:, None] * d_r + q[None, :]
        tl.store(dst + off, words, mask=(q < Q_out)[None, :])

    @triton.jit
    def _hopper_scale_kernel(src, dst, tab, C_in, K0_out, s_e, s_r, d_e, d_r, W: tl.constexpr, BK0: tl.constexpr):
        """One run of 16 W rows (m0, i1) x BK0 column pairs k0.

        Source rows 32 W m0 + 16 W i1 + 16 w + 8 i3 + i4 come from tab; columns 2 k0 + k1 (zero
        beyond C_in). Byte goes to row W m0 + w, column 64 k0 + 32 i1 + 4 i4 + 2 k1 + i3.
        """
        m0 = tl.program_id(0) // 2
        i1 = tl.program_id(0) % 2
        e = tl.program_id(2).to(tl.int64)
        sr = tl.load(tab + m0 * 32 * W + i1 * 16 * W + tl.arange(0, 16 * W))  # (w, i3, i4)
        col = tl.program_id(1) * 2 * BK0 + tl.arange(0, 2 * BK0)  # (k0, k1)
        m = (sr >= 0)[:, None] & (col < C_in)[None, :]
        x = tl.load(src + e * s_e + sr[:, None] * s_r + col[None, :], mask=m, other=0)
        x = tl.reshape(x, (W, 2, 8, BK0, 2))  # w i3 i4 k0 k1
        x = tl.reshape(tl.permute(x, (0, 3, 2, 4, 1)), (W, BK0 * 32))  # w, (k0 i4 k1 i3)
        j = tl.arange(0, BK0 * 32)
        k0 = tl.program_id(1) * BK0 + j // 32
        off = (m0 * W + tl.arange(0, W))[:, None] * d_r + (k0 * 64 + i1 * 32 + j % 32)[None, :]
        tl.store(dst + e * d_e + off, x, mask=(k0 < K0_out)[None, :])


def hopper_values(src: torch.Tensor, tab: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """uint8 [E, R_in, Kb_in] -> value buffer uint8 [E, Np/4, 4*row_bytes] with Np = len(tab):
    kernel row n is source row tab[n] (-1 = zeros), bytes beyond Kb_in zero, then the value
    permutation and the bit twiddle. Np % 16 == 0, row_bytes % 32 == 0, Kb_in % 4 == 0."""
    E, kb_in, n = kernel_dims(src, tab)
    if n % 16 or row_bytes % 32 or kb_in % 4:
        raise ValueError(f"Hopper value layout needs rows % 16, bytes % 32 and source bytes % 4 == 0, got {n}, {row_bytes}, {kb_in}")
    out, src, tab = gather_operands(src, tab, (E, n // 4, 4 * row_bytes))
    if out.numel() == 0:
        return out
    s, d = as_words(src, torch.int32), out.view(torch.int32)
    cfg = KERNEL_CONFIG["hopper_values"]
    grid = (n // 16, triton.cdiv(row_bytes // 32, cfg["BR1"]), E)
    launch(
        _hopper_value_kernel, grid, src,
        s, d, tab, kb_in // 4, row_bytes, s.stride(0), s.stride(1), d.stride(0), d.stride(1), **cfg
    )
    return out


def hopper_scales(src: torch.Tensor, tab: torch.Tensor, cols: int, num_warps: int) -> torch.Tensor:
    """uint8 [E, R_in, C_in] -> scale buffer uint8 [E, Ns/32, 32*cols] with Ns = len(tab): kernel
    row n is source row tab[n] (-1 = zeros), columns beyond C_in zero, then the scale permutation
    for ``num_warps``. Ns % (32 * num_warps) == 0, cols even."""
    E, c_in, n = kernel_dims(src, tab)
    W = int(num_warps)
    if n % (32 * W) or cols % 2:
        raise ValueError(f"Hopper scale layout needs rows % {32 * W} == 0 and even columns, got [{n}, {cols}]")
    out, src, tab = gather_operands(src, tab, (E, n // 32, 32 * cols))
    if out.numel() == 0:
        return out
    cfg = KERNEL_CONFIG["hopper_scales"]
    grid = (2 * n // (32 * W), triton.cdiv(cols // 2, cfg["BK0"]), E)
    launch(
        _hopper_scale_kernel, grid, src,
        src, out, tab, c_in, cols // 2, src.stride(0), src.stride(1), out.stride(0), out.stride(1), W=W, **cfg
    )
    return out


__all__ = ["KERNEL_CONFIG", "hopper_scales", "hopper_values"]
