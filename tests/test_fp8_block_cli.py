"""``mxconv quantize --format fp8-block`` end to end: the DeepSeek-V3 style checkpoint (tensors,
quantization_config naming every other Linear), the manifest's tile counts, ``--require-exact``,
``verify --reference`` (bit-equal tiles against MXFP4, thresholds against floats) and the gpt-oss refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.cli import mx
from support.tamper import patch_tensor
from support.workspace import MadeCheckpoints, copy_checkpoint

from mxconv.mx.numerics import dequantize_fp8_block, dequantize_mx

LAYER0 = "model.layers.0.mlp.experts.1.up_proj"


def _tensor(ckpt: Path, name: str) -> torch.Tensor:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(ckpt / index[name]), "pt") as f:
        return f.get_tensor(name)


def _run(*args: object) -> tuple[int, str, str]:
    return mx(*args, "--device", "cpu", "--quiet")


@pytest.fixture(scope="module")
def mx4(made: MadeCheckpoints) -> Path:
    return made.quantize(made.source("qwen3-moe").path, "--format", "mxfp4")


def test_float_source_writes_the_deepseek_convention(made: MadeCheckpoints) -> None:
    src = made.source("qwen3-moe").path
    out = made.quantize(src, "--format", "fp8-block")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert "model.layers.0.self_attn.q_proj" in qc["modules_to_not_convert"]
    assert not any(".experts." in m for m in qc["modules_to_not_convert"])
    w, s = _tensor(out, f"{LAYER0}.weight"), _tensor(out, f"{LAYER0}.weight_scale_inv")
    ref = _tensor(src, f"{LAYER0}.weight").float()
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (-(-ref.shape[0] // 128), -(-ref.shape[1] // 128))
    assert float(s[0, 0]) == float(ref[:128, :128].abs().max() / 448)
    m = json.loads((out / "mxconv.json").read_text())
    assert m["weight_format"] == "fp8-block" and m["scale_rounding"] is None
    assert m["quant_config"]["block_shape"] == [128, 128] and m["fp8_tiles"]["inexact_tiles"] == 0
    code, stdout, err = mx("verify", out, "--reference", src, "--json")
    assert code == 0, err
    assert {r["threshold"] for r in json.loads(stdout)["layers"]} == {"fp8-block"}


def test_mxfp4_source_is_exact_and_verifies_bit_equal(made: MadeCheckpoints, mx4: Path) -> None:
    out = made.quantize(mx4, "--format", "fp8-block")
    deq = dequantize_fp8_block(_tensor(out, f"{LAYER0}.weight")[None], _tensor(out, f"{LAYER0}.weight_scale_inv")[None], (128, 128))
    ref = dequantize_mx(_tensor(mx4, f"{LAYER0}.weight_packed"), _tensor(mx4, f"{LAYER0}.weight_scale"), "mxfp4")
    assert torch.equal(deq[0].view(torch.int32), ref.view(torch.int32))
    code, stdout, err = mx("verify", out, "--reference", mx4, "--json")
    assert code == 0, err
    layers = json.loads(stdout)["layers"]
    assert {r["threshold"] for r in layers} == {"exact"} and all(r["fp8_tiles"]["inexact"] == 0 for r in layers)


def _spread(mx4: Path, tmp_path: Path) -> Path:
    """A copy of the MXFP4 output whose layer-0 expert-1 up_proj has one group 40 binades down."""
    bad = copy_checkpoint(mx4, tmp_path / "spread")

    def lower(s: torch.Tensor) -> torch.Tensor:
        s = s.clone()
        s[3, 1] = max(1, int(s[3, 1]) - 40)
        return s

    patch_tensor(bad, f"{LAYER0}.weight_scale", lower, fix_manifest=True)
    return bad


def test_inexact_block_is_counted_and_refused_with_require_exact(mx4: Path, tmp_path: Path) -> None:
    bad = _spread(mx4, tmp_path)
    code, _, err = _run("quantize", bad, tmp_path / "strict", "--format", "fp8-block", "--require-exact")
    assert code == 2
    assert "layer 0 (model.layers.0.mlp.experts) expert 1 up: 128x128 block [0, 0]" in err
    assert not (tmp_path / "strict").exists()
    code, _, err = _run("quantize", bad, tmp_path / "lossy", "--format", "fp8-block")
    assert code == 0, err
    tiles = json.loads((tmp_path / "lossy" / "mxconv.json").read_text())["fp8_tiles"]
    assert tiles["inexact_tiles"] == 1 and tiles["layers"]["0"]["inexact"] == 1 and tiles["layers"]["1"]["inexact"] == 0
    assert tiles["max_abs_error"] > 0 and "expert 1 up" in tiles["layers"]["0"]["max_error_at"]
    code, stdout, err = mx("verify", tmp_path / "lossy", "--reference", bad, "--json")
    layer0 = json.loads(stdout)["layers"][0]
    assert code == 0, err
    assert layer0["fp8_tiles"]["inexact"] == 1 and layer0["threshold"] == "fp8-block"


def test_gpt_oss_is_refused_with_its_reason(made: MadeCheckpoints, tmp_path: Path) -> None:
    code, _, err = _run("quantize", made.source("gpt-oss-mxfp4").path, tmp_path / "o", "--format", "fp8-block")
    assert code == 2 and "no loader reads a block-FP8 gpt-oss" in err and "_load_weights_other" in err


@pytest.mark.parametrize("flags, message", [
    (("--format", "mxfp4", "--require-exact"), "--require-exact applies to --format fp8-block"),
    (("--format", "fp8-block", "--scale-rounding", "floor"), "fp8-block tile scales"),
])
def test_flags_refused(made: MadeCheckpoints, tmp_path: Path, flags: tuple[str, ...], message: str) -> None:
    code, _, err = _run("quantize", made.source("qwen3-moe").path, tmp_path / "o", *flags)
    assert code == 2 and message in err


def test_partial_ignore_lists_the_float_layer_for_loaders_and_verifies(made: MadeCheckpoints) -> None:
    src = made.source("qwen3-moe").path
    out = made.quantize(src, "--format", "fp8-block", "--ignore", "layers.1")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # vLLM's Fp8Config matches the FusedMoE prefix exactly; transformers' fused experts module has the same name
    assert "model.layers.1.mlp.experts" in qc["modules_to_not_convert"]
    assert "model.layers.0.mlp.experts" not in qc["modules_to_not_convert"]
    kept = "model.layers.1.mlp.experts.2.down_proj.weight"
    assert torch.equal(_tensor(out, kept), _tensor(src, kept)) and _tensor(out, kept).dtype == torch.bfloat16
    assert _tensor(out, f"{LAYER0}.weight").dtype == torch.float8_e4m3fn
    m = json.loads((out / "mxconv.json").read_text())
    assert [r["layer"] for r in m["layers"]] == [0] and set(m["fp8_tiles"]["layers"]) == {"0"}
    code, stdout, err = mx("verify", out, "--reference", src, "--json")
    assert code == 0, err
    assert [r["layer"] for r in json.loads(stdout)["layers"]] == [0]


def test_partial_ignore_of_an_mxfp4_layer_is_refused(mx4: Path, tmp_path: Path) -> None:
    code, _, err = _run("quantize", mx4, tmp_path / "o", "--format", "fp8-block", "--include", "layers.0")
    assert code == 2
    assert "model.layers.1.mlp.experts: --include/--ignore leave this mxfp4 MoE layer as it is" in err
    assert "loaders read as float weights" in err and not (tmp_path / "o").exists()


def test_an_unlisted_float_layer_under_an_fp8_config_is_refused(made: MadeCheckpoints, tmp_path: Path) -> None:
    out = made.quantize(made.source("qwen3-moe").path, "--format", "fp8-block", "--ignore", "layers.1")
    bad = copy_checkpoint(out, tmp_path / "unlisted")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].remove("model.layers.1.mlp.experts")
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = mx("verify", bad)
    assert code != 0 and "model.layers.1.mlp.experts.0" in err and "quantization_config says fp8_block" in err
