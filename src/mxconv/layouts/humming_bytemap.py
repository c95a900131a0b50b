"""Byte map of humming-kernels 0.1.19's weight transform for 4-bit and 8-bit weights and 16-bit
activations on SM90 (spec: docs/layout-humming.md), written as torch permutations so CPU and CUDA agree.

Derived from ``humming/include/humming/kernel/process.cuh`` (``weight_repack_nk`` with
kNumBitsB=4, kNumBitsA=16, packed input, interleave_mode 3, no native dequant, no packed-K layout)
and ``humming/transform.py`` (``transform_humming_weight_scale``, ``transform_humming_bias``,
``check_and_pad_tensors``). One CUDA block covers 64 rows (n) x 64 values (k); the stored word at
(row r = k // 16, column c) holds eight nibbles, and with

    c = 128 * bx + 16 * ln + 4 * lq + jj        (bx: 64-row block, ln 0..7, lq 0..3, jj 0..3)
    nibble p = 4 * i6 + 2 * i4 + i5             (i4, i5, i6 in 0..1)

nibble p of word (r, c) is the canonical value at n = 64*bx + 16*jj + 8*i4 + ln and
k = 16*r + 8*i5 + 2*lq + i6. 8-bit weights (kNumBitsB=8: :func:`repack_bytes`) keep the same 64 x 64
block and thread assignment, but a word holds four values, so a row of words is 4N long: with

    c = 256 * bx + 32 * ln + 8 * lq + kk        (kk 0..7)
    byte p = 2 * i6 + i5

byte p of word (r, c) is the value at n = 64*bx + 8*kk + ln and k = 16*r + 8*i5 + 2*lq + i6. Scales: [N, K/32] transposed to [K/32, N], then an 8x8 transpose inside
every 64-column chunk (:func:`scale_columns`: the same as a column map). Bias: 32-element chunks permuted ``out[8i + 2a + b] = in[8a + b + 2i]``.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mxconv.errors import LayoutError
from mxconv.experts.stack import round_up

if TYPE_CHECKING:
    import torch

N_MULTIPLE = 256  # humming pads every GEMM's N (output rows) to this (vLLM's pad_n_to_multiple)
K_MULTIPLE = 128  # and K (inputs) to this (pad_k_to_multiple)
SCALE_PAD_BYTE = 127  # F.pad(value=1) on float8_e8m0fnu scales: E8M0 1.0


def gemm_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int, int, int]]:
    """Per GEMM ("w13", "w2") of a layer vLLM allocated with ``intermediate`` (its padded per-rank
    size): (N, K) before humming's padding and (N_pad, K_pad) after it; the same for every weight format."""
    n13, n2 = 2 * intermediate, hidden
    return {"w13": (n13, hidden, round_up(n13, N_MULTIPLE), round_up(hidden, K_MULTIPLE)),
            "w2": (n2, intermediate, round_up(n2, N_MULTIPLE), round_up(intermediate, K_MULTIPLE))}  # fmt: skip


# permuted axes of the nibble view [E, BX, JJ, I4, LN, R, I5, LQ, I6] into the stored word order
_WORD_ORDER = (0, 5, 1, 4, 7, 2, 8, 3, 6)
_WORD_ORDER_INV = tuple(_WORD_ORDER.index(i) for i in range(9))


# 8-bit weights: the value view [E, BX, KK, LN, R, I5, LQ, I6] into the stored byte order
_BYTE_ORDER = (0, 4, 1, 3, 6, 2, 7, 5)
_BYTE_ORDER_INV = tuple(_BYTE_ORDER.index(i) for i in range(8))


