"""The bf16x2 inline PTX of :mod:`mxconv.kernels.bf16x2`, run on the CPU.

The CPU suite's Triton interpreter cannot run inline PTX (it takes the fp32 path), so this test
executes the instruction text itself with a small emulator of its nine opcodes: integer ops on
uint32 words, bf16x2 ops lane by lane with exact round-to-nearest-even (products and sums formed
exactly in float64, then rounded to bf16 by hand). Every finite non-negative bf16 value meets every
scale byte under which it can occur (|x| * 2^-e < 8; < 7 without the saturating ``min``), with a
different value in the other lane of the word; the codes must be ``e2m1_codes``' in both lanes.
The GPU tests (tests/test_triton_fused.py, ``-m gpu``) run the compiled kernel against the torch
quantizer.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from mxconv.kernels.bf16x2 import PAIR_CODES_PTX, SATURATED_PAIR_CODES_PTX
from mxconv.mx.formats import e2m1_codes

MASK32 = np.uint64(0xFFFFFFFF)


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    """float64 values of bf16 bit patterns (uint64 0..0xFFFF)."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _bf16_round(v: np.ndarray) -> np.ndarray:
    """bf16 bits (uint64) of non-negative exact values ``v``, rounded to nearest-even (subnormals
    on the 2^-133 grid)."""
    _, exp = np.frexp(v)  # v = f * 2^exp, f in [0.5, 1)
    ulp = np.ldexp(1.0, np.maximum(exp - 1, -126) - 7)
    r = np.rint(v / ulp) * ulp  # numpy's rint rounds half to even
    return (r.astype(np.float32).view(np.uint32) >> 16).astype(np.uint64)


def _lanes(word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return word & np.uint64(0xFFFF), word >> np.uint64(16)


def _per_lane(fn, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    (alo, ahi), (blo, bhi) = _lanes(a), _lanes(b)
    return fn(alo, blo) | (fn(ahi, bhi) << np.uint64(16))


_OPS = {
    "and.b32": lambda a, b: a & b,
    "add.u32": lambda a, b: (a + b) & MASK32,
    "sub.u32": lambda a, b: (a - b) & MASK32,
    "shr.u32": lambda a, b: a >> b,
    "mul.rn.bf16x2": lambda a, b: _per_lane(lambda x, y: _bf16_round(_bf16_value(x) * _bf16_value(y)), a, b),
    "add.rn.bf16x2": lambda a, b: _per_lane(lambda x, y: _bf16_round(_bf16_value(x) + _bf16_value(y)), a, b),
    "max.bf16x2": lambda a, b: _per_lane(lambda x, y: np.where(_bf16_value(x) >= _bf16_value(y), x, y), a, b),
    "min.u16x2": lambda a, b: _per_lane(np.minimum, a, b),
}


def run_ptx(text: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Execute the PTX block ``text`` on uint64-held 32-bit words (``inputs``: "$1", "$2", ...);
    returns "$0". Knows the opcodes of the bf16x2 block and nothing else (an unknown one fails)."""
    env = dict(inputs)
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *srcs = [a.strip() for a in args.split(",")]
        vals = [np.uint64(int(s, 0)) if re.fullmatch(r"0x[0-9A-Fa-f]+|[0-9]+", s) else env[s] for s in srcs]
        env[dst] = vals[0] if op == "mov.b32" else _OPS[op](*vals)
    return env["$0"]


def _cases(limit: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(|x| bits of the low lane, of the high lane, scale byte): every finite non-negative bf16 in the
    low lane against every byte with |x| * 2^-e < ``limit``; the high lane holds another such value."""
    bits = np.arange(0, 0x7F80, dtype=np.uint64)
    value = _bf16_value(bits)
    lo, hi, bytes_ = [], [], []
    for byte in range(254):
        keep = bits[value * 2.0 ** (127 - byte) < limit]
        lo.append(keep)
        hi.append(np.roll(keep, 7))
        bytes_.append(np.full(len(keep), byte, dtype=np.uint64))
    return np.concatenate(lo), np.concatenate(hi), np.concatenate(bytes_)


def _expected(x_bits: np.ndarray, byte: np.ndarray) -> np.ndarray:
    y = _bf16_value(x_bits) * np.ldexp(1.0, 127 - byte.astype(np.int64))
    return e2m1_codes(torch.from_numpy(y.astype(np.float32))).numpy().astype(np.uint64)  # y is exact in fp32 or < 2^-126


def _codes(text: str, lo: np.ndarray, hi: np.ndarray, byte: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (low, high) lane codes ``text`` gives the words of ``lo`` and ``hi`` under ``byte``."""
    half = (np.uint64(254) - byte) << np.uint64(7)  # 2^-e as bf16 bits
    return _lanes(run_ptx(text, {"$1": lo | (hi << np.uint64(16)), "$2": half | (half << np.uint64(16))}))


def _check(text: str, limit: float) -> None:
    lo, hi, byte = _cases(limit)
    assert len(lo) > 4_000_000
    got_lo, got_hi = _codes(text, lo, hi, byte)
    assert np.array_equal(got_lo, _expected(lo, byte)), "low lane"
    assert np.array_equal(got_hi, _expected(hi, byte)), "high lane"


def test_pair_codes_equal_e2m1_codes_below_seven() -> None:
    _check(PAIR_CODES_PTX, 7.0)  # rceil keeps |y| <= 6, so the unsaturated block serves it


def test_saturated_pair_codes_equal_e2m1_codes_below_eight() -> None:
    _check(SATURATED_PAIR_CODES_PTX, 8.0)  # floor: |y| < 8, codes saturate at 6


def test_the_emulator_would_catch_a_wrong_constant() -> None:
    lo, hi, byte = _cases(8.0)
    wrong = SATURATED_PAIR_CODES_PTX.replace("0x03000300", "0x03800380")  # magic 2^(7+t): steps twice as wide
    got_lo, _ = _codes(wrong, lo, hi, byte)
    assert not np.array_equal(got_lo, _expected(lo, byte))
