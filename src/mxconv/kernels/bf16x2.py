"""bf16 experts two at a time: the E2M1 codes and block maxima of bf16 pair words computed with
bf16x2 and u16x2 instructions (inline PTX, sm_90 and later), for the fused ``triton`` kernel
(:mod:`mxconv.kernels.triton_fused`). The bytes are those of the fp32 path of
:mod:`mxconv.kernels.mx_triton` (``scaled_elements`` + ``fp4_magnitudes``), which the Triton
interpreter, fp16/fp32 experts and older GPUs take instead (:func:`bf16x2_path`).
"""

from __future__ import annotations

import torch

from mxconv.environment import triton_interpreter_on
from mxconv.kernels.triton_import import tl, triton

# The E2M1 codes of both bf16 halves of a word with bf16x2 instructions (sm_90 and later: mul/add.rn.bf16x2,
# min.u16x2), on |w| ($1: the words & 0x7FFF7FFF) and the block's 2^-e in both halves ($2): |x| * 2^-e
# is exact in bf16 (a power of two; bf16 arithmetic keeps subnormals, so tiny blocks need no
# rebuild), then the magic add of _e2m1_magnitude with bf16's 7 mantissa bits: 2^(6+t) has the E2M1
# step as its ulp, and the code is the sum's step count n plus 2t. The integer steps act on both
# 16-bit lanes of the word at once, exactly: no lane borrows or carries into the other (in each
# lane s >= eb, s - eb + (eb >> 6) >= 0x3FE, the result n + 2t is in [0, 8], and the exponent bits
# shifted right by 6 stay inside their lane). tests/test_bf16x2_codes.py runs these instructions on
# the CPU, every bf16 against every scale byte.
PAIR_CODES_PTX = """{
        .reg .b32 y, one, eb, mg, s, sh;
        mul.rn.bf16x2 y, $1, $2;
        mov.b32 one, 0x3F803F80;
        max.bf16x2 eb, y, one;
        and.b32 eb, eb, 0x7F807F80;
        add.u32 mg, eb, 0x03000300;
        add.rn.bf16x2 s, y, mg;
        shr.u32 sh, eb, 6;
        sub.u32 s, s, eb;
        add.u32 s, s, sh;
        sub.u32 $0, s, 0x03FE03FE;
    }"""
SATURATED_PAIR_CODES_PTX = PAIR_CODES_PTX.replace(
    "sub.u32 $0, s, 0x03FE03FE;", "sub.u32 s, s, 0x03FE03FE;\n        mov.b32 sh, 0x00070007;\n        min.u16x2 $0, s, sh;"
)


def bf16x2_path(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels take the bf16x2 path (PAIR_CODES_PTX) for ``dtype`` experts on ``device``:
    bf16 on an NVIDIA GPU of compute capability 9.0 or later, compiled (not the interpreter)."""
    if dtype != torch.bfloat16 or device.type != "cuda" or torch.version.hip is not None or triton_interpreter_on():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


if triton is not None:

    _PAIR_CODES_PTX = tl.constexpr(PAIR_CODES_PTX)
    _SATURATED_PAIR_CODES_PTX = tl.constexpr(SATURATED_PAIR_CODES_PTX)

    @triton.jit
    def _max_u16x2(a, b):
        """Lane-wise unsigned max of two words of two 16-bit lanes (``tl.reduce``'s combine)."""
        return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], tl.int32, True, 1)

    @triton.jit
    def bf16_pair_max(abs_w):
        """Per row of ``abs_w`` (int32 [B, n], bf16 pairs & 0x7FFF7FFF): the largest |x| as fp32 bits
        (int32 [B]; >= 0x7F800000 iff a NaN or an Inf; bf16 bits order as their values). Compiled code
        only (inline PTX)."""
        m = tl.reduce(abs_w, 1, _max_u16x2)
        return tl.maximum(m & -65536, m << 16)

    @triton.jit
    def bf16_pair_codes(abs_w, byte, SATURATE: tl.constexpr):
        """E2M1 magnitude codes of the bf16 pairs ``abs_w`` (int32 [B, n], words & 0x7FFF7FFF; scale
        ``byte`` int32 [B] in [0, 253]): the low half's code at bits 0-2, the high half's at 16-18
        (int32 [B, n]). Compiled code only (inline PTX; the interpreter takes :func:`fp4_magnitudes`)."""
        half = (254 - byte) << 7  # 2^-e as bf16 bits, normal for byte <= 253
        scale = tl.broadcast_to((half | (half << 16))[:, None], abs_w.shape)
        if SATURATE:  # as _e2m1_magnitude: floor can round above 6 (rceil maps the block max to <= 6)
            return tl.inline_asm_elementwise(_SATURATED_PAIR_CODES_PTX, "=r,r,r", [abs_w, scale], tl.int32, True, 1)
        return tl.inline_asm_elementwise(_PAIR_CODES_PTX, "=r,r,r", [abs_w, scale], tl.int32, True, 1)


__all__ = ["PAIR_CODES_PTX", "SATURATED_PAIR_CODES_PTX", "bf16x2_path"]
