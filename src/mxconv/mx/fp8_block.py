"""Block FP8 in the DeepSeek-V3 convention (``quantize --format fp8-block``): E4M3 weights
``[..., N, K]`` and one fp32 ``scale_inv`` per 128x128 tile ``[..., ceil(N/128), ceil(K/128)]``,
``W = fp32(q) * scale_inv``. Two ways in (docs/numerics.md, "Block FP8"):

* from MXFP4 (:func:`mxfp4_to_fp8_block`): a power-of-two tile scale ``2^t``. Every non-zero E2M1
  value is ``m * 2^p`` with ``m`` in {1, 1.5}: its leading bit is ``2^p`` and its last set bit
  ``2^p`` (m = 1) or ``2^(p-1)`` (m = 1.5). ``v / 2^t`` is an E4M3 value (normal or subnormal, no
  overflow) exactly when its leading bit is at most ``2^8`` (448 = 1.75 * 2^8; 1.5 * 2^8 = 384 fits)
  and its last bit at least ``2^-9`` (E4M3's subnormal step). A tile is exact iff some ``t`` meets
  both for all its elements: ``top - low <= 17`` (top: the highest leading-bit exponent, low: the
  lowest last-bit exponent). ``t = top - 8`` is then exact, and it is also the least-loss scale of an
  inexact tile: a smaller ``t`` overflows its largest element (an error of at least 64 * 2^t), a
  larger one only coarsens the grid the small elements round to. The cast rounds to nearest even.
* from floats (:func:`float_to_fp8_block`): ``scale_inv = amax / 448`` per tile (fp32), ``q =
  RNE(x / scale_inv)``: the rule of DeepSeek-V3's own FP8 weights. A tile of zeros gets scale 1.

Both run in torch on any device, in chunks of experts; partial edge tiles are tiles of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxconv.mx.formats import E2M1_VALUES, E4M3_MAX, E8M0_BIAS, E8M0_NAN, unpack_fp4

TILE = 128
WEIGHT_BLOCK_SIZE = (TILE, TILE)
E4M3_TOP_EXP = 8  # leading-bit exponent of the largest E4M3 values (256 .. 448)
E4M3_LOW_EXP = -9  # E4M3's smallest step: the subnormal 2^-9
MAX_EXACT_SPREAD = E4M3_TOP_EXP - E4M3_LOW_EXP  # 17 binades between a tile's top and lowest bit
_NONE = 1 << 20  # exponent sentinel of a group without non-zero elements
# per E2M1 magnitude code 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6): exponent of the leading and the last set bit
_TOP = (-_NONE, -1, 0, 0, 1, 1, 2, 2)
_LOW = (_NONE, -1, 0, -1, 1, 0, 2, 1)
_CHUNK = 1 << 26  # elements re-encoded at once (fp32 temporaries of a few hundred MB)


@dataclass
class BlockFP8:
    """A block-FP8 tensor: ``data`` float8_e4m3fn [..., N, K], ``scale_inv`` fp32 [..., ceil(N/128),
    ceil(K/128)]; from MXFP4 also per tile ``exact`` (bool) and ``max_error`` (fp64, the largest
    |dequantized FP8 - dequantized MXFP4| of the tile, 0 where exact)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    exact: torch.Tensor | None = None
    max_error: torch.Tensor | None = None


