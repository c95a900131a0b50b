"""MX (OCP Microscaling) numerics: constants and the exact torch reference path.

Everything here follows ../shared/docs/mx-numerics.md bit for bit:

* block size 32 along the last dim K; one E8M0 scale byte ``s`` per block meaning ``2^(s - 127)``;
* MXFP4: E2M1 codes, two per byte, element ``2i`` in the low nibble;
* MXFP8: E4M3 (``float8_e4m3fn``) bytes;
* scale modes ``rceil`` (default), ``floor`` (OCP), ``even`` (AMD/torchao EVEN), computed with integer
  operations on the fp32 bit pattern of the block maximum ``A`` (never a float ``log2``);
* elements round to nearest, ties to even, saturate at the format maximum and keep the sign of zero.

All functions are pure torch and give the same bytes on CPU and CUDA tensors. The Triton kernels in
``mxconv.kernels.mx_triton`` import their constants from here and must produce identical bytes.

How the bytes are computed (shared with the Triton kernels):

1. ``x`` is upcast to fp32 (exact for bf16/fp16); ``A = max |x|`` per block, taken on the bit patterns.
2. The exponent ``e`` comes from ``A``'s exponent field ``ea`` and mantissa field ``ma``
   (``emax`` = 2 for E2M1, 8 for E4M3):

   * floor: ``e = ea - 127 - emax``
   * rceil: ``e = ea - 127 - emax + (ma > mantissa field of max_elem)``; this equals
     ``ceil(log2(fp32(A / max_elem)))`` for every ``A`` whose ratio is a normal fp32 number. Where the
     ratio is subnormal the byte is 0 when ``fp32(A / max_elem) <= 2^-127`` (``A`` below
     ``RCEIL_MIN_BITS_BYTE1``) and 1 otherwise.
   * even: ``e = ((bits(A) + 2^(22 - mbits)) >> 23) - 127 - emax`` (round ``A`` to the element's
     mantissa width, ties away, and take the exponent of the result).

   The byte is ``clamp(e + 127, 0, 254)``; for finite input it never exceeds 253.
3. ``y = x * 2^-e`` is exact (``2^-e`` is a normal fp32 number since the byte is <= 253). Subnormal
   fp32 inputs are rebuilt from their mantissa integer (``m * 2^(-149-e)``) in blocks whose byte is at
   most ``SUBNORMAL_FIX_MAX_BYTE``, so the result does not depend on flush-to-zero modes (Triton on
   NVIDIA flushes fp32 subnormals); in every other block a subnormal input rounds to a signed zero.
4. MXFP4: ``y`` is rounded to the E2M1 grid by counting the midpoints below ``|y|`` (a midpoint
   whose lower code is odd is moved one ulp down, so ties go to the even code; saturating at 6);
   MXFP8: ``y`` is clamped to +-448 and cast to ``float8_e4m3fn`` (RNE).

Non-finite input is not checked here (see :func:`first_nonfinite`); its bytes are unspecified.
"""

from __future__ import annotations

import struct
from fractions import Fraction
from typing import Callable

import torch

from mxconv.errors import BadInput

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
_F32_ABS_MASK = 0x7FFFFFFF


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

# Row chunks of the torch path hold about this many elements on the CPU: the chunk's temporaries
# (2-4 bytes per element, a few of them) stay in the caches between the passes over it. On other
# devices (the torch path on CUDA without Triton) chunks are _DEVICE_CHUNK_FACTOR times larger, so
# few launches run per stack.
_CHUNK_ELEMS = 1 << 20
_DEVICE_CHUNK_FACTOR = 8


# ---------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------


def check_args(x: torch.Tensor, fmt: str, scale_rounding: str) -> None:
    """Raise BadInput unless ``x`` is a float tensor [..., K] with K % 32 == 0 and fmt/mode are known."""
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


def _pow2_from_byte(byte: torch.Tensor, negate: bool) -> torch.Tensor:
    """fp32 2^(s-127) (negate=False) or 2^(127-s) (negate=True) for int32 bytes s in [1, 253] exactly."""
    field = (2 * E8M0_BIAS - byte) if negate else byte
    return (field << 23).view(torch.float32)


# ---------------------------------------------------------------------------------------------------
# elements
# ---------------------------------------------------------------------------------------------------


