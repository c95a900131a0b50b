"""MX numerics (torch path) against an independent exact scalar reference and other libraries.

The reference below is plain Python on ``fractions.Fraction`` / ``math.frexp``; it shares no code
with ``mxconv.mx.numerics`` (spec: ../shared/docs/mx-numerics.md).
"""

from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction

import pytest
import torch

from mxconv.mx import fast as mxfast
from mxconv.mx import formats as mxf
from mxconv.mx import numerics as mxn
from mxconv.errors import BadInput
from mxconv.mx.formats import pack_fp4, unpack_fp4
from mxconv.mx.numerics import dequantize_mx, first_nonfinite, quantize_mx_torch
from mxconv.kernels.quantize import quantize_mx, select_impl

# ---------------------------------------------------------------------------------------------------
# independent scalar reference
# ---------------------------------------------------------------------------------------------------

TWO = Fraction(2)
E2M1_GRID = [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]  # code 0..7


def _e4m3_value(code: int) -> Fraction:
    exp, mant = code >> 3, code & 7
    if exp == 0:
        return Fraction(mant, 8) * TWO**-6
    return (1 + Fraction(mant, 8)) * TWO ** (exp - 7)


E4M3_GRID = [_e4m3_value(c) for c in range(0x7F)]  # codes 0..0x7E (0x7F is NaN)
FMT = {  # fmt -> (max_elem, emax, mantissa bits, positive grid)
    "mxfp4": (Fraction(6), 2, 1, E2M1_GRID),
    "mxfp8": (Fraction(448), 8, 3, E4M3_GRID),
}


def f32(v: float) -> float:
    """Round a Python float to fp32 (through struct) and return it as a float."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def ref_round_f32(q: Fraction) -> Fraction:
    """Round-to-nearest-even of q >= 0 onto the fp32 grid (with subnormals)."""
    if q == 0:
        return q
    e = 0
    while TWO**e > q:
        e -= 1
    while TWO ** (e + 1) <= q:
        e += 1
    quantum = TWO ** (max(e, -126) - 23)
    k = q / quantum
    n = math.floor(k)
    frac = k - n
    if frac > Fraction(1, 2) or (frac == Fraction(1, 2) and n % 2 == 1):
        n += 1
    return n * quantum


def ref_scale_byte(block: list[float], fmt: str, mode: str) -> int:
    """E8M0 byte of one block of fp32-representable floats (mx-numerics §2, exact)."""
    max_elem, emax, mbits, _ = FMT[fmt]
    a = max(abs(v) for v in block)
    if a == 0:
        return 0
    if mode == "floor":
        _, ex = math.frexp(a)
        e = (ex - 1) - emax
    elif mode == "rceil":
        d = ref_round_f32(Fraction(a) / max_elem)
        if d == 0:
            return 0
        m, ex = math.frexp(float(d))
        e = ex - 1 if m == 0.5 else ex  # ceil(log2 d)
    elif mode == "even":
        m, ex = math.frexp(a)  # a = m * 2^ex, m in [0.5, 1)
        sig = Fraction(m) * 2  # [1, 2)
        rounded = Fraction(math.floor(sig * 2**mbits + Fraction(1, 2)), 2**mbits)  # ties away
        e = (ex - 1) + (1 if rounded >= 2 else 0) - emax
    else:
        raise AssertionError(mode)
    return min(max(e + 127, 0), 254)


def ref_code(v: float, byte: int, fmt: str) -> int:
    """Element code of fp32 value v under scale byte: RNE to the grid (ties to even code), saturate."""
    _, _, _, grid = FMT[fmt]
    y = abs(Fraction(v)) / TWO ** (byte - 127)
    i = bisect.bisect_left(grid, y)
    if i == len(grid):
        code = len(grid) - 1  # saturate
    elif grid[i] == y or i == 0:
        code = i
    else:
        lo, hi = grid[i - 1], grid[i]
        if y - lo < hi - y:
            code = i - 1
        elif y - lo > hi - y:
            code = i
        else:
            code = i if i % 2 == 0 else i - 1
    neg = math.copysign(1.0, v) < 0
    return code | ((0x8 if fmt == "mxfp4" else 0x80) if neg else 0)


def ref_quantize(x: torch.Tensor, fmt: str, mode: str) -> tuple[list[int], list[int]]:
    """Reference (codes, scale bytes) of a 1-D/2-D float tensor, flattened block by block."""
    vals = x.float().reshape(-1, 32).tolist()
    codes, scales = [], []
    for block in vals:
        s = ref_scale_byte(block, fmt, mode)
        scales.append(s)
        codes.extend(ref_code(v, s, fmt) for v in block)
    return codes, scales


def our_codes(x: torch.Tensor, fmt: str, mode: str) -> tuple[list[int], list[int]]:
    data, scales = quantize_mx_torch(x, fmt, mode)
    codes = unpack_fp4(data) if fmt == "mxfp4" else data
    return codes.reshape(-1).tolist(), scales.reshape(-1).tolist()


def blocks_with_max(max_values: list[float], others: float = 0.01, seed: int = 0) -> torch.Tensor:
    """fp32 [n, 32]: block i has max_values[i] at position 3 and smaller fill values elsewhere."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(len(max_values), 32, generator=g) * 2 - 1) * others
    x = x * torch.tensor([abs(v) for v in max_values]).unsqueeze(1)
    x[:, 3] = torch.tensor(max_values, dtype=torch.float32)
    return x


