"""vLLM 0.33's padding per platform (``mxfp4_round_up_hidden_size_and_intermediate_size``'s ROCm branch),
taken from the GPU a layout records: the triton layout's sizes come from that one table, and a gfx950
output is served by TRITON and AITER_TRITON_MXFP4_BF16 (manifest, inspect, inspect --engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.checkpoints import ModelSizes, make_checkpoint
from support.cli import mx

from mxconv.families import detect_family
from mxconv.layouts.engine_picks import VLLM, Gpu, SourceKind, picks
from mxconv.layouts.engine_report import engine_padding, pick_row
from mxconv.layouts.triton import LAYOUT
from mxconv.layouts.triton_arch import Arch
from mxconv.layouts.vllm_backends import (
    Platform,
    platform_of,
    vllm_padded_sizes,
    vllm_refusal,
)
from mxconv.run.conversion import Conversion, RunSettings
from mxconv.run.options import QuantOptions, RepackOptions
from mxconv.run.plan import build_plan
from mxconv.source.checkpoint import open_checkpoint

SWIGLU = {"activation": "swigluoai", "has_expert_bias": True}


def test_platform_of_recorded_arch() -> None:
    assert [platform_of(a) for a in ("sm90", "sm120", "gfx950", "gfx942", None)] == [
        Platform.CUDA, Platform.CUDA, Platform.ROCM_CDNA4, Platform.ROCM, None]


def test_rocm_branch_of_the_table() -> None:
    """gpt-oss sizes per rank at TP 1 and 2 (H = 2880, I = 2880 / 1440) and silu's exceptions."""
    rocm = Platform.ROCM_CDNA4
    assert vllm_padded_sizes("TRITON", 2880, 1440, "swigluoai") == (2880, 1472)  # CUDA, as before
    assert vllm_padded_sizes("TRITON", 2880, 1440, "swigluoai", rocm) == (3072, 1536)
    assert vllm_padded_sizes("TRITON", 2880, 2880, "silu", rocm) == (3072, 3072)
    for backend in ("AITER_TRITON_MXFP4_BF16", "AITER_MXFP4_FP8", "AITER_TRITON_MXFP4_MXFP4"):
        assert vllm_padded_sizes(backend, 2880, 1440, "swigluoai") == (3072, 1536), backend  # home: ROCm
        assert vllm_padded_sizes(backend, 2880, 1440, "silu", rocm) == (3072, 1536), backend
    # TRITON_UNFUSED: block_k 128 off CDNA4 for silu/situ, 256 on gfx950
    assert vllm_padded_sizes("TRITON_UNFUSED", 2880, 1440, "silu", Platform.ROCM) == (2944, 1536)
    assert vllm_padded_sizes("TRITON_UNFUSED", 2880, 1440, "silu", rocm) == (3072, 1536)
    # unchanged: AITER CK rules, branches vLLM takes before the ROCm one, the CUDA default
    assert vllm_padded_sizes("AITER_MXFP4_MXFP4", 2880, 1440, "swigluoai", rocm) == (3072, 1536)
    assert vllm_padded_sizes("AITER_MXFP4_BF16", 2880, 1440, "silu") == (2944, 1536)
    assert vllm_padded_sizes("EMULATION", 2880, 1440, "silu", rocm) == (2880, 1440)
    assert vllm_padded_sizes("XPU", 2880, 1440, "silu", rocm) == (2880, 1472)


@pytest.mark.parametrize("arch", [a.value for a in Arch])
@pytest.mark.parametrize("hidden,inter", [(2880, 1440), (352, 160), (96, 64), (4096, 768)])
def test_triton_layout_pads_as_the_table_says(arch: str, hidden: int, inter: int) -> None:
    opts = LAYOUT.resolve_options({"arch": arch})
    want = vllm_padded_sizes("TRITON", hidden, inter, "swigluoai", platform_of(arch))
    assert LAYOUT.padded_sizes(hidden, inter, "interleaved", "bf16", opts) == want


