"""Marlin MXFP4 MoE layout: worked examples of layout-marlin.md §9, scalar formulas of §4/§5/§6/§8,
round trips, padding checks, shapes and errors."""

from __future__ import annotations

import re

import pytest
import torch

from mxconv.errors import LayoutError
from mxconv.experts.padding import pad_canonical
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.layouts import get_layout
from mxconv.mx.formats import pack_fp4, unpack_fp4
from mxconv.layouts.marlin import LAYOUT
from mxconv.layouts.marlin_bytemap import (
    chunk32_perm, inverse_perm, legacy_unweave, legacy_weave, marlin_bias, marlin_scales, marlin_unscales,
    marlin_weight_repack, marlin_weight_unrepack, scale_perm_bf16, scale_regroup_perm, scale_transpose_perm,
    weight_source_index,
)

MODES = [("bf16", "current"), ("bf16", "legacy"), ("fp8", "current")]


def u32(x: torch.Tensor | int) -> int:
    return int(x) & 0xFFFFFFFF


def random_stack(E: int, H: int, I: int, row_order: str, bias: bool, seed: int = 0) -> CanonicalExperts:
    g = torch.Generator().manual_seed(seed)

    def rb(*shape: int, hi: int = 256) -> torch.Tensor:
        return torch.randint(0, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    b13 = torch.randn(E, 2 * I, generator=g).to(torch.bfloat16) if bias else None
    b2 = torch.randn(E, H, generator=g).to(torch.bfloat16) if bias else None
    # scale bytes <= 249 so the same stack also fits the FP8-activation variant
    return CanonicalExperts(
        w13=rb(E, 2 * I, H // 2),
        w13_scale=rb(E, 2 * I, H // 32, hi=250),
        w2=rb(E, H, I // 2),
        w2_scale=rb(E, H, I // 32, hi=250),
        w13_bias=b13,
        w2_bias=b2,
        row_order=row_order,
    )


def sizes_of(c: CanonicalExperts, activation: str = "bf16") -> LayoutSizes:
    return c.sizes(*LAYOUT.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation))


# ---------------------------------------------------------------------------------------------
# §9 worked examples
# ---------------------------------------------------------------------------------------------


def test_example_a_code_equals_k() -> None:
    row = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)
    out = marlin_weight_repack(row.repeat(64, 1)[None], "bf16")
    assert out.shape == (1, 1, 128) and out.dtype == torch.int32
    words = [0x91918080, 0xB3B3A2A2, 0xD5D5C4C4, 0xF7F7E6E6]
    for col in range(128):
        assert u32(out[0, 0, col]) == words[(col // 4) % 4], col
    # word 0 nibbles j = 0..7 are k 0,8,0,8,1,9,1,9
    assert [(u32(out[0, 0, 0]) >> (4 * j)) & 0xF for j in range(8)] == [0, 8, 0, 8, 1, 9, 1, 9]


def test_example_b_code_equals_n_mod_16() -> None:
    codes = (torch.arange(64) % 16).to(torch.uint8)[:, None].expand(64, 16)
    out = marlin_weight_repack(pack_fp4(codes)[None], "bf16")
    words = [0x88008800, 0x99119911, 0xAA22AA22, 0xBB33BB33]
    for thc, word in enumerate(words):
        assert u32(out[0, 0, 16 * thc]) == word


def test_first_word_source_map() -> None:
    K, N = 16, 64
    src = weight_source_index(K, N, "bf16")  # [1, 16N], flat n*K + k
    assert src.shape == (1, 16 * N)

    def kn(word: int) -> list[tuple[int, int]]:
        return [(int(s) % K, int(s) // K) for s in src[0, 8 * word : 8 * word + 8]]

    first = [(0, 0), (8, 0), (0, 8), (8, 8), (1, 0), (9, 0), (1, 8), (9, 8)]
    assert kn(0) == first
    assert kn(1) == [(k, n + 16) for k, n in first]
    assert kn(4) == [(k + 2, n) for k, n in first]
    assert kn(16) == [(k, n + 1) for k, n in first]
    # The same map, observed through the repack itself: a single non-zero code moves to that nibble.
    for j, (k, n) in enumerate(first):
        q = torch.zeros(N, K, dtype=torch.uint8)
        q[n, k] = 0xA
        out = marlin_weight_repack(pack_fp4(q)[None], "bf16")
        assert u32(out[0, 0, 0]) == 0xA << (4 * j)
        assert int((out != 0).sum()) == 1


def test_example_scale_rows() -> None:
    s = torch.arange(64, dtype=torch.uint8)[None, :, None]  # [E=1, N=64, G=1], byte of column n = n
    bf16 = marlin_scales(s, "bf16", "current")
    assert bf16.shape == (1, 1, 64)
    assert bf16[0, 0, :16].tolist() == [0, 16, 8, 24, 32, 48, 40, 56, 1, 17, 9, 25, 33, 49, 41, 57]
    fp8 = marlin_scales(s, "fp8")
    assert fp8[0, 0, :16].tolist() == [6, 7, 14, 15, 22, 23, 30, 31, 8, 9, 16, 17, 24, 25, 32, 33]
    n = torch.arange(64)[:, None]
    g = torch.arange(2)[None, :]
    legacy = marlin_scales((2 * n + g).to(torch.uint8)[None], "bf16", "legacy")
    assert legacy.shape == (1, 2, 64)
    assert legacy[0, 0, :16].tolist() == [0, 32, 16, 48, 64, 96, 80, 112, 1, 33, 17, 49, 65, 97, 81, 113]
    assert legacy[0, 1, :16].tolist() == [8, 40, 24, 56, 72, 104, 88, 120, 9, 41, 25, 57, 73, 105, 89, 121]


# ---------------------------------------------------------------------------------------------
# Scalar formulas
# ---------------------------------------------------------------------------------------------


def _formula_kn(activation: str, kt: int, nt: int, t: int, j: int) -> tuple[int, int]:
    """§4.2 / §4.3: element (k, n) held by nibble j of word t of tile (kt, nt)."""
    w, th = t % 4, t // 4
    thr, thc = th % 4, th // 4
    j0, j1, j2 = j & 1, (j >> 1) & 1, j >> 2
    if activation == "bf16":
        return 16 * kt + 8 * j0 + 2 * thr + j2, 64 * nt + 16 * w + 8 * j1 + thc
    return 32 * kt + 16 * j0 + 4 * thr + 2 * j2 + j1, 32 * nt + 8 * w + thc


@pytest.mark.parametrize("activation", ["bf16", "fp8"])
def test_weight_nibble_formula_on_random_data(activation: str) -> None:
    E, N, K = 2, 128, 64
    q = torch.randint(0, 16, (E, N, K), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    out = marlin_weight_repack(pack_fp4(q.to(torch.uint8)), activation)
    assert out.shape == (E, K // 16, 2 * N) and out.dtype == torch.int32
    tile_k, tile_n = (16, 64) if activation == "bf16" else (32, 32)
    flat = out.reshape(E, -1).tolist()
    qs = q.tolist()
    for e in range(E):
        for kt in range(K // tile_k):
            for nt in range(N // tile_n):
                base = (kt * (N // tile_n) + nt) * 128
                for t in range(128):
                    word = flat[e][base + t] & 0xFFFFFFFF
                    for j in range(8):
                        k, n = _formula_kn(activation, kt, nt, t, j)
                        assert (word >> (4 * j)) & 0xF == qs[e][n][k], (e, kt, nt, t, j)


def test_inverse_scalar_form_section_8() -> None:
    """§8 16-bit scalar form: the code of (k, n) sits in out[kt][128*nt + 4*(4*thc + thr) + w], nibble 4*j2+2*j1+j0."""
    N, K = 128, 48
    q = torch.randint(0, 16, (1, N, K), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    out = marlin_weight_repack(pack_fp4(q.to(torch.uint8)), "bf16").tolist()[0]
    for k in range(0, K, 5):
        for n in range(0, N, 7):
            kt, j0, thr, j2 = k // 16, (k % 16) // 8, (k % 8) // 2, k % 2
            nt, w, j1, thc = n // 64, (n % 64) // 16, (n % 16) // 8, n % 8
            word = out[kt][128 * nt + 4 * (4 * thc + thr) + w] & 0xFFFFFFFF
            assert (word >> (4 * (4 * j2 + 2 * j1 + j0))) & 0xF == int(q[0, n, k])


def test_scale_perm_bf16_formulas() -> None:
    perm = scale_perm_bf16().tolist()
    for p in range(64):
        p0, p1, p2 = p & 1, (p >> 1) & 1, (p >> 2) & 1
        assert perm[p] == 32 * p2 + 16 * p0 + 8 * p1 + (p >> 3)
    for c in range(64):  # forward form: source c goes to p = 8*cl + 4*c5 + 2*c3 + c4
        cl, c3, c4, c5 = c & 7, (c >> 3) & 1, (c >> 4) & 1, (c >> 5) & 1
        assert perm.index(c) == 8 * cl + 4 * c5 + 2 * c3 + c4
    # composition of (a) 8x8 transpose then (b) middle-two swap
    a = [i + 8 * j for i in range(8) for j in range(8)]  # out[8i + j] = in[i + 8j]
    assert scale_transpose_perm().tolist() == a
    b = [4 * (p // 4) + [0, 2, 1, 3][p % 4] for p in range(64)]
    assert scale_regroup_perm().tolist() == b
    assert perm == [a[b[p]] for p in range(64)]


def test_chunk32_perm_formula_and_involution() -> None:
    perm = chunk32_perm().tolist()
    assert perm[:16] == [0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27]
    assert perm[16:] == [4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31]
    assert [perm[perm[p]] for p in range(32)] == list(range(32))
    assert sorted(perm) == list(range(32))


def test_legacy_weave_scalar() -> None:
    G, N = 4, 128
    a = torch.randint(0, 256, (2, G, N), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    woven = legacy_weave(a)
    al = a.tolist()
    for e in range(2):
        for r in range(G // 2):
            stream: list[int] = []
            for c in range(N // 8):
                stream += al[e][2 * r][8 * c : 8 * c + 8] + al[e][2 * r + 1][8 * c : 8 * c + 8]
            assert woven[e, 2 * r].tolist() == stream[:N]
            assert woven[e, 2 * r + 1].tolist() == stream[N:]
    assert torch.equal(legacy_unweave(woven), a)
    with pytest.raises(LayoutError, match="even number of scale groups"):
        legacy_weave(torch.zeros(1, 3, 64, dtype=torch.uint8), "w2_weight_scale")


@pytest.mark.parametrize("activation,scale_layout", MODES)
def test_scales_scalar_and_inverse(activation: str, scale_layout: str) -> None:
    E, N, G = 2, 128, 4
    s = torch.randint(0, 250, (E, N, G), generator=torch.Generator().manual_seed(4), dtype=torch.int32).to(torch.uint8)
    m = marlin_scales(s, activation, scale_layout)
    assert m.shape == (E, G, N) and m.dtype == torch.uint8
    assert torch.equal(marlin_unscales(m, activation, scale_layout), s)
    if scale_layout == "current":
        perm = scale_perm_bf16().tolist() if activation == "bf16" else chunk32_perm().tolist()
        C, off = len(perm), (6 if activation == "fp8" else 0)
        for e in range(E):
            for g in range(G):
                for col in range(N):
                    src = C * (col // C) + perm[col % C]
                    assert int(m[e, g, col]) == int(s[e, src, g]) + off


def test_scale_bytes_all_values_survive() -> None:
    s = torch.arange(256, dtype=torch.uint8).reshape(1, 128, 2)  # bytes 0 and 255 included
    for scale_layout in ("current", "legacy"):
        m = marlin_scales(s, "bf16", scale_layout)
        assert torch.equal(marlin_unscales(m, "bf16", scale_layout), s)


def test_bias_permutation_scalar() -> None:
    b = torch.randn(2, 96, generator=torch.Generator().manual_seed(5))
    out = marlin_bias(b)
    assert out.dtype == torch.bfloat16
    perm = chunk32_perm().tolist()
    bb = b.to(torch.bfloat16)
    for e in range(2):
        for p in range(96):
            assert out[e, p].item() == bb[e, 32 * (p // 32) + perm[p % 32]].item()


def test_nibbles_and_inverse_perm() -> None:
    x = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    codes = unpack_fp4(x)
    assert codes[0, :4].tolist() == [0, 0, 1, 0] and codes[1, 2:4].tolist() == [1, 4]  # 0x41 -> 1, 4
    assert torch.equal(pack_fp4(codes), x)
    perm = scale_perm_bf16()
    assert torch.equal(perm[inverse_perm(perm)], torch.arange(64))


# ---------------------------------------------------------------------------------------------
# Layout: sizes, specs, describe
# ---------------------------------------------------------------------------------------------


def test_registry_and_identity() -> None:
    assert get_layout("marlin") is LAYOUT
    assert LAYOUT.name == "marlin" and LAYOUT.version == 1 and LAYOUT.activations == ("bf16", "fp8")


def test_padded_sizes_and_rules() -> None:
    assert LAYOUT.padded_sizes(2880, 2880, "interleaved", "bf16") == (3072, 2944)
    assert LAYOUT.padded_sizes(256, 128, "halves", "fp8") == (256, 128)
    assert LAYOUT.padded_sizes(320, 160, "halves", "bf16") == (512, 256)
    assert LAYOUT.padded_sizes(2880, 1440, "interleaved", "bf16") == (3072, 1536)  # tp=2 rank


@pytest.mark.parametrize("activation,scale_layout", MODES)
def test_kernel_specs_gpt_oss_20b(activation: str, scale_layout: str) -> None:
    sizes = LayoutSizes(32, 2880, 2880, 3072, 2944, "interleaved", True)
    specs = LAYOUT.kernel_specs(sizes, activation, LAYOUT.resolve_options({"marlin_scale_layout": scale_layout}))
    got = {name: (spec.shape, spec.dtype) for name, spec in specs.items()}
    assert got == {
        "w13_weight": ((32, 192, 11776), torch.int32),
        "w13_weight_scale": ((32, 96, 5888), torch.float8_e8m0fnu),
        "w13_bias": ((32, 5888), torch.bfloat16),
        "w2_weight": ((32, 184, 6144), torch.int32),
        "w2_weight_scale": ((32, 92, 3072), torch.float8_e8m0fnu),
        "w2_bias": ((32, 3072), torch.bfloat16),
    }
    no_bias = LAYOUT.kernel_specs(LayoutSizes(32, 2880, 2880, 3072, 2944, "halves", False), activation, None)
    assert set(no_bias) == {"w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"}


def test_describe() -> None:
    sizes = LayoutSizes(4, 320, 160, 512, 256, "interleaved", True)
    cur = LAYOUT.describe(sizes, "bf16", None)
    assert cur["name"] == "marlin" and cur["version"] == 1 and cur["activation"] == "bf16"
    assert cur["engine_compat"] == {"vllm": ">=0.12"}
    assert cur["scale_layout"] == "current" and cur["weight_tile"] == {"k": 16, "n": 64}
    legacy = LAYOUT.describe(sizes, "bf16", LAYOUT.resolve_options({"marlin_scale_layout": "legacy"}))
    assert legacy["engine_compat"] == {"vllm": ">=0.10.2,<=0.11.2"} and legacy["scale_layout"] == "legacy"
    fp8 = LAYOUT.describe(sizes, "fp8", None)
    assert fp8["engine_compat"] == {"vllm": ">=0.12"}
    assert fp8["weight_tile"] == {"k": 32, "n": 32} and fp8["scale_offset"] == 6


def test_option_errors() -> None:
    sizes = LayoutSizes(1, 256, 128, 256, 128, "halves", False)
    with pytest.raises(LayoutError, match="legacy"):
        LAYOUT.kernel_specs(sizes, "fp8", LAYOUT.resolve_options({"marlin_scale_layout": "legacy"}))
    with pytest.raises(LayoutError, match="marlin_scale_layout"):
        LAYOUT.describe(sizes, "bf16", LAYOUT.resolve_options({"marlin_scale_layout": "v2"}))
    c = random_stack(1, 256, 128, "halves", False)
    with pytest.raises(LayoutError, match="legacy"):
        LAYOUT.to_kernel(c, "fp8", LAYOUT.resolve_options({"marlin_scale_layout": "legacy"}))


# ---------------------------------------------------------------------------------------------
# Layout: to_kernel / from_kernel
# ---------------------------------------------------------------------------------------------

ROUND_TRIP_CASES = [
    (3, 320, 160, "interleaved", True),  # pads H 320 -> 512, I 160 -> 256
    (2, 96, 96, "halves", False),  # pads H 96 -> 256, I 96 -> 128 (each half)
    (2, 256, 128, "interleaved", True),  # aligned
    (2, 96, 96, "interleaved", False),
    (2, 320, 160, "halves", True),
]


@pytest.mark.parametrize("activation,scale_layout", MODES)
@pytest.mark.parametrize("E,H,I,row_order,bias", ROUND_TRIP_CASES)
def test_round_trip(E: int, H: int, I: int, row_order: str, bias: bool, activation: str, scale_layout: str) -> None:
    c = random_stack(E, H, I, row_order, bias, seed=H + I)
    opts = LAYOUT.resolve_options({"marlin_scale_layout": scale_layout})
    sizes = sizes_of(c, activation)
    k = LAYOUT.to_kernel(c, activation, opts)
    specs = LAYOUT.kernel_specs(sizes, activation, opts)
    assert list(k) == list(specs)
    for name, t in k.items():
        assert (tuple(t.shape), t.dtype) == (specs[name].shape, specs[name].dtype), name
        assert t.is_contiguous() and t.device == c.device
    back = LAYOUT.from_kernel(k, sizes, activation, opts)
    assert back.row_order == row_order
    for field in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, field), getattr(c, field)), field
    if bias:
        assert back.w13_bias.dtype == torch.float32
        assert torch.equal(back.w13_bias, c.w13_bias.float())
        assert torch.equal(back.w2_bias, c.w2_bias.float())
    else:
        assert back.w13_bias is None and back.w2_bias is None


def test_to_kernel_matches_padded_helpers_and_per_expert() -> None:
    """Padding location and vectorisation over E: expert e of the stack == that expert on its own."""
    c = random_stack(3, 320, 160, "halves", True, seed=7)
    k = LAYOUT.to_kernel(c, "bf16", None)
    p = pad_canonical(c, 512, 256)
    # halves: gate rows at 0..I-1, up rows at Ip..Ip+I-1 of the padded matrix
    assert torch.equal(p.w13[:, 256 : 256 + 160, :160], c.w13[:, 160:, :])
    for e in range(3):
        assert torch.equal(k["w13_weight"][e : e + 1], marlin_weight_repack(p.w13[e : e + 1], "bf16"))
        assert torch.equal(k["w2_weight"][e : e + 1], marlin_weight_repack(p.w2[e : e + 1], "bf16"))
        assert torch.equal(
            k["w2_weight_scale"][e : e + 1].view(torch.uint8), marlin_scales(p.w2_scale[e : e + 1], "bf16")
        )
        assert torch.equal(k["w13_bias"][e : e + 1], marlin_bias(p.w13_bias[e : e + 1]))
    # padded rows of w13 (gate units I..Ip-1) are all-zero codes in the kernel stream
    src = weight_source_index(512, 512, "bf16")  # w13: K = Hp = 512, N = 2*Ip = 512
    codes = unpack_fp4(k["w13_weight"][0].contiguous().view(torch.uint8)).reshape(-1)
    n_of = src.reshape(-1) // 512
    assert int(codes[(n_of >= 160) & (n_of < 256)].max()) == 0
    assert torch.equal(unpack_fp4(p.w13[0]).reshape(-1)[src.reshape(-1)], codes)


def test_medium_interleaved_fp8() -> None:
    c = random_stack(4, 640, 608, "interleaved", True, seed=11)
    sizes = sizes_of(c, "fp8")
    assert (sizes.padded_hidden_size, sizes.padded_intermediate_size) == (768, 640)
    k = LAYOUT.to_kernel(c, "fp8", None)
    # padded scale bytes are 0 + 6
    assert int(k["w2_weight_scale"].view(torch.uint8).min()) >= 6
    back = LAYOUT.from_kernel(k, sizes, "fp8", None)
    assert torch.equal(back.w13, c.w13) and torch.equal(back.w2_scale, c.w2_scale)


def _kernel_from_padded(p: CanonicalExperts, activation: str = "bf16") -> dict[str, torch.Tensor]:
    out = {
        "w13_weight": marlin_weight_repack(p.w13, activation),
        "w13_weight_scale": marlin_scales(p.w13_scale, activation).view(torch.float8_e8m0fnu),
        "w2_weight": marlin_weight_repack(p.w2, activation),
        "w2_weight_scale": marlin_scales(p.w2_scale, activation).view(torch.float8_e8m0fnu),
    }
    if p.w13_bias is not None:
        out["w13_bias"] = marlin_bias(p.w13_bias)
        out["w2_bias"] = marlin_bias(p.w2_bias)
    return out


@pytest.mark.parametrize(
    "field,index,name",
    [
        ("w13", (1, 2 * 160, 0), "w13_weight"),  # interleaved padding row
        ("w13", (0, 5, 160), "w13_weight"),  # K padding byte (H/2 = 160)
        ("w13_scale", (2, 400, 1), "w13_weight_scale"),
        ("w13_scale", (0, 3, 12), "w13_weight_scale"),  # K padding column (H/32 = 10)
        ("w2", (0, 320, 3), "w2_weight"),
        ("w2", (1, 7, 100), "w2_weight"),  # K padding byte (I/2 = 80)
        ("w2_scale", (2, 1, 6), "w2_weight_scale"),  # I/32 = 5
        ("w13_bias", (0, 330), "w13_bias"),
        ("w2_bias", (1, 500), "w2_bias"),
    ],
)
def test_nonzero_padding_is_rejected(field: str, index: tuple[int, ...], name: str) -> None:
    c = random_stack(3, 320, 160, "interleaved", True, seed=13)
    sizes = sizes_of(c)
    p = pad_canonical(c, 512, 256)
    getattr(p, field)[index] = 1
    k = _kernel_from_padded(p)
    with pytest.raises(LayoutError, match=re.escape(f"padding of {name} at index {list(index)}")):
        LAYOUT.from_kernel(k, sizes, "bf16", None)


def test_halves_padding_is_rejected() -> None:
    c = random_stack(2, 96, 96, "halves", False, seed=17)
    sizes = sizes_of(c)
    p = pad_canonical(c, 256, 128)
    p.w13[1, 100, 3] = 0x20  # gate-half padding (gate units I..Ip-1 = rows 96..127)
    with pytest.raises(LayoutError, match=r"padding of w13_weight at index \[1, 100, 3\]"):
        LAYOUT.from_kernel(_kernel_from_padded(p), sizes, "bf16", None)


def test_fp8_scale_errors() -> None:
    c = random_stack(2, 256, 128, "halves", False, seed=19)
    c.w2_scale[1, 7, 2] = 250
    with pytest.raises(LayoutError, match=r"w2_weight_scale at index \[1, 7, 2\] holds E8M0 byte 250"):
        LAYOUT.to_kernel(c, "fp8", None)
    c.w2_scale[1, 7, 2] = 249
    k = LAYOUT.to_kernel(c, "fp8", None)
    assert int(k["w2_weight_scale"].view(torch.uint8).max()) == 255
    sizes = sizes_of(c, "fp8")
    bad = k["w13_weight_scale"].view(torch.uint8).clone()
    bad[0, 0, 0] = 5
    with pytest.raises(LayoutError, match="w13_weight_scale"):
        LAYOUT.from_kernel({**k, "w13_weight_scale": bad.view(torch.float8_e8m0fnu)}, sizes, "fp8", None)
    # padded fp8 scales must hold exactly 6 (= 0 + 6)
    c2 = random_stack(1, 96, 96, "halves", False, seed=23)
    k2 = LAYOUT.to_kernel(c2, "fp8", None)
    s2 = k2["w2_weight_scale"].view(torch.uint8).clone()  # [1, Ip/32 = 4, Hp = 256]
    assert int(s2[0, 3, 0]) == 6  # group 3 is padding (I/32 = 3)
    s2[0, 3, 0] = 7
    with pytest.raises(LayoutError, match="padding of w2_weight_scale"):
        LAYOUT.from_kernel({**k2, "w2_weight_scale": s2.view(torch.float8_e8m0fnu)}, sizes_of(c2, "fp8"), "fp8", None)


def test_from_kernel_validates_shapes_and_dtypes() -> None:
    c = random_stack(2, 96, 96, "interleaved", True, seed=29)
    sizes = sizes_of(c)
    k = LAYOUT.to_kernel(c, "bf16", None)
    with pytest.raises(LayoutError, match=r"w2_weight_scale has shape .* dtype torch.uint8, expected .*float8_e8m0fnu"):
        LAYOUT.from_kernel({**k, "w2_weight_scale": k["w2_weight_scale"].view(torch.uint8)}, sizes, "bf16", None)
    with pytest.raises(LayoutError, match=r"w13_weight has shape \(2, 16, 255\)"):
        LAYOUT.from_kernel({**k, "w13_weight": k["w13_weight"][..., :255]}, sizes, "bf16", None)
    with pytest.raises(LayoutError, match="w13_bias has shape"):
        LAYOUT.from_kernel({**k, "w13_bias": k["w13_bias"].float()}, sizes, "bf16", None)
    missing = {n: t for n, t in k.items() if n != "w2_bias"}
    with pytest.raises(LayoutError, match="w2_bias is missing"):
        LAYOUT.from_kernel(missing, sizes, "bf16", None)
    # a kernel tensor set from another activation mode has the same shapes but other bytes: padding check trips
    k_fp8 = LAYOUT.to_kernel(c, "fp8", None)
    with pytest.raises(LayoutError):
        LAYOUT.from_kernel(k_fp8, sizes, "bf16", None)


def test_weight_repack_size_rules() -> None:
    with pytest.raises(LayoutError, match="N % 64 == 0"):
        marlin_weight_repack(torch.zeros(1, 32, 8, dtype=torch.uint8), "bf16", "w2_weight")
    with pytest.raises(LayoutError, match="K % 32 == 0"):
        marlin_weight_repack(torch.zeros(1, 64, 8, dtype=torch.uint8), "fp8", "w2_weight")
    q = torch.randint(0, 256, (2, 64, 24), dtype=torch.int32).to(torch.uint8)  # K = 48: fine for bf16
    assert torch.equal(marlin_weight_unrepack(marlin_weight_repack(q, "bf16"), "bf16"), q)
