"""The registry-wide test cases: every backend with every weight format it declares
(``Layout.weight_formats``) and the activations it takes for that format (``Layout.format_activations``),
and random canonical stacks of each format, so a test over "every backend" reaches an MXFP8-only or
INT4 form as well as the MXFP4 ones. Nothing here lists a backend: all of it is read from the registry."""

from __future__ import annotations

import torch

from mxconv.experts.stack import CanonicalExperts
from mxconv.layouts import backend_names, get_layout
from mxconv.mx.int4 import pack_int4

# the canonical formats a stack or a source is made in here, in this order
FORMATS = ("mxfp4", "mxfp8", "int4")


def format_cases(formats: tuple[str, ...] = FORMATS) -> list[tuple[str, str]]:
    """(backend, weight format) for every registered backend and every format of ``formats`` it takes."""
    return [(b, f) for b in backend_names() for f in get_layout(b).weight_formats if f in formats]


def activation_cases(formats: tuple[str, ...] = FORMATS) -> list[tuple[str, str, str]]:
    """(backend, weight format, activation) for :func:`format_cases` and each activation the backend takes
    for that format, leaving out those that store a source's FP8 input scales (W4A8: a source must have them)."""
    return [(b, f, a) for b, f in format_cases(formats) for a in get_layout(b).format_activations(f)
            if a not in get_layout(b).input_scale_activations]  # fmt: skip


def case_id(case: tuple[str, ...]) -> str:
    return "-".join(case)


def takes_biases(backend: str, weight_format: str) -> bool:
    """Whether ``backend``'s bytes for ``weight_format`` experts hold expert biases (its declared refusal)."""
    return get_layout(backend).bias_refusal(weight_format) is None


def make_stack(weight_format: str, E: int, H: int, I: int, row_order: str, bias: bool = True,
               seed: int = 0) -> CanonicalExperts:  # fmt: skip
    """A random canonical stack of ``weight_format`` on CPU. MX scale bytes in [1, 249] (Marlin's fp8
    variant takes them), INT4 group scales in [0.25, 1.25) bf16; biases (bf16) only where ``bias``."""
    g = torch.Generator().manual_seed(seed)

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    if weight_format == "int4":
        q = lambda *s: torch.randint(-8, 8, s, generator=g)
        sc = lambda *s: (torch.rand(s, generator=g) + 0.25).to(torch.bfloat16)
        weights = (pack_int4(q(E, 2 * I, H)), sc(E, 2 * I, H // 32), pack_int4(q(E, H, I)), sc(E, H, I // 32))
    else:
        per = 2 if weight_format == "mxfp4" else 1
        weights = (u8(E, 2 * I, H // per), u8(E, 2 * I, H // 32, lo=1, hi=250), u8(E, H, I // per),
                   u8(E, H, I // 32, lo=1, hi=250))  # fmt: skip
    biases = (torch.randn(E, 2 * I, generator=g).to(torch.bfloat16), torch.randn(E, H, generator=g).to(torch.bfloat16))
    return CanonicalExperts(*weights, *(biases if bias else (None, None)), row_order=row_order, weight_format=weight_format)


# (E, H, I, row order) of a small stack every form of the format takes: MXFP4 sizes every MXFP4 form pads;
# MXFP8 forms pad nothing and take H % 64 == 0 (marlin's) and I % 64 == 0 (aiter's); trtllm's MxInt4 takes
# multiples of 256 with halves
SMALL_SHAPES = {"mxfp4": (2, 128, 96, "interleaved"), "mxfp8": (2, 128, 128, "halves"), "int4": (2, 256, 256, "halves")}


def small_stack(backend: str, weight_format: str, seed: int = 0) -> CanonicalExperts:
    """A :data:`SMALL_SHAPES` stack of ``weight_format``, with biases where ``backend``'s bytes hold them."""
    return make_stack(weight_format, *SMALL_SHAPES[weight_format], bias=takes_biases(backend, weight_format), seed=seed)
