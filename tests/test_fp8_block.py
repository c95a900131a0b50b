"""``mxconv.mx.fp8_block``: MXFP4 -> block FP8 with power-of-two tile scales (exact where the
tile's binade spread allows it, least loss elsewhere) and float -> block FP8 (amax / 448), checked
against an exact rational oracle: the E4M3 value set as fractions, nearest-even by brute force."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from mxconv.mx.formats import E2M1_VALUES
from mxconv.mx.fp8_block import (
    MAX_EXACT_SPREAD,
    float_to_fp8_block,
    mxfp4_to_fp8_block,
    tile_exponents,
)
from mxconv.mx.numerics import dequantize_fp8_block, dequantize_mx

# every finite E4M3 value, by code, and the non-negative ones sorted (code even = mantissa lsb 0)
_E4M3 = [(c, Fraction(float(v))) for c, v in enumerate(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist())
         if not math.isnan(v)]
_POS = sorted((v, c) for c, v in _E4M3 if v >= 0 and c < 0x80)
_REPRESENTABLE = {v for _, v in _E4M3}


def _rne(x: Fraction) -> Fraction:
    """The E4M3 value nearest to x, ties to the even code (x within +-448)."""
    a = abs(x)
    best = min(_POS, key=lambda vc: (abs(vc[0] - a), vc[1] % 2))
    return best[0] if x >= 0 else -best[0]


def _mx_values(data: torch.Tensor, scales: torch.Tensor) -> list[list[Fraction]]:
    """The exact values of one expert's MXFP4 rows as fractions."""
    codes = torch.stack((data & 15, data >> 4), -1).flatten(-2)
    out = []
    for r in range(codes.shape[0]):
        out.append([Fraction(E2M1_VALUES[int(c)]) * Fraction(2) ** (int(scales[r, j // 32]) - 127)
                    for j, c in enumerate(codes[r].tolist())])
    return out


def _oracle_tile(vals: list[Fraction]) -> tuple[bool, Fraction, list[Fraction]]:
    """(exact?, 2^t, dequantized values): the power-of-two scale found by search, the smallest one
    with no overflow when no scale is exact."""
    nz = [abs(v) for v in vals if v]
    if not nz:
        return True, Fraction(1), list(vals)
    top = max(nz)
    t = -200
    while top / Fraction(2) ** t > 448:
        t += 1
    for tt in range(t, t + 40):
        if all(v / Fraction(2) ** tt in _REPRESENTABLE for v in vals):
            return True, Fraction(2) ** tt, list(vals)
    s = Fraction(2) ** t
    return False, s, [_rne(v / s) * s for v in vals]


def _check_against_oracle(data: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """Compare every tile of a one-expert stack with the oracle; (tiles, inexact tiles)."""
    out = mxfp4_to_fp8_block(data, scales)
    deq = dequantize_fp8_block(out.data, out.scale_inv, (128, 128))[0]
    vals = _mx_values(data[0], scales[0])
    N, K = len(vals), len(vals[0])
    inexact = 0
    for bi in range(-(-N // 128)):
        for bj in range(-(-K // 128)):
            rows, cols = range(bi * 128, min(N, bi * 128 + 128)), range(bj * 128, min(K, bj * 128 + 128))
            tile = [vals[r][c] for r in rows for c in cols]
            exact, scale, want = _oracle_tile(tile)
            got = [Fraction(float(deq[r, c])) for r in rows for c in cols]
            assert bool(out.exact[0, bi, bj]) == exact, (bi, bj)
            assert Fraction(float(out.scale_inv[0, bi, bj])) == scale, (bi, bj)
            assert got == want, (bi, bj)
            err = max(abs(g - v) for g, v in zip(got, tile))
            assert Fraction(float(out.max_error[0, bi, bj])) == err
            inexact += not exact
    return -(-N // 128) * -(-K // 128), inexact


def _stack(N: int, K: int, code: int = 2, scale: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.full((1, N, K // 2), code | (code << 4), dtype=torch.uint8)
    return data, torch.full((1, N, K // 32), scale, dtype=torch.uint8)


@pytest.mark.parametrize(
    "low_code, low_scale, exact",
    [
        (1, 127 - 15, True),   # 0.5 * 2^-15 = 2^-16: last bit 2^-16, spread 17 from the top's 2^1
        (1, 127 - 16, False),  # 2^-17: spread 18
        (2, 127 - 16, True),   # 1.0 * 2^-16: spread 17
        (3, 127 - 15, True),   # 1.5 * 2^-15: leading bit 2^-15, last bit 2^-16: spread 17
        (3, 127 - 16, False),  # 1.5 * 2^-16: leading bit within 17 binades, last bit 2^-17 is not
    ],
)
def test_boundary_tiles(low_code: int, low_scale: int, exact: bool) -> None:
    """A tile whose top element is 4 * 2^-1 = 2 (leading bit 2^1) next to one small element: exact
    iff the small element's last set bit is within 17 binades of 2^1."""
    data, scales = _stack(128, 128, code=0)
    data[0, 0, 0] = 6  # element (0, 0): 4.0 at scale 2^-1
    scales[0, 0, 0] = 126
    data[0, 5, 16] = low_code  # element (5, 32): the small one, its own group of 32
    scales[0, 5, 1] = low_scale
    top, low = tile_exponents(data, scales)
    assert int(top) == 1 and (int(top) - int(low) <= MAX_EXACT_SPREAD) is exact
    out = mxfp4_to_fp8_block(data, scales)
    assert bool(out.exact[0, 0, 0]) is exact
    assert _check_against_oracle(data, scales) == (1, 0 if exact else 1)


def test_random_tiles_match_the_oracle() -> None:
    """Partial edge tiles (N = 200, K = 320), spreads on both sides of the boundary."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (1, 200, 160), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 128, (1, 200, 10), dtype=torch.uint8, generator=g)
    scales[0, 130:, 4:8] = 100  # tile (1, 1): 20+ binades of spread -> inexact
    scales[0, 3, 0] = 0  # tile (0, 0): the smallest scale -> inexact
    tiles, inexact = _check_against_oracle(data, scales)
    assert (tiles, inexact) == (6, 2)


def test_exact_tiles_dequantize_bit_equal_to_mxfp4() -> None:
    """gpt-oss-like scales (a few binades per tile): every tile exact and the fp32 dequantizations
    equal bit for bit, edge tiles and extreme scale bytes (0 and 254) included."""
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (3, 130, 96), dtype=torch.uint8, generator=g)
    scales = torch.randint(117, 125, (3, 130, 6), dtype=torch.uint8, generator=g)
    scales[1] = torch.randint(0, 4, (130, 6), dtype=torch.uint8, generator=g)
    scales[2] = torch.randint(245, 254, (130, 6), dtype=torch.uint8, generator=g)
    out = mxfp4_to_fp8_block(data, scales)
    assert bool(out.exact.all())
    assert float(out.max_error.max()) == 0.0
    ref = dequantize_mx(data, scales, "mxfp4")
    got = dequantize_fp8_block(out.data, out.scale_inv, (128, 128))
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


def test_nan_scale_groups_become_nan() -> None:
    data, scales = _stack(128, 64)
    scales[0, 7, 1] = 0xFF
    out = mxfp4_to_fp8_block(data, scales)
    deq = dequantize_fp8_block(out.data, out.scale_inv, (128, 128))
    assert deq[0, 7, 32:].isnan().all() and not deq[0, 7, :32].isnan().any() and bool(out.exact.all())


def test_float_rule_amax_over_448() -> None:
    """scale_inv = amax / 448 per tile; q is the nearest-even E4M3 of x / scale_inv; zero tile -> 1."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 130, 140, generator=g).to(torch.bfloat16)
    x[1, 128:, 128:] = 0
    out = float_to_fp8_block(x)
    xf = x.float()
    for e, bi, bj in [(0, 0, 0), (0, 1, 1), (1, 0, 1)]:
        tile = xf[e, bi * 128 : bi * 128 + 128, bj * 128 : bj * 128 + 128]
        s = torch.tensor(float(tile.abs().max()), dtype=torch.float32) / 448
        assert out.scale_inv[e, bi, bj] == s
        q = out.data[e, bi * 128 : bi * 128 + 128, bj * 128 : bj * 128 + 128].float()
        for v, got in list(zip((tile / s).flatten().tolist(), q.flatten().tolist()))[::37]:
            assert Fraction(got) == _rne(Fraction(v))
    assert float(out.scale_inv[1, 1, 1]) == 1.0 and not out.data[1, 128:, 128:].float().any()