# ---------------------------------------------------------------------------------------------------
# reference sanity (the reference itself must agree with the spec's tables)
# ---------------------------------------------------------------------------------------------------


def test_reference_grids_match_spec_and_torch():
    assert [float(v) for v in E2M1_GRID] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert E4M3_GRID[0x7E] == 448 and E4M3_GRID[1] == TWO**-9 and E4M3_GRID[8] == TWO**-6
    as_torch = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    assert as_torch == [float(v) for v in E4M3_GRID]


# ---------------------------------------------------------------------------------------------------
# constants and E2M1 table
# ---------------------------------------------------------------------------------------------------


def test_constants():
    assert mxf.BLOCK_SIZE == 32
    assert mxf.FORMATS == ("mxfp4", "mxfp8")
    assert mxf.SCALE_MODES == ("rceil", "floor", "even")
    assert (mxf.E2M1_MAX, mxf.E2M1_EMAX, mxf.E4M3_MAX, mxf.E4M3_EMAX) == (6.0, 2, 448.0, 8)
    assert (mxf.E8M0_BIAS, mxf.E8M0_NAN) == (127, 0xFF)
    assert list(mxf.E2M1_VALUES) == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert math.copysign(1, mxf.E2M1_VALUES[8]) == -1


def test_e2m1_table_decodes_every_code():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # 32 codes = one block
    data = pack_fp4(codes)
    out = dequantize_mx(data, torch.tensor([127], dtype=torch.uint8), "mxfp4")
    assert out.tolist() == list(mxf.E2M1_VALUES) * 2
    assert torch.signbit(out[8])


@pytest.mark.parametrize("k", [-20, -3, 0, 7, 60])
def test_e2m1_every_tie_rounds_to_even_at_several_scales(k):
    scale = 2.0**k
    # block max 6*2^k -> rceil/floor/even all pick e = k
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expect_values = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    vals = [6.0] + ties + [-t for t in ties]
    vals += [0.0] * (32 - len(vals))
    x = torch.tensor(vals, dtype=torch.float32) * scale
    for mode in mxf.SCALE_MODES:
        data, scales = quantize_mx_torch(x.to(torch.bfloat16), "mxfp4", mode)
        assert scales.tolist() == [127 + k]
        deq = dequantize_mx(data, scales, "mxfp4") / scale
        assert deq[1:8].tolist() == expect_values
        assert deq[8:15].tolist() == [-v for v in expect_values]
        codes = unpack_fp4(data).tolist()
        assert codes[1:8] == [0, 2, 2, 4, 4, 6, 6]
        assert codes[8:15] == [8, 10, 10, 12, 12, 14, 14]  # signs kept, -0.25 -> -0 (0x8)


def test_e2m1_values_one_ulp_off_ties_round_to_nearest():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    below = [f32_from_bits(f32_bits(t) - 1) for t in ties]
    above = [f32_from_bits(f32_bits(t) + 1) for t in ties]
    vals = [6.0] + below + above
    vals += [0.0] * (32 - len(vals))
    x = torch.tensor(vals, dtype=torch.float32)
    codes = unpack_fp4(quantize_mx_torch(x, "mxfp4")[0]).tolist()
    assert codes[1:8] == [0, 1, 2, 3, 4, 5, 6]
    assert codes[8:15] == [1, 2, 3, 4, 5, 6, 7]


