"""One Triton kernel from float experts to the ``triton`` backend's Hopper MXFP4 value buffer:
the MXFP4 quantizer of :mod:`mxconv.kernels.mx_triton` and the value gather of
:func:`mxconv.kernels.triton_swizzle.hopper_values` in a single pass (docs/layout-triton.md §3).

Unfused, the packed bytes are written by the quantizer and then read and written again by the
gather; here each program loads the bf16 (fp16, fp32) words of the 16 kernel rows and 2 x BR1
32-element blocks it stores, quantizes them in registers (the quantizer's own block math,
``quantize_block_words``), joins four packed bytes into one int32 word and hands the words to the
value kernel's permutation, twiddle and store (``store_hopper_words``). The bytes are those of
``quantize_mx_triton`` followed by ``hopper_values`` with the same row table (padding rows and
bytes zero). The plain E8M0 scales [E, R_in, K/32] of the real rows and blocks are stored beside
(``hopper_scales`` lays them out: 1/16 of the bytes), and a NaN/Inf sets the int32 flag as the
quantizer's FLAG does (the bytes of such blocks are then undefined: the caller takes the general path).
"""

from __future__ import annotations

import torch

from mxconv.errors import BadInput
from mxconv.kernels.triton_common import as_words, gather_operands, kernel_dims, launch
from mxconv.kernels.triton_import import tl, triton
from mxconv.mx.formats import (
    FORMAT_PARAMS,
    SCALE_MODE_IDS,
    SUBNORMAL_FIX_MAX_BYTE,
    check_args,
)

# Launch shape: BR1 = 32-byte column blocks of the value buffer per program (2 BR1 blocks of 32
# elements per kernel row), as hopper_values' BR1. Swept on an H200 (w13 of gpt-oss-120b, bf16):
# BR1 2 / 2 warps 2.80 ms, 4 / 4 2.94, 8 / 8 3.22, 1 / 1 2.96; more warps a program is slower.
KERNEL_CONFIG: dict[str, int] = {"BR1": 2, "num_warps": 2}

_INPUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # mx_triton's INPUT_KIND

