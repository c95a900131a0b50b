"""Layout options are one frozen object per backend, resolved once (LayoutBase.resolve_options):
invalid values are refused there with the messages of the LayoutOption declarations, the
layout methods take the object, and its to_json() is the manifest's layout ``options``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mxconv.errors import LayoutError
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.base import EmptyOptions, LayoutOptions
from mxconv.layouts.trtllm import TrtllmOptions

# backend -> (options as given on the command line, the manifest's layout options they give)
GIVEN = {
    "trtllm": ({"intermediate_align": "256"}, {"intermediate_align": 256}),
    "marlin": ({"marlin_scale_layout": "legacy"}, {"marlin_scale_layout": "legacy"}),
    "aiter": ({"check_undefined_scale_padding": "false"}, {"check_undefined_scale_padding": False}),
    "triton": ({"pad_hidden": "yes", "num_warps": "4", "arch": "sm90"},
               {"triton_layout": "3.5", "num_warps": 4, "scale_k_align": 4, "pad_hidden": True, "arch": "sm90"}),
    "deepgemm": ({}, {}),
    "cutlass": ({}, {}),
    "humming": ({"int4_codes": "e0m3"}, {"int4_codes": "e0m3"}),
    "cpu": ({}, {}),
    "flashinfer-cutlass": ({}, {}),
}


@pytest.mark.parametrize("backend", backend_names())
def test_options_object_matches_the_declarations(backend: str) -> None:
    layout = get_layout(backend)
    opts = layout.resolve_options()
    assert isinstance(opts, layout.options_type) and isinstance(opts, LayoutOptions)
    assert [f.name for f in dataclasses.fields(opts)] == [o.name for o in layout.options]
    assert opts.to_json() == {o.name: o.default for o in layout.options}
    assert layout.resolve_options(opts) is opts  # resolved once: the object passes through as is
    if not layout.options:
        assert layout.options_type is EmptyOptions


@pytest.mark.parametrize("backend", sorted(GIVEN))
def test_to_json_round_trips_to_the_manifest_dict(backend: str) -> None:
    layout = get_layout(backend)
    given, manifest = GIVEN[backend]
    opts = layout.resolve_options(given)
    assert opts.to_json() == manifest and list(opts.to_json()) == list(manifest)
    assert json.dumps(opts.to_json()) == json.dumps(manifest)  # same bytes, same key order
    assert layout.resolve_options(json.loads(json.dumps(opts.to_json()))) == opts  # read back from a manifest


def test_options_are_frozen_and_refused_at_resolve_time() -> None:
    trt = get_layout("trtllm")
    opts = trt.resolve_options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.intermediate_align = 256  # type: ignore[misc]
    with pytest.raises(LayoutError, match=r"layout option intermediate_align=96: must be a positive multiple of 128"):
        trt.resolve_options({"intermediate_align": "96"})
    with pytest.raises(LayoutError, match="backend trtllm has no option colour"):
        trt.resolve_options({"colour": "red"})
    with pytest.raises(LayoutError, match=r"intermediate_align='256' must be a positive multiple of 128"):
        TrtllmOptions(intermediate_align="256")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="marlin_scale_layout='v2': choose one of current, legacy"):
        get_layout("marlin").resolve_options({"marlin_scale_layout": "v2"})


def test_methods_take_the_resolved_object_not_a_dict() -> None:
    trt = get_layout("trtllm")
    assert trt.padded_sizes(2880, 2880, "interleaved", "bf16", None) == (3072, 2944)  # None: the defaults
    with pytest.raises(TypeError, match="TrtllmOptions"):
        trt.padded_sizes(2880, 2880, "interleaved", "bf16", {"intermediate_align": 256})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="TrtllmOptions"):
        trt.padded_sizes(2880, 2880, "interleaved", "bf16", get_layout("marlin").resolve_options())  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="backend trtllm has no option marlin_scale_layout"):
        trt.resolve_options(get_layout("marlin").resolve_options())  # another backend's object is checked as given
