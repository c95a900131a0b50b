"""trtllm's MXFP8 x MXFP8 form (Fp8MoeBackend.FLASHINFER_TRTLLM, docs/layout-trtllm.md section 10): bytes
against vLLM 0.33's conversion replayed with FlashInfer's own CPU row helpers and its pure-torch reader of
128x4 scale buffers, round trips on padded odd sizes in both row orders and at TP 1 and 2, the padding
checks, the refusals, and the CLI (repack, verify passing and failing on planted damage, inspect)."""

from __future__ import annotations

import json

from pathlib import Path

import pytest
import torch
from support.cli import mx
from support.mxfp8_cli import engine_row_holders, quantized_mxfp8, repack_verify_and_damage, swapped_experts_fail

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts
from mxconv.experts.tp import slice_tp, tp_ranges
from mxconv.layouts import get_layout
from mxconv.layouts.trtllm_bytemap import check_kernel_tensors, swizzle_128x4, unswizzle_128x4

LAYOUT = get_layout("trtllm")
OPTS = LAYOUT.resolve_options()
SIZES = [(192, 96), (256, 128), (320, 160), (256, 224), (96, 32)]  # padded and unpadded, odd multiples of 32


def _stack(order: str, H: int, I: int, E: int = 3, seed: int = 0) -> CanonicalExperts:
    g = torch.Generator().manual_seed(seed + 7 * H + I)
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g)  # noqa: E731
    return CanonicalExperts(u8(E, 2 * I, H), u8(E, 2 * I, H // 32), u8(E, H, I), u8(E, H, I // 32),
                            row_order=order, weight_format="mxfp8")  # fmt: skip


def _as_halves(c: CanonicalExperts) -> dict[str, torch.Tensor]:
    """The tensors CompressedTensorsW8A8Mxfp8MoEMethod loads: w13 rows [gate; up] whatever mxconv's order."""
    def halves(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1) if c.row_order == "interleaved" else t

    return {"w13": halves(c.w13), "w13_scale": halves(c.w13_scale), "w2": c.w2, "w2_scale": c.w2_scale}


def _vllm_pad(p: dict[str, torch.Tensor], H: int, I: int) -> dict[str, torch.Tensor]:
    """align_mxfp8_moe_weights_for_fi_trtllm as its docstring states it: H to 256, I to 128, each w13 half
    on its own; weights 0, scales 127 in every padded place; nothing touched when nothing pads."""
    Hp, Ip = -(-H // 256) * 256, -(-I // 128) * 128
    if (Hp, Ip) == (H, I):
        return p
    E = p["w2"].shape[0]
    out = {"w13": torch.zeros(E, 2 * Ip, Hp, dtype=torch.uint8), "w13_scale": torch.full((E, 2 * Ip, Hp // 32), 127, dtype=torch.uint8),
           "w2": torch.zeros(E, Hp, Ip, dtype=torch.uint8), "w2_scale": torch.full((E, Hp, Ip // 32), 127, dtype=torch.uint8)}  # fmt: skip
    for half in range(2):
        out["w13"][:, half * Ip : half * Ip + I, :H] = p["w13"][:, half * I : (half + 1) * I]
        out["w13_scale"][:, half * Ip : half * Ip + I, : H // 32] = p["w13_scale"][:, half * I : (half + 1) * I]
    out["w2"][:, :H, :I] = p["w2"]
    out["w2_scale"][:, :H, : I // 32] = p["w2_scale"]
    return out


def _fi() -> tuple:  # noqa: ANN202 - FlashInfer's functions
    try:
        from flashinfer.fused_moe.core import get_reorder_rows_for_gated_act_gemm_row_indices
        from flashinfer.trace.templates.gemm import _unswizzle_batched_sf_128x4
        from flashinfer.utils import get_shuffle_matrix_a_row_indices
    except Exception as exc:  # noqa: BLE001 - any import failure means "oracle unavailable"
        pytest.skip(f"flashinfer not importable on this machine: {exc}")
    return get_reorder_rows_for_gated_act_gemm_row_indices, get_shuffle_matrix_a_row_indices, _unswizzle_batched_sf_128x4


def fi_block_scale_interleave(s: torch.Tensor) -> torch.Tensor:
    """block_scale_interleave's bytes for [E, R, C] (R % 128 == 0, C % 4 == 0) on CPU: the inverse of
    FlashInfer's own pure-torch reader of 128x4 buffers (the CUDA op itself needs a GPU)."""
    E, R, C = s.shape
    slot_of = _fi()[2](torch.arange(E * R * C), E, R, C)
    out = torch.empty(E * R * C, dtype=s.dtype)
    out[slot_of.flatten()] = s.flatten()
    return out.reshape(E, R, C)


def vllm_trtllm_mxfp8(c: CanonicalExperts, interleave=fi_block_scale_interleave) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """prepare_fp8_moe_layer_for_fi(is_trtllm=True) on MXFP8 tensors, replayed step by step with FlashInfer's
    helpers the way vLLM 0.33 calls them (_shuffle_mxfp8_moe_weights, epilogue_tile_m 128)."""
    reorder_rows, shuffle_rows, _ = _fi()
    p = _vllm_pad(_as_halves(c), c.hidden_size, c.intermediate_size)
    w13, s13 = (torch.cat([t[:, t.shape[1] // 2 :], t[:, : t.shape[1] // 2]], dim=1) for t in (p["w13"], p["w13_scale"]))
    gate_up = reorder_rows(w13[0].reshape(w13.shape[1], -1))
    w13, s13 = w13[:, gate_up], s13[:, gate_up]
    out = {}
    for name, w, s in (("w13", w13, s13), ("w2", p["w2"], p["w2_scale"])):
        idx = shuffle_rows(w[0], 128)
        out[f"{name}_weight"] = w[:, idx].view(torch.float8_e4m3fn)
        sidx = shuffle_rows(s[0].reshape(s.shape[1], -1), 128)
        out[f"{name}_weight_scale"] = interleave(s[:, sidx].to(s.device)).reshape(s.shape)
    return out


@pytest.mark.parametrize("order", ["halves", "interleaved"])
@pytest.mark.parametrize("H,I", SIZES)
def test_bytes_equal_vllms_conversion_with_flashinfers_helpers(order: str, H: int, I: int) -> None:
    c = _stack(order, H, I)
    got, want = LAYOUT.to_kernel(c, "mxfp8", OPTS), vllm_trtllm_mxfp8(c)
    assert list(got) == ["w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"]
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def test_scale_padding_is_e8m0_one_and_weights_zero() -> None:
    c = _stack("halves", 192, 96)
    k = LAYOUT.to_kernel(c, "mxfp8", OPTS)
    s13 = unswizzle_128x4(k["w13_weight_scale"].reshape(3, -1), 256, 8)
    # kernel row 2i = up_i, 2i+1 = gate_i before the 32-row shuffle; rows of i >= 96 and columns >= 6 pad
    real = {r for r in range(256) if (r // 32) * 32 + (r % 8) * 4 + (r % 32) // 8 < 192}
    for r in range(256):
        cols = s13[:, r, :6] if r in real else s13[:, r]
        assert bool((s13[:, r, 6:] == 0x7F).all()) and (r in real or bool((cols == 0x7F).all()))
    w13 = k["w13_weight"].view(torch.uint8)
    assert not bool(w13[:, :, 192:].any()) and not bool(k["w2_weight"].view(torch.uint8)[:, 192:].any())


@pytest.mark.parametrize("order", ["halves", "interleaved"])
@pytest.mark.parametrize("H,I", SIZES)
def test_round_trip_and_sizes(order: str, H: int, I: int) -> None:
    c, Hp, Ip = _stack(order, H, I), -(-H // 256) * 256, -(-I // 128) * 128
    assert LAYOUT.padded_sizes(H, I, order, "mxfp8", OPTS, weight_format="mxfp8") == (H, I)
    sizes, k = c.sizes(H, I), LAYOUT.to_kernel(c, "mxfp8", OPTS)
    check_kernel_tensors(k, LAYOUT.kernel_specs(sizes, "mxfp8", OPTS))  # names, shapes, dtypes, one device
    assert k["w13_weight"].shape == (3, 2 * Ip, Hp) and k["w2_weight_scale"].shape == (3, Hp, Ip // 32)
    back = LAYOUT.from_kernel(k, sizes, "mxfp8", OPTS)
    assert back.weight_format == "mxfp8" and back.row_order == order
    for f in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, f), getattr(c, f)), f


def test_both_row_orders_give_the_same_bytes() -> None:
    c = _stack("halves", 320, 160)
    inter = CanonicalExperts(torch.stack([c.w13[:, :160], c.w13[:, 160:]], 2).reshape(c.w13.shape),
                             torch.stack([c.w13_scale[:, :160], c.w13_scale[:, 160:]], 2).reshape(c.w13_scale.shape),
                             c.w2, c.w2_scale, row_order="interleaved", weight_format="mxfp8")  # fmt: skip
    a, b = LAYOUT.to_kernel(c, "mxfp8", OPTS), LAYOUT.to_kernel(inter, "mxfp8", OPTS)
    assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


@pytest.mark.parametrize("order", ["halves", "interleaved"])
def test_tp_slices(order: str) -> None:
    c = _stack(order, 192, 192, E=2)
    for rank, (s, e) in enumerate(tp_ranges(192, 2)):
        part = slice_tp(c, s, e, rank)
        k = LAYOUT.to_kernel(part, "mxfp8", OPTS)
        assert torch.equal(k["w2_weight"].view(torch.uint8), vllm_trtllm_mxfp8(part)["w2_weight"].view(torch.uint8))
        back = LAYOUT.from_kernel(k, part.sizes(192, 96), "mxfp8", OPTS)
        assert torch.equal(back.w13, part.w13) and torch.equal(back.w2_scale, part.w2_scale)


def test_from_kernel_names_a_padding_byte_that_is_not_its_fill() -> None:
    c = _stack("halves", 192, 96)
    sizes, k = c.sizes(192, 96), LAYOUT.to_kernel(c, "mxfp8", OPTS)
    w2 = k["w2_weight"].clone()
    w2.view(torch.uint8)[1, :, 100] = 0  # column 100 >= I is padding; make one row of it nonzero
    w2.view(torch.uint8)[1, 0, 100] = 0x38
    with pytest.raises(LayoutError, match=r"padding of w2_weight at index \[1, \d+, 100\] holds 56, expected 0"):
        LAYOUT.from_kernel(dict(k, w2_weight=w2), sizes, "mxfp8", OPTS)
    s2 = unswizzle_128x4(k["w2_weight_scale"].reshape(3, -1), 256, 4)
    s2[2, 5, 3] = 0x00  # column 3 >= I/32: vLLM fills it with 127
    bad = swizzle_128x4(s2).reshape(3, 256, 4)
    with pytest.raises(LayoutError, match=r"padding of w2_weight_scale at index \[2, \d+, 3\] holds 0, expected 127"):
        LAYOUT.from_kernel(dict(k, w2_weight_scale=bad), sizes, "mxfp8", OPTS)
    with pytest.raises(LayoutError, match="w13_weight_scale has dtype torch.float8_e4m3fn, expected torch.uint8"):
        LAYOUT.from_kernel(dict(k, w13_weight_scale=k["w13_weight_scale"].view(torch.float8_e4m3fn)), sizes, "mxfp8", OPTS)


def test_refusals_name_vllms_rule() -> None:
    with pytest.raises(LayoutError, match="MXFP8 activations only"):
        LAYOUT.padded_sizes(256, 128, "halves", "bf16", OPTS, weight_format="mxfp8")
    with pytest.raises(LayoutError, match="intermediate_align 256 is not vLLM 0.33's 128"):
        LAYOUT.padded_sizes(256, 128, "halves", "mxfp8", LAYOUT.resolve_options({"intermediate_align": 256}),
                            weight_format="mxfp8")  # fmt: skip
    with pytest.raises(LayoutError, match="intermediate size 48 must be a positive multiple of 32"):
        LAYOUT.padded_sizes(256, 48, "halves", "mxfp8", OPTS, weight_format="mxfp8")
    c = _stack("halves", 256, 128)
    with pytest.raises(LayoutError, match="padded sizes must equal"):
        LAYOUT.kernel_specs(c.sizes(256, 128).__class__(3, 256, 128, 256, 256, "halves", False, "mxfp8"), "mxfp8", OPTS)
    biased = CanonicalExperts(c.w13, c.w13_scale, c.w2, c.w2_scale, torch.zeros(3, 256), torch.zeros(3, 256),
                              "halves", "mxfp8")  # fmt: skip
    with pytest.raises(LayoutError, match="takes no expert biases"):
        LAYOUT.kernel_specs(biased.sizes(256, 128), "mxfp8", OPTS)


def test_describe_and_declared_backends() -> None:
    d = LAYOUT.describe(_stack("halves", 192, 96).sizes(192, 96), "mxfp8", OPTS)
    assert (d["variant"], d["vllm_oracle"], d["vllm_moe_backend"]) == ("mxfp8", "Fp8MoeBackend", "FLASHINFER_TRTLLM")
    assert d["padding"] == {"kernel_hidden_size": 256, "kernel_intermediate_size": 128} and d["scale_fill"] == 0x7F
    assert "mxfp8" in LAYOUT.weight_formats and LAYOUT.vllm_mxfp8_backends == {"mxfp8": ("FLASHINFER_TRTLLM",)}


# --- the CLI --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized_mxfp8(tmp_path_factory.mktemp("tmx8"), 192, 192)


@pytest.mark.parametrize("tp", ["1", "2"])
def test_repack_verifies_bit_exact_and_a_flipped_scale_byte_fails(q8: Path, tmp_path: Path, tp: str) -> None:
    m = repack_verify_and_damage(q8, tmp_path / "trt", "trtllm", tp, 0, "--activation", "mxfp8")
    assert m["served_vllm_backends"] == ["FLASHINFER_TRTLLM"]
    assert m["served_vllm_methods"] == {"CompressedTensorsW8A8Mxfp8MoEMethod": ["FLASHINFER_TRTLLM"]}
    assert m["layout"]["vllm_moe_backend"] == "FLASHINFER_TRTLLM"
    assert m["layout"]["padding"] == {"kernel_hidden_size": 256, "kernel_intermediate_size": 256 if tp == "1" else 128}


def test_swapped_experts_fail_verify(q8: Path, tmp_path: Path) -> None:
    swapped_experts_fail(q8, tmp_path / "trt", "trtllm", "model.layers.1.mlp.experts.w2_weight", "--activation", "mxfp8")


def test_bf16_activations_are_refused_naming_the_rule(q8: Path, tmp_path: Path) -> None:
    code, _, err = mx("repack", q8, tmp_path / "o", "--backend", "trtllm", "--activation", "bf16", "--quiet", "--device", "cpu")
    assert code == 2 and "MXFP8 activations only" in err and "pass --activation mxfp8" in err


def test_mxfp8_experts_default_to_mxfp8_activations(q8: Path, tmp_path: Path) -> None:
    """No --activation: the backend's first activation that takes the experts' format (trtllm MXFP8: mxfp8)."""
    code, _, err = mx("repack", q8, tmp_path / "o", "--backend", "trtllm", "--quiet", "--device", "cpu")
    assert code == 0, err
    m = json.loads((tmp_path / "o" / "mxconv.json").read_text())
    assert m["activation"] == "mxfp8" and m["weight_format"] == "mxfp8"


def test_inspect_engine_sm100_names_the_trtllm_output(q8: Path) -> None:
    assert engine_row_holders(q8, "sm100") == ("ct-mxfp8", "FLASHINFER_TRTLLM",
                                               [("repack --backend trtllm --activation mxfp8 --format mxfp8", None)])