if triton is not None:
    from mxconv.kernels.mx_triton import quantize_block_words
    from mxconv.kernels.triton_swizzle import store_hopper_words

    @triton.jit
    def _fused_value_kernel(
        src, dst, scale, flag, tab, C_in, Q_out, s_e, s_r, d_e, d_r, c_e, c_r,
        INPUT_KIND: tl.constexpr, MODE: tl.constexpr, EMAX: tl.constexpr, RCEIL_MANT_T: tl.constexpr,
        RCEIL_MIN_BITS: tl.constexpr, EVEN_ADD: tl.constexpr, FIX_MAX_BYTE: tl.constexpr, BR1: tl.constexpr,
    ):  # fmt: skip
        """Kernel rows 16 r0 + n (n < 16, source rows tab[...], -1 = zeros) x blocks 2 BR1 p1 + j.

        src: element-pair words [E, R_in, K/2] (int32 for 16-bit floats, int64 for fp32); block j of
        a row is words 16 j .. 16 j + 15. Its 16 packed bytes are 4 words; the 8 BR1 words of a row are
        the source words u = (r1, a1, w1) of ``store_hopper_words``. scale: uint8 [E, R_in, C_in].
        """
        NB: tl.constexpr = 2 * BR1
        p1 = tl.program_id(0)  # column blocks fastest: neighbouring programs stream the same rows
        r0 = tl.program_id(1)
        e = tl.program_id(2).to(tl.int64)
        b = tl.arange(0, 16 * NB)  # (n, j)
        sr = tl.load(tab + r0 * 16 + b // NB)
        j = p1 * NB + b % NB
        ok = (sr >= 0) & (j < C_in)
        offs = (sr * s_r + j * 16)[:, None] + tl.arange(0, 16)[None, :]
        w = tl.load(src + e * s_e + offs, mask=ok[:, None], other=0, eviction_policy="evict_first")
        out, byte, mag = quantize_block_words(
            w, ok, INPUT_KIND, True, MODE, EMAX, RCEIL_MANT_T, RCEIL_MIN_BITS, EVEN_ADD, FIX_MAX_BYTE
        )
        tl.store(flag + b * 0, 1, mask=ok & (mag >= 0x7F800000))  # no cross-warp reduction
        tl.store(scale + e * c_e + sr * c_r + j, byte.to(tl.uint8), mask=ok)
        # bytes (pairs) 4 q + t1 of a block -> word q: byte t1 at bits 8 t1 (out's bits above 7 are not the byte's)
        lo, hi = tl.split(tl.reshape(out & 0xFF, (16 * NB, 8, 2)))
        lo, hi = tl.split(tl.reshape(lo | (hi << 8), (16 * NB, 4, 2)))
        words = tl.reshape(lo | (hi << 16), (2, 8, 4 * BR1, 2))  # w0, (t0 s0), (r1 a1), w1
        x0, x1 = tl.split(tl.permute(words, (1, 2, 3, 0)))
        store_hopper_words(x0, x1, dst + e * d_e, r0, p1, Q_out, d_r, BR1)


def fused_hopper_values(
    x: torch.Tensor, tab: torch.Tensor, row_bytes: int, scale_rounding: str, nonfinite: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float experts ``x`` [E, R_in, K] (bf16/fp16/fp32) -> (value buffer uint8 [E, Np/4, 4*row_bytes],
    plain E8M0 scales uint8 [E, R_in, K/32]) with Np = len(tab): the bytes of
    ``hopper_values(quantize_mx_triton(x, "mxfp4", scale_rounding)[0], tab, row_bytes)`` and of its
    scales, in one pass. Scales of source rows no entry of ``tab`` names are left unwritten.
    ``nonfinite``: int32 [1] on x's device, set to 1 when an element is NaN or Inf (the bytes of
    its block are then not the quantizer's). Np % 16 == 0, row_bytes % 32 == 0, 2 * row_bytes >= K."""
    check_args(x, "mxfp4", scale_rounding)
    E, k, n = kernel_dims(x, tab)
    if n % 16 or row_bytes % 32 or 2 * row_bytes < k:
        raise BadInput(f"fused Hopper values need rows % 16 == 0, row bytes % 32 == 0 and >= K/2, got {n}, {row_bytes}, K={k}")
    if x.dtype not in _INPUT_KINDS:
        raise BadInput(f"fused Hopper values take bf16, fp16 or fp32 experts, got {x.dtype}")
    if nonfinite.dtype != torch.int32 or nonfinite.device != x.device:
        raise BadInput(f"nonfinite must be an int32 tensor on {x.device}, got {nonfinite.dtype} on {nonfinite.device}")
    out, src, tab = gather_operands(x, tab, (E, n // 4, 4 * row_bytes))
    scales = torch.empty((E, x.shape[1], k // 32), dtype=torch.uint8, device=x.device)
    if out.numel() == 0:
        return out, scales
    s = as_words(src, torch.int64 if x.dtype == torch.float32 else torch.int32)
    d = out.view(torch.int32)
    p = FORMAT_PARAMS["mxfp4"]
    grid = (triton.cdiv(row_bytes // 32, KERNEL_CONFIG["BR1"]), n // 16, E)
    launch(
        _fused_value_kernel, grid, x,
        s, d, scales, nonfinite, tab, k // 32, row_bytes, s.stride(0), s.stride(1), d.stride(0), d.stride(1),
        scales.stride(0), scales.stride(1),
        INPUT_KIND=_INPUT_KINDS[x.dtype], MODE=SCALE_MODE_IDS[scale_rounding], EMAX=p.emax,
        RCEIL_MANT_T=p.rceil_mant_threshold, RCEIL_MIN_BITS=p.rceil_min_bits_byte1, EVEN_ADD=p.even_round_add,
        FIX_MAX_BYTE=SUBNORMAL_FIX_MAX_BYTE, **KERNEL_CONFIG,
    )  # fmt: skip
    return out, scales


__all__ = ["KERNEL_CONFIG", "fused_hopper_values"]
