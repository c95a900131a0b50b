"""MXFP8 in vLLM 0.33's served lists and ``inspect --engine``: a compressed-tensors ``quantize --format
mxfp8`` output is held as is by Fp8MoeBackend.TRITON_MXFP8 (gfx950's default) and EMULATION (the CPU's),
which read the tensors as loaded; mxconv's gpt-oss MXFP8 is loaded by no vLLM method; an MXFP8 kernel
output is compared with the compressed-tensors MXFP8 picks per GPU (HUMMING on sm90, MARLIN on sm120)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli import mx

from mxconv.examples import make_checkpoint
from mxconv.layouts.engine_picks import MXFP8_BACKENDS, VLLM, Gpu, SourceKind
from mxconv.layouts.engine_report import holders, pick_row
from mxconv.layouts.vllm_backends import home_platform, vllm_refusal

MODEL = {"hidden_size": 2048, "intermediate_size": 768, "activation": "silu", "has_expert_bias": False,
         "num_experts": 8, "row_order": "halves"}  # fmt: skip
# vLLM 0.33.0 fused_moe/oracle/mxfp8.py _SUPPORTED_BACKENDS, checked in
VLLM_MXFP8_BACKENDS = ("FLASHINFER_TRTLLM", "DEEPGEMM", "MARLIN", "XPU", "AITER_MXFP8", "HUMMING", "TRITON_MXFP8", "EMULATION")


def test_every_mxfp8_backend_is_held_or_has_a_reason() -> None:
    assert set(MXFP8_BACKENDS) == set(VLLM_MXFP8_BACKENDS)
    for name in VLLM_MXFP8_BACKENDS:
        held = holders(name, "vllm_mxfp8_backends")
        assert bool(held) != bool(MXFP8_BACKENDS[name]), f"{name}: held {held}, reason {MXFP8_BACKENDS[name]!r}"
    canonical = [{"output": "canonical (canonical-compressed-tensors)", "layout": "canonical-compressed-tensors"}]
    assert holders("TRITON_MXFP8", "vllm_mxfp8_backends") == canonical
    assert holders("EMULATION", "vllm_mxfp8_backends") == canonical
    assert [h["output"] for h in holders("MARLIN", "vllm_mxfp8_backends")] == ["repack --backend marlin --activation bf16 --format mxfp8"]


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
    make_checkpoint(root / "src", "qwen3-moe", hidden_size=128, intermediate_size=128)
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
    make_checkpoint(tmp_path / "gsrc", "gpt-oss-bf16", hidden_size=128, intermediate_size=128)
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
