"""Every family through quantize -> verify and repack (every backend) -> verify, plus --include/--ignore."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mxconv.checkpoint import open_checkpoint
from mxconv.convert import QuantOptions, RepackOptions, build_plan, execute
from mxconv.families import detect_family
from mxconv.layouts import BACKENDS
from mxconv.testing import KINDS, make_checkpoint
from mxconv.verify import verify

import torch


def _convert(src: Path, out: Path, q: QuantOptions, r: RepackOptions | None = None) -> dict:
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), "repack" if r else "quantize", q, r)
    return execute(plan, out, device=torch.device("cpu"), max_shard_size=10**9, overwrite=True, argv=["test"])


@pytest.mark.parametrize("kind", KINDS)
def test_family_end_to_end(kind: str, tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", kind).path
    q4 = tmp_path / "q4"
    s = _convert(src, q4, QuantOptions("mxfp4"))
    rep = verify(q4, reference=str(src), tokens=16)
    assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
    if kind != "gpt-oss-mxfp4":
        assert 0.08 < s["relative_rms_error"] < 0.16  # MXFP4 weight error (mx-numerics §6)
    for backend in BACKENDS:
        k = tmp_path / f"k-{backend}"
        _convert(q4, k, QuantOptions(), RepackOptions(backend, {"trtllm": "bf16", "marlin": "bf16", "aiter": "bf16"}[backend]))
        rep = verify(k, reference=str(q4), tokens=16)
        assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
        assert all(r.layout == "bit-exact" for r in rep.layers)
        m = json.loads((k / "mxconv.json").read_text())
        assert m["backend"] == backend and m["layout"]["name"] == backend


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
