"""In-memory conversion: one MoE layer's experts, already in (GPU or CPU) memory, into a backend's
kernel layout, and into a live :class:`~mxconv.engines.loader.EngineLayer` — no file is touched.

The pattern of an RL weight sync (a trainer pushes new bf16 weights into an inference engine every
step)::

    from mxconv.engines.in_memory import ConvertOptions, convert_layer, update_layer
    kernel = convert_layer({"w13": w13, "w2": w2, "w13_bias": b13, "w2_bias": b2},
                           ConvertOptions(backend="triton"), row_order="interleaved")
    update_layer(engine_layer, {"gate_up_proj": gu, "down_proj": dn, ...})   # in place

Input names (:func:`canonical_experts`), one layer, TP=1:

* canonical, float (any float dtype): ``w13`` [E, 2I, H] (rows in ``row_order``), ``w2`` [E, H, I];
* canonical, MXFP4: ``w13`` uint8 [E, 2I, H/2] + ``w13_scale`` uint8 [E, 2I, H/32], ``w2`` + ``w2_scale``;
* canonical, MXFP8: ``w13`` float8_e4m3fn [E, 2I, H] + ``w13_scale`` uint8 [E, 2I, H/32], ``w2`` + ``w2_scale``;
* gpt-oss source names: ``gate_up_proj`` [E, H, 2I] / ``down_proj`` [E, I, H] (bf16, interleaved
  rows), or ``gate_up_proj_blocks`` / ``_scales`` and ``down_proj_blocks`` / ``_scales`` (MXFP4
  uint8 pairs, or MXFP8 float8_e4m3fn values as ``quantize --format mxfp8`` writes them);
* biases, optional: ``w13_bias`` [E, 2I] / ``w2_bias`` [E, H] (``gate_up_proj_bias`` / ``down_proj_bias``).

The work is the conversion's own: float experts are quantized by ``mxconv.run.compute.to_format``
(the kernels and expert chunks ``quantize`` / ``repack`` use; MX bytes move untouched) and laid out
by the backend's ``to_kernel``, so the bytes equal the files ``repack`` writes from the same source
(tests/test_in_memory.py). The experts' format in the layout is ``ConvertOptions.quant``'s, as
``repack --format``: left out, MX bytes keep theirs (MXFP8 stays MXFP8) and floats become MXFP4;
MXFP4 bytes asked for as MXFP8 are re-coded losslessly, MXFP8 bytes are never re-quantized to MXFP4
(BadInput). Float experts go first to the layout's ``float_to_kernel`` (a ``Layout`` member, None
by default; triton: one fused kernel from bf16 to its Hopper buffers), which gives the same bytes;
where it answers None (none, it does not apply, or an element is NaN/Inf) the general path runs. Everything runs on the tensors' device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mxconv.engines.loader import EngineLayer
from mxconv.errors import BadInput
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import ROW_ORDERS, CanonicalExperts
from mxconv.families.base import MXStack
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.base import Layout, LayoutOptions
from mxconv.layouts.description import ActivationDescription
from mxconv.run.compute import to_format
from mxconv.run.options import QUANTIZE_FORMATS, QuantOptions, ScaleRounding
from mxconv.run.repack_formats import default_weight_format

# gpt-oss source name -> (canonical name, transpose the last two dims?)
_SOURCE_NAMES = {
    "gate_up_proj": ("w13", True),
    "down_proj": ("w2", True),
    "gate_up_proj_blocks": ("w13", False),
    "gate_up_proj_scales": ("w13_scale", False),
    "down_proj_blocks": ("w2", False),
    "down_proj_scales": ("w2_scale", False),
    "gate_up_proj_bias": ("w13_bias", False),
    "down_proj_bias": ("w2_bias", False),
}
_CANONICAL = ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias")


@dataclass(frozen=True)
class ConvertOptions:
    """What :func:`convert_layer` writes: ``backend`` (a registered layout), its ``activation``
    (None: the backend's default), its ``layout_options`` (as for ``repack --layout-option``), the
    experts' format and the quantization of float experts (``quant``, as ``repack --format`` and
    ``--scale-rounding`` of a float source; None: MX bytes keep their format, floats become MXFP4
    with its default rule) and whether CUDA stacks may use the Triton layout kernels
    (``kernel_choice``; the bytes are the same)."""

    backend: str
    activation: str | None = None
    layout_options: LayoutOptions | Mapping[str, Any] = field(default_factory=dict)
    quant: QuantOptions | None = None
    kernel_choice: KernelChoice = KernelChoice.AUTO


def _rename(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str | None]:
    """Canonical names for ``tensors`` and the row order the names imply (gpt-oss: interleaved)."""
    out: dict[str, torch.Tensor] = {}
    implied = None
    for name, t in tensors.items():
        if name in _CANONICAL:
            out[name] = t
        elif name in _SOURCE_NAMES:
            canon, transpose = _SOURCE_NAMES[name]
            if name.endswith("_blocks"):
                t = t.reshape(*t.shape[:-2], t.shape[-2] * t.shape[-1])
            out[canon] = t.transpose(-1, -2) if transpose else t
            implied = "interleaved"
        else:
            raise BadInput(f"in-memory conversion: unknown expert tensor {name!r} "
                           f"(canonical: {', '.join(_CANONICAL)}; gpt-oss: {', '.join(_SOURCE_NAMES)})")  # fmt: skip
    for need in ("w13", "w2"):
        if need not in out:
            raise BadInput(f"in-memory conversion: no {need} (or its gpt-oss name) among {sorted(tensors)}")
    return out, implied


def _mx_bytes(t: dict[str, torch.Tensor], which: str) -> MXStack | None:
    """``which`` given as MX bytes (with a ``*_scale``): uint8 pairs are MXFP4, float8_e4m3fn values
    MXFP8; None for floats."""
    w, scale = t[which], t.get(f"{which}_scale")
    if scale is None:
        return None
    if w.dtype == torch.float8_e4m3fn:
        return MXStack("mxfp8", w.view(torch.uint8), scale.view(torch.uint8))
    if w.dtype != torch.uint8:
        raise BadInput(f"in-memory conversion: {which} with {which}_scale must be uint8 MXFP4 pairs or float8_e4m3fn "
                       f"MXFP8 values, got {w.dtype}")  # fmt: skip
    if w.shape[-1] == 32 * scale.shape[-1] != 0:
        raise BadInput(f"in-memory conversion: {which} is uint8 with 32 bytes per {which}_scale byte: give MXFP8 "
                       f"values as float8_e4m3fn (uint8 means MXFP4 pairs, 16 bytes per scale byte)")  # fmt: skip
    return MXStack("mxfp4", w, scale.view(torch.uint8))


def _stack(t: dict[str, torch.Tensor], which: str, fmt: str, quant: QuantOptions, device: torch.device) -> MXStack:
    """One canonical stack in ``fmt``: MX bytes as they are (MXFP4 re-coded losslessly to MXFP8), floats quantized."""
    w = t[which]
    if w.dim() != 3:
        raise BadInput(f"in-memory conversion: {which} must be [E, N, K], got {list(w.shape)}")
    mx = _mx_bytes(t, which)
    if mx is not None:
        if mx.fmt == "mxfp8" and fmt != "mxfp8":
            raise BadInput(f"in-memory conversion: {which} holds MXFP8 values and {fmt} was asked for; MX bytes are "
                           "moved as they are, never re-quantized to MXFP4 (give the float experts, or leave quant out)")  # fmt: skip
        got = to_format(mx, None, fmt, quant, which, None, device)
    elif not w.dtype.is_floating_point or w.dtype == torch.float8_e4m3fn:
        raise BadInput(f"in-memory conversion: {which} is {w.dtype}: give floats, or MX bytes with {which}_scale")
    else:
        got = to_format(None, w, fmt, quant, f"in-memory {which}", None, device)
    assert isinstance(got, MXStack)
    return got


def resolve_quant(tensors: Mapping[str, torch.Tensor], quant: QuantOptions | None, layout: Layout | None = None) -> QuantOptions:
    """``quant``, or where it is None the format ``tensors`` keep (names of the module docstring):
    MXFP8 for MXFP8 bytes; float experts MXFP4, or the first MX format of ``layout`` where it takes no
    MXFP4 (xpu: MXFP8, as ``repack`` defaults); with that format's default scale rule."""
    if quant is not None:
        return quant
    t, _ = _rename(tensors)
    if "w13_scale" in t:  # MX bytes keep their format
        return QuantOptions("mxfp8" if t["w13"].dtype == torch.float8_e4m3fn else "mxfp4")
    # float experts: repack's rule (any float source name will do: it tells floats from MX and INT4)
    return QuantOptions(default_weight_format("bf16", layout) if layout is not None else "mxfp4")


