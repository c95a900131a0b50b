"""GPU == CPU bytes for whole conversions (quantize both formats, every backend layout).

Marked ``gpu``: skipped without CUDA; run on the device with ``python -m pytest -q -m gpu``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mxconv.source.checkpoint import open_checkpoint
from mxconv.run.conversion import Conversion, RunSettings
from mxconv.run.options import QuantOptions, RepackOptions
from mxconv.run.plan import build_plan
from mxconv.families import detect_family
from mxconv.layouts import backend_names, get_layout
from support.checkpoints import ModelSizes, make_checkpoint

pytestmark = pytest.mark.gpu


def _run(src: Path, out: Path, device: str, q: QuantOptions, r: RepackOptions | None) -> dict:
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), q, r)
    Conversion(plan).run(out, device=torch.device(device), settings=RunSettings(10**9, True, argv=("test",)))
    return json.loads((out / "mxconv.json").read_text())["tensors"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu")
    return {
        "gpt": make_checkpoint(root / "gpt", "gpt-oss-bf16", ModelSizes(hidden_size=288, intermediate_size=320)).path,
        "qwen": make_checkpoint(root / "qwen", "qwen3-moe", ModelSizes(num_experts=8)).path,
        "ds": make_checkpoint(root / "ds", "deepseek-v3-fp8").path,
    }


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("rounding", ["rceil", "floor", "even"])
@pytest.mark.parametrize("src", ["gpt", "qwen", "ds"])
def test_quantize_cuda_equals_cpu(sources, tmp_path: Path, src: str, fmt: str, rounding: str) -> None:
    q = QuantOptions(fmt=fmt, scale_rounding=rounding)
    a = _run(sources[src], tmp_path / "cpu", "cpu", q, None)
    b = _run(sources[src], tmp_path / "cuda", "cuda", q, None)
    assert {k: v["sha256"] for k, v in a.items()} == {k: v["sha256"] for k, v in b.items()}


@pytest.mark.parametrize("backend", [b for b in backend_names() if "mxfp4" in get_layout(b).weight_formats])
@pytest.mark.parametrize("src", ["gpt", "qwen"])
def test_repack_cuda_equals_cpu(sources, tmp_path: Path, src: str, backend: str) -> None:
    layout = get_layout(backend)
    arches = [{}] + [{"arch": a} for o in layout.options if o.name == "arch" for a in o.choices if a != o.default]
    for act in layout.activations:
        if act in layout.input_scale_activations:  # W4A8 needs a source with FP8 input scales
            continue
        for tp in (1, 2):
            for extra in arches:
                r = RepackOptions(backend, act, tp, extra)
                a = _run(sources[src], tmp_path / f"cpu-{act}-{tp}-{extra}", "cpu", QuantOptions(), r)
                b = _run(sources[src], tmp_path / f"cuda-{act}-{tp}-{extra}", "cuda", QuantOptions(), r)
                assert {k: v["sha256"] for k, v in a.items()} == {k: v["sha256"] for k, v in b.items()}, (act, tp, extra)
