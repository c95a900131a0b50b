"""MXFP8 in vLLM 0.33's served lists and ``inspect --engine``: a compressed-tensors ``quantize --format
mxfp8`` output is held as is by Fp8MoeBackend.TRITON_MXFP8 (gfx950's default) and EMULATION (the CPU's),
which read the tensors as loaded; mxconv's gpt-oss MXFP8 is loaded by no vLLM method; an MXFP8 kernel
output is compared with the compressed-tensors MXFP8 picks per GPU (HUMMING on sm90, MARLIN on sm120)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.cli import mx

from mxconv.examples import ModelSizes, make_checkpoint
from mxconv.layouts.engine_picks import MXFP8_BACKENDS, VLLM, Gpu, SourceKind
from mxconv.layouts.engine_report import holders, not_held, pick_row
from mxconv.layouts.vllm_backends import home_platform, vllm_refusal
from mxconv.layouts.vllm_serving import VllmMethod

MODEL = {"hidden_size": 2048, "intermediate_size": 768, "activation": "silu", "has_expert_bias": False,
         "num_experts": 8, "row_order": "halves"}  # fmt: skip
# vLLM 0.33.0 fused_moe/oracle/mxfp8.py _SUPPORTED_BACKENDS, checked in
VLLM_MXFP8_BACKENDS = ("FLASHINFER_TRTLLM", "DEEPGEMM", "MARLIN", "XPU", "AITER_MXFP8", "HUMMING", "TRITON_MXFP8", "EMULATION")


def test_every_mxfp8_backend_is_listed_and_who_holds_it_comes_from_the_registry() -> None:
    assert set(MXFP8_BACKENDS) == set(VLLM_MXFP8_BACKENDS)
    for name in VLLM_MXFP8_BACKENDS:
        held, why = holders(name, VllmMethod.CT_MXFP8), not_held(name, VllmMethod.CT_MXFP8)
        assert (why is None) == bool(held), (name, held, why)
        assert not re.search(r"mxconv|layout|manifest|output", MXFP8_BACKENDS[name]), (name, MXFP8_BACKENDS[name])
    # every Fp8MoeBackend vLLM runs MXFP8 experts on is held by some output (XPU, the last, by repack --backend xpu)
    assert all(holders(name, VllmMethod.CT_MXFP8) for name in VLLM_MXFP8_BACKENDS)
    assert [h["output"] for h in holders("XPU", VllmMethod.CT_MXFP8)] == ["repack --backend xpu --activation bf16 --format mxfp8"]
    canonical = [{"output": "canonical (canonical-compressed-tensors)", "layout": "canonical-compressed-tensors",
                  "weight_format": "mxfp8"}]
    assert holders("TRITON_MXFP8", VllmMethod.CT_MXFP8) == canonical
    assert holders("EMULATION", VllmMethod.CT_MXFP8) == canonical
    assert [h["output"] for h in holders("MARLIN", VllmMethod.CT_MXFP8)] == ["repack --backend marlin --activation bf16 --format mxfp8"]


@pytest.mark.parametrize(("gpu", "backend"), [(Gpu.GFX950, "TRITON_MXFP8"), (Gpu.CPU, "EMULATION")])
def test_canonical_mxfp8_rows(gpu: Gpu, backend: str) -> None:
    row = pick_row(VLLM, SourceKind.CT_MXFP8, gpu, MODEL)
    assert row["backend"] == backend and row["engine_padding"] == [2048, 768] and "note" not in row
    assert "fused_moe/oracle/mxfp8.py: _SUPPORTED_BACKENDS, select_mxfp8_moe_backend" in row["cite"]
    assert [(h["output"], h["padded"], h["refusal"]) for h in row["held_by"]] == [
        ("canonical (canonical-compressed-tensors)", [2048, 768], None)]


def test_triton_mxfp8_runs_on_rocm_only() -> None:
    assert home_platform("TRITON_MXFP8") is not None and home_platform("TRITON_MXFP8").is_rocm
    sizes = (2048, 768, 2048, 768)
    assert vllm_refusal("TRITON_MXFP8", sizes, MODEL, None, False, "sm90") == "TRITON_MXFP8 runs on ROCm only; these bytes are for sm90"
    assert vllm_refusal("TRITON_MXFP8", sizes, MODEL, None, False, "gfx950") is None


def _engine_json(path: Path, gpu: str) -> dict:
    code, out, err = mx("inspect", path, "--engine", "vllm-0.33", "--gpu", gpu, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def qwen8(tmp_path_factory) -> dict[str, Path]:
    """A Qwen-style source, its MXFP8 quantization and that repacked for humming and marlin."""
    root = tmp_path_factory.mktemp("engine-mxfp8")
    make_checkpoint(root / "src", "qwen3-moe", ModelSizes(hidden_size=128, intermediate_size=128))
    runs = {"q8": ("quantize", "src", "--format", "mxfp8"), "humming": ("repack", "q8", "--backend", "humming"),
            "marlin": ("repack", "q8", "--backend", "marlin")}  # fmt: skip
    for name, (command, src, *args) in runs.items():
        code, _, err = mx(command, root / src, root / name, *args, "--quiet", "--device", "cpu")
        assert code == 0, err
    return {"src": root / "src", **{name: root / name for name in runs}}


def test_canonical_mxfp8_output_names_its_served_backends(qwen8: dict[str, Path], tmp_path: Path) -> None:
    m = json.loads((qwen8["q8"] / "mxconv.json").read_text())
    assert m["served_vllm_backends"] == ["TRITON_MXFP8", "EMULATION"]
    doc = _engine_json(qwen8["q8"], "gfx950")
    [row] = doc["engine"]["gpus"][0]["rows"]
    assert (row["form"], row["kind"], row["backend"]) == ("as is", "ct-mxfp8", "TRITON_MXFP8")
    assert [h["output"] for h in row["held_by"]] == ["canonical (canonical-compressed-tensors)"]
    # gpt-oss MXFP8 (quant_method null): no vLLM method loads it
    make_checkpoint(tmp_path / "gsrc", "gpt-oss-bf16", ModelSizes(hidden_size=128, intermediate_size=128))
    code, _, err = mx("quantize", tmp_path / "gsrc", tmp_path / "g8", "--format", "mxfp8", "--quiet", "--device", "cpu")
    assert code == 0, err
    assert json.loads((tmp_path / "g8" / "mxconv.json").read_text())["served_vllm_backends"] == []


@pytest.mark.parametrize(("output", "gpu", "backend", "holds"),
                         [("humming", "sm90", "HUMMING", True), ("humming", "sm120", "MARLIN", False),
                          ("marlin", "sm120", "MARLIN", True), ("marlin", "gfx950", "TRITON_MXFP8", False)])  # fmt: skip
def test_mxfp8_kernel_output_is_compared_with_the_mxfp8_picks(qwen8: dict[str, Path], output: str, gpu: str, backend: str,
                                                               holds: bool) -> None:  # fmt: skip
    """Before: an MXFP8 kernel output's canonical form was taken as compressed-tensors MXFP4 (MARLIN on
    sm90 and this output 'not holding it', though its manifest names HUMMING)."""
    doc = _engine_json(qwen8[output], gpu)
    [row] = doc["engine"]["gpus"][0]["rows"]
    assert row["form"].startswith("its canonical mxfp8 form") and row["kind"] == "ct-mxfp8"
    assert (row["backend"], row["this_output_holds_it"]) == (backend, holds)


def test_bf16_source_mxfp8_holder_says_format(qwen8: dict[str, Path]) -> None:
    rows = _engine_json(qwen8["src"], "sm90")["engine"]["gpus"][0]["rows"]
    row = next(r for r in rows if r["form"] == "quantize --format mxfp8")
    assert row["backend"] == "HUMMING"
    assert [h["output"] for h in row["held_by"]] == ["repack --backend humming --activation bf16 --format mxfp8"]


CT_MXFP8 = "CompressedTensorsW8A8Mxfp8MoEMethod"


def test_one_served_by_answer_for_mxfp8_outputs(qwen8: dict[str, Path]) -> None:
    """The manifest, inspect's backend table and inspect --engine ask one rule (layouts.vllm_serving): MXFP8
    outputs are held under the method vLLM loads an MXFP8 checkpoint with, CompressedTensorsW8A8Mxfp8MoEMethod."""
    want = {"q8": ["TRITON_MXFP8", "EMULATION"], "humming": ["HUMMING"], "marlin": ["MARLIN"]}
    for name, backends in want.items():
        m = json.loads((qwen8[name] / "mxconv.json").read_text())
        assert m["served_vllm_methods"] == m["quant_config"]["served_vllm_methods"] == {CT_MXFP8: backends}, name
    code, out, err = mx("inspect", qwen8["q8"], "--json")
    assert code == 0, err
    table = {(b["backend"], b["activation"]): b for b in json.loads(out)["backends"]}
    assert table["humming", "bf16"]["vllm_methods"] == {CT_MXFP8: ["HUMMING"]}
    assert table["marlin", "bf16"]["vllm_methods"] == {CT_MXFP8: ["MARLIN"]}
    row = _engine_json(qwen8["humming"], "sm90")["engine"]["gpus"][0]["rows"][0]
    assert row["method"] == CT_MXFP8 and row["this_output_served"] == {CT_MXFP8: ["HUMMING"]}


def test_mxfp8_holders_print_whole_commands_with_format(qwen8: dict[str, Path]) -> None:
    code, out, err = mx("inspect", qwen8["src"], "--gpu", "sm90")
    assert code == 0, err
    src = qwen8["src"]
    want = f"mxconv repack {src} {src}-humming-bf16-mxfp8 --backend humming --activation bf16 --format mxfp8"
    assert any(line.endswith(want) for line in out.splitlines()), out
    code, out, err = mx("inspect", qwen8["q8"], "--gpu", "cpu")
    assert code == 0, err
    assert any(line.endswith(f"mxconv quantize {qwen8['q8']} {qwen8['q8']}-mxfp8 --format mxfp8") for line in out.splitlines()), out
    assert "HUMMING (ct-mxfp8)" in out and "ct-mxfp8: compressed-tensors MXFP8 (CompressedTensorsW8A8Mxfp8MoEMethod)" in out


def test_an_mxfp8_output_with_expert_biases_is_held_by_no_mxfp8_backend(tmp_path: Path) -> None:
    """Before: gpt-oss experts repacked for humming with --format mxfp8 listed HUMMING as served, though
    CompressedTensorsW8A8Mxfp8MoEMethod (the method loading MXFP8 bytes) creates no expert biases."""
    make_checkpoint(tmp_path / "src", "gpt-oss-bf16", ModelSizes(hidden_size=96, intermediate_size=64))
    code, out, err = mx("repack", tmp_path / "src", tmp_path / "hum", "--backend", "humming", "--format", "mxfp8",
                        "--device", "cpu", "--json")  # fmt: skip
    assert code == 0, err
    m = json.loads((tmp_path / "hum" / "mxconv.json").read_text())
    assert m["served_vllm_backends"] == [] and m["served_vllm_methods"] == {}
    why = f"compressed-tensors MXFP8 ({CT_MXFP8}) creates no expert biases; the model has them"
    assert m["quant_config"]["not_served"] == {"HUMMING": why}
    assert any(n.startswith("note: no vLLM 0.33 MXFP8 MoE backend holds these bytes") and why in n
               for n in json.loads(out)["notes"])  # fmt: skip
