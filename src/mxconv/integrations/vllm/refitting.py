"""Refit: new expert weights pushed into a running vLLM that loaded an mxconv output
(``load_format="mxconv"``), written into the storage vLLM already holds.

    from mxconv.integrations.vllm import refit
    llm = LLM(model="out-cpu", load_format="mxconv")
    refit(llm, "step-1200/")          # a checkpoint of the same model: bf16 or MXFP4 experts

Each vLLM worker (one a TP rank) reads the checkpoint's routed experts layer by layer with mxconv's
family reader, quantizes float experts as the output's were (its manifest's ``weight_format`` and
``scale_rounding``: the bytes ``quantize`` + ``repack`` would write), takes its rank's share of the
intermediate channels, lays it out with the output's backend and copies it into the layer's
parameters in place: no parameter is reallocated (same ``data_ptr``), so captured graphs stay valid.
Every converted tensor is checked against the parameter (shape, element size) before that layer is
written. The non-expert tensors (attention, embeddings, norms, routers) go first, through vLLM's own
in-place reload (``collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)``,
vLLM 0.32: its layer-wise reload loads them with the model's weight loaders, re-runs each layer's
post-load processing, e.g. the CPU build's linear prepack, and copies the result into the storage the
engine holds); MoE layers receive nothing there and keep their kernel tensors until the experts follow.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from mxconv.engines.in_memory import canonical_experts
from mxconv.engines.loader import LayerSource
from mxconv.errors import BadInput
from mxconv.families import detect_family
from mxconv.families.base import MoELayer
from mxconv.layouts import get_layout
from mxconv.layouts.padding import slice_tp
from mxconv.run.options import QuantOptions, ScaleRounding
from mxconv.source.checkpoint import open_checkpoint


def refit(llm: Any, source: str | Path, non_experts: bool = True) -> list[int]:
    """Push checkpoint ``source`` into ``llm`` (a ``vllm.LLM`` that loaded an mxconv output with
    ``load_format="mxconv"``) on every worker: its non-expert tensors through vLLM's reload (unless
    ``non_experts`` is false), then its routed experts; returns the MoE layers written (of the first
    worker). BadInput when ``llm`` holds no mxconv-loaded layer, ``source`` lacks one of its layers, or
    a layer converts to other shapes than vLLM holds."""
    path = str(Path(source).expanduser().resolve())
    if non_experts:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": non_expert_tensors(path), "is_checkpoint_format": True})
    done = llm.apply_model(functools.partial(refit_model, path))
    return list(done[0])


def non_expert_tensors(source: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of checkpoint ``source`` that no MoE layer's experts are built from, by checkpoint
    name (what the model's ``load_weights`` takes), read whole."""
    ckpt = open_checkpoint(source)
    experts = {n for ref in detect_family(ckpt).layer_refs() for n in ref.source_names}
    return [(name, ckpt.read(name)) for name in ckpt.tensors if name not in experts]


def _stacks(layer: MoELayer) -> dict[str, torch.Tensor]:
    """The layer's experts under in-memory conversion names (MXFP4 bytes, or floats)."""
    if layer.w13_mx is not None and layer.w2_mx is not None:
        out = {"w13": layer.w13_mx.data, "w13_scale": layer.w13_mx.scales, "w2": layer.w2_mx.data, "w2_scale": layer.w2_mx.scales}
    else:
        w13, w2 = layer.float_weights()
        out = {"w13": w13, "w2": w2}
    out.update({k: v for k, v in (("w13_bias", layer.w13_bias), ("w2_bias", layer.w2_bias)) if v is not None})
    return out


def rank_kernel(layer: MoELayer, src: LayerSource) -> dict[str, torch.Tensor]:
    """Rank ``src.rank``'s kernel tensors of ``layer``, as ``repack`` wrote the output ``src`` is from."""
    m, lay = src.manifest, src.manifest.layout
    quant = QuantOptions(m.weight_format, m.scale_rounding or ScaleRounding.AUTO)
    canon = canonical_experts(_stacks(layer), row_order=layer.row_order, quant=quant)
    if src.tp_size > 1:
        start, end = m.rank_ranges[src.rank]
        canon = slice_tp(canon, start, end, src.rank, pad_to=lay.intermediate_size)
    layout = get_layout(src.backend)
    return dict(layout.to_kernel(canon, str(m.activation), layout.resolve_options(lay.option_values)))


def refit_model(source: str, model: torch.nn.Module) -> list[int]:
    """:func:`refit` inside one vLLM worker (``LLM.apply_model``)."""
    reader = detect_family(open_checkpoint(source))
    refs = {r.layer: r for r in reader.layer_refs()}
    done = []
    for module in model.modules():
        src = getattr(getattr(module, "quant_method", None), "mxconv_src", None)
        if src is None:
            continue
        ref = refs.get(src.layer)
        if ref is None:
            raise BadInput(f"{source}: has no MoE layer {src.layer}, which vLLM holds from {src.root}")
        new = rank_kernel(reader.read_layer(ref), src)
        held = {k: getattr(module, k) for k in new}
        for key, t in new.items():
            p = held[key]
            if p is None or tuple(t.shape) != tuple(p.shape) or t.element_size() != p.element_size():
                raise BadInput(f"{source}: layer {src.layer} {key} converts to {t.dtype}{list(t.shape)}, vLLM holds "
                               f"{None if p is None else f'{p.dtype}{list(p.shape)}'}: not the model {src.root} is from")  # fmt: skip
        with torch.no_grad():
            for key, t in new.items():  # same element size checked: a dtype rename at most (bytes as written)
                held[key].data.copy_(t if t.dtype == held[key].dtype else t.view(held[key].dtype))
        done.append(src.layer)
    if not done:
        raise BadInput("refit: this vLLM holds no MoE layer loaded by mxconv (load the output with load_format='mxconv')")
    return sorted(done)
