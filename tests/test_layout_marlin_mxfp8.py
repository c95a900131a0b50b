"""``--backend marlin`` with MXFP8 experts on CPU (vLLM's Fp8MoeBackend.MARLIN,
``prepare_mxfp8_moe_layer_for_marlin``): the 8-bit weight stream against a scalar oracle written from
Marlin's repack rules (16 x 64 tiles of four 16 x 16 blocks, 32 thread lanes, four k a word in the
order 0, 2, 1, 3), the scales against their permutation lists, vLLM's per-half padding of I to 64,
round trips in both row orders and TP slices, the refusals, and the CLI (repack + verify bit-exact,
a flipped scale byte caught). tests/test_engines_gpu.py runs vLLM's Marlin MoE GEMM on the files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.cli import mx
from support.mxfp8_cli import engine_row_holders, quantized_mxfp8, repack_verify_and_damage

from mxconv.errors import LayoutError
from mxconv.examples import ModelSizes, make_checkpoint
from mxconv.experts.stack import CanonicalExperts
from mxconv.experts.tp import slice_tp, tp_ranges
from mxconv.layouts import get_layout
from mxconv.layouts.marlin_mxfp8 import repack_bytes, unrepack_bytes

LAYOUT = get_layout("marlin")
OPTS = LAYOUT.resolve_options()


def _oracle(q: torch.Tensor) -> torch.Tensor:
    """One expert's uint8 Q[N, K] -> int32 [K/16, 4N], scalar: tile (kt, nt) of 16 k x 64 n is four
    16 x 16 blocks b; lane t (0..31) of block b with row group g (0, 1) holds the four k
    2(t % 4) + (0, 1, 8, 9) of column 16b + 8g + t // 4, stored in the byte order 0, 2, 1, 3."""
    N, K = q.shape
    out = torch.zeros(K // 16, 16 * N, dtype=torch.uint8)
    pos = 0
    for kt in range(K // 16):
        pos = 0
        for nt in range(N // 64):
            for t in range(32):
                for b in range(4):
                    for g in range(2):
                        ks = [2 * (t % 4), 2 * (t % 4) + 1, 2 * (t % 4) + 8, 2 * (t % 4) + 9]
                        for r in (0, 2, 1, 3):
                            out[kt, pos] = q[64 * nt + 16 * b + 8 * g + t // 4, 16 * kt + ks[r]]
                            pos += 1
    return out.view(torch.int32)


def test_weight_stream_matches_the_repack_rules() -> None:
    g = torch.Generator().manual_seed(11)
    q = torch.randint(0, 256, (2, 128, 48), dtype=torch.uint8, generator=g)
    got = repack_bytes(q, "w")
    assert got.shape == (2, 3, 512) and got.dtype == torch.int32
    for e in range(2):
        assert torch.equal(got[e], _oracle(q[e]))
    assert torch.equal(unrepack_bytes(got, "w"), q)
    with pytest.raises(LayoutError, match="N % 64 == 0"):
        repack_bytes(q[:, :96], "w2_weight")


def test_worked_example_of_the_docs() -> None:
    """layout-marlin.md §13: word 32 thc + 8 thr + 2 j + blk, byte p holds k = 2 thr + 8 (p % 2) + p // 2,
    n = 16 j + 8 blk + thc."""
    n = torch.arange(64).view(1, 64, 1).expand(1, 64, 16)
    k = torch.arange(16).view(1, 1, 16).expand(1, 64, 16)
    nb = repack_bytes(n.to(torch.uint8)).view(torch.uint8).view(256, 4)
    kb = repack_bytes(k.to(torch.uint8)).view(torch.uint8).view(256, 4)
    assert kb[0].tolist() == [0, 8, 1, 9] and nb[0].tolist() == [0] * 4
    assert nb[1].tolist() == [8] * 4 and nb[2].tolist() == [16] * 4 and nb[32].tolist() == [1] * 4
    assert kb[8].tolist() == [2, 10, 3, 11]


def test_scales_are_the_16_bit_marlin_permutation() -> None:
    """Transposed to [K/32, N], each 64-chunk 8x8-transposed (marlin_permute_scales), then every run
    of four bytes a b c d -> a c b d (mxfp8_marlin_process_scales)."""
    E, I, H = 1, 64, 64
    s13 = torch.arange(2 * I * H // 32, dtype=torch.int64).view(1, 2 * I, H // 32) % 251
    c = CanonicalExperts(torch.zeros(E, 2 * I, H, dtype=torch.uint8), s13.to(torch.uint8),
                         torch.zeros(E, H, I, dtype=torch.uint8), torch.zeros(E, H, I // 32, dtype=torch.uint8),
                         row_order="halves", weight_format="mxfp8")  # fmt: skip
    got = LAYOUT.to_kernel(c, "bf16", OPTS)["w13_weight_scale"].view(torch.uint8)[0]
    g_n = s13[0].t()
    perm = [i + 8 * j for i in range(8) for j in range(8)]
    stepped = g_n.reshape(-1, 64)[:, perm].reshape(g_n.shape)
    want = stepped.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(g_n.shape)
    assert torch.equal(got.long(), want)


def _stack(order: str, H: int, I: int, E: int = 3, seed: int = 0) -> CanonicalExperts:
    g = torch.Generator().manual_seed(seed + H + I)
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g)  # noqa: E731
    return CanonicalExperts(u8(E, 2 * I, H), u8(E, 2 * I, H // 32), u8(E, H, I), u8(E, H, I // 32),
                            row_order=order, weight_format="mxfp8")  # fmt: skip


@pytest.mark.parametrize("order,H,I", [("halves", 192, 96), ("halves", 320, 160), ("halves", 64, 64),
                                       ("interleaved", 128, 192), ("interleaved", 192, 64)])  # fmt: skip
def test_round_trip_and_vllms_padding(order: str, H: int, I: int) -> None:
    c = _stack(order, H, I)
    assert LAYOUT.padded_sizes(H, I, order, "bf16", OPTS, weight_format="mxfp8") == (H, I)
    sizes = c.sizes(H, I)
    k = LAYOUT.to_kernel(c, "bf16", OPTS)
    specs = LAYOUT.kernel_specs(sizes, "bf16", OPTS)
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {n: (s.shape, s.dtype) for n, s in specs.items()}
    Ip = -(-I // 64) * 64
    assert k["w13_weight"].shape == (3, H // 16, 8 * Ip) and k["w2_weight"].shape == (3, Ip // 16, 4 * H)
    # vLLM's _moe_pad_shard_rows: gate rows [0, I), zeros to Ip, up rows from Ip
    plain13 = unrepack_bytes(k["w13_weight"], "w13_weight")
    assert torch.equal(plain13[:, :I], c.w13[:, :I]) and torch.equal(plain13[:, Ip : Ip + I], c.w13[:, I:])
    assert not bool(plain13[:, I:Ip].any())
    back = LAYOUT.from_kernel(k, sizes, "bf16", OPTS)
    assert back.weight_format == "mxfp8"
    for f in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, f), getattr(c, f)), f
    if Ip != I:  # a padding byte that is not zero is named
        plain13[1, I, 3] = 0x38
        with pytest.raises(LayoutError, match=rf"w13_weight at index \[1, {I}, 3\]"):
            LAYOUT.from_kernel(dict(k, w13_weight=repack_bytes(plain13, "w13_weight")), sizes, "bf16", OPTS)


@pytest.mark.parametrize("order", ["halves", "interleaved"])
def test_tp_slices(order: str) -> None:
    c = _stack(order, 128, 256, E=2)
    for rank, (s, e) in enumerate(tp_ranges(256, 2)):
        part = slice_tp(c, s, e, rank)
        back = LAYOUT.from_kernel(LAYOUT.to_kernel(part, "bf16", OPTS), part.sizes(128, 128), "bf16", OPTS)
        assert torch.equal(back.w13, part.w13) and torch.equal(back.w2_scale, part.w2_scale)


def test_refusals_name_vllms_rule() -> None:
    with pytest.raises(LayoutError, match="hidden size 160 is not a multiple of 64"):
        LAYOUT.padded_sizes(160, 64, "halves", "bf16", OPTS, weight_format="mxfp8")
    with pytest.raises(LayoutError, match="splits gate/up pairs"):
        LAYOUT.padded_sizes(128, 96, "interleaved", "bf16", OPTS, weight_format="mxfp8")
    with pytest.raises(LayoutError, match="bf16 activations"):
        LAYOUT.padded_sizes(128, 64, "halves", "fp8", OPTS, weight_format="mxfp8")
    legacy = LAYOUT.resolve_options({"marlin_scale_layout": "legacy"})
    with pytest.raises(LayoutError, match="current scale layout"):
        LAYOUT.padded_sizes(128, 64, "halves", "bf16", legacy, weight_format="mxfp8")
    biased = _stack("halves", 128, 64)
    with pytest.raises(LayoutError, match="no expert biases"):
        LAYOUT.kernel_specs(CanonicalExperts(biased.w13, biased.w13_scale, biased.w2, biased.w2_scale,
                                             torch.zeros(3, 128), torch.zeros(3, 128), "halves", "mxfp8").sizes(128, 64),
                            "bf16", OPTS)  # fmt: skip


def test_describe() -> None:
    d = LAYOUT.describe(_stack("halves", 192, 96).sizes(192, 96), "bf16", OPTS)
    assert d["variant"] == "mxfp8" and d["vllm_oracle"] == "Fp8MoeBackend" and d["weight_bits"] == 8
    assert d["padding"] == {"hidden_multiple": 1, "intermediate_multiple": 64, "marlin_intermediate_size": 128}


# --- the CLI --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized_mxfp8(tmp_path_factory.mktemp("mmx8"), 192, 192)


@pytest.mark.parametrize("tp", ["1", "2"])
def test_repack_verifies_bit_exact_and_a_flipped_scale_byte_fails(q8: Path, tmp_path: Path, tp: str) -> None:
    m = repack_verify_and_damage(q8, tmp_path / "marlin", "marlin", tp, layer=0)
    assert m["served_vllm_backends"] == ["MARLIN"]
    assert m["layout"]["padding"]["marlin_intermediate_size"] == (192 if tp == "1" else 128)


def test_a_model_with_expert_biases_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "src", "gpt-oss-bf16", ModelSizes(hidden_size=128, intermediate_size=64))
    code, _, err = mx("repack", tmp_path / "src", tmp_path / "o", "--backend", "marlin", "--format", "mxfp8", "--quiet")
    assert code == 2 and "marlin MXFP8 takes no expert biases" in err


def test_inspect_engine_sm120_names_the_marlin_output(q8: Path) -> None:
    assert engine_row_holders(q8, "sm120") == ("ct-mxfp8", "MARLIN", [("repack --backend marlin --activation bf16 --format mxfp8", None)])
