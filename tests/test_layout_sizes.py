"""What every backend's ``padded_sizes`` refuses, naming the size, option, activation or row order."""

from __future__ import annotations

import pytest

from mxconv.errors import LayoutError
from mxconv.layouts import get_layout


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
