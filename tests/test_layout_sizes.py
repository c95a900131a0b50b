"""What every backend's ``padded_sizes`` refuses, naming the size, option, activation or row order."""

from __future__ import annotations

import re

import pytest
from support.registry_cases import case_id, format_cases

from mxconv.errors import LayoutError
from mxconv.experts.stack import LayoutSizes
from mxconv.layouts import backend_names, get_layout


@pytest.mark.parametrize(
    "backend,H,I,row_order,activation,options,match",
    [
        ("aiter", 100, 128, "halves", "bf16", {}, "hidden size 100 must be a positive multiple of 32"),
        ("aiter", 128, 48, "halves", "bf16", {}, "intermediate size 48"),
        ("aiter", 128, 128, "halves", "fp8", {}, "unknown activation 'fp8'"),
        ("aiter", 128, 128, "concat", "bf16", {}, "unknown w13 row order"),
        ("marlin", 2880, 100, "halves", "bf16", {}, "multiple of 32"),
        ("marlin", 48, 128, "halves", "bf16", {}, "multiple of 32"),
        ("marlin", 256, 128, "halves", "mxfp8", {}, "activation"),
        ("marlin", 256, 128, "sideways", "bf16", {}, "row order"),
        ("trtllm", 100, 256, "halves", "bf16", {}, "hidden size 100 must be a positive multiple of 32"),
        ("trtllm", 256, 48, "halves", "bf16", {}, "intermediate size 48 must be a positive multiple of 32"),
        ("trtllm", 256, 0, "halves", "bf16", {}, "intermediate size 0"),
        ("trtllm", 256, 256, "halves", "bf16", {"intermediate_align": 64}, "intermediate_align=64 must be a positive multiple of 128"),
        ("trtllm", 256, 256, "halves", "fp8", {}, "activation 'fp8'.*bf16, mxfp8"),
        ("trtllm", 256, 256, "gate_up", "bf16", {}, "row order"),
    ],
)
def test_padded_sizes_errors(
    backend: str, H: int, I: int, row_order: str, activation: str, options: dict, match: str
) -> None:
    with pytest.raises(LayoutError, match=match):
        layout = get_layout(backend)
        layout.padded_sizes(H, I, row_order, activation, layout.options_type(**options))


@pytest.mark.parametrize("case", format_cases(), ids=case_id)
def test_declared_activations_and_bias_refusal_are_what_the_layout_does(case: tuple[str, str]) -> None:
    """``format_activations`` and ``bias_refusal``, which the demo and the registry-wide tests read, are
    the layout's behaviour: each declared activation sizes the format's experts and no other does, and
    sizes with expert biases are refused with exactly the declared text (or taken when none is declared)."""
    backend, fmt = case
    layout = get_layout(backend)
    takes = layout.format_activations(fmt)
    assert takes and set(takes) <= set(layout.activations)
    every = {a for b in backend_names() for a in get_layout(b).activations}
    for act in sorted(every):
        options = layout.resolve_options({"arch": "gfx950"} if act in layout.input_scale_activations else None)
        if act not in takes:
            with pytest.raises(LayoutError):
                layout.padded_sizes(256, 256, "halves", act, options, weight_format=fmt)
            continue
        Hp, Ip = layout.padded_sizes(256, 256, "halves", act, options, weight_format=fmt)
        why = layout.bias_refusal(fmt)
        if why is None:
            layout.kernel_specs(LayoutSizes(4, 256, 256, Hp, Ip, "halves", True, fmt), act, options)
        else:
            with pytest.raises(LayoutError, match=f"^{re.escape(why)}$"):
                layout.kernel_specs(LayoutSizes(4, 256, 256, Hp, Ip, "halves", True, fmt), act, options)
    assert layout.format_activations("nvfp4") == () and layout.bias_refusal("nvfp4") is None
