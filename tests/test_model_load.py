"""The whole-model loader (mxconv.engines.model_load) on CPU: real repack outputs (marlin, TP=2),
the toy backend (its engine runner runs on CPU, so its layers come back wrapped), the hash check,
layer selection, progress lines and the errors."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from support.toy_backend import ToyLayout
from support.workspace import MadeCheckpoints, link_workspace

from mxconv.engines.loader import EngineLayer, read_layer_tensors, resolve_layer
from mxconv.engines.model_load import LoadProgress, load_model, stderr_progress
from mxconv.engines.staged_read import StagingOptions, byte_view
from mxconv.errors import BadInput
from mxconv.layouts import register_layout, unregister_layout
from mxconv.source.checkpoint import open_checkpoint
from mxconv.source.st_format import read_tensor
from mxconv.source.manifest import Manifest
from mxconv.examples import ModelSizes


@pytest.fixture(scope="module")
def outputs(made: MadeCheckpoints, tmp_path_factory) -> Path:
    q4 = made.quantize(made.source("gpt-oss-bf16", ModelSizes(hidden_size=128, intermediate_size=96)).path)
    return link_workspace(tmp_path_factory.mktemp("model-load"), {
        "q4": q4, "marlin": made.repack(q4, "marlin"), "marlin-tp2": made.repack(q4, "marlin", "--tp", "2")})


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    ckpt = open_checkpoint(str(directory))
    return {name: read_tensor(info) for name, info in ckpt.tensors.items()}


def test_every_layer_bytes_equal_the_files(outputs: Path) -> None:
    seen: list[LoadProgress] = []
    model = load_model(outputs / "marlin", device="cpu", staging=StagingOptions(buffer_bytes=4096, piece_bytes=1000),
                       on_progress=seen.append)  # fmt: skip
    m = json.loads((outputs / "marlin" / "mxconv.json").read_text())
    assert sorted(model.layers) == sorted(int(e["layer"]) for e in m["layers"]) and not model.wrapped
    stored = _stored(outputs / "marlin")
    n = 0
    for i, tensors in model.layers.items():
        for key, t in tensors.items():
            ref = stored[f"model.layers.{i}.mlp.experts.{key}"]
            assert t.dtype == ref.dtype and t.shape == ref.shape and torch.equal(byte_view(t), byte_view(ref)), (i, key)
            n += t.numel() * t.element_size()
    assert model.bytes_read == n and [p.done for p in seen] == list(range(1, len(model.layers) + 1))
    assert seen[-1].bytes_done == seen[-1].bytes_total == n


def test_tp_output_loads_the_rank_asked_for(outputs: Path) -> None:
    with pytest.raises(BadInput, match="pass rank=0..1"):
        load_model(outputs / "marlin-tp2", device="cpu")
    one = load_model(outputs / "marlin-tp2", device="cpu", rank=1, layers=[0])
    same = load_model(outputs / "marlin-tp2" / "rank-1", device="cpu", layers=[0])
    stored = _stored(outputs / "marlin-tp2" / "rank-1")
    assert one.rank == same.rank == 1 and one.tp_size == 2 and list(one.layers) == [0]
    for key, t in one.layers[0].items():
        assert torch.equal(byte_view(t), byte_view(same.layers[0][key]))
        assert torch.equal(byte_view(t), byte_view(stored[f"model.layers.0.mlp.experts.{key}"]))


def test_hash_check_finds_a_flipped_byte(outputs: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(outputs / "marlin", copy, symlinks=False)
    load_model(copy, device="cpu", check_hashes=True)  # intact
    m = json.loads((copy / "mxconv.json").read_text())
    name = "model.layers.1.mlp.experts.w2_weight"
    info = open_checkpoint(str(copy)).tensors[name]
    with open(info.file, "r+b") as f:
        f.seek(info.begin + 5)
        b = f.read(1)
        f.seek(info.begin + 5)
        f.write(bytes([b[0] ^ 0x10]))
    assert load_model(copy, device="cpu").layers  # not checked by default
    with pytest.raises(BadInput, match=rf"{m['tensors'][name]['file']}: tensor '{name}': sha256 mismatch"):
        load_model(copy, device="cpu", check_hashes=True)


def test_errors(outputs: Path) -> None:
    with pytest.raises(BadInput, match=r"no MoE layer \[9\]"):
        load_model(outputs / "marlin", device="cpu", layers=[0, 9])
    with pytest.raises(BadInput, match="canonical checkpoint"):
        load_model(outputs / "q4", device="cpu")


def test_toy_backend_layers_come_back_wrapped(made: MadeCheckpoints, tmp_path: Path) -> None:
    register_layout("toy", ToyLayout())
    try:
        q4 = made.quantize(made.source("gpt-oss-bf16", ModelSizes(hidden_size=128, intermediate_size=96)).path)
        out = made.repack(q4, "toy")
        model = load_model(out, device="cpu")
        assert model.wrapped and model.backend == "toy"
        layer = model.layers[0]
        assert isinstance(layer, EngineLayer) and layer.device.type == "cpu"
        x = torch.randn(3, 128)
        ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
        y = layer.forward(x, ids, torch.full((3, 2), 0.5))
        assert y.shape == (3, 128) and bool(torch.isfinite(y).all())
    finally:
        unregister_layout("toy")


def test_stderr_progress_lines() -> None:
    buf = io.StringIO()
    report = stderr_progress(buf)
    report(LoadProgress(3, 1, 2, 1_500_000_000, 3_000_000_000, 0.25))
    report(LoadProgress(5, 2, 2, 3_000_000_000, 3_000_000_000, 0.5))
    assert buf.getvalue().splitlines() == ["loaded layer 3 (1/2): 1.50 of 3.00 GB, 0.2 s",
                                           "loaded layer 5 (2/2): 3.00 of 3.00 GB, 0.5 s"]  # fmt: skip


def test_a_manifest_without_a_tensor_hash_is_refused_before_any_read(outputs: Path) -> None:
    """An integration hands the loader a parsed Manifest: one whose tensor has no sha256 never is one."""
    m = json.loads((outputs / "marlin" / "mxconv.json").read_text())
    name = "model.layers.1.mlp.experts.w2_weight_scale"
    del m["tensors"][name]["sha256"]
    with pytest.raises(BadInput, match=rf"field 'tensors\.{re.escape(name)}\.sha256' is missing"):
        Manifest.parse(m, outputs / "marlin" / "mxconv.json")
