"""verify starts the first layer's reads before the checks that do not need its bytes (issue 21), and
``verify --kernel`` hands the engine the layer tensors verify already read instead of reading them
again; neither changes a verdict, a message or the order of the problems."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from support.toy_backend import ToyLayout

import mxconv.verify as verify_pkg
from mxconv.engines import loader
from mxconv.engines.loader import HeldTensor, held_layer_tensors, resolve_layer, run_kernel_layer
from mxconv.errors import BadInput
from mxconv.families import detect_family
from mxconv.layouts import register_layout, unregister_layout
from mxconv.source.checkpoint import open_checkpoint
from mxconv.source.file_names import rank_dirs
from mxconv.source.manifest import load_manifest
from mxconv.verify import prefetch, verify
from mxconv.verify.integrity import model_info_of
from mxconv.verify.prefetch import LayerReads, _OnDevice
from mxconv.verify.reference_moe import Routing
from mxconv.verify.report import Run


@pytest.fixture(scope="module")
def q4(made) -> Path:
    return made.quantize(made.source("qwen3-moe").path)


@pytest.fixture(scope="module")
def kernel_out(made, q4: Path) -> Path:
    return made.repack(q4, "marlin")


def _waits_for(event: threading.Event, seen: list[bool], real: Any) -> Any:
    """``real`` that first waits (at most 10 s) for ``event`` and notes whether it came."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        seen.append(event.wait(10))
        return real(*args, **kwargs)

    return wrapped


def _sets(event: threading.Event, real: Any) -> Any:
    """``real`` that sets ``event`` as it starts."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        event.set()
        return real(*args, **kwargs)

    return wrapped


def test_the_first_layers_read_runs_while_the_headers_are_checked(kernel_out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The header checks wait until the output's first layer is being read: they return only
    because that read began before them (it used to begin after the manifest's claims)."""
    reading, seen = threading.Event(), []
    monkeypatch.setattr(prefetch.StagedReader, "read_hashed", _sets(reading, prefetch.StagedReader.read_hashed))
    monkeypatch.setattr(verify_pkg, "check_integrity", _waits_for(reading, seen, verify_pkg.check_integrity))
    report = verify(kernel_out, device="cpu")
    assert seen == [True], "the header checks ran before the first layer's read began"
    assert report.passed and [r.layout for r in report.layers] == ["ok"] * len(report.layers)


