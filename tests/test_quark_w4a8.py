"""AMD Quark gpt-oss W4A8 sources (per-expert MXFP4 + static FP8 input scales) and the W4A8 output
for vLLM's AITER_MXFP4_FP8 (``repack --backend triton --layout-option arch=gfx950 --activation fp8``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mxconv.families import detect_family
from mxconv.source.checkpoint import open_checkpoint
from mxconv.run.options import QuantOptions, RepackOptions
from support.checkpoints import ModelSizes, make_checkpoint
from support.cli import mx
from support.tamper import patch_tensor
from test_memory_budget import _same_output

GFX950 = ("--backend", "triton", "--layout-option", "arch=gfx950")


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(str(f)))
    return got


def test_reader_gives_the_stored_bytes_and_every_experts_input_scales(tmp_path: Path) -> None:
    truth = make_checkpoint(tmp_path / "src", "gpt-oss-quark-w4a8")
    reader = detect_family(open_checkpoint(tmp_path / "src"))
    assert reader.name == "gpt-oss-quark" and reader.model_info().row_order == "interleaved"
    ref = reader.layer_refs()[1]
    t = truth.layers[1]
    layer = reader.read_layer(ref)
    assert torch.equal(layer.w13_mx.data, t.w13_mx[0]) and torch.equal(layer.w2_mx.scales, t.w2_mx[1])
    assert torch.equal(layer.w13_bias, t.w13_bias) and torch.equal(layer.w2_bias, t.w2_bias)
    assert torch.equal(layer.input_scales.w13, t.input_scales[0]) and torch.equal(layer.input_scales.w2, t.input_scales[1])
    part = reader.read_layer(ref, (1, 3))  # a group of experts keeps the whole layer's input scales
    assert part.first_expert == 1 and torch.equal(part.w2_mx.data, t.w2_mx[0][1:3])
    assert torch.equal(part.input_scales.w13, t.input_scales[0])
    assert reader.source_location(ref, "w13", (2, 5, 7)) == "model.layers.1.mlp.experts.2.gate_up_proj.weight [5, 3]"


@pytest.mark.parametrize("tp", [1, 2])
def test_w4a8_output_is_the_gfx950_bytes_plus_the_max_input_scales(tmp_path: Path, tp: int) -> None:
    truth = make_checkpoint(tmp_path / "src", "gpt-oss-quark-w4a8")
    assert not torch.equal(truth.layers[0].input_scales[0], truth.layers[0].input_scales[0][:1].expand(4))
    rc, _, err = mx("repack", tmp_path / "src", tmp_path / "fp8", *GFX950, "--activation", "fp8", "--tp", str(tp))
    assert rc == 0, err
    rc, _, err = mx("repack", tmp_path / "src", tmp_path / "bf16", *GFX950, "--tp", str(tp))
    assert rc == 0, err
    for rank in range(tp):
        sub = Path(f"rank-{rank}") if tp > 1 else Path()
        fp8, bf16 = _tensors(tmp_path / "fp8" / sub), _tensors(tmp_path / "bf16" / sub)
        for L, t in truth.layers.items():
            p = f"model.layers.{L}.mlp.experts"
            for w in ("w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias"):
                assert torch.equal(fp8[f"{p}.{w}"], bf16[f"{p}.{w}"]), w
            assert fp8[f"{p}.w13_bias"].dtype == torch.float32
            for name, per_expert in zip(("w13_input_scale", "w2_input_scale"), t.input_scales):
                got = fp8[f"{p}.{name}"]
                assert got.shape == () and got.dtype == torch.float32
                assert torch.equal(got, per_expert.max())
            assert f"{p}.w13_input_scale" not in bf16
    rc, out, err = mx("verify", tmp_path / "fp8", "--reference", tmp_path / "src")
    assert rc == 0, out + err


def test_w4a8_in_expert_groups_gives_the_whole_layer_bytes(tmp_path: Path) -> None:
    """Groups of experts (a memory budget) write the layer's reduced scalar once, from every expert."""
    make_checkpoint(tmp_path / "src", "gpt-oss-quark-w4a8", ModelSizes(num_experts=8))
    _same_output(tmp_path / "src", tmp_path, QuantOptions(), RepackOptions("triton", "fp8", 1, {"arch": "gfx950"}))


def test_a_source_without_input_scales_is_refused_naming_them(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "q", "gpt-oss-quark-w4a8", input_scales=False)
    make_checkpoint(tmp_path / "g", "gpt-oss-mxfp4")
    for src in ("q", "g"):
        rc, _, err = mx("repack", tmp_path / src, tmp_path / f"o{src}", *GFX950, "--activation", "fp8")
        assert rc == 2
        assert "model.layers.0.mlp.experts.*.gate_up_proj.input_scale" in err
        assert "model.layers.0.mlp.experts.*.down_proj.input_scale" in err
    rc, _, err = mx("repack", tmp_path / "q", tmp_path / "obf16", *GFX950)  # bf16 activations need none
    assert rc == 0, err


@pytest.mark.parametrize("arch", ["sm90", "sm100", "gfx1250"])
def test_fp8_activation_is_gfx950_only(tmp_path: Path, arch: str) -> None:
    make_checkpoint(tmp_path / "src", "gpt-oss-quark-w4a8")
    rc, _, err = mx("repack", tmp_path / "src", tmp_path / "o", "--backend", "triton", "--layout-option", f"arch={arch}",
                    "--activation", "fp8")
    assert rc == 2 and "gfx950 only" in err


