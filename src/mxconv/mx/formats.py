"""The MX formats themselves (see :mod:`mxconv.mx.numerics`, whose docstring gives the rules): block
size and formats, the E2M1 / E4M3 / E8M0 constants and per-format scale parameters, argument
checks, the E8M0 scale-byte rules, the exact element scaling, E2M1 / E4M3 codes, FP4 packing and
E8M0 decoding. The torch quantizer (:mod:`mxconv.mx.numerics`, :mod:`mxconv.mx.fast`) and the
Triton kernels are built on these; other modules import them through :mod:`mxconv.mx.numerics`,
except the ones ``mxconv inspect`` imports (:mod:`mxconv.run.plan`, :mod:`mxconv.layouts.marlin_bytemap`):
:mod:`mxconv.mx.numerics` imports torch, this module imports it lazily, in the functions that compute.
"""

from __future__ import annotations

import struct
from fractions import Fraction
from typing import TYPE_CHECKING

from mxconv.errors import BadInput

if TYPE_CHECKING:
    import torch

# ---------------------------------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------------------------------

BLOCK_SIZE = 32
FORMATS: tuple[str, ...] = ("mxfp4", "mxfp8")
SCALE_MODES: tuple[str, ...] = ("rceil", "floor", "even")
# The rule "auto" picks per format: the lowest weight and layer-output error measured by
# scripts/numerics_table.py on Gaussian, Student-t and outlier weights (docs/numerics.md).
DEFAULT_SCALE_MODES: dict[str, str] = {"mxfp4": "even", "mxfp8": "rceil"}


def resolve_scale_mode(fmt: str, mode: str) -> str:
    """``mode``, or the format's default rule when ``mode`` is "auto"."""
    return DEFAULT_SCALE_MODES[fmt] if mode == "auto" else mode

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MAX_FINITE = 254

# E2M1 (FP4): max 6 = 1.5 * 2^2, one mantissa bit.
E2M1_MAX = 6.0
E2M1_EMAX = 2
E2M1_MBITS = 1
# value of each 4-bit code (bit 3 = sign), code order 0x0 .. 0xF
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
# |y| boundaries between consecutive E2M1 magnitudes (codes 0..7). A tie goes to the even code: the
# ties 0.25, 1.25, 2.5, 5 (lower code even) round down, 0.75, 1.75, 3.5 (lower code odd) round up.
E2M1_MIDPOINTS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_TIE_ROUNDS_UP: tuple[bool, ...] = (False, True, False, True, False, True, False)

# E4M3 (float8_e4m3fn): max 448 = 1.75 * 2^8, three mantissa bits.
E4M3_MAX = 448.0
E4M3_EMAX = 8
E4M3_MBITS = 3

SCALE_MODE_IDS: dict[str, int] = {"rceil": 0, "floor": 1, "even": 2}

# Blocks whose scale byte is <= this are the only ones where an fp32-subnormal input can round to a
# non-zero element (E4M3's smallest half-step is 2^-10 = 2^-126 * 2^116, so e <= -117, byte <= 10).
SUBNORMAL_FIX_MAX_BYTE = 10

# fp32 bit-field helpers
_F32_MANT_MASK = 0x007FFFFF
F32_ABS_MASK = 0x7FFFFFFF