def test_refusals_by_platform_and_tp() -> None:
    cuda_sizes, rocm_sizes = (2880, 1440, 2880, 1472), (2880, 1440, 3072, 1536)
    assert vllm_refusal("TRITON", rocm_sizes, SWIGLU, None, arch="gfx950") is None
    assert vllm_refusal("AITER_TRITON_MXFP4_BF16", rocm_sizes, SWIGLU, None, arch="gfx950") is None
    assert vllm_refusal("TRITON", cuda_sizes, SWIGLU, None, arch="gfx950") == (
        "vLLM pads (H, I) = (2880, 1440) to (3072, 1536) for TRITON; these tensors are padded to (2880, 1472)")
    assert vllm_refusal("AITER_TRITON_MXFP4_BF16", cuda_sizes, SWIGLU, None, arch="sm100") == (
        "AITER_TRITON_MXFP4_BF16 runs on ROCm only; these bytes are for sm100")
    assert vllm_refusal("MARLIN", (2880, 1440, 3072, 1536), SWIGLU, None, arch="gfx950") == (
        "MARLIN runs on CUDA only; these bytes are for gfx950")
    assert vllm_refusal("TRITON", rocm_sizes, SWIGLU, None, arch="gfx950", tp=4) == (
        "vLLM swizzles TRITON scales for CDNA4 at TP <= 2 only (should_use_cdna4_mx_scale_swizzle); this output is for TP 4")
    assert vllm_refusal("AITER_TRITON_MXFP4_BF16", rocm_sizes, {"activation": "silu"}, None, arch="gfx950") is None
    assert vllm_refusal("TRITON", rocm_sizes, {"activation": "silu"}, None, arch="gfx950") == (
        "TRITON runs swigluoai only; the model uses silu")