def _scaled_blocks(xb: torch.Tensor, byte: torch.Tensor) -> torch.Tensor:
    """y = x * 2^-e exactly, per block.

    xb: fp32 [R, nb, 32]; byte: int32 [R, nb] in [0, 253]. Returns fp32 [R, nb, 32].
    """
    y = xb * _pow2_from_byte(byte, negate=True).unsqueeze(-1)
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


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) of fp32 y (already scaled): RNE, saturating at 6, sign kept.

    Counts the rounding thresholds below |y| (exact comparisons, so sticky bits are exact).
    """
    ay = y.abs()
    codes = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    above = torch.empty(y.shape, dtype=torch.bool, device=y.device)
    for threshold in _E2M1_THRESHOLDS:
        torch.gt(ay, threshold, out=above)
        codes += above
    return codes | (torch.signbit(y).to(torch.uint8) << 3)


def _e4m3_bytes(y: torch.Tensor) -> torch.Tensor:
    """E4M3 bit patterns (uint8) of fp32 y: clamp to +-448 (keeps -0), cast RNE."""
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes uint8 [..., K] (K even, values 0..15) into bytes uint8 [..., K/2].

    Element 2i goes to the low nibble, 2i+1 to the high nibble.
    """
    if codes.shape[-1] % 2 != 0:
        raise BadInput(f"cannot pack {codes.shape[-1]} FP4 codes into bytes: the last dim must be even")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def unpack_fp4(data: torch.Tensor) -> torch.Tensor:
    """Unpack bytes uint8 [..., K/2] into E2M1 codes uint8 [..., K] (low nibble = even element)."""
    if data.dtype != torch.uint8:
        raise BadInput(f"packed FP4 data must be uint8, got {data.dtype}")
    return torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------------