def _f32_bits(value: float) -> int:
    """Bit pattern of ``value`` rounded to fp32 (int in [0, 2^32))."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _f32_from_bits(bits: int) -> float:
    """The fp32 value with bit pattern ``bits`` (int in [0, 2^32)), as a Python float."""
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _round_fraction_to_f32(q: Fraction) -> Fraction:
    """Exact round-to-nearest-even of a non-negative rational to fp32 (subnormals included, no overflow)."""
    if q == 0:
        return Fraction(0)
    exp = q.numerator.bit_length() - q.denominator.bit_length()  # floor(log2 q) or one more
    if Fraction(2) ** exp > q:
        exp -= 1
    ulp = Fraction(2) ** (max(exp, -126) - 23)
    n, rem = divmod(q, ulp)
    if rem * 2 > ulp or (rem * 2 == ulp and n % 2 == 1):
        n += 1
    return n * ulp


def _rceil_min_bits_byte1(max_elem: float) -> int:
    """Smallest fp32 bit pattern of A for which fp32(A / max_elem) > 2^-127 (rceil byte >= 1).

    Below it the ratio rounds to at most 2^-127 and rceil stores byte 0.
    """
    target = Fraction(2) ** -127
    lo, hi = 0, 0x7F800000  # search over positive finite bit patterns (monotone in value)
    while lo < hi:
        mid = (lo + hi) // 2
        a = Fraction(_f32_from_bits(mid))
        if _round_fraction_to_f32(a / Fraction(max_elem)) > target:
            hi = mid
        else:
            lo = mid + 1
    return lo


class _FormatParams:
    """Per-format integer constants of the scale rules (shared with the Triton kernels)."""

    def __init__(self, name: str, max_elem: float, emax: int, mbits: int) -> None:
        self.name = name
        self.max_elem = max_elem
        self.emax = emax
        self.mbits = mbits
        # rceil: the exponent goes up by one when A's mantissa field exceeds max_elem's
        self.rceil_mant_threshold = _f32_bits(max_elem) & _F32_MANT_MASK
        self.rceil_min_bits_byte1 = _rceil_min_bits_byte1(max_elem)
        # even: add half an ulp of the element's mantissa width (ties away) before taking the exponent
        self.even_round_add = 1 << (22 - mbits)


FORMAT_PARAMS: dict[str, _FormatParams] = {
    "mxfp4": _FormatParams("mxfp4", E2M1_MAX, E2M1_EMAX, E2M1_MBITS),
    "mxfp8": _FormatParams("mxfp8", E4M3_MAX, E4M3_EMAX, E4M3_MBITS),
}


# ---------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------


def check_args(x: torch.Tensor, fmt: str, scale_rounding: str) -> None:
    """Raise BadInput unless ``x`` is a float tensor [..., K] with K % 32 == 0 and fmt/mode are known."""
    import torch

    if fmt not in FORMATS:
        raise BadInput(f"unknown MX format {fmt!r}; supported: {', '.join(FORMATS)}")
    if scale_rounding not in SCALE_MODES:
        raise BadInput(f"unknown scale rounding {scale_rounding!r}; supported: {', '.join(SCALE_MODES)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise BadInput(f"cannot quantize a {x.dtype} tensor to {fmt}: expected bfloat16, float16 or float32")
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE != 0:
        k = "a scalar" if x.dim() == 0 else f"last dim K={x.shape[-1]}"
        raise BadInput(f"cannot quantize a tensor of shape {tuple(x.shape)} to {fmt}: {k} is not a multiple of {BLOCK_SIZE}")


# ---------------------------------------------------------------------------------------------------
# scale bytes
# ---------------------------------------------------------------------------------------------------


def scale_bytes_from_amax_bits(amax_bits: torch.Tensor, fmt: str, scale_rounding: str) -> torch.Tensor:
    """E8M0 byte per block from the fp32 bit pattern of its max |x|.

    amax_bits: int32 [...] (non-negative: bits of a finite |x|). Returns int32 [...] in [0, 254].
    """
    import torch

    p = FORMAT_PARAMS[fmt]
    exp_field = amax_bits >> 23
    if scale_rounding == "floor":
        e = exp_field - (E8M0_BIAS + p.emax)
    elif scale_rounding == "rceil":
        bump = ((amax_bits & _F32_MANT_MASK) > p.rceil_mant_threshold).to(torch.int32)
        e = exp_field - (E8M0_BIAS + p.emax) + bump
        # ratio A/max_elem subnormal and rounding to <= 2^-127: byte 0
        e = torch.where(amax_bits < p.rceil_min_bits_byte1, -E8M0_BIAS, e)
    elif scale_rounding == "even":
        e = ((amax_bits + p.even_round_add) >> 23) - (E8M0_BIAS + p.emax)
    else:
        raise BadInput(f"unknown scale rounding {scale_rounding!r}; supported: {', '.join(SCALE_MODES)}")
    return (e + E8M0_BIAS).clamp_(0, E8M0_MAX_FINITE)


def pow2_from_byte(byte: torch.Tensor, negate: bool) -> torch.Tensor:
    """fp32 2^(s-127) (negate=False) or 2^(127-s) (negate=True) for int32 bytes s in [1, 253] exactly."""
    import torch

    field = (2 * E8M0_BIAS - byte) if negate else byte
    return (field << 23).view(torch.float32)


# ---------------------------------------------------------------------------------------------------
# elements
# ---------------------------------------------------------------------------------------------------


def scaled_blocks(xb: torch.Tensor, byte: torch.Tensor) -> torch.Tensor:
    """y = x * 2^-e exactly, per block.

    xb: fp32 [R, nb, 32]; byte: int32 [R, nb] in [0, 253]. Returns fp32 [R, nb, 32].
    """
    import torch

    y = xb * pow2_from_byte(byte, negate=True).unsqueeze(-1)
    low = byte <= SUBNORMAL_FIX_MAX_BYTE
    if bool(low.any()):
        bits = xb.view(torch.int32)
        sub = ((bits & 0x7F800000) == 0) & low.unsqueeze(-1)
        if bool(sub.any()):
            # |x| = m * 2^-149 with m < 2^23: rebuild as float(m) * 2^(-149-e), 2^(-149-e) normal here
            e = byte - E8M0_BIAS
            mult = ((E8M0_BIAS - 149 - e) << 23).clamp_(min=1 << 23).view(torch.float32)
            mag = (bits & _F32_MANT_MASK).to(torch.float32) * mult.unsqueeze(-1)
            exact = torch.where(bits < 0, -mag, mag)
            y = torch.where(sub, exact, y)
    return y


# |y| thresholds between consecutive E2M1 magnitudes: code = number of thresholds strictly below |y|.
# A tie whose lower code is odd must round up, so that threshold is moved one fp32 ulp down.
_E2M1_THRESHOLDS: tuple[float, ...] = tuple(
    _f32_from_bits(_f32_bits(mid) - 1) if up else mid for mid, up in zip(E2M1_MIDPOINTS, E2M1_TIE_ROUNDS_UP)
)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) of fp32 y (already scaled): RNE, saturating at 6, sign kept.

    Counts the rounding thresholds below |y| (exact comparisons, so sticky bits are exact).
    """
    import torch

    ay = y.abs()
    codes = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    above = torch.empty(y.shape, dtype=torch.bool, device=y.device)
    for threshold in _E2M1_THRESHOLDS:
        torch.gt(ay, threshold, out=above)
        codes += above
    return codes | (torch.signbit(y).to(torch.uint8) << 3)


def e4m3_bytes(y: torch.Tensor) -> torch.Tensor:
    """E4M3 bit patterns (uint8) of fp32 y: clamp to +-448 (keeps -0), cast RNE."""
    import torch

    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes uint8 [..., K] (K even, values 0..15) into bytes uint8 [..., K/2].

    Element 2i goes to the low nibble, 2i+1 to the high nibble.
    """
    import torch

    if codes.shape[-1] % 2 != 0:
        raise BadInput(f"cannot pack {codes.shape[-1]} FP4 codes into bytes: the last dim must be even")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def unpack_fp4(data: torch.Tensor) -> torch.Tensor:
    """Unpack bytes uint8 [..., K/2] into E2M1 codes uint8 [..., K] (low nibble = even element)."""
    import torch

    if data.dtype != torch.uint8:
        raise BadInput(f"packed FP4 data must be uint8, got {data.dtype}")
    return torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2)


def scales_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes uint8 [...] -> exact fp32 2^(s-127) [...]; byte 0 -> 2^-127 (subnormal), 0xFF -> NaN."""
    import torch

    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)
    bits = torch.where(s == E8M0_NAN, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)