def _convert(src: Path, out: Path, repack: RepackOptions | None) -> Path:
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), QuantOptions(), repack)
    Conversion(plan).run(out, device=torch.device("cpu"), settings=RunSettings(10**9, True, argv=("test",)))
    return out


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Triton outputs (output directories): gfx950 from gpt-oss MXFP4 and from qwen3-moe (silu, halves
    rows) at TP 1, gpt-oss gfx950 at TP 2 and gpt-oss sm100."""
    root = tmp_path_factory.mktemp("rocm")
    gpt = make_checkpoint(root / "gpt", "gpt-oss-mxfp4").path
    qwen = _convert(make_checkpoint(root / "qwen", "qwen3-moe").path, root / "qwen-q4", None)
    wide = make_checkpoint(root / "wide", "gpt-oss-mxfp4", ModelSizes(intermediate_size=128)).path  # 2 ranks of 64
    runs = {"gpt": (gpt, 1, "gfx950"), "qwen": (qwen, 1, "gfx950"), "gpt-tp2": (wide, 2, "gfx950"), "gpt-sm100": (gpt, 1, "sm100")}
    return {k: _convert(src, root / f"out-{k}", RepackOptions("triton", "bf16", tp, {"arch": arch})) for k, (src, tp, arch) in runs.items()}


def _manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / "mxconv.json").read_text())


def test_gfx950_outputs_list_the_rocm_backends(outputs: dict[str, Path]) -> None:
    gpt = _manifest(outputs["gpt"])
    assert gpt["layout"]["arch"] == "gfx950" and gpt["served_vllm_backends"] == ["TRITON", "AITER_TRITON_MXFP4_BF16"]
    lay = gpt["layout"]
    assert (lay["padded_hidden_size"], lay["padded_intermediate_size"]) == vllm_padded_sizes(
        "TRITON", lay["hidden_size"], lay["intermediate_size"], "swigluoai", Platform.ROCM_CDNA4)
    qwen = _manifest(outputs["qwen"])["quant_config"]  # silu, halves rows: vLLM interleaves them for AITER Triton
    assert qwen["served_vllm_backends"] == ["AITER_TRITON_MXFP4_BF16"]
    assert qwen["not_served"] == {"TRITON": "TRITON runs swigluoai only; the model uses silu"}
    tp2 = _manifest(outputs["gpt-tp2"])  # the CDNA4 scale swizzle vLLM keeps up to TP 2
    assert tp2["tp_size"] == 2 and tp2["served_vllm_backends"] == ["TRITON", "AITER_TRITON_MXFP4_BF16"]
    sm100 = _manifest(outputs["gpt-sm100"])
    assert sm100["served_vllm_backends"] == ["TRITON"] and sm100["quant_config"]["not_served"] == {
        "AITER_TRITON_MXFP4_BF16": "AITER_TRITON_MXFP4_BF16 runs on ROCm only; these bytes are for sm100"}


@pytest.mark.parametrize("tp", [4, 8])
def test_gfx950_above_tp2_is_refused_at_planning(tmp_path: Path, tp: int) -> None:
    """vLLM keeps the scales strided above TP 2 (no CDNA4 swizzle): no engine would hold the bytes."""
    src = make_checkpoint(tmp_path / "wide", "gpt-oss-mxfp4", ModelSizes(intermediate_size=256)).path
    out = tmp_path / "out"
    code, stdout, err = mx("repack", src, out, "--backend", "triton", "--layout-option", "arch=gfx950",
                           "--tp", str(tp), "--dry-run")  # fmt: skip
    assert code == 2 and not out.exists(), stdout + err
    assert f"--tp {tp} --backend triton: arch=gfx950 writes CDNA4MXScaleLayout scales" in err
    assert "should_use_cdna4_mx_scale_swizzle" in err and "repack with --tp 2 or less" in err
    for arch, tp_ok in (("gfx950", 2), ("gfx1250", tp), ("sm90", tp)):
        assert LAYOUT.tp_refusal(tp_ok, LAYOUT.resolve_options({"arch": arch})) is None


def test_inspect_and_verify_agree(outputs: dict[str, Path]) -> None:
    code, out, err = mx("inspect", str(outputs["gpt"]), "--json")
    assert code == 0, err
    assert json.loads(out)["served_vllm_backends"] == ["TRITON", "AITER_TRITON_MXFP4_BF16"]
    code, out, err = mx("verify", str(outputs["gpt"]))
    assert code == 0, out + err


def test_engine_report_on_gfx950_uses_rocm_padding_and_the_gfx950_output() -> None:
    model = {"hidden_size": 2880, "intermediate_size": 2880, "activation": "swigluoai", "has_expert_bias": True,
             "num_experts": 4, "row_order": "interleaved"}
    pick = picks(VLLM, SourceKind.GPT_OSS_MXFP4, Gpu.GFX950)
    assert pick is not None and engine_padding(pick, 2880, 2880, "swigluoai") == (3072, 3072)
    row = pick_row(VLLM, SourceKind.GPT_OSS_MXFP4, Gpu.GFX950, model)
    held = {h["output"]: h for h in row["held_by"]}
    triton = held["repack --backend triton --activation bf16 --layout-option arch=gfx950"]
    assert row["engine_padding"] == [3072, 3072] and triton["padded"] == [3072, 3072] and triton["refusal"] is None
    sm90 = pick_row(VLLM, SourceKind.GPT_OSS_MXFP4, Gpu.SM90, model)
    assert "repack --backend triton --activation bf16" in {h["output"] for h in sm90["held_by"]}


def _aiter_shuffle_scale_moe() -> Any:
    """``shuffle_scale_moe`` of aiter's ``aiter/ops/triton/utils/shuffle.py`` (pure torch), loaded from
    ``$MXCONV_AITER_SHUFFLE`` (a copy of that file, never vendored here) with its two aiter imports
    stubbed; skipped when unset."""
    import importlib.util
    import os
    import sys
    import types

    path = os.environ.get("MXCONV_AITER_SHUFFLE")
    if not path:
        pytest.skip("set MXCONV_AITER_SHUFFLE to a copy of aiter/ops/triton/utils/shuffle.py")
    stubs = {"aiter": types.ModuleType("aiter"), "aiter.ops": types.ModuleType("aiter.ops"),
             "aiter.ops.shuffle": types.ModuleType("aiter.ops.shuffle"),
             "aiter.ops.triton.utils._triton.arch_info": types.ModuleType("arch_info")}
    stubs["aiter.ops.shuffle"].shuffle_weight = None  # type: ignore[attr-defined]
    stubs["aiter.ops.triton.utils._triton.arch_info"].get_arch = lambda: "gfx1250"  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("aiter_shuffle_copy", path)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod.shuffle_scale_moe


@pytest.mark.parametrize("shape", [(3, 352, 160), (1, 2880, 1440)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
def test_gfx1250_scales_equal_aiter_shuffle_scale_moe(shape: tuple[int, int, int], row_order: str) -> None:
    """vLLM's _swizzle_mxfp4 on gfx1250: values strided (canonical bytes), scales [E, K/32, N] through
    shuffle_scale_moe(arch="gfx1250", preshuffle_factor=32, scale_kwidth=4), then StridedLayout:
    the stored buffer is the shuffled tensor's ``.mT``, contiguous."""
    from test_layout_gpu import make_stack
    from test_layout_triton_arch import vendored, vllm_inputs

    shuffle = _aiter_shuffle_scale_moe()
    tensor, layout = vendored()
    opts = LAYOUT.resolve_options({"arch": "gfx1250"})
    c = make_stack(*shape, row_order, seed=sum(shape))
    got = LAYOUT.to_kernel(c, "bf16", opts)
    for w, (values, scales) in vllm_inputs(c, opts).items():
        tiled = shuffle(scales.transpose(-2, -1), arch="gfx1250", preshuffle_factor=32, scale_kwidth=4)
        s = tensor.convert_layout(tensor.wrap_torch_tensor(tiled), layout.StridedLayout)
        v = tensor.convert_layout(tensor.wrap_torch_tensor(values.transpose(-2, -1), dtype=tensor.FP4), layout.StridedLayout)
        assert torch.equal(got[f"{w}_weight_scale"], s.storage.data.mT.contiguous()), w
        assert torch.equal(got[f"{w}_weight"], v.storage.data.mT.contiguous()), w
    sizes = c.sizes(*LAYOUT.padded_sizes(c.hidden_size, c.intermediate_size, row_order, "bf16", opts))
    back = LAYOUT.from_kernel(got, sizes, "bf16", opts)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, name), getattr(c, name)), name


