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

The code sits in three modules: the formats' constants, scale rules, element codes and packing in
:mod:`mxconv.mx.formats`; the fast chunk path and lookup tables in :mod:`mxconv.mx.fast`;
here the quantize / dequantize entry points, the exact path, the error sums, the non-finite scans
and the conversions between formats. Each name is imported from the module that owns it (the
formats' constants and :func:`~mxconv.mx.formats.pack_fp4` from :mod:`mxconv.mx.formats`).
"""

from __future__ import annotations

from typing import Callable

import torch

from mxconv.errors import BadInput
from mxconv.mx.fast import add_error_sums, dequant_lut, quantize_rows_fast
from mxconv.mx.formats import (
    BLOCK_SIZE, E2M1_VALUES, E8M0_NAN, FORMATS, check_args, e2m1_codes, e4m3_bytes, pack_fp4,
    scale_bytes_from_amax_bits, scaled_blocks, scales_to_float, unpack_fp4,
)

# Row chunks of the torch path hold about this many elements on the CPU: the chunk's temporaries
# (2-4 bytes per element, a few of them) stay in the caches between the passes over it. On other
# devices (the torch path on CUDA without Triton) chunks are _DEVICE_CHUNK_FACTOR times larger, so
# few launches run per stack.
_CHUNK_ELEMS = 1 << 20
_DEVICE_CHUNK_FACTOR = 8


# ---------------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------------


def _rows_per_chunk(row_elems: int, device: torch.device | None = None) -> int:
    """Rows of ``row_elems`` elements per chunk so a chunk holds about ``_CHUNK_ELEMS`` elements
    (``_DEVICE_CHUNK_FACTOR`` times more off the CPU)."""
    elems = _CHUNK_ELEMS if device is None or device.type == "cpu" else _CHUNK_ELEMS * _DEVICE_CHUNK_FACTOR
    return max(1, elems // max(1, row_elems))


def _quantize_rows_exact(xc: torch.Tensor, fmt: str, scale_rounding: str, data_out: torch.Tensor,
                         scale_out: torch.Tensor) -> None:
    """The reference computation of one row chunk (fp32 throughout, threshold-counting E2M1)."""
    k = xc.shape[-1]
    nb = k // BLOCK_SIZE
    xb = xc.to(torch.float32).contiguous().view(-1, nb, BLOCK_SIZE)
    amax = torch.maximum(xb.amax(dim=-1).abs(), xb.amin(dim=-1).abs())  # no full-size |x| temporary
    byte = scale_bytes_from_amax_bits(amax.view(torch.int32), fmt, scale_rounding)
    y = scaled_blocks(xb, byte)
    if fmt == "mxfp4":
        data_out.copy_(pack_fp4(e2m1_codes(y)).view(data_out.shape))
    else:
        data_out.copy_(e4m3_bytes(y).view(data_out.shape))
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
        if not (fast and quantize_rows_fast(xc, fmt, scale_rounding, d_out, s_out, error_sums)):
            _quantize_rows_exact(xc, fmt, scale_rounding, d_out, s_out)
            if error_sums is not None:
                add_error_sums(xc, d_out, s_out, fmt, error_sums)
    return data, scales


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
        add_error_sums(rows[r0 : r0 + step], data_rows[r0 : r0 + step], scale_rows[r0 : r0 + step], fmt, sums)
    return sums[0], sums[1]


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
    lut = dequant_lut(fmt, data.device)
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


# ---------------------------------------------------------------------------------------------------
# non-finite check
# ---------------------------------------------------------------------------------------------------


_SCAN_CHUNK = 1 << 26  # elements per pass of a scan: bounds the temporaries of a huge stack
_FINITE_CHUNK = 1 << 20  # elements per sum of first_nonfinite's fast check (stays in the caches)
# On a GPU each sum is a launch and a device -> host sync (~20 us): 1M-element sums made a
# gpt-oss-120b layer's scan 87 ms on an H200; one sum per 256M elements reads at HBM speed.
_FINITE_CHUNK_GPU = 1 << 28


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
        step = _FINITE_CHUNK if x.device.type == "cpu" else _FINITE_CHUNK_GPU
        for start in range(0, flat.numel(), step):
            if not _surely_finite(flat[start : start + step]):
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