def tiles(n: int) -> int:
    return -(-n // TILE)


def _tile_reduce(g: torch.Tensor, fill: int, largest: bool) -> torch.Tensor:
    """Per-group exponents [E, N, K/32] -> per-tile max (or min) [E, ceil(N/128), ceil(K/128)]."""
    E, N, G = g.shape
    nb, kb = tiles(N), tiles(G * 32)
    padded = torch.full((E, nb * TILE, kb * (TILE // 32)), fill, dtype=g.dtype, device=g.device)
    padded[:, :N, :G] = g
    t = padded.view(E, nb, TILE, kb, TILE // 32)
    return t.amax(dim=(2, 4)) if largest else t.amin(dim=(2, 4))


def _expand(tile: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """Per-tile [E, nb, kb] -> per group of 32 [E, n, g] (rows and groups of each tile)."""
    return tile.repeat_interleave(TILE, dim=1)[:, :n].repeat_interleave(TILE // 32, dim=2)[:, :, :g]


def tile_exponents(data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 [E, N, K/2] + E8M0 [E, N, K/32] -> per tile (top, low) int32 [E, nb, kb]: the exponents
    of the highest leading bit and of the lowest set bit of its non-zero elements (sentinels
    -2^20 / 2^20 for a tile of zeros; NaN-scale groups count as empty)."""
    codes = unpack_fp4(data)
    E, N, K = codes.shape
    mag = (codes & 7).long().view(E, N, K // 32, 32)
    top_lut = torch.tensor(_TOP, dtype=torch.int32, device=data.device)
    low_lut = torch.tensor(_LOW, dtype=torch.int32, device=data.device)
    s = scales.to(torch.int32) - E8M0_BIAS
    nan = scales == E8M0_NAN
    gtop = (top_lut[mag].amax(dim=-1) + s).masked_fill(nan, -_NONE)
    glow = (low_lut[mag].amin(dim=-1) + s).masked_fill(nan, _NONE)
    return _tile_reduce(gtop, -_NONE, True), _tile_reduce(glow, _NONE, False)


def _pow2(t: torch.Tensor) -> torch.Tensor:
    """2^t as fp32 for int tensors t (exact from 2^-149 up; 0 below)."""
    return torch.ldexp(torch.ones(t.shape, dtype=torch.float64, device=t.device), t.to(torch.float64)).to(torch.float32)


def _reencode_chunk(data: torch.Tensor, scales: torch.Tensor) -> BlockFP8:
    top, low = tile_exponents(data, scales)
    empty = top <= -_NONE
    t = torch.where(empty, torch.zeros_like(top), top - E4M3_TOP_EXP)
    exact = empty | (top - low <= MAX_EXACT_SPREAD)
    E, N, G = scales.shape
    # per group of 32: its elements are e2m1 * 2^(s - 127 - t); below 2^-126 they all round to zero
    k = scales.to(torch.int32) - E8M0_BIAS - _expand(t, N, G)
    factor = torch.where(k < -126, torch.zeros((), dtype=torch.float32, device=k.device), _pow2(k.clamp(-126, 127)))
    factor = factor.masked_fill(scales == E8M0_NAN, float("nan"))
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=data.device)
    x = lut[unpack_fp4(data).long()].view(E, N, G, 32).mul_(factor.unsqueeze(-1)).view(E, N, G * 32)
    q = x.to(torch.float8_e4m3fn)
    diff = (x - q.to(torch.float32)).abs_().nan_to_num_(0.0).view(E, N, G, 32).amax(dim=-1)
    err = _tile_reduce(diff, 0, True).to(torch.float64) * torch.ldexp(torch.ones_like(t, dtype=torch.float64), t.to(torch.float64))
    return BlockFP8(q, _pow2(t), exact, err)


def mxfp4_to_fp8_block(data: torch.Tensor, scales: torch.Tensor) -> BlockFP8:
    """MXFP4 packed [E, N, K/2] + E8M0 scales [E, N, K/32] -> block FP8 with power-of-two tile scales
    (module docstring): bit-exact on every tile whose spread allows it, least loss elsewhere. A group
    whose scale is NaN (0xFF) becomes NaN elements."""
    E, N, Kh = data.shape
    step = max(1, _CHUNK // max(1, N * Kh * 2))
    parts = [_reencode_chunk(data[e0 : e0 + step], scales[e0 : e0 + step]) for e0 in range(0, E, step)]
    if len(parts) == 1:
        return parts[0]
    return BlockFP8(*(torch.cat([getattr(p, f) for p in parts]) for f in ("data", "scale_inv", "exact", "max_error")))


def float_to_fp8_block(x: torch.Tensor) -> BlockFP8:
    """Float [E, N, K] -> block FP8: ``scale_inv = amax / 448`` per tile (1 for a tile of zeros), ``q =
    RNE(x / scale_inv)`` computed in fp32 (clamped to +-448 against a quotient that rounds above it)."""
    E, N, K = x.shape
    nb, kb = tiles(N), tiles(K)
    xf = torch.zeros((E, nb * TILE, kb * TILE), dtype=torch.float32, device=x.device)
    xf[:, :N, :K] = x
    t = xf.view(E, nb, TILE, kb, TILE)
    amax = t.abs().amax(dim=(2, 4))
    # a tensor divisor: CUDA torch turns division by a Python scalar into a multiply by its reciprocal,
    # which rounds differently from the CPU's (and the Triton kernel's) true division
    scale_inv = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (t / scale_inv[:, :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).view(E, nb * TILE, kb * TILE)
    return BlockFP8(q[:, :N, :K].to(torch.float8_e4m3fn), scale_inv)
