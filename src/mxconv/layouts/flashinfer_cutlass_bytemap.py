"""Byte maps of the FlashInfer CUTLASS MXFP4 MoE layout (spec: docs/layout-flashinfer-cutlass.md).

Three pure tensor maps, each with its inverse, over whole expert stacks [E, rows, cols]:

* :func:`sm90_weight_interleave` - what FlashInfer 0.7.2.post1's CUDA helper
  ``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")`` writes for the SM90 mixed-input GEMM
  (W4A16): inside every 16-row x 32-byte tile, four bytes from rows (r, r+8) and columns (c, c+4)
  are gathered into a 32-bit word whose bits are permuted (sign and 3-bit magnitude of each FP4
  code land in different places) and written as four consecutive bytes of one row;
* :func:`sm90_scale_fold` - FlashInfer's pure-torch ``interleave_moe_scales_for_sm90_mixed_gemm``
  for uint8 E8M0 scales of 32-element groups: [E, R, C] -> [E, R/64, C/4, 16, 16];
* the 128x4 scale swizzle of ``block_scale_interleave`` (SM100), shared with the trtllm layout
  (:func:`mxconv.layouts.scale_swizzle.swizzle_128x4`).

torch is imported lazily, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mxconv.errors import LayoutError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FP4_WORD_BIT_DST", "SCALE_FOLD_COLS", "SCALE_FOLD_ROWS", "WEIGHT_TILE_COLS", "WEIGHT_TILE_ROWS",
    "sm90_scale_fold", "sm90_scale_unfold", "sm90_weight_deinterleave", "sm90_weight_interleave",
]

WEIGHT_TILE_ROWS = 16  # rows r and r + 8 meet in one word
WEIGHT_TILE_COLS = 32  # bytes (64 FP4 codes) per partition of a row
SCALE_FOLD_ROWS = 64  # one folded scale block covers 64 rows ...
SCALE_FOLD_COLS = 4  # ... and 4 scale columns (128 elements of K)

# Word bit i (word = b0 | b1 << 8 | b2 << 16 | b3 << 24 with b0 = (r, c), b1 = (r+8, c),
# b2 = (r, c+4), b3 = (r+8, c+4)) goes to output bit FP4_WORD_BIT_DST[i]. Read off the masks and
# shifts of interleave_fp4_weights_for_sm90_mixed_gemm_kernel (moe_gemm_mixed_utils.cu).
FP4_WORD_BIT_DST: tuple[int, ...] = (
    6, 7, 8, 15, 22, 23, 24, 31,  # b0: low code (3 magnitude bits, sign), high code
    3, 4, 5, 12, 19, 20, 21, 28,  # b1
    0, 1, 2, 9, 16, 17, 18, 25,  # b2
    13, 10, 11, 14, 29, 26, 27, 30,  # b3
)


def _byte_luts(bit_dst: tuple[int, ...], device: torch.device | str | None) -> torch.Tensor:
    """[4, 256] int64: LUT[q, v] = the output word bits that byte q of value v sets."""
    import torch

    values = torch.arange(256, dtype=torch.int64, device=device)
    luts = torch.zeros(4, 256, dtype=torch.int64, device=device)
    for q in range(4):
        for b in range(8):
            luts[q] |= ((values >> b) & 1) << bit_dst[8 * q + b]
    return luts


def _permute_word_bits(words: torch.Tensor, bit_dst: tuple[int, ...]) -> torch.Tensor:
    """[..., 4] uint8 (little-endian 32-bit words) -> [..., 4] uint8 with bit i moved to bit_dst[i]."""
    import torch

    luts = _byte_luts(bit_dst, words.device)
    w = words.long()
    out = luts[0][w[..., 0]] | luts[1][w[..., 1]] | luts[2][w[..., 2]] | luts[3][w[..., 3]]
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=words.device)
    return ((out.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)


def _inverse(bit_dst: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(bit_dst)
    for src, dst in enumerate(bit_dst):
        inv[dst] = src
    return tuple(inv)


def _uint8_stack(t: torch.Tensor, what: str, dims: str, row_mult: int, col_mult: int, rule: str) -> tuple[int, int, int]:
    """(E, rows, cols) of ``t``; LayoutError naming ``what`` unless it is a uint8 [E, rows, cols]
    stack (``dims`` names the two axes) with rows % ``row_mult`` == cols % ``col_mult`` == 0
    (``rule``: that requirement in the words of its map)."""
    import torch

    if t.dim() != 3 or t.dtype != torch.uint8:
        raise LayoutError(f"flashinfer-cutlass: {what} must be a [E, {dims}] uint8 stack, got {tuple(t.shape)} {t.dtype}")
    E, rows, cols = t.shape
    if rows % row_mult or cols % col_mult:
        raise LayoutError(f"flashinfer-cutlass: {what} [E, {dims}] = {tuple(t.shape)} needs {rule}")
    return E, rows, cols


def _check_weight(w: torch.Tensor, what: str) -> tuple[int, int, int]:
    rule = f"N % {WEIGHT_TILE_ROWS} == 0 and K % {2 * WEIGHT_TILE_COLS} == 0 (SM90 mixed-GEMM interleave)"
    return _uint8_stack(w, what, "N, K/2", WEIGHT_TILE_ROWS, WEIGHT_TILE_COLS, rule)


def sm90_weight_interleave(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K/2] packed FP4 -> the same shape in the SM90 mixed-GEMM order (module docstring).

    Source byte (row g*16 + h*8 + r, col p*32 + m*8 + s*4 + l) is byte h + 2s of word (g, r, p, m, l);
    that word, bit-permuted, lands in row g*16 + (m % 2)*8 + r, bytes p*32 + (m // 2)*16 + l*4 + 0..3.
    """
    E, n, kb = _check_weight(w, "weight")
    G, P = n // WEIGHT_TILE_ROWS, kb // WEIGHT_TILE_COLS
    src = w.reshape(E, G, 2, 8, P, 4, 2, 4)  # e, g, h, r, p, m, s, l
    words = src.permute(0, 1, 3, 4, 5, 7, 6, 2).reshape(E, G, 8, P, 4, 4, 4)  # e, g, r, p, m, l, q = 2s + h
    out = _permute_word_bits(words, FP4_WORD_BIT_DST)  # e, g, r, p, m, l, j
    out = out.reshape(E, G, 8, P, 2, 2, 4, 4)  # e, g, r, p, mh, ml, l, j
    return out.permute(0, 1, 5, 2, 3, 4, 6, 7).reshape(E, n, kb).contiguous()


