"""GPU == CPU bytes for whole conversions (quantize both formats, every backend layout with every weight
format it takes: MXFP4 from bf16 sources, MXFP8 from MXFP8 quantizations, INT4 from the Kimi release).

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
from mxconv.layouts import get_layout
from support.checkpoints import ModelSizes, make_checkpoint
from support.registry_cases import case_id, format_cases, takes_biases

pytestmark = pytest.mark.gpu


def _run(src: Path, out: Path, device: str, q: QuantOptions, r: RepackOptions | None) -> dict:
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), q, r)
    Conversion(plan).run(out, device=torch.device(device), settings=RunSettings(10**9, True, argv=("test",)))
    return json.loads((out / "mxconv.json").read_text())["tensors"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu")
    out = {
        "gpt": make_checkpoint(root / "gpt", "gpt-oss-bf16", ModelSizes(hidden_size=288, intermediate_size=320)).path,
        "qwen": make_checkpoint(root / "qwen", "qwen3-moe", ModelSizes(num_experts=8)).path,
        "ds": make_checkpoint(root / "ds", "deepseek-v3-fp8").path,
        "kimi": make_checkpoint(root / "kimi", "kimi-k2-int4", ModelSizes(intermediate_size=512)).path,  # TP 2: 256 a rank (MxInt4)
    }
    for name, kind in (("gpt8", "gpt-oss-bf16"), ("qwen8", "qwen3-moe")):  # H, I per TP 2 rank multiples of 64: every MXFP8 form
        src = make_checkpoint(root / f"{name}-bf16", kind, ModelSizes(num_experts=8, hidden_size=256, intermediate_size=256)).path
        _run(src, root / name, "cpu", QuantOptions("mxfp8"), None)
        out[name] = root / name
    return out


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("rounding", ["rceil", "floor", "even"])
@pytest.mark.parametrize("src", ["gpt", "qwen", "ds"])
def test_quantize_cuda_equals_cpu(sources, tmp_path: Path, src: str, fmt: str, rounding: str) -> None:
    q = QuantOptions(fmt=fmt, scale_rounding=rounding)
    a = _run(sources[src], tmp_path / "cpu", "cpu", q, None)
    b = _run(sources[src], tmp_path / "cuda", "cuda", q, None)
    assert {k: v["sha256"] for k, v in a.items()} == {k: v["sha256"] for k, v in b.items()}


# the sources of each weight format the repacks read (float ones are quantized to MXFP4 on the way), and those
# with expert biases, which a form declaring a bias refusal is not given
FORMAT_SOURCES = {"mxfp4": ("gpt", "qwen"), "mxfp8": ("gpt8", "qwen8"), "int4": ("kimi",)}
BIASED = ("gpt", "gpt8")
REPACK_CASES = [(s, b, f) for b, f in format_cases() for s in FORMAT_SOURCES[f] if s not in BIASED or takes_biases(b, f)]


def repack_runs(backend: str, fmt: str) -> list[RepackOptions]:
    """Every activation ``backend`` takes for ``fmt`` experts (W4A8 ones need a source with FP8 input scales),
    at TP 1 and 2, with each GPU's storage where the backend has an ``arch`` option."""
    layout = get_layout(backend)
    arches = [{}] + [{"arch": a} for o in layout.options if o.name == "arch" for a in o.choices if a != o.default]
    acts = [a for a in layout.format_activations(fmt) if a not in layout.input_scale_activations]
    return [RepackOptions(backend, act, tp, extra) for act in acts for tp in (1, 2) for extra in arches]


@pytest.mark.parametrize("case", REPACK_CASES, ids=case_id)
def test_repack_cuda_equals_cpu(sources, tmp_path: Path, case: tuple[str, str, str]) -> None:
    src, backend, fmt = case
    for i, r in enumerate(repack_runs(backend, fmt)):
        a = _run(sources[src], tmp_path / f"cpu-{i}", "cpu", QuantOptions(), r)
        b = _run(sources[src], tmp_path / f"cuda-{i}", "cuda", QuantOptions(), r)
        assert {k: v["sha256"] for k, v in a.items()} == {k: v["sha256"] for k, v in b.items()}, r
