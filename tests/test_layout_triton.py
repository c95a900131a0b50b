"""triton_kernels Hopper ("triton") MXFP4 layout: spec worked examples, scalar formulas, the sizes
table, round trips, padding checks, the gate/up interleave, triton_kernels' own layout classes as
an oracle (when importable), the Triton kernels under the interpreter, and CUDA == CPU (``-m gpu``).

Spec: docs/layout-triton.md. The scalar helpers re-derive every index from the spec's formulas in
plain Python, independently of the vectorised module.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.gathers import layout_kernels
from mxconv.layouts.triton import LAYOUT, TritonOptions
from mxconv.layouts.triton_bytemap import (
    TWIDDLE_GROUPS, permute_scales, permute_values, twiddle_words, unpermute_scales, unpermute_values, w13_row_table,
)
from support.interpreter import kernels_match_torch, print_report, report_fixture

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_layout_gpu import make_stack, same_bytes  # noqa: E402

GENERATIONS = ("3.5", "3.6")


def sizes_of(c: CanonicalExperts, opts: TritonOptions) -> LayoutSizes:
    return c.sizes(*LAYOUT.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, "bf16", opts))


def ids(*shape: int) -> torch.Tensor:
    """int64 tensor whose value is its own flat index (traces where each element goes)."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.int64).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Scalar formulas straight from the spec
# ---------------------------------------------------------------------------------------------


def value_source(R: int, Cc: int) -> tuple[int, int]:
    """§3: (row, byte) of the canonical matrix behind buf[R, Cc] (before the twiddle)."""
    r0, t0 = R // 4, R % 4
    r1, s0, t1 = Cc // 128, (Cc // 64) % 2, (Cc // 16) % 4
    a1, w1, w0 = (Cc // 4) % 4, (Cc // 2) % 2, Cc % 2
    return 16 * r0 + 8 * w0 + 2 * t0 + s0, 32 * r1 + 8 * a1 + 4 * w1 + t1


def scale_source(R: int, Cc: int, W: int) -> tuple[int, int]:
    """§4: (row, column) of the canonical scale matrix behind buf[R, Cc]."""
    m0, w = R // W, R % W
    k0, i1, i4, k1, i3 = Cc // 64, (Cc // 32) % 2, (Cc // 4) % 8, (Cc // 2) % 2, Cc % 2
    return 32 * W * m0 + 16 * W * i1 + 16 * w + 8 * i3 + i4, 2 * k0 + k1


# nibble j: destination bits of (m, e0, e1, s), low nibbles -> bits 0-15, high nibbles -> +16 (§3 table)
TWIDDLE_TABLE = {0: (6, 7, 8, 15), 1: (3, 4, 5, 12), 2: (0, 1, 2, 9), 3: (13, 10, 11, 14)}


def twiddle_scalar(b: list[int]) -> list[int]:
    """§3 bit twiddle of one 4-byte group, bit by bit; returns the 4 little-endian output bytes."""
    word = 0
    for j in range(4):
        for half, nib in ((0, b[j] & 0xF), (16, b[j] >> 4)):
            for bit in range(4):
                if nib >> bit & 1:
                    word |= 1 << (half + TWIDDLE_TABLE[j][bit])
    return [(word >> (8 * i)) & 0xFF for i in range(4)]


# ---------------------------------------------------------------------------------------------
# Spec §6 worked examples and the §3 twiddle example
# ---------------------------------------------------------------------------------------------

VALUE_EXAMPLE = {
    (0, 0): (0, 0), (0, 1): (8, 0), (0, 2): (0, 4), (0, 3): (8, 4), (0, 4): (0, 8), (0, 7): (8, 12),
    (0, 8): (0, 16), (0, 16): (0, 1), (0, 64): (1, 0), (0, 128): (0, 32), (1, 0): (2, 0), (4, 0): (16, 0),
}  # fmt: skip
SCALE_EXAMPLE = {
    (0, 0): (0, 0), (0, 1): (8, 0), (0, 2): (0, 1), (0, 3): (8, 1), (0, 4): (1, 0), (0, 31): (15, 1),
    (0, 32): (128, 0), (0, 64): (0, 2), (1, 0): (16, 0), (7, 0): (112, 0),
}  # fmt: skip


def test_twiddle_worked_example() -> None:
    b = torch.tensor([0x21, 0x43, 0x65, 0x87], dtype=torch.uint8)
    assert twiddle_words(b).tolist() == [0x5D, 0x2C, 0xA6, 0x40]
    assert twiddle_scalar([0x21, 0x43, 0x65, 0x87]) == [0x5D, 0x2C, 0xA6, 0x40]
    assert twiddle_words(twiddle_words(b), inverse=True).tolist() == [0x21, 0x43, 0x65, 0x87]


def test_twiddle_matches_the_bit_table_and_is_a_bijection() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4096,), generator=g, dtype=torch.int32).to(torch.uint8)
    x[:32] = torch.tensor([1 << (i % 8) for i in range(32)], dtype=torch.uint8)  # single bits
    got = twiddle_words(x).view(-1, 4).tolist()
    assert got == [twiddle_scalar(q) for q in x.view(-1, 4).tolist()]
    assert torch.equal(twiddle_words(twiddle_words(x), inverse=True), x)
    masks = [m & 0xFFFFFFFF for _, m in TWIDDLE_GROUPS]
    assert sum(bin(m).count("1") for m in masks) == 32 and len(set().union(*[{i for i in range(32) if m >> i & 1} for m in masks])) == 32


