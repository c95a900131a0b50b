"""``--backend humming`` with MXFP8 experts on CPU (vLLM's Fp8MoeBackend.HUMMING): the 8-bit word map
against a scalar transcription of humming's ``weight_repack_nk`` / ``humming_pack_weight`` loops, round
trips on odd sizes in both row orders and TP slices, what vLLM pads (nothing), the manifest, and the
CLI (repack of an MXFP8 output and of a bf16 source, verify bit-exact, planted damage caught).
tests/test_humming_gpu.py compares the bytes with humming's own transform and runs its GEMMs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.cli import mx
from support.mxfp8_cli import quantized_mxfp8, repack_verify_and_damage

from mxconv.errors import LayoutError
from mxconv.examples import ModelSizes, make_checkpoint
from mxconv.experts.stack import CanonicalExperts
from mxconv.experts.tp import slice_tp, tp_ranges
from mxconv.layouts import get_layout
from mxconv.layouts.humming_bytemap import repack_bytes, repack_weights, unrepack_bytes


def _kernel_oracle(values: torch.Tensor, bits: int) -> torch.Tensor:
    """weight_repack_nk<bits, 16, packed> with interleave_mode 3 for one value per element of
    ``values`` [E, N, K] (codes < 2**bits), one 64 x 64 block and one thread lane at a time."""
    E, N, K = values.shape
    v = values.tolist()
    per_word = 32 // bits  # values in one int32
    group = per_word // 2  # get_interleaved_index with 16-bit activations (stride 2)
    out = torch.zeros(E, K // 16, N * bits // 2, dtype=torch.int64)
    for z in range(E):
        for bx in range(N // 64):
            for by in range(K // 64):
                for lane in range(32):
                    tmp = [0] * 128  # [j // 2][i // 2][i % 2][j % 2][k]
                    for i in range(8):
                        for j in range(8):
                            for k in range(2):
                                x = v[z][bx * 64 + i * 8 + lane // 4][by * 64 + j * 8 + (lane % 4) * 2 + k]
                                tmp[((((j // 2) * 4 + i // 2) * 2 + i % 2) * 2 + j % 2) * 2 + k] = x
                    for i in range(4):
                        for j in range(bits):
                            word = 0
                            for p in range(per_word):
                                q = (p % group) * 2 + p // group
                                word |= tmp[i * 32 + j * per_word + q] << (bits * p)
                            out[z, by * 4 + i, 32 * bits * bx + lane * bits + j] = word
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def test_byte_map_matches_the_kernel_loops() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (2, 128, 64), dtype=torch.uint8, generator=g)
    got = repack_bytes(x, "w")
    assert got.shape == (2, 4, 512) and got.dtype == torch.int32
    assert torch.equal(got, _kernel_oracle(x, 8))
    assert torch.equal(unrepack_bytes(got, "w"), x)
    # the same transcription at 4 bits gives the MXFP4 map (tests/test_layout_humming.py checks that one)
    nib = torch.randint(0, 16, (1, 64, 128), dtype=torch.uint8, generator=g)
    assert torch.equal(repack_weights(nib[..., 0::2] | (nib[..., 1::2] << 4), "w"), _kernel_oracle(nib, 4))


def test_worked_example_word_zero() -> None:
    """Word (r, c) byte p holds (n, k) = (64bx + 8kk + ln, 16r + 8(p % 2) + 2lq + p // 2), c = 256bx + 32ln + 8lq + kk."""
    N, K = 128, 64
    n = torch.arange(N).view(1, N, 1).expand(1, N, K)
    k = torch.arange(K).view(1, 1, K).expand(1, N, K)
    words = repack_bytes((n * 2 + (k >= 32)).to(torch.uint8), "w").view(torch.uint8).view(1, K // 16, 4 * N, 4)
    ncode = repack_bytes(n.to(torch.uint8), "w").view(torch.uint8).view(1, K // 16, 4 * N, 4)
    kcode = repack_bytes(k.to(torch.uint8), "w").view(torch.uint8).view(1, K // 16, 4 * N, 4)
    assert ncode[0, 0, 0].tolist() == [0, 0, 0, 0] and kcode[0, 0, 0].tolist() == [0, 8, 1, 9]
    assert ncode[0, 0, 1].tolist() == [8] * 4 and ncode[0, 0, 32].tolist() == [1] * 4 and ncode[0, 0, 256].tolist() == [64] * 4
    assert kcode[0, 0, 8].tolist() == [2, 10, 3, 11] and kcode[0, 1, 0].tolist() == [16, 24, 17, 25]
    assert words.shape == (1, 4, 512, 4)


def _stack(order: str, H: int, I: int, bias: bool, E: int = 3) -> CanonicalExperts:
    g = torch.Generator().manual_seed(H * 7 + I)
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g)  # noqa: E731
    return CanonicalExperts(u8(E, 2 * I, H), u8(E, 2 * I, H // 32), u8(E, H, I), u8(E, H, I // 32),
                            torch.randn(E, 2 * I, generator=g) if bias else None,
                            torch.randn(E, H, generator=g) if bias else None, order, "mxfp8")  # fmt: skip


@pytest.mark.parametrize("order,H,I,bias", [("halves", 96, 64, False), ("interleaved", 160, 192, True),
                                            ("halves", 160, 96, True), ("interleaved", 96, 224, False)])  # fmt: skip
def test_round_trip_and_padding(order: str, H: int, I: int, bias: bool) -> None:
    layout = get_layout("humming")
    opts = layout.resolve_options()
    c = _stack(order, H, I, bias)
    assert layout.padded_sizes(H, I, order, "bf16", weight_format="mxfp8") == (H, I)  # vLLM pads MXFP8 experts nothing
    sizes = c.sizes(H, I)
    k = layout.to_kernel(c, "bf16", opts)
    specs = layout.kernel_specs(sizes, "bf16", opts)
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {n: (s.shape, s.dtype) for n, s in specs.items()}
    n13, k13 = -(-2 * I // 256) * 256, -(-H // 128) * 128
    assert k["w13_weight"].shape == (3, k13 // 16, 4 * n13) and k["w13_weight_scale"].shape == (3, k13 // 32, n13)
    back = layout.from_kernel(k, sizes, "bf16", opts)
    assert back.weight_format == "mxfp8"
    for f in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, f), getattr(c, f)), f
    if bias:
        assert torch.equal(back.w13_bias, c.w13_bias.to(torch.bfloat16))
    # humming's padding: zero values past K, scale byte 127 past N; another byte is named
    plain = unrepack_bytes(k["w2_weight"], "w2_weight")
    assert not bool(plain[:, :, I:].any())
    if H % 256:
        assert int(k["w2_weight_scale"].view(torch.uint8)[0, 0, -1]) == 127
    plain[1, 2, -1] = 0x38
    bad = dict(k, w2_weight=repack_bytes(plain, "w2_weight"))
    with pytest.raises(LayoutError, match=r"w2_weight at index \[1, 2, "):
        layout.from_kernel(bad, sizes, "bf16", opts)


@pytest.mark.parametrize("order", ["interleaved", "halves"])
def test_tp_slices_lay_out_each_rank(order: str) -> None:
    """Each TP rank's slice (I = 192 over 2 ranks: 96 each) is laid out on its own and comes back."""
    layout = get_layout("humming")
    opts = layout.resolve_options()
    c = _stack(order, 160, 192, True, E=2)
    for rank, (s, e) in enumerate(tp_ranges(192, 2)):
        part = slice_tp(c, s, e, rank)
        assert part.w13.shape == (2, 192, 160) and part.w2.shape == (2, 160, 96)
        back = layout.from_kernel(layout.to_kernel(part, "bf16", opts), part.sizes(160, 96), "bf16", opts)
        assert torch.equal(back.w13, part.w13) and torch.equal(back.w2_scale, part.w2_scale)


def test_describe_records_the_mxfp8_layer_configs() -> None:
    layout = get_layout("humming")
    c = _stack("halves", 192, 96, False)
    d = layout.describe(c.sizes(192, 96), "bf16", layout.resolve_options())
    assert d["variant"] == "mxfp8" and d["vllm_oracle"] == "Fp8MoeBackend" and d["intermediate_align"] == 1
    assert "four E4M3 bytes" in d["weight_dtype"]
    w13, w2 = d["layer_configs"]["w13"], d["layer_configs"]["w2"]
    assert w13["b_dtype"] == w2["b_dtype"] == "float8e4m3" and w13["bs_dtype"] == "float8e8m0"
    assert (w13["shape_n"], w13["pad_shape_n"], w13["shape_k"], w13["pad_shape_k"]) == (256, 64, 256, 64)
    assert (w2["shape_n"], w2["pad_shape_n"], w2["shape_k"], w2["pad_shape_k"]) == (256, 64, 128, 32)
    with pytest.raises(LayoutError, match="padded sizes"):
        layout.kernel_specs(c.sizes(192, 128), "bf16", layout.resolve_options())  # the MXFP4 padding is not this form's


# --- the CLI: an MXFP8 output and a bf16 source ---------------------------------------------------


@pytest.fixture(scope="module")
def q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized_mxfp8(tmp_path_factory.mktemp("hmx8"), 160, 192)


@pytest.mark.parametrize("tp", ["1", "2"])
def test_repack_of_an_mxfp8_output_verifies_bit_exact_and_damage_fails(q8: Path, tmp_path: Path, tp: str) -> None:
    m = repack_verify_and_damage(q8, tmp_path / "hum", "humming", tp, layer=1)
    assert m["served_vllm_backends"] == ["HUMMING"] and m["layout"]["padded_intermediate_size"] == 192 // int(tp)


def test_repack_of_a_bf16_source_with_format_mxfp8(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "src", "gpt-oss-bf16", ModelSizes(hidden_size=96, intermediate_size=64))
    out = tmp_path / "hum"
    code, _, err = mx("repack", tmp_path / "src", out, "--backend", "humming", "--format", "mxfp8", "--quiet", "--device", "cpu")
    assert code == 0, err
    m = json.loads((out / "mxconv.json").read_text())
    assert m["weight_format"] == "mxfp8" and m["scale_rounding"] == "rceil" and m["layout"]["w13_row_order"] == "interleaved"
    assert m["layout"]["activation_type"] == "binary_interleaved" and "w13_bias" in json.dumps(m["tensors"])
    code, text, err = mx("verify", out, "--reference", tmp_path / "src", "--device", "cpu")
    assert code == 0, text + err


def test_mxfp8_experts_are_refused_where_no_layout_takes_them(q8: Path, tmp_path: Path) -> None:
    code, _, err = mx("repack", q8, tmp_path / "t", "--backend", "cpu", "--quiet", "--device", "cpu")
    assert code == 2 and "experts are mxfp8" in err
    assert "backends that take mxfp8: trtllm, marlin, aiter, deepgemm, humming" in err
    code, _, err = mx("repack", q8, tmp_path / "t", "--backend", "humming", "--format", "mxfp4", "--quiet")
    assert code == 2 and "never re-quantizes them to MXFP4" in err


def test_inspect_engine_names_the_humming_output_for_an_mxfp8_checkpoint(q8: Path) -> None:
    code, text, err = mx("inspect", q8, "--engine", "vllm-0.33", "--gpu", "sm90", "--json")
    assert code == 0, err
    doc = json.loads(text)
    row = doc["engine"]["gpus"][0]["rows"][0]
    assert (row["form"], row["kind"], row["backend"]) == ("as is", "ct-mxfp8", "HUMMING")
    assert [h["output"] for h in row["held_by"]][0] == "repack --backend humming --activation bf16 --format mxfp8"
    assert row["held_by"][0]["refusal"] is None and row["engine_padding"] == [160, 192]
    hum = [b for b in doc["backends"] if b["backend"] == "humming"][0]
    assert hum["vllm_backends"] == ["HUMMING"] and hum["padded_intermediate_size"] == 192
