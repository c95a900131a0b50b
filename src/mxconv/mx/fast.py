"""The fast chunk path of the torch quantizer (:func:`mxconv.mx.numerics.quantize_mx_torch`) and the
lookup tables it and the dequantizer share: E2M1 codes per bf16 bit pattern, fp32 values per MX
byte, whether the device's fp8 cast saturates. Same bytes as the exact path, in fewer passes.
"""

from __future__ import annotations

import torch

from mxconv.mx.formats import (
    BLOCK_SIZE, E2M1_VALUES, E4M3_MAX, F32_ABS_MASK, SUBNORMAL_FIX_MAX_BYTE, e2m1_codes, pow2_from_byte,
    scale_bytes_from_amax_bits, scales_to_float,
)

# --- the fast chunk path --------------------------------------------------------------------------
#
# The same bytes as the exact path (``_quantize_rows_exact`` in ``mxconv.mx.numerics``), in fewer and
# narrower passes:
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
#   ``e2m1_codes``, so it is that function's rounding). An fp32 ``y`` is first rounded to bf16
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
        lut = _E2M1_LUT[key] = e2m1_codes(values).to(device)
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
        return (xb.view(torch.int32) & F32_ABS_MASK).amax(dim=-1)
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


def quantize_rows_fast(xc: torch.Tensor, fmt: str, scale_rounding: str, data_out: torch.Tensor,
                        scale_out: torch.Tensor, sums: list[float] | None = None) -> bool:
    """Quantize rows xc [R, K] (contiguous) into data_out / scale_out (uint8 views of the result);
    with ``sums``, add the chunk's error sums (:func:`add_error_sums`).

    Returns False, writing nothing, when the chunk needs the exact path (see above).
    """
    rows, k = xc.shape
    nb = k // BLOCK_SIZE
    xb = xc.view(rows, nb, BLOCK_SIZE)
    amax_bits = _block_amax_bits(xb)
    byte = scale_bytes_from_amax_bits(amax_bits, fmt, scale_rounding)
    if bool(((byte <= SUBNORMAL_FIX_MAX_BYTE) & (amax_bits != 0)).any()):
        return False
    inv = pow2_from_byte(byte, negate=True).unsqueeze(-1)  # 2^-e, exact (byte 0 only for all-zero blocks)
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
        add_error_sums(xc, data_out, scale_out, fmt, sums, xf)
    return True


def add_error_sums(xc: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, fmt: str, sums: list[float],
                    xf: torch.Tensor | None = None) -> None:
    """Add sum((dequantized - x)^2) and sum(x^2) of one row chunk (xc [R, K], its MX bytes) to ``sums``
    (``xf``: xc in fp32 when the caller has it). fp32 dot products, accumulated in Python floats."""
    rows, k = xc.shape
    nb = k // BLOCK_SIZE
    vals = torch.index_select(dequant_lut(fmt, xc.device), 0, data.reshape(-1).to(torch.int32)).view(rows, nb, BLOCK_SIZE)
    vals.mul_(scales_to_float(scales).unsqueeze(-1))
    xf = (xc.to(torch.float32) if xf is None else xf).reshape(-1)
    diff = vals.view(-1).sub_(xf)
    sums[0] += float(torch.dot(diff, diff))
    sums[1] += float(torch.dot(xf, xf))


def dequant_lut(fmt: str, device: torch.device) -> torch.Tensor:
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