def sm90_weight_deinterleave(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`sm90_weight_interleave`."""
    E, n, kb = _check_weight(w, "interleaved weight")
    G, P = n // WEIGHT_TILE_ROWS, kb // WEIGHT_TILE_COLS
    out = w.reshape(E, G, 2, 8, P, 2, 4, 4).permute(0, 1, 3, 4, 5, 2, 6, 7)  # e, g, r, p, mh, ml, l, j
    words = _permute_word_bits(out.reshape(E, G, 8, P, 4, 4, 4), _inverse(FP4_WORD_BIT_DST))  # ..., q
    src = words.reshape(E, G, 8, P, 4, 4, 2, 2)  # e, g, r, p, m, l, s, h
    return src.permute(0, 1, 7, 2, 3, 4, 6, 5).reshape(E, n, kb).contiguous()


def _fold_view(E: int, R: int, C: int) -> tuple[int, ...]:
    return (E, R // SCALE_FOLD_ROWS, SCALE_FOLD_COLS, 16, C // SCALE_FOLD_COLS, SCALE_FOLD_COLS)


def sm90_scale_fold(s: torch.Tensor) -> torch.Tensor:
    """[E, R, C] uint8 E8M0 -> [E, R/64, C/4, 16, 16]: element (R64 block b, row 16a + f, column 4t + q)
    goes to [e, b, t, f, 4a + q] (R % 64 == 0, C % 4 == 0)."""
    rule = f"R % {SCALE_FOLD_ROWS} == 0 and C % {SCALE_FOLD_COLS} == 0 (SM90 scale fold)"
    E, R, C = _uint8_stack(s, "scales", "R, C", SCALE_FOLD_ROWS, SCALE_FOLD_COLS, rule)
    folded = s.reshape(_fold_view(E, R, C)).permute(0, 1, 4, 3, 2, 5)
    return folded.reshape(E, R // SCALE_FOLD_ROWS, C // SCALE_FOLD_COLS, 16, 16).contiguous()


def sm90_scale_unfold(folded: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`sm90_scale_fold`: [E, R/64, C/4, 16, 16] -> [E, R, C]."""
    E, B, T = folded.shape[:3]
    R, C = B * SCALE_FOLD_ROWS, T * SCALE_FOLD_COLS
    view = folded.reshape(E, B, T, 16, 4, SCALE_FOLD_COLS).permute(0, 1, 4, 3, 2, 5)
    return view.reshape(E, R, C).contiguous()
