"""The triton_kernels Hopper MX byte maps (docs/layout-triton.md): the bit twiddle of every 32-bit
word (§3), the value and scale permutations of an already padded stack (§3, §4) with their inverses,
and the kernel-row tables (§5) :mod:`mxconv.layouts.triton` gathers with.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mxconv.errors import LayoutError
from mxconv.experts.stack import ROW_ORDERS
from mxconv.layouts.gathers import cached_index, pad_row_source

if TYPE_CHECKING:
    import torch

# Bit twiddle (spec §3): destination bit of nibble bits (m, e0, e1, s) of byte j of a 32-bit word;
# low nibbles fill the low 16 bits, high nibbles the same pattern + 16.
NIBBLE_DEST_BITS = ((6, 7, 8, 15), (3, 4, 5, 12), (0, 1, 2, 9), (13, 10, 11, 14))


# ---------------------------------------------------------------------------------------------
# Bit twiddle: a bijection on the 32 bits of each little-endian word, applied as masked shifts.
# ---------------------------------------------------------------------------------------------


def _twiddle_moves() -> list[tuple[int, int]]:
    """(source bit, destination bit) of the forward twiddle, 32 pairs."""
    return [(8 * j + 4 * h + b, 16 * h + NIBBLE_DEST_BITS[j][b]) for j in range(4) for h in range(2) for b in range(4)]


def _shift_groups(moves: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Moves grouped by shift: ((shift, destination mask as a signed int32 value), ...)."""
    groups: dict[int, int] = {}
    for src, dst in moves:
        groups[dst - src] = groups.get(dst - src, 0) | (1 << dst)
    return tuple((s, m - (1 << 32) if m >= 1 << 31 else m) for s, m in sorted(groups.items()))


TWIDDLE_GROUPS = _shift_groups(_twiddle_moves())
UNTWIDDLE_GROUPS = _shift_groups([(dst, src) for src, dst in _twiddle_moves()])
_TWIDDLE_CHUNK = 1 << 18  # int32 words per CPU pass (1 MB: the working set stays in cache)


