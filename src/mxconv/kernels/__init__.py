"""GPU kernels. Importing this package never requires triton or CUDA; check ``triton_available()``."""

from __future__ import annotations

from mxconv.kernels.mx_triton import quantize_mx_triton, triton_available

__all__ = ["quantize_mx_triton", "triton_available"]
