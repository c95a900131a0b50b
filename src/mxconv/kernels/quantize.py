"""The one entry point the rest of mxconv uses to quantize a tensor to MXFP4/MXFP8 (and to block
FP8 for ``quantize --format fp8-block``).

``impl="auto"`` runs the Triton kernel for CUDA tensors when Triton works, otherwise the exact torch
path; both give the same bytes (tests/test_triton_kernels.py checks it bit for bit on a GPU).
"""

from __future__ import annotations

import torch

from mxconv.errors import BadInput
from mxconv.mx import fp8_block
from mxconv.mx.formats import check_args
from mxconv.mx.fp8_block import BlockFP8
from mxconv.mx.numerics import mx_error_sums, quantize_mx_torch

IMPLS: tuple[str, ...] = ("auto", "torch", "triton")


def select_impl(x: torch.Tensor, impl: str = "auto") -> str:
    """Which implementation ``quantize_mx`` runs for ``x``: "torch" or "triton"."""
    if impl not in IMPLS:
        raise BadInput(f"unknown quantizer implementation {impl!r}; supported: {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    if x.is_cuda:
        from mxconv.kernels.mx_triton import triton_available

        if triton_available():
            return "triton"
    return "torch"


def quantize_mx(
    x: torch.Tensor, fmt: str, scale_rounding: str = "rceil", impl: str = "auto",
    *, error_sums: list[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., K] (bf16/fp16/fp32) to MX blocks of 32 along K.

    Returns ``(data, scales)`` on x's device: mxfp4 data uint8 [..., K/2] (element 2i in the low
    nibble), mxfp8 data uint8 [..., K] (E4M3 bits), scales uint8 [..., K/32] (E8M0).
    ``impl``: "auto" (Triton for CUDA tensors when available, else torch), "torch" or "triton".
    Raises BadInput for an unknown format/mode/impl, a non-float dtype or K % 32 != 0.
    Does not check for NaN/Inf (use ``mxconv.mx.numerics.first_nonfinite`` first).
    ``error_sums``: a list ``[sq_err, sq_ref]`` to which ``sum((dequantized - x)^2)`` and ``sum(x^2)``
    are added — the error statistic without a full-size dequantized copy (on the torch path it is
    computed chunk by chunk while each chunk is still in the caches).
    """
    check_args(x, fmt, scale_rounding)
    chosen = select_impl(x, impl)
    if chosen == "triton":
        from mxconv.kernels.mx_triton import quantize_mx_triton

        data, scales = quantize_mx_triton(x, fmt, scale_rounding)
        if error_sums is not None:
            err, ref = mx_error_sums(x, data, scales, fmt)
            error_sums[0] += err
            error_sums[1] += ref
        return data, scales
    return quantize_mx_torch(x, fmt, scale_rounding, error_sums=error_sums)


def mxfp4_to_fp8_block(data: torch.Tensor, scales: torch.Tensor, impl: str = "auto") -> BlockFP8:
    """MXFP4 [E, N, K/2] + E8M0 [E, N, K/32] -> block FP8 with power-of-two tile scales
    (:func:`mxconv.mx.fp8_block.mxfp4_to_fp8_block`); Triton for CUDA tensors under "auto", same bytes."""
    if select_impl(data, impl) == "triton":
        from mxconv.kernels.fp8_block_triton import mxfp4_to_fp8_block_triton

        return mxfp4_to_fp8_block_triton(data, scales)
    return fp8_block.mxfp4_to_fp8_block(data, scales)


def float_to_fp8_block(x: torch.Tensor, impl: str = "auto") -> BlockFP8:
    """Floats [E, N, K] -> block FP8, amax/448 per 128x128 tile (:func:`mxconv.mx.fp8_block.float_to_fp8_block`);
    Triton for CUDA tensors under "auto", same bytes."""
    if select_impl(x, impl) == "triton":
        from mxconv.kernels.fp8_block_triton import float_to_fp8_block_triton

        return float_to_fp8_block_triton(x)
    return fp8_block.float_to_fp8_block(x)


__all__ = ["IMPLS", "float_to_fp8_block", "mxfp4_to_fp8_block", "quantize_mx", "select_impl"]
