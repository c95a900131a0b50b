"""Refit: new expert weights pushed into a running vLLM that loaded an mxconv output
(``load_format="mxconv"``), written into the storage vLLM already holds.

    from mxconv.integrations.vllm import refit
    llm = LLM(model="out-cpu", load_format="mxconv")
    refit(llm, "step-1200/")          # a checkpoint of the same model: bf16 or MXFP4 experts

All or nothing, in two steps. First every vLLM worker (one a TP rank) converts every MoE layer and
checks it, writing nothing: it reads the checkpoint's routed experts with mxconv's family reader, takes
its rank's share of the intermediate channels (before quantizing: the blocks run along K, so the
bytes are those of slicing the whole layer's), quantizes float experts as the output's were (its
manifest's ``weight_format`` and ``scale_rounding``: the bytes ``quantize`` + ``repack`` would write),
lays them out with the output's backend and checks each tensor against vLLM's (shape, element size);
the converted layers wait on the worker. Only when every worker has converted every layer does the
second step write: the non-expert tensors (attention, embeddings, norms, routers) through vLLM's own
in-place reload (the worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``,
vLLM 0.32: its layer-wise reload loads them with the model's weight loaders, re-runs each layer's
post-load processing, e.g. the CPU build's linear prepack, and copies the result into the storage the
engine holds; MoE layers receive nothing there), read from the checkpoint inside each worker, then
the experts, copied into the layers' parameters in place: no parameter is reallocated (same
``data_ptr``), so captured graphs stay valid. A failure of the first step leaves the engine as it was.

Backends whose vLLM conversion replaces the parameters with other objects (TRITON: triton_kernels
tensors; AITER: flagged views) are refused: refit writes into plain parameters only.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mxconv.engines.in_memory import canonical_experts
from mxconv.engines.loader import LayerSource
from mxconv.errors import BadInput
from mxconv.experts.padding import pad_canonical
from mxconv.experts.tp import tp_share
from mxconv.families import detect_family
from mxconv.families.base import MoELayer
from mxconv.integrations.vllm.mappings import MAPPINGS, BackendMapping
from mxconv.layouts import get_layout
from mxconv.run.options import QuantOptions, ScaleRounding
from mxconv.source.checkpoint import open_checkpoint

_PENDING = "_mxconv_refit_pending"  # on vLLM's model: the converted layers between the two steps

Pending = list[tuple[LayerSource, torch.nn.Module, dict[str, torch.Tensor]]]  # (layer's source, vLLM's layer, new tensors)


def refit(llm: Any, source: str | Path, non_experts: bool = True) -> list[int]:
    """Push checkpoint ``source`` into ``llm`` (a ``vllm.LLM`` that loaded an mxconv output with
    ``load_format="mxconv"``) on every worker, all or nothing (module docstring): its routed experts
    converted and checked on every worker first, then its non-expert tensors through vLLM's reload
    (unless ``non_experts`` is false) and the experts written; returns the MoE layers written (of the
    first worker). BadInput, before anything is written, when ``llm`` holds no mxconv-loaded layer or
    one of a backend refit cannot write, ``source`` lacks one of its layers, or a layer converts to
    other shapes than vLLM holds."""
    path = str(Path(source).expanduser().resolve())
    try:
        done = llm.apply_model(functools.partial(prepare_model, path))
    except BaseException:
        llm.apply_model(discard_model)
        raise
    llm.collective_rpc(commit_worker, args=(path, non_experts))
    return list(done[0])


def non_expert_tensors(source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of checkpoint ``source`` that no MoE layer's experts are built from, by checkpoint
    name (what the model's ``load_weights`` takes), read one at a time where it is consumed."""
    ckpt = open_checkpoint(source)
    experts = {n for ref in detect_family(ckpt).layer_refs() for n in ref.source_names}
    return ((name, ckpt.read(name)) for name in ckpt.tensors if name not in experts)


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
    """Rank ``src.rank``'s kernel tensors of ``layer``, as ``repack`` wrote the output ``src`` is from:
    the rank's share taken before quantizing and laying out (only that share is converted)."""
    m, lay = src.manifest, src.manifest.layout
    quant = QuantOptions(m.weight_format, m.scale_rounding or ScaleRounding.AUTO)
    stacks = _stacks(layer)
    if src.tp_size > 1:
        start, end = m.rank_ranges[src.rank]
        stacks = tp_share(stacks, layer.row_order, start, end, src.rank)
    canon = canonical_experts(stacks, row_order=layer.row_order, quant=quant)
    if canon.intermediate_size < lay.intermediate_size:  # a narrower last rank, padded as repack pads it
        canon = pad_canonical(canon, canon.hidden_size, lay.intermediate_size)
    layout = get_layout(src.backend)
    options = layout.with_choices(layout.resolve_options(lay.option_values), lay.choices_of(src.layer, src.rank))
    return dict(layout.to_kernel(canon, str(m.activation), options))


