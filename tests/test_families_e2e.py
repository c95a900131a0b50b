"""Every family through quantize -> verify and repack (every backend) -> verify, plus --include/--ignore."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mxconv.source.checkpoint import open_checkpoint
from mxconv.run.conversion import Conversion, RunSettings
from mxconv.run.options import QuantOptions, RepackOptions
from mxconv.run.plan import build_plan
from mxconv.errors import BadInput, LayoutError
from mxconv.families import detect_family
from mxconv.families.gpt_oss import MODULES_TO_NOT_CONVERT
from mxconv.layouts import get_layout
from support.checkpoints import KINDS, ModelSizes, make_checkpoint
from support.registry_cases import format_cases
from mxconv.source.manifest import load_manifest
from mxconv.verify import VerifyOptions, verify

import torch


def _convert(src: Path, out: Path, q: QuantOptions, r: RepackOptions | None = None) -> dict:
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), q, r)
    return Conversion(plan).run(out, device=torch.device("cpu"), settings=RunSettings(10**9, True, argv=("test",)))


@pytest.mark.parametrize("kind", KINDS)
def test_family_end_to_end(kind: str, tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", kind).path
    q4 = tmp_path / "q4"
    s = _convert(src, q4, QuantOptions("mxfp4"))
    rep = verify(q4, VerifyOptions(reference=str(src), tokens=16))
    assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
    if kind != "gpt-oss-mxfp4":
        assert 0.08 < s["relative_rms_error"] < 0.16  # MXFP4 weight error (mx-numerics §6)
    for backend, _ in format_cases(("mxfp4",)):  # q4's experts (MXFP8: below; INT4: tests/test_mxint4.py)
        k = tmp_path / f"k-{backend}"
        _convert(q4, k, QuantOptions(), RepackOptions(backend, get_layout(backend).activations[0]))  # its default
        rep = verify(k, VerifyOptions(reference=str(q4), tokens=16))
        assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
        assert all(r.layout == "bit-exact" for r in rep.layers)
        m = json.loads((k / "mxconv.json").read_text())
        assert m["backend"] == backend and m["layout"]["name"] == backend


@pytest.mark.parametrize("kind", KINDS)
def test_family_end_to_end_mxfp8(kind: str, tmp_path: Path) -> None:
    """quantize --format mxfp8 -> verify, then every backend's MXFP8 form -> verify bit-exact; a form whose
    bytes hold no expert biases refuses a family with them while planning, by its declared refusal."""
    src = make_checkpoint(tmp_path / "src", kind, ModelSizes(hidden_size=128, intermediate_size=128)).path  # I % 64: every form
    q8 = tmp_path / "q8"
    _convert(src, q8, QuantOptions("mxfp8"))
    rep = verify(q8, VerifyOptions(reference=str(src), tokens=16))
    assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
    has_bias = detect_family(open_checkpoint(q8)).model_info().has_expert_bias
    for backend, fmt in format_cases(("mxfp8",)):
        layout, k = get_layout(backend), tmp_path / f"k-{backend}"
        repack = RepackOptions(backend, layout.default_activation(fmt))
        if has_bias and layout.bias_refusal(fmt):
            with pytest.raises(LayoutError, match=re.escape(layout.bias_refusal(fmt))):
                _convert(q8, k, QuantOptions(), repack)
            continue
        _convert(q8, k, QuantOptions(), repack)
        rep = verify(k, VerifyOptions(reference=str(q8), tokens=16))
        assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
        assert all(r.layout == "bit-exact" for r in rep.layers) and load_manifest(k).weight_format == "mxfp8"


def test_mxfp8_from_fp8_ue8m0_is_exact(tmp_path: Path) -> None:
    """Power-of-two-scaled block FP8 -> MXFP8 under rceil loses nothing (mx-numerics §5.3)."""
    src = make_checkpoint(tmp_path / "src", "deepseek-v3.1-fp8-ue8m0").path
    s = _convert(src, tmp_path / "q8", QuantOptions("mxfp8", "rceil"))
    assert s["relative_rms_error"] == 0.0
    s = _convert(src, tmp_path / "q8f", QuantOptions("mxfp8", "floor"))
    assert s["relative_rms_error"] > 0.0  # floor is not exact: some sub-block maxima saturate


def test_include_ignore_select_layers(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    out = tmp_path / "q"
    _convert(src, out, QuantOptions("mxfp4", ignore=r"layers\.0\."))
    m = json.loads((out / "mxconv.json").read_text())
    assert [l["layer"] for l in m["layers"]] == [1]
    names = set(m["tensors"])
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names  # left as it was (bf16)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_packed" in names
    assert m["tensors"]["model.layers.0.mlp.experts.0.gate_proj.weight"]["dtype"] == "BF16"
    _convert(src, tmp_path / "q2", QuantOptions("mxfp4", include=r"layers\.0\."))
    m2 = json.loads((tmp_path / "q2" / "mxconv.json").read_text())
    assert [l["layer"] for l in m2["layers"]] == [0]
    qc = json.loads((tmp_path / "q2" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"][-1] == r"re:(?:.*\.)?layers\.1\.mlp\.experts(?:\.\d+\.(?:gate_proj|up_proj|down_proj))?$"


def _float_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# The config entry that marks layer 1's experts as not converted, per family convention.
_CT_LAYER1 = r"re:(?:.*\.)?layers\.1\.mlp\.experts(?:\.\d+\.(?:gate_proj|up_proj|down_proj))?$"


@pytest.mark.parametrize("kind", ["gpt-oss-bf16", "qwen3-moe", "deepseek-v3-fp8"])
def test_partial_quantize_describes_and_reads_back_skipped_layers(kind: str, tmp_path: Path) -> None:
    """quantize --ignore layer 1: the config lists layer 1's experts as not converted, mxconv reads
    the mixed output back per layer (layer 1 as the source had it), and verify passes."""
    src = make_checkpoint(tmp_path / "src", kind).path
    out = tmp_path / "q"
    _convert(src, out, QuantOptions("mxfp4", ignore=r"layers\.1\."))
    src_cfg = json.loads((src / "config.json").read_text())
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if kind == "gpt-oss-bf16":
        assert qc == {"quant_method": "mxfp4", "modules_to_not_convert": [*MODULES_TO_NOT_CONVERT, "model.layers.1.mlp.experts"]}
    else:
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mxfp4-pack-quantized"
        full = detect_family(open_checkpoint(src)).quantization_config("mxfp4", "rceil")  # every layer converted
        assert qc["ignore"] == [*full["ignore"], _CT_LAYER1]
        assert qc["config_groups"] == full["config_groups"]
        if kind == "deepseek-v3-fp8":  # the unconverted block-FP8 experts keep their tile size
            assert qc["mxconv_unconverted_quantization_config"] == src_cfg["quantization_config"]
        else:
            assert "mxconv_unconverted_quantization_config" not in qc

    src_reader = detect_family(open_checkpoint(src))
    reader = detect_family(open_checkpoint(out))
    assert type(reader) is type(src_reader)
    assert reader.model_info().expert_format == "mxfp4"  # a mixed checkpoint reports its MX format
    refs = reader.layer_refs()
    assert [r.layer for r in refs] == [r.layer for r in src_reader.layer_refs()]
    src_refs = {r.layer: r for r in src_reader.layer_refs()}
    for ref in refs:
        got, want = reader.read_layer(ref), src_reader.read_layer(src_refs[ref.layer])
        if ref.layer == 1:  # unconverted: what the source reads as (fp32 for block-FP8, dequantized alike)
            assert reader.layer_format(ref) == src_reader.layer_format(src_refs[1])
            assert ref.source_names == src_refs[1].source_names
            (g13, g2), (w13, w2) = got.float_weights(), want.float_weights()
            assert not got.is_mx and _float_equal(g13, w13) and _float_equal(g2, w2)
        else:
            assert reader.layer_format(ref) == "mxfp4"
            assert got.is_mx and got.w13_mx.fmt == got.w2_mx.fmt == "mxfp4"
        if want.w13_bias is not None:
            assert torch.equal(got.w13_bias, want.w13_bias) and torch.equal(got.w2_bias, want.w2_bias)
    rep = verify(out, VerifyOptions(reference=str(src), tokens=16))
    assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
    assert [r.layer for r in rep.layers] == [r.layer for r in refs if r.layer != 1]

    # Quantizing the mixed output again with the same selection describes it the same way; with every
    # layer selected, nothing is left unconverted.
    _convert(out, tmp_path / "again", QuantOptions("mxfp4", ignore=r"layers\.1\."))
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"] == qc
    _convert(out, tmp_path / "all", QuantOptions("mxfp4"))
    qc_all = json.loads((tmp_path / "all" / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.experts" not in qc_all.get("modules_to_not_convert", [])
    assert _CT_LAYER1 not in qc_all.get("ignore", []) and "mxconv_unconverted_quantization_config" not in qc_all
    all_reader = detect_family(open_checkpoint(tmp_path / "all"))
    assert {all_reader.layer_format(r) for r in all_reader.layer_refs()} == {"mxfp4"}
    rep = verify(tmp_path / "all", VerifyOptions(reference=str(src), tokens=16))
    assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems


@pytest.mark.parametrize("kind", ["gpt-oss-bf16", "qwen3-moe"])
def test_unconverted_layer_missing_from_config_is_refused(kind: str, tmp_path: Path) -> None:
    """A float layer next to an MX quantization_config that does not list it is refused (a loader
    would take it for MX weights)."""
    src = make_checkpoint(tmp_path / "src", kind).path
    out = tmp_path / "q"
    _convert(src, out, QuantOptions("mxfp4", ignore=r"layers\.1\."))
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    if kind == "gpt-oss-bf16":
        qc["modules_to_not_convert"].remove("model.layers.1.mlp.experts")
        match = r"is BF16 \(unquantized\) and 'model\.layers\.1\.mlp\.experts' is not in quantization_config's modules_to_not_convert"
    else:
        qc["ignore"].remove(_CT_LAYER1)
        match = r"are float, but config\.json's compressed-tensors quantization_config \(MX mxfp4\) does not list layer 1's experts"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInput, match=match):
        detect_family(open_checkpoint(out)).model_info()


def test_partial_quantize_keeps_one_mx_format(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4").path
    ckpt = open_checkpoint(src)
    with pytest.raises(BadInput, match=r"leave this mxfp4 layer as it is, next to mxfp8 layers"):
        build_plan(ckpt, detect_family(ckpt), QuantOptions("mxfp8", ignore=r"layers\.1\."))
    # Same format: the kept layers already are what the config says.
    _convert(src, tmp_path / "q", QuantOptions("mxfp4", ignore=r"layers\.1\."))
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"] == json.loads(
        (src / "config.json").read_text()
    )["quantization_config"]


def test_compressed_tensors_leaves_unconverted_layers_alone(tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    out = tmp_path / "q"
    _convert(src, out, QuantOptions("mxfp4", ignore=r"layers\.1\."))
    tensors = {n: t for f in sorted(out.glob("*.safetensors")) for n, t in load_file(str(f)).items()}
    decoded = CompressedTensorsDequantizer(out, dtype=torch.float32).validate(dict(tensors))
    layer1 = [n for n in tensors if n.startswith("model.layers.1.mlp.experts.")]
    assert layer1 and all(_float_equal(decoded[n], tensors[n]) for n in layer1)
    assert decoded["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.float32  # decompressed MX


@pytest.mark.parametrize("option", ["include", "ignore"])
def test_repack_refuses_include_ignore(option: str, tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    ckpt = open_checkpoint(src)
    q = QuantOptions("mxfp4", **{option: r"layers\.1\."})
    with pytest.raises(BadInput) as ei:
        build_plan(ckpt, detect_family(ckpt), q, RepackOptions("marlin", "bf16"))
    assert str(ei.value) == "repack converts every MoE layer; QuantOptions.include/QuantOptions.ignore apply to quantize only"


def test_repack_cli_has_no_include_ignore() -> None:
    from typer.testing import CliRunner

    from mxconv.cli import app

    runner = CliRunner()
    for option in ("--include", "--ignore"):
        r = runner.invoke(app, ["repack", "src", "out", "--backend", "marlin", option, "x"], env={"COLUMNS": "200"})
        assert r.exit_code == 2 and "No such option" in r.output, r.output
    assert "--include" in runner.invoke(app, ["quantize", "--help"], env={"COLUMNS": "200"}).output


def test_trtllm_intermediate_align_option_reaches_the_plan(tmp_path: Path) -> None:
    """Backend options that change padding go through Layout.padded_sizes (256-aligned Ip here; the default is 128)."""
    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path  # I = 96
    q4 = tmp_path / "q4"
    _convert(src, q4, QuantOptions("mxfp4"))
    k = tmp_path / "k"
    s = _convert(q4, k, QuantOptions(), RepackOptions("trtllm", "bf16", 1, {"intermediate_align": 256}))
    assert s["sizes"]["padded_intermediate_size"] == 256
    m = json.loads((k / "mxconv.json").read_text())
    assert m["layout"]["padded_intermediate_size"] == 256 and m["layout"]["options"] == {"intermediate_align": 256}
    rep = verify(k, VerifyOptions(reference=str(q4), tokens=16))
    assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