def _nibble_view_shape(E: int, N: int, K: int) -> tuple[int, ...]:
    return (E, N // 64, 4, 2, 8, K // 16, 2, 4, 2)


def _word_view_shape(E: int, N: int, K: int) -> tuple[int, ...]:
    return (E, K // 16, N // 64, 8, 4, 4, 2, 2, 2)


def check_geometry(N: int, K: int, name: str) -> None:
    """LayoutError unless (N, K) are whole 64-row / 16-value tiles (humming's padding gives 256/128)."""
    if N % 64 or K % 64:
        raise LayoutError(f"{name}: humming weight tiles need N % 64 == 0 and K % 64 == 0, got N={N}, K={K}")


def repack_weights(packed: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 [E, N, K/2] (low nibble = even k, padded) -> int32 [E, K/16, 2N] humming words."""
    import torch

    E, N, kb = packed.shape
    K = 2 * kb
    check_geometry(N, K, name)
    nib = torch.stack((packed & 0xF, packed >> 4), dim=-1).view(E, N, K)
    words = nib.view(_nibble_view_shape(E, N, K)).permute(_WORD_ORDER).reshape(E, K // 16, 2 * N, 4, 2)
    out = (words[..., 0] | (words[..., 1] << 4)).contiguous()
    return out.view(torch.int32).view(E, K // 16, 2 * N)


def unrepack_weights(words: torch.Tensor, name: str) -> torch.Tensor:
    """Inverse of :func:`repack_weights`: int32 [E, K/16, 2N] -> uint8 [E, N, K/2]."""
    import torch

    E, kr, n2 = words.shape
    N, K = n2 // 2, kr * 16
    check_geometry(N, K, name)
    b = words.contiguous().view(torch.uint8).view(E, kr, n2, 4)
    nib = torch.stack((b & 0xF, b >> 4), dim=-1)
    canon = nib.view(_word_view_shape(E, N, K)).permute(_WORD_ORDER_INV).reshape(E, N, K // 2, 2)
    return (canon[..., 0] | (canon[..., 1] << 4)).contiguous()


def repack_bytes(values: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 [E, N, K] (one 8-bit value per byte, padded) -> int32 [E, K/16, 4N] humming words."""
    import torch

    E, N, K = values.shape
    check_geometry(N, K, name)
    view = values.reshape(E, N // 64, 8, 8, K // 16, 2, 4, 2)
    return view.permute(_BYTE_ORDER).reshape(E, K // 16, 16 * N).view(torch.int32)


def unrepack_bytes(words: torch.Tensor, name: str) -> torch.Tensor:
    """Inverse of :func:`repack_bytes`: int32 [E, K/16, 4N] -> uint8 [E, N, K]."""
    import torch

    E, kr, n4 = words.shape
    N, K = n4 // 4, kr * 16
    check_geometry(N, K, name)
    b = words.contiguous().view(torch.uint8).view(E, kr, N // 64, 8, 4, 8, 2, 2)
    return b.permute(_BYTE_ORDER_INV).reshape(E, N, K).contiguous()


def _chunk_perm(chunk: int, on_c: bool) -> list[int]:
    """humming's permutation of one chunk (64 scales, or 32 bias/C-side values)."""
    base = [0, 1, 8, 9, 16, 17, 24, 25] if on_c else [0, 8, 16, 24, 32, 40, 48, 56]
    count = sum(x < 8 for x in base)
    perm: list[int] = []
    for i in range(8 // count):
        perm += [x + count * i for x in base]
    if len(perm) != chunk:
        raise AssertionError("humming chunk permutation length")
    return perm


def _permute_last(t: torch.Tensor, perm: list[int], inverse: bool) -> torch.Tensor:
    import torch

    chunk = len(perm)
    if t.shape[-1] % chunk:
        raise LayoutError(f"humming: last dimension {t.shape[-1]} is not a multiple of {chunk}")
    idx = torch.tensor(perm, dtype=torch.long, device=t.device)
    if inverse:
        idx = torch.argsort(idx)
    lead = t.shape[:-1]
    return t.reshape(*lead, t.shape[-1] // chunk, chunk).index_select(-1, idx).reshape(*lead, t.shape[-1])


def lay_out_scales(scales: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, K/32] (padded) -> uint8 [E, K/32, N]: transposed, 8x8 transpose per 64 columns."""
    return _permute_last(scales.transpose(1, 2).contiguous(), _chunk_perm(64, False), False).contiguous()


def scale_columns(rows: int, padded_rows: int) -> tuple[list[int], list[int]]:
    """:func:`lay_out_scales` as a column map, for a kernel that transposes through a row table: the
    padded row behind each stored column (``padded_rows`` of them, the 8x8 chunk transpose applied),
    and the stored columns whose row lies past the first ``rows`` (humming's own padding, which
    holds SCALE_PAD_BYTE)."""
    perm = _chunk_perm(64, False)
    if padded_rows % 64:
        raise LayoutError(f"humming: {padded_rows} scale rows are not whole 64-row chunks")
    source = [64 * (p // 64) + perm[p % 64] for p in range(padded_rows)]
    return source, [p for p, r in enumerate(source) if r >= rows]


def unlay_scales(stored: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`lay_out_scales`."""
    return _permute_last(stored, _chunk_perm(64, False), True).transpose(1, 2).contiguous()


def lay_out_bias(bias: torch.Tensor) -> torch.Tensor:
    """[E, N] (padded) -> [E, N] in humming's C-side order (32-element chunks)."""
    return _permute_last(bias, _chunk_perm(32, True), False).contiguous()


def unlay_bias(stored: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`lay_out_bias`."""
    return _permute_last(stored, _chunk_perm(32, True), True).contiguous()


def pad_matrix(t: torch.Tensor, rows: int, cols: int, fill: float) -> torch.Tensor:
    """[E, R, C] -> [E, rows, cols]: new rows and columns appended at the end, holding ``fill``."""
    import torch

    E, R, C = t.shape
    if (R, C) == (rows, cols):
        return t.contiguous()
    out = torch.full((E, rows, cols), fill, dtype=t.dtype, device=t.device)
    out[:, :R, :C] = t
    return out


def pad_vector(t: torch.Tensor, n: int) -> torch.Tensor:
    """[E, R] -> [E, n], zero-filled at the end."""
    import torch

    return torch.nn.functional.pad(t, (0, n - t.shape[1])) if t.shape[1] != n else t.contiguous()