def test_e4m3_ties_and_saturation():
    # e = 0 for every mode with block max 448 (1.75 * 2^8: even keeps 1.75 at 3 mantissa bits)
    ties = [1 + 1 / 16, 1 + 3 / 16, 2 ** -9 * 1.5, 2 ** -9 * 0.5, 256 + 16, 416 + 16, 2 ** -6 + 2 ** -10]
    expect = [0x38, 0x3A, 0x02, 0x00, 0x78, 0x7E, 0x08]  # even mantissa wins each tie
    vals = [448.0] + ties + [-t for t in ties]
    vals += [0.0] * (32 - len(vals))
    x = torch.tensor(vals, dtype=torch.float32)
    for mode in mxf.SCALE_MODES:
        data, scales = quantize_mx_torch(x, "mxfp8", mode)
        assert scales.tolist() == [127]
        got = data.tolist()
        assert got[0] == 0x7E
        assert got[1:8] == expect
        assert got[8:15] == [c | 0x80 for c in expect]
    # floor saturates: A = 500 -> e = floor(log2 500) - 8 = 0, 500 -> 448 (0x7E)
    x = torch.zeros(32)
    x[0], x[1], x[2] = 500.0, -479.0, 464.0
    data, scales = quantize_mx_torch(x, "mxfp8", "floor")
    assert scales.tolist() == [127] and data[:3].tolist() == [0x7E, 0xFE, 0x7E]
    data, scales = quantize_mx_torch(x, "mxfp8", "rceil")  # never saturates: e = 1
    # 250 lies between 240 (0x77) and 256 (0x78); -239.5 -> 240; 232 is the 224/240 tie -> 224 (0x76)
    assert scales.tolist() == [128] and data[:3].tolist() == [0x78, 0xF7, 0x76]


def test_fp4_floor_saturation():
    x = torch.zeros(32)
    x[0], x[1] = 7.5, -7.0  # floor: e = 0, 7.5 -> 6, -7 -> tie 6/8 -> 8 -> saturates to -6
    data, scales = quantize_mx_torch(x, "mxfp4", "floor")
    assert scales.tolist() == [127]
    assert unpack_fp4(data)[:2].tolist() == [0x7, 0xF]


# ---------------------------------------------------------------------------------------------------
# scale exponents against the reference, at and one fp32 ulp around the boundaries
# ---------------------------------------------------------------------------------------------------


def _boundary_maxima() -> list[float]:
    out = []
    for k in (-126, -125, -120, -100, -30, -1, 0, 1, 5, 20, 100, 120, 125, 127):
        for m in (1.0, 1.5, 1.75, 1.875, 1.9375, 1.0 + 2**-23, 2 - 2**-23):
            base = m * 2.0**k
            if base > 3.0e38:
                continue
            bits = f32_bits(f32(base))
            out += [f32_from_bits(bits - 1), f32_from_bits(bits), f32_from_bits(bits + 1)]
        for max_elem in (6.0, 448.0):  # A / max_elem exactly a power of two, and its neighbours
            base = max_elem * 2.0 ** (k - 3)
            if base < 3.0e38:
                bits = f32_bits(f32(base))
                out += [f32_from_bits(bits - 1), f32_from_bits(bits), f32_from_bits(bits + 1)]
    out.append(f32_from_bits(0x7F7FFFFF))  # fp32 max
    return out


@pytest.mark.parametrize("fmt", mxf.FORMATS)
@pytest.mark.parametrize("mode", mxf.SCALE_MODES)
def test_scale_byte_at_and_around_powers_of_two_fp32(fmt, mode):
    maxima = _boundary_maxima()
    x = blocks_with_max(maxima)
    _, scales = quantize_mx_torch(x, fmt, mode)
    expect = [ref_scale_byte(row, fmt, mode) for row in x.tolist()]
    assert scales.reshape(-1).tolist() == expect


def test_scale_modes_pick_expected_exponents():
    # A = 1.75: floor -> 0-2, rceil(A/6=0.29) -> -1, even (1.75 rounds to 2 at 1 bit) -> 1-2
    x = torch.zeros(32)
    x[0] = 1.75
    got = {m: quantize_mx_torch(x, "mxfp4", m)[1].item() - 127 for m in mxf.SCALE_MODES}
    assert got == {"floor": -2, "rceil": -1, "even": -1}
    x[0] = 1.7  # even: 1.7 rounds to 1.5 at 1 mantissa bit -> stays in the binade
    got = {m: quantize_mx_torch(x, "mxfp4", m)[1].item() - 127 for m in mxf.SCALE_MODES}
    assert got == {"floor": -2, "rceil": -1, "even": -2}


def test_rceil_one_ulp_above_power_of_two_ratio():
    # A = 6 * 2^k exactly -> e = k; one ulp above -> e = k + 1; one ulp below -> e = k
    for k in (-60, 0, 33):
        a = 6.0 * 2.0**k
        bits = f32_bits(a)
        x = blocks_with_max([f32_from_bits(bits - 1), a, f32_from_bits(bits + 1)])
        assert quantize_mx_torch(x, "mxfp4", "rceil")[1].reshape(-1).tolist() == [127 + k, 127 + k, 128 + k]