def test_value_worked_example() -> None:
    buf = permute_values(ids(1, 32, 64))[0]
    assert tuple(buf.shape) == (8, 256)
    for (R, Cc), (row, byte) in VALUE_EXAMPLE.items():
        assert int(buf[R, Cc]) == row * 64 + byte, (R, Cc)
        assert value_source(R, Cc) == (row, byte)


def test_scale_worked_example() -> None:
    buf = permute_scales(ids(1, 256, 4), 8)[0]
    assert tuple(buf.shape) == (8, 128)
    for (R, Cc), (row, col) in SCALE_EXAMPLE.items():
        assert int(buf[R, Cc]) == row * 4 + col, (R, Cc)
        assert scale_source(R, Cc, 8) == (row, col)


def test_worked_examples_through_to_kernel() -> None:
    """w2 of H = 32, I = 128 is the §6 canonical [32, 64] byte matrix: its stored buffer is the
    example's permutation, then the twiddle; w13's scales of H = I = 128 are the [256, 4] example."""
    o = LAYOUT.resolve_options({"scale_k_align": 1})
    c = make_stack(2, 32, 128, "interleaved", bias=False, seed=3)
    expected = torch.empty(2, 8, 256, dtype=torch.uint8)
    for R in range(8):
        for Cc in range(256):
            row, byte = value_source(R, Cc)
            expected[:, R, Cc] = c.w2[:, row, byte]
    assert torch.equal(LAYOUT.to_kernel(c, "bf16", o)["w2_weight"], twiddle_words(expected))
    c = make_stack(2, 128, 128, "interleaved", bias=False, seed=4)
    got = LAYOUT.to_kernel(c, "bf16", o)["w13_weight_scale"]
    assert tuple(got.shape) == (2, 8, 128)
    for (R, Cc), (row, col) in SCALE_EXAMPLE.items():
        assert torch.equal(got[:, R, Cc], c.w13_scale[:, row, col])