def test_gfx1250_scale_map_worked_example_and_padding() -> None:
    """Independent of aiter: buffer row n0, column (k0*32 + r32)*4 + k4 holds source row 32 n0 + r32,
    column 4 k0 + k4; vLLM pads TRITON to 256/256 on ROCm outside CDNA4 too; no TP limit."""
    from mxconv.layouts.triton_arch import decode, encode

    x = torch.arange(64 * 8, dtype=torch.int32).reshape(1, 64, 8)  # rows 64, columns 8
    _, buf = encode("gfx1250", torch.zeros(1, 64, 4, dtype=torch.uint8), x, 8)
    assert buf.shape == (1, 2, 256)
    n0, r32, k0, k4 = 1, 5, 1, 3
    assert buf[0, n0, (k0 * 32 + r32) * 4 + k4] == x[0, 32 * n0 + r32, 4 * k0 + k4]
    assert torch.equal(decode("gfx1250", torch.zeros(1, 64, 4, dtype=torch.uint8), buf, 8)[1], x)
    opts = LAYOUT.resolve_options({"arch": "gfx1250"})
    assert LAYOUT.padded_sizes(2880, 1440, "interleaved", "bf16", opts) == (3072, 1536)
    assert vllm_refusal("TRITON", (2880, 1440, 3072, 1536), SWIGLU, None, arch="gfx1250", tp=8) is None
