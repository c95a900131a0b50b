"""One Triton kernel from float experts to the ``triton`` backend's Hopper MXFP4 value buffer:
the MXFP4 quantizer of :mod:`mxconv.kernels.mx_triton` and the value gather of
:func:`mxconv.kernels.triton_swizzle.hopper_values` in a single pass (docs/layout-triton.md §3).

Unfused, the packed bytes are written by the quantizer and then read and written again by the
gather; here they never exist. A stored word (before the twiddle: bytes j = w0 + 2 w1) takes
source bytes κ + 4 w1 of kernel rows ρ + 8 w0, i.e. element pairs κ and κ + 4 of one 32-element
block in two rows. So a program loads its blocks as four tiles [blocks, 8] of the same shape, one
per (w0, w1): column 4 a1l + t1 is pair 8 a1l + 4 w1 + t1 of the block. The threads that hold a
pair in one tile hold its three word partners in the others, a block's amax is a max over two
tiles, and each pair's two E2M1 codes and signs go straight to their twiddled bits (spec §3's
nibble table for byte j, a constant of the tile), ORed across the four tiles: no byte is packed,
no tile is permuted or exchanged between threads (the compiler keeps the memory order: a thread
loads 4 consecutive pairs; only the finished words change layout for the store). A program's
source rows are looked up once, before its column loop.

bf16 on an sm_90 or later GPU takes the bf16x2 path of :mod:`mxconv.kernels.bf16x2`: both halves
of a pair word are scaled, rounded and coded by packed bf16x2 and u16x2 instructions (inline PTX),
and a block's max is a u16x2 max of the words; fp16/fp32, older GPUs and the interpreter take the
fp32 path of the plain quantizer. Counted offline (scripts/count_fused_sass.py: ptxas for sm_90,
Triton 3.6): the column loop is 360 instructions for a thread's 16 pairs (22.5 a pair; the fp32
path about 34), and w13 of gpt-oss-120b runs as fast as the plain quantizer (docs/benchmarks.md).

The bytes are those of ``quantize_mx_triton`` followed by ``hopper_values`` with the same row
table (padding rows and bytes zero). The E8M0 scales go straight to their places in the Hopper
scale buffer (``hopper_scales``' layout, 1/16 of the bytes; a zeroed buffer, so padding stays 0),
and a NaN/Inf sets the int32 flag as the quantizer's FLAG does (the bytes of such blocks are then
undefined: the caller takes the general path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxconv.errors import BadInput
from mxconv.kernels.bf16x2 import bf16x2_path
from mxconv.kernels.triton_common import as_words, gather_operands, kernel_dims, launch
from mxconv.kernels.triton_import import tl, triton
from mxconv.mx.formats import (
    FORMAT_PARAMS,
    SCALE_MODE_IDS,
    SUBNORMAL_FIX_MAX_BYTE,
    check_args,
)

# Launch shape: a program does BR0 16-row blocks x BR1 32-byte column blocks of the value buffer
# (2 BR1 blocks of 32 elements a row) per loop step, ITERS steps; maxnreg (0: none): ptxas' register
# cap. Swept on an H200 (w13 of gpt-oss-120b, bf16x2 path; scripts/bench_fused_triton.py --sweep):
# BR0/BR1/warps 1/2/2, 5 steps, uncapped 1.49 ms (the plain quantizer: 1.50); 1/1/1, 1 step 1.53;
# 1/1/1, 9 steps, 64 registers 1.59 (the fp32-path kernel's best shape: 1.70 then); 2/1/2 and 4/1/4,
# 5 steps 1.58 / 1.60; caps of 48, 40 and 32 registers slower (1.66-4.25).
KERNEL_CONFIG: dict[str, int] = {"BR0": 1, "BR1": 2, "ITERS": 5, "maxnreg": 0, "num_warps": 2}

_INPUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # mx_triton's INPUT_KIND

if triton is not None:
    from mxconv.kernels.bf16x2 import bf16_pair_codes, bf16_pair_max
    from mxconv.kernels.mx_triton import (
        fp4_magnitudes,
        scale_byte,
        scaled_elements,
        split_pairs,
    )

    @triton.jit
    def _abs_max(w, INPUT_KIND: tl.constexpr, PACKED: tl.constexpr):
        """Per tile row: the max |x| of its elements as fp32 bits, and an integer max of |x|'s bits
        (>= 0x7F800000 iff a NaN or an Inf; float max drops NaN). bf16: both from one integer max
        (bf16 bits order as their values; subnormals are not flushed, which gives the same byte)."""
        if PACKED:
            m = bf16_pair_max(w & 0x7FFF7FFF)
            return m, m
        if INPUT_KIND == 1:
            m = tl.maximum(tl.max(w & 0x7FFF0000, axis=1), tl.max(w & 0x7FFF, axis=1) << 16)
            return m, m
        xe, xo = split_pairs(w, INPUT_KIND)
        mag = tl.max(tl.maximum(xe & 0x7FFFFFFF, xo & 0x7FFFFFFF), axis=1)
        amax = tl.max(tl.maximum(tl.abs(xe.to(tl.float32, bitcast=True)), tl.abs(xo.to(tl.float32, bitcast=True))), axis=1)
        return amax.to(tl.int32, bitcast=True), mag

    @triton.jit
    def _placed(w, byte, need_fix, J: tl.constexpr, INPUT_KIND: tl.constexpr, MODE: tl.constexpr,
                FIX_MAX_BYTE: tl.constexpr, PACKED: tl.constexpr):  # fmt: skip
        """The bits the pairs ``w`` (scale ``byte`` a row) give their stored words as byte J (spec §3's
        twiddle: low nibble -> low 16 bits, high nibble -> the same + 16). PACKED (bf16, compiled):
        both codes of a pair from bf16x2 instructions."""
        if PACKED:
            m = bf16_pair_codes(w & 0x7FFF7FFF, byte, MODE != 0)
        else:
            xe, xo = split_pairs(w, INPUT_KIND)
            ye = scaled_elements(xe, byte, need_fix, FIX_MAX_BYTE)
            me, mo = fp4_magnitudes(ye, scaled_elements(xo, byte, need_fix, FIX_MAX_BYTE), MODE)
            m = me | (mo << 16)  # (m, e0, e1) at bits 0-2 and 16-18
        if INPUT_KIND == 0:
            s = ((xe >> 16) & 0x8000) | (xo & -2147483648)  # signs at bits 15 and 31
        else:
            s = w & -2147450880  # 0x80008000
        if J == 0:
            return (m << 6) | s
        elif J == 1:
            return (m << 3) | ((s >> 3) & 0x10001000)
        elif J == 2:
            return m | ((s >> 6) & 0x02000200)
        else:
            return ((m & 0x10001) << 13) | ((m & 0x60006) << 9) | ((s >> 1) & 0x40004000)

    @triton.jit
    def _tiles(src, sr, e, j, C_in, s_e, s_r):
        """The two tiles (w1 = 0, 1) of blocks j of source rows sr ([B]; -1: none): int32 [B, 8] each,
        zeros where sr is -1 or j >= C_in."""
        ok = (sr >= 0) & (j < C_in)
        k = tl.arange(0, 8)
        offs = (sr * s_r + j * 16)[:, None] + (8 * (k // 4) + k % 4)[None, :]
        base = src + e * s_e
        wa = tl.load(base + offs, mask=ok[:, None], other=0, eviction_policy="evict_first")
        wb = tl.load(base + offs + 4, mask=ok[:, None], other=0, eviction_policy="evict_first")
        return wa, wb

    @triton.jit
    def _rows(wa, wb, sr, scale, flag, e, r0, ts, j, C_in, c_e, c_r, NS32,
              W0: tl.constexpr, INPUT_KIND: tl.constexpr, MODE: tl.constexpr, EMAX: tl.constexpr,
              RCEIL_MANT_T: tl.constexpr, RCEIL_MIN_BITS: tl.constexpr, EVEN_ADD: tl.constexpr,
              FIX_MAX_BYTE: tl.constexpr, PACKED: tl.constexpr, SW: tl.constexpr):  # fmt: skip
        """The tiles of :func:`_tiles` (kernel rows n = 16 r0 + 8 W0 + ts): quantized, scales and flag
        stored, and the bits of bytes W0 and W0 + 2 returned ORed (int32 [B, 8]). The scale of row n,
        block j goes where ``hopper_scales`` puts it (SW warps): n = 32 SW m0 + 16 SW i1 + 16 w + 8 i3
        + i4, j = 2 k0 + k1 -> row SW m0 + w, column 64 k0 + 32 i1 + 4 i4 + 2 k1 + i3 (rows < NS32)."""
        ok = (sr >= 0) & (j < C_in)
        amax_a, mag_a = _abs_max(wa, INPUT_KIND, PACKED)
        amax_b, mag_b = _abs_max(wb, INPUT_KIND, PACKED)
        byte = scale_byte(tl.maximum(amax_a, amax_b), MODE, EMAX, RCEIL_MANT_T, RCEIL_MIN_BITS, EVEN_ADD)
        tl.store(flag + j * 0, 1, mask=ok & (tl.maximum(mag_a, mag_b) >= 0x7F800000))  # no cross-warp reduction
        s_row = SW * (r0 // (2 * SW)) + r0 % SW
        s_col = 64 * (j // 2) + 32 * ((r0 // SW) % 2) + 4 * ts + 2 * (j % 2) + W0
        tl.store(scale + e * c_e + s_row * c_r + s_col, byte.to(tl.uint8), mask=ok & (s_row < NS32))
        if PACKED:  # bf16x2 arithmetic keeps subnormals: no rebuild
            need_fix = False
        else:
            need_fix = tl.min(tl.where(ok, byte, 255)) <= FIX_MAX_BYTE
        bits = _placed(wa, byte, need_fix, W0, INPUT_KIND, MODE, FIX_MAX_BYTE, PACKED)
        return bits | _placed(wb, byte, need_fix, W0 + 2, INPUT_KIND, MODE, FIX_MAX_BYTE, PACKED)

    @triton.jit
    def _fused_value_kernel(
        src, dst, scale, flag, tab, C_in, Q_out, N16, NS32, s_e, s_r, d_e, d_r, c_e, c_r,
        INPUT_KIND: tl.constexpr, MODE: tl.constexpr, EMAX: tl.constexpr, RCEIL_MANT_T: tl.constexpr,
        RCEIL_MIN_BITS: tl.constexpr, EVEN_ADD: tl.constexpr, FIX_MAX_BYTE: tl.constexpr, PACKED: tl.constexpr,
        SW: tl.constexpr, BR0: tl.constexpr, BR1: tl.constexpr, ITERS: tl.constexpr,
    ):  # fmt: skip
        """Kernel rows 16 r0 + 8 w0 + 2 t0 + s0 (source rows tab[...], -1 = zeros) x 32-byte column
        blocks r1: r0 in [BR0 pid1, + BR0); r1 in [BR1 p1, + BR1) for p1 in [ITERS pid0, + ITERS), one
        loop step each (masked at N16, Q_out / 32). A step loads its four tiles before its first store
        (a store between them would keep the later loads from being issued early: the pointers may
        alias).

        src: element-pairs words [E, R_in, K/2] (int32 for 16-bit floats, int64 for fp32); pair
        32 r1 + 8 a1 + 4 w1 + t1 of a row is source byte κ; a1 = 2 a1h + a1l, block j = 2 r1 + a1h.
        dst: int32 words [E, Np/4, Q_out]; word 32 r1 + 16 s0 + 4 t1 + a1 of row 4 r0 + t0.
        scale: the Hopper scale buffer uint8 [E, NS32, 32 C_out] of SW warps (:func:`_rows`), zero
        where nothing is stored. Tile rows b = (r0, t0 s0, r1, a1h), columns 4 a1l + t1.
        """
        NB: tl.constexpr = 2 * BR1  # blocks a row
        e = tl.program_id(2).to(tl.int64)
        b = tl.arange(0, 16 * BR0 * BR1)
        ts = (b // NB) % 8
        r0 = tl.program_id(1) * BR0 + b // (8 * NB)
        ok_r = r0 < N16
        j0 = tl.program_id(0) * ITERS * NB + b % NB
        sr0 = tl.load(tab + r0 * 16 + ts, mask=ok_r, other=-1)  # source rows of kernel rows 16 r0 + 8 w0 + ts
        sr1 = tl.load(tab + r0 * 16 + 8 + ts, mask=ok_r, other=-1)
        for it in tl.range(0, ITERS, num_stages=1):
            j = j0 + it * NB
            a0, b0 = _tiles(src, sr0, e, j, C_in, s_e, s_r)
            a1, b1 = _tiles(src, sr1, e, j, C_in, s_e, s_r)
            _step(a0, b0, sr0, a1, b1, sr1, dst, scale, flag, e, r0, ts, j, ok_r, C_in, Q_out, d_e, d_r, c_e, c_r, NS32,
                  INPUT_KIND, MODE, EMAX, RCEIL_MANT_T, RCEIL_MIN_BITS, EVEN_ADD, FIX_MAX_BYTE, PACKED, SW)  # fmt: skip

    @triton.jit
    def _step(a0, b0, sr0, a1, b1, sr1, dst, scale, flag, e, r0, ts, j, ok_r, C_in, Q_out, d_e, d_r, c_e, c_r, NS32,
              INPUT_KIND: tl.constexpr, MODE: tl.constexpr, EMAX: tl.constexpr, RCEIL_MANT_T: tl.constexpr,
              RCEIL_MIN_BITS: tl.constexpr, EVEN_ADD: tl.constexpr, FIX_MAX_BYTE: tl.constexpr,
              PACKED: tl.constexpr, SW: tl.constexpr):  # fmt: skip
        """One loop step of :func:`_fused_value_kernel` on the four tiles of blocks j: their words."""
        args = (scale, flag, e, r0, ts, j, C_in, c_e, c_r, NS32)
        words = _rows(a0, b0, sr0, *args, 0, INPUT_KIND, MODE, EMAX, RCEIL_MANT_T, RCEIL_MIN_BITS, EVEN_ADD,
                      FIX_MAX_BYTE, PACKED, SW)  # fmt: skip
        words |= _rows(a1, b1, sr1, *args, 1, INPUT_KIND, MODE, EMAX, RCEIL_MANT_T, RCEIL_MIN_BITS, EVEN_ADD,
                       FIX_MAX_BYTE, PACKED, SW)  # fmt: skip
        q = 32 * (j // 2) + 16 * (ts % 2) + 2 * (j % 2)
        k = tl.arange(0, 8)
        off = ((4 * r0 + ts // 2) * d_r + q)[:, None] + (4 * (k % 4) + k // 4)[None, :]
        tl.store(dst + e * d_e + off, words, mask=(ok_r & (q < Q_out))[:, None])


@dataclass(frozen=True)
class HopperScales:
    """The scale buffer the fused kernel writes: ``hopper_scales``' layout of ``rows`` kernel rows
    (the value table's real rows, then zero rows), ``cols`` columns (scale groups, zero beyond the
    real ones) for ``num_warps``: uint8 [E, rows/32, 32*cols]. rows % (32*num_warps) == 0, cols even;
    a real row of the value table at or beyond ``rows`` has no place there (its scales are not stored)."""

    rows: int
    cols: int
    num_warps: int


def fused_hopper_values(
    x: torch.Tensor, tab: torch.Tensor, row_bytes: int, scale_rounding: str, nonfinite: torch.Tensor,
    scales: HopperScales,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Float experts ``x`` [E, R_in, K] (bf16/fp16/fp32) -> (value buffer uint8 [E, Np/4, 4*row_bytes],
    scale buffer uint8 [E, scales.rows/32, 32*scales.cols]) with Np = len(tab): the bytes of
    ``hopper_values(q, tab, row_bytes)`` and ``hopper_scales(s, tab_s, scales.cols,
    scales.num_warps)`` for ``q, s = quantize_mx_triton(x, "mxfp4", scale_rounding)`` and a scale row
    table ``tab_s`` of scales.rows rows that agrees with ``tab`` on its real rows, in one pass.
    ``nonfinite``: int32 [1] on x's device, set to 1 when an element is NaN or Inf (the bytes of
    its block are then not the quantizer's). Np % 16 == 0, row_bytes % 32 == 0, 2 * row_bytes >= K."""
    check_args(x, "mxfp4", scale_rounding)
    E, k, n = kernel_dims(x, tab)
    if n % 16 or row_bytes % 32 or 2 * row_bytes < k:
        raise BadInput(f"fused Hopper values need rows % 16 == 0, row bytes % 32 == 0 and >= K/2, got {n}, {row_bytes}, K={k}")
    if scales.num_warps < 1 or scales.rows % (32 * scales.num_warps) or scales.cols % 2 or scales.cols < k // 32:
        raise BadInput(f"fused Hopper scales need rows % {32 * scales.num_warps} == 0 and even columns >= K/32, got {scales}")
    if x.dtype not in _INPUT_KINDS:
        raise BadInput(f"fused Hopper values take bf16, fp16 or fp32 experts, got {x.dtype}")
    if nonfinite.dtype != torch.int32 or nonfinite.device != x.device:
        raise BadInput(f"nonfinite must be an int32 tensor on {x.device}, got {nonfinite.dtype} on {nonfinite.device}")
    out, src, tab = gather_operands(x, tab, (E, n // 4, 4 * row_bytes))
    sbuf = torch.zeros((E, scales.rows // 32, 32 * scales.cols), dtype=torch.uint8, device=x.device)
    if out.numel() == 0:
        return out, sbuf
    s = as_words(src, torch.int64 if x.dtype == torch.float32 else torch.int32)
    d = out.view(torch.int32)
    p = FORMAT_PARAMS["mxfp4"]
    cfg = {k: v for k, v in KERNEL_CONFIG.items() if v or k != "maxnreg"}
    grid = (-(-row_bytes // (32 * cfg["BR1"] * cfg["ITERS"])), -(-n // (16 * cfg["BR0"])), E)
    launch(
        _fused_value_kernel, grid, x,
        s, d, sbuf, nonfinite, tab, k // 32, row_bytes, n // 16, scales.rows // 32, s.stride(0), s.stride(1), d.stride(0), d.stride(1),
        sbuf.stride(0), sbuf.stride(1),
        INPUT_KIND=_INPUT_KINDS[x.dtype], MODE=SCALE_MODE_IDS[scale_rounding], EMAX=p.emax,
        RCEIL_MANT_T=p.rceil_mant_threshold, RCEIL_MIN_BITS=p.rceil_min_bits_byte1, EVEN_ADD=p.even_round_add,
        FIX_MAX_BYTE=SUBNORMAL_FIX_MAX_BYTE, PACKED=bf16x2_path(x.dtype, x.device),
        SW=scales.num_warps, **cfg,
    )  # fmt: skip
    return out, sbuf


__all__ = ["KERNEL_CONFIG", "HopperScales", "fused_hopper_values"]