def test_the_references_first_read_runs_while_the_claims_are_checked(kernel_out: Path, q4: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The reference's first layer is read as soon as the reference is open, beside the manifest's
    claims; the layers still come out bit-exact against it."""
    reading, seen = threading.Event(), []
    monkeypatch.setattr(_OnDevice, "read", _sets(reading, _OnDevice.read))
    monkeypatch.setattr(verify_pkg, "check_manifest_claims", _waits_for(reading, seen, verify_pkg.check_manifest_claims))
    report = verify(kernel_out, reference=str(q4), device="cpu", tokens=8)
    assert seen == [True], "the manifest's claims were checked before the reference's first read began"
    assert report.passed and report.layers and all(r.layout == "bit-exact" for r in report.layers)
    assert "numerics" in report.scope.checked


def test_a_reference_of_another_model_is_refused_with_the_first_read_in_flight(kernel_out: Path, made) -> None:
    """The refusal is the one it always was, and no reading thread outlives it."""
    other = made.source("gpt-oss-mxfp4").path
    before = threading.active_count()
    with pytest.raises(BadInput, match="a different model"):
        verify(kernel_out, reference=str(other), device="cpu")
    assert threading.active_count() <= before


def test_a_kernel_that_cannot_run_is_still_named_before_a_bad_reference(kernel_out: Path, made) -> None:
    """The order of the refusals holds: --kernel's (no GPU here) comes before the reference's."""
    other = made.source("gpt-oss-mxfp4").path
    with pytest.raises(BadInput, match="--kernel: cannot run the marlin engine kernel here"):
        verify(kernel_out, reference=str(other), kernel=True, device="cpu")


def test_layer_reads_start_a_layer_before_the_reference_is_attached(kernel_out: Path, q4: Path) -> None:
    """A layer started before the reference was open gets its reference layer too, read beside it;
    the output's bytes are those of the files, the reference's those its own reader gives."""
    manifest = load_manifest(kernel_out)
    ckpt = open_checkpoint(kernel_out)
    run = Run(kernel_out, manifest, [ckpt], model_info_of(manifest["model"]), 8, 0, "cpu")
    prefixes = {int(l["layer"]): l["module_prefix"] for l in manifest["layers"]}
    first = min(prefixes)
    with LayerReads(run, prefixes) as reads:
        reads.start(first)
        run.ref_ckpt = open_checkpoint(q4)
        run.ref_reader = detect_family(run.ref_ckpt)
        reads.attach_reference()
        got = reads.get(first, [])
    ref = {r.layer: r for r in run.ref_reader.layer_refs()}[first]
    want = run.ref_reader.read_layer(ref)
    assert got.reference is not None and got.reference.w13_mx is not None and want.w13_mx is not None
    for a, b in ((got.reference.w13_mx, want.w13_mx), (got.reference.w2_mx, want.w2_mx)):
        assert a.data.equal(b.data) and a.scales.equal(b.scales)
    assert got.kernel is not None
    for key, t in got.kernel[0].items():
        assert t.equal(ckpt.read(f"{prefixes[first]}.experts.{key}")), key
    assert {name for _, name, _ in got.digests} == {f"{prefixes[first]}.experts.{k}" for k in got.kernel[0]}


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
    report = verify(toy_outputs[tp], reference=str(q4), kernel=True, device="cpu", tokens=8)
    assert report.passed and report.layers, [r.problems for r in report.layers]
    assert all(r.kernel is not None and r.kernel.status == "ok" for r in report.layers)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_held_tensors_give_the_kernel_output_the_files_give(toy_outputs, tp: int) -> None:
    """run_kernel_layer on the tensors verify read equals run_kernel_layer reading the files."""
    out = toy_outputs[tp]
    manifest = load_manifest(out)
    run = Run(out, manifest, [open_checkpoint(d) for d in rank_dirs(out, tp)], model_info_of(manifest["model"]), 8, 0, "cpu")
    prefixes = {int(l["layer"]): l["module_prefix"] for l in manifest["layers"]}
    L = min(prefixes)
    with LayerReads(run, prefixes) as reads:
        held = reads.get(L, []).held()
    assert held is not None and len(held) == tp
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, run.info.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(run.info.num_experts, generator=g)[: run.info.top_k] for _ in range(8)])
    routing = Routing(ids, torch.softmax(torch.randn(8, run.info.top_k, generator=g), -1))
    from_files = run_kernel_layer(out, manifest, L, x, routing)
    from_held = run_kernel_layer(out, manifest, L, x, routing, held=held)
    assert torch.isfinite(from_files).all() and torch.equal(from_held, from_files)


def test_held_tensors_are_used_only_where_they_are_the_files_tensors(toy_outputs) -> None:
    """The same keys from the same files and names: handed over as they are; a key missing, or a
    tensor from another file or name: None (the loader reads the layer from its files)."""
    out = toy_outputs[1]
    src = resolve_layer(out, min(int(l["layer"]) for l in load_manifest(out)["layers"]))
    ckpt = open_checkpoint(out)
    held = {k: HeldTensor(src.files[k], src.names[k], ckpt.read(src.names[k])) for k in src.files}
    got = held_layer_tensors(src, held, "cpu")
    assert got is not None and all(got[k] is held[k].tensor for k in held)
    first = next(iter(held))
    assert held_layer_tensors(src, {k: h for k, h in held.items() if k != first}, "cpu") is None
    assert held_layer_tensors(src, {**held, first: dataclasses.replace(held[first], name="other")}, "cpu") is None
    assert held_layer_tensors(src, {**held, first: dataclasses.replace(held[first], file=out / "other.safetensors")}, "cpu") is None
