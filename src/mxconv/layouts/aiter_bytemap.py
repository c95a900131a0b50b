"""AITER's byte shuffles (docs/layout-aiter.md section 2) as reshape/permutes, the spec's index
formulas, and the whole-stack torch path over an already padded stack (:func:`permute_padded`), which
:mod:`mxconv.layouts.aiter` fuses with the padding into row gathers.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mxconv.errors import LayoutError
from mxconv.experts.padding import pad_last
from mxconv.experts.stack import CanonicalExperts, round_up
from mxconv.experts.tensors import KernelTensors, in_kernel_order

if TYPE_CHECKING:
    import torch

# Byte written into scale columns that AITER pads (E8M0 0x7F = 2**0; never 0xFF, which is NaN).
SCALE_PAD_FILL = 0x7F

ACTIVATIONS = ("bf16", "mxfp4")


# ---------------------------------------------------------------------------------------------
# The three primitives (spec section 2) and the gpt-oss row de-interleave, as reshape/permutes.
# W16 / S32x8 act on the trailing [N, X] matrix (any leading dims); row maps act on dim 1 of
# [E, N, *rest].
# ---------------------------------------------------------------------------------------------


def _swap_axes(t: torch.Tensor, lead: int, order: tuple[int, ...]) -> torch.Tensor:
    """Permute the axes after the first ``lead`` ones by ``order`` (relative indices)."""
    return t.permute(*range(lead), *(lead + o for o in order))


def w16(x: torch.Tensor) -> torch.Tensor:
    """W16: cut each trailing ``[N, B]`` matrix into 16x16 tiles, tiles row-block-major, bytes
    row-major inside a tile: ``out_flat[((r//16)*(B/16) + c//16)*256 + (r%16)*16 + c%16] = in[r, c]``.

    x: ``[..., N, B]`` (any dtype), ``N % 16 == 0``, ``B % 16 == 0``. Returns the same shape, contiguous.
    """
    *lead, n, b = x.shape
    need(n % 16 == 0 and b % 16 == 0, f"W16 needs rows and bytes multiples of 16, got [{n}, {b}]")
    t = x.reshape(*lead, n // 16, 16, b // 16, 16)
    return _swap_axes(t, len(lead), (0, 2, 1, 3)).reshape(*lead, n, b)


def w16_inverse(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`w16` (same shape contract)."""
    *lead, n, b = x.shape
    need(n % 16 == 0 and b % 16 == 0, f"W16 needs rows and bytes multiples of 16, got [{n}, {b}]")
    t = x.reshape(*lead, n // 16, b // 16, 16, 16)
    return _swap_axes(t, len(lead), (0, 2, 1, 3)).reshape(*lead, n, b)


def gu16(x: torch.Tensor) -> torch.Tensor:
    """GU16: rows ``[gate (N/2); up (N/2)]`` -> 16-row blocks alternating gate and up.

    Dest row ``d = 16*j + q`` takes source row ``(j % 2) * N/2 + (j // 2) * 16 + q``.
    x: ``[E, N, *rest]`` (any dtype), ``N % 32 == 0``. Returns the same shape, contiguous.
    """
    e, n, *rest = x.shape
    need(n % 32 == 0, f"GU16 needs a row count that is a multiple of 32, got {n}")
    t = x.reshape(e, 2, n // 32, 16, *rest)
    return t.transpose(1, 2).reshape(e, n, *rest)


def gu16_inverse(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`gu16`: back to ``[gate; up]`` (same shape contract)."""
    e, n, *rest = x.shape
    need(n % 32 == 0, f"GU16 needs a row count that is a multiple of 32, got {n}")
    t = x.reshape(e, n // 32, 2, 16, *rest)
    return t.transpose(1, 2).reshape(e, n, *rest)


def s32x8(x: torch.Tensor) -> torch.Tensor:
    """S32x8: 32-row x 8-column scale tiles, tiles row-block-major; inside a tile, with
    ``r%32 = 16*b + c`` and ``q%8 = 4*f + g``, the byte goes to ``((g*16 + c)*2 + f)*2 + b``.

    x: ``[..., R, C]`` (any dtype), ``R % 32 == 0``, ``C % 8 == 0``. Returns the same shape, contiguous.
    """
    *lead, r, c = x.shape
    need(r % 32 == 0 and c % 8 == 0, f"S32x8 needs rows % 32 == 0 and columns % 8 == 0, got [{r}, {c}]")
    # axes: (row tile, b, c, col tile, f, g) -> (row tile, col tile, g, c, f, b)
    t = x.reshape(*lead, r // 32, 2, 16, c // 8, 2, 4)
    return _swap_axes(t, len(lead), (0, 3, 5, 2, 4, 1)).reshape(*lead, r, c)


def s32x8_inverse(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`s32x8` (same shape contract)."""
    *lead, r, c = x.shape
    need(r % 32 == 0 and c % 8 == 0, f"S32x8 needs rows % 32 == 0 and columns % 8 == 0, got [{r}, {c}]")
    # axes: (row tile, col tile, g, c, f, b) -> (row tile, b, c, col tile, f, g)
    t = x.reshape(*lead, r // 32, c // 8, 4, 16, 2, 2)
    return _swap_axes(t, len(lead), (0, 5, 3, 1, 4, 2)).reshape(*lead, r, c)


def deinterleave_rows(x: torch.Tensor) -> torch.Tensor:
    """gpt-oss rows ``g0, u0, g1, u1, ...`` -> ``[g0..g(I-1); u0..u(I-1)]``.

    x: ``[E, 2I, *rest]`` (any dtype). Dest row ``d < I`` <- ``2d``; dest ``I + j`` <- ``2j + 1``.
    """
    e, n, *rest = x.shape
    need(n % 2 == 0, f"de-interleave needs an even row count, got {n}")
    return x.reshape(e, n // 2, 2, *rest).transpose(1, 2).reshape(e, n, *rest)


def interleave_rows(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`deinterleave_rows`: dest ``2m`` <- ``m``, dest ``2m+1`` <- ``I + m``."""
    e, n, *rest = x.shape
    need(n % 2 == 0, f"re-interleave needs an even row count, got {n}")
    return x.reshape(e, 2, n // 2, *rest).transpose(1, 2).reshape(e, n, *rest)


def shuffle_scale_a16w4(s: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """AITER ``shuffle_scale_a16w4(s.view(E*N, C), E, gate_up)``.

    s: ``[E, N, C]`` uint8 E8M0, ``N % 32 == 0``. Pads C to ``Cp = round_up(C, 8)`` with 0x7F,
    applies GU16 when ``gate_up``, then S32x8 per expert. Returns 2-D ``[E*N, Cp]``, s's dtype.
    """
    e, n, c = s.shape
    t = pad_last(s, round_up(c, 8), SCALE_PAD_FILL)
    if gate_up:
        t = gu16(t)
    return s32x8(t).reshape(e * n, -1)


def unshuffle_scale_a16w4(s2d: torch.Tensor, num_experts: int, gate_up: bool) -> torch.Tensor:
    """Inverse of :func:`shuffle_scale_a16w4` without cropping: 2-D ``[E*N, Cp]`` -> ``[E, N, Cp]``
    (columns ``>= C`` still hold the padding)."""
    t = s32x8_inverse(s2d.reshape(num_experts, -1, s2d.shape[-1]))
    return gu16_inverse(t) if gate_up else t


def e8m0_shuffle(s2d: torch.Tensor, fill: int = SCALE_PAD_FILL) -> torch.Tensor:
    """AITER ``e8m0_shuffle`` with a deterministic fill for the bytes upstream leaves uninitialised.

    s2d: ``[M, C]``. Pads to ``[round_up(M, 256), round_up(C, 8)]`` with ``fill``, then S32x8 over
    the 2-D matrix. Returns the padded 2-D result.
    """
    import torch

    m, c = s2d.shape
    padded = torch.full((round_up(m, 256), round_up(c, 8)), fill, dtype=s2d.dtype, device=s2d.device)
    padded[:m, :c] = s2d
    return s32x8(padded)


def e8m0_unshuffle(s2d: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`e8m0_shuffle` without cropping: padded ``[Mp, Cp]`` -> padded ``[Mp, Cp]``."""
    return s32x8_inverse(s2d)


def shuffle_scale_a4w4(s: torch.Tensor) -> torch.Tensor:
    """vLLM's a4w4 scale step ``e8m0_shuffle(s.view(E*N, C)).view(E, N, -1)``.

    s: ``[E, N, C]``. Raises LayoutError when ``E*N % 256 != 0`` (the padded 2-D result would not
    view back to ``[E, N, -1]`` cleanly upstream). Returns ``[E, N, round_up(C, 8)]``.
    """
    e, n, c = s.shape
    check_a4w4_rows("scale", e, n)
    return e8m0_shuffle(s.reshape(e * n, c)).reshape(e, n, -1)


def unshuffle_scale_a4w4(s: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`shuffle_scale_a4w4` without cropping: ``[E, N, Cp]`` -> ``[E, N, Cp]``."""
    e, n, cp = s.shape
    check_a4w4_rows("scale", e, n)
    return e8m0_unshuffle(s.reshape(e * n, cp)).reshape(e, n, cp)


# ---------------------------------------------------------------------------------------------
# Index functions: the spec formulas evaluated directly (for tests, verify and error messages).
# Each returns an int64 tensor on ``device``.
# ---------------------------------------------------------------------------------------------


def w16_dest_offsets(n: int, b: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[N, B]``: flat destination offset (within one expert) of source byte ``(r, c)`` under W16."""
    import torch

    r = torch.arange(n, device=device).unsqueeze(1)
    c = torch.arange(b, device=device).unsqueeze(0)
    return ((r // 16) * (b // 16) + c // 16) * 256 + (r % 16) * 16 + c % 16


def gu16_source_rows(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[N]``: concat-order source row of each GU16 destination row."""
    import torch

    d = torch.arange(n, device=device)
    j, q = d // 16, d % 16
    return (j % 2) * (n // 2) + (j // 2) * 16 + q


def s32x8_dest_offsets(r: int, c: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[R, C]``: flat destination offset of source scale ``(row, col)`` under S32x8."""
    import torch

    row = torch.arange(r, device=device).unsqueeze(1)
    col = torch.arange(c, device=device).unsqueeze(0)
    b, cc = (row % 32) // 16, row % 16
    f, g = (col % 8) // 4, col % 4
    return ((row // 32) * (c // 8) + col // 8) * 256 + ((g * 16 + cc) * 2 + f) * 2 + b


def deinterleave_source_rows(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[N]``: interleaved source row of each concat-order row (``d < N/2 <- 2d``, ``N/2 + j <- 2j+1``)."""
    import torch

    d = torch.arange(n, device=device)
    half = n // 2
    return torch.where(d < half, 2 * d, 2 * (d - half) + 1)


# ---------------------------------------------------------------------------------------------
# Whole-stack permutations of an already padded stack (what runs after vLLM's padding).
# ---------------------------------------------------------------------------------------------


def permute_padded(c: CanonicalExperts, activation: str) -> KernelTensors:
    """Apply AITER's shuffles to an already padded stack (no padding is added here).

    c: padded canonical stack (w13 ``[E, 2I, H/2]``, scales ``[E, 2I, H/32]``, ...; any dtype for
    weights/scales so id tensors can be traced). Returns kernel tensors: a16w4 scales 2-D
    ``[E*N, round_up(K/32, 8)]``, a4w4 scales 3-D ``[E, N, round_up(K/32, 8)]``, biases float32.
    """
    import torch

    check_activation(activation)
    out: KernelTensors = {}
    if activation == "bf16":
        w13, s13, b13 = c.w13, c.w13_scale, c.w13_bias
        if c.row_order == "interleaved":
            w13, s13 = deinterleave_rows(w13), deinterleave_rows(s13)
            b13 = None if b13 is None else deinterleave_rows(b13)
        out["w13_weight"] = w16(gu16(w13))
        out["w13_weight_scale"] = shuffle_scale_a16w4(s13, gate_up=True)
        out["w2_weight"] = w16(c.w2)
        out["w2_weight_scale"] = shuffle_scale_a16w4(c.w2_scale, gate_up=False)
    else:
        b13 = c.w13_bias
        out["w13_weight"] = w16(c.w13)
        out["w13_weight_scale"] = shuffle_scale_a4w4(c.w13_scale)
        out["w2_weight"] = w16(c.w2)
        out["w2_weight_scale"] = shuffle_scale_a4w4(c.w2_scale)
    if b13 is not None:
        out["w13_bias"] = b13.to(torch.float32).contiguous()
    if c.w2_bias is not None:
        out["w2_bias"] = c.w2_bias.to(torch.float32).contiguous()
    return in_kernel_order(out)


def w16_bytes(x: torch.Tensor) -> torch.Tensor:
    """:func:`w16` of a contiguous uint8 ``[E, N, B]``, moving 8-byte words (same bytes; a stack at a
    storage offset that is no whole number of words is copied first)."""
    import torch

    from mxconv.kernels.triton_common import as_words

    e, n, b = x.shape
    need(n % 16 == 0 and b % 16 == 0, f"W16 needs rows and bytes multiples of 16, got [{n}, {b}]")
    words = as_words(x, torch.int64).reshape(e, n // 16, 16, b // 16, 2)
    return words.permute(0, 1, 3, 2, 4).reshape(e, n, b // 8).view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def need(ok: bool, msg: str) -> None:
    """Raise ``LayoutError("aiter: " + msg)`` unless ``ok``."""
    if not ok:
        raise LayoutError(f"aiter: {msg}")


def check_activation(activation: str) -> None:
    """Raise ``LayoutError`` unless ``activation`` is one of :data:`ACTIVATIONS`."""
    if activation not in ACTIVATIONS:
        raise LayoutError(f"aiter: unknown activation {activation!r} (expected one of {ACTIVATIONS})")


def check_a4w4_rows(what: str, num_experts: int, rows: int) -> None:
    """Raise ``LayoutError`` unless an a4w4 scale tensor of ``num_experts`` x ``rows`` rows can be shuffled."""
    if (num_experts * rows) % 256:
        raise LayoutError(
            f"aiter a4w4: {what} needs E*N % 256 == 0 for e8m0_shuffle to view back to [E, N, -1], "
            f"got E={num_experts}, N={rows} (E*N={num_experts * rows})"
        )
