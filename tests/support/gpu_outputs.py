"""Shared setup of the GPU engine tests (test_engines_gpu, test_humming_gpu, test_loader_gpu): the
skip when an engine's kernels are absent, and quantized test checkpoints repacked for backends."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from mxconv.engines import discover
from mxconv.environment import MARLIN_OPS_ENV, TRITON_KERNELS_ENV
from mxconv.errors import BadInput
from support.checkpoints import ModelSizes, make_checkpoint
from support.cli import mx

# (kind, hidden size); I = 192 (TP2 ranks 96 -> 128), E = 8, top-2. triton_kernels' Hopper matmul
# (num_warps 8) needs every output width > 128, hence no smaller sizes.
KINDS = {"gpt": ("gpt-oss-bf16", 160), "qwen": ("qwen3-moe", 192)}
INTERMEDIATE = 192


def need_kernels(backend: str) -> None:
    """Skip (with the discovery message) unless the GPU and kernels of ``backend`` (triton: Hopper
    and triton_kernels; marlin: vLLM's MoE ops) are present."""
    try:
        if backend == "triton":
            discover.check_gpu("cuda", exact=discover.HOPPER, what="triton_kernels' Hopper MX matmul")
            discover.find_triton_kernels()
        else:
            discover.check_gpu("cuda", exact=None, minimum=discover.MARLIN_MIN_CAPABILITY)
            discover.find_marlin_ops()
    except BadInput as exc:
        pytest.skip(f"{backend} kernel not available (set {TRITON_KERNELS_ENV} / {MARLIN_OPS_ENV}): {exc}")


@dataclass
class Case:
    family: str
    q4: Path  # the quantized checkpoint the outputs come from (MXFP4 unless repacked_cases was given another format)
    outputs: dict[str, Path]  # output name (e.g. "marlin-tp2") -> its directory, those repack wrote


def repacked_cases(root: Path, repacks: dict[str, list[str]], *, required: bool, fmt: str = "mxfp4") -> dict[str, Case]:
    """Per family of KINDS: a test checkpoint quantized to ``fmt`` (MXFP4, or MXFP8) on the CPU (``q4``,
    whatever the format), then repacked with each ``repacks`` entry's extra arguments. A failed repack
    fails the setup when ``required``, else it is printed and left out of the case's outputs."""
    out: dict[str, Case] = {}
    for fam, (kind, hidden) in KINDS.items():
        make_checkpoint(root / f"{fam}-src", kind, ModelSizes(hidden_size=hidden, intermediate_size=INTERMEDIATE, num_experts=8, top_k=2))
        q4 = root / f"{fam}-q4" if fmt == "mxfp4" else root / f"{fam}-{fmt}"
        code, stdout, stderr = mx("quantize", root / f"{fam}-src", q4, "--format", fmt, "--quiet", "--device", "cpu")
        assert code == 0, stdout + stderr
        outputs: dict[str, Path] = {}
        pad = ["--layout-option", "pad_hidden=true"] if hidden % 64 else []
        for name, args in repacks.items():
            extra = [*args, *pad] if name.startswith("triton") else args
            code, stdout, stderr = mx("repack", q4, root / f"{fam}-{name}", *extra, "--quiet", "--device", "cpu")
            assert code == 0 or not required, stdout + stderr
            if code == 0:
                outputs[name] = root / f"{fam}-{name}"
            else:
                print(f"repack {fam} {name} failed ({code}): {(stdout + stderr).strip()[-300:]}")
        out[fam] = Case(fam, q4, outputs)
    return out
