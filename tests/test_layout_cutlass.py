"""cutlass layout (docs/layout-cutlass.md): the scale tiles against an element-by-element model of
vLLM 0.33's ``swizzle_mxfp4_scales`` on sizes that need its padding, weights as they come, the
inverse and its refusals, and the CLI: repack, verify, ``verify --kernel`` (exit 2), served backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.cli import mx

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.cutlass import LAYOUT, swizzle_scales, tiled_shape, unswizzle_scales
from mxconv.examples import ModelSizes


def u8(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)


def stack(E: int, H: int, I: int, row_order: str, bias: bool, seed: int = 0) -> CanonicalExperts:
    """Random canonical stack; scale bytes cover 0 and 0xFF (E8M0 2^-127 and NaN) too."""
    g = torch.Generator().manual_seed(seed)
    s13 = u8(g, E, 2 * I, H // 32)
    s13[0, 0, 0], s13[0, 0, 1] = 0, 255
    return CanonicalExperts(
        u8(g, E, 2 * I, H // 2), s13, u8(g, E, H, I // 2), u8(g, E, H, I // 32),
        torch.randn(E, 2 * I, generator=g).to(torch.bfloat16) if bias else None,
        torch.randn(E, H, generator=g).to(torch.bfloat16) if bias else None,
        row_order,
    )


def sizes_of(c: CanonicalExperts) -> LayoutSizes:
    return c.sizes(*LAYOUT.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, "mxfp4"))


def oracle_tiles(scales: torch.Tensor) -> list[int]:
    """One expert's [N, C] scales laid out one element at a time by the formula in the docstring of
    vLLM's swizzle_mxfp4_scales: tiles [N/128, C/4, 32, 4, 4] indexed (m // 128, k // 4, m % 32,
    (m // 32) % 4, k % 4), over the zero-padded [roundup(N, 128), roundup(C, 4)]."""
    N, C = scales.shape
    rows, cols = -(-N // 128) * 128, -(-C // 4) * 4
    k_tiles = cols // 4
    values = scales.tolist()
    out = [-1] * (rows * cols)
    for m in range(rows):
        for k in range(cols):
            at = (((m // 128) * k_tiles + k // 4) * 32 + m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4
            assert out[at] == -1, "two elements map to one byte"
            out[at] = values[m][k] if m < N and k < C else 0
    assert -1 not in out, "a byte no element maps to"
    return out


def test_registered() -> None:
    assert "cutlass" in backend_names() and get_layout("cutlass") is LAYOUT
    assert LAYOUT.activations == ("mxfp4",) and LAYOUT.vllm_backends == {"mxfp4": ("CUTLASS_MXFP4_MXFP4",)}


@pytest.mark.parametrize("N, C", [(1, 1), (96, 3), (200, 5), (128, 4), (300, 9), (256, 8), (130, 7)])
def test_swizzle_against_the_element_model(N: int, C: int) -> None:
    s = u8(torch.Generator().manual_seed(N * 31 + C), 2, N, C)
    got = swizzle_scales(s)
    assert tuple(got.shape) == (2, *tiled_shape(N, C)) and got.dtype == torch.uint8
    for e in range(2):
        assert got[e].flatten().tolist() == oracle_tiles(s[e]), (N, C, e)
    assert torch.equal(unswizzle_scales(got, "s", N, C), s)


def test_swizzle_worked_example() -> None:
    """N = 130, C = 6 -> [256, 8]. Element (33, 5): m tile 0, k tile 1, 33 % 32 = 1, (33 // 32) % 4 = 1,
    5 % 4 = 1 -> byte ((0 * 2 + 1) * 32 + 1) * 16 + 1 * 4 + 1 = 533. Element (129, 0): m tile 1 ->
    byte ((1 * 2 + 0) * 32 + 1) * 16 = 1040."""
    s = torch.zeros(1, 130, 6, dtype=torch.uint8)
    s[0, 33, 5], s[0, 129, 0] = 0x7F, 0x80
    flat = swizzle_scales(s).flatten()
    assert flat.numel() == 256 * 8
    assert flat.nonzero().flatten().tolist() == [533, 1040] and (flat[533], flat[1040]) == (0x7F, 0x80)


@pytest.mark.parametrize("H, I, want", [(2880, 2880, (2880, 2880)), (96, 160, (96, 160)), (7168, 2048, (7168, 2048))])
def test_padded_sizes_keep_the_weights(H: int, I: int, want: tuple[int, int]) -> None:
    assert LAYOUT.padded_sizes(H, I, "halves", "mxfp4") == want


def test_padded_sizes_refused() -> None:
    for args, msg in (((100, 128, "halves", "mxfp4"), "hidden size 100"), ((128, 48, "halves", "mxfp4"), "intermediate size 48"),
                      ((128, 128, "sideways", "mxfp4"), "unknown w13 row order"), ((128, 128, "halves", "bf16"), "activation 'bf16'")):
        with pytest.raises(LayoutError, match=msg):
            LAYOUT.padded_sizes(*args)
    with pytest.raises(LayoutError, match=r"do not match the layout's \(96, 160\) .*only the scale tiles"):
        LAYOUT.kernel_specs(LayoutSizes(2, 96, 160, 128, 256, "halves", False), "mxfp4", None)


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
@pytest.mark.parametrize("bias", [True, False])
def test_to_kernel_bytes(row_order: str, bias: bool) -> None:
    """H = 96 (K/32 = 3 for w13), I = 160 (w13 N = 320, w2 K/32 = 5), w2 N = 96: every scale tensor
    needs row and column padding."""
    c = stack(3, 96, 160, row_order, bias)
    k = LAYOUT.to_kernel(c, "mxfp4", None)
    specs = LAYOUT.kernel_specs(sizes_of(c), "mxfp4", None)
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {n: (s.shape, s.dtype) for n, s in specs.items()}
    assert list(k) == [n for n in ("w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias") if n in k]
    assert specs["w13_weight_scale"].shape == (3, 384, 4) and specs["w2_weight_scale"].shape == (3, 128, 8)
    assert torch.equal(k["w13_weight"], c.w13) and torch.equal(k["w2_weight"], c.w2)
    for e in range(3):
        assert k["w13_weight_scale"][e].flatten().tolist() == oracle_tiles(c.w13_scale[e])
        assert k["w2_weight_scale"][e].flatten().tolist() == oracle_tiles(c.w2_scale[e])
    if bias:
        assert k["w13_bias"].dtype == torch.bfloat16 and torch.equal(k["w13_bias"], c.w13_bias) and torch.equal(k["w2_bias"], c.w2_bias)
    else:
        assert "w13_bias" not in k and "w2_bias" not in k


def test_aligned_sizes_are_what_vllm_holds() -> None:
    """H = 256, I = 128: no tile padding, the scales keep vLLM's [E, N, K/32] shape (the reshape in
    CompressedTensorsW4A4Mxfp4MoEMethod.process_weights_after_loading)."""
    c = stack(2, 256, 128, "halves", False)
    k = LAYOUT.to_kernel(c, "mxfp4", None)
    assert k["w13_weight_scale"].shape == c.w13_scale.shape and k["w2_weight_scale"].shape == c.w2_scale.shape
    assert k["w13_weight_scale"][1].flatten().tolist() == oracle_tiles(c.w13_scale[1])


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
def test_round_trip(row_order: str) -> None:
    c = stack(4, 160, 96, row_order, True, seed=3)
    back = LAYOUT.from_kernel(LAYOUT.to_kernel(c, "mxfp4", None), sizes_of(c), "mxfp4", None)
    for f in ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias"):
        assert torch.equal(getattr(back, f), getattr(c, f)), f
    assert back.row_order == row_order


def test_from_kernel_refuses() -> None:
    c = stack(2, 96, 160, "halves", True)  # w13 scales [320, 3] -> [384, 4]; w2 scales [96, 5] -> [128, 8]
    sizes = sizes_of(c)
    good = LAYOUT.to_kernel(c, "mxfp4", None)

    def bad(name: str, fn) -> dict[str, torch.Tensor]:
        k = {n: t.clone() for n, t in good.items()}
        k[name] = fn(k[name])
        return k

    def poke_tile(t: torch.Tensor, e: int, m: int, col: int) -> torch.Tensor:
        """Set unswizzled element (m, col) of expert e, found through the element model."""
        rows, cols = t.shape[1:]
        probe = torch.zeros(1, rows, cols, dtype=torch.uint8)
        probe[0, m, col] = 1
        t[e].view(-1)[int(swizzle_scales(probe).flatten().nonzero())] = 9
        return t

    cases = [
        (bad("w13_weight_scale", lambda t: poke_tile(t, 1, 350, 0)), r"padding of w13_weight_scale at index \[1, 350, 0\]"),
        (bad("w13_weight_scale", lambda t: poke_tile(t, 0, 17, 3)), r"padding of w13_weight_scale at index \[0, 17, 3\]"),
        (bad("w2_weight_scale", lambda t: poke_tile(t, 1, 5, 6)), r"padding of w2_weight_scale at index \[1, 5, 6\]"),
        (bad("w2_weight_scale", lambda t: poke_tile(t, 0, 100, 1)), r"padding of w2_weight_scale at index \[0, 100, 1\]"),
        (bad("w13_weight_scale", lambda t: t[:, :320, :3].contiguous()), r"w13_weight_scale is \(2, 320, 3\) torch.uint8"),
        (bad("w2_bias", lambda t: t.float()), r"w2_bias is \(2, 96\) torch.float32"),
        ({n: t for n, t in good.items() if n != "w2_bias"}, r"missing \['w2_bias'\]"),
        ({**good, "w2_weight_scale_2": good["w2_weight_scale"]}, r"unexpected \['w2_weight_scale_2'\]"),
    ]
    for k, msg in cases:
        with pytest.raises(LayoutError, match=msg):
            LAYOUT.from_kernel(k, sizes, "mxfp4", None)


def test_describe() -> None:
    d = LAYOUT.describe(sizes_of(stack(2, 96, 160, "interleaved", False)), "mxfp4", None)
    assert (d["name"], d["version"], d["vllm_moe_backend"], d["engine_compat"]["vllm"]) == ("cutlass", 1, "CUTLASS_MXFP4_MXFP4", ">=0.33")
    assert d["padding"] == {"hidden_align": 1, "intermediate_align": 1, "scale_row_align": 128, "scale_col_align": 4, "fill": 0}
    assert d["w13_kernel_row_order"] == "interleaved"


# ---- through the CLI --------------------------------------------------------------------------


def _manifest(out: Path) -> dict:
    return json.loads((out / "mxconv.json").read_text())


@pytest.mark.parametrize("H, I, served", [(256, 128, True), (160, 96, False)])
def test_repack_verify_and_served_backends(made, H: int, I: int, served: bool) -> None:
    """A compressed-tensors MXFP4 source (mxconv quantize of Qwen3) repacked: verify passes; vLLM 0.33
    holds it as CUTLASS_MXFP4_MXFP4 only where H and I are multiples of 128."""
    src = made.source("qwen3-moe", ModelSizes(hidden_size=H, intermediate_size=I)).path
    out = made.repack(made.quantize(src), "cutlass", "--activation", "mxfp4")
    m = _manifest(out)
    assert m["backend"] == "cutlass" and m["layout"]["padded_hidden_size"] == H and m["layout"]["padded_intermediate_size"] == I
    code, text, err = mx("verify", out, "--reference", src)
    assert code == 0, text + err
    qc = m["quant_config"]
    assert qc["activation_quant"]["scheme"] == "dynamic_mxfp4" and qc["activation"]["w13_kernel_row_order"] == "halves"
    if served:
        assert m["served_vllm_backends"] == ["CUTLASS_MXFP4_MXFP4"] and qc["not_served"] == {}
    else:
        assert m["served_vllm_backends"] == [] and "CUTLASS_MXFP4_MXFP4" in qc["not_served"]


def test_gpt_oss_biases_are_not_served(made) -> None:
    out = made.repack(made.source("gpt-oss-mxfp4", ModelSizes(hidden_size=256, intermediate_size=128)).path, "cutlass", "--activation", "mxfp4")
    why = _manifest(out)["quant_config"]["not_served"]["CUTLASS_MXFP4_MXFP4"]
    assert "ignores expert biases" in why


def test_verify_kernel_says_it_needs_sm100(made) -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (10, 11):
        pytest.skip("an SM100-family GPU: the reason is a different one")
    out = made.repack(made.source("qwen3-moe", ModelSizes(hidden_size=256, intermediate_size=128)).path, "cutlass", "--activation", "mxfp4")
    code, text, err = mx("verify", out, "--kernel")
    assert code == 2 and "--kernel" in err and "SM100" in err and "Traceback" not in text + err, text + err
