"""TRT-LLM-gen (FlashInfer) MXFP4 layout: spec worked examples, scalar formulas, round trips,
padding checks, error messages and (when flashinfer imports on CPU) FlashInfer's own row helpers.

Spec: docs/layout-trtllm.md. The scalar helpers below re-derive every index from the spec's
formulas in plain Python, independently of the vectorised module.
"""

from __future__ import annotations

import random

import pytest
import torch

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.layouts import get_layout
from mxconv.layouts.trtllm import LAYOUT, TrtllmOptions
from mxconv.layouts.vllm_backends import admits_vllm
from mxconv.layouts.trtllm_bytemap import (
    gate_up_pair_dst, gate_up_pair_src, mma_shuffle_dst, mma_shuffle_src, swizzle_128x4, swizzle_offsets,
    swizzle_slot_coords, unswizzle_128x4, w13_row_dst, w13_row_src, w2_row_dst, w2_row_src,
)


# ---------------------------------------------------------------------------------------------
# Scalar formulas straight from the spec
# ---------------------------------------------------------------------------------------------


def s_scalar(j: int) -> int:
    """§4: s(j) = 32*floor(j/32) + 4*(j mod 8) + floor((j mod 32)/8)."""
    return 32 * (j // 32) + 4 * (j % 8) + (j % 32) // 8


def d_scalar(r: int) -> int:
    """§4: d(r) = 32*floor(r/32) + 8*(r mod 4) + floor((r mod 32)/4)."""
    return 32 * (r // 32) + 8 * (r % 4) + (r % 32) // 4


def p_scalar(k: int, Ip: int, row_order: str) -> int:
    """§3: P(k)."""
    if row_order == "interleaved":
        return k ^ 1
    return Ip + k // 2 if k % 2 == 0 else (k - 1) // 2


def p_inv_scalar(n: int, Ip: int, row_order: str) -> int:
    """§6: P^-1(n)."""
    if row_order == "interleaved":
        return n ^ 1
    return 2 * n + 1 if n < Ip else 2 * (n - Ip)


def off_scalar(r: int, c: int, Cp: int) -> int:
    """§6: swizzled slot of scale element (r, c)."""
    return (r // 128 * (Cp // 4) + c // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4


def slot_scalar(p: int, Cp: int) -> tuple[int, int]:
    """§10: (r, c) held by slot p."""
    mt, q = p // (128 * Cp), p % (128 * Cp)
    kt = q // 512
    return 128 * mt + 32 * ((q % 16) // 4) + (q % 512) // 16, 4 * kt + q % 4


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ---------------------------------------------------------------------------------------------
# Fixtures: random canonical stacks and an independent re-enactment of vLLM's zero-init padding
# ---------------------------------------------------------------------------------------------


def make_stack(E: int, H: int, I: int, row_order: str, bias: bool, seed: int = 0) -> CanonicalExperts:
    g = torch.Generator().manual_seed(seed)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    return CanonicalExperts(
        w13=u8(E, 2 * I, H // 2),
        w13_scale=u8(E, 2 * I, H // 32),
        w2=u8(E, H, I // 2),
        w2_scale=u8(E, H, I // 32),
        w13_bias=bf16(E, 2 * I) if bias else None,
        w2_bias=bf16(E, H) if bias else None,
        row_order=row_order,
    )


def vllm_padded(c: CanonicalExperts, Hp: int, Ip: int) -> dict[str, torch.Tensor]:
    """Zero-initialised padded params with the checkpoint copied in, as vLLM's loaders do (§2)."""
    E, H, I = c.num_experts, c.hidden_size, c.intermediate_size
    out = {
        "w13": torch.zeros(E, 2 * Ip, Hp // 2, dtype=torch.uint8),
        "w13_scale": torch.zeros(E, 2 * Ip, Hp // 32, dtype=torch.uint8),
        "w2": torch.zeros(E, Hp, Ip // 2, dtype=torch.uint8),
        "w2_scale": torch.zeros(E, Hp, Ip // 32, dtype=torch.uint8),
    }
    if c.w13_bias is not None:
        out["w13_bias"] = torch.zeros(E, 2 * Ip, dtype=torch.float32)
        out["w2_bias"] = torch.zeros(E, Hp, dtype=torch.float32)
    w13_parts = [("w13", c.w13, H // 2), ("w13_scale", c.w13_scale, H // 32)]
    for name, src, cols in w13_parts:
        if c.row_order == "halves":
            out[name][:, :I, :cols] = src[:, :I]
            out[name][:, Ip : Ip + I, :cols] = src[:, I:]
        else:
            out[name][:, : 2 * I, :cols] = src
    out["w2"][:, :H, : I // 2] = c.w2
    out["w2_scale"][:, :H, : I // 32] = c.w2_scale
    if c.w13_bias is not None:
        if c.row_order == "halves":
            out["w13_bias"][:, :I] = c.w13_bias[:, :I].float()
            out["w13_bias"][:, Ip : Ip + I] = c.w13_bias[:, I:].float()
        else:
            out["w13_bias"][:, : 2 * I] = c.w13_bias.float()
        out["w2_bias"][:, :H] = c.w2_bias.float()
    return out


def sizes_of(c: CanonicalExperts, Hp: int, Ip: int) -> LayoutSizes:
    return c.sizes(Hp, Ip)


def assert_same_canonical(a: CanonicalExperts, b: CanonicalExperts) -> None:
    assert a.row_order == b.row_order
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == torch.uint8, name
        assert torch.equal(x, y), name
    for name in ("w13_bias", "w2_bias"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert y.dtype == torch.float32, name
            assert torch.equal(x.float(), y), name


# ---------------------------------------------------------------------------------------------
# §5 worked example
# ---------------------------------------------------------------------------------------------

SPEC_MMA = [0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29, 2, 6, 10, 14, 18, 22, 26, 30,
            3, 7, 11, 15, 19, 23, 27, 31, 32, 36, 40, 44, 48, 52, 56, 60]  # fmt: skip
SPEC_HALVES = [128, 130, 132, 134, 136, 138, 140, 142, 0, 2, 4, 6, 8, 10, 12, 14, 129, 131, 133, 135,
               137, 139, 141, 143, 1, 3, 5, 7, 9, 11, 13, 15, 144, 146, 148, 150, 152, 154, 156, 158]  # fmt: skip
SPEC_INTERLEAVED = [1, 5, 9, 13, 17, 21, 25, 29, 0, 4, 8, 12, 16, 20, 24, 28, 3, 7, 11, 15, 19, 23, 27, 31,
                    2, 6, 10, 14, 18, 22, 26, 30, 33, 37, 41, 45, 49, 53, 57, 61]  # fmt: skip
SPEC_INVERSE = [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27, 4, 12, 20, 28, 5, 13, 21, 29,
                6, 14, 22, 30, 7, 15, 23, 31, 32, 40, 48, 56, 33, 41, 49, 57]  # fmt: skip
SPEC_SLOTS_0_40 = [
    (0, 0), (0, 1), (0, 2), (0, 3), (32, 0), (32, 1), (32, 2), (32, 3),
    (64, 0), (64, 1), (64, 2), (64, 3), (96, 0), (96, 1), (96, 2), (96, 3),
    (1, 0), (1, 1), (1, 2), (1, 3), (33, 0), (33, 1), (33, 2), (33, 3),
    (65, 0), (65, 1), (65, 2), (65, 3), (97, 0), (97, 1), (97, 2), (97, 3),
    (2, 0), (2, 1), (2, 2), (2, 3), (34, 0), (34, 1), (34, 2), (34, 3),
]  # fmt: skip
SPEC_SLOTS_512 = [(0, 4), (0, 5), (0, 6), (0, 7), (32, 4)]


def test_worked_example_row_indices() -> None:
    assert mma_shuffle_src(256)[:40].tolist() == SPEC_MMA
    assert w2_row_src(256)[:40].tolist() == SPEC_MMA
    assert w13_row_src(128, "halves")[:40].tolist() == SPEC_HALVES
    assert w13_row_src(128, "interleaved")[:40].tolist() == SPEC_INTERLEAVED
    assert mma_shuffle_dst(256)[:40].tolist() == SPEC_INVERSE
    assert w2_row_dst(256)[:40].tolist() == SPEC_INVERSE


def test_worked_example_swizzle_slots() -> None:
    R, C = 128, 8
    coded = torch.arange(R * C, dtype=torch.long).reshape(R, C)  # element (r, c) holds r*C + c
    buf = swizzle_128x4(coded)
    assert buf.shape == (R * C,)
    as_rc = [(int(v) // C, int(v) % C) for v in buf]
    assert as_rc[:40] == SPEC_SLOTS_0_40
    assert as_rc[512:517] == SPEC_SLOTS_512
    r, c = swizzle_slot_coords(R, C)
    assert list(zip(r[:40].tolist(), c[:40].tolist())) == SPEC_SLOTS_0_40
    assert list(zip(r[512:517].tolist(), c[512:517].tolist())) == SPEC_SLOTS_512


def test_kernel_scales_of_worked_example_stack() -> None:
    """w2 scales of a [1, 256, 8] stack (H=256, I=256): each slot holds the spec's (row, col)."""
    E, H, I = 1, 256, 256
    c = make_stack(E, H, I, "halves", bias=False)
    k = LAYOUT.to_kernel(c, "bf16", None)
    flat = k["w2_weight_scale"].view(torch.uint8).reshape(-1)
    for p in list(range(40)) + list(range(512, 517)):
        r, col = slot_scalar(p, 8)
        assert flat[p] == c.w2_scale[0, s_scalar(r), col]  # rows shuffled by s before the swizzle


# ---------------------------------------------------------------------------------------------
# Independent scalar checks of the index functions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [32, 96, 256, 3072])
def test_mma_shuffle_matches_scalar_formulas(rows: int) -> None:
    src, dst = mma_shuffle_src(rows), mma_shuffle_dst(rows)
    assert src.dtype == dst.dtype == torch.long
    assert src.tolist() == [s_scalar(j) for j in range(rows)]
    assert dst.tolist() == [d_scalar(r) for r in range(rows)]
    assert torch.equal(src[dst], torch.arange(rows))  # inverse
    assert torch.equal(dst[src], torch.arange(rows))


def test_mma_shuffle_rejects_bad_row_counts() -> None:
    with pytest.raises(LayoutError, match="multiple of 32"):
        mma_shuffle_src(48)
    with pytest.raises(LayoutError, match="multiple of 32"):
        mma_shuffle_dst(0)


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
@pytest.mark.parametrize("Ip", [128, 256, 384])
def test_w13_rows_match_scalar_formulas(row_order: str, Ip: int) -> None:
    n = 2 * Ip
    assert gate_up_pair_src(Ip, row_order).tolist() == [p_scalar(k, Ip, row_order) for k in range(n)]
    assert gate_up_pair_dst(Ip, row_order).tolist() == [p_inv_scalar(k, Ip, row_order) for k in range(n)]
    src, dst = w13_row_src(Ip, row_order), w13_row_dst(Ip, row_order)
    assert src.tolist() == [p_scalar(s_scalar(j), Ip, row_order) for j in range(n)]
    assert dst.tolist() == [d_scalar(p_inv_scalar(r, Ip, row_order)) for r in range(n)]
    assert torch.equal(src[dst], torch.arange(n))


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
def test_w13_kernel_row_meaning(row_order: str) -> None:
    """§4: kernel row 32b+16h+8t+c holds channel 16b+2c+h of up (t=0) or gate (t=1)."""
    Ip = 256
    src = w13_row_src(Ip, row_order).tolist()
    for b in range(2 * Ip // 32):
        for h in (0, 1):
            for t in (0, 1):
                for c in range(8):
                    ch = 16 * b + 2 * c + h
                    is_up = t == 0
                    if row_order == "halves":
                        want = Ip + ch if is_up else ch
                    else:
                        want = 2 * ch + 1 if is_up else 2 * ch
                    assert src[32 * b + 16 * h + 8 * t + c] == want


def test_gate_up_rejects_unknown_row_order() -> None:
    with pytest.raises(LayoutError, match="row order"):
        gate_up_pair_src(128, "gate_first")


@pytest.mark.parametrize("R,C", [(128, 8), (256, 12), (100, 6), (3, 1)])
def test_swizzle_matches_offset_formula(R: int, C: int) -> None:
    Rp, Cp = round_up(R, 128), round_up(C, 4)
    coded = torch.arange(R * C, dtype=torch.long).reshape(R, C) + 1  # 0 marks padding
    buf = swizzle_128x4(coded)
    assert buf.shape == (Rp * Cp,)
    offs = swizzle_offsets(R, C)
    for r in range(R):
        for c in range(C):
            assert offs[r, c] == off_scalar(r, c, Cp)
            assert buf[off_scalar(r, c, Cp)] == r * C + c + 1
    assert int((buf == 0).sum()) == Rp * Cp - R * C  # padding slots hold the zero pattern
    slot_r, slot_c = swizzle_slot_coords(R, C)
    for p in range(Rp * Cp):
        r, c = slot_scalar(p, Cp)
        assert (slot_r[p], slot_c[p]) == (r, c)
        if r < R and c < C:
            assert buf[p] == r * C + c + 1
    assert torch.equal(unswizzle_128x4(buf, R, C), coded)


def test_swizzle_is_per_expert_and_2d_equals_3d_when_rows_align() -> None:
    g = torch.Generator().manual_seed(1)
    s = torch.randint(0, 256, (3, 256, 8), generator=g, dtype=torch.uint8)
    per_expert = swizzle_128x4(s)
    assert per_expert.shape == (3, 256 * 8)
    for e in range(3):
        assert torch.equal(per_expert[e], swizzle_128x4(s[e]))
    assert torch.equal(per_expert.reshape(-1), swizzle_128x4(s.reshape(3 * 256, 8)))
    assert torch.equal(unswizzle_128x4(per_expert, 256, 8), s)


def test_unswizzle_rejects_wrong_buffer_size() -> None:
    with pytest.raises(LayoutError, match="1024"):
        unswizzle_128x4(torch.zeros(2, 1000, dtype=torch.uint8), 128, 8)


# ---------------------------------------------------------------------------------------------
# Sizes, specs, describe
# ---------------------------------------------------------------------------------------------


def test_registry_returns_this_layout() -> None:
    assert get_layout("trtllm") is LAYOUT
    assert LAYOUT.name == "trtllm" and LAYOUT.version == 1
    assert LAYOUT.activations == ("bf16", "mxfp8")


@pytest.mark.parametrize(
    "H,I,align,want",
    [
        (2880, 2880, 256, (3072, 3072)),
        (2880, 1440, 256, (3072, 1536)),
        (2880, 2880, 128, (3072, 2944)),
        (320, 160, 256, (512, 256)),
        (96, 96, 128, (256, 128)),
        (256, 256, 256, (256, 256)),
    ],
)
def test_padded_sizes(H: int, I: int, align: int, want: tuple[int, int]) -> None:
    for row_order in ("halves", "interleaved"):
        for act in ("bf16", "mxfp8"):
            assert LAYOUT.padded_sizes(H, I, row_order, act, TrtllmOptions(intermediate_align=align)) == want
    if align == 128:  # the default is vLLM 0.33's FLASHINFER_TRTLLM_MXFP4_* padding
        assert LAYOUT.padded_sizes(H, I, "halves", "bf16") == want
        assert LAYOUT.padded_sizes(H, I, "halves", "bf16", None) == want


def test_default_pads_gpt_oss_20b_intermediate_to_128_not_256() -> None:
    assert LAYOUT.padded_sizes(2880, 2880, "interleaved", "bf16") == (3072, 2944)
    assert LAYOUT.padded_sizes(2880, 2880, "interleaved", "bf16", LAYOUT.resolve_options({"intermediate_align": 256})) == (3072, 3072)
    assert LAYOUT.resolve_options().to_json() == {"intermediate_align": 128}


@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("options,Ip", [({}, 2944), ({"intermediate_align": 128}, 2944), ({"intermediate_align": 256}, 3072)])
def test_kernel_specs_gpt_oss_20b(has_bias: bool, options: dict, Ip: int) -> None:
    sizes = LayoutSizes(32, 2880, 2880, 3072, Ip, "interleaved", has_bias)
    options = LAYOUT.resolve_options(options)
    specs = LAYOUT.kernel_specs(sizes, "bf16", options)
    got = {name: (spec.shape, spec.dtype) for name, spec in specs.items()}
    want = {
        "w13_weight": ((32, 2 * Ip, 1536), torch.uint8),
        "w13_weight_scale": ((32, 2 * Ip, 96), torch.float8_e4m3fn),
        "w2_weight": ((32, 3072, Ip // 2), torch.uint8),
        "w2_weight_scale": ((32, 3072, Ip // 32), torch.float8_e4m3fn),
    }
    if has_bias:
        want["w13_bias"] = ((32, 2 * Ip), torch.float32)
        want["w2_bias"] = ((32, 3072), torch.float32)
    assert got == want
    assert specs["w13_weight"].nbytes == 32 * 2 * Ip * 1536
    assert LAYOUT.kernel_specs(sizes, "mxfp8", options) == specs


def test_kernel_specs_tp2_and_align_option() -> None:
    sizes = LayoutSizes(32, 2880, 1440, 3072, 1536, "interleaved", True)
    specs = LAYOUT.kernel_specs(sizes, "bf16", None)
    assert specs["w13_weight"].shape == (32, 3072, 1536)
    assert specs["w2_weight"].shape == (32, 3072, 768)
    assert specs["w2_weight_scale"].shape == (32, 3072, 48)
    sizes128 = LayoutSizes(8, 2880, 2880, 3072, 2944, "halves", False)
    specs128 = LAYOUT.kernel_specs(sizes128, "bf16", LAYOUT.resolve_options({"intermediate_align": 128}))
    assert specs128["w13_weight_scale"].shape == (8, 5888, 96)
    assert specs128["w2_weight"].shape == (8, 3072, 1472)


def test_kernel_specs_rejects_sizes_that_disagree_with_the_layout() -> None:
    sizes = LayoutSizes(2, 320, 96, 512, 256, "halves", False)
    with pytest.raises(LayoutError, match=r"\(Hp, Ip\) = \(512, 256\) do not match the layout's \(512, 128\)"):
        LAYOUT.kernel_specs(sizes, "bf16", LAYOUT.resolve_options({"intermediate_align": 128}))
    with pytest.raises(LayoutError, match=r"do not match the layout's \(512, 256\)"):
        LAYOUT.kernel_specs(LayoutSizes(2, 320, 160, 320, 256, "halves", False), "bf16", None)


@pytest.mark.parametrize("activation", ["bf16", "mxfp8"])
def test_describe(activation: str) -> None:
    sizes = LayoutSizes(32, 2880, 2880, 3072, 2944, "interleaved", True)
    d = LAYOUT.describe(sizes, activation, None)
    assert d["name"] == "trtllm" and d["version"] == 1
    assert d["activation"] == activation
    assert d["engine_compat"] == {"vllm": ">=0.27", "flashinfer": ">=0.3"}
    assert d["epilogue_tile_m"] == 128 and d["num_elts_per_sf"] == 16
    assert d["intermediate_align"] == 128 and d["hidden_align"] == 256
    assert d["scale_fill"] == 0
    want_backend = {"bf16": "FLASHINFER_TRTLLM_MXFP4_BF16", "mxfp8": "FLASHINFER_TRTLLM_MXFP4_MXFP8"}
    assert d["vllm_moe_backend"] == want_backend[activation]
    with pytest.raises(LayoutError, match="activation"):
        LAYOUT.describe(sizes, "fp8", None)


@pytest.mark.parametrize(("align", "vllm"), [(128, ">=0.27"), (256, "0.10.2-0.26"), (384, None)])
def test_describe_engine_compat_follows_padding(align: int, vllm: str | None) -> None:
    """Each intermediate_align names the vLLM releases that allocate it; 0.33 admits only 128."""
    Ip = -(-2880 // align) * align
    d = LAYOUT.describe(LayoutSizes(32, 2880, 2880, 3072, Ip, "interleaved", True), "bf16",
                        LAYOUT.resolve_options({"intermediate_align": align}))
    assert d["engine_compat"].get("vllm") == vllm and d["engine_compat"]["flashinfer"] == ">=0.3"
    if vllm is not None:
        assert admits_vllm(vllm) is (align == 128)


# ---------------------------------------------------------------------------------------------
# Forward bytes against the spec formulas; round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "E,H,I,row_order,bias,align",
    [
        (2, 320, 160, "halves", False, 256),
        (2, 320, 160, "interleaved", True, 256),
        (2, 96, 96, "halves", True, 128),
        (1, 256, 256, "interleaved", False, 256),
    ],
)
def test_to_kernel_bytes_match_spec_formulas(E: int, H: int, I: int, row_order: str, bias: bool, align: int) -> None:
    c = make_stack(E, H, I, row_order, bias, seed=E + H + I)
    Hp, Ip = round_up(H, 256), round_up(I, align)
    k = LAYOUT.to_kernel(c, "bf16", LAYOUT.resolve_options({"intermediate_align": align}))
    ref = vllm_padded(c, Hp, Ip)
    assert set(k) == set(LAYOUT.kernel_specs(sizes_of(c, Hp, Ip), "bf16", LAYOUT.resolve_options({"intermediate_align": align})))
    for name, t in k.items():
        assert t.is_contiguous(), name
    for j in range(2 * Ip):
        n = p_scalar(s_scalar(j), Ip, row_order)
        assert torch.equal(k["w13_weight"][:, j], ref["w13"][:, n]), j
        if bias:
            assert torch.equal(k["w13_bias"][:, j], ref["w13_bias"][:, n]), j
    for j in range(Hp):
        assert torch.equal(k["w2_weight"][:, j], ref["w2"][:, s_scalar(j)]), j
        if bias:
            assert torch.equal(k["w2_bias"][:, j], ref["w2_bias"][:, s_scalar(j)]), j
    # Scales: canonical (e, n, c) sits at e*Rp*Cp + off(dst(n), c) of the flat kernel bytes (§6).
    rng = random.Random(0)
    flat13 = k["w13_weight_scale"].view(torch.uint8).reshape(-1)
    flat2 = k["w2_weight_scale"].view(torch.uint8).reshape(-1)
    C13, C2 = Hp // 32, Ip // 32
    for _ in range(1500):
        e = rng.randrange(E)
        n, col = rng.randrange(2 * Ip), rng.randrange(C13)
        kernel_row = d_scalar(p_inv_scalar(n, Ip, row_order))
        assert flat13[e * 2 * Ip * C13 + off_scalar(kernel_row, col, C13)] == ref["w13_scale"][e, n, col]
        n, col = rng.randrange(Hp), rng.randrange(C2)
        assert flat2[e * Hp * C2 + off_scalar(d_scalar(n), col, C2)] == ref["w2_scale"][e, n, col]


@pytest.mark.parametrize(
    "E,H,I,row_order,bias,align",
    [
        (3, 320, 160, "interleaved", True, 256),  # needs padding, with biases
        (3, 320, 160, "halves", False, 256),  # needs padding, each half padded on its own
        (2, 96, 96, "halves", False, 128),
        (2, 96, 96, "interleaved", True, 128),
        (2, 256, 256, "halves", False, 256),  # already aligned
        (2, 256, 256, "interleaved", True, 256),
        (4, 768, 640, "interleaved", True, 256),  # medium
    ],
)
def test_round_trip(E: int, H: int, I: int, row_order: str, bias: bool, align: int) -> None:
    c = make_stack(E, H, I, row_order, bias, seed=7 * E + H)
    opts = LAYOUT.resolve_options({"intermediate_align": align})
    Hp, Ip = LAYOUT.padded_sizes(H, I, row_order, "bf16", opts)
    k = LAYOUT.to_kernel(c, "bf16", opts)
    sizes = sizes_of(c, Hp, Ip)
    for name, spec in LAYOUT.kernel_specs(sizes, "bf16", opts).items():
        assert (tuple(k[name].shape), k[name].dtype) == (spec.shape, spec.dtype), name
    back = LAYOUT.from_kernel(k, sizes, "bf16", opts)
    assert_same_canonical(c, back)


def test_activations_give_identical_bytes() -> None:
    c = make_stack(2, 320, 160, "interleaved", True, seed=3)
    a, b = LAYOUT.to_kernel(c, "bf16", None), LAYOUT.to_kernel(c, "mxfp8", None)
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    sizes = sizes_of(c, 512, 256)
    assert_same_canonical(c, LAYOUT.from_kernel(b, sizes, "mxfp8", None))
    with pytest.raises(LayoutError, match="activation 'fp8'"):
        LAYOUT.to_kernel(c, "fp8", None)


def test_scales_are_viewed_not_value_cast() -> None:
    """Bytes like 0x7F/0xFF (NaN as e4m3) and 0x80 (-0) must come through unchanged."""
    c = make_stack(1, 256, 256, "halves", False)
    special = torch.tensor([0x00, 0x7F, 0x80, 0xFF, 0x7E, 0x01], dtype=torch.uint8)
    c.w13_scale = special.repeat(c.w13_scale.numel() // 6 + 1)[: c.w13_scale.numel()].reshape(c.w13_scale.shape)
    k = LAYOUT.to_kernel(c, "bf16", None)
    assert k["w13_weight_scale"].dtype == torch.float8_e4m3fn
    got = k["w13_weight_scale"].view(torch.uint8).reshape(-1).sort().values
    assert torch.equal(got, c.w13_scale.reshape(-1).sort().values)


def test_to_kernel_keeps_the_input_device() -> None:
    """Index tensors are made on the input's device (meta: no data, but any device mix-up raises)."""
    c = make_stack(2, 320, 160, "halves", True).to("meta")
    k = LAYOUT.to_kernel(c, "bf16", None)
    assert all(t.device.type == "meta" for t in k.values())
    assert k["w13_weight_scale"].shape == (2, 512, 16)


def test_to_kernel_input_errors() -> None:
    c = make_stack(1, 256, 256, "halves", True)
    c.w2_bias = None
    with pytest.raises(LayoutError, match="both w13_bias and w2_bias"):
        LAYOUT.to_kernel(c, "bf16", None)
    bad = make_stack(1, 256, 256, "halves", False)
    bad.w2 = bad.w2[:, :100]
    with pytest.raises(LayoutError, match="w2 has shape"):
        LAYOUT.to_kernel(bad, "bf16", None)
    with pytest.raises(LayoutError, match="intermediate_align='256'"):
        LAYOUT.to_kernel(make_stack(1, 256, 256, "halves", False), "bf16", TrtllmOptions(intermediate_align="256"))


# ---------------------------------------------------------------------------------------------
# Inverse: padding fill and shape/dtype checks
# ---------------------------------------------------------------------------------------------


def _kernel_and_sizes(row_order: str, bias: bool) -> tuple[dict[str, torch.Tensor], LayoutSizes]:
    c = make_stack(2, 320, 160, row_order, bias, seed=11)
    return LAYOUT.to_kernel(c, "bf16", None), sizes_of(c, 512, 256)


def test_from_kernel_rejects_nonzero_weight_padding() -> None:
    H, I, Ip = 320, 160, 256
    k, sizes = _kernel_and_sizes("halves", False)
    # Row I of the canonical halves stack is the first padding row of the gate half.
    row = int(w13_row_dst(Ip, "halves")[I])
    k1 = dict(k, w13_weight=k["w13_weight"].clone())
    k1["w13_weight"][1, row, 3] = 0x10
    with pytest.raises(LayoutError, match=r"padding of w13_weight at index \[1, 160, 3\]"):
        LAYOUT.from_kernel(k1, sizes, "bf16", None)
    # Row Ip + I: first padding row of the up half.
    row = int(w13_row_dst(Ip, "halves")[Ip + I])
    k1 = dict(k, w13_weight=k["w13_weight"].clone())
    k1["w13_weight"][0, row, 0] = 1
    with pytest.raises(LayoutError, match=r"padding of w13_weight at index \[0, 416, 0\]"):
        LAYOUT.from_kernel(k1, sizes, "bf16", None)
    # Column padding of w2 (bytes I/2 onwards) in canonical row 5.
    k2 = dict(k, w2_weight=k["w2_weight"].clone())
    k2["w2_weight"][1, int(w2_row_dst(512)[5]), I // 2] = 7
    with pytest.raises(LayoutError, match=r"padding of w2_weight at index \[1, 5, 80\]"):
        LAYOUT.from_kernel(k2, sizes, "bf16", None)
    # Row padding of w2 (rows H onwards).
    k3 = dict(k, w2_weight=k["w2_weight"].clone())
    k3["w2_weight"][0, int(w2_row_dst(512)[H]), 0] = 7
    with pytest.raises(LayoutError, match=r"padding of w2_weight at index \[0, 320, 0\]"):
        LAYOUT.from_kernel(k3, sizes, "bf16", None)


def test_from_kernel_rejects_nonzero_scale_padding() -> None:
    H, I, Ip, Hp = 320, 160, 256, 512
    k, sizes = _kernel_and_sizes("interleaved", False)
    # Canonical w13 scale (e=1, n=4, c=H/32=10) is a column-padding byte: patch it in the swizzled buffer.
    kernel_row = int(w13_row_dst(Ip, "interleaved")[4])
    C13 = Hp // 32
    s13 = k["w13_weight_scale"].view(torch.uint8).clone()
    s13.view(-1)[1 * 2 * Ip * C13 + off_scalar(kernel_row, H // 32, C13)] = 0x7F
    k1 = dict(k, w13_weight_scale=s13.view(torch.float8_e4m3fn))
    with pytest.raises(LayoutError, match=r"padding of w13_weight_scale at index \[1, 4, 10\]"):
        LAYOUT.from_kernel(k1, sizes, "bf16", None)
    # Canonical w2 scale (e=0, n=H, c=0) is a row-padding byte.
    C2 = Ip // 32
    s2 = k["w2_weight_scale"].view(torch.uint8).clone()
    s2.view(-1)[off_scalar(d_scalar(H), 0, C2)] = 0xFF
    k2 = dict(k, w2_weight_scale=s2.view(torch.float8_e4m3fn))
    with pytest.raises(LayoutError, match=r"padding of w2_weight_scale at index \[0, 320, 0\]"):
        LAYOUT.from_kernel(k2, sizes, "bf16", None)


def test_from_kernel_rejects_nonzero_bias_padding() -> None:
    H, I, Ip = 320, 160, 256
    k, sizes = _kernel_and_sizes("interleaved", True)
    b13 = k["w13_bias"].clone()
    b13[0, int(w13_row_dst(Ip, "interleaved")[2 * I + 1])] = 0.5
    with pytest.raises(LayoutError, match=r"padding of w13_bias at index \[0, 321\]"):
        LAYOUT.from_kernel(dict(k, w13_bias=b13), sizes, "bf16", None)
    b2 = k["w2_bias"].clone()
    b2[1, int(w2_row_dst(512)[H + 3])] = -1.0
    with pytest.raises(LayoutError, match=r"padding of w2_bias at index \[1, 323\]"):
        LAYOUT.from_kernel(dict(k, w2_bias=b2), sizes, "bf16", None)


def test_from_kernel_shape_dtype_and_name_errors() -> None:
    k, sizes = _kernel_and_sizes("interleaved", True)
    wrong_dtype = dict(k, w13_weight_scale=k["w13_weight_scale"].view(torch.uint8))
    with pytest.raises(LayoutError, match="w13_weight_scale has dtype torch.uint8, expected torch.float8_e4m3fn"):
        LAYOUT.from_kernel(wrong_dtype, sizes, "bf16", None)
    wrong_shape = dict(k, w2_weight=k["w2_weight"][:, :256])
    with pytest.raises(LayoutError, match=r"w2_weight has shape \(2, 256, 128\), expected \(2, 512, 128\)"):
        LAYOUT.from_kernel(wrong_shape, sizes, "bf16", None)
    bf16_bias = dict(k, w2_bias=k["w2_bias"].to(torch.bfloat16))
    with pytest.raises(LayoutError, match="w2_bias has dtype torch.bfloat16, expected torch.float32"):
        LAYOUT.from_kernel(bf16_bias, sizes, "bf16", None)
    missing = {name: t for name, t in k.items() if name != "w2_bias"}
    with pytest.raises(LayoutError, match="missing: w2_bias"):
        LAYOUT.from_kernel(missing, sizes, "bf16", None)
    no_bias_sizes = LayoutSizes(2, 320, 160, 512, 256, "interleaved", False)
    with pytest.raises(LayoutError, match="unexpected trtllm kernel tensors: w13_bias, w2_bias"):
        LAYOUT.from_kernel(k, no_bias_sizes, "bf16", None)
    with pytest.raises(LayoutError, match="do not match"):
        LAYOUT.from_kernel(k, sizes, "bf16", LAYOUT.resolve_options({"intermediate_align": 512}))


def test_from_kernel_with_wrong_row_order_is_not_silently_identical() -> None:
    """Decoding with the other row order must not reproduce the canonical stack (roles matter)."""
    c = make_stack(1, 256, 256, "halves", False, seed=5)
    k = LAYOUT.to_kernel(c, "bf16", None)
    other = LAYOUT.from_kernel(k, LayoutSizes(1, 256, 256, 256, 256, "interleaved", False), "bf16", None)
    assert not torch.equal(other.w13, c.w13)
    assert torch.equal(other.w2, c.w2)


# ---------------------------------------------------------------------------------------------
# Oracle: FlashInfer's own pure-torch row helpers (skipped when flashinfer cannot be imported)
# ---------------------------------------------------------------------------------------------


def _flashinfer_helpers():  # noqa: ANN202 - returns a namespace of upstream functions
    try:
        import flashinfer.fused_moe.core as fi_core
        import flashinfer.utils as fi_utils
        from flashinfer.quantization.fp4_quantization import shuffle_matrix_a
    except Exception as exc:  # noqa: BLE001 - any import failure means "oracle unavailable"
        pytest.skip(f"flashinfer not importable on this machine: {exc}")
    return fi_utils, fi_core, shuffle_matrix_a


@pytest.mark.parametrize("rows", [128, 256, 3072, 6144])
def test_oracle_flashinfer_row_indices(rows: int) -> None:
    fi_utils, fi_core, _ = _flashinfer_helpers()
    x = torch.zeros(rows, 8, dtype=torch.uint8)
    ours = mma_shuffle_src(rows)
    assert torch.equal(fi_utils.get_shuffle_matrix_a_row_indices(x, epilogue_tile_m=128), ours)
    for sf in (16, 32):
        assert torch.equal(fi_utils.get_shuffle_matrix_sf_a_row_indices(x, 128, num_elts_per_sf=sf), ours)
    assert torch.equal(fi_core.get_w2_permute_indices_with_cache({}, x, 128), ours)
    assert torch.equal(fi_core.get_w2_permute_indices_with_cache({}, x, 128, num_elts_per_sf=16), ours)
    # FlashInfer's w3_w1 permutation indexes [w3; w1]; ours indexes [w1; w3] (halves).
    Ip = rows // 2
    fi_w3w1 = fi_core._maybe_get_cached_w3_w1_permute_indices({}, x, 128)
    as_w1w3 = torch.where(fi_w3w1 < Ip, fi_w3w1 + Ip, fi_w3w1 - Ip)
    assert torch.equal(as_w1w3, w13_row_src(Ip, "halves"))


def _oracle_case(row_order: str, seed: int) -> tuple[int, int, int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(E, Hp, Ip, vLLM's padded stack, our kernel tensors) for a 2-expert H=320, I=160 stack with biases."""
    E, H, I = 2, 320, 160
    Hp, Ip = 512, 256
    c = make_stack(E, H, I, row_order, True, seed=seed)
    return E, Hp, Ip, vllm_padded(c, Hp, Ip), LAYOUT.to_kernel(c, "bf16", None)


def test_oracle_flashinfer_standard_sequence_halves() -> None:
    """Re-enact the [w3; w1] + FlashInfer permute sequence per expert on weights, scale rows, bias."""
    _, fi_core, _ = _flashinfer_helpers()
    E, Hp, Ip, ref, k = _oracle_case("halves", seed=21)
    w13_scale_rows = unswizzle_128x4(k["w13_weight_scale"].view(torch.uint8).reshape(E, -1), 2 * Ip, Hp // 32)
    w2_scale_rows = unswizzle_128x4(k["w2_weight_scale"].view(torch.uint8).reshape(E, -1), Hp, Ip // 32)
    for e in range(E):
        def w3w1(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[Ip:], t[:Ip]])

        w = w3w1(ref["w13"][e])
        perm = fi_core._maybe_get_cached_w3_w1_permute_indices({}, w, 128)
        assert torch.equal(k["w13_weight"][e], w[perm])
        s = w3w1(ref["w13_scale"][e])
        perm_sf = fi_core._maybe_get_cached_w3_w1_permute_indices({}, s, 128, num_elts_per_sf=16)
        assert torch.equal(w13_scale_rows[e], s[perm_sf])
        b = w3w1(ref["w13_bias"][e])[:, None]
        assert torch.equal(k["w13_bias"][e], b[fi_core._maybe_get_cached_w3_w1_permute_indices({}, b, 128)][:, 0])
        p2 = fi_core.get_w2_permute_indices_with_cache({}, ref["w2"][e], 128)
        assert torch.equal(k["w2_weight"][e], ref["w2"][e][p2])
        p2sf = fi_core.get_w2_permute_indices_with_cache({}, ref["w2_scale"][e], 128, num_elts_per_sf=16)
        assert torch.equal(w2_scale_rows[e], ref["w2_scale"][e][p2sf])


def test_oracle_flashinfer_gpt_oss_sequence_interleaved() -> None:
    """Old vLLM gpt-oss path: swap every two rows, then FlashInfer's shuffle_matrix_a per expert."""
    _, _, shuffle_matrix_a = _flashinfer_helpers()
    E, _, _, ref, k = _oracle_case("interleaved", seed=22)

    def swap_pairs(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0] // 2, 2, *t.shape[1:]).flip(1).reshape(t.shape)

    for e in range(E):
        assert torch.equal(k["w13_weight"][e], shuffle_matrix_a(swap_pairs(ref["w13"][e]), 128))
        bias_col = swap_pairs(ref["w13_bias"][e])[:, None]
        assert torch.equal(k["w13_bias"][e], shuffle_matrix_a(bias_col, 128)[:, 0])
        assert torch.equal(k["w2_weight"][e], shuffle_matrix_a(ref["w2"][e], 128))
        assert torch.equal(k["w2_bias"][e], shuffle_matrix_a(ref["w2_bias"][e][:, None], 128)[:, 0])
