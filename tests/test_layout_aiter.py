"""AITER layout (docs/layout-aiter.md): worked examples, scalar formulas, round trips, padding checks.

The expected bytes are built here from the spec's formulas written out in plain Python (one loop
per byte), independently of the reshape/permute implementation in mxconv.layouts.aiter.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import pytest
import torch

from mxconv.errors import LayoutError
from mxconv.experts.padding import pad_canonical
from mxconv.experts.stack import CanonicalExperts, LayoutSizes, round_up
from mxconv.layouts import get_layout
from mxconv.layouts.aiter import LAYOUT
from mxconv.layouts.aiter_bytemap import (
    SCALE_PAD_FILL, deinterleave_rows, deinterleave_source_rows, e8m0_shuffle, e8m0_unshuffle, gu16, gu16_inverse,
    gu16_source_rows, interleave_rows, permute_padded, s32x8, s32x8_dest_offsets, s32x8_inverse, shuffle_scale_a16w4,
    shuffle_scale_a4w4, w16, w16_dest_offsets, w16_inverse,
)


# ---------------------------------------------------------------------------------------------
# Spec formulas, scalar, plain Python
# ---------------------------------------------------------------------------------------------


def w16_offset(r: int, c: int, nbytes: int) -> int:
    """Spec 2.1: flat offset of byte (r, c) of an [N, B] matrix."""
    return ((r // 16) * (nbytes // 16) + (c // 16)) * 256 + (r % 16) * 16 + (c % 16)


def gu16_source(d: int, n: int) -> int:
    """Spec 2.2: concat source row of GU16 destination row d."""
    j, q = d // 16, d % 16
    return (j % 2) * (n // 2) + (j // 2) * 16 + q


def gu16_dest_of(n: int) -> dict[int, int]:
    """Concat row -> GU16 destination row, inverted from the spec's source formula."""
    return {gu16_source(d, n): d for d in range(n)}


