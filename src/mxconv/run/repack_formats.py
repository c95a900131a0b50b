"""Which expert format a repack writes into a backend's layout, and, where the backend does not take it, what
the experts are and what would work: one wording for repack's planning (a BadInput) and ``inspect``'s
per-backend table.

A repack keeps an MX or INT4 source's format (RepackOptions.weight_format None). A float or block-FP8
source is quantized on the way: to MXFP4 by default, or, when the backend does not take MXFP4 (xpu: MXFP8
experts only), to the first format it does take (:func:`default_weight_format`; the run's summary says so,
:func:`chosen_format_note`). Otherwise ``RepackOptions.weight_format`` picks: MXFP4 or MXFP8 for a float
source, MXFP8 for an MXFP4 one (re-coded without loss); MXFP8 experts are never re-quantized to MXFP4 and
INT4 ones stay INT4 (``quantize`` first to get MX experts).

Headers only; no torch (``inspect`` imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mxconv.errors import LayoutError
from mxconv.experts.stack import LayoutSizes
from mxconv.families.quant_config import FLOAT_DTYPES
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.base import Layout
from mxconv.run.options import WeightFormat

__all__ = ["ExpertShape", "chosen_format_note", "default_weight_format", "experts_are", "made_by_repack",
           "weight_format_hint"]

MX = (WeightFormat.MXFP4, WeightFormat.MXFP8)
FLOAT_SOURCES = (*FLOAT_DTYPES.values(), "fp8_block")  # ModelInfo.expert_format of experts a repack quantizes


@dataclass(frozen=True)
class ExpertShape:
    """One TP rank's experts as a layout sizes them: the hint asks a format's form whether it takes them."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    row_order: str
    has_bias: bool


def made_by_repack(source: str) -> tuple[WeightFormat, ...]:
    """The formats a repack can write from ``source`` experts (ModelInfo.expert_format): INT4 and MXFP8 kept,
    MXFP4 kept or re-coded to MXFP8 (lossless), floats and block-FP8 quantized to either MX format."""
    if source in (WeightFormat.INT4, WeightFormat.MXFP8):
        return (WeightFormat(source),)
    return MX


def default_weight_format(source: str, layout: Layout) -> WeightFormat:
    """What a repack into ``layout`` writes when RepackOptions.weight_format is not set: an MX or INT4 source's
    own format; a float one's MXFP4, or the first MX format the layout takes when it does not take MXFP4."""
    if source in (WeightFormat.MXFP4, WeightFormat.MXFP8, WeightFormat.INT4):
        return WeightFormat(source)
    if WeightFormat.MXFP4 in layout.weight_formats or source not in FLOAT_SOURCES:
        return WeightFormat.MXFP4
    return next((WeightFormat(f) for f in layout.weight_formats if f in MX), WeightFormat.MXFP4)


def chosen_format_note(source: str, layout: Layout, asked: str | None) -> str | None:
    """The note a run or its plan shows when :func:`default_weight_format` chose other than MXFP4 for a float
    source (None otherwise: the documented default, or the format asked for)."""
    fmt = default_weight_format(source, layout)
    if asked is not None or source not in FLOAT_SOURCES or fmt == WeightFormat.MXFP4:
        return None
    return (f"{source} experts quantized to {fmt}: backend {layout.name} takes {', '.join(layout.weight_formats)} "
            f"experts, not the default mxfp4 (set RepackOptions.weight_format to choose)")


def experts_are(source: str) -> str:
    """What ``source`` experts are, for a refusal's first words."""
    if source in FLOAT_SOURCES:
        return f"{source} (quantized to mxfp4 unless RepackOptions.weight_format says otherwise)"
    return {WeightFormat.INT4: "int4 (compressed-tensors INT4, bf16 group scales)"}.get(source, source)


def form_refusal(layout: Layout, fmt: str, shape: ExpertShape, activation: str | None = None,
                 options: Any = None) -> str | None:  # fmt: skip
    """Why ``layout``'s form of ``fmt`` cannot lay out ``shape``'s experts (``activation``: the one asked, else
    the form's default; ``options``: resolved), None if it can."""
    try:
        act = activation or layout.default_activation(fmt)
        opts = layout.resolve_options(options)
        Hp, Ip = layout.padded_sizes(shape.hidden_size, shape.intermediate_size, shape.row_order, act, opts, weight_format=fmt)
        sizes = LayoutSizes(shape.num_experts, shape.hidden_size, shape.intermediate_size, Hp, Ip, shape.row_order,
                            shape.has_bias, fmt)  # fmt: skip
        layout.kernel_specs(sizes, act, opts)
    except LayoutError as exc:
        return str(exc)
    return None


def weight_format_hint(source: str, layout: Layout, refused: str, shape: ExpertShape | None = None,
                       activation: str | None = None, options: Any = None) -> str:  # fmt: skip
    """Why ``layout`` does not take ``source`` experts as ``refused`` ones, where the layout says (its
    ``weight_format_refusals``), and what would put them into it: the RepackOptions.weight_format that works,
    quantizing first (INT4), or that nothing does; then the backends that take ``refused``. ``shape`` (with
    ``activation``, ``options``): a suggested format whose form would refuse these sizes is named with why."""
    takes = [WeightFormat(f) for f in layout.weight_formats if f != refused]
    reachable = [f for f in takes if f in made_by_repack(source)]
    blocked = {f: why for f in reachable if shape is not None and (why := form_refusal(layout, f, shape, activation, options))}
    usable = [f for f in reachable if f not in blocked]
    if usable:
        lossless = " (MXFP4 re-coded as MXFP8 without loss)" if source == WeightFormat.MXFP4 and usable[0] == WeightFormat.MXFP8 else ""
        hint = f"set RepackOptions.weight_format {usable[0]}{lossless}"
    elif blocked:
        fmt, why = next(iter(blocked.items()))
        hint = f"RepackOptions.weight_format {fmt} would not help: {why}"
    elif source == WeightFormat.INT4 and (quantized := [f for f in takes if f in MX]):
        hint = (f"repack keeps INT4 experts INT4; quantize the source first (QuantOptions.fmt {quantized[0]}) and "
                "repack that output")
    elif source == WeightFormat.MXFP8 and takes:
        hint = f"repack never re-quantizes MXFP8 experts to {takes[0]}; repack the float source instead"
    else:
        hint = f"no repack of {source} experts writes a format backend {layout.name} takes"
    others = [n for n in backend_names() if refused in get_layout(n).weight_formats]
    own = layout.weight_format_refusals.get(refused)
    return (f"{own}; " if own else "") + hint + f" (backends that take {refused}: {', '.join(others) or 'none'})"