@pytest.mark.parametrize("tp", [1, 2])
def test_verify_fails_a_stored_scale_that_is_not_the_sources_max(tmp_path: Path, tp: int) -> None:
    make_checkpoint(tmp_path / "src", "gpt-oss-quark-w4a8")
    assert mx("repack", tmp_path / "src", tmp_path / "out", *GFX950, "--activation", "fp8", "--tp", str(tp))[0] == 0
    last = tmp_path / "out" / (f"rank-{tp - 1}" if tp > 1 else "")
    patch_tensor(last, "model.layers.1.mlp.experts.w13_input_scale", lambda t: t * 0.5, fix_manifest=tp == 1)
    if tp > 1:  # the manifest's hash of rank 1 made right again, so only the value check can see it
        _fix_rank_hash(tmp_path / "out", tp - 1, "model.layers.1.mlp.experts.w13_input_scale")
    rc, out, err = mx("verify", tmp_path / "out", "--reference", tmp_path / "src")
    assert rc == 1 and "w13_input_scale" in out + err, out + err
    patch_tensor(last, "model.layers.1.mlp.experts.w13_input_scale", lambda t: -t.abs(), fix_manifest=tp == 1)  # negative: not a scale
    if tp > 1:
        _fix_rank_hash(tmp_path / "out", tp - 1, "model.layers.1.mlp.experts.w13_input_scale")
    rc, out, err = mx("verify", tmp_path / "out")
    assert rc == 1 and ("must be finite and positive" in out + err or "differ from rank 0" in out + err), out + err


def _fix_rank_hash(root: Path, rank: int, name: str) -> None:
    """Put the sha256 of ``rank``'s tensor ``name`` as stored into the root manifest."""
    import json

    from mxconv.verify.hashing import sha256_of

    manifest = json.loads((root / "mxconv.json").read_text())
    manifest["tensors"][f"rank-{rank}/{name}"]["sha256"] = sha256_of(open_checkpoint(root / f"rank-{rank}"), name)
    (root / "mxconv.json").write_text(json.dumps(manifest, indent=2))


def test_verify_against_a_reference_without_input_scales_says_so(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "src", "gpt-oss-quark-w4a8")
    assert mx("repack", tmp_path / "src", tmp_path / "out", *GFX950, "--activation", "fp8")[0] == 0
    assert mx("quantize", tmp_path / "src", tmp_path / "q4", "--format", "mxfp4")[0] == 0  # drops the input scales
    rc, out, err = mx("verify", tmp_path / "out", "--reference", tmp_path / "q4")
    assert rc == 1 and "the reference has none to check them against" in " ".join((out + err).split()), out + err


def test_a_source_scale_that_is_not_positive_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "src", "gpt-oss-quark-w4a8")
    name = "model.layers.0.mlp.experts.1.down_proj.input_scale"
    patch_tensor(tmp_path / "src", name, lambda t: t * 0, fix_manifest=False)
    rc, _, err = mx("repack", tmp_path / "src", tmp_path / "out", *GFX950, "--activation", "fp8")
    assert rc == 2 and name in err and "finite and positive" in err, err


def test_quantize_of_a_quark_source_writes_gpt_oss_mxfp4_without_input_scales(tmp_path: Path) -> None:
    truth = make_checkpoint(tmp_path / "src", "gpt-oss-quark-w4a8")
    rc, _, err = mx("quantize", tmp_path / "src", tmp_path / "out", "--format", "mxfp4")
    assert rc == 0, err
    got = _tensors(tmp_path / "out")
    assert not [n for n in got if "input_scale" in n or ".experts.0." in n]
    t = truth.layers[0]
    assert torch.equal(got["model.layers.0.mlp.experts.gate_up_proj_blocks"].reshape(t.w13_mx[0].shape), t.w13_mx[0])
    assert torch.equal(got["model.layers.0.mlp.experts.down_proj_bias"], t.w2_bias)
    reader = detect_family(open_checkpoint(tmp_path / "out"))
    assert reader.name == "gpt-oss"


def test_the_loader_requires_the_input_scales_of_a_w4a8_output(tmp_path: Path) -> None:
    import json

    from mxconv.engines.loader import resolve_layer
    from mxconv.errors import BadInput
    from mxconv.source.manifest import Manifest

    make_checkpoint(tmp_path / "src", "gpt-oss-quark-w4a8")
    assert mx("repack", tmp_path / "src", tmp_path / "out", *GFX950, "--activation", "fp8")[0] == 0
    assert "w13_input_scale" in resolve_layer(tmp_path / "out", 0).files
    manifest = json.loads((tmp_path / "out" / "mxconv.json").read_text())
    del manifest["tensors"]["model.layers.0.mlp.experts.w2_input_scale"]
    with pytest.raises(BadInput, match="lists no model.layers.0.mlp.experts.w2_input_scale"):
        resolve_layer(tmp_path / "out", 0, manifest=Manifest.parse(manifest, "mxconv.json"))


def test_a_config_with_fewer_experts_than_the_tensors_is_refused(tmp_path: Path) -> None:
    import json

    make_checkpoint(tmp_path / "src", "gpt-oss-quark-w4a8")
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    cfg["num_local_experts"] -= 1
    cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], cfg["num_local_experts"])
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    rc, _, err = mx("inspect", tmp_path / "src")
    assert rc == 2 and f"expert {cfg['num_local_experts']} beyond config.json" in err, err