def twiddle_words(buf: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Spec §3 bit twiddle (or its inverse) of every aligned 4-byte little-endian word of uint8
    ``buf`` [..., 4n]; a new uint8 tensor of the same shape (``21 43 65 87 -> 5D 2C A6 40``).
    Masking after each (arithmetic) shift keeps only bits that came from inside the word. On CPU
    it runs in cache-sized chunks (about 10x faster than whole-tensor passes)."""
    import torch

    words = buf.contiguous().view(torch.int32).view(-1)
    out = torch.empty_like(words)
    step = _TWIDDLE_CHUNK if words.device.type == "cpu" else max(words.numel(), 1)
    tmp = torch.empty(min(step, words.numel()), dtype=torch.int32, device=words.device)
    for i in range(0, words.numel(), step):
        w, acc = words[i : i + step], out[i : i + step]
        t = tmp[: w.numel()]
        acc.zero_()
        for shift, mask in UNTWIDDLE_GROUPS if inverse else TWIDDLE_GROUPS:
            torch.bitwise_left_shift(w, shift, out=t) if shift >= 0 else torch.bitwise_right_shift(w, -shift, out=t)
            acc |= t.bitwise_and_(mask)
    return out.view(torch.uint8).view(buf.shape)


# ---------------------------------------------------------------------------------------------
# Permutations of an already padded stack (pure views/permutes; any dtype).
# Value: source row n = 16 r0 + 8 w0 + 2 t0 + s0, byte k = 32 r1 + 8 a1 + 4 w1 + t1;
#        buffer row 4 r0 + t0, column ((((r1*2 + s0)*4 + t1)*4 + a1)*2 + w1)*2 + w0.
# Scale: source row 32W m0 + 16W i1 + 16 w + 8 i3 + i4, column 2 k0 + k1;
#        buffer row W m0 + w, column (((k0*2 + i1)*8 + i4)*2 + k1)*2 + i3.
# ---------------------------------------------------------------------------------------------


def need(ok: bool, msg: str) -> None:
    """Raise ``LayoutError(msg)`` unless ``ok``."""
    if not ok:
        raise LayoutError(msg)


def permute_values(x: torch.Tensor) -> torch.Tensor:
    """[E, Np, Kbp] (Np % 16 == 0, Kbp % 32 == 0, any dtype) -> [E, Np/4, 4*Kbp], permutation only."""
    E, n, kb = x.shape
    need(n % 16 == 0 and kb % 32 == 0, f"Hopper value layout needs rows % 16 and bytes % 32 == 0, got [{n}, {kb}]")
    t = x.reshape(E, n // 16, 2, 4, 2, kb // 32, 4, 2, 4)  # r0 w0 t0 s0 r1 a1 w1 t1
    return t.permute(0, 1, 3, 5, 4, 8, 6, 7, 2).reshape(E, n // 4, 4 * kb)


def unpermute_values(buf: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute_values`: [E, Np/4, 4*Kbp] -> [E, Np, Kbp]."""
    E, rows, cols = buf.shape
    need(rows % 4 == 0 and cols % 128 == 0, f"Hopper value buffer [{rows}, {cols}] is not [Np/4, 4*Kbp]")
    t = buf.reshape(E, rows // 4, 4, cols // 128, 2, 4, 4, 2, 2)  # r0 t0 r1 s0 t1 a1 w1 w0
    return t.permute(0, 1, 8, 2, 4, 3, 6, 7, 5).reshape(E, 4 * rows, cols // 4)


def permute_scales(x: torch.Tensor, num_warps: int) -> torch.Tensor:
    """[E, Ns, Cp] (Ns % (32 W) == 0, Cp even, any dtype) -> [E, Ns/32, 32*Cp], permutation only."""
    E, n, c = x.shape
    W = num_warps
    need(n % (32 * W) == 0 and c % 2 == 0, f"Hopper scale layout (num_warps {W}) needs rows % {32 * W} == 0 and even columns, got [{n}, {c}]")
    t = x.reshape(E, n // (32 * W), 2, W, 2, 8, c // 2, 2)  # m0 i1 w i3 i4 k0 k1
    return t.permute(0, 1, 3, 6, 2, 5, 7, 4).reshape(E, n // 32, 32 * c)


def unpermute_scales(buf: torch.Tensor, num_warps: int) -> torch.Tensor:
    """Inverse of :func:`permute_scales`: [E, Ns/32, 32*Cp] -> [E, Ns, Cp]."""
    E, rows, cols = buf.shape
    W = num_warps
    need(rows % W == 0 and cols % 64 == 0, f"Hopper scale buffer [{rows}, {cols}] does not fit num_warps {W}")
    t = buf.reshape(E, rows // W, W, cols // 64, 2, 8, 2, 2)  # m0 w k0 i1 i4 k1 i3
    return t.permute(0, 1, 4, 2, 7, 5, 3, 6).reshape(E, 32 * rows, cols // 32)


def w13_row_table(intermediate: int, row_order: str, rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Source row of the unpadded w13 stack behind each kernel row j in [0, rows), -1 = padding.

    Kernel rows are gate/up pairs j = 2m + u (u = 0 gate, 1 up); pairs m < I are real, the rest
    (vLLM's padding to Ip, then the value/scale layout's) zero. interleaved source: row j; halves
    source: row u*I + m (spec §5). Cached int32 tensor [rows].
    """
    import torch

    need(row_order in ROW_ORDERS, f"unknown w13 row order {row_order!r} (expected one of {ROW_ORDERS})")

    def build() -> torch.Tensor:
        j = torch.arange(rows, dtype=torch.long)
        m, u = j // 2, j % 2
        return torch.where(m < intermediate, j if row_order == "interleaved" else u * intermediate + m, -1)

    return cached_index(("triton-w13", intermediate, row_order, rows), device, build)


def w2_row_table(hidden: int, rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Source row behind each w2 kernel row (rows appended at the end, -1 = padding). Cached int32 [rows]."""
    return cached_index(("triton-w2", hidden, rows), device, lambda: pad_row_source(hidden, rows))


def inverse_rows(tab: torch.Tensor, real: int) -> torch.Tensor:
    """Kernel row of each source row: ``inv[tab[j]] = j`` for the ``real`` leading kernel rows
    (which hold every source row once; the rest are padding). LongTensor [real] on tab's device."""
    import torch

    inv = torch.empty(real, dtype=torch.long, device=tab.device)
    inv[tab[:real].long()] = torch.arange(real, dtype=torch.long, device=tab.device)
    return inv
