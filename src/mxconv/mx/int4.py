"""INT4 expert weights as compressed-tensors ``pack-quantized`` stores them (symmetric, group 32,
bf16 scales; Kimi-K2-Thinking style), and mxconv's canonical form of them.

Canonical int4 convention (``Int4Stack``, ``CanonicalExperts(weight_format="int4")``):

| tensor | shape          | dtype    | meaning |
|--------|----------------|----------|---------|
| data   | [..., N, K/2]  | uint8    | **offset-binary** nibbles: stored ``s = q + 8`` for ``q`` in [-8, 7]; byte ``b`` of a row holds column ``2b`` in its low nibble and column ``2b+1`` in its high nibble |
| scales | [..., N, K/32] | bfloat16 | ``w[n, k] = q[n, k] * scales[n, k // 32]`` (no zero point) |

The data bytes are exactly the little-endian bytes of compressed-tensors' int32 ``weight_packed``
words (value ``j`` of a row in bits ``4*(j%8)`` of word ``j//8``), so a reader only *views* the
words as bytes and the canonical bytes equal the checkpoint's bytes. Two's-complement int4 (what
TRT-LLM-gen's MxInt4 kernels read) is ``data ^ 0x88`` on every byte; the same XOR converts back.

Dequantization ``q * scale`` in fp32 is exact: ``|q| <= 8`` needs 4 significand bits and a bf16
scale 8, far below fp32's 24, and the bf16 exponent range is fp32's.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GROUP_SIZE = 32  # weights per bf16 scale, along K
VALUES_PER_WORD = 8  # int4 values per int32 word
OFFSET = 8  # stored nibble = q + OFFSET
SIGN_FLIP = 0x88  # offset-binary <-> two's complement, both nibbles of a byte at once
SCALE_DTYPE = "BF16"  # safetensors name of the scales' dtype (bfloat16)


def _check_little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("INT4 word/byte views assume a little-endian host (as safetensors files are)")


def words_as_bytes(words: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``weight_packed`` int32 ``[..., K/8]`` -> canonical uint8 ``[..., K/2]``
    (a view of the same memory; offset-binary nibbles, low nibble = even column)."""
    import torch

    if words.dtype != torch.int32:
        raise ValueError(f"packed INT4 words must be int32, got {words.dtype}")
    _check_little_endian()
    return words.contiguous().view(torch.uint8)


def bytes_as_words(data: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`words_as_bytes`: uint8 ``[..., K/2]`` -> int32 ``[..., K/8]`` (a view)."""
    import torch

    if data.dtype != torch.uint8 or data.shape[-1] % 4:
        raise ValueError(f"INT4 bytes must be uint8 with a multiple of 4 per row, got {data.dtype} {tuple(data.shape)}")
    _check_little_endian()
    return data.contiguous().view(torch.int32)


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """Canonical offset-binary bytes uint8 ``[..., K/2]`` -> signed values int8 ``[..., K]`` in [-8, 7]."""
    import torch

    if data.dtype != torch.uint8:
        raise ValueError(f"INT4 bytes must be uint8, got {data.dtype}")
    nibbles = torch.stack((data & 0x0F, data >> 4), dim=-1)  # [..., K/2, 2]: even column, odd column
    return (nibbles.to(torch.int8) - OFFSET).reshape(*data.shape[:-1], data.shape[-1] * 2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed values (any integer dtype) ``[..., K]`` in [-8, 7], K even -> canonical offset-binary
    bytes uint8 ``[..., K/2]``. ValueError for a value out of range."""
    import torch

    if q.is_floating_point() or q.shape[-1] % 2:
        raise ValueError(f"pack_int4 takes integers with an even last dimension, got {q.dtype} {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < -OFFSET or int(q.max()) > OFFSET - 1):
        raise ValueError("INT4 values must lie in [-8, 7]")
    s = (q.to(torch.int16) + OFFSET).to(torch.uint8).reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
    return s[..., 0] | (s[..., 1] << 4)


def pack_int4_words(q: torch.Tensor) -> torch.Tensor:
    """Signed values ``[..., K]`` (K a multiple of 8) -> compressed-tensors ``weight_packed`` int32
    ``[..., K/8]``: value ``j`` offset-binary in bits ``4*(j%8)`` of word ``j//8``."""
    if q.shape[-1] % VALUES_PER_WORD:
        raise ValueError(f"K = {q.shape[-1]} is not a multiple of {VALUES_PER_WORD} (values per int32 word)")
    return bytes_as_words(pack_int4(q))


def to_twos_complement(data: torch.Tensor) -> torch.Tensor:
    """Offset-binary int4 bytes -> two's-complement int4 bytes (``^ 0x88``; also the inverse). uint8, same shape."""
    import torch

    return torch.bitwise_xor(data, SIGN_FLIP)


def dequantize_int4(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Exact fp32 weights ``[..., N, K]`` from canonical bytes uint8 ``[..., N, K/2]`` and bf16
    scales ``[..., N, K/32]``: ``q * scale`` with q = nibble - 8."""
    import torch

    K = data.shape[-1] * 2
    if tuple(scales.shape) != (*data.shape[:-1], K // GROUP_SIZE) or K % GROUP_SIZE:
        raise ValueError(f"INT4 scales {tuple(scales.shape)} do not match data {tuple(data.shape)} (one per {GROUP_SIZE} along K)")
    q = unpack_int4(data).to(torch.float32).view(*data.shape[:-1], K // GROUP_SIZE, GROUP_SIZE)
    return (q * scales.to(torch.float32).unsqueeze(-1)).view(*data.shape[:-1], K)
