"""``--backend humming`` for compressed-tensors INT4 experts on CPU: the stored codes against a scalar
transcription of humming's ``convert_symmetric_integer_weight``, the bf16 scales against humming's
permutation list, round trips, the code-form refusals, and repack -> verify of a Kimi-style source
(tests/test_humming_gpu.py compares the bytes with humming's own transform)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.layouts import get_layout
from mxconv.layouts.humming_bytemap import unrepack_weights
from mxconv.mx.int4 import pack_int4
from mxconv.source.checkpoint import open_checkpoint
from support.checkpoints import GroundTruth, ModelSizes, make_checkpoint
from support.cli import mx
from support.tamper import patch_tensor

LAYOUT = get_layout("humming")


def _stack(E: int, H: int, I: int, seed: int, low: int) -> CanonicalExperts:
    """Random int4 stack with q in [low, 7] (low -7: no q = -8, humming's e0m3 case)."""
    g = torch.Generator().manual_seed(seed)
    q = lambda *s: torch.randint(low, 8, s, generator=g)  # noqa: E731
    sc = lambda *s: (torch.rand(s, generator=g) + 0.25).to(torch.bfloat16)  # noqa: E731
    return CanonicalExperts(pack_int4(q(E, 2 * I, H)), sc(E, 2 * I, H // 32), pack_int4(q(E, H, I)), sc(E, H, I // 32),
                            row_order="halves", weight_format="int4")  # fmt: skip


def _opts(codes: str):  # noqa: ANN202
    return LAYOUT.resolve_options({"int4_codes": codes})


def _scalar_code(s: int, codes: str) -> int:
    """humming: offset-binary s kept (uint4), or q = s - 8 -> |q| | (q < 0) << 3 (float4e0m3)."""
    if codes == "uint4":
        return s
    q = s - 8
    return abs(q) | (8 if q < 0 else 0)


@pytest.mark.parametrize("codes,low", [("uint4", -8), ("e0m3", -7)])
def test_codes_and_scales_follow_humming(codes: str, low: int) -> None:
    E, H, I = 2, 96, 160
    c = _stack(E, H, I, seed=5, low=low)
    if codes == "uint4":  # humming keeps offset-binary codes only where the stack holds q = -8
        assert bool(((c.w2 & 0xF) == 0).any() | ((c.w2 >> 4) == 0).any())
    k = LAYOUT.to_kernel(c, "bf16", _opts(codes))
    for w, n, kk in (("w13", 2 * I, H), ("w2", H, I)):
        stored = unrepack_weights(k[f"{w}_weight"], w)  # the word map is checked in test_layout_humming
        src, got = getattr(c, w).tolist(), stored.tolist()
        for e in range(E):
            for r in range(n):
                for b in range(kk // 2):
                    s = src[e][r][b]
                    assert got[e][r][b] == _scalar_code(s & 0xF, codes) | (_scalar_code(s >> 4, codes) << 4)
        assert not stored[:, n:].any() and not stored[:, :n, kk // 2:].any()  # humming's zero padding
        st = k[f"{w}_weight_scale"]
        assert st.dtype == torch.bfloat16 and st.shape == (E, -(-kk // 128) * 4, -(-n // 256) * 256)
        scale = getattr(c, f"{w}_scale")
        for e, row, grp in ((0, 0, 0), (1, n - 1, kk // 32 - 1), (0, 9, 1), (1, 70, 2)):
            col = 64 * (row // 64) + 8 * (row % 8) + (row % 64) // 8  # out[8i + q] = in[8q + i] per 64
            assert st[e, grp, col].item() == scale[e, row, grp].item()


@pytest.mark.parametrize("codes,low", [("uint4", -8), ("e0m3", -7)])
def test_round_trip_specs_and_describe(codes: str, low: int) -> None:
    E, H, I = 3, 288, 96
    c = _stack(E, H, I, seed=H + I, low=low)
    assert LAYOUT.padded_sizes(H, I, "halves", "bf16", weight_format="int4") == (H, I)
    sizes = LayoutSizes(E, H, I, H, I, "halves", False, "int4")
    k = LAYOUT.to_kernel(c, "bf16", _opts(codes))
    specs = LAYOUT.kernel_specs(sizes, "bf16", _opts(codes))
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {n: (s.shape, s.dtype) for n, s in specs.items()}
    back = LAYOUT.from_kernel(k, sizes, "bf16", _opts(codes))
    assert back.weight_format == "int4" and back.row_order == "halves"
    for f in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, f).view(torch.uint8), getattr(c, f).view(torch.uint8)), f
    d = LAYOUT.describe(sizes, "bf16", _opts(codes))
    want_b = {"uint4": "uint4", "e0m3": "float4e0m3"}[codes]
    for w, (n, kk) in {"w13": (2 * I, H), "w2": (H, I)}.items():
        cfg = d["layer_configs"][w]
        assert (cfg["b_dtype"], cfg["bs_dtype"], cfg["weight_scale_group_size"], cfg["has_zero_point"]) == (want_b, "bfloat16", 32, False)
        assert (cfg["shape_n"] - cfg["pad_shape_n"], cfg["shape_k"] - cfg["pad_shape_k"]) == (n, kk)
        assert cfg["shape_n"] % 256 == 0 and cfg["shape_k"] % 128 == 0
    assert (d["variant"], d["int4_codes"], d["activation_type"], d["scale_dtype"]) == ("int4", codes, "binary_split", "bfloat16")
    # a scale in humming's padding is named
    bad = dict(k, w2_weight_scale=k["w2_weight_scale"].clone())
    bad["w2_weight_scale"][0, 0, -1] = 1.0
    with pytest.raises(LayoutError, match="padding of w2_weight_scale"):
        LAYOUT.from_kernel(bad, sizes, "bf16", _opts(codes))


def test_the_code_form_humming_would_not_pick_is_refused() -> None:
    with_minus8, without = _stack(1, 64, 64, seed=1, low=-8), _stack(1, 64, 64, seed=1, low=-7)
    with pytest.raises(LayoutError, match=r"w13_weight: the code q = -8.*not float4e0m3; int4_codes=auto"):
        LAYOUT.to_kernel(with_minus8, "bf16", _opts("e0m3"))
    with pytest.raises(LayoutError, match=r"w13_weight: no code of this stack is q = -8.*not uint4; int4_codes=auto"):
        LAYOUT.to_kernel(without, "bf16", _opts("uint4"))
    with pytest.raises(LayoutError, match="multiple of 32"):
        LAYOUT.padded_sizes(64, 48, "halves", "bf16", weight_format="int4")
    with pytest.raises(LayoutError, match="halves"):
        LAYOUT.padded_sizes(64, 64, "interleaved", "bf16", weight_format="int4")
    with pytest.raises(LayoutError, match="int4_codes"):
        LAYOUT.resolve_options({"int4_codes": "int4"})


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> GroundTruth:
    """Two MoE layers (1, 2); the generator's codes stay in [-7, 7] (scale amax / 7): no q = -8, so
    humming makes every stack float4e0m3, except layer 2's w2, where one code is set to q = -8."""
    truth = make_checkpoint(tmp_path_factory.mktemp("kimi") / "src", "kimi-k2-int4", ModelSizes(num_layers=3))
    patch_tensor(truth.path, f"{MINUS8_EXPERT}.weight_packed", lambda t: t & ~0xF, fix_manifest=False)  # nibble 0: q = -8
    return truth


MINUS8_EXPERT = "model.layers.2.mlp.experts.1.down_proj"
AUTO_CHOICES = {"1": [{"w13_weight": "e0m3", "w2_weight": "e0m3"}], "2": [{"w13_weight": "e0m3", "w2_weight": "uint4"}]}


def _repack(kimi: GroundTruth, out: Path, *extra: str) -> tuple[int, str]:
    code, _, err = mx("repack", kimi.path, out, "--backend", "humming", "--device", "cpu", "--quiet", *extra)
    return code, err


def _verify(out: Path, kimi: GroundTruth) -> tuple[bool, str]:
    code, stdout, err = mx("verify", out, "--reference", kimi.path, "--json")
    assert code in (0, 1), stdout + err
    return json.loads(stdout)["passed"], stdout


@pytest.mark.parametrize("tp", [1, 2])
def test_repack_and_verify_a_kimi_source(kimi: GroundTruth, tmp_path: Path, tp: int) -> None:
    """No option needed: each stack gets the codes humming gives it, recorded per layer, rank and GEMM."""
    out = tmp_path / "hum"
    code, err = _repack(kimi, out, "--tp", str(tp))
    assert code == 0, err
    m = json.loads((out / "mxconv.json").read_text())
    lay = m["layout"]
    assert (m["backend"], m["weight_format"], lay["variant"], lay["int4_codes"], lay["options"]) == (
        "humming", "int4", "int4", "auto", {"int4_codes": "auto"})
    assert lay["stack_choices"] == {k: v * tp for k, v in AUTO_CHOICES.items()}
    assert lay["layer_configs"]["w13"]["b_dtype"] is None  # per stack: stack_choices
    assert m["served_vllm_backends"] == ["HUMMING"]
    # the stored nibbles are the forms recorded: e0m3 never stores "-0" (8); the uint4 stack keeps q = -8 as 0
    for layer, w, form in (("1", "w2", "e0m3"), ("2", "w2", "uint4")):
        words = open_checkpoint(out if tp == 1 else out / "rank-0").read(f"model.layers.{layer}.mlp.experts.{w}_weight")
        nib = unrepack_weights(words, w)
        nibbles = torch.stack((nib & 0xF, nib >> 4))
        assert bool((nibbles == (0 if form == "uint4" else 8)).any()) == (form == "uint4")
    passed, report = _verify(out, kimi)
    assert passed, report


def test_the_recorded_choice_is_what_verify_inverts_with(kimi: GroundTruth, tmp_path: Path) -> None:
    """The manifest's choice, tampered (the weights untouched, so every sha256 still holds), fails verify:
    the bytes read back with the other codes are not the reference's, or not what humming would choose."""
    out = tmp_path / "hum"
    assert _repack(kimi, out)[0] == 0
    path = out / "mxconv.json"
    good = json.loads(path.read_text())
    for layer, w, other in (("1", "w13_weight", "uint4"), ("2", "w2_weight", "e0m3")):
        bad = json.loads(json.dumps(good))
        bad["layout"]["stack_choices"][layer][0][w] = other
        path.write_text(json.dumps(bad))
        passed, report = _verify(out, kimi)
        assert not passed and f"model.layers.{layer}.mlp.experts" in report, report
    del bad["layout"]["stack_choices"]  # auto without the record cannot be inverted
    path.write_text(json.dumps(bad))
    passed, report = _verify(out, kimi)
    assert not passed and "stack_choices" in report, report


def test_explicit_codes_override_and_refuse_what_humming_would_not_pick(kimi: GroundTruth, tmp_path: Path) -> None:
    auto = tmp_path / "auto"
    assert _repack(kimi, auto)[0] == 0
    # e0m3 for every stack: layer 2's w2 holds q = -8, so humming would keep uint4 there
    code, err = _repack(kimi, tmp_path / "e0m3", "--layout-option", "int4_codes=e0m3")
    assert code == 2 and "model.layers.2" in err and "w2_weight: the code q = -8" in err, err
    assert "convert_symmetric_integer_weight" in err
    code, err = _repack(kimi, tmp_path / "uint4", "--layout-option", "int4_codes=uint4")
    assert code == 2 and "w13_weight: no code of this stack is q = -8" in err, err
    # a source without q = -8 (layer 2 alone, via a clean checkpoint): the override writes what auto writes
    clean = make_checkpoint(tmp_path / "clean", "kimi-k2-int4")
    for name, extra in (("c-auto", ()), ("c-e0m3", ("--layout-option", "int4_codes=e0m3"))):
        code, _, err = mx("repack", clean.path, tmp_path / name, "--backend", "humming", "--device", "cpu", "--quiet", *extra)
        assert code == 0, err
    digests = [{p.name: p.read_bytes() for p in (tmp_path / n).glob("*.safetensors")} for n in ("c-auto", "c-e0m3")]
    assert digests[0] == digests[1]
    m = json.loads((tmp_path / "c-e0m3" / "mxconv.json").read_text())["layout"]
    assert (m["int4_codes"], m["stack_choices"], m["layer_configs"]["w2"]["b_dtype"]) == (
        "e0m3", {"1": [{"w13_weight": "e0m3", "w2_weight": "e0m3"}]}, "float4e0m3")


def test_a_layer_cut_into_groups_whose_choices_differ_is_refused() -> None:
    """Under a memory budget a layer is laid out in groups of experts, but humming chooses once per
    whole stack: a later group whose data gives the other form is refused, naming tensor and rule."""
    from mxconv.errors import BadInput
    from mxconv.families.base import MoELayer, MoELayerRef
    from mxconv.run.compute import RunStats

    ref = MoELayerRef(2, "model.layers.2.mlp", (), "model.layers.2.mlp.gate.weight")
    stats = RunStats()
    first, later = (MoELayer(ref, "halves", first_expert=e) for e in (0, 4))
    stats.record_choices(first, 0, {"w13_weight": "e0m3", "w2_weight": "e0m3"})
    stats.record_choices(first, 1, {"w13_weight": "e0m3", "w2_weight": "uint4"})
    stats.record_choices(later, 0, {"w13_weight": "e0m3", "w2_weight": "e0m3"})  # agrees: fine
    with pytest.raises(BadInput, match=r"model\.layers\.2\.mlp\.experts\.w2_weight \(rank 1\): experts from 4 on give "
                       r"'e0m3', the layer's earlier experts 'uint4'; the layout chooses once per whole stack") as exc:
        stats.record_choices(later, 1, {"w13_weight": "e0m3", "w2_weight": "e0m3"})
    assert exc.value.exit_code == 2 and "max_memory" in str(exc.value)
    assert stats.stack_choices == {2: [{"w13_weight": "e0m3", "w2_weight": "e0m3"}, {"w13_weight": "e0m3", "w2_weight": "uint4"}]}
