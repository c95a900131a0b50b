"""deepgemm layout (docs/layout-deepgemm.md): bytes against an element-by-element model of what vLLM 0.33
and DeepGEMM do at load time, padding, the engine's strided view, the inverse and its refusals."""

from __future__ import annotations

import struct

import pytest
import torch

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.deepgemm import LAYOUT, pack_ue8m0, unpack_ue8m0


def stack(E: int, H: int, I: int, row_order: str, bias: bool, seed: int = 0) -> CanonicalExperts:
    """Random canonical stack; scale bytes cover 0 and 0xFF (E8M0 2^-127 and NaN) too."""
    g = torch.Generator().manual_seed(seed)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    s13 = u8(E, 2 * I, H // 32)
    s13[0, 0, 0], s13[0, 0, 1] = 0, 255
    return CanonicalExperts(
        u8(E, 2 * I, H // 2), s13, u8(E, H, I // 2), u8(E, H, I // 32),
        torch.randn(E, 2 * I, generator=g).to(torch.bfloat16) if bias else None,
        torch.randn(E, H, generator=g).to(torch.bfloat16) if bias else None,
        row_order,
    )


def sizes_of(c: CanonicalExperts) -> LayoutSizes:
    return c.sizes(*LAYOUT.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, "fp8"))


def vllm_param_row(r: int, I: int, Ip: int, row_order: str) -> int | None:
    """Source w13 row that row r of vLLM's zero-initialised padded parameter holds (None = padding)."""
    if row_order == "interleaved":
        return r if r < 2 * I else None
    half, local = divmod(r, Ip)
    return half * I + local if local < I else None


def model_scale_words(scales: torch.Tensor, I: int, Ip: int, N_p: int, C_p: int, row_order: str, w13: bool) -> list[int]:
    """Storage of DeepGEMM's MN-major packed tensor, one expert, element by element: pad to [N_p, C_p]
    with 0, E8M0 -> fp32 bits (byte << 23, _upcast_e8m0_to_fp32), then word (j, n) at j*N_p + n is
    b0>>23 | b1>>15 | b2>>7 | b3<<1 (transpose_and_pack_fp32_into_ue8m0)."""
    words = []
    for j in range(C_p // 4):
        for n in range(N_p):
            src = vllm_param_row(n, I, Ip, row_order) if w13 else (n if n < scales.shape[0] else None)
            fp32 = []
            for q in range(4):
                c = 4 * j + q
                byte = int(scales[src, c]) if src is not None and c < scales.shape[1] else 0
                fp32.append(byte << 23)
            words.append((fp32[0] >> 23) | (fp32[1] >> 15) | (fp32[2] >> 7) | ((fp32[3] << 1) & 0xFFFFFFFF))
    return words


def test_registered() -> None:
    assert "deepgemm" in backend_names() and get_layout("deepgemm") is LAYOUT
    assert LAYOUT.activations == ("fp8",) and LAYOUT.vllm_backends == {"fp8": ("DEEPGEMM_MXFP4",)}


@pytest.mark.parametrize("H, I, want", [(2880, 2880, (2944, 2944)), (7168, 2048, (7168, 2048)), (2048, 768, (2048, 768)),
                                        (96, 160, (128, 256)), (2880, 352, (2944, 384))])
def test_padded_sizes(H: int, I: int, want: tuple[int, int]) -> None:
    assert LAYOUT.padded_sizes(H, I, "halves", "fp8") == want


def test_padded_sizes_refused() -> None:
    for args, msg in (((100, 128, "halves", "fp8"), "hidden size 100"), ((128, 48, "halves", "fp8"), "intermediate size 48"),
                      ((128, 128, "sideways", "fp8"), "unknown w13 row order"), ((128, 128, "halves", "bf16"), "activation 'bf16'")):
        with pytest.raises(LayoutError, match=msg):
            LAYOUT.padded_sizes(*args)


def test_pack_word_values() -> None:
    s = torch.tensor([[[1, 2, 3, 4, 5, 6, 7, 8], [0x7F, 0, 0xFF, 0x80, 9, 10, 11, 12]]], dtype=torch.uint8)  # [1, 2, 8]
    p = pack_ue8m0(s)
    assert p.shape == (1, 2, 2) and p.dtype == torch.int32
    le = [struct.unpack("<I", bytes(b))[0] for b in ([1, 2, 3, 4], [0x7F, 0, 0xFF, 0x80], [5, 6, 7, 8], [9, 10, 11, 12])]
    assert p.view(torch.uint32).flatten().tolist() == le  # word [j, n]: j = K/128 block, n = row
    assert torch.equal(unpack_ue8m0(p), s)
    with pytest.raises(LayoutError, match="do not pack"):
        pack_ue8m0(torch.zeros(1, 2, 6, dtype=torch.uint8))


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
@pytest.mark.parametrize("bias", [True, False])
def test_to_kernel_bytes(row_order: str, bias: bool) -> None:
    c = stack(3, 96, 160, row_order, bias)  # Hp = 128, Ip = 256
    k = LAYOUT.to_kernel(c, "fp8", None)
    Hp, Ip, I = 128, 256, 160
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {
        n: (s.shape, s.dtype) for n, s in LAYOUT.kernel_specs(sizes_of(c), "fp8", None).items()}
    assert list(k) == [n for n in ("w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias") if n in k]
    for e in range(3):
        for r in range(2 * Ip):
            src = vllm_param_row(r, I, Ip, row_order)
            want = torch.zeros(Hp // 2, dtype=torch.uint8) if src is None else torch.cat([c.w13[e, src], torch.zeros(16, dtype=torch.uint8)])
            assert torch.equal(k["w13_weight"][e, r], want), (e, r)
            if bias:
                assert float(k["w13_bias"][e, r]) == (0.0 if src is None else float(c.w13_bias[e, src]))
        assert torch.equal(k["w2_weight"][e, :96, :80], c.w2[e]) and not k["w2_weight"][e, 96:].any() and not k["w2_weight"][e, :, 80:].any()
        got13 = k["w13_weight_scale"][e].flatten().view(torch.uint32).tolist()
        assert got13 == model_scale_words(c.w13_scale[e], I, Ip, 2 * Ip, Hp // 32, row_order, True)
        got2 = k["w2_weight_scale"][e].flatten().view(torch.uint32).tolist()
        assert got2 == model_scale_words(c.w2_scale[e], I, Ip, Hp, Ip // 32, row_order, False)
    if bias:
        assert k["w13_bias"].dtype == torch.bfloat16 and torch.equal(k["w2_bias"][:, :96], c.w2_bias) and not k["w2_bias"][:, 96:].any()
    else:
        assert "w13_bias" not in k and "w2_bias" not in k


def test_engine_view_is_mn_major() -> None:
    """vLLM holds stored.transpose(1, 2): shape [E, N, K/128], strides (N*K/128, 1, N), as DeepGEMM's
    get_mn_major_tma_aligned_packed_ue8m0_tensor returns it (tma-aligned N = N, since N % 4 == 0)."""
    c = stack(2, 256, 128, "halves", False)
    k = LAYOUT.to_kernel(c, "fp8", None)
    view = k["w13_weight_scale"].transpose(1, 2)
    assert view.shape == (2, 256, 2) and view.stride() == (512, 1, 256)
    b = view.contiguous().view(torch.uint8).reshape(2, 256, 2, 4)  # [e, n, j, q]: K block 4j + q
    assert torch.equal(b.reshape(2, 256, 8), c.w13_scale)


def test_gpt_oss_20b_specs() -> None:
    sizes = LayoutSizes(32, 2880, 2880, 2944, 2944, "interleaved", True)
    got = {n: (s.shape, s.dtype) for n, s in LAYOUT.kernel_specs(sizes, "fp8", None).items()}
    assert got == {
        "w13_weight": ((32, 5888, 1472), torch.uint8), "w13_weight_scale": ((32, 23, 5888), torch.int32),
        "w13_bias": ((32, 5888), torch.bfloat16), "w2_weight": ((32, 2944, 1472), torch.uint8),
        "w2_weight_scale": ((32, 23, 2944), torch.int32), "w2_bias": ((32, 2944), torch.bfloat16),
    }
    with pytest.raises(LayoutError, match=r"do not match the layout's \(2944, 2944\)"):
        LAYOUT.kernel_specs(LayoutSizes(32, 2880, 2880, 3072, 2944, "interleaved", True), "fp8", None)


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
def test_round_trip(row_order: str) -> None:
    c = stack(4, 160, 96, row_order, True, seed=3)
    back = LAYOUT.from_kernel(LAYOUT.to_kernel(c, "fp8", None), sizes_of(c), "fp8", None)
    for f in ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias"):
        assert torch.equal(getattr(back, f), getattr(c, f)), f
    assert back.row_order == row_order


def test_from_kernel_refuses() -> None:
    c = stack(2, 96, 160, "halves", True)
    sizes = sizes_of(c)
    good = LAYOUT.to_kernel(c, "fp8", None)

    def bad(name: str, fn) -> dict[str, torch.Tensor]:
        k = {n: t.clone() for n, t in good.items()}
        k[name] = fn(k[name])
        return k

    def poke(t: torch.Tensor, idx: tuple[int, ...], v: int) -> torch.Tensor:
        t[idx] = v
        return t

    def poke_scale(t: torch.Tensor, e: int, j: int, n: int, q: int) -> torch.Tensor:
        t.view(torch.uint8).view(*t.shape, 4)[e, j, n, q] = 1  # byte q of word [e, j, n]
        return t

    cases = [
        (bad("w13_weight", lambda t: poke(t, (1, 200, 3), 7)), r"padding of w13_weight at index \[1, 200, 3\]"),
        (bad("w2_weight", lambda t: poke(t, (0, 5, 90), 1)), r"padding of w2_weight at index \[0, 5, 90\]"),
        # word [e=0, j=0, n=170] byte 2 = scale (row 170, K block 2): row 170 is in the gate half's padding
        (bad("w13_weight_scale", lambda t: poke_scale(t, 0, 0, 170, 2)), r"padding of w13_weight_scale at index \[0, 170, 2\]"),
        (bad("w2_weight_scale", lambda t: poke_scale(t, 1, 1, 7, 3)), r"padding of w2_weight_scale at index \[1, 7, 7\]"),
        (bad("w2_bias", lambda t: poke(t, (1, 100), 1)), r"padding of w2_bias at index \[1, 100\]"),
        (bad("w13_weight_scale", lambda t: t.view(torch.uint8)), r"w13_weight_scale is \(2, 1, 2048\) torch.uint8"),
        ({n: t for n, t in good.items() if n != "w2_bias"}, r"missing \['w2_bias'\]"),
    ]
    for k, msg in cases:
        with pytest.raises(LayoutError, match=msg):
            LAYOUT.from_kernel(k, sizes, "fp8", None)


def test_describe() -> None:
    c = stack(2, 96, 160, "halves", False)
    d = LAYOUT.describe(sizes_of(c), "fp8", None)
    assert (d["name"], d["version"], d["vllm_moe_backend"], d["engine_compat"]["vllm"]) == ("deepgemm", 1, "DEEPGEMM_MXFP4", ">=0.33")
    assert d["padding"] == {"hidden_align": 128, "intermediate_align": 128, "fill": 0} and d["w13_kernel_row_order"] == "halves"
