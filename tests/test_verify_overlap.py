"""``verify --kernel`` hands the engine the layer tensors verify already read instead of reading them
again (issue 21), without changing a verdict, a message or the order of the problems."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from support.toy_backend import ToyLayout

from mxconv.engines import loader
from mxconv.engines.loader import HeldTensor, held_layer_tensors, resolve_layer, run_kernel_layer
from mxconv.layouts import register_layout, unregister_layout
from mxconv.source.checkpoint import open_checkpoint
from mxconv.source.manifest import load_manifest
from mxconv.verify import VerifyOptions, verify
from mxconv.verify.prefetch import LayerReads
from mxconv.verify.reference_moe import Routing
from mxconv.verify.plan import VerifyPlan, open_output
from mxconv.verify.state import VerifyState


@pytest.fixture(scope="module")
def q4(made) -> Path:
    return made.quantize(made.source("qwen3-moe").path)


@pytest.fixture(scope="module")
def toy_outputs(made, q4: Path):
    """The qwen3-moe MXFP4 checkpoint repacked for the toy backend (a CPU engine runner), TP 1 and 2."""
    register_layout("toy", ToyLayout())
    try:
        yield {tp: made.repack(q4, "toy", "--tp", str(tp)) for tp in (1, 2)}
    finally:
        unregister_layout("toy")


def _no_second_read(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("verify --kernel read the layer from its files a second time")


@pytest.mark.parametrize("tp", [1, 2])
def test_verify_kernel_hands_the_engine_the_tensors_it_read(toy_outputs, q4: Path, tp: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """With every read through the loader refused, verify --kernel still runs the engine on every
    layer (and rank): it wraps the tensors the layout check read."""
    monkeypatch.setattr(loader, "read_layer_tensors", _no_second_read)
    report = verify(toy_outputs[tp], VerifyOptions(reference=str(q4), kernel=True, device="cpu", tokens=8))
    assert report.passed and report.layers, [r.problems for r in report.layers]
    assert all(r.kernel is not None and r.kernel.status == "ok" for r in report.layers)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_held_tensors_give_the_kernel_output_the_files_give(toy_outputs, tp: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """run_kernel_layer on the tensors verify read (no file read allowed) equals run_kernel_layer reading the files."""
    out = toy_outputs[tp]
    manifest = load_manifest(out)
    run = VerifyState(VerifyPlan.build(out, manifest, open_output(out, manifest), VerifyOptions(tokens=8)))
    prefixes = {entry.layer: entry.module_prefix for entry in manifest.layers}
    L = min(prefixes)
    with LayerReads(run, prefixes) as reads:
        held = reads.get(L, []).held()
    assert held is not None and len(held) == tp
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, run.plan.info.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(run.plan.info.num_experts, generator=g)[: run.plan.info.top_k] for _ in range(8)])
    routing = Routing(ids, torch.softmax(torch.randn(8, run.plan.info.top_k, generator=g), -1))
    from_files = run_kernel_layer(out, manifest, L, x, routing)
    monkeypatch.setattr(loader, "read_layer_tensors", _no_second_read)
    from_held = run_kernel_layer(out, manifest, L, x, routing, held=held)
    assert torch.isfinite(from_files).all() and torch.equal(from_held, from_files)


def test_held_tensors_are_used_only_where_they_are_the_files_tensors(toy_outputs) -> None:
    """The same keys from the same files and names: handed over as they are; a key missing, or a
    tensor from another file or name: None (the loader reads the layer from its files)."""
    out = toy_outputs[1]
    src = resolve_layer(out, min(load_manifest(out).layer_numbers))
    ckpt = open_checkpoint(out)
    held = {k: HeldTensor(src.files[k], src.names[k], ckpt.read(src.names[k])) for k in src.files}
    got = held_layer_tensors(src, held, "cpu")
    assert got is not None and all(got[k] is held[k].tensor for k in held)
    first = next(iter(held))
    assert held_layer_tensors(src, {k: h for k, h in held.items() if k != first}, "cpu") is None
    assert held_layer_tensors(src, {**held, first: dataclasses.replace(held[first], name="other")}, "cpu") is None
    assert held_layer_tensors(src, {**held, first: dataclasses.replace(held[first], file=out / "other.safetensors")}, "cpu") is None
