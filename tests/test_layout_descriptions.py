"""The typed descriptions the GPU engine runners read a manifest's ``layout`` through
(:class:`TritonDescription`, :class:`MarlinDescription`, :class:`HummingDescription`): each parses the
manifest of a real repack and gives back exactly the keys it read, the keys its backend writes are the
ones it reads, a missing or mistyped key is a BadInput naming ``layout.<key>``, an absent key (an
older manifest) takes the default the runner assumed before, and the runners' ``kernel_unavailable``
takes the typed ``LayoutPart`` on this CPU machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from mxconv.engines.runner import kernel_unavailable, require_runner
from mxconv.errors import BadInput
from mxconv.layouts.description import ActivationDescription, LayoutDescription, ServingDescription
from mxconv.layouts.humming import HummingDescription
from mxconv.layouts.marlin_description import MarlinDescription
from mxconv.layouts.triton_arch import TritonDescription
from mxconv.source.manifest import LayoutPart, Manifest, load_manifest
from support.checkpoints import ModelSizes

SIZES = ModelSizes(hidden_size=128, intermediate_size=96)
# repack -> (its description class, the keys its manifest must hold: every key the backend writes there)
CASES: dict[str, tuple[type[LayoutDescription], tuple[str, ...]]] = {
    "triton-sm90": (TritonDescription, TritonDescription.keys()),
    "triton-sm100": (TritonDescription, TritonDescription.keys()),
    "marlin-mxfp4": (MarlinDescription, ("activation", "scale_layout")),
    "marlin-mxfp8": (MarlinDescription, MarlinDescription.keys()),
    "humming-mxfp4": (HummingDescription, ("sm_version", "w13_kernel_row_order", "layer_configs")),
    "humming-mxfp8": (HummingDescription, ("variant", "sm_version", "w13_kernel_row_order", "layer_configs")),
    "humming-int4": (HummingDescription, HummingDescription.keys()),
}


@pytest.fixture(scope="module")
def outputs(made: Any) -> dict[str, Path]:
    q4 = made.quantize(made.source("gpt-oss-bf16", SIZES).path)
    qwen = made.source("qwen3-moe", SIZES).path
    kimi = made.source("kimi-k2-int4").path
    return {
        "triton-sm90": made.repack(q4, "triton"),
        "triton-sm100": made.repack(q4, "triton", "--layout-option", "arch=sm100"),
        "marlin-mxfp4": made.repack(q4, "marlin"),
        "marlin-mxfp8": made.repack(qwen, "marlin", "--format", "mxfp8"),
        "humming-mxfp4": made.repack(q4, "humming"),
        "humming-mxfp8": made.repack(qwen, "humming", "--format", "mxfp8"),
        "humming-int4": made.repack(kimi, "humming"),
    }


def _part(layout: LayoutPart, **changes: Any) -> LayoutPart:
    """``layout`` with its backend's own keys changed (None: removed), as a manifest would hold them."""
    doc = layout.as_written()
    for key, value in changes.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    return LayoutPart.from_json(doc)


@pytest.mark.parametrize("case", list(CASES))
def test_description_parses_a_repack_and_gives_back_its_json(outputs: dict[str, Path], case: str) -> None:
    cls, written = CASES[case]
    layout = load_manifest(outputs[case]).layout
    d = cls.from_layout(layout)
    full = layout.as_written()
    assert d.to_json() == {k: full[k] for k in full if k in cls.keys()}  # the same keys, values and order
    assert set(written) <= set(d.to_json())  # what the backend writes is what the runner reads (no drift)
    assert cls.from_layout(LayoutPart.from_json(full)) == d


def test_typed_values_of_each_backend(outputs: dict[str, Path]) -> None:
    sm90 = TritonDescription.from_layout(load_manifest(outputs["triton-sm90"]).layout)
    assert (sm90.arch, sm90.hopper_storage(), sm90.intermediate_align) == ("sm90", ("3.5", 8, 4), 64)
    sm100 = TritonDescription.from_layout(load_manifest(outputs["triton-sm100"]).layout)
    assert (sm100.arch, sm100.triton_layout, sm100.num_warps, sm100.scale_k_align) == ("sm100", None, None, 1)
    assert MarlinDescription.from_layout(load_manifest(outputs["marlin-mxfp4"]).layout) == MarlinDescription()
    assert MarlinDescription.from_layout(load_manifest(outputs["marlin-mxfp8"]).layout).variant == "mxfp8"
    int4 = HummingDescription.from_layout(load_manifest(outputs["humming-int4"]).layout)
    assert (int4.variant, int4.sm_version, int4.int4_codes) == ("int4", 90, "auto")
    assert set(int4.layer_configs or {}) == {"w13", "w2"}


def test_absent_keys_take_the_defaults_of_older_manifests(outputs: dict[str, Path]) -> None:
    """A manifest written before a key existed: the runner assumes what it assumed when it read the JSON."""
    lay = load_manifest(outputs["triton-sm90"]).layout
    old = TritonDescription.from_layout(_part(lay, **dict.fromkeys(TritonDescription.keys())))
    assert (old.arch, old.triton_layout, old.num_warps, old.scale_k_align, old.intermediate_align) == ("sm90", "3.5", 8, 4, 64)
    assert old.to_json() == {}
    hum = HummingDescription.from_layout(_part(load_manifest(outputs["humming-mxfp4"]).layout, sm_version=None, layer_configs=None))
    assert (hum.variant, hum.sm_version, hum.int4_codes, hum.layer_configs) == ("mxfp4", 0, "uint4", None)


