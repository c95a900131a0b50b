"""``--backend aiter`` with MXFP8 experts (vLLM 0.33's Fp8MoeBackend.AITER_MXFP8, ``shuffle_mxfp8_moe_weights``):
every byte against a scalar oracle written from aiter's ``shuffle_weight(is_guinterleave=True, gate_up=...)`` and
``shuffle_scale`` views (aiter does not import without ROCm, so its function cannot run here), odd sizes (scale
columns and e8m0_shuffle rows padded), both w13 row orders, TP slices, the refusals, the padding checks, and
the CLI (repack + verify bit-exact; a flipped scale byte and swapped experts caught)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.cli import mx
from support.mxfp8_cli import quantized_mxfp8, repack_verify_and_damage, swapped_experts_fail

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts
from mxconv.experts.tp import slice_tp, tp_ranges
from mxconv.layouts import get_layout
from mxconv.layouts.engine_report import holders
from mxconv.layouts.vllm_serving import VllmMethod

LAYOUT = get_layout("aiter")
OPTS = LAYOUT.resolve_options()


def _stack(order: str, H: int, I: int, E: int = 3, seed: int = 0) -> CanonicalExperts:
    g = torch.Generator().manual_seed(seed + H + I)
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g)  # noqa: E731
    return CanonicalExperts(u8(E, 2 * I, H), u8(E, 2 * I, H // 32), u8(E, H, I), u8(E, H, I // 32),
                            row_order=order, weight_format="mxfp8")  # fmt: skip


def _weight_oracle(w: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """shuffle_weight(w, (16, 16), is_guinterleave=True, gate_up): per expert, view rows as (half, N0, NLane 16)
    when gate_up else (N0, NLane), K bytes as (K0, KLane 4, KPack 16), store (N0, half, K0, KLane, NLane, KPack)."""
    E, N, K = w.shape
    half_rows = N // 2 if gate_up else N
    out = torch.zeros(E * N * K, dtype=torch.uint8)
    src = w.reshape(-1).tolist()
    for e in range(E):
        for r in range(N):
            p, n0, lane = (r // half_rows, (r % half_rows) // 16, r % 16)
            for k in range(K):
                k0, kl, kp = k // 64, (k % 64) // 16, k % 16
                halves = 2 if gate_up else 1
                d = ((((n0 * halves + p) * (K // 64) + k0) * 4 + kl) * 16 + lane) * 16 + kp
                out[e * N * K + d] = src[(e * N + r) * K + k]
    return out.view(E, N, K)


def _w13_scale_oracle(s: torch.Tensor) -> torch.Tensor:
    """shuffle_scale(s.reshape(E*2I, C), E, is_guinterleave=True, gate_up=True): columns padded to Cp (0x7F),
    per expert rows (half, N1, NLane 16), columns (K1, KPack 2, KLane 4), stored (N1, K1, KLane, NLane, KPack, half)."""
    E, N, C = s.shape
    Cp, I = -(-C // 8) * 8, N // 2
    out = torch.full((E * N * Cp,), 0x7F, dtype=torch.uint8)
    for e in range(E):
        for r in range(N):
            p, n1, lane = r // I, (r % I) // 16, r % 16
            for q in range(C):
                k1, kpack, klane = q // 8, (q % 8) // 4, q % 4
                d = ((((n1 * (Cp // 8) + k1) * 4 + klane) * 16 + lane) * 2 + kpack) * 2 + p
                out[e * N * Cp + d] = int(s[e, r, q])
    return out.view(E * N, Cp)


def _w2_scale_oracle(s: torch.Tensor) -> torch.Tensor:
    """shuffle_scale(s.reshape(E*H, C)) (e8m0_shuffle): the 2-D matrix padded to [roundup(E*H, 256),
    roundup(C, 8)] (mxconv's fill 0x7F), rows (tile, b, c), columns (tile, f, g), stored (tile, tile, g, c, f, b)."""
    flat = s.reshape(-1, s.shape[-1])
    M, C = flat.shape
    Mp, Cp = -(-M // 256) * 256, -(-C // 8) * 8
    out = torch.full((Mp * Cp,), 0x7F, dtype=torch.uint8)
    for r in range(M):
        a, b, c = r // 32, (r % 32) // 16, r % 16
        for q in range(C):
            t, f, g = q // 8, (q % 8) // 4, q % 4
            out[((((a * (Cp // 8) + t) * 4 + g) * 16 + c) * 2 + f) * 2 + b] = int(flat[r, q])
    return out.view(Mp, Cp)


@pytest.mark.parametrize("order,H,I,E", [("halves", 192, 64, 3), ("interleaved", 128, 128, 2), ("halves", 256, 64, 4)])
def test_bytes_match_aiters_shuffle(order: str, H: int, I: int, E: int) -> None:
    c = _stack(order, H, I, E)
    k = LAYOUT.to_kernel(c, "bf16", OPTS)
    specs = LAYOUT.kernel_specs(c.sizes(H, I), "bf16", OPTS)
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {n: (s.shape, s.dtype) for n, s in specs.items()}
    assert k["w13_weight"].dtype == torch.float8_e4m3fn and k["w13_weight_scale"].shape == (E * 2 * I, -(-H // 256) * 8)
    assert torch.equal(k["w13_weight"].view(torch.uint8), _weight_oracle(c.w13, gate_up=True))
    assert torch.equal(k["w2_weight"].view(torch.uint8), _weight_oracle(c.w2, gate_up=False))
    assert torch.equal(k["w13_weight_scale"], _w13_scale_oracle(c.w13_scale))
    assert torch.equal(k["w2_weight_scale"], _w2_scale_oracle(c.w2_scale))


def test_worked_example() -> None:
    """docs/layout-aiter.md §8: w13 byte 16 is row 1 (gate), byte 1024 (I = 32... here I = 64: 16 rows x 64 bytes)
    the first up row, w13 scale byte 1 the first up row's block 0."""
    I, H = 64, 64
    rows = torch.arange(2 * I).view(1, 2 * I, 1).expand(1, 2 * I, H).to(torch.uint8)
    s = torch.arange(2 * I).view(1, 2 * I, 1).expand(1, 2 * I, 2).to(torch.uint8)
    c = CanonicalExperts(rows.contiguous(), s.contiguous(), torch.zeros(1, H, I, dtype=torch.uint8),
                         torch.zeros(1, H, 2, dtype=torch.uint8), row_order="halves", weight_format="mxfp8")  # fmt: skip
    k = LAYOUT.to_kernel(c, "bf16", OPTS)
    w = k["w13_weight"].view(torch.uint8).reshape(-1)
    assert w[:16].tolist() == [0] * 16 and int(w[16]) == 1 and int(w[1024]) == I and int(w[2048]) == 16
    sc = k["w13_weight_scale"].reshape(-1)
    assert sc[:6].tolist() == [0, I, 0x7F, 0x7F, 1, I + 1]


@pytest.mark.parametrize("order", ["halves", "interleaved"])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_both_orders_and_tp(order: str, tp: int) -> None:
    H, I = 192, 256
    c = _stack(order, H, I, E=3)
    for rank, (s, e) in enumerate(tp_ranges(I, tp)):
        part = slice_tp(c, s, e, rank)
        sizes = part.sizes(H, e - s)
        assert LAYOUT.padded_sizes(H, e - s, order, "bf16", OPTS, weight_format="mxfp8") == (H, e - s)
        back = LAYOUT.from_kernel(LAYOUT.to_kernel(part, "bf16", OPTS), sizes, "bf16", OPTS)
        assert back.weight_format == "mxfp8" and back.row_order == order
        for f in ("w13", "w13_scale", "w2", "w2_scale"):
            assert torch.equal(getattr(back, f), getattr(part, f)), (rank, f)


def test_padding_bytes_are_checked() -> None:
    c = _stack("halves", 192, 64)
    sizes = c.sizes(192, 64)
    k = LAYOUT.to_kernel(c, "bf16", OPTS)
    s13 = k["w13_weight_scale"].clone()
    s13[16, 2] = 0  # unshuffled (row 0, scale column 6): the 0x7F column padding aiter itself writes
    with pytest.raises(LayoutError, match=r"w13_weight_scale padding at \[0, 6\].*holds 0, expected 127"):
        LAYOUT.from_kernel(dict(k, w13_weight_scale=s13), sizes, "bf16", OPTS)
    s2 = k["w2_weight_scale"].clone()
    s2[-1, -1] = 5  # e8m0_shuffle's row padding: torch.empty upstream
    with pytest.raises(LayoutError, match=r"w2_weight_scale padding at \[767, 7\]"):
        LAYOUT.from_kernel(dict(k, w2_weight_scale=s2), sizes, "bf16", OPTS)
    lax = LAYOUT.resolve_options({"check_undefined_scale_padding": False})
    assert torch.equal(LAYOUT.from_kernel(dict(k, w2_weight_scale=s2), sizes, "bf16", lax).w2_scale, c.w2_scale)


def test_refusals_name_vllms_rule() -> None:
    with pytest.raises(LayoutError, match="intermediate size 96 per rank is not a multiple of 64"):
        LAYOUT.padded_sizes(128, 96, "halves", "bf16", OPTS, weight_format="mxfp8")
    with pytest.raises(LayoutError, match="hidden size 160"):
        LAYOUT.padded_sizes(160, 64, "halves", "bf16", OPTS, weight_format="mxfp8")
    with pytest.raises(LayoutError, match="take bf16 activations"):
        LAYOUT.padded_sizes(128, 64, "halves", "mxfp4", OPTS, weight_format="mxfp8")
    b = _stack("halves", 128, 64)
    biased = CanonicalExperts(b.w13, b.w13_scale, b.w2, b.w2_scale, torch.zeros(3, 128), torch.zeros(3, 128), "halves", "mxfp8")
    with pytest.raises(LayoutError, match="aiter MXFP8 takes no expert biases"):
        LAYOUT.kernel_specs(biased.sizes(128, 64), "bf16", OPTS)


def test_describe_and_engine_data() -> None:
    d = LAYOUT.describe(_stack("halves", 192, 64).sizes(192, 64), "bf16", OPTS)
    assert (d["variant"], d["vllm_oracle"], d["vllm_backend"]) == ("mxfp8", "Fp8MoeBackend", "AITER_MXFP8")
    assert d["scale_pad_defined_upstream"] is False and d["padding"]["intermediate_align"] == 1
    assert LAYOUT.weight_formats == ("mxfp4", "mxfp8") and LAYOUT.vllm_mxfp8_backends == {"bf16": ("AITER_MXFP8",)}
    assert [h["output"] for h in holders("AITER_MXFP8", VllmMethod.CT_MXFP8)] == [
        "repack --backend aiter --activation bf16 --format mxfp8"]


# --- the CLI --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized_mxfp8(tmp_path_factory.mktemp("amx8"), 128, 256)


@pytest.mark.parametrize("tp", ["1", "2"])
def test_repack_verifies_bit_exact_and_a_flipped_scale_byte_fails(q8: Path, tmp_path: Path, tp: str) -> None:
    per_rank = 256 // int(tp)
    m = repack_verify_and_damage(q8, tmp_path / "aiter", "aiter", tp, layer=0, flip_at=(2 * 2 * per_rank, 0))
    assert m["served_vllm_backends"] == ["AITER_MXFP8"] and m["layout"]["vllm_backend"] == "AITER_MXFP8"
    assert m["quant_config"]["activation_quant"]["scheme"] == "dynamic_mxfp8"


def test_swapped_experts_fail_verify(q8: Path, tmp_path: Path) -> None:
    swapped_experts_fail(q8, tmp_path / "aiter", "aiter", "model.layers.0.mlp.experts.w2_weight")


def test_inspect_lists_the_aiter_mxfp8_output(q8: Path) -> None:
    code, text, err = mx("inspect", q8, "--json")
    assert code == 0, err
    table = {(b["backend"], b["activation"]): b for b in json.loads(text)["backends"]}
    assert table["aiter", "bf16"]["vllm_methods"] == {"CompressedTensorsW8A8Mxfp8MoEMethod": ["AITER_MXFP8"]}
    assert "error" in table["aiter", "mxfp4"]
