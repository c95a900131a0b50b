"""A plan's memory: the per-expert bytes of its items (headers only), its :class:`MemoryPlan` under a
budget (:func:`memory_plan_for`, the model in :mod:`mxconv.run.memory`), and its work items cut into
the planned groups of experts (:func:`work_items`)."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import Any

from mxconv.errors import BadInput
from mxconv.layouts import get_layout
from mxconv.output.writer import COPY_CHUNK
from mxconv.run.compute import CHUNK_ELEMENTS
from mxconv.run.memory import (
    CUDA_HOST_RESERVE, GROWTH, ITEM_READ_BYTES, MXFP4_TO_MXFP8_BYTES, OUTPUT_COPIES, QUANTIZE_BYTES, RESERVE, TORCH_RSS,
    Baseline, ExpertCost, ItemCosts, MemoryBudget, MemoryPlan, host_bytes, plan_memory, resolve_budget,
)
from mxconv.run.machine import process_rss
from mxconv.run.options import ConversionKind
from mxconv.run.pipeline import WorkItem
from mxconv.run.plan import Plan


def memory_plan_for(plan: Plan, budget: MemoryBudget | None, device: Any) -> MemoryPlan:
    """The memory plan (pipeline depth, experts per group) of ``plan`` on ``device`` (a
    torch.device, or a device type: ``inspect`` plans for "cpu" without torch) under ``budget``
    (None fields: the machine's defaults, see :mod:`mxconv.run.memory`); BadInput when one expert
    does not fit."""
    budget = budget or MemoryBudget()
    resolved, default = resolve_budget(budget.host, budget.gpu, device)
    return plan_for(plan, resolved, default_budget=default)


def beside_items(plan: Plan, costs: list[ExpertCost], device_type: str) -> int:
    """Host bytes set aside beside the items (RESERVE's comment): GROWTH, and four chunks of the
    largest byte copy plus one expert (or whole item) in flight, at most RESERVE: a small
    model's copies and freed blocks are small."""
    largest = max((plan.ckpt.info(n).nbytes for n in plan.copied_names()), default=0)
    one = max((host_bytes(c, 1, 1, 1, device_type) for c in costs), default=0)
    return GROWTH + min(RESERVE, 4 * min(COPY_CHUNK, largest) + one)


def expert_cost(plan: Plan, item: WorkItem) -> ExpertCost:
    """Per-expert bytes of a layer item of ``plan`` (headers only)."""
    ref = item.payload
    E = plan.info.num_experts
    H, I = plan.info.hidden_size, plan.info.intermediate_size
    planned = {t.name: t.nbytes for d in plan.dests for t in d if t.role == "expert"}
    out = sum(planned[n] for names in item.out_names for n in names)
    conversion = plan.conversion(ref)
    w13 = 2 * I * H
    if conversion == ConversionKind.AS_IS:
        work, cap = 0, E  # bytes moved as they are
    elif conversion == ConversionKind.MXFP4_TO_MXFP8:
        work, cap = MXFP4_TO_MXFP8_BYTES * w13, E  # lossless re-coding, the whole item at once
    else:
        work, cap = QUANTIZE_BYTES * w13, max(1, CHUNK_ELEMENTS // w13)
    copies = OUTPUT_COPIES["repack" if plan.repack is not None else "quantize"]
    return ExpertCost(-(-item.in_bytes // E), -(-out // E), work, cap, copies * -(-out // E))


def whole_item_cost(plan: Plan, item: WorkItem) -> ExpertCost:
    """Bytes of an item converted whole (e.g. one layer's linears, ``--targets linear``): its
    read and output bytes, quantize temporaries for its largest weight (one at a time)."""
    planned = {t.name: t.nbytes for d in plan.dests for t in d}
    out = sum(planned.get(n, 0) for names in item.out_names for n in names)
    shapes = [getattr(r, "shape", None) for r in (item.payload if isinstance(item.payload, (list, tuple)) else ())]
    elems = max((math.prod(s) for s in shapes if s), default=item.in_bytes // 2)
    return ExpertCost(item.in_bytes, out, QUANTIZE_BYTES * elems, 1, OUTPUT_COPIES["quantize"] * out)


def plan_for(plan: Plan, budget: MemoryBudget, default_budget: bool = False, baseline: int | None = None) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``plan``'s items under ``budget`` (RSS now as the baseline, unless
    ``baseline`` gives the bytes held beside the pipeline): MoE layer items by expert, other
    computed items whole."""
    layers = [i for i in plan.items if i.kind == "layer"]
    costs = {i.payload.layer: expert_cost(plan, i) for i in layers}
    names = {i.payload.layer: i.payload.module_prefix + ".experts" for i in layers}
    whole = {f"the {i.kind} item writing {i.out_names[0][0]}": whole_item_cost(plan, i)
             for i in plan.items if i.kind not in ("copy", "layer") and i.out_names and i.out_names[0]}
    whole_layers = whole_layers_why(plan)
    items = ItemCosts(costs, plan.info.num_experts, names, whole, splittable=plan.reader.reads_expert_ranges and whole_layers is None,
                      whole_why=whole_layers or ItemCosts.whole_why)  # fmt: skip
    if baseline is not None:
        beside = Baseline(baseline)
    else:
        torch_rss = 0 if "torch" in sys.modules else TORCH_RSS
        cuda = CUDA_HOST_RESERVE if budget.device_type == "cuda" else 0
        held = process_rss()
        total = held + torch_rss + cuda + beside_items(plan, [*costs.values(), *whole.values()], budget.device_type)
        aside = ("threads, byte-copy chunks and freed blocks the allocator keeps" + (", torch's import" if torch_rss else "")
                 + (", the CUDA context" if cuda else ""))
        beside = Baseline(total, held, aside)
    return plan_memory(items, budget, beside, default_budget=default_budget, item_read_cap=ITEM_READ_BYTES)


def whole_layers_why(plan: Plan) -> str | None:
    """Why ``plan``'s output is written a whole layer at a time (its layout's ``whole_layers`` for the
    experts' format: a kernel tensor mixes experts); None when layers may be cut into expert groups."""
    return get_layout(plan.repack.backend).whole_layers(str(plan.weight_format)) if plan.repack is not None else None


def work_items(items: list[WorkItem], mem: MemoryPlan | None, whole_why: str | None = None) -> list[WorkItem]:
    """``items`` with every layer item cut into its groups of experts (in expert order); a group
    reads a share of the layer's bytes (for the progress bar) and writes the layer's tensor names
    (whole per-expert tensors, or parts of ``[E, ...]`` stacks). ``whole_why`` (:func:`whole_layers_why`):
    BadInput for a memory plan that cuts layers, naming why this output cannot be cut."""
    if mem is None or not mem.split:
        return list(items)
    if whole_why is not None:
        raise BadInput(f"the memory plan cuts MoE layers into groups of experts ({mem.describe()}), but {whole_why}: "
                       "give MemoryBudget.host room for a whole layer")
    out = []
    E = mem.num_experts
    for item in items:
        g = mem.groups.get(item.payload.layer, E) if item.kind == "layer" else E
        if item.kind != "layer" or g >= E:
            out.append(item)
            continue
        for e0 in range(0, E, g):
            e1 = min(E, e0 + g)
            share = item.in_bytes * e1 // E - item.in_bytes * e0 // E
            out.append(replace(item, in_bytes=share, experts=(e0, e1)))
    return out