# ---------------------------------------------------------------------------------------------------
# zeros, signs, subnormals, tiny blocks
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", mxf.FORMATS)
def test_zero_blocks_and_negative_zero(fmt):
    x = torch.zeros(3, 32)
    x[1] = -0.0
    x[2, 0] = 1.0
    x[2, 1] = -0.0
    x[2, 2] = -1e-6  # rounds to zero, keeps the sign
    data, scales = quantize_mx_torch(x, fmt, "rceil")
    codes = unpack_fp4(data) if fmt == "mxfp4" else data
    neg_zero = 0x8 if fmt == "mxfp4" else 0x80
    assert scales.reshape(-1)[:2].tolist() == [0, 0]
    assert codes[0].tolist() == [0] * 32
    assert codes[1].tolist() == [neg_zero] * 32
    assert codes[2, 1].item() == neg_zero and codes[2, 2].item() == neg_zero
    assert codes[2, 3:].tolist() == [0] * 29


def test_subnormal_element_results():
    # FP4: 0.5 * X is the only subnormal; E4M3: m * 2^-9 * X
    x = torch.zeros(32)
    x[0], x[1], x[2], x[3] = 6.0, 0.5, -0.5, 0.3  # 0.3 -> 0.5
    codes = unpack_fp4(quantize_mx_torch(x, "mxfp4")[0])[:4].tolist()
    assert codes == [0x7, 0x1, 0x9, 0x1]
    x = torch.zeros(32)
    x[0] = 448.0
    x[1:8] = torch.tensor([m * 2.0**-9 for m in range(1, 8)])
    x[8] = 2.0**-10  # tie between 0 and 2^-9 -> 0
    x[9] = f32_from_bits(f32_bits(2.0**-10) + 1)  # just above -> 2^-9
    x[10] = -3 * 2.0**-10  # tie between 1 and 2 (x 2^-9) -> 2
    data, scales = quantize_mx_torch(x, "mxfp8", "rceil")
    assert scales.item() == 127
    assert data[:11].tolist() == [0x7E, 1, 2, 3, 4, 5, 6, 7, 0, 1, 0x82]


@pytest.mark.parametrize("fmt", mxf.FORMATS)
@pytest.mark.parametrize("mode", mxf.SCALE_MODES)
def test_tiny_blocks_and_fp32_subnormal_inputs(fmt, mode):
    p = mxf.FORMAT_PARAMS[fmt]
    thr = p.rceil_min_bits_byte1
    maxima = [f32_from_bits(b) for b in (thr - 2, thr - 1, thr, thr + 1, 1, 0x3FFFFF, 0x400000, 0x7FFFFF, 0x800000)]
    maxima += [f32_from_bits(b) for b in (0x00C00000, 0x01000000, 0x02000000, 0x04000000, 0x08000000)]
    maxima += [-m for m in maxima[:4]]
    g = torch.Generator().manual_seed(1)
    x = blocks_with_max(maxima, others=1.0)
    # mix in fp32 subnormal elements with random mantissas in every block
    sub = (torch.randint(1, 1 << 23, (len(maxima), 8), generator=g, dtype=torch.int32)).view(torch.float32)
    sign = torch.where(torch.rand(len(maxima), 8, generator=g) < 0.5, -1.0, 1.0)
    x[:, 20:28] = sub * sign
    codes, scales = our_codes(x, fmt, mode)
    ref_c, ref_s = ref_quantize(x, fmt, mode)
    assert scales == ref_s
    assert codes == ref_c
    if mode == "rceil":  # byte 0 exactly when fp32(A / max_elem) <= 2^-127
        assert ref_s[:4] == [0, 0, 1, 1]


def test_rceil_threshold_constants_match_numpy_division():
    np = pytest.importorskip("numpy")
    for fmt, max_elem in (("mxfp4", 6.0), ("mxfp8", 448.0)):
        thr = mxf.FORMAT_PARAMS[fmt].rceil_min_bits_byte1
        bound = np.float32(2.0**-127)
        below = np.array([thr - 1], dtype=np.uint32).view(np.float32)[0] / np.float32(max_elem)
        at = np.array([thr], dtype=np.uint32).view(np.float32)[0] / np.float32(max_elem)
        assert below <= bound < at


def test_results_do_not_depend_on_cpu_flush_denormal():
    x = blocks_with_max([1e-39, 3e-39, 2e-38, 1e-37], others=1.0)
    x[:, 10:20] = torch.tensor([1e-40, -2e-39, 5e-41, 7e-39, -9e-40, 1e-45, 3e-39, -1e-39, 2e-40, 4e-39])
    expect = {f: quantize_mx_torch(x, f, "rceil") for f in mxf.FORMATS}
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for f in mxf.FORMATS:
            got = quantize_mx_torch(x, f, "rceil")
            assert torch.equal(got[0], expect[f][0]) and torch.equal(got[1], expect[f][1])
    finally:
        torch.set_flush_denormal(False)


