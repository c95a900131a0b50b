"""triton layout on other GPUs (``--layout-option arch=``) and triton_kernels 3.8: bytes equal to
triton_kernels' own ``convert_layout`` run the way vLLM 0.33's ``_swizzle_mxfp4`` runs it on that
platform (the vendored copy in ``.kern``; a 3.8-generation tree from ``$MXCONV_TRITON_KERNELS_38``),
round trips, padding rules, manifest fields and the kernel refusal."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts
from mxconv.layouts.triton import LAYOUT, TritonOptions
from mxconv.layouts.triton_arch import Arch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_layout_gpu import make_stack

# (E, H, I): odd sizes, gpt-oss hidden/intermediate at TP 1 and TP 2 (I = 2880 / 2 = 1440 per rank)
SHAPES = [(3, 352, 160), (1, 2880, 2880), (1, 2880, 1440)]


def _import_tk(root: str) -> object:
    for name in [m for m in sys.modules if m == "triton_kernels" or m.startswith("triton_kernels.")]:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        from triton_kernels import tensor
        from triton_kernels.tensor_details import layout
    except Exception as exc:  # noqa: BLE001 - any import failure means "no oracle here"
        pytest.skip(f"triton_kernels is not importable from {root}: {type(exc).__name__}: {exc}")
    finally:
        sys.path.remove(root)
    return tensor, layout


def vendored() -> tuple[object, object]:
    """(tensor, layout) modules of vLLM 0.33's vendored triton_kernels (3.5.1 API)."""
    return _import_tk(os.environ.get("MXCONV_TRITON_KERNELS") or str(HERE.parent / ".kern"))


def _zero_padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[2], 0, rows - x.shape[1]))