def s32x8_offset(r: int, q: int, cols: int) -> int:
    """Spec 2.3: flat offset of scale (r, q) of an [R, C'] matrix."""
    b, c = (r % 32) // 16, r % 16
    f, g = (q % 8) // 4, q % 4
    return ((r // 32) * (cols // 8) + (q // 8)) * 256 + ((g * 16 + c) * 2 + f) * 2 + b


def rand_u8(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def make_stack(E: int, H: int, I: int, row_order: str, bias: bool, seed: int = 0) -> CanonicalExperts:
    """Random canonical stack; scales avoid 0 and 0x7F so misplaced fill bytes cannot hide."""
    scale13 = rand_u8(E, 2 * I, H // 32, seed=seed + 1) % 100 + 1
    scale2 = rand_u8(E, H, I // 32, seed=seed + 3) % 100 + 1
    g = torch.Generator().manual_seed(seed + 5)
    return CanonicalExperts(
        w13=rand_u8(E, 2 * I, H // 2, seed=seed),
        w13_scale=scale13,
        w2=rand_u8(E, H, I // 2, seed=seed + 2),
        w2_scale=scale2,
        w13_bias=torch.randn(E, 2 * I, generator=g).to(torch.bfloat16) if bias else None,
        w2_bias=torch.randn(E, H, generator=g).to(torch.bfloat16) if bias else None,
        row_order=row_order,
    )


def sizes_for(c: CanonicalExperts, activation: str) -> LayoutSizes:
    return c.sizes(*LAYOUT.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation))


# ---------------------------------------------------------------------------------------------
# Independent expected kernel bytes (scalar loops over every padded position)
# ---------------------------------------------------------------------------------------------


def concat_row(padded_row: int, Ip: int, row_order: str) -> int:
    """Row of the padded w13 (in source row order) -> row in concat [gate; up] order (spec 4.2 step 1)."""
    if row_order == "halves":
        return padded_row
    return padded_row // 2 if padded_row % 2 == 0 else Ip + padded_row // 2


def source_row(padded_row: int, I: int, Ip: int, row_order: str) -> int | None:
    """Row of the padded w13 -> unpadded canonical row, or None for a padding row (spec 4.1)."""
    if row_order == "interleaved":
        return padded_row if padded_row < 2 * I else None
    if padded_row < Ip:
        return padded_row if padded_row < I else None
    return I + padded_row - Ip if padded_row - Ip < I else None


def expected_kernel(c: CanonicalExperts, activation: str) -> dict[str, torch.Tensor]:
    """Kernel tensors computed byte by byte from the spec (sections 2, 4.1, 4.2-4.4)."""
    E, H, I, ro = c.num_experts, c.hidden_size, c.intermediate_size, c.row_order
    Hp, Ip = LAYOUT.padded_sizes(H, I, ro, activation)
    a16w4 = activation == "bf16"
    gu = gu16_dest_of(2 * Ip)
    out: dict[str, torch.Tensor] = {}

    def value(data: list, e: int, sr: int | None, q: int, k: int, real_cols: int, is_scale: bool) -> int:
        """Byte at column q of source row sr (None: a padding row) of a tensor with K = k."""
        if q >= (k // 32 if is_scale else k // 2):
            return SCALE_PAD_FILL  # AITER's K padding of scales
        if sr is None or q >= real_cols:
            return 0  # vLLM's zero padding
        return data[e][sr][q]

    def offset(e: int, rows: int, cols: int, r: int, q: int, is_scale: bool) -> int:
        """Flat destination of (expert e, shuffled row r, column q)."""
        if not is_scale:
            return e * rows * cols + w16_offset(r, q, cols)
        if a16w4:
            return e * rows * cols + s32x8_offset(r, q, cols)
        return s32x8_offset(e * rows + r, q, cols)

    def build13(src: torch.Tensor, cols: int, real_cols: int, is_scale: bool) -> list[int]:
        rows = 2 * Ip
        data = src.tolist()
        flat = [0] * (E * rows * cols)
        for e in range(E):
            for pr in range(rows):
                sr = source_row(pr, I, Ip, ro)
                r = gu[concat_row(pr, Ip, ro)] if a16w4 else pr
                for q in range(cols):
                    flat[offset(e, rows, cols, r, q, is_scale)] = value(data, e, sr, q, Hp, real_cols, is_scale)
        return flat

    def build2(src: torch.Tensor, cols: int, real_cols: int, is_scale: bool) -> list[int]:
        data = src.tolist()
        flat = [0] * (E * Hp * cols)
        for e in range(E):
            for r in range(Hp):
                for q in range(cols):
                    flat[offset(e, Hp, cols, r, q, is_scale)] = value(data, e, r if r < H else None, q, Ip, real_cols, is_scale)
        return flat

    c13, c2 = round_up(Hp // 32, 8), round_up(Ip // 32, 8)
    u8 = torch.uint8
    out["w13_weight"] = torch.tensor(build13(c.w13, Hp // 2, H // 2, False), dtype=u8).view(E, 2 * Ip, Hp // 2)
    s13 = torch.tensor(build13(c.w13_scale, c13, H // 32, True), dtype=u8)
    out["w13_weight_scale"] = s13.view(E * 2 * Ip, c13) if a16w4 else s13.view(E, 2 * Ip, c13)
    out["w2_weight"] = torch.tensor(build2(c.w2, Ip // 2, I // 2, False), dtype=u8).view(E, Hp, Ip // 2)
    s2 = torch.tensor(build2(c.w2_scale, c2, I // 32, True), dtype=u8)
    out["w2_weight_scale"] = s2.view(E * Hp, c2) if a16w4 else s2.view(E, Hp, c2)
    if c.w13_bias is not None:
        b = c.w13_bias.float().tolist()
        b13 = [[0.0] * (2 * Ip) for _ in range(E)]
        for e in range(E):
            for pr in range(2 * Ip):
                sr = source_row(pr, I, Ip, ro)
                if sr is not None:
                    # a16w4: [gate; up] (not GU16-blocked); a4w4: source row order kept.
                    b13[e][concat_row(pr, Ip, ro) if a16w4 else pr] = b[e][sr]
        out["w13_bias"] = torch.tensor(b13, dtype=torch.float32)
        b2 = torch.zeros(E, Hp, dtype=torch.float32)
        b2[:, :H] = c.w2_bias.float()
        out["w2_bias"] = b2
    return out


# ---------------------------------------------------------------------------------------------
# Section 5 worked example (a16w4, one expert, I = 32, H = 128), bytes traced with id tensors
# ---------------------------------------------------------------------------------------------

I_EX, H_EX = 32, 128
B_EX = H_EX // 2  # 64 bytes per w13 row

# dest byte offset range -> (concat row, first byte); spec section 5, first table.
WEIGHT_TABLE = [
    (range(0, 16), 0, 0),
    (range(16, 32), 1, 0),
    (range(240, 256), 15, 0),
    (range(256, 272), 0, 16),
    (range(768, 784), 0, 48),
    (range(1024, 1040), 32, 0),
    (range(2048, 2064), 16, 0),
    (range(4095, 4096), 63, 63),
]
# gpt-oss row of each table line (third column of the spec table).
WEIGHT_TABLE_GPTOSS_ROWS = [0, 2, 30, 0, 0, 1, 32, 63]

# dest -> source (concat row, col); spec section 5, second table. Cols 4..7 are 0x7F padding.
SCALE_TABLE = {
    0: (0, 0), 1: (32, 0), 2: (0, 4), 3: (32, 4), 4: (1, 0), 5: (33, 0),
    64: (0, 1), 65: (32, 1), 128: (0, 2), 256: (16, 0), 257: (48, 0),
}


def example_stack(row_order: str, ids: bool) -> CanonicalExperts:
    """One-expert stack of the worked example. ids=True: every byte holds its (row, col) id."""
    rows = 2 * I_EX
    if ids:
        w13 = torch.arange(rows * B_EX, dtype=torch.int64).view(1, rows, B_EX)
        s13 = 1000 + torch.arange(rows * 4, dtype=torch.int64).view(1, rows, 4)
        w2 = torch.zeros(1, H_EX, I_EX // 2, dtype=torch.int64)
        s2 = torch.zeros(1, H_EX, 1, dtype=torch.int64)
    else:
        w13, s13 = rand_u8(1, rows, B_EX, seed=11), rand_u8(1, rows, 4, seed=12) % 100 + 1
        w2, s2 = rand_u8(1, H_EX, I_EX // 2, seed=13), rand_u8(1, H_EX, 1, seed=14)
    return CanonicalExperts(w13, s13, w2, s2, None, None, row_order)


def gptoss_row_of_concat(cr: int) -> int:
    return 2 * cr if cr < I_EX else 2 * (cr - I_EX) + 1


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
def test_worked_example_weight_offsets(row_order: str) -> None:
    out = permute_padded(example_stack(row_order, ids=True), "bf16")["w13_weight"].reshape(-1)
    for (offsets, cr, byte0), gpt_row in zip(WEIGHT_TABLE, WEIGHT_TABLE_GPTOSS_ROWS):
        src_row = cr if row_order == "halves" else gptoss_row_of_concat(cr)
        if row_order == "interleaved":
            assert src_row == gpt_row
        for i, off in enumerate(offsets):
            assert int(out[off]) == src_row * B_EX + byte0 + i, (row_order, off)


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
def test_worked_example_weight_bytes(row_order: str) -> None:
    c = example_stack(row_order, ids=False)
    out = permute_padded(c, "bf16")["w13_weight"].reshape(-1)
    assert out.dtype == torch.uint8
    for offsets, cr, byte0 in WEIGHT_TABLE:
        src_row = cr if row_order == "halves" else gptoss_row_of_concat(cr)
        want = c.w13[0, src_row, byte0 : byte0 + len(offsets)]
        assert torch.equal(out[offsets.start : offsets.stop], want)


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
def test_worked_example_scale_offsets(row_order: str) -> None:
    out = permute_padded(example_stack(row_order, ids=True), "bf16")["w13_weight_scale"]
    assert tuple(out.shape) == (64, 8)  # 2-D [E*2I, round_up(4, 8)]
    flat = out.reshape(-1)
    for dest, (cr, col) in SCALE_TABLE.items():
        src_row = cr if row_order == "halves" else gptoss_row_of_concat(cr)
        want = SCALE_PAD_FILL if col >= 4 else 1000 + src_row * 4 + col
        assert int(flat[dest]) == want, (row_order, dest)


def test_worked_example_scale_bytes() -> None:
    c = example_stack("interleaved", ids=False)
    flat = permute_padded(c, "bf16")["w13_weight_scale"].reshape(-1)
    for dest, (cr, col) in SCALE_TABLE.items():
        want = SCALE_PAD_FILL if col >= 4 else int(c.w13_scale[0, gptoss_row_of_concat(cr), col])
        assert int(flat[dest]) == want


# ---------------------------------------------------------------------------------------------
# Primitives against the scalar formulas; index helpers; inverses
# ---------------------------------------------------------------------------------------------


def _assert_offsets(out: torch.Tensor, x: torch.Tensor, offset: Callable[[int, int, int], int], col_step: int = 1) -> None:
    """Element (e, r, c) of ``x`` [E, R, C] (every ``col_step``-th column) sits at
    ``out[e, offset(r, c, C)]`` of the flattened result ``out`` [E, R*C]."""
    E, R, C = x.shape
    for e in range(E):
        for r in range(R):
            for c in range(0, C, col_step):
                assert int(out[e, offset(r, c, C)]) == int(x[e, r, c])


def test_w16_matches_formula() -> None:
    N, B = 48, 80
    x = torch.arange(2 * N * B, dtype=torch.int64).view(2, N, B)
    out = w16(x).reshape(2, -1)
    _assert_offsets(out, x, w16_offset, col_step=3)
    dest = w16_dest_offsets(N, B)
    assert [int(dest[r, c]) for r, c in [(0, 0), (17, 33), (47, 79)]] == [
        w16_offset(r, c, B) for r, c in [(0, 0), (17, 33), (47, 79)]
    ]
    assert torch.equal(out[0][dest.reshape(-1)], x[0].reshape(-1))
    assert torch.equal(w16_inverse(w16(x)), x)


def test_gu16_matches_formula() -> None:
    N = 96
    x = torch.arange(2 * N * 3, dtype=torch.int64).view(2, N, 3)
    out = gu16(x)
    for d in range(N):
        assert torch.equal(out[:, d], x[:, gu16_source(d, N)])
    assert gu16_source_rows(N).tolist() == [gu16_source(d, N) for d in range(N)]
    assert gu16(torch.arange(64).view(1, 64))[0, :34].tolist() == [*range(16), *range(32, 48), 16, 17]
    assert torch.equal(gu16_inverse(out), x)


def test_s32x8_matches_formula() -> None:
    R, C = 64, 24
    x = torch.arange(3 * R * C, dtype=torch.int64).view(3, R, C)
    out = s32x8(x).reshape(3, -1)
    _assert_offsets(out, x, s32x8_offset)
    dest = s32x8_dest_offsets(R, C)
    assert torch.equal(out[1][dest.reshape(-1)], x[1].reshape(-1))
    assert torch.equal(s32x8_inverse(s32x8(x)), x)


def test_s32x8_in_tile_loop_order() -> None:
    """Spec 2.3 'equivalently': in-tile order is for g, for c, for f, for b (b innermost)."""
    x = torch.arange(32 * 8).view(32, 8)
    want = [x[16 * b + c, 4 * f + g].item() for g in range(4) for c in range(16) for f in range(2) for b in range(2)]
    assert s32x8(x).reshape(-1).tolist() == want


def test_deinterleave_rows() -> None:
    x = torch.arange(2 * 8 * 2).view(2, 8, 2)
    out = deinterleave_rows(x)
    assert out[0, :, 0].tolist() == [0, 4, 8, 12, 2, 6, 10, 14]
    assert deinterleave_source_rows(8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(interleave_rows(out), x)
    bias = torch.arange(12.0).view(2, 6)
    assert deinterleave_rows(bias)[1].tolist() == [6.0, 8.0, 10.0, 7.0, 9.0, 11.0]


def test_shuffle_scale_a16w4_pads_with_7f() -> None:
    s = torch.full((2, 32, 3), 5, dtype=torch.uint8)
    out = shuffle_scale_a16w4(s, gate_up=False)
    assert tuple(out.shape) == (64, 8)
    assert int((out == SCALE_PAD_FILL).sum()) == 2 * 32 * 5 and int((out == 5).sum()) == 2 * 32 * 3


def test_e8m0_shuffle_pads_rows_and_cols() -> None:
    s = rand_u8(40, 5, seed=3)
    out = e8m0_shuffle(s)
    assert tuple(out.shape) == (256, 8)
    back = e8m0_unshuffle(out)
    assert torch.equal(back[:40, :5], s)
    assert bool((back[40:] == SCALE_PAD_FILL).all()) and bool((back[:, 5:] == SCALE_PAD_FILL).all())


def test_e8m0_shuffle_equals_per_expert_s32x8_when_aligned() -> None:
    """Spec section 3 note: with N % 32 == 0, tiles never straddle experts."""
    s = rand_u8(4, 64, 16, seed=4)
    assert torch.equal(shuffle_scale_a4w4(s), s32x8(s))
    assert torch.equal(shuffle_scale_a4w4(s).reshape(-1), shuffle_scale_a16w4(s, gate_up=False).reshape(-1))


def test_a4w4_refuses_rows_not_multiple_of_256() -> None:
    with pytest.raises(LayoutError, match=r"E\*N % 256"):
        shuffle_scale_a4w4(rand_u8(3, 32, 8, seed=1))
    sizes = LayoutSizes(1, 320, 128, 320, 128, "halves", False)
    with pytest.raises(LayoutError, match=r"E\*N % 256.*E=1, N=320"):
        LAYOUT.kernel_specs(sizes, "mxfp4", None)


def test_primitive_shape_errors() -> None:
    with pytest.raises(LayoutError, match="W16"):
        w16(torch.zeros(1, 24, 32, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="GU16"):
        gu16(torch.zeros(1, 48, 32, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="S32x8"):
        s32x8(torch.zeros(1, 32, 12, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------
# Whole layout: byte-exact to_kernel, round trips, shapes
# ---------------------------------------------------------------------------------------------

CASES = [
    # (activation, row order, bias, E, H, I)
    ("bf16", "interleaved", True, 2, 96, 96),  # pads 96 -> 256 on both axes
    ("bf16", "halves", False, 2, 96, 160),  # 128/128 align: Hp = 128 (scale cols 4 -> 8), Ip = 256
    ("mxfp4", "interleaved", True, 2, 96, 96),  # Hp = 256, Ip = 128 (w2 scale cols 4 -> 8)
    ("mxfp4", "halves", False, 2, 320, 160),  # Hp = 512, Ip = 256
]


@pytest.mark.parametrize("activation,row_order,bias,E,H,I", CASES)
def test_to_kernel_bytes_match_spec(activation: str, row_order: str, bias: bool, E: int, H: int, I: int) -> None:
    c = make_stack(E, H, I, row_order, bias, seed=E + H + I)
    got = LAYOUT.to_kernel(c, activation, None)
    want = expected_kernel(c, activation)
    order = ("w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias")
    assert list(got) == [n for n in order if n in want]
    specs = LAYOUT.kernel_specs(sizes_for(c, activation), activation, None)
    for name, tensor in got.items():
        assert tensor.is_contiguous(), name
        assert tensor.device == c.device
        assert (tuple(tensor.shape), tensor.dtype) == (specs[name].shape, specs[name].dtype), name
        assert torch.equal(tensor, want[name]), name


ROUND_TRIPS = [
    ("bf16", "interleaved", True, 3, 320, 160),
    ("bf16", "interleaved", True, 2, 256, 256),  # aligned: no padding at all
    ("bf16", "halves", False, 3, 320, 160),
    ("bf16", "halves", False, 2, 128, 128),  # aligned (scale columns still padded 4 -> 8)
    ("mxfp4", "interleaved", True, 3, 320, 160),
    ("mxfp4", "halves", False, 3, 320, 160),
    ("mxfp4", "halves", True, 1, 256, 128),  # aligned
]


@pytest.mark.parametrize("activation,row_order,bias,E,H,I", ROUND_TRIPS)
def test_round_trip(activation: str, row_order: str, bias: bool, E: int, H: int, I: int) -> None:
    c = make_stack(E, H, I, row_order, bias, seed=7)
    sizes = sizes_for(c, activation)
    back = LAYOUT.from_kernel(LAYOUT.to_kernel(c, activation, None), sizes, activation, None)
    assert back.row_order == row_order
    for f in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, f), getattr(c, f)), f
    if bias:
        assert back.w13_bias.dtype == torch.float32
        assert torch.equal(back.w13_bias.to(torch.bfloat16), c.w13_bias)
        assert torch.equal(back.w2_bias.to(torch.bfloat16), c.w2_bias)
    else:
        assert back.w13_bias is None and back.w2_bias is None


def test_round_trip_medium_gptoss_like() -> None:
    """Medium case: 8 experts, H = 704, I = 448 (interleaved, biases) -> Hp = 768, Ip = 512."""
    c = make_stack(8, 704, 448, "interleaved", True, seed=21)
    for activation in LAYOUT.activations:
        sizes = sizes_for(c, activation)
        k = LAYOUT.to_kernel(c, activation, None)
        back = LAYOUT.from_kernel(k, sizes, activation, None)
        assert torch.equal(back.w13, c.w13) and torch.equal(back.w2_scale, c.w2_scale)
        assert torch.equal(back.w13_bias.to(torch.bfloat16), c.w13_bias)


def test_to_kernel_is_device_agnostic() -> None:
    """No tensor is created on a fixed device: the whole forward path runs on 'meta'."""
    c = make_stack(2, 96, 96, "interleaved", True).to("meta")
    for activation in LAYOUT.activations:
        out = LAYOUT.to_kernel(c, activation, None)
        assert all(t.device.type == "meta" for t in out.values())


def test_to_kernel_needs_both_biases_or_none() -> None:
    c = dataclasses.replace(make_stack(1, 128, 128, "halves", True), w2_bias=None)
    with pytest.raises(LayoutError, match="both be present or both absent"):
        LAYOUT.to_kernel(c, "bf16", None)


def test_registry_returns_this_layout() -> None:
    assert get_layout("aiter") is LAYOUT
    assert (LAYOUT.name, LAYOUT.version, LAYOUT.activations) == ("aiter", 1, ("bf16", "mxfp4"))


# ---------------------------------------------------------------------------------------------
# Padded sizes and shapes (gpt-oss-20b / 120b, spec 4.1)
# ---------------------------------------------------------------------------------------------


def test_padded_sizes_table() -> None:
    assert LAYOUT.padded_sizes(2880, 2880, "interleaved", "bf16") == (3072, 3072)
    # 120b TP4: per-rank I = ceil(90 / 4) * 32 = 736 (spec 4.1 writes "720 -> 768").
    assert LAYOUT.padded_sizes(2880, 736, "interleaved", "bf16") == (3072, 768)
    assert LAYOUT.padded_sizes(2880, 2880, "halves", "bf16") == (2944, 2944)
    assert LAYOUT.padded_sizes(2880, 2880, "interleaved", "mxfp4") == (3072, 2944)
    assert LAYOUT.padded_sizes(2880, 2880, "halves", "mxfp4") == (3072, 2944)
    assert LAYOUT.padded_sizes(256, 128, "halves", "mxfp4") == (256, 128)


def gptoss20b_sizes(row_order: str, activation: str) -> LayoutSizes:
    Hp, Ip = LAYOUT.padded_sizes(2880, 2880, row_order, activation)
    return LayoutSizes(32, 2880, 2880, Hp, Ip, row_order, True)


def spec_shapes(specs: dict) -> dict[str, tuple]:
    return {n: (s.shape, s.dtype) for n, s in specs.items()}


def test_gptoss_20b_shapes_a16w4_interleaved() -> None:
    u8, f32 = torch.uint8, torch.float32
    got = spec_shapes(LAYOUT.kernel_specs(gptoss20b_sizes("interleaved", "bf16"), "bf16", None))
    assert got == {
        "w13_weight": ((32, 6144, 1536), u8),
        "w13_weight_scale": ((32 * 6144, 96), u8),
        "w13_bias": ((32, 6144), f32),
        "w2_weight": ((32, 3072, 1536), u8),
        "w2_weight_scale": ((32 * 3072, 96), u8),
        "w2_bias": ((32, 3072), f32),
    }
    specs = LAYOUT.kernel_specs(gptoss20b_sizes("interleaved", "bf16"), "bf16", None)
    assert specs["w13_weight"].nbytes == 32 * 6144 * 1536


def test_gptoss_120b_shapes_a16w4() -> None:
    """Spec 4.1 example: 120b TP1, w13 [128, 6144, 1536], scale 3-D [128, 6144, 96] stored 2-D."""
    sizes = LayoutSizes(128, 2880, 2880, 3072, 3072, "interleaved", True)
    got = spec_shapes(LAYOUT.kernel_specs(sizes, "bf16", None))
    assert got["w13_weight"][0] == (128, 6144, 1536)
    assert got["w13_weight_scale"][0] == (128 * 6144, 96)
    assert got["w2_weight"][0] == (128, 3072, 1536) and got["w2_weight_scale"][0] == (128 * 3072, 96)


def test_gptoss_20b_shapes_a16w4_halves() -> None:
    got = spec_shapes(LAYOUT.kernel_specs(gptoss20b_sizes("halves", "bf16"), "bf16", None))
    assert got["w13_weight"][0] == (32, 5888, 1472)
    assert got["w13_weight_scale"][0] == (32 * 5888, 96)  # 92 scale columns -> 96
    assert got["w2_weight"][0] == (32, 2944, 1472)
    assert got["w2_weight_scale"][0] == (32 * 2944, 96)


@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
def test_gptoss_20b_shapes_a4w4(row_order: str) -> None:
    got = spec_shapes(LAYOUT.kernel_specs(gptoss20b_sizes(row_order, "mxfp4"), "mxfp4", None))
    assert got == {
        "w13_weight": ((32, 5888, 1536), torch.uint8),
        "w13_weight_scale": ((32, 5888, 96), torch.uint8),
        "w13_bias": ((32, 5888), torch.float32),
        "w2_weight": ((32, 3072, 1472), torch.uint8),
        "w2_weight_scale": ((32, 3072, 96), torch.uint8),  # spec 4.4: K/32 = 92 -> 96
        "w2_bias": ((32, 3072), torch.float32),
    }


def test_kernel_specs_without_bias() -> None:
    sizes = LayoutSizes(2, 128, 128, 128, 128, "halves", False)
    assert set(LAYOUT.kernel_specs(sizes, "bf16", None)) == {
        "w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"
    }


def test_kernel_specs_rejects_unshufflable_padding() -> None:
    sizes = LayoutSizes(2, 2880, 2880, 2880, 2880, "halves", False)  # 2880 % 128 != 0
    with pytest.raises(LayoutError, match=r"a16w4 needs the padded hidden size % 128 == 0"):
        LAYOUT.kernel_specs(sizes, "bf16", None)


def test_describe() -> None:
    d = LAYOUT.describe(gptoss20b_sizes("interleaved", "bf16"), "bf16", None)
    assert d["name"] == "aiter" and d["version"] == 1 and d["activation"] == "bf16"
    assert d["engine_compat"]["vllm"] == ">=0.33"
    assert d["engine_compat"]["aiter"] == ">=c4be416761"  # 96 scale columns: no K padding needed
    assert d["is_shuffled"] is True
    assert d["vllm_backend"] == "AITER_MXFP4_BF16" and d["kernel"] == "a16w4"
    assert d["torch_dtype"]["w13_weight"] == "float4_e2m1fn_x2"
    assert d["torch_dtype"]["w13_bias"] == "float32"
    assert d["padding"] == {"hidden_align": 256, "intermediate_align": 256, "fill": 0}
    small = LayoutSizes(2, 128, 128, 128, 128, "halves", False)  # 4 scale columns -> 8
    assert LAYOUT.describe(small, "bf16", None)["engine_compat"]["aiter"] == ">=c2b69b9b87"
    d4 = LAYOUT.describe(gptoss20b_sizes("interleaved", "mxfp4"), "mxfp4", None)
    assert d4["vllm_backend"] == "AITER_MXFP4_MXFP4" and d4["scale_shuffle"] == "e8m0_shuffle"
    assert d4["w13_kernel_row_order"] == "interleaved"
    assert d4["scale_pad_defined_upstream"] is False  # 92 -> 96 columns come from torch.empty
    assert d4["padding"]["intermediate_align"] == 128


# ---------------------------------------------------------------------------------------------
# from_kernel: validation and padding checks
# ---------------------------------------------------------------------------------------------


def kernel_of(activation: str, row_order: str, bias: bool, E: int = 2, H: int = 96, I: int = 96):
    c = make_stack(E, H, I, row_order, bias, seed=3)
    return c, LAYOUT.to_kernel(c, activation, None), sizes_for(c, activation)


def test_from_kernel_rejects_bad_shape_dtype_and_missing() -> None:
    c, k, sizes = kernel_of("bf16", "interleaved", True)
    bad = dict(k, w13_weight_scale=k["w13_weight_scale"].view(2, 512, -1))
    with pytest.raises(LayoutError, match=r"w13_weight_scale has shape \(2, 512, 8\), expected \(1024, 8\)"):
        LAYOUT.from_kernel(bad, sizes, "bf16", None)
    bad = dict(k, w2_bias=k["w2_bias"].to(torch.bfloat16))
    with pytest.raises(LayoutError, match=r"w2_bias has dtype torch.bfloat16, expected torch.float32"):
        LAYOUT.from_kernel(bad, sizes, "bf16", None)
    bad = {n: t for n, t in k.items() if n != "w2_weight"}
    with pytest.raises(LayoutError, match="w2_weight is missing"):
        LAYOUT.from_kernel(bad, sizes, "bf16", None)
    no_bias = dataclasses.replace(sizes, has_bias=False)
    with pytest.raises(LayoutError, match="unexpected kernel tensor"):
        LAYOUT.from_kernel(k, no_bias, "bf16", None)


def test_from_kernel_accepts_vllm_dtype_views() -> None:
    c, k, sizes = kernel_of("mxfp4", "halves", False)
    views = dict(k)
    for n in ("w13_weight", "w2_weight"):
        views[n] = k[n].view(torch.float4_e2m1fn_x2)
    for n in ("w13_weight_scale", "w2_weight_scale"):
        views[n] = k[n].view(torch.float8_e8m0fnu)
    back = LAYOUT.from_kernel(views, sizes, "mxfp4", None)
    assert torch.equal(back.w13, c.w13) and torch.equal(back.w2_scale, c.w2_scale)


def poke(t: torch.Tensor, flat_offset: int, value: int | float) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[flat_offset] = value
    return out


def test_scale_column_padding_checked_a16w4() -> None:
    # halves, H = 96 -> Hp = 128: w13 scales have 4 real columns, padded to 8 with 0x7F.
    c, k, sizes = kernel_of("bf16", "halves", False)
    Ip = sizes.padded_intermediate_size
    # Expert 1, concat row 40 (up row 8), scale column 6 (AITER padding).
    d = gu16_dest_of(2 * Ip)[40]
    off = 1 * (2 * Ip * 8) + s32x8_offset(d, 6, 8)
    bad = dict(k, w13_weight_scale=poke(k["w13_weight_scale"], off, 0))
    where = re.escape(str([off // 8, off % 8]))
    msg = rf"w13_weight_scale at stored index {where} \(expert 1, row 40, scale column 6\) holds 0, expected 127"
    with pytest.raises(LayoutError, match=msg):
        LAYOUT.from_kernel(bad, sizes, "bf16", None)


def test_scale_column_padding_checked_a16w4_interleaved_rows() -> None:
    """The reported row is in the source (interleaved) order; the stored index is where we poked."""
    c = make_stack(1, 96, 64, "interleaved", False)
    sizes = LayoutSizes(1, 96, 64, 128, 128, "interleaved", False)  # explicit 128 padding: 4 -> 8 cols
    k = permute_padded(pad_canonical(c, 128, 128), "bf16")
    Ip = 128
    # interleaved row 5 = up 2 -> concat row Ip + 2
    d = gu16_dest_of(2 * Ip)[Ip + 2]
    off = s32x8_offset(d, 5, 8)
    bad = dict(k, w13_weight_scale=poke(k["w13_weight_scale"], off, 3))
    msg = rf"stored index \[{off // 8}, {off % 8}\] \(expert 0, row 5, scale column 5\)"
    with pytest.raises(LayoutError, match=msg):
        LAYOUT.from_kernel(bad, sizes, "bf16", None)
    assert torch.equal(LAYOUT.from_kernel(k, sizes, "bf16", None).w13, c.w13)


def test_scale_column_padding_checked_a4w4_and_option() -> None:
    # mxfp4, I = 96 -> Ip = 128: w2 scales have 4 columns padded to 8 (undefined upstream, 0x7F here).
    c, k, sizes = kernel_of("mxfp4", "interleaved", True)
    Hp = sizes.padded_hidden_size
    off = s32x8_offset(1 * Hp + 3, 7, 8)  # expert 1, row 3, column 7 of the 2-D [E*Hp, 8] matrix
    bad = dict(k, w2_weight_scale=poke(k["w2_weight_scale"], off, 0xAB))
    e, rem = divmod(off, Hp * 8)
    msg = rf"w2_weight_scale at stored index \[{e}, {rem // 8}, {rem % 8}\] \(expert 1, row 3, scale column 7\) holds 171"
    with pytest.raises(LayoutError, match=msg):
        LAYOUT.from_kernel(bad, sizes, "mxfp4", None)
    back = LAYOUT.from_kernel(bad, sizes, "mxfp4", LAYOUT.resolve_options({"check_undefined_scale_padding": False}))
    assert torch.equal(back.w2_scale, c.w2_scale)


def test_vllm_zero_padding_checked() -> None:
    c, k, sizes = kernel_of("bf16", "interleaved", True)  # H = I = 96 -> 256
    Hp, Ip = sizes.padded_hidden_size, sizes.padded_intermediate_size
    # w2 row 200 (>= H) is padding: W16 offset of (200, 0) in expert 0.
    bad = dict(k, w2_weight=poke(k["w2_weight"], w16_offset(200, 0, Ip // 2), 1))
    with pytest.raises(LayoutError, match=r"w2_weight at index \[0, 200, 0\]"):
        LAYOUT.from_kernel(bad, sizes, "bf16", None)
    # w13 K padding: concat row 0, byte 60 (>= H/2 = 48).
    off = w16_offset(gu16_dest_of(2 * Ip)[0], 60, Hp // 2)
    bad = dict(k, w13_weight=poke(k["w13_weight"], off, 9))
    with pytest.raises(LayoutError, match=r"w13_weight at index \[0, 0, 60\]"):
        LAYOUT.from_kernel(bad, sizes, "bf16", None)
    # w13 scale of a padded gate row (concat row 100 >= I), real column 0: vLLM fill is 0.
    off = s32x8_offset(gu16_dest_of(2 * Ip)[100], 0, 8)
    bad = dict(k, w13_weight_scale=poke(k["w13_weight_scale"], off, 1))
    with pytest.raises(LayoutError, match=r"w13_weight_scale at index \[0, 200, 0\]"):
        LAYOUT.from_kernel(bad, sizes, "bf16", None)
    # w13 bias: concat row Ip + 100 is up row 100 (padding) -> interleaved row 201.
    bad = dict(k, w13_bias=poke(k["w13_bias"], Ip + 100, 0.5))
    with pytest.raises(LayoutError, match=r"w13_bias at index \[0, 201\]"):
        LAYOUT.from_kernel(bad, sizes, "bf16", None)
    # a real byte changes nothing structurally: round trip still reports it faithfully.
    real = dict(k, w2_weight=poke(k["w2_weight"], w16_offset(5, 3, Ip // 2), 0))
    assert int(LAYOUT.from_kernel(real, sizes, "bf16", None).w2[0, 5, 3]) == 0


def test_a4w4_halves_padding_rows_checked() -> None:
    c, k, sizes = kernel_of("mxfp4", "halves", False, E=2, H=96, I=96)  # Ip = 128: gate rows 96..127 pad
    B = sizes.padded_hidden_size // 2
    bad = dict(k, w13_weight=poke(k["w13_weight"], w16_offset(110, 2, B), 4))
    with pytest.raises(LayoutError, match=r"w13_weight at index \[0, 110, 2\]"):
        LAYOUT.from_kernel(bad, sizes, "mxfp4", None)