# ---------------------------------------------------------------------------------------------------
# random data against the reference (bf16 and fp32), shapes, chunking
# ---------------------------------------------------------------------------------------------------


def _random_mixed(n_blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mags = 2.0 ** torch.randint(-40, 40, (n_blocks, 1), generator=g).float()
    x = torch.randn(n_blocks, 32, generator=g) * mags
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", mxf.FORMATS)
@pytest.mark.parametrize("mode", mxf.SCALE_MODES)
def test_random_blocks_match_reference(dtype, fmt, mode):
    x = _random_mixed(24, torch.float32, seed=7)
    if dtype == torch.float16:
        x = (x / x.abs().amax(dim=1, keepdim=True) * 1000).to(dtype)
    else:
        x = x.to(dtype)
    codes, scales = our_codes(x, fmt, mode)
    ref_c, ref_s = ref_quantize(x, fmt, mode)
    assert scales == ref_s
    assert codes == ref_c


def test_shapes_noncontiguous_and_chunking(monkeypatch):
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    for fmt, dk in (("mxfp4", 64), ("mxfp8", 128)):
        data, scales = quantize_mx_torch(x, fmt)
        assert data.shape == (3, 5, dk) and data.dtype == torch.uint8
        assert scales.shape == (3, 5, 4) and scales.dtype == torch.uint8
        # a transposed (non-contiguous) view quantizes like its contiguous copy
        xt = torch.randn(128, 6, dtype=torch.bfloat16).t()
        a = quantize_mx_torch(xt, fmt)
        b = quantize_mx_torch(xt.contiguous(), fmt)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        # row chunks give the same bytes as one pass
        monkeypatch.setattr(mxn, "_CHUNK_ELEMS", 200)
        c = quantize_mx_torch(x, fmt)
        monkeypatch.undo()
        assert torch.equal(c[0], data) and torch.equal(c[1], scales)
        assert torch.equal(dequantize_mx(data, scales, fmt), _dequant_chunked(data, scales, fmt, monkeypatch))


def _dequant_chunked(data, scales, fmt, monkeypatch):
    monkeypatch.setattr(mxn, "_CHUNK_ELEMS", 100)
    try:
        return dequantize_mx(data, scales, fmt)
    finally:
        monkeypatch.undo()


def test_empty_leading_dims():
    data, scales = quantize_mx_torch(torch.empty(0, 64), "mxfp4")
    assert data.shape == (0, 32) and scales.shape == (0, 2)


# ---------------------------------------------------------------------------------------------------
# pack / unpack, dequantization
# ---------------------------------------------------------------------------------------------------


def test_pack_unpack_round_trip_and_nibble_order():
    assert pack_fp4(torch.tensor([0x1, 0x2, 0xF, 0x8], dtype=torch.uint8)).tolist() == [0x21, 0x8F]
    assert unpack_fp4(torch.tensor([0x21, 0x8F], dtype=torch.uint8)).tolist() == [0x1, 0x2, 0xF, 0x8]
    codes = torch.randint(0, 16, (4, 3, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (4, 3, 32)
    assert torch.equal(unpack_fp4(packed), codes)
    with pytest.raises(BadInput):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", mxf.FORMATS)
def test_dequant_is_exact(fmt):
    g = torch.Generator().manual_seed(3)
    scales = torch.tensor([0, 1, 2, 60, 127, 128, 200, 240, 255], dtype=torch.uint8)
    n = scales.numel()
    if fmt == "mxfp4":
        codes = torch.randint(0, 16, (n, 32), generator=g, dtype=torch.uint8)
        data = pack_fp4(codes)
        values = [mxf.E2M1_VALUES[c] for c in codes.reshape(-1).tolist()]
    else:
        data = torch.randint(0, 256, (n, 32), generator=g, dtype=torch.uint8)
        data[data == 0x7F] = 0x7E
        data[data == 0xFF] = 0xFE
        values = [(-1 if c & 0x80 else 1) * float(_e4m3_value(c & 0x7F)) for c in data.reshape(-1).tolist()]
    out = dequantize_mx(data, scales.unsqueeze(1), fmt).reshape(-1).tolist()
    for i, (got, v) in enumerate(zip(out, values)):
        s = scales[i // 32].item()
        if s == 255:
            assert math.isnan(got)
            continue
        exact = math.ldexp(v, s - 127)  # exact in double; exactly representable in fp32 here
        assert got == exact and math.copysign(1, got) == math.copysign(1, exact), (i, s, v)
    # bf16 output is lossless as well for these (normal-range) scales
    ok = (scales >= 20) & (scales <= 240)  # bf16 subnormals stop at 2^-133
    bf = dequantize_mx(data[ok], scales[ok].unsqueeze(1), fmt, dtype=torch.bfloat16)
    assert torch.equal(bf.float(), dequantize_mx(data[ok], scales[ok].unsqueeze(1), fmt))


def test_dequant_rejects_mismatched_scales():
    with pytest.raises(BadInput, match="scales of shape"):
        dequantize_mx(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), "mxfp4")


@pytest.mark.parametrize("fmt", mxf.FORMATS)
@pytest.mark.parametrize("mode", mxf.SCALE_MODES)
def test_requantizing_dequantized_values_is_value_exact(fmt, mode):
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    d1, s1 = quantize_mx_torch(x, fmt, mode)
    v1 = dequantize_mx(d1, s1, fmt)
    d2, s2 = quantize_mx_torch(v1, fmt, mode)
    assert torch.equal(dequantize_mx(d2, s2, fmt), v1)
    if mode == "rceil":  # bf16 round trip is lossless too
        assert torch.equal(dequantize_mx(*quantize_mx_torch(v1.bfloat16(), fmt), fmt), v1)


# ---------------------------------------------------------------------------------------------------
# measured error (§6)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt,mode,expected",
    [
        ("mxfp4", "rceil", 0.1153),
        ("mxfp4", "floor", 0.1148),
        ("mxfp4", "even", 0.1119),
        ("mxfp8", "rceil", 0.0266),
        ("mxfp8", "floor", 0.0293),
        ("mxfp8", "even", 0.0276),
    ],
)
def test_relative_rms_error_on_gaussian(fmt, mode, expected):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4096, generator=g).to(torch.bfloat16)
    data, scales = quantize_mx_torch(x, fmt, mode)
    xf = x.float()
    rel = ((dequantize_mx(data, scales, fmt) - xf).norm() / xf.norm()).item()
    assert abs(rel - expected) <= 0.1 * expected, rel


# ---------------------------------------------------------------------------------------------------
# errors, non-finite detection, dispatcher
# ---------------------------------------------------------------------------------------------------


def test_bad_input_messages():
    with pytest.raises(BadInput, match="K=48 is not a multiple of 32"):
        quantize_mx_torch(torch.zeros(2, 48), "mxfp4")
    with pytest.raises(BadInput, match="unknown MX format 'mxfp6'"):
        quantize_mx_torch(torch.zeros(2, 64), "mxfp6")
    with pytest.raises(BadInput, match="unknown scale rounding 'ceil'"):
        quantize_mx_torch(torch.zeros(2, 64), "mxfp8", "ceil")
    with pytest.raises(BadInput, match="int32"):
        quantize_mx_torch(torch.zeros(2, 64, dtype=torch.int32), "mxfp8")
    with pytest.raises(BadInput, match="K=48"):
        quantize_mx(torch.zeros(2, 48), "mxfp4")


def test_first_nonfinite():
    x = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    assert first_nonfinite(x) is None
    x[1, 2, 17] = float("inf")
    x[2, 0, 0] = float("nan")
    assert first_nonfinite(x) == (1, 2, 17)
    y = torch.zeros(5, 7)
    y[4, 6] = float("-inf")
    assert first_nonfinite(y) == (4, 6)
    assert first_nonfinite(y[:, :6]) is None  # non-contiguous view
    assert first_nonfinite(torch.zeros(3, dtype=torch.int64)) is None


def test_quantizer_dispatch_on_cpu():
    x = torch.randn(4, 64)
    assert select_impl(x) == "torch"
    a = quantize_mx(x, "mxfp4", impl="auto")
    b = quantize_mx_torch(x, "mxfp4")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(BadInput, match="unknown quantizer implementation"):
        quantize_mx(x, "mxfp4", impl="cuda")
    import os

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.importorskip("triton")
        with pytest.raises(BadInput, match="needs a CUDA tensor"):
            quantize_mx(x, "mxfp4", impl="triton")


# ---------------------------------------------------------------------------------------------------
# independent libraries
# ---------------------------------------------------------------------------------------------------


def test_compressed_tensors_decodes_our_bytes():
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    del ct
    x = torch.randn(16, 256, dtype=torch.bfloat16) * 0.02
    for fmt, comp, preset in (
        ("mxfp4", MXFP4PackedCompressor, "MXFP4A16"),
        ("mxfp8", MXFP8QuantizationCompressor, "MXFP8A16"),
    ):
        data, scales = quantize_mx_torch(x, fmt)
        scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])
        if fmt == "mxfp4":
            sd = {"weight_packed": data, "weight_scale": scales}
        else:
            sd = {"weight": data.view(torch.float8_e4m3fn), "weight_scale": scales}
        theirs = comp.decompress(sd, scheme)["weight"]
        ours = dequantize_mx(data, scales, fmt, dtype=torch.bfloat16)
        assert theirs.shape == ours.shape
        assert torch.equal(theirs.to(torch.bfloat16), ours), fmt