@pytest.mark.parametrize("case, key, value, rule", [
    ("triton-sm90", "num_warps", "8", "an integer or null"),
    ("triton-sm90", "arch", 90, "a string"),
    ("triton-sm90", "intermediate_align", True, "an integer"),
    ("marlin-mxfp4", "scale_layout", ["current"], "a string"),
    ("humming-mxfp4", "layer_configs", [1, 2], "an object or null"),
    ("humming-int4", "sm_version", 90.0, "an integer"),
])  # fmt: skip
def test_a_mistyped_key_is_refused_by_name(outputs: dict[str, Path], case: str, key: str, value: Any, rule: str) -> None:
    cls = CASES[case][0]
    with pytest.raises(BadInput, match=rf"manifest layout\.{key}: .* is not {rule} \(what the \w+ engine runner reads\)"):
        cls.from_layout(_part(load_manifest(outputs[case]).layout, **{key: value}))


def test_a_missing_required_key_is_refused_by_name(outputs: dict[str, Path]) -> None:
    lay = _part(load_manifest(outputs["humming-mxfp4"]).layout, w13_kernel_row_order=None)
    with pytest.raises(BadInput, match=r"manifest layout\.w13_kernel_row_order: missing; the humming engine runner needs it \(a string\)"):
        HummingDescription.from_layout(lay)


def test_sm90_storage_without_its_generation_is_refused_by_name(outputs: dict[str, Path]) -> None:
    lay = load_manifest(outputs["triton-sm90"]).layout
    doc = {**lay.as_written(), "triton_layout": None}
    with pytest.raises(BadInput, match=r"manifest layout\.triton_layout: null, but the sm90 storage"):
        TritonDescription.from_layout(LayoutPart.from_json(doc)).hopper_storage()


def test_descriptions_are_frozen(outputs: dict[str, Path]) -> None:
    d = MarlinDescription.from_layout(load_manifest(outputs["marlin-mxfp4"]).layout)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.activation = "fp8"  # type: ignore[misc]


@pytest.mark.parametrize("case", list(CASES))
def test_runners_take_the_typed_layout_part_on_cpu(outputs: dict[str, Path], case: str) -> None:
    """No GPU here: each runner's line, from the manifest's typed layout part (triton sm100: its arch first)."""
    m = load_manifest(outputs[case])
    why = kernel_unavailable(m, "cpu")
    assert why is not None
    assert ("layout.arch = 'sm100'" in why) if case == "triton-sm100" else ("CUDA" in why or "GPU" in why or "cuda" in why), why
    runner = require_runner(m.backend)
    if case != "triton-sm100":
        with pytest.raises(BadInput):
            runner.kernel_unavailable(m.layout, "cpu")


def test_a_mistyped_key_reaches_the_caller_as_the_runners_line(outputs: dict[str, Path]) -> None:
    m = load_manifest(outputs["triton-sm90"])
    bad = Manifest.parse({**m.as_written(), "layout": {**m.layout.as_written(), "arch": 90}}, "mxconv.json")
    assert "manifest layout.arch: 90 is not a string" in (kernel_unavailable(bad, "cpu") or "")


def test_the_activation_any_backend_records(outputs: dict[str, Path]) -> None:
    """update_layer reads the layout's activation without knowing the backend (absent: None, the backend's default)."""
    lay = load_manifest(outputs["marlin-mxfp4"]).layout
    assert ActivationDescription.from_layout(lay).activation == "bf16"
    assert ActivationDescription.from_layout(_part(lay, activation=None)).activation is None
    with pytest.raises(BadInput, match=r"manifest layout\.activation: 16 is not a string or null \(what the in-memory conversion"):
        ActivationDescription.from_layout(_part(lay, activation=16))


def test_the_serving_keys_any_backend_records(outputs: dict[str, Path]) -> None:
    """The quant config and the vLLM plugin read vllm_moe_backend, w13_kernel_row_order and arch without knowing
    the backend: typed, None where a layout records none, a mistyped one refused by name."""
    from mxconv.integrations.vllm.checks import served_by
    from mxconv.output.engine_quant_config import from_manifest

    m = load_manifest(outputs["triton-sm100"])
    d = ServingDescription.from_layout(m.layout)
    assert (d.vllm_moe_backend, d.w13_kernel_row_order, d.arch) == ("TRITON", "interleaved", "sm100")
    assert from_manifest(m).activation.w13_kernel_row_order == "interleaved"
    assert "TRITON" in served_by(m)
    bare = ServingDescription.from_layout(_part(m.layout, vllm_moe_backend=None, w13_kernel_row_order=None, arch=None))
    assert (bare.vllm_moe_backend, bare.w13_kernel_row_order, bare.arch, bare.to_json()) == (None, None, None, {})
    with pytest.raises(BadInput, match=r"manifest layout\.arch: 100 is not a string or null \(what the engine quant config"):
        ServingDescription.from_layout(_part(m.layout, arch=100))