def canonical_experts(tensors: Mapping[str, torch.Tensor], *, row_order: str | None = None,
                      quant: QuantOptions | None = None) -> CanonicalExperts:  # fmt: skip
    """The canonical MX stack of one layer's experts given under the names of the module docstring,
    on their device (float experts quantized per ``quant``, MX bytes moved untouched; ``quant``
    None: :func:`resolve_quant`).
    ``row_order``: of the w13 rows, "interleaved" or "halves" (default: what the names imply,
    "halves" for canonical names)."""
    t, implied = _rename(tensors)
    q = resolve_quant(tensors, quant)
    device = t["w13"].device
    w13, w2 = _stack(t, "w13", q.fmt, q, device), _stack(t, "w2", q.fmt, q, device)
    bias = {k: None if t.get(k) is None else t[k].to(device) for k in ("w13_bias", "w2_bias")}
    canon = CanonicalExperts(w13=w13.data, w13_scale=w13.scales, w2=w2.data, w2_scale=w2.scales,
                             row_order=row_order or implied or "halves", weight_format=q.fmt, **bias)  # fmt: skip
    canon.validate()
    return canon


def convert_layer(tensors: Mapping[str, torch.Tensor], options: ConvertOptions, *,
                  row_order: str | None = None, choices: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """One layer's experts (names of the module docstring) -> the backend's kernel tensors
    (``w13_weight``, ``w13_weight_scale``, ``w2_weight``, ``w2_weight_scale``, biases where given),
    padded as ``repack`` pads them, on the input's device; bytes equal to ``repack``'s files.
    ``choices``: what the layout must choose for these stacks (a loaded layer's recorded
    ``layout.stack_choices``; LayoutError where the data gives another choice)."""
    layout = get_layout(options.backend)
    activation = options.activation or layout.activations[0]
    layout.check_activation(activation)
    layout_options = layout.with_choices(layout.resolve_options(options.layout_options), choices or {})
    t, implied = _rename(tensors)
    quant = resolve_quant(tensors, options.quant, layout)
    fused = _fused(layout, t, row_order or implied or "halves", activation, layout_options, options, quant)
    if fused is not None:
        return dict(fused)
    if quant.fmt not in layout.weight_formats:
        others = [n for n in backend_names() if quant.fmt in get_layout(n).weight_formats]
        raise BadInput(f"in-memory conversion: backend {options.backend} takes {', '.join(layout.weight_formats)} "
                       f"experts, not {quant.fmt} (backends that take {quant.fmt}: {', '.join(others) or 'none'}; for "
                       f"float experts set ConvertOptions.quant to QuantOptions(fmt={layout.weight_formats[0]!r}))")  # fmt: skip
    canon = canonical_experts(tensors, row_order=row_order, quant=quant)
    return dict(layout.to_kernel(canon, activation, layout_options, options.kernel_choice))


def _consistent_floats(t: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``t`` is a float layer the general path would take as it is: w13 [E, 2I, H] and w2
    [E, H, I] of one float dtype on one device, H and I positive multiples of 32, both biases or none
    ([E, 2I], [E, H]). Anything else goes the general way, which names what is wrong."""
    w13, w2, b13, b2 = t["w13"], t["w2"], t.get("w13_bias"), t.get("w2_bias")
    if "w13_scale" in t or "w2_scale" in t or w13.dim() != 3 or w2.dim() != 3:
        return False
    if not w13.dtype.is_floating_point or w2.dtype != w13.dtype or w2.device != w13.device:
        return False
    E, n13, H = w13.shape
    sizes_ok = n13 % 64 == 0 and H % 32 == 0 and n13 > 0 and H > 0 and tuple(w2.shape) == (E, H, n13 // 2)
    if b13 is None or b2 is None:
        return sizes_ok and b13 is None and b2 is None
    return sizes_ok and tuple(b13.shape) == (E, n13) and tuple(b2.shape) == (E, H)


def _fused(layout: Layout, t: dict[str, torch.Tensor], row_order: str, activation: str, layout_options: LayoutOptions,
           options: ConvertOptions, q: QuantOptions) -> Mapping[str, torch.Tensor] | None:  # fmt: skip
    """The layout's one-pass conversion of float experts (its ``float_to_kernel``: the same bytes as
    quantizing, then ``to_kernel``) for a consistent float layer; None when the layout has none (the
    LayoutBase default), it does not apply or the experts hold a NaN/Inf (the general path then decides)."""
    if row_order not in ROW_ORDERS or not _consistent_floats(t):
        return None
    return layout.float_to_kernel(t, row_order, activation, layout_options, str(q.fmt), str(q.scale_rounding),
                                  options.kernel_choice)  # fmt: skip


def layer_quant(layer: EngineLayer) -> QuantOptions:
    """How ``layer``'s output quantized float experts (its manifest's ``weight_format`` and
    ``scale_rounding``; no rule recorded, MX bytes moved untouched: the format's default rule)."""
    if layer.weight_format not in QUANTIZE_FORMATS:
        raise BadInput(f"update_layer: the layer's output holds {layer.weight_format} experts (manifest weight_format); "
                       f"in-memory conversion writes {', '.join(QUANTIZE_FORMATS)}")  # fmt: skip
    return QuantOptions(layer.weight_format, layer.scale_rounding or ScaleRounding.AUTO)


def _check_fits(layer: EngineLayer, new: Mapping[str, torch.Tensor]) -> None:
    """BadInput, before any buffer is written, unless ``new`` has exactly the layer's tensors, each
    of its shape and element size."""
    extra = sorted(set(new) - set(layer.tensors))
    if extra:
        raise BadInput(f"update_layer: the conversion gives {', '.join(extra)}, which the layer does not hold "
                       f"(it holds {', '.join(layer.tensors)}; biases given for a layer without them?)")  # fmt: skip
    for key, held in layer.tensors.items():
        got = new.get(key)
        if got is None or got.shape != held.shape or got.element_size() != held.element_size():
            shown = "absent" if got is None else f"{got.dtype}{list(got.shape)}"
            raise BadInput(f"update_layer: {key} converts to {shown}, the layer holds {held.dtype}{list(held.shape)}")


def update_layer(layer: EngineLayer, tensors: Mapping[str, torch.Tensor], *, quant: QuantOptions | None = None,
                 row_order: str | None = None) -> EngineLayer:  # fmt: skip
    """Convert ``tensors`` for ``layer``'s backend, activation and layout options and quantization
    (its manifest's: float experts are quantized as that output's were, :func:`layer_quant`;
    ``quant`` overrides) and copy the result into the layer's stored buffers, in place (no buffer
    is reallocated), then re-wrap ``layer.experts`` from them (cheap: the triton and marlin runners
    hold those very buffers, as views, so an engine keeping the old objects sees the new weights
    too; a runner that copies, like the test suite's toy, gets fresh objects). Every converted
    tensor must be one the layer holds, of its size, and every held one must be converted (BadInput
    naming the tensor otherwise, raised before any buffer is written). Returns ``layer``."""
    lay = layer.layout
    if lay is None:
        raise BadInput(f"update_layer: layer {layer.layer} carries no manifest layout (load it with mxconv.engines.loader)")
    activation = ActivationDescription.from_layout(lay).activation  # the layout's describe() records it (None: its default)
    opts = ConvertOptions(layer.backend, activation=activation,
                          layout_options=lay.option_values, quant=quant or layer_quant(layer))  # fmt: skip
    new = convert_layer({k: v.to(layer.device) for k, v in tensors.items()}, opts, row_order=row_order or lay.w13_row_order,
                        choices=lay.choices_of(layer.layer, layer.rank))  # fmt: skip
    _check_fits(layer, new)
    for key, held in layer.tensors.items():
        got = new[key]
        held.copy_(got.view(held.dtype) if got.dtype != held.dtype else got)
    if layer.rewrap is not None:
        layer.experts = layer.rewrap(layer.tensors)
    return layer