@pytest.mark.parametrize("fmt", mxf.FORMATS)
@pytest.mark.parametrize("mode", mxf.SCALE_MODES)
def test_torchao_to_mx_gives_identical_bytes_on_bf16(fmt, mode):
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception:  # noqa: BLE001 - not installed, or its build does not match this torch
        pytest.skip("torchao's MX formats are not importable")
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(64, 512, generator=g) * 2.0 ** torch.randint(-20, 20, (64, 1), generator=g)).to(torch.bfloat16)
    elem = torch.float4_e2m1fn_x2 if fmt == "mxfp4" else torch.float8_e4m3fn
    s_ao, d_ao = to_mx(x, elem, 32, getattr(ScaleCalculationMode, mode.upper()))
    data, scales = quantize_mx_torch(x, fmt, mode)
    assert torch.equal(s_ao.view(torch.uint8).reshape(scales.shape), scales)
    assert torch.equal(d_ao.view(torch.uint8).reshape(data.shape), data)


# ---------------------------------------------------------------------------------------------------
# the fast CPU path (bit-pattern block maxima, E2M1 table, fp8 cast) against the exact path
# ---------------------------------------------------------------------------------------------------


def _fast_path_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    xs = [_random_mixed(64, torch.float32, seed=3), torch.randn(48, 256, generator=g) * 0.02]
    # every E2M1 / E4M3 midpoint and its fp32 neighbours, at block maxima that put them on the grid
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 7.5, 2.0**-10, 3 * 2.0**-10, 440.0, 456.0])
    bits = mids.view(torch.int32)
    near = torch.stack([bits - 2, bits - 1, bits, bits + 1, bits + 2]).reshape(-1).view(torch.float32)
    row = torch.cat([near, -near])[:64]
    row[0] = 6.0
    for scale in (1.0, 2.0**-7, 2.0**20, 448.0 / 6.0, 2.0**-100, 2.0**100, 0.75):
        xs.append(row.unsqueeze(0).repeat(3, 1) * scale)
    # random bit patterns (fp32 subnormals included), both signs
    raw = torch.randint(0, 0x7F000000, (64, 64), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    xs.append(raw * torch.where(torch.rand(64, 64, generator=g) < 0.5, -1.0, 1.0))
    # zero blocks, -0, and a chunk holding one tiny block (exact path) next to ordinary ones
    mixed = torch.randn(8, 64, generator=g)
    mixed[1] = 0.0
    mixed[2] = -0.0
    mixed[5, :32] *= 1e-38
    xs.append(mixed)
    out = []
    for x in xs:
        if dtype == torch.float16:
            x = (x / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) * 1000).nan_to_num()
        x = x.to(dtype)
        out.append(torch.where(torch.isfinite(x), x, torch.zeros_like(x)))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", mxf.FORMATS)