def _rows_per_chunk(row_elems: int, device: torch.device | None = None) -> int:
    """Rows of ``row_elems`` elements per chunk so a chunk holds about ``_CHUNK_ELEMS`` elements
    (``_DEVICE_CHUNK_FACTOR`` times more off the CPU)."""
    elems = _CHUNK_ELEMS if device is None or device.type == "cpu" else _CHUNK_ELEMS * _DEVICE_CHUNK_FACTOR
    return max(1, elems // max(1, row_elems))


# --- the fast chunk path --------------------------------------------------------------------------
#
# The same bytes as the exact path below (``_quantize_rows_exact``), in fewer and narrower passes:
#
# * the block maximum is taken on the bit patterns: ``bits & 0x7FFF`` (bf16/fp16) or ``& 0x7FFFFFFF``
#   (fp32) orders |x| as integers, so an integer ``amax`` gives the bits of max |x| (masking two bf16
#   values at once through an int32 view);
# * for E2M1, bf16 input is scaled in bf16: ``x * 2^-e`` is exact there (bf16 has fp32's exponent
#   range), except that a product below 2^-126 may round to a bf16 subnormal, and such a value
#   rounds to a signed zero element anyway; everything else is scaled in fp32 as before;
# * E4M3: the scaled value is cast straight into the output (RNE); the clamp to +-448 is only done
#   where the device's cast does not saturate by itself (probed once per device type);
# * E2M1: a 65536-entry table maps every bf16 bit pattern of ``y`` to its code (built with
#   ``_e2m1_codes``, so it is that function's rounding). An fp32 ``y`` is first rounded to bf16
#   *to odd* (truncate, OR-ing any dropped bit into the last kept bit): every E2M1 rounding threshold
#   is a bf16 value with an even bit pattern, so the rounded key lies on the same side of each
#   threshold as ``y`` and the table gives ``y``'s own RNE code;
# * a chunk holding a non-zero block whose scale byte is <= SUBNORMAL_FIX_MAX_BYTE (max |x| below
#   about 2^-110: never seen in real weights) goes through the exact path, which rebuilds subnormal
#   inputs whatever the flush-to-zero mode.

_E2M1_LUT: dict[str, torch.Tensor] = {}
_DEQUANT_LUT: dict[str, torch.Tensor] = {}
_FP8_CAST_SATURATES: dict[str, bool] = {}


def _device_key(device: torch.device) -> str:
    return str(device)


def _e2m1_lut(device: torch.device) -> torch.Tensor:
    """uint8 [65536]: the E2M1 code (sign in bit 3) of the bf16 value with each bit pattern."""
    key = _device_key(device)
    lut = _E2M1_LUT.get(key)
    if lut is None:
        values = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
        lut = _E2M1_LUT[key] = _e2m1_codes(values).to(device)
    return lut


def _fp8_cast_saturates(device: torch.device) -> bool:
    """Whether casting fp32 and bf16 to float8_e4m3fn on ``device`` maps finite overflow to +-448."""
    key = _device_key(device)
    sat = _FP8_CAST_SATURATES.get(key)
    if sat is None:
        probe = torch.tensor([464.0, -1e30, 3e38, 449.0], dtype=torch.float32, device=device)
        want = [0x7E, 0xFE, 0x7E, 0x7E]
        sat = all(
            probe.to(dt).to(torch.float8_e4m3fn).view(torch.uint8).tolist() == want
            for dt in (torch.float32, torch.bfloat16)
        )
        _FP8_CAST_SATURATES[key] = sat
    return sat


def _block_amax_bits(xb: torch.Tensor) -> torch.Tensor:
    """fp32 bit pattern (int32 [R, nb]) of max |x| per block of xb [R, nb, 32] (contiguous)."""
    if xb.dtype == torch.float32:
        return (xb.view(torch.int32) & _F32_ABS_MASK).amax(dim=-1)
    # two 16-bit values per int32: clear both sign bits at once, then reduce as int16
    halves = (xb.view(torch.int32) & 0x7FFF7FFF).view(torch.int16).view(*xb.shape[:-1], 2, BLOCK_SIZE // 2)
    m16 = torch.maximum(halves[..., 0, :], halves[..., 1, :]).amax(dim=-1)
    if xb.dtype == torch.bfloat16:
        return m16.to(torch.int32) << 16
    return m16.view(torch.float16).to(torch.float32).view(torch.int32)


def _e2m1_keys(y: torch.Tensor) -> torch.Tensor:
    """int32 bf16 bit patterns (0..65535) indexing ``_e2m1_lut`` for y (bf16 exactly; fp32 rounded to odd)."""
    if y.dtype == torch.bfloat16:
        return y.view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)
    bits = y.view(torch.int32)
    keys = (bits >> 16).bitwise_and_(0xFFFF)
    return keys.bitwise_or_((bits & 0xFFFF).ne_(0).to(torch.int32))


def _quantize_rows_fast(xc: torch.Tensor, fmt: str, scale_rounding: str, data_out: torch.Tensor,
                        scale_out: torch.Tensor, sums: list[float] | None = None) -> bool:
    """Quantize rows xc [R, K] (contiguous) into data_out / scale_out (uint8 views of the result);
    with ``sums``, add the chunk's error sums (:func:`_add_error_sums`).

    Returns False, writing nothing, when the chunk needs the exact path (see above).
    """
    rows, k = xc.shape
    nb = k // BLOCK_SIZE
    xb = xc.view(rows, nb, BLOCK_SIZE)
    amax_bits = _block_amax_bits(xb)
    byte = scale_bytes_from_amax_bits(amax_bits, fmt, scale_rounding)
    if bool(((byte <= SUBNORMAL_FIX_MAX_BYTE) & (amax_bits != 0)).any()):
        return False
    inv = _pow2_from_byte(byte, negate=True).unsqueeze(-1)  # 2^-e, exact (byte 0 only for all-zero blocks)
    xf = None
    if fmt == "mxfp8":
        # fp32 arithmetic and the fp32 -> E4M3 cast are faster on the CPU than their bf16 forms
        if sums is None:
            y = xb.to(torch.float32, copy=True).mul_(inv)
        else:
            xf = xb.to(torch.float32)  # kept for the error sums
            y = xf * inv
        if not _fp8_cast_saturates(xc.device):
            y.clamp_(-E4M3_MAX, E4M3_MAX)
        data_out.view(torch.float8_e4m3fn).view(rows, nb, BLOCK_SIZE).copy_(y)
    else:
        # E2M1 keys are bf16 patterns: a bf16 product needs no rounding to odd
        y = xb * inv.to(torch.bfloat16) if xc.dtype == torch.bfloat16 else xb.to(torch.float32) * inv
        codes = torch.index_select(_e2m1_lut(xc.device), 0, _e2m1_keys(y).view(-1)).view(rows, k)
        torch.bitwise_or(codes[:, 0::2], codes[:, 1::2] << 4, out=data_out)
    scale_out.copy_(byte)
    if sums is not None:
        _add_error_sums(xc, data_out, scale_out, fmt, sums, xf)
    return True


def _quantize_rows_exact(xc: torch.Tensor, fmt: str, scale_rounding: str, data_out: torch.Tensor,
                         scale_out: torch.Tensor) -> None:
    """The reference computation of one row chunk (fp32 throughout, threshold-counting E2M1)."""
    k = xc.shape[-1]
    nb = k // BLOCK_SIZE
    xb = xc.to(torch.float32).contiguous().view(-1, nb, BLOCK_SIZE)
    amax = torch.maximum(xb.amax(dim=-1).abs(), xb.amin(dim=-1).abs())  # no full-size |x| temporary
    byte = scale_bytes_from_amax_bits(amax.view(torch.int32), fmt, scale_rounding)
    y = _scaled_blocks(xb, byte)
    if fmt == "mxfp4":
        data_out.copy_(pack_fp4(_e2m1_codes(y)).view(data_out.shape))
    else:
        data_out.copy_(_e4m3_bytes(y).view(data_out.shape))
    scale_out.copy_(byte)


def quantize_mx_torch(
    x: torch.Tensor, fmt: str, scale_rounding: str = "rceil", *, fast: bool = True,
    error_sums: list[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., K] (bf16/fp16/fp32, any device) to MX blocks of 32 along K.

    Returns ``(data, scales)`` on x's device:
      * mxfp4: data uint8 [..., K/2] (two E2M1 codes per byte, element 2i in the low nibble)
      * mxfp8: data uint8 [..., K] (float8_e4m3fn bit patterns)
      * scales: uint8 [..., K/32] E8M0 bytes (2^(s-127)); an all-zero block gets byte 0.
    Raises BadInput for an unknown format/mode, a non-float dtype, or K % 32 != 0.
    ``fast=False`` runs only the exact reference computation (same bytes, several times slower; tests).
    ``error_sums``: a list ``[sq_err, sq_ref]`` to which ``sum((dequantized - x)^2)`` and ``sum(x^2)``
    are added (see :func:`mx_error_sums`), computed chunk by chunk while the chunk is in the caches.
    """
    check_args(x, fmt, scale_rounding)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    nb = k // BLOCK_SIZE
    data_k = k // 2 if fmt == "mxfp4" else k
    data = torch.empty(lead + (data_k,), dtype=torch.uint8, device=x.device)
    scales = torch.empty(lead + (nb,), dtype=torch.uint8, device=x.device)
    rows = x.reshape(-1, k)
    data_rows = data.view(-1, data_k)
    scale_rows = scales.view(-1, nb)
    step = _rows_per_chunk(k, x.device)
    for r0 in range(0, rows.shape[0], step):
        xc = rows[r0 : r0 + step].contiguous()
        d_out, s_out = data_rows[r0 : r0 + step], scale_rows[r0 : r0 + step]
        if not (fast and _quantize_rows_fast(xc, fmt, scale_rounding, d_out, s_out, error_sums)):
            _quantize_rows_exact(xc, fmt, scale_rounding, d_out, s_out)
            if error_sums is not None:
                _add_error_sums(xc, d_out, s_out, fmt, error_sums)
    return data, scales


def _add_error_sums(xc: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, fmt: str, sums: list[float],
                    xf: torch.Tensor | None = None) -> None:
    """Add sum((dequantized - x)^2) and sum(x^2) of one row chunk (xc [R, K], its MX bytes) to ``sums``
    (``xf``: xc in fp32 when the caller has it). fp32 dot products, accumulated in Python floats."""
    rows, k = xc.shape
    nb = k // BLOCK_SIZE
    vals = torch.index_select(_dequant_lut(fmt, xc.device), 0, data.reshape(-1).to(torch.int32)).view(rows, nb, BLOCK_SIZE)
    vals.mul_(scales_to_float(scales).unsqueeze(-1))
    xf = (xc.to(torch.float32) if xf is None else xf).reshape(-1)
    diff = vals.view(-1).sub_(xf)
    sums[0] += float(torch.dot(diff, diff))
    sums[1] += float(torch.dot(xf, xf))


def mx_error_sums(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, fmt: str) -> tuple[float, float]:
    """``(sum((dequantize_mx(data, scales) - x)^2), sum(x^2))`` for x [..., K] and its MX bytes, in fp32
    row chunks (no full-size temporary). A NaN scale byte makes the first sum NaN."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    data_rows = data.reshape(rows.shape[0], -1)
    scale_rows = scales.reshape(rows.shape[0], -1)
    sums = [0.0, 0.0]
    step = _rows_per_chunk(k, x.device)
    for r0 in range(0, rows.shape[0], step):
        _add_error_sums(rows[r0 : r0 + step], data_rows[r0 : r0 + step], scale_rows[r0 : r0 + step], fmt, sums)
    return sums[0], sums[1]


def scales_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes uint8 [...] -> exact fp32 2^(s-127) [...]; byte 0 -> 2^-127 (subnormal), 0xFF -> NaN."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)
    bits = torch.where(s == E8M0_NAN, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)


def dequantize_mx(
    data: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode MX blocks back to floats: value(code) * 2^(s-127), exact in fp32 (NaN where s == 0xFF).

    data: uint8 [..., K/2] (mxfp4) or [..., K] (mxfp8 E4M3 bytes); scales: uint8 [..., K/32].
    Returns ``dtype`` [..., K] on data's device (computed in fp32, then cast).
    """
    if fmt not in FORMATS:
        raise BadInput(f"unknown MX format {fmt!r}; supported: {', '.join(FORMATS)}")
    if data.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise BadInput(f"MX data and scales must be uint8, got {data.dtype} and {scales.dtype}")
    k = data.shape[-1] * 2 if fmt == "mxfp4" else data.shape[-1]
    nb = k // BLOCK_SIZE
    if k % BLOCK_SIZE != 0 or tuple(scales.shape) != tuple(data.shape[:-1]) + (nb,):
        raise BadInput(
            f"{fmt} data of shape {tuple(data.shape)} needs scales of shape "
            f"{tuple(data.shape[:-1]) + (nb,)}, got {tuple(scales.shape)}"
        )
    lead = tuple(data.shape[:-1])
    out = torch.empty(lead + (k,), dtype=dtype, device=data.device)
    data_rows = data.reshape(-1, data.shape[-1])
    scale_rows = scales.reshape(-1, nb)
    out_rows = out.view(-1, k)
    # a table of fp32 values per byte: E4M3 (the cast's own results), or per packed E2M1 byte the
    # values of its low and high nibble; a lookup is several times faster than the CPU's fp8 cast
    lut = _dequant_lut(fmt, data.device)
    step = _rows_per_chunk(k, data.device)
    for r0 in range(0, data_rows.shape[0], step):
        d = data_rows[r0 : r0 + step]
        rows = d.shape[0]
        vals = torch.index_select(lut, 0, d.reshape(-1).to(torch.int32))
        sc = scales_to_float(scale_rows[r0 : r0 + step]).unsqueeze(-1)
        if dtype == torch.float32:
            torch.mul(vals.view(rows, nb, BLOCK_SIZE), sc, out=out_rows[r0 : r0 + step].view(rows, nb, BLOCK_SIZE))
        else:
            out_rows[r0 : r0 + step] = vals.view(rows, nb, BLOCK_SIZE).mul_(sc).view(rows, k).to(dtype)
    return out


def _dequant_lut(fmt: str, device: torch.device) -> torch.Tensor:
    """fp32 [256] E4M3 values (mxfp8; NaN at 0x7F/0xFF) or [256, 2] E2M1 values of each packed
    byte's low and high nibble (mxfp4)."""
    key = f"{fmt}:{_device_key(device)}"
    lut = _DEQUANT_LUT.get(key)
    if lut is None:
        byte = torch.arange(256)
        if fmt == "mxfp4":
            values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
            lut = torch.stack((values[byte & 0x0F], values[byte >> 4]), dim=-1)
        else:
            lut = byte.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        lut = _DEQUANT_LUT[key] = lut.to(device)
    return lut


# ---------------------------------------------------------------------------------------------------
# non-finite check
# ---------------------------------------------------------------------------------------------------


_SCAN_CHUNK = 1 << 26  # elements per pass of a scan: bounds the temporaries of a huge stack
_FINITE_CHUNK = 1 << 20  # elements per sum of first_nonfinite's fast check (stays in the caches)


def _first_where(x: torch.Tensor, bad: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, ...] | None:
    """Index (row-major) of the first element of ``x`` where ``bad(chunk)`` is True, or None.

    Cheap on the common path: one mask and one ``any()`` per chunk of the flattened tensor.
    """
    if x.numel() == 0:
        return None
    flat = x.reshape(-1)
    for start in range(0, flat.numel(), _SCAN_CHUNK):
        hit = bad(flat[start : start + _SCAN_CHUNK])
        if bool(hit.any()):
            return _unravel(start + int(hit.nonzero()[0, 0]), x.shape)
    return None


def _unravel(pos: int, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """Row-major index of flat position ``pos`` in ``shape``."""
    idx = []
    for size in reversed(shape):
        idx.append(pos % size)
        pos //= size
    return tuple(reversed(idx))


def _surely_finite(part: torch.Tensor) -> bool:
    """True when a float tensor certainly holds no NaN/Inf: its fp32 sum is finite (a NaN or an Inf
    term makes any IEEE sum non-finite). False is inconclusive (a sum may also overflow)."""
    return bool(torch.isfinite(part.sum(dtype=torch.float32)))


def first_nonfinite(x: torch.Tensor) -> tuple[int, ...] | None:
    """Index (row-major) of the first NaN/Inf in ``x``, or None when every element is finite
    (integer tensors always are)."""
    if not (x.is_floating_point() or x.is_complex()):
        return None
    if x.is_floating_point() and x.numel() > 0:
        # common path: one reduction per cache-sized chunk; the element scan runs only from a chunk
        # whose sum is not finite
        flat = x.reshape(-1)
        for start in range(0, flat.numel(), _FINITE_CHUNK):
            if not _surely_finite(flat[start : start + _FINITE_CHUNK]):
                hit = _first_where(flat[start:], lambda part: ~torch.isfinite(part))
                return None if hit is None else _unravel(start + hit[0], x.shape)
        return None
    return _first_where(x, lambda part: ~torch.isfinite(part))


def first_nan_scale(scales: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first E8M0 NaN byte (0xFF) in MX scales (uint8 or float8_e8m0fnu), or None.

    0xFF is the only E8M0 code that is not a power of two: a block with that scale decodes to NaN
    whatever its elements, so it is never a number to carry over or compare.
    """
    return _first_where(scales.view(torch.uint8), lambda part: part == E8M0_NAN)


def first_nonnumber(tensors: dict[str, torch.Tensor | None]) -> tuple[str, tuple[int, ...], str] | None:
    """The first of ``{key: tensor}`` holding a value that is not a number, as (key, index, what).

    Keys ending in ``_scale`` hold E8M0 scale bytes (what = "E8M0 NaN scale byte 0xFF"); the others
    are float tensors (what = "non-finite value nan" / "inf" / "-inf"). None entries are skipped.
    """
    for key, t in tensors.items():
        if t is None:
            continue
        if key.endswith("_scale"):
            idx = first_nan_scale(t)
            if idx is not None:
                return key, idx, f"E8M0 NaN scale byte 0x{E8M0_NAN:02X}"
        else:
            idx = first_nonfinite(t)
            if idx is not None:
                return key, idx, f"non-finite value {t[idx].item()}"
    return None


__all__ = [
    "BLOCK_SIZE",
    "E2M1_EMAX",
    "E2M1_MAX",
    "E2M1_MIDPOINTS",
    "E2M1_VALUES",
    "E4M3_EMAX",
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "FORMATS",
    "FORMAT_PARAMS",
    "SCALE_MODES",
    "SUBNORMAL_FIX_MAX_BYTE",
    "dequantize_mx",
    "first_nan_scale",
    "first_nonfinite",
    "first_nonnumber",
    "mx_error_sums",
    "pack_fp4",
    "quantize_mx_torch",
    "scale_bytes_from_amax_bits",
    "scales_to_float",
    "unpack_fp4",
]


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-FP8 -> fp32: ``W[..., i, j] = fp32(weight[..., i, j]) * scale_inv[..., i // bn, j // bk]``.

    weight: float8_e4m3fn ``[..., N, K]``; scale_inv: any float ``[..., ceil(N/bn), ceil(K/bk)]``
    (edge tiles partial). Returns a new fp32 ``[..., N, K]`` tensor. The product is computed in fp32
    (exact for power-of-two scales; one correctly rounded multiply otherwise).
    """
    bn, bk = block
    n, k = weight.shape[-2], weight.shape[-1]
    s = scale_inv.to(torch.float32)
    s = s.repeat_interleave(bn, dim=-2)[..., :n, :]
    s = s.repeat_interleave(bk, dim=-1)[..., :k]
    out = weight.to(torch.float32)
    out.mul_(s)
    return out


def mxfp4_to_mxfp8(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 codes -> E4M3 bytes with the same block scales (every E2M1 value is an E4M3 value)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=data.device)
    vals = lut[unpack_fp4(data).long()]
    return vals.to(torch.float8_e4m3fn).view(torch.uint8)