def vllm_inputs(c: CanonicalExperts, opts: TritonOptions) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What ``_swizzle_mxfp4`` receives per matrix: vLLM's zero padding of H/I, gate/up rows
    interleaved (what mxconv stores for every source), and on SM90 the K/32 pre-pad to 4."""
    hp, ip = LAYOUT.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, "bf16", opts)
    pairs = torch.arange(2 * c.intermediate_size)
    if c.row_order == "halves":  # kernel row 2m + u <- source row u * I + m
        pairs = pairs.reshape(2, -1).t().reshape(-1)
    align = opts.scale_k_align if opts.arch == "sm90" else 1
    mats = {"w13": (c.w13[:, pairs], c.w13_scale[:, pairs], 2 * ip, hp), "w2": (c.w2, c.w2_scale, hp, ip)}
    return {w: (_zero_padded(v, n, kk // 2), _zero_padded(s, n, -(-kk // 32 // align) * align))
            for w, (v, s, n, kk) in mats.items()}  # fmt: skip


def oracle_35(c: CanonicalExperts, opts: TritonOptions) -> dict[str, torch.Tensor]:
    """Stored buffers from the vendored classes through ``convert_layout`` (layout classes as vLLM
    passes them on that platform), as contiguous buffers (``data.mT``; Blackwell scale reshaped)."""
    tensor, layout = vendored()
    value_cls, scale_cls = {
        "sm100": (layout.BlackwellMXValueLayout, layout.BlackwellMXScaleLayout),
        "sm120": (layout.BlackwellMXValueLayout, layout.BlackwellMXScaleLayout),
        "gfx950": (layout.StridedLayout, layout.CDNA4MXScaleLayout),
    }[opts.arch]
    out = {}
    for w, (wp, sp) in vllm_inputs(c, opts).items():
        v = tensor.convert_layout(tensor.wrap_torch_tensor(wp.transpose(-2, -1), dtype=tensor.FP4), value_cls)
        s = tensor.convert_layout(tensor.wrap_torch_tensor(sp.transpose(-2, -1)), scale_cls)
        out[f"{w}_weight"] = v.storage.data.mT.contiguous()
        data = s.storage.data
        out[f"{w}_weight_scale"] = data.contiguous().view(-1) if data.ndim == 5 else data.mT.contiguous()
    return out


@pytest.mark.parametrize("arch", ["sm100", "sm120", "gfx950"])
@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bytes_equal_triton_kernels_convert_layout(arch: str, row_order: str, shape: tuple[int, int, int]) -> None:
    o = LAYOUT.resolve_options({"arch": arch})
    c = make_stack(*shape, row_order, seed=shape[1] + shape[2] + len(arch))
    ref = oracle_35(c, o)
    got = LAYOUT.to_kernel(c, "bf16", o)
    for name, t in ref.items():
        g = got[name].reshape(-1) if t.ndim == 1 else got[name]
        assert g.shape == t.shape and torch.equal(g, t), name
    back = LAYOUT.from_kernel(got, c.sizes(*LAYOUT.padded_sizes(c.hidden_size, c.intermediate_size, row_order, "bf16", o)), "bf16", o)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, name), getattr(c, name)), name
    assert torch.equal(back.w13_bias, c.w13_bias.float()) and torch.equal(back.w2_bias, c.w2_bias.float())


def test_padded_sizes_and_shapes_per_arch() -> None:
    """CUDA: Ip = roundup(I, 64), H kept; gfx950: both to 256 (vLLM's ROCm rule for TRITON)."""
    opt = {a: LAYOUT.resolve_options({"arch": a}) for a in ("sm90", "sm100", "gfx950")}
    assert LAYOUT.padded_sizes(352, 160, "halves", "bf16", opt["sm100"]) == (352, 192)
    assert LAYOUT.padded_sizes(2880, 1440, "interleaved", "bf16", opt["gfx950"]) == (3072, 1536)
    c = make_stack(2, 352, 160, "interleaved", seed=3)
    sizes = c.sizes(*LAYOUT.padded_sizes(352, 160, "interleaved", "bf16", opt["sm100"]))
    specs = LAYOUT.kernel_specs(sizes, "bf16", opt["sm100"])
    assert specs["w13_weight"].shape == (2, 384, 256)  # rows 2Ip, bytes 176 -> 256
    assert specs["w13_weight_scale"].shape == (2, 3, 128 * 16)  # rows 384 -> 3 x 128, K/32 11 -> 16
    assert specs["w2_weight_scale"].shape == (2, 3, 128 * 8)  # rows 352 -> 384, K/32 6 -> 8
    gsizes = c.sizes(*LAYOUT.padded_sizes(352, 160, "interleaved", "bf16", opt["gfx950"]))
    gspecs = LAYOUT.kernel_specs(gsizes, "bf16", opt["gfx950"])
    assert gspecs["w13_weight"].shape == (2, 512, 256) and gspecs["w13_weight_scale"].shape == (2, 16, 32 * 16)
    with pytest.raises(LayoutError, match="padded sizes"):
        LAYOUT.geometry(sizes, opt["gfx950"])
    with pytest.raises(LayoutError):
        LAYOUT.resolve_options({"arch": "sm80"})


def test_manifest_names_gpu_layouts_and_backends() -> None:
    c = make_stack(1, 2880, 1440, "interleaved", bias=False, seed=1)
    for arch, value, scale, backends in (
        ("sm90", "HopperMXValueLayout", "HopperMXScaleLayout", ["TRITON"]),
        ("sm100", "BlackwellMXValueLayout", "BlackwellMXScaleLayout", ["TRITON"]),
        ("gfx950", "StridedLayout", "CDNA4MXScaleLayout", ["TRITON", "AITER_TRITON_MXFP4_BF16"]),
    ):
        o = LAYOUT.resolve_options({"arch": arch})
        d = LAYOUT.describe(c.sizes(*LAYOUT.padded_sizes(2880, 1440, "interleaved", "bf16", o)), "bf16", o)
        assert d["arch"] == arch and d["vllm_moe_backends_on_arch"] == backends
        assert d["w13"]["value"]["layout"] == value and d["w2"]["scale"]["layout"] == scale
        assert d["bit_twiddle"] is (arch == "sm90")
        assert arch.upper()[:5] in d["engine_compat"]["gpu"].upper()
    assert LAYOUT.hidden_warning(2880, LAYOUT.resolve_options({"arch": "sm100"})) is None


def test_arch_is_the_enum_and_the_manifest_keeps_its_string() -> None:
    o = LAYOUT.resolve_options({"arch": "gfx950"})
    assert o.arch is Arch.GFX950 and LAYOUT.resolve_options().arch is Arch.SM90
    doc = o.to_json()
    assert type(doc["arch"]) is str and json.dumps(doc).endswith('"arch": "gfx950"}')
    assert LAYOUT.resolve_options(json.loads(json.dumps(doc))) == o
    with pytest.raises(LayoutError, match="arch='sm80': choose one of sm90, sm100, sm120, gfx950, gfx1250"):
        TritonOptions(arch="sm80")  # type: ignore[arg-type]


def test_arch_shares_the_engine_picks_gpu_values() -> None:
    from mxconv.layouts.engine_picks import Gpu

    shared = [g for g in Gpu if g is not Gpu.CPU]
    assert [(a.name, a.value) for a in Arch][: len(shared)] == [(g.name, g.value) for g in shared]


@pytest.mark.parametrize("arch", ["sm100", "sm120", "gfx950", "gfx1250"])
@pytest.mark.parametrize("option,value", [("triton_layout", "3.6"), ("num_warps", "4"), ("scale_k_align", "1")])
def test_hopper_only_options_are_refused_for_another_arch(arch: str, option: str, value: str) -> None:
    with pytest.raises(LayoutError, match=rf"layout option {option}={value} applies to arch sm90 only; arch {arch} "):
        LAYOUT.resolve_options({"arch": arch, option: value})
    assert getattr(LAYOUT.resolve_options({"arch": "sm90", option: value}), option) == type(getattr(TritonOptions(), option))(value)


def test_manifest_of_another_arch_records_no_hopper_only_value() -> None:
    c = make_stack(1, 512, 256, "interleaved", bias=False, seed=4)
    for arch in ("sm100", "gfx950"):
        o = LAYOUT.resolve_options({"arch": arch})
        d = LAYOUT.describe(c.sizes(*LAYOUT.padded_sizes(512, 256, "interleaved", "bf16", o)), "bf16", o)
        assert d["triton_layout"] is None and d["num_warps"] is None and d["scale_k_align"] == 1
        assert d["w13"]["scale"]["num_warps"] is None and d["w2"]["scale"]["num_warps"] is None
    o = LAYOUT.resolve_options({"num_warps": "4"})
    d = LAYOUT.describe(c.sizes(*LAYOUT.padded_sizes(512, 256, "interleaved", "bf16", o)), "bf16", o)
    assert (d["triton_layout"], d["num_warps"], d["w13"]["scale"]["num_warps"], d["scale_k_align"]) == ("3.5", 4, 4, 4)


def test_kernel_runner_refuses_other_arch_storage() -> None:
    from mxconv.engines.triton_moe import RUNNER
    from mxconv.source.manifest import LayoutPart

    layout = LayoutPart(name="triton", version=1, engine_compat={}, hidden_size=512, intermediate_size=256, padded_hidden_size=512,
                        padded_intermediate_size=256, w13_row_order="interleaved", kernel_params=None,
                        extra={"arch": "gfx950"})  # fmt: skip
    why = RUNNER.kernel_unavailable(layout, "cpu")
    assert why is not None and "gfx950" in why and "arch=sm90" in why


# ---------------------------------------------------------------------------------------------
# triton_kernels 3.8 (matmul API): the Hopper storage is the 3.6 storage
# ---------------------------------------------------------------------------------------------


def test_38_writes_the_36_bytes_and_says_so() -> None:
    c = make_stack(2, 352, 160, "halves", seed=5)
    o36, o38 = LAYOUT.resolve_options({"triton_layout": "3.6"}), LAYOUT.resolve_options({"triton_layout": "3.8"})
    k36, k38 = LAYOUT.to_kernel(c, "bf16", o36), LAYOUT.to_kernel(c, "bf16", o38)
    assert k36.keys() == k38.keys() and all(torch.equal(k36[n], k38[n]) for n in k36)
    d = LAYOUT.describe(c.sizes(352, 192), "bf16", o38)
    assert d["triton_layout"] == "3.8" and "3.6 bytes" in d["engine_compat"]["vllm"]
    assert d["value_padding"] == {"rows": 64, "row_bytes": 64}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_38_hopper_bytes_equal_its_own_classes(shape: tuple[int, int, int]) -> None:
    """With a 3.8-generation triton_kernels tree (matmul API; ``$MXCONV_TRITON_KERNELS_38`` = the
    folder holding the package): layout instances with mx_axis=-2, as its matmul takes them."""
    root = os.environ.get("MXCONV_TRITON_KERNELS_38")
    if not root:
        pytest.skip("set MXCONV_TRITON_KERNELS_38 to a triton_kernels 3.8 tree (python/triton_kernels of triton main)")
    tensor, layout = _import_tk(root)
    if not hasattr(layout.HopperMXValueLayout, "make_transformation"):
        pytest.skip(f"{root} is not a 3.8-generation triton_kernels")
    o = LAYOUT.resolve_options({"triton_layout": "3.8"})
    c = make_stack(*shape, "interleaved", bias=False, seed=shape[2])
    got = LAYOUT.to_kernel(c, "bf16", o)
    for w, (wp, sp) in vllm_inputs(c, o).items():
        v = tensor.convert_layout(tensor.wrap_torch_tensor(wp.transpose(-2, -1), dtype=tensor.FP4),
                                  layout.HopperMXValueLayout(mx_axis=-2, mma_version=3))
        s = tensor.convert_layout(tensor.wrap_torch_tensor(sp.transpose(-2, -1)),
                                  layout.HopperMXScaleLayout(mx_axis=-2, num_warps=o.num_warps))
        assert torch.equal(v.storage.data.mT.contiguous(), got[f"{w}_weight"]), w
        assert torch.equal(s.storage.data.mT.contiguous(), got[f"{w}_weight_scale"]), w
    with pytest.raises(AssertionError):  # vLLM 0.33's CUDA call passes mx_axis=1, which 3.8 rejects
        layout.HopperMXValueLayout(mx_axis=1, mma_version=3)