@pytest.mark.parametrize("mode", mxf.SCALE_MODES)
def test_fast_path_equals_exact_path(dtype, fmt, mode, monkeypatch):
    monkeypatch.setattr(mxn, "_CHUNK_ELEMS", 256)  # several chunks, some of them on the exact path
    for x in _fast_path_inputs(dtype):
        fast = quantize_mx_torch(x, fmt, mode)
        exact = quantize_mx_torch(x, fmt, mode, fast=False)
        assert torch.equal(fast[1], exact[1]), (dtype, fmt, mode)
        assert torch.equal(fast[0], exact[0]), (dtype, fmt, mode)


def test_fast_path_falls_back_only_for_tiny_nonzero_blocks():
    x = torch.randn(4, 64)
    x[1] = 0.0
    d = torch.empty(4, 32, dtype=torch.uint8)
    s = torch.empty(4, 2, dtype=torch.uint8)
    assert mxfast.quantize_rows_fast(x, "mxfp4", "rceil", d, s)  # zero blocks (byte 0) stay on it
    x[2, 40] = 1e-39
    x[2, 32:40] = 0.0
    x[2, 41:] = 0.0
    assert not mxfast.quantize_rows_fast(x, "mxfp4", "rceil", d, s)


def test_e2m1_table_with_round_to_odd_keys_equals_threshold_counting():
    # every fp32 value within 64 ulps of each threshold and of each grid value, plus random ones
    anchors = torch.tensor(list(mxf.E2M1_MIDPOINTS) + [abs(v) for v in mxf.E2M1_VALUES[:8]] + [8.0, 12.0, 2.0**-3])
    offs = torch.arange(-64, 65, dtype=torch.int32)
    y = (anchors.view(torch.int32).unsqueeze(1) + offs).reshape(-1).view(torch.float32)
    g = torch.Generator().manual_seed(5)
    y = torch.cat([y, torch.rand(200_000, generator=g) * 9, torch.rand(1000, generator=g) * 2.0**-120])
    y = torch.cat([y, -y])
    lut = mxfast._e2m1_lut(y.device)
    got = lut[mxfast._e2m1_keys(y).long()]
    assert torch.equal(got, mxf.e2m1_codes(y))
    yb = y.to(torch.bfloat16)
    assert torch.equal(lut[mxfast._e2m1_keys(yb).long()], mxf.e2m1_codes(yb.float()))


