"""The typed manifest (:class:`mxconv.source.manifest.Manifest`): every manifest mxconv writes parses
and gives back exactly its JSON (``parse(x).as_written() == x``, and the same text as written), keys a
newer mxconv adds are kept, and the typed parts say what the JSON says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mxconv.demo import run_demo
from mxconv.errors import OutputDamaged
from mxconv.families.base import ModelInfo
from mxconv.layouts import backend_names
from mxconv.source.json_files import dumps_strict
from mxconv.source.manifest import Manifest, load_manifest


def _round_trips(out: Path) -> Manifest:
    text = (out / "mxconv.json").read_text()
    m = load_manifest(out)
    assert m.as_written() == json.loads(text), out
    assert dumps_strict(m.as_written(), indent=2, sort_keys=False) + "\n" == text, out  # the writer's own text
    return m


@pytest.fixture(scope="module")
def outputs(made) -> dict[str, Path]:
    q4 = made.quantize(made.source("gpt-oss-bf16").path)
    return {"q4": q4, "q8": made.quantize(made.source("gpt-oss-bf16").path, "--format", "mxfp8"),
            "trtllm": made.repack(q4, "trtllm"), "aiter-tp2": made.repack(q4, "aiter", "--tp", "2"),
            "humming-int4-tp2": made.repack(made.source("kimi-k2-int4").path, "humming", "--tp", "2")}


def test_written_manifests_round_trip(outputs: dict[str, Path]) -> None:
    for out in outputs.values():
        _round_trips(out)


def test_typed_parts_say_what_the_json_says(outputs: dict[str, Path]) -> None:
    doc = json.loads((outputs["aiter-tp2"] / "mxconv.json").read_text())
    m = load_manifest(outputs["aiter-tp2"])
    assert (m.kind, m.backend, m.tp_size, m.is_kernel) == ("kernel", "aiter", 2, True)
    assert m.rank_ranges == tuple(tuple(r) for r in doc["layout"]["tp_ranges"])
    assert m.layer_numbers == [row["layer"] for row in doc["layers"]]
    assert m.layers[0].module_prefix == doc["layers"][0]["module_prefix"]
    key = next(iter(doc["tensors"]))
    assert m.tensors[key].shape == tuple(doc["tensors"][key]["shape"]) and m.tensors[key].sha256 == doc["tensors"][key]["sha256"]
    assert ModelInfo.from_part(m.model).to_json() == {**ModelInfo.from_part(m.model).to_json(), **doc["model"]}
    assert {k: m.layout.json_value(k) for k in doc["layout"]} == doc["layout"]
    with pytest.raises(TypeError):  # frozen: the parsed manifest is what every reader sees
        m.layout.extra["x"] = 1  # type: ignore[index]


def test_unknown_and_absent_keys_are_kept(outputs: dict[str, Path]) -> None:
    doc = json.loads((outputs["q4"] / "mxconv.json").read_text())
    newer = {**doc, "a_future_key": {"x": [1, 2]}, "layout": {**doc["layout"], "a_future_layout_key": 3}}
    newer["layers"] = [{k: v for k, v in row.items() if k != "router_bias"} for row in doc["layers"]]  # optional, absent
    assert Manifest.parse(newer, "mxconv.json").as_written() == newer
    assert list(Manifest.parse(newer, "mxconv.json").as_written()) == list(newer)  # key order too


def test_parse_refuses_what_the_schema_refuses(outputs: dict[str, Path]) -> None:
    doc = json.loads((outputs["trtllm"] / "mxconv.json").read_text())
    with pytest.raises(OutputDamaged, match="field 'tp_size' must be a positive integer, got 0"):
        Manifest.parse({**doc, "tp_size": 0}, "mxconv.json")


def test_stack_choices_are_typed_and_checked(outputs: dict[str, Path]) -> None:
    """``layout.stack_choices``: per converted layer, one object per rank (humming INT4's codes per GEMM)."""
    m = _round_trips(outputs["humming-int4-tp2"])
    assert m.layout.choices_of(1, 1) == {"w13_weight": "e0m3", "w2_weight": "e0m3"}
    assert m.layout.choices_of(2, 0) == {} and _round_trips(outputs["trtllm"]).layout.stack_choices is None
    doc = m.as_written()
    for bad, why in (({"1": [{"w13_weight": "e0m3"}]}, "must hold tp_size=2 objects, got 1"),
                     ({"7": [{}, {}]}, "names no converted layer"),
                     ({"1": [{"w13_weight": 4}, {}]}, "must be a non-empty string, got 4")):
        with pytest.raises(OutputDamaged, match=f"field 'layout.stack_choices.*{why}"):
            Manifest.parse({**doc, "layout": {**doc["layout"], "stack_choices": bad}}, "mxconv.json")


def test_run_records_are_typed_parts(outputs: dict[str, Path]) -> None:
    """numerics (and the upstream run it carries), linears and fp8_tiles read as fields, written back as read."""
    q4, trt = _round_trips(outputs["q4"]), _round_trips(outputs["trtllm"])
    assert q4.numerics is not None and q4.numerics.source_format == "bf16" and q4.numerics.upstream is None
    up = trt.numerics.upstream if trt.numerics is not None else None  # the repack kept the quantize run's bytes
    assert up is not None and (up.source_format, up.weight_format, up.fingerprint) == ("bf16", "mxfp4", q4.source.fingerprint)
    doc = trt.as_written()
    linears = {"targets": "linear", "format": "mxfp8", "quantized": ["a.q_proj"], "carried_mx": [],
               "left_alone": {"lm_head": "kept"}}
    tiles = {"tiles": 8, "layers": {"1": {"tiles": 8, "inexact": 2}}}
    m = Manifest.parse({**doc, "linears": linears, "fp8_tiles": tiles}, "mxconv.json")
    assert m.linears is not None and (m.linears.targets, m.linears.quantized, m.linears.scale_rounding) == ("linear", ("a.q_proj",), None)
    assert m.fp8_tiles is not None and (m.fp8_tiles.inexact(1), m.fp8_tiles.inexact(2)) == (2, None)
    assert m.as_written() == {**doc, "linears": linears, "fp8_tiles": tiles}


@pytest.mark.slow  # the demo: every format and every registered backend (~40 s on 2 cores)
def test_every_demo_manifest_round_trips(tmp_path: Path) -> None:
    result = run_demo(tmp_path, torch.device("cpu"))
    assert result["passed"]
    found = [p.parent for p in tmp_path.rglob("mxconv.json")]
    kinds = {(m.kind, m.weight_format, m.backend) for m in map(_round_trips, found)}
    assert set(backend_names()) <= {b for _, _, b in kinds}, kinds  # every registered backend's output
    assert {("canonical", f, None) for f in ("mxfp4", "mxfp8")} <= kinds, kinds
