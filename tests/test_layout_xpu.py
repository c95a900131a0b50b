"""``--backend xpu`` (vLLM 0.33's Fp8MoeBackend.XPU, ``prepare_fp8_moe_layer_for_xpu``): every byte against an
element-by-element model of the load-time step (each weight and 3-d scale tensor with its last two axes swapped,
nothing padded, dtypes kept), odd sizes (K/32 odd), both w13 row orders, TP slices, the refusals (MXFP4 experts
among them, whose canonical output vLLM's XPU backend runs as loaded where unpadded) and the CLI: repack of a ``quantize --format
mxfp8`` output and of a bf16 source with ``--format mxfp8`` at TP 1 and 2, verify bit-exact, a flipped scale
byte and swapped experts caught. vLLM's own function on these bytes: tests/test_vllm_xpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.cli import mx
from support.mxfp8_cli import (
    engine_row_holders, quantized_mxfp8, repack_verify_and_damage, swapped_experts_fail, unpadded_round_trips,
)

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts
from mxconv.layouts import get_layout
from mxconv.layouts.engine_report import holders, not_held
from mxconv.layouts.vllm_serving import VllmMethod
from mxconv.source.st_format import read_header, read_tensor

LAYOUT = get_layout("xpu")
OPTS = LAYOUT.resolve_options()
NAMES = {"w13_weight": "w13", "w13_weight_scale": "w13_scale", "w2_weight": "w2", "w2_weight_scale": "w2_scale"}


def _stack(order: str, H: int, I: int, E: int = 3, seed: int = 0) -> CanonicalExperts:
    g = torch.Generator().manual_seed(seed + H + I)
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g)  # noqa: E731
    return CanonicalExperts(u8(E, 2 * I, H), u8(E, 2 * I, H // 32), u8(E, H, I), u8(E, H, I // 32),
                            row_order=order, weight_format="mxfp8")  # fmt: skip


def _model(t: torch.Tensor) -> list[int]:
    """The stored bytes, in storage order, of ``t`` [E, R, C] after the XPU load step: element (e, c, r) of the
    [E, C, R] result, row-major, is byte (e, r, c) of the loaded tensor."""
    E, R, C = t.shape
    src = t.reshape(-1).tolist()
    return [src[(e * R + r) * C + c] for e in range(E) for c in range(C) for r in range(R)]


@pytest.mark.parametrize("order,H,I", [("halves", 96, 160), ("interleaved", 160, 96), ("halves", 224, 32)])
def test_bytes_match_the_load_step(order: str, H: int, I: int) -> None:
    c = _stack(order, H, I)
    k = LAYOUT.to_kernel(c, "bf16", OPTS)
    specs = LAYOUT.kernel_specs(c.sizes(H, I), "bf16", OPTS)
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {n: (s.shape, s.dtype) for n, s in specs.items()}
    assert list(k) == list(NAMES)
    assert (k["w13_weight"].shape, k["w13_weight_scale"].shape) == ((3, H, 2 * I), (3, H // 32, 2 * I))
    assert (k["w2_weight"].shape, k["w2_weight_scale"].shape) == ((3, I, H), (3, I // 32, H))
    assert k["w13_weight"].dtype == k["w2_weight"].dtype == torch.float8_e4m3fn
    assert k["w13_weight_scale"].dtype == k["w2_weight_scale"].dtype == torch.uint8
    for name, field in NAMES.items():
        assert k[name].is_contiguous(), name
        assert k[name].view(torch.uint8).reshape(-1).tolist() == _model(getattr(c, field)), name


def test_worked_example() -> None:
    """One expert, H = 32, I = 32: w13 row r (gate r for r < 32, up r - 32 after) becomes column r, each
    row's single scale byte becomes column r of the one scale row."""
    w13 = torch.arange(64 * 32, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(1, 64, 32)
    s13 = torch.arange(64, dtype=torch.uint8).reshape(1, 64, 1) + 100
    w2 = torch.arange(32 * 32, dtype=torch.int64).remainder(253).to(torch.uint8).reshape(1, 32, 32)
    s2 = torch.full((1, 32, 1), 127, dtype=torch.uint8)
    k = LAYOUT.to_kernel(CanonicalExperts(w13, s13, w2, s2, row_order="halves", weight_format="mxfp8"), "bf16", OPTS)
    assert k["w13_weight_scale"].tolist() == [[list(range(100, 164))]]
    assert int(k["w13_weight"].view(torch.uint8)[0, 5, 40]) == int(w13[0, 40, 5]) == (40 * 32 + 5) % 251
    assert int(k["w2_weight"].view(torch.uint8)[0, 7, 3]) == (3 * 32 + 7) % 253


@pytest.mark.parametrize("order", ["halves", "interleaved"])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_both_orders_and_tp(order: str, tp: int) -> None:
    for part, k in unpadded_round_trips(LAYOUT, "bf16", _stack(order, 96, 192), tp):
        I = part.intermediate_size
        assert I == 192 // tp and k["w13_weight"].shape == (3, 96, 2 * I)
        for name, field in NAMES.items():
            assert k[name].view(torch.uint8).reshape(-1).tolist() == _model(getattr(part, field)), name
        assert LAYOUT.describe(part.sizes(96, I), "bf16", OPTS)["w13_kernel_row_order"] == order


def test_refusals_name_the_rule() -> None:
    c = _stack("halves", 96, 64)
    with pytest.raises(LayoutError, match="XPU experts bf16 hidden states"):
        LAYOUT.padded_sizes(96, 64, "halves", "mxfp8", OPTS, weight_format="mxfp8")
    with pytest.raises(LayoutError, match="multiple of 32"):
        LAYOUT.padded_sizes(80, 64, "halves", "bf16", OPTS, weight_format="mxfp8")
    biased = CanonicalExperts(c.w13, c.w13_scale, c.w2, c.w2_scale, torch.zeros(3, 128), torch.zeros(3, 96), "halves", "mxfp8")
    with pytest.raises(LayoutError, match="xpu MXFP8 takes no expert biases"):
        LAYOUT.kernel_specs(biased.sizes(96, 64), "bf16", OPTS)
    k = LAYOUT.to_kernel(c, "bf16", OPTS)
    with pytest.raises(LayoutError, match=r"xpu kernel tensor w13_weight_scale is \(3, 128, 3\)"):  # untransposed scales
        LAYOUT.from_kernel(dict(k, w13_weight_scale=c.w13_scale), c.sizes(96, 64), "bf16", OPTS)
    # MXFP4 experts: the layout says why (vLLM's Mxfp4MoeBackend.XPU takes the canonical bytes as loaded)
    for call in (lambda: LAYOUT.padded_sizes(96, 64, "halves", "bf16", OPTS),
                 lambda: LAYOUT.check_weight_format("mxfp4")):  # fmt: skip
        with pytest.raises(LayoutError, match="Mxfp4MoeBackend.XPU runs MXFP4 experts on the checkpoint's tensors as loaded"):
            call()
    assert LAYOUT.weight_formats == ("mxfp8",)


def test_describe_and_engine_data() -> None:
    d = LAYOUT.describe(_stack("halves", 96, 64).sizes(96, 64), "bf16", OPTS)
    assert (d["name"], d["variant"], d["vllm_oracle"], d["vllm_moe_backend"]) == ("xpu", "mxfp8", "Fp8MoeBackend", "XPU")
    assert d["engine_compat"]["vllm"] == "0.33" and d["padding"] == {"hidden_align": 1, "intermediate_align": 1, "fill": 0}
    assert LAYOUT.vllm_mxfp8_backends == {"bf16": ("XPU",)} and LAYOUT.vllm_backends == {}
    assert [h["output"] for h in holders("XPU", VllmMethod.CT_MXFP8)] == ["repack --backend xpu --activation bf16 --format mxfp8"]
    assert not_held("XPU", VllmMethod.CT_MXFP8) is None
    assert "Intel Xe2/Xe3 GPU" in LAYOUT.kernel_unavailable(None)  # type: ignore[arg-type]


# --- the CLI --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized_mxfp8(tmp_path_factory.mktemp("xmx8"), 96, 192)


def _tensors(out: Path, rank: str = "") -> dict[str, bytes]:
    where = out / rank if rank else out
    index = json.loads((where / "model.safetensors.index.json").read_text())
    got = {}
    for name, file in index["weight_map"].items():
        t = read_tensor(read_header(where / file)[0][name])
        got[name] = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return got


@pytest.mark.parametrize("tp", ["1", "2"])
def test_repack_verifies_bit_exact_and_a_flipped_scale_byte_fails(q8: Path, tmp_path: Path, tp: str) -> None:
    m = repack_verify_and_damage(q8, tmp_path / "x", "xpu", tp, layer=1, flip_at=(2, 1, 7))
    assert m["served_vllm_backends"] == ["XPU"] and m["layout"]["vllm_moe_backend"] == "XPU"
    assert m["quant_config"]["activation_quant"]["scheme"] == "dynamic_mxfp8"
    assert m["layout"]["padded_intermediate_size"] == 192 // int(tp) and m["layout"]["w13_kernel_row_order"] == "halves"


@pytest.mark.parametrize("tp", ["1", "2"])
def test_repack_of_a_bf16_source_with_format_mxfp8(q8: Path, tmp_path: Path, tp: str) -> None:
    """The bf16 source quantized on the way gives the bytes of quantize --format mxfp8 then repack."""
    src = q8.parent / "src"
    for name, source in (("direct", src), ("via-q8", q8)):
        code, _, err = mx("repack", source, tmp_path / name, "--backend", "xpu", "--tp", tp,
                          *(("--format", "mxfp8") if source == src else ()), "--quiet", "--device", "cpu")  # fmt: skip
        assert code == 0, err
    m = json.loads((tmp_path / "direct" / "mxconv.json").read_text())
    assert m["weight_format"] == "mxfp8" and m["served_vllm_backends"] == ["XPU"]
    ranks = [""] if tp == "1" else [f"rank-{r}" for r in range(int(tp))]
    for rank in ranks:
        assert _tensors(tmp_path / "direct", rank) == _tensors(tmp_path / "via-q8", rank), rank
    code, text, err = mx("verify", tmp_path / "direct", "--reference", src, "--device", "cpu")
    assert code == 0, text + err


def test_swapped_experts_fail_verify(q8: Path, tmp_path: Path) -> None:
    swapped_experts_fail(q8, tmp_path / "x", "xpu", "model.layers.0.mlp.experts.w2_weight")


def test_mxfp4_experts_are_refused_naming_why(q8: Path, tmp_path: Path) -> None:
    """Asked for MXFP4 experts (a bf16 source left to itself becomes MXFP8: tests/test_repack_formats.py)."""
    code, _, err = mx("repack", q8.parent / "src", tmp_path / "x4", "--backend", "xpu", "--format", "mxfp4", "--quiet",
                      "--device", "cpu")  # fmt: skip
    assert code == 2 and "backend xpu takes mxfp8 experts only" in err and "pass --format mxfp8" in err
    assert "Mxfp4MoeBackend.XPU runs MXFP4 experts on the checkpoint's tensors as loaded" in err
    assert not (tmp_path / "x4").exists()


def test_inspect_engine_lists_the_xpu_output(q8: Path) -> None:
    code, text, err = mx("inspect", q8, "--json")
    assert code == 0, err
    table = {(b["backend"], b["activation"]): b for b in json.loads(text)["backends"]}
    assert table["xpu", "bf16"]["vllm_methods"] == {VllmMethod.CT_MXFP8.value: ["XPU"]}
    assert engine_row_holders(q8, "sm90")[:2] == ("ct-mxfp8", "HUMMING")  # XPU is no CUDA GPU's pick
