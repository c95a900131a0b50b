"""The memory budget of a conversion (``--max-memory``, ``--max-gpu-memory``).

A run holds, at any moment, the items the pipeline has in flight (:mod:`mxconv.run.pipeline`):
``prefetch`` items read or being read, the one being computed with its temporaries, and up to
``queue_depth + 2`` results waiting for or being written. An item is one MoE layer, or, when one
layer does not fit the budget, one group of its experts: the layer is then read, computed and
written group after group (every output tensor is a stack over experts along dim 0, or one tensor
per expert, so a group is a run of dim-0 rows and the output bytes are the same whatever the
grouping). This module plans, from headers alone, the pipeline depth and the experts per group of
every layer so that the estimated peak stays within the budget:

    host peak = RSS now (+ torch's import where not yet loaded) + reserve (see ``beside_items``)
                + prefetch x read bytes + compute temporaries (CPU device) + (queue_depth + 2) x output bytes

per item, where the per-expert figures are:

* read: the source bytes of one expert as stored (bf16, block-FP8, MX, INT4);
* output: the bytes one expert's result takes, every destination (TP rank) together;
* compute temporaries: quantizing from a float (or block-FP8, INT4, other MX) source holds about
  ``QUANTIZE_BYTES`` per element of w13 (fp32 copies for the error statistic: measured 12.5-15 on
  CPU), for at most ``compute.CHUNK_ELEMENTS`` elements at a time; MXFP4 -> MXFP8 about
  ``MXFP4_TO_MXFP8_BYTES``; the layout (repack) or the per-expert split (quantize) ``OUTPUT_COPIES``
  times the output.

Other computed items (one layer's linear layers under ``--targets linear``) are converted whole:
their bytes count as one "expert" and must fit the same pipeline.

On a CUDA device the temporaries are on the GPU (checked against the GPU budget, with the item's
input and output there too) and the host keeps pinned copies of the results (``PINNED`` x output:
torch's pinned allocator rounds blocks up to powers of two).

Defaults (:mod:`mxconv.run.machine`): ``--max-memory`` = ``HOST_FRACTION`` of the memory available when the run starts
(MemAvailable) plus what the process already holds; ``--max-gpu-memory`` = ``GPU_FRACTION`` of the
device's free memory. The pipeline keeps two items read ahead and two results queued when whole
layers fit, one result queued otherwise, and reads one item ahead only when not even one expert
fits with two. A budget too small for one expert is an error (exit 2) that names the sizes.

Items are also kept small for overlap, whatever the budget: where the reader can read a range of
experts, a layer whose experts read more than ``ITEM_READ_BYTES`` is cut into equal groups that
read at most that much each. The pipeline fills (the first item read before anything is
computed) and drains (the last item computed and written after the last read) one item at a
time; with a 6.4 GB gpt-oss-120b bf16 layer as one item that left the disk idle for seconds at
both ends (``scripts/bench_e2e.py``). The bytes written do not depend on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mxconv.errors import BadInput
from mxconv.sizes import human_bytes, parse_size
from mxconv.output.writer import COPY_CHUNK
from mxconv.run.machine import default_gpu_budget, default_host_budget

QUANTIZE_BYTES = 16  # host/GPU bytes per w13 element while a float stack is quantized (+ error statistic)
MXFP4_TO_MXFP8_BYTES = 14  # per w13 element of the lossless MXFP4 -> MXFP8 re-coding
OUTPUT_COPIES = {"repack": 4, "quantize": 2}  # temporaries of the layout / per-expert split, x output
PINNED = 2
# Held beside the items (beside_items), at most RESERVE: a byte copy's chunk being written and
# hashed, the one before it (hashing may lag one chunk) and the next one being read
# (mxconv.source.diskio.read_ahead), plus the NaN scan's temporary (at most a chunk); and the freed blocks of earlier items that the allocator keeps (glibc keeps
# blocks under its 32 MiB mmap threshold: ~90 MB beside 12 MB experts converted one at a time).
RESERVE = 4 * COPY_CHUNK
GROWTH = 32 << 20  # what the process adds once the pipeline runs (compute modules, threads): 14-18 MB measured
SLACK = 0.1
CUDA_HOST_RESERVE = 1 << 30  # host memory of the CUDA context, Triton and the pinned allocator
# What importing torch adds to the RSS (measured 186-204 MiB, torch 2.13 CPU build). A plan made in a
# process without torch (``mxconv inspect`` imports none) counts it: the run it plans for has it.
TORCH_RSS = 200 << 20
PIPELINE_DEPTHS = ((2, 2), (2, 1), (1, 1))  # (prefetch, queue_depth), most overlap first
ITEM_READ_BYTES = 512 << 20  # a layer item reads at most this much where it can be cut (module doc)


def parse_memory(text: str | None, flag: str) -> int | None:
    """``--max-memory`` / ``--max-gpu-memory`` value: 2GB, 512MiB, ... (None when not given)."""
    if text is None or text.strip().lower() in ("", "auto"):
        return None
    return parse_size(text, flag)


@dataclass(frozen=True)
class MemoryBudget:
    """What the user asked for (None = the default) and where the compute runs."""

    host: int | None = None
    gpu: int | None = None
    device_type: str = "cpu"


@dataclass(frozen=True)
class ExpertCost:
    """Bytes one expert of a layer takes in flight (see the module docstring)."""

    read: int
    out: int
    work: int  # compute temporaries per expert, for at most ``work_cap`` experts at a time
    work_cap: int
    out_temp: int  # layout / split temporaries per expert

    def compute(self, g: int) -> int:
        return self.work * min(g, self.work_cap) + self.out_temp * g


@dataclass
class MemoryPlan:
    """Pipeline depth and experts per group for one run, with the estimates behind them."""

    host_budget: int | None
    gpu_budget: int | None
    baseline: int  # host bytes held before the pipeline starts (RSS + reserve)
    prefetch: int
    queue_depth: int
    num_experts: int
    groups: dict[int, int] = field(default_factory=dict)  # layer -> experts per group
    peak_host: int = 0
    peak_gpu: int | None = None
    min_host: int = 0  # the smallest host budget that works (one expert, least overlap)
    default_budget: bool = True
    item_read_cap: int | None = None  # groups were cut to read at most this much (overlap, not memory)

    @property
    def split(self) -> bool:
        return any(g < self.num_experts for g in self.groups.values())

    def group_sizes(self) -> list[int]:
        return sorted(set(self.groups.values()))

    def to_json(self) -> dict[str, Any]:
        return {
            "max_memory": self.host_budget,
            "max_memory_default": self.default_budget,
            "max_gpu_memory": self.gpu_budget,
            "prefetch": self.prefetch,
            "queue_depth": self.queue_depth,
            "experts_per_group": {str(L): g for L, g in sorted(self.groups.items())},
            "groups_per_layer": {str(L): math.ceil(self.num_experts / g) for L, g in sorted(self.groups.items())},
            "estimated_peak_host_bytes": self.peak_host,
            "estimated_peak_gpu_bytes": self.peak_gpu,
            "smallest_max_memory": self.min_host,
            "item_read_cap": self.item_read_cap,
        }

    def describe(self) -> str:
        """One line for --dry-run and the summary table."""
        sizes = self.group_sizes()
        if not self.split:
            what = "whole layers"
        else:
            gs = "/".join(str(g) for g in sizes)
            n = max(math.ceil(self.num_experts / g) for g in sizes)
            what = f"groups of {gs} of {self.num_experts} experts ({n} per layer)"
            if self.item_read_cap is not None:
                what += f", each reading at most {human_bytes(self.item_read_cap)} to keep the stages overlapped"
        budget = "no limit" if self.host_budget is None else human_bytes(self.host_budget)
        if self.default_budget and self.host_budget is not None:
            budget += " (default)"
        s = (f"{what}; {self.prefetch} read ahead, {self.queue_depth} queued for writing; "
             f"host peak ~{human_bytes(self.peak_host)} of {budget}")
        if self.peak_gpu is not None:
            s += f"; GPU peak ~{human_bytes(self.peak_gpu)} of {human_bytes(self.gpu_budget or 0)}"
        return s


def host_bytes(c: ExpertCost, g: int, prefetch: int, queue_depth: int, device_type: str) -> int:
    """Host bytes of the items in flight (baseline excluded) for groups of ``g`` experts."""
    if device_type == "cuda":
        return prefetch * c.read * g + PINNED * (queue_depth + 2) * c.out * g
    return prefetch * c.read * g + c.compute(g) + (queue_depth + 2) * c.out * g


def gpu_bytes(c: ExpertCost, g: int) -> int:
    """GPU bytes of the one item being computed: its input, temporaries and result."""
    return c.read * g + c.compute(g) + c.out * g


def _with_slack(n: int) -> int:
    return int(n * (1 + SLACK))


def _largest_group(c: ExpertCost, E: int, room: int, prefetch: int, queue_depth: int, device_type: str,
                   gpu_room: int | None) -> int:
    """The most experts (<= E) whose items fit ``room`` host bytes (and ``gpu_room``); 0 if none."""
    lo, hi = 0, E
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = _with_slack(host_bytes(c, mid, prefetch, queue_depth, device_type)) <= room
        if ok and gpu_room is not None:
            ok = _with_slack(gpu_bytes(c, mid)) <= gpu_room
        if ok:
            lo = mid
        else:
            hi = mid - 1
    return lo


def balance(g: int, E: int) -> int:
    """Equal groups: the smallest size that needs no more groups than groups of ``g`` do."""
    n = math.ceil(E / g)
    return math.ceil(E / n)


@dataclass(frozen=True)
class _Fit:
    """Whether items fit a budget: the host room beside ``baseline`` and the GPU room (None: no limit)."""

    costs: dict[int, ExpertCost]
    num_experts: int
    budget: MemoryBudget
    baseline: int
    splittable: bool
    whole: dict[str, ExpertCost]
    item_read_cap: int | None
    default_budget: bool

    @property
    def room(self) -> int | None:
        return None if self.budget.host is None else self.budget.host - self.baseline

    @property
    def gpu_room(self) -> int | None:
        return self.budget.gpu if self.budget.device_type == "cuda" else None

    def host_fits(self, c: ExpertCost, g: int, p: int, q: int) -> bool:
        return self.room is None or _with_slack(host_bytes(c, g, p, q, self.budget.device_type)) <= self.room

    def fits(self, c: ExpertCost, g: int, p: int, q: int) -> bool:
        gpu_room = self.gpu_room
        return self.host_fits(c, g, p, q) and (gpu_room is None or _with_slack(gpu_bytes(c, g)) <= gpu_room)

    def whole_fit(self, p: int, q: int) -> bool:
        return all(self.fits(c, 1, p, q) for c in self.whole.values())

    def layers_fit(self, p: int, q: int) -> bool:
        return self.whole_fit(p, q) and all(self.fits(c, self.num_experts, p, q) for c in self.costs.values())

    def finish(self, p: int, q: int, groups: dict[int, int]) -> MemoryPlan:
        """The plan for pipeline depth (``p``, ``q``) and ``groups``, cut to ``item_read_cap``."""
        E, dev, baseline = self.num_experts, self.budget.device_type, self.baseline
        capped = False
        if self.splittable and self.item_read_cap is not None:
            for L, g in groups.items():
                most = max(1, self.item_read_cap // max(1, self.costs[L].read))
                if most < g:
                    groups[L], capped = balance(most, E), True
        items = [(self.costs[L], g) for L, g in groups.items()] + [(c, 1) for c in self.whole.values()]
        peak = baseline + max((_with_slack(host_bytes(c, g, p, q, dev)) for c, g in items), default=0)
        peak_gpu = max((_with_slack(gpu_bytes(c, g)) for c, g in items), default=0) if dev == "cuda" else None
        least = [(c, 1 if self.splittable else E) for c in self.costs.values()] + [(c, 1) for c in self.whole.values()]
        smallest = baseline + max((_with_slack(host_bytes(c, g, 1, 1, dev)) for c, g in least), default=0)
        return MemoryPlan(self.budget.host, self.gpu_room, baseline, p, q, E, groups, peak, peak_gpu, smallest,
                          self.default_budget, self.item_read_cap if capped else None)


@dataclass(frozen=True)
class ItemCosts:
    """What goes through the pipeline: the MoE layers by per-expert cost (``names``: how a refusal
    names a layer), and other items converted whole, by name (their cost as one "expert").
    ``splittable``: the reader can read a range of experts and the output's tensors are stacks over
    experts, so a layer can be cut into groups; ``whole_why``: why not, for a refusal."""

    costs: dict[int, ExpertCost]
    num_experts: int
    names: dict[int, str] = field(default_factory=dict)
    whole: dict[str, ExpertCost] = field(default_factory=dict)
    splittable: bool = True
    whole_why: str = "this family's reader reads whole layers"


@dataclass(frozen=True)
class Baseline:
    """Host bytes held whatever the items: ``total`` (RSS at planning + reserve); ``held``, the part
    the process holds now, which a refusal names apart from the rest, set aside for ``aside``
    (None: all of it is held)."""

    total: int
    held: int | None = None
    aside: str = ""


def plan_memory(items: ItemCosts, budget: MemoryBudget, baseline: Baseline, *, default_budget: bool = False,
                item_read_cap: int | None = None) -> MemoryPlan:
    """Pipeline depth and experts per group for ``items`` under ``budget``.

    Whole layers with the deepest pipeline that fits, else the largest equal groups with one result
    queued (two items read ahead, or one when not even one expert fits with two). The items
    converted whole must fit the same pipeline. BadInput naming the sizes when one expert does not
    fit (or, where layers are not cut (``items.splittable`` False: a reader that reads whole layers, a
    layout that declares ``whole_layers``), one layer; or one whole item).
    ``item_read_cap``: where the reader can read expert ranges, groups read at most this many bytes
    (at least one expert) even where more would fit."""
    costs, E, splittable, names = items.costs, items.num_experts, items.splittable, items.names
    fit = _Fit(costs, E, budget, baseline.total, splittable, items.whole, item_read_cap, default_budget)
    dev = budget.device_type
    for p, q in PIPELINE_DEPTHS[:2]:  # whole layers, the deepest pipeline that fits
        if fit.layers_fit(p, q):
            return fit.finish(p, q, {L: E for L in costs})
    p, q = PIPELINE_DEPTHS[-1]
    beside = _beside(baseline)
    if not splittable and fit.whole_fit(p, q):
        if fit.layers_fit(p, q):
            return fit.finish(p, q, {L: E for L in costs})
        L, c = max(costs.items(), key=lambda kv: host_bytes(kv[1], E, p, q, dev))
        if fit.host_fits(c, E, p, q):  # the host has room for every layer: the GPU has not, for this one
            L, c = max(costs.items(), key=lambda kv: gpu_bytes(kv[1], E))
            one = _with_slack(gpu_bytes(c, E))
            raise BadInput(f"MemoryBudget.gpu {human_bytes(fit.gpu_room or 0)} is too small for {names.get(L, f'layer {L}')}: "
                           f"{items.whole_why}, and computing one layer takes about {human_bytes(one)} on the GPU; give at "
                           f"least {human_bytes(one)}")
        one = _with_slack(host_bytes(c, E, p, q, dev))
        raise BadInput(
            f"MemoryBudget.host {human_bytes(budget.host or 0)} is too small for {names.get(L, f'layer {L}')}: {items.whole_why}, "
            f"and one layer in flight takes about {human_bytes(one)} "
            f"on top of {beside}; give at least {human_bytes(baseline.total + one)}"
        )
    for p, q in PIPELINE_DEPTHS[1:] if splittable else ():
        if not fit.whole_fit(p, q):
            continue
        room = fit.room if fit.room is not None else 1 << 62
        groups = {L: _largest_group(c, E, room, p, q, dev, fit.gpu_room) for L, c in costs.items()}
        if all(g >= 1 for g in groups.values()):
            return fit.finish(p, q, {L: balance(g, E) for L, g in groups.items()})
    raise _refusal(fit, names, beside)


def _refusal(fit: _Fit, names: dict[int, str], beside: str) -> BadInput:
    """Not even one expert (or one item converted whole) fits: the error naming the sizes."""
    p, q = PIPELINE_DEPTHS[-1]
    dev, budget = fit.budget.device_type, fit.budget
    failing = [(n, c) for n, c in fit.whole.items() if not fit.fits(c, 1, p, q)]
    if failing:
        where, c = max(failing, key=lambda kv: host_bytes(kv[1], 1, p, q, dev))
        what, unit = f"{where} (converted whole)", "it"
    else:
        L, c = max(fit.costs.items(), key=lambda kv: host_bytes(kv[1], 1, p, q, dev))
        what, unit = f"one expert of {names.get(L, f'layer {L}')}", "one expert"
    if not fit.host_fits(c, 1, p, q):
        one = _with_slack(host_bytes(c, 1, p, q, dev))
        return BadInput(
            f"MemoryBudget.host {human_bytes(budget.host or 0)} is too small for {what}: {unit} in flight "
            f"takes about {human_bytes(one)} (read {human_bytes(c.read)}, output {human_bytes(c.out)}, compute "
            f"{human_bytes(c.compute(1) if dev != 'cuda' else 0)}) on top of {beside}; give at least "
            f"{human_bytes(fit.baseline + one)}"
        )
    one = _with_slack(gpu_bytes(c, 1))
    return BadInput(
        f"MemoryBudget.gpu {human_bytes(fit.gpu_room or 0)} is too small for {what}: computing {unit} "
        f"takes about {human_bytes(one)} on the GPU (input {human_bytes(c.read)}, temporaries {human_bytes(c.compute(1))}, "
        f"output {human_bytes(c.out)}); give at least {human_bytes(one)}"
    )


def _beside(baseline: Baseline) -> str:
    """What a refusal says the items come on top of: the process's RSS, and what is set aside."""
    total, held = baseline.total, baseline.held
    if held is None or held >= total:
        return f"the {human_bytes(total)} the process holds already"
    return f"the {human_bytes(held)} the process holds now and {human_bytes(total - held)} set aside for {baseline.aside}"


def resolve_budget(host: int | None, gpu: int | None, device: Any) -> tuple[MemoryBudget, bool]:
    """The budget a run uses (defaults filled in from the machine) and whether the host one is the default."""
    dev_type = getattr(device, "type", str(device))
    return MemoryBudget(
        host if host is not None else default_host_budget(),
        gpu if gpu is not None else default_gpu_budget(device),
        dev_type,
    ), host is None