def _refittable(module: torch.nn.Module) -> tuple[LayerSource, BackendMapping] | None:
    """(where the layer came from, its mapping) of an MoE layer mxconv's loader filled; BadInput where
    vLLM's conversion replaced its parameters with objects refit cannot write into."""
    method = getattr(module, "quant_method", None)
    src, mapping = getattr(method, "mxconv_src", None), getattr(method, "mxconv_mapping", None)
    if src is None or mapping is None:
        return None
    if mapping.build is not None:
        plain = ", ".join(b for b, m in MAPPINGS.items() if m.build is None and m.refusal is None)
        raise BadInput(f"refit: {src.root} is a {mapping.backend} output, which vLLM holds as {mapping.vllm_backend} "
                       f"kernel objects in place of its parameters ({mapping.build.rpartition(':')[2]}); refit writes "
                       f"into plain parameters only ({plain} outputs): reload the engine from a new output instead")  # fmt: skip
    return src, mapping


def _checked(source: str, module: torch.nn.Module, src: LayerSource, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's tensors of the layer, by the names of ``new``; BadInput unless each new one has its shape
    and element size."""
    held = {k: getattr(module, k, None) for k in new}
    for key, t in new.items():
        p = held[key]
        if not isinstance(p, torch.Tensor) or tuple(t.shape) != tuple(p.shape) or t.element_size() != p.element_size():
            raise BadInput(f"{source}: layer {src.layer} {key} converts to {t.dtype}{list(t.shape)}, vLLM holds "
                           f"{f'{p.dtype}{list(p.shape)}' if isinstance(p, torch.Tensor) else 'no tensor'}: not the "
                           f"model {src.root} is from; nothing was written")  # fmt: skip
    return held  # type: ignore[return-value]


def prepare_model(source: str, model: torch.nn.Module) -> list[int]:
    """Step one of :func:`refit` inside one vLLM worker (``LLM.apply_model``): every MoE layer converted
    and checked, nothing written; the result waits on ``model``. Returns the layers."""
    discard_model(model)
    layers = [(m, *hit) for m in model.modules() if (hit := _refittable(m)) is not None]
    if not layers:
        raise BadInput("refit: this vLLM holds no MoE layer loaded by mxconv (load the output with load_format='mxconv')")
    reader = detect_family(open_checkpoint(source))
    refs = {r.layer: r for r in reader.layer_refs()}
    pending: Pending = []
    for module, src, _ in layers:
        ref = refs.get(src.layer)
        if ref is None:
            raise BadInput(f"{source}: has no MoE layer {src.layer}, which vLLM holds from {src.root}; nothing was written")
        new = rank_kernel(reader.read_layer(ref), src)
        _checked(source, module, src, new)
        pending.append((src, module, new))
    model.__dict__[_PENDING] = pending
    return sorted(src.layer for src, _, _ in pending)


def discard_model(model: torch.nn.Module) -> None:
    """Drop converted layers waiting on ``model`` (a failed step one)."""
    model.__dict__.pop(_PENDING, None)


def commit_worker(worker: Any, source: str, non_experts: bool) -> None:
    """Step two of :func:`refit` on one vLLM worker (``LLM.collective_rpc``): the non-expert tensors
    through vLLM's reload, read here from ``source``, then the converted experts copied in place."""
    model = worker.get_model()
    pending: Pending | None = model.__dict__.pop(_PENDING, None)
    if pending is None:
        raise BadInput("refit: no converted layers wait on this vLLM worker (run refit(), not its steps)")
    if non_experts:
        worker.reload_weights(weights_iterator=non_expert_tensors(source), is_checkpoint_format=True)
    with torch.no_grad():
        for src, module, new in pending:
            held = _checked(source, module, src, new)  # vLLM's tensors now (its reload left them in place)
            for key, t in new.items():  # same element size checked: a dtype rename at most (bytes as written)
                held[key].data.copy_(t if t.dtype == held[key].dtype else t.view(held[key].dtype))
