"""``mxconv demo`` runs every format and backend on its tiny sources and passes; a format a family
does not write is shown as such (the family's own reason), not as a failure."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mxconv.cli.demo import show_results
from mxconv.demo import _declared_refusal, _repack_step, run_demo
from mxconv.errors import BadInput, LayoutError
from mxconv.families import detect_family
from mxconv.layouts import backend_names, get_layout
from mxconv.source.checkpoint import open_checkpoint
from support.checkpoints import make_checkpoint


@pytest.mark.slow  # ~40 s on 2 cores: every backend's repack and verify
def test_the_demo_passes_and_shows_every_format_and_backend(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    result = run_demo(tmp_path, torch.device("cpu"))
    show_results(result, as_json=False, quiet=True, workdir=tmp_path)  # --quiet: the verdict line alone
    assert capsys.readouterr().out == "demo passed\n"
    show_results(result, as_json=False, quiet=False, workdir=None)  # the table names temporary paths: say how to keep them
    assert "to keep them, run: mxconv demo --workdir DIR" in capsys.readouterr().out
    assert result["passed"], [s for s in result["steps"] if not s["ok"]]
    steps = {(s["source"].split(" ")[0], s["step"]): s for s in result["steps"]}
    assert steps["qwen3-moe", "verify fp8-block vs mxfp4"]["rel_rms"] == 0.0  # the exact re-encode
    assert steps["gpt-oss", "quantize fp8-block"]["detail"].startswith("not written: no loader reads a block-FP8 gpt-oss")
    assert ("gpt-oss", "verify fp8-block vs bf16") not in steps
    for backend in backend_names():  # written and verified from some source (xpu: the Qwen one's MXFP8)
        assert any(step.startswith(f"verify {backend} (") for _, step in steps), backend
    # exactly these steps are shown as not written, each with the refusal its family or layout declares
    # (MXFP8 methods create no expert biases; no loader reads a block-FP8 gpt-oss); any other is a failure
    skipped = {key: s["detail"] for key, s in steps.items() if s["detail"].startswith("not written: ")}
    assert set(skipped) == {("gpt-oss", "quantize fp8-block"), ("gpt-oss", "repack xpu (bf16)")}, skipped
    assert skipped["gpt-oss", "repack xpu (bf16)"] == "not written: " + get_layout("xpu").bias_refusal("mxfp8")
    assert steps["qwen3-moe", "verify xpu (bf16) vs mxfp8"]["ok"]


def test_a_planning_error_the_layout_does_not_declare_fails_the_step(tmp_path: Path) -> None:
    """Only a declared refusal (xpu's MXFP8 form and expert biases) is shown as not written; any other
    error while planning a repack, a LayoutError included (here: more TP ranks than the experts have
    blocks of 32), reaches the step, which the demo records as failed."""
    src = make_checkpoint(tmp_path / "g", "gpt-oss-bf16").path
    assert _declared_refusal(src, "xpu", "mxfp8") == get_layout("xpu").bias_refusal("mxfp8")
    assert _declared_refusal(src, "marlin", "mxfp4") is None
    assert _declared_refusal(make_checkpoint(tmp_path / "q", "qwen3-moe").path, "xpu", "mxfp8") is None
    with pytest.raises(LayoutError, match="RepackOptions.tp 64 leaves a rank with no intermediate channels"):
        _repack_step(src, tmp_path / "out", "marlin", "bf16", torch.device("cpu"), tp=64)

def test_format_refusal_is_what_quantized_specs_raise(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "g", "gpt-oss-bf16")
    make_checkpoint(tmp_path / "q", "qwen3-moe")
    gpt, qwen = (detect_family(open_checkpoint(tmp_path / n)) for n in ("g", "q"))
    assert gpt.format_refusal("mxfp4") is None and qwen.format_refusal("fp8-block") is None
    why = gpt.format_refusal("fp8-block")
    assert why and "gpt-oss" in why
    with pytest.raises(BadInput, match=re.escape(why)):
        gpt.quantized_specs(gpt.layer_refs()[0], "fp8-block")
