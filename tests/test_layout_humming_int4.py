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
from mxconv.layouts import get_layout
from mxconv.layouts.canonical import CanonicalExperts, LayoutSizes
from mxconv.layouts.humming_bytemap import unrepack_weights
from mxconv.mx.int4 import pack_int4
from support.checkpoints import GroundTruth, make_checkpoint
from support.cli import mx

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
    return make_checkpoint(tmp_path_factory.mktemp("kimi") / "src", "kimi-k2-int4")


@pytest.mark.parametrize("tp", [1, 2])
def test_repack_and_verify_a_kimi_source(kimi: GroundTruth, tmp_path: Path, tp: int) -> None:
    out = tmp_path / "hum"
    args = ("repack", kimi.path, out, "--backend", "humming", "--device", "cpu", "--tp", str(tp), "--quiet")
    code, _, err = mx(*args)  # the generator's codes stay in [-7, 7]: humming makes them float4e0m3
    assert code == 2 and "no code of this stack is q = -8" in err and "int4_codes=e0m3" in err
    code, _, err = mx(*args, "--layout-option", "int4_codes=e0m3")
    assert code == 0, err
    m = json.loads((out / "mxconv.json").read_text())
    lay = m["layout"]
    assert (m["backend"], m["weight_format"], lay["variant"], lay["int4_codes"], lay["options"]) == (
        "humming", "int4", "int4", "e0m3", {"int4_codes": "e0m3"})
    assert lay["layer_configs"]["w13"]["b_dtype"] == "float4e0m3"
    assert m["served_vllm_backends"] == ["HUMMING"]
    code, stdout, err = mx("verify", out, "--reference", kimi.path, "--json")
    assert code == 0, stdout + err
    assert json.loads(stdout)["passed"]
