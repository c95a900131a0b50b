"""``--backend deepgemm`` with MXFP8 experts (vLLM 0.33's Fp8MoeBackend.DEEPGEMM on SM100,
``prepare_fp8_moe_layer_for_deepgemm``): the e4m3 bytes as loaded, the scales against an element-by-element
model of the byte -> float32 -> packed UE8M0 chain (DeepGEMM's pack reads K blocks past K/32 as 0; DeepGEMM
runs on CUDA only), odd sizes (K/32 not a multiple of 4), both row orders, TP slices, the refusals and the
CLI (repack + verify bit-exact; a flipped scale byte and swapped experts caught)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.mxfp8_cli import quantized_mxfp8, repack_verify_and_damage, swapped_experts_fail, unpadded_round_trips

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts
from mxconv.layouts import get_layout
from mxconv.layouts.engine_report import holders
from mxconv.layouts.vllm_backends import home_platform, vllm_refusal
from mxconv.layouts.vllm_serving import VllmMethod

LAYOUT = get_layout("deepgemm")
OPTS = LAYOUT.resolve_options()


def _stack(order: str, H: int, I: int, E: int = 3, seed: int = 0) -> CanonicalExperts:
    g = torch.Generator().manual_seed(seed + H + I)
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g)  # noqa: E731
    c = CanonicalExperts(u8(E, 2 * I, H), u8(E, 2 * I, H // 32), u8(E, H, I), u8(E, H, I // 32),
                         row_order=order, weight_format="mxfp8")  # fmt: skip
    c.w13_scale[0, 0, :2] = torch.tensor([0, 255], dtype=torch.uint8)  # E8M0 2^-127 and NaN survive the float32 trip
    return c


def _words_model(s: torch.Tensor) -> list[int]:
    """One expert's uint8 [N, C] -> the int32 storage of DeepGEMM's MN-major packed tensor, word (j, n) at
    j * N + n: each byte to float32 bits (byte << 23, _upcast_e8m0_to_fp32), blocks 4j..4j+3 (0 past C), packed
    b0 >> 23 | b1 >> 15 | b2 >> 7 | b3 << 1 (transpose_and_pack_fp32_into_ue8m0), as signed int32."""
    N, C = s.shape
    out = []
    for j in range(-(-C // 4)):
        for n in range(N):
            bits = [(int(s[n, 4 * j + q]) if 4 * j + q < C else 0) << 23 for q in range(4)]
            w = (bits[0] >> 23) | (bits[1] >> 15) | (bits[2] >> 7) | ((bits[3] << 1) & 0xFFFFFFFF)
            out.append(w - (1 << 32) if w >= 1 << 31 else w)
    return out


@pytest.mark.parametrize("order,H,I", [("halves", 96, 160), ("interleaved", 128, 64), ("halves", 224, 32)])
def test_bytes_match_the_load_time_chain(order: str, H: int, I: int) -> None:
    c = _stack(order, H, I)
    k = LAYOUT.to_kernel(c, "fp8", OPTS)
    specs = LAYOUT.kernel_specs(c.sizes(H, I), "fp8", OPTS)
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {n: (s.shape, s.dtype) for n, s in specs.items()}
    assert k["w13_weight_scale"].shape == (3, -(-H // 128), 2 * I) and k["w2_weight_scale"].shape == (3, -(-I // 128), H)
    assert torch.equal(k["w13_weight"].view(torch.uint8), c.w13) and torch.equal(k["w2_weight"].view(torch.uint8), c.w2)
    for e in range(3):
        assert k["w13_weight_scale"][e].reshape(-1).tolist() == _words_model(c.w13_scale[e])
        assert k["w2_weight_scale"][e].reshape(-1).tolist() == _words_model(c.w2_scale[e])
    engine = k["w13_weight_scale"].transpose(1, 2)  # what vLLM holds: [E, N, ceil(K/128)], MN-major
    assert engine.stride() == (2 * I * -(-H // 128), 1, 2 * I)


@pytest.mark.parametrize("order", ["halves", "interleaved"])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_both_orders_and_tp(order: str, tp: int) -> None:
    assert len(unpadded_round_trips(LAYOUT, "fp8", _stack(order, 96, 192), tp)) == tp


def test_bytes_past_k_are_checked_and_refusals() -> None:
    c = _stack("halves", 96, 64)
    k = LAYOUT.to_kernel(c, "fp8", OPTS)
    words = k["w13_weight_scale"].clone()
    words.view(torch.uint8)[1, 0, 4 * 5 + 3] = 1  # expert 1, row 5, block 3 (H/32 = 3: past K)
    with pytest.raises(LayoutError, match=r"w13_weight_scale at index \[1, 5, 3\]"):
        LAYOUT.from_kernel(dict(k, w13_weight_scale=words), c.sizes(96, 64), "fp8", OPTS)
    with pytest.raises(LayoutError, match="DeepGemmExperts run MXFP8 activations"):
        LAYOUT.padded_sizes(96, 64, "halves", "bf16", OPTS, weight_format="mxfp8")
    biased = CanonicalExperts(c.w13, c.w13_scale, c.w2, c.w2_scale, torch.zeros(3, 128), torch.zeros(3, 96), "halves", "mxfp8")
    with pytest.raises(LayoutError, match="deepgemm MXFP8 takes no expert biases"):
        LAYOUT.kernel_specs(biased.sizes(96, 64), "fp8", OPTS)


def test_describe_and_engine_data() -> None:
    d = LAYOUT.describe(_stack("halves", 96, 64).sizes(96, 64), "fp8", OPTS)
    assert (d["variant"], d["vllm_oracle"], d["vllm_moe_backend"]) == ("mxfp8", "Fp8MoeBackend", "DEEPGEMM")
    assert LAYOUT.vllm_mxfp8_backends == {"fp8": ("DEEPGEMM",)}
    assert [h["output"] for h in holders("DEEPGEMM", VllmMethod.CT_MXFP8)] == ["repack --backend deepgemm --activation fp8 --format mxfp8"]
    assert home_platform("DEEPGEMM") is not None and not home_platform("DEEPGEMM").is_rocm
    model = {"activation": "silu", "has_expert_bias": False}
    assert vllm_refusal("DEEPGEMM", (96, 64, 96, 64), model, None, False, "gfx950") == "DEEPGEMM runs on CUDA only; these bytes are for gfx950"


# --- the CLI --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized_mxfp8(tmp_path_factory.mktemp("dmx8"), 96, 192)


@pytest.mark.parametrize("tp", ["1", "2"])
def test_repack_verifies_bit_exact_and_a_flipped_scale_byte_fails(q8: Path, tmp_path: Path, tp: str) -> None:
    m = repack_verify_and_damage(q8, tmp_path / "dg", "deepgemm", tp, layer=0)
    assert m["served_vllm_backends"] == ["DEEPGEMM"] and m["layout"]["vllm_moe_backend"] == "DEEPGEMM"
    assert m["quant_config"]["activation_quant"]["scheme"] == "dynamic_mxfp8"


def test_swapped_experts_fail_verify(q8: Path, tmp_path: Path) -> None:
    swapped_experts_fail(q8, tmp_path / "dg", "deepgemm", "model.layers.0.mlp.experts.w13_weight")