@pytest.mark.parametrize("n,kb", [(16, 32), (48, 96), (64, 160)])
def test_value_permutation_matches_scalar_formula(n: int, kb: int) -> None:
    buf = permute_values(ids(1, n, kb))[0]
    assert tuple(buf.shape) == (n // 4, 4 * kb)
    for R in range(n // 4):
        for Cc in range(4 * kb):
            row, byte = value_source(R, Cc)
            assert int(buf[R, Cc]) == row * kb + byte
    assert torch.equal(unpermute_values(buf[None])[0], ids(n, kb))


@pytest.mark.parametrize("W", [8, 4])
@pytest.mark.parametrize("cols", [2, 6])
def test_scale_permutation_matches_scalar_formula(W: int, cols: int) -> None:
    n = 64 * W
    buf = permute_scales(ids(1, n, cols), W)[0]
    assert tuple(buf.shape) == (n // 32, 32 * cols)
    for R in range(n // 32):
        for Cc in range(32 * cols):
            row, col = scale_source(R, Cc, W)
            assert int(buf[R, Cc]) == row * cols + col
    assert torch.equal(unpermute_scales(buf[None], W)[0], ids(n, cols))


# ---------------------------------------------------------------------------------------------
# Sizes (spec §3/§4 gpt-oss tables), options, manifest
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "I,gen,align,w13,w2,s13,s2",
    [
        (2880, "3.5", 4, (1440, 5760), (720, 5760), (184, 2944), (96, 2944)),
        (2880, "3.6", 4, (1440, 5888), (720, 5888), (184, 2944), (96, 2944)),
        (2880, "3.5", 1, (1440, 5760), (720, 5760), (184, 2880), (96, 2880)),
        (1440, "3.5", 4, (736, 5760), (720, 2944), None, None),
        (1440, "3.6", 4, (736, 5888), (720, 3072), None, None),
    ],
)
def test_gpt_oss_sizes_table(I: int, gen: str, align: int, w13, w2, s13, s2) -> None:
    opts = LAYOUT.resolve_options({"triton_layout": gen, "scale_k_align": align})
    hp, ip = LAYOUT.padded_sizes(2880, I, "interleaved", "bf16", opts)
    assert (hp, ip) == (2880, 1472 if I == 1440 else 2880)
    specs = LAYOUT.kernel_specs(LayoutSizes(128, 2880, I, hp, ip, "interleaved", True), "bf16", opts)
    assert specs["w13_weight"].shape == (128, *w13) and specs["w2_weight"].shape == (128, *w2)
    assert specs["w13_bias"].shape == (128, 2 * ip) and specs["w13_bias"].dtype == torch.float32
    if s13:
        assert specs["w13_weight_scale"].shape == (128, *s13) and specs["w2_weight_scale"].shape == (128, *s2)


def test_options_and_padded_sizes() -> None:
    assert LAYOUT.resolve_options().to_json() == {"triton_layout": "3.5", "num_warps": 8, "scale_k_align": 4, "pad_hidden": False, "arch": "sm90"}
    got = LAYOUT.resolve_options({"triton_layout": "3.6", "num_warps": "4", "scale_k_align": "1", "pad_hidden": "true"})
    assert got.to_json() == {"triton_layout": "3.6", "num_warps": 4, "scale_k_align": 1, "pad_hidden": True, "arch": "sm90"}
    for bad in ({"triton_layout": "3.4"}, {"num_warps": 16}, {"scale_k_align": 2}, {"intermediate_align": 64}):
        with pytest.raises(LayoutError):
            LAYOUT.resolve_options(bad)
    assert LAYOUT.padded_sizes(352, 160, "halves", "bf16") == (352, 192)
    assert LAYOUT.padded_sizes(352, 160, "halves", "bf16", LAYOUT.resolve_options({"pad_hidden": True})) == (384, 192)
    with pytest.raises(LayoutError, match="multiple of 32"):
        LAYOUT.padded_sizes(350, 160, "halves", "bf16")
    with pytest.raises(LayoutError, match="activation"):
        LAYOUT.padded_sizes(352, 160, "halves", "mxfp8")
    assert "triton" in backend_names() and get_layout("triton") is LAYOUT


def test_hidden_warning_and_manifest() -> None:
    msg = LAYOUT.hidden_warning(352)
    assert msg and "352" in msg and "multiple of 64" in msg and "pad_hidden=true" in msg and "384" in msg
    assert LAYOUT.hidden_warning(352, LAYOUT.resolve_options({"pad_hidden": True})) is None and LAYOUT.hidden_warning(2880) is None
    c = make_stack(3, 352, 160, "halves", seed=2)
    for opts in ({}, {"pad_hidden": True, "triton_layout": "3.6", "num_warps": 4, "scale_k_align": 1}):
        o = LAYOUT.resolve_options(opts)
        sizes = sizes_of(c, o)
        d = LAYOUT.describe(sizes, "bf16", o)
        json.dumps(d)
        assert d["name"] == "triton" and d["vllm_moe_backend"] == "TRITON" and d["activation"] == "bf16"
        assert (d["triton_layout"], d["num_warps"], d["scale_k_align"]) == (o.triton_layout, o.num_warps, o.scale_k_align)
        assert d["w13_kernel_row_order"] == "interleaved" and d["w13_source_row_order"] == "halves"
        assert d["hidden_padded"] is o.pad_hidden and (d["hidden_warning"] is None) is o.pad_hidden
        k = LAYOUT.to_kernel(c, "bf16", o)
        hp, ip = sizes.padded_hidden_size, sizes.padded_intermediate_size
        for w, n, kk in (("w13", 2 * ip, hp), ("w2", hp, ip)):
            v, s = d[w]["value"], d[w]["scale"]
            assert v["initial_shape"] == [3, kk // 2, n] and v["shape"] == [3, kk, n]
            assert v["buffer_shape"] == list(k[f"{w}_weight"].shape)
            mt = k[f"{w}_weight"].mT
            assert v["data_shape"] == list(mt.shape) and v["data_strides"] == list(mt.stride())
            c_logical = -(-kk // 32 // o.scale_k_align) * o.scale_k_align
            assert s["shape"] == [3, c_logical, n] and s["num_warps"] == o.num_warps
            assert s["buffer_shape"] == list(k[f"{w}_weight_scale"].shape)
            assert s["data_strides"] == list(k[f"{w}_weight_scale"].mT.stride())


# ---------------------------------------------------------------------------------------------
# Round trips, padding checks, gate/up interleave
# ---------------------------------------------------------------------------------------------

OPTION_SETS = [
    {},
    {"triton_layout": "3.6"},
    {"num_warps": 4},
    {"triton_layout": "3.6", "num_warps": 4, "scale_k_align": 1},
    {"pad_hidden": True},
]


@pytest.mark.parametrize("opts", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
@pytest.mark.parametrize("shape", [(3, 352, 160), (2, 96, 64), (2, 512, 256)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [True, False])
def test_round_trip(opts: dict, row_order: str, shape: tuple[int, int, int], bias: bool) -> None:
    c = make_stack(*shape, row_order, bias=bias, seed=sum(shape))
    o = LAYOUT.resolve_options(opts)
    k = LAYOUT.to_kernel(c, "bf16", o)
    sizes = sizes_of(c, o)
    specs = LAYOUT.kernel_specs(sizes, "bf16", o)
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {n: (s.shape, s.dtype) for n, s in specs.items()}
    back = LAYOUT.from_kernel(k, sizes, "bf16", o)
    assert back.row_order == row_order
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, name), getattr(c, name)), name
    if bias:
        assert torch.equal(back.w13_bias, c.w13_bias.float()) and torch.equal(back.w2_bias, c.w2_bias.float())
    else:
        assert back.w13_bias is None and back.w2_bias is None


def _kernel_view(k: dict, name: str, W: int) -> torch.Tensor:
    """Un-swizzled [E, rows, cols] view of stored tensor ``name`` (biases as stored)."""
    if name.endswith("_weight"):
        return unpermute_values(twiddle_words(k[name], inverse=True))
    if name.endswith("_scale"):
        return unpermute_scales(k[name], W)
    return k[name]


def _restore(k: dict, name: str, view: torch.Tensor, W: int) -> None:
    if name.endswith("_weight"):
        k[name] = twiddle_words(permute_values(view))
    elif name.endswith("_scale"):
        k[name] = permute_scales(view, W)
    else:
        k[name] = view


PADDING_CASES = [
    ("w13_weight", (1, 320, 5), {}),  # pair m = 160 >= I (vLLM's intermediate padding)
    ("w13_weight", (0, 3, 176), {}),  # byte >= H/2 (value layout byte padding)
    ("w13_weight_scale", (1, 383, 0), {}),  # last padded pair row
    ("w13_weight_scale", (0, 0, 11), {}),  # K/32 = 11 -> 12: vLLM 0.33's pre-pad column
    ("w13_weight_scale", (0, 400, 1), {}),  # swizzle row padding (384 -> 512)
    ("w2_weight", (1, 7, 80), {"triton_layout": "3.6"}),  # byte >= I/2
    ("w2_weight", (0, 360, 0), {"triton_layout": "3.6"}),  # 3.6 value rows 352 -> 384
    ("w2_weight", (0, 360, 0), {"pad_hidden": True}),  # hidden padded 352 -> 384
    ("w2_weight_scale", (0, 352, 0), {}),  # hidden rows padded 352 -> 512 by the swizzle
    ("w2_weight_scale", (0, 9, 5), {"num_warps": 4}),  # K/32 = 5 -> 6 (Ip) -> 8 (pre-pad)
    ("w13_bias", (1, 330), {}),
    ("w2_bias", (1, 370), {"pad_hidden": True}),
]


@pytest.mark.parametrize("name,index,opts", PADDING_CASES, ids=lambda x: str(x))
def test_padding_checks_name_tensor_and_index(name: str, index: tuple[int, ...], opts: dict) -> None:
    """E=2, H=352, I=160 -> Ip=192: each kind of padding (vLLM's intermediate pairs, the value
    layout's rows/bytes, the scale K/32 pre-pad and swizzle padding, hidden padding, biases)."""
    c = make_stack(2, 352, 160, "halves", seed=7)
    o = LAYOUT.resolve_options(opts)
    k = LAYOUT.to_kernel(c, "bf16", o)
    view = _kernel_view(k, name, o.num_warps).clone()
    view[index] = 1
    _restore(k, name, view, o.num_warps)
    with pytest.raises(LayoutError, match=rf"triton: padding of {name} at index \[{', '.join(map(str, index))}\]"):
        LAYOUT.from_kernel(k, sizes_of(c, o), "bf16", o)


def test_from_kernel_rejects_wrong_tensors() -> None:
    c = make_stack(2, 352, 160, "interleaved", seed=8)
    o = LAYOUT.resolve_options()
    sizes = sizes_of(c, o)
    k = LAYOUT.to_kernel(c, "bf16", o)
    with pytest.raises(LayoutError, match=r"missing \[.w2_bias.\]"):
        LAYOUT.from_kernel({n: t for n, t in k.items() if n != "w2_bias"}, sizes, "bf16", o)
    with pytest.raises(LayoutError, match="triton kernel tensor w13_weight is"):
        LAYOUT.from_kernel({**k, "w13_weight": k["w13_weight"][:, :-4]}, sizes, "bf16", o)
    with pytest.raises(LayoutError, match=r"unexpected \[.extra.\]"):
        LAYOUT.from_kernel({**k, "extra": k["w2_bias"]}, sizes, "bf16", o)
    with pytest.raises(LayoutError, match="padded sizes"):
        LAYOUT.from_kernel(k, LayoutSizes(2, 352, 160, 352, 256, "interleaved", True), "bf16", o)


def test_halves_rows_are_interleaved_as_spec_section_5() -> None:
    """Kernel row 2m <- gate m (source row m), 2m+1 <- up m (source row I + m): weights, scales and
    bias; the result equals the interleaved source of the same experts."""
    E, H, I = 2, 128, 96
    c = make_stack(E, H, I, "halves", seed=11)
    o = LAYOUT.resolve_options()
    k = LAYOUT.to_kernel(c, "bf16", o)
    w = _kernel_view(k, "w13_weight", 8)
    s = _kernel_view(k, "w13_weight_scale", 8)
    for m in range(I):
        for u in range(2):
            assert torch.equal(w[:, 2 * m + u, : H // 2], c.w13[:, u * I + m]), (m, u)
            assert torch.equal(s[:, 2 * m + u, : H // 32], c.w13_scale[:, u * I + m]), (m, u)
            assert torch.equal(k["w13_bias"][:, 2 * m + u], c.w13_bias[:, u * I + m].float())
    inter = torch.arange(2 * I).reshape(2, I).t().reshape(-1)  # 0, I, 1, I+1, ...
    ci = CanonicalExperts(c.w13[:, inter], c.w13_scale[:, inter], c.w2, c.w2_scale, c.w13_bias[:, inter], c.w2_bias, "interleaved")
    assert not same_bytes(LAYOUT.to_kernel(ci, "bf16", o), k)
    tab = w13_row_table(I, "halves", 2 * 128)
    assert tab[:4].tolist() == [0, I, 1, I + 1] and tab[2 * I :].eq(-1).all()


# ---------------------------------------------------------------------------------------------
# triton_kernels' own layout classes as an oracle (vLLM's vendored copy; not in CI)
# ---------------------------------------------------------------------------------------------


def oracle_layouts() -> tuple[type, type]:
    """(HopperMXValueLayout, HopperMXScaleLayout) from ``$MXCONV_TRITON_KERNELS`` (the folder that
    holds the ``triton_kernels`` package) or ``<repo>/.kern``; skip when it does not import."""
    root = os.environ.get("MXCONV_TRITON_KERNELS") or str(HERE.parent / ".kern")
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout
    except Exception as exc:  # noqa: BLE001 - any import failure means "no oracle here"
        pytest.skip(f"triton_kernels is not importable from {root} (set MXCONV_TRITON_KERNELS to the folder "
                    f"holding vLLM's vendored triton_kernels): {type(exc).__name__}: {exc}")  # fmt: skip
    return HopperMXValueLayout, HopperMXScaleLayout


def oracle_buffers(c: CanonicalExperts, opts: TritonOptions, device: str = "cpu") -> dict[str, torch.Tensor]:
    """What vLLM's ``_swizzle_mxfp4`` stores (``data.mT``) for ``c``: vLLM's zero padding of I (and
    of H with pad_hidden), gate/up row interleave for halves, K/32 pre-pad, then triton_kernels."""
    value_cls, scale_cls = oracle_layouts()
    H, I = c.hidden_size, c.intermediate_size
    hp, ip = LAYOUT.padded_sizes(H, I, c.row_order, "bf16", opts)
    out = {}
    for w, n_real, n, kk in (("w13", 2 * I, 2 * ip, hp), ("w2", H, hp, ip)):
        src_w, src_s = getattr(c, w), getattr(c, f"{w}_scale")
        if w == "w13" and c.row_order == "halves":
            order = torch.arange(2 * I).reshape(2, I).t().reshape(-1)
            src_w, src_s = src_w[:, order], src_s[:, order]
        m = 64 if opts.triton_layout == "3.6" else 1  # 3.6 sees N and K/2 already padded to 64
        wp = torch.zeros(c.num_experts, -(-n // m) * m, -(-kk // 2 // m) * m, dtype=torch.uint8)
        wp[:, :n_real, : src_w.shape[2]] = src_w
        c_logical = -(-kk // 32 // opts.scale_k_align) * opts.scale_k_align
        sp = torch.zeros(c.num_experts, n, c_logical, dtype=torch.uint8)
        sp[:, :n_real, : src_s.shape[2]] = src_s
        wp, sp = wp.to(device), sp.to(device)
        vl = value_cls(list(wp.mT.shape), mx_axis=1)
        sl = scale_cls(list(sp.mT.shape), mx_axis=1, num_warps=opts.num_warps)
        out[f"{w}_weight"] = vl.swizzle_data(wp.mT).mT.contiguous()
        out[f"{w}_weight_scale"] = sl.swizzle_data(sp.mT).mT.contiguous()
        assert torch.equal(vl.unswizzle_data(out[f"{w}_weight"].mT).mT, wp)  # their inverse of our bytes
        assert torch.equal(sl.unswizzle_data(out[f"{w}_weight_scale"].mT).mT[:, :n, :c_logical], sp)
    return out


@pytest.mark.parametrize("opts", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
@pytest.mark.parametrize("shape", [(3, 352, 160), (1, 2880, 1440)], ids=lambda s: "x".join(map(str, s)))
def test_bytes_equal_triton_kernels_oracle(opts: dict, row_order: str, shape: tuple[int, int, int]) -> None:
    o = LAYOUT.resolve_options(opts)
    c = make_stack(*shape, row_order, bias=False, seed=shape[1] + len(row_order))
    ref = oracle_buffers(c, o)
    got = LAYOUT.to_kernel(c, "bf16", o)
    for name, t in ref.items():
        assert got[name].shape == t.shape and torch.equal(got[name], t), name


# ---------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (subprocess with TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------

INTERP_CASES = [("interleaved", {}), ("halves", {"triton_layout": "3.6"}), ("halves", {"num_warps": 4, "scale_k_align": 1})]


def _interpreter_main() -> None:
    """Runs in the subprocess: print a JSON report of every kernel-vs-torch comparison."""
    import mxconv.layouts.triton as tl_mod
    from mxconv.kernels import triton_swizzle as ts
    from mxconv.layouts.gathers import gather_padded_rows

    g = torch.Generator().manual_seed(0)

    def data(rows_in: int, cols_in: int, rows_out: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random bytes [2, rows_in, cols_in] and a random row table [rows_out] (-1 = padding row)."""
        x = torch.randint(0, 256, (2, rows_in, cols_in), dtype=torch.uint8, generator=g)
        rows = torch.cat([torch.randperm(rows_in, generator=g), torch.full((rows_out - rows_in,), -1)])
        return x, rows[torch.randperm(rows_out, generator=g)]

    report: dict[str, bool] = {}
    for r_in, n, kb_in, kb in ((40, 48, 44, 64), (64, 64, 96, 96), (30, 128, 16, 320)):
        src, tab = data(r_in, kb_in, n)
        ref = twiddle_words(permute_values(gather_padded_rows(src, tab, kb)))
        report[f"values-{n}x{kb}"] = torch.equal(ts.hopper_values(src, tab, kb), ref)
    for W, r_in, n, c_in, cols in ((8, 200, 256, 9, 12), (8, 60, 512, 90, 92), (4, 100, 128, 5, 6), (4, 128, 256, 45, 46)):
        src, tab = data(r_in, c_in, n)
        ref = permute_scales(gather_padded_rows(src, tab, cols), W)
        report[f"scales-W{W}-{n}x{cols}"] = torch.equal(ts.hopper_scales(src, tab, cols, W), ref)
    for row_order, opts in INTERP_CASES:
        c = make_stack(2, 352, 160, row_order, seed=len(report))
        o = LAYOUT.resolve_options(opts)
        report[f"to_kernel-{row_order}-{opts}"] = kernels_match_torch(tl_mod, ts, lambda: LAYOUT.to_kernel(c, "bf16", o))
    print_report(report)


interpreter_report = report_fixture("test_layout_triton")


def test_interpreter_kernels_equal_torch(interpreter_report: dict[str, bool]) -> None:
    assert len(interpreter_report) == 7 + len(INTERP_CASES)
    assert all(interpreter_report.values()), [k for k, v in interpreter_report.items() if not v]


# ---------------------------------------------------------------------------------------------
# CUDA (``-m gpu``): Triton kernels == CPU torch path, round trips, the oracle at full size
# ---------------------------------------------------------------------------------------------

# (E, H, I): padded odd sizes; gpt-oss-120b per expert at TP1 (H = I = 2880) and TP2 (I = 1440 -> 1472)
GPU_SHAPES = [(4, 352, 160), (2, 2880, 2880), (2, 2880, 1440)]
GPU_OPTIONS = [{}, {"triton_layout": "3.6"}, {"num_warps": 4, "scale_k_align": 1}, {"triton_layout": "3.6", "pad_hidden": True}]


@pytest.mark.gpu
@pytest.mark.parametrize("opts", GPU_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_equals_cpu_and_round_trips(opts: dict, row_order: str, shape: tuple[int, int, int]) -> None:
    o = LAYOUT.resolve_options(opts)
    c = make_stack(*shape, row_order, seed=sum(shape) + len(row_order))
    cuda = c.to("cuda")
    assert layout_kernels(cuda.w13, KernelChoice.AUTO) is not None  # the Triton kernels run
    k_gpu = LAYOUT.to_kernel(cuda, "bf16", o)
    assert all(t.is_cuda for t in k_gpu.values())
    k_cpu = LAYOUT.to_kernel(c, "bf16", o)
    assert not same_bytes(k_gpu, k_cpu), same_bytes(k_gpu, k_cpu)
    back = LAYOUT.from_kernel(k_gpu, sizes_of(c, o), "bf16", o)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, name).cpu(), getattr(c, name)), name
    assert torch.equal(back.w13_bias.cpu(), c.w13_bias.float()) and torch.equal(back.w2_bias.cpu(), c.w2_bias.float())


@pytest.mark.gpu
@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
def test_cuda_torch_path_and_no_bias(row_order: str) -> None:
    c = make_stack(4, 352, 160, row_order, bias=False, seed=21)
    o = LAYOUT.resolve_options()
    k_cpu = LAYOUT.to_kernel(c, "bf16", o)
    assert "w13_bias" not in k_cpu
    assert not same_bytes(LAYOUT.to_kernel(c.to("cuda"), "bf16", o), k_cpu)
    assert layout_kernels(torch.zeros(1, device="cuda"), KernelChoice.TORCH) is None
    assert not same_bytes(LAYOUT.to_kernel(c.to("cuda"), "bf16", o, KernelChoice.TORCH), k_cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
def test_cuda_equals_triton_kernels_oracle_gpt_oss_120b(gen: str, row_order: str) -> None:
    o = LAYOUT.resolve_options({"triton_layout": gen})
    c = make_stack(4, 2880, 2880, row_order, bias=False, seed=31)
    ref = oracle_buffers(c, o, device="cuda")
    got = LAYOUT.to_kernel(c.to("cuda"), "bf16", o)
    for name, t in ref.items():
        assert got[name].shape == t.shape and torch.equal(got[name], t), name


def test_random_spot_checks_of_full_buffers() -> None:
    """Random buffer positions of a padded odd stack against the scalar formulas + twiddle."""
    c = make_stack(2, 352, 160, "interleaved", bias=False, seed=41)
    o = LAYOUT.resolve_options()
    k = LAYOUT.to_kernel(c, "bf16", o)
    rng = random.Random(0)
    buf = k["w2_weight"]  # [E, 352/4, 4*96]: rows 352 (no row padding), bytes 80 -> 96
    for _ in range(200):
        e, R, q = rng.randrange(2), rng.randrange(buf.shape[1]), rng.randrange(buf.shape[2] // 4)
        group = []
        for Cc in range(4 * q, 4 * q + 4):
            row, byte = value_source(R, Cc)
            group.append(int(c.w2[e, row, byte]) if byte < 80 else 0)
        assert buf[e, R, 4 * q : 4 * q + 4].tolist() == twiddle_scalar(group)
    s = k["w13_weight_scale"]  # rows 2Ip = 384 -> 512, K/32 = 11 -> 12
    for _ in range(200):
        e, R, Cc = rng.randrange(2), rng.randrange(s.shape[1]), rng.randrange(s.shape[2])
        row, col = scale_source(R, Cc, 8)
        want = int(c.w13_scale[e, row, col]) if row < 320 and col < 11 else 0
        assert int(s[e, R, Cc]) == want


def test_verify_takes_the_hidden_warning_as_advice_whatever_its_wording(tmp_path: Path) -> None:
    """``hidden_warning`` is advice in words (TritonLayout.advisory_keys): an output written when it was worded
    otherwise (mxconv before this session said "use --layout-option ...") still verifies; a warning removed
    where the layout gives one, or planted where it gives none, fails verify (exit 1)."""
    from support.cli import mx

    from mxconv.examples import ModelSizes, make_checkpoint

    make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4", ModelSizes(hidden_size=288, intermediate_size=160))
    code, _, err = mx("repack", tmp_path / "src", tmp_path / "out", "--backend", "triton", "--quiet", "--device", "cpu")
    assert code == 0, err
    path = tmp_path / "out" / "mxconv.json"
    doc = json.loads(path.read_text())
    assert "pad_hidden=true" in doc["layout"]["hidden_warning"]

    def verify_with(warning: object) -> tuple[int, str]:
        path.write_text(json.dumps({**doc, "layout": {**doc["layout"], "hidden_warning": warning}}))
        code, out, err = mx("verify", tmp_path / "out", "--device", "cpu")
        return code, out + err

    old = ("hidden size 288 is not a multiple of 64: vLLM's TRITON MoE path on Hopper (triton_kernels matmul_ogs) computes "
           "wrong results for it (docs/real-kernels.md). The bytes written are what vLLM builds; for a loader that pads "
           "activations use --layout-option pad_hidden=true (hidden padded to 320 with zeros)")
    assert verify_with(old)[0] == 0
    code, text = verify_with(None)
    assert code == 1 and "manifest layout.hidden_warning is None" in text