def test_fast_path_without_a_saturating_fp8_cast(monkeypatch):
    x = blocks_with_max([1.9375 * 2.0**k for k in range(-8, 8)], others=1.0)  # floor/even saturate at 448
    want = {m: quantize_mx_torch(x, "mxfp8", m, fast=False) for m in mxf.SCALE_MODES}
    assert mxfast._fp8_cast_saturates(x.device) == (
        torch.tensor([464.0, -1e30]).to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [0x7E, 0xFE])
    monkeypatch.setitem(mxfast._FP8_CAST_SATURATES, str(x.device), False)  # the clamp path
    for m, (d, s) in want.items():
        got = quantize_mx_torch(x, "mxfp8", m)
        assert torch.equal(got[0], d) and torch.equal(got[1], s), m


def test_dequant_tables_match_the_formula():
    every = torch.arange(256, dtype=torch.uint8)
    scales = torch.tensor([0, 1, 100, 127, 200, 254, 255], dtype=torch.uint8)
    for fmt in mxf.FORMATS:
        per_block = 16 if fmt == "mxfp4" else 32
        data = every.repeat(len(scales) * 2)[: len(scales) * 2 * per_block].view(len(scales), 2 * per_block)
        sc = scales.unsqueeze(1).repeat(1, 2)
        if fmt == "mxfp4":
            lut = torch.tensor(mxf.E2M1_VALUES)
            vals = lut[unpack_fp4(data).long()]
        else:
            vals = data.view(torch.float8_e4m3fn).float()
        want = (vals.view(len(scales), 2, 32) * mxf.scales_to_float(sc).unsqueeze(-1)).view(len(scales), 64)
        for dtype in (torch.float32, torch.bfloat16):
            got = dequantize_mx(data, sc, fmt, dtype)
            w = want.to(dtype)
            assert torch.equal(torch.isnan(got), torch.isnan(w))
            assert torch.equal(got.nan_to_num(0.0), w.nan_to_num(0.0)), (fmt, dtype)


def test_first_nonfinite_fast_check(monkeypatch):
    monkeypatch.setattr(mxn, "_FINITE_CHUNK", 100)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        x = torch.randn(7, 300).to(dtype)
        assert first_nonfinite(x) is None
        for val in (float("nan"), float("inf"), float("-inf")):
            for pos in ((0, 0), (3, 151), (6, 299)):
                y = x.clone()
                y[pos] = val
                assert first_nonfinite(y) == pos, (dtype, val, pos)
        y = x.clone()
        y[4, 5], y[2, 250] = float("inf"), float("-inf")  # +inf and -inf in different chunks
        assert first_nonfinite(y) == (2, 250)
    # finite values whose sum overflows: the exact scan decides
    big = torch.full((4, 64), 3e38)
    assert first_nonfinite(big) is None and first_nonfinite(big.bfloat16()) is None
    big[3, 7] = float("nan")
    assert first_nonfinite(big) == (3, 7)


@pytest.mark.parametrize("fmt", mxf.FORMATS)
def test_error_sums_match_the_dequantized_error(fmt, monkeypatch):
    monkeypatch.setattr(mxn, "_CHUNK_ELEMS", 1000)
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(3, 40, 256, generator=g) * 0.02).to(torch.bfloat16)
    sums = [0.0, 0.0]
    d, s = quantize_mx(x, fmt, "rceil", error_sums=sums)
    ref = x.double()
    want_err = float((dequantize_mx(d, s, fmt).double() - ref).square().sum())
    want_ref = float(ref.square().sum())
    assert sums[0] == pytest.approx(want_err, rel=1e-5) and sums[1] == pytest.approx(want_ref, rel=1e-5)
    assert mxn.mx_error_sums(x, d, s, fmt) == pytest.approx((want_err, want_ref), rel=1e-5)
    assert (sums[0] / sums[1]) ** 0.5 == pytest.approx(0.1153 if fmt == "mxfp4" else 0.0266, rel=0.05)
