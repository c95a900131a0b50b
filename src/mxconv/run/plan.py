"""Planning a ``quantize`` or ``repack`` run from headers alone (``--dry-run`` reads no data).

A :class:`Plan` holds every output tensor with its shape and dtype, grouped into ordered work items
(byte copies, and one item per MoE layer), the padded sizes and layout description of a repack,
and the shard split of every output directory (one per TP rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from mxconv.source.checkpoint import Checkpoint, layer_index
from mxconv.errors import BadInput
from mxconv.families import FamilyReader, ModelInfo, MoELayerRef
from mxconv.layouts import Layout, LayoutSizes, TensorSpec, backend_names, get_layout
from mxconv.layouts.base import tp_ranges
from mxconv.layouts.padding import KernelChoice
from mxconv.run.linears import TARGETS, LinearSelection, check_patterns, fused_part_warnings, linear_item, name_matches, select_linears
from mxconv.run.pipeline import WorkItem
from mxconv.mx.formats import resolve_scale_mode  # numerics imports torch, numerics_format does not
from mxconv.output.shards import PlannedTensor, ShardPlan, plan_shards


@dataclass
class QuantOptions:
    """What `quantize` (and `repack` of a float source) does to expert weights."""

    fmt: str = "mxfp4"
    scale_rounding: str = "auto"  # "auto" = numerics.DEFAULT_SCALE_MODES[fmt]
    allow_nonfinite: bool = False
    # patterns (one or a list) over "<module_prefix>.experts" and, with targets "linear", linear module
    # names: a regex found anywhere, or compressed-tensors' "re:REGEX" (re.match); see linears.name_matches
    include: str | list[str] | None = None  # default: every MoE layer (and linear)
    ignore: str | list[str] | None = None
    targets: str = "experts"  # "experts": routed experts only; "linear": every linear layer too, MXFP8 (mxconv.run.linears)
    skip_unaligned: bool = False  # targets "linear": leave a linear whose input is not a multiple of 32 alone

    def selects(self, ref: MoELayerRef) -> bool:
        target = f"{ref.module_prefix}.experts"
        if self.include and not name_matches(self.include, target):
            return False
        if self.ignore and name_matches(self.ignore, target):
            return False
        return True


@dataclass
class RepackOptions:
    backend: str
    activation: str
    tp: int = 1
    layout_options: dict[str, Any] = field(default_factory=dict)
    kernel_choice: KernelChoice = KernelChoice.AUTO  # Triton layout kernels on CUDA, or torch ops only (same bytes)


@dataclass
class Plan:
    """Everything a run needs, computed from headers only."""

    ckpt: Checkpoint
    reader: FamilyReader
    info: ModelInfo
    command: str  # "quantize" | "repack"
    quant: QuantOptions
    repack: RepackOptions | None
    refs: list[MoELayerRef]  # converted MoE layers
    items: list[WorkItem]
    dests: list[list[PlannedTensor]]  # per output directory (rank), tensors in write order
    sizes: LayoutSizes | None = None  # per-rank sizes (repack)
    rank_ranges: list[tuple[int, int]] = field(default_factory=list)
    layout_desc: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # sizes the engine takes but computes wrongly
    memory: Any = None  # mxconv.run.memory.MemoryPlan: pipeline depth, experts per group (convert.plan_memory)
    memory_device: str | None = None  # the device type it was planned for
    linears: LinearSelection | None = None  # the model's linear layers (mxconv.run.linears); None for repack

    @property
    def bytes_in(self) -> int:
        return sum(i.in_bytes for i in self.items)

    @property
    def bytes_out(self) -> int:
        return sum(t.nbytes for d in self.dests for t in d)

    def copied_names(self) -> list[str]:
        """The tensors copied byte for byte, in write order (they come first: their own shards)."""
        return [n for i in self.items if i.kind == "copy" for n in i.copy_names]

    def shard_plans(self, max_shard_size: int) -> list[list[ShardPlan]]:
        """Per destination, its shards: the byte copies' first, then the converted tensors'."""
        ncopy = len(self.copied_names())
        return [plan_shards(d, max_shard_size, first_group=ncopy) for d in self.dests]

    def expert_bytes_out(self) -> int:
        return sum(t.nbytes for d in self.dests for t in d if t.role == "expert")

    def summary(self) -> dict[str, Any]:
        s: dict[str, Any] = {
            "command": self.command,
            "family": self.info.family,
            "source_format": self.info.expert_format,
            "weight_format": self.weight_format,
            "moe_layers_converted": len(self.refs),
            "tensors_out": sum(len(d) for d in self.dests),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "expert_bytes_out": self.expert_bytes_out(),
        }
        if self.linears is not None and self.linears.mx_modules():
            s["linears_quantized"] = len(self.linears.quantized)
            s["linear_bytes_out"] = sum(t.nbytes for d in self.dests for t in d if t.role == "linear")
        if self.memory is not None:
            s["memory"] = self.memory.describe()
        if self.warnings:
            s["warnings"] = list(self.warnings)
        if self.sizes is not None:
            s["sizes"] = {
                "hidden_size": self.sizes.hidden_size,
                "intermediate_size_per_rank": self.sizes.intermediate_size,
                "padded_hidden_size": self.sizes.padded_hidden_size,
                "padded_intermediate_size": self.sizes.padded_intermediate_size,
            }
        return s

    @property
    def weight_format(self) -> str:
        """Format of the written experts: quantize's --format; repack: mxfp4, or int4 (kept) for an INT4 source."""
        if self.command == "repack":
            return self.sizes.weight_format if self.sizes is not None else "mxfp4"
        return self.quant.fmt

    def conversion(self, ref: MoELayerRef) -> str:
        """How layer ``ref``'s experts become :attr:`weight_format`: "as_is" (the same MX or INT4
        format: bytes moved untouched), "mxfp4_to_mxfp8" (lossless re-coding, same scales) or
        "quantize" (floats, or the fp32 dequantization of block-FP8, INT4 or another MX format)."""
        src = self.reader.layer_format(ref)
        if src == self.weight_format:
            return "as_is"
        if src == "mxfp4" and self.weight_format == "mxfp8":
            return "mxfp4_to_mxfp8"
        return "quantize"


def _layer_of(name: str) -> int:
    """Sort key: the tensor's layer, global tensors (embeddings, final norm, head) last."""
    L = layer_index(name)
    return 1 << 30 if L is None else L


def kernel_params(info: ModelInfo) -> dict[str, float] | None:
    """Activation constants the fused kernels take (gemm1_alpha/beta/clamp_limit), None for SiLU."""
    if info.activation == "swigluoai":
        return {
            "gemm1_alpha": 1.702 if info.swiglu_alpha is None else float(info.swiglu_alpha),
            "gemm1_beta": 1.0,
            "gemm1_clamp_limit": 7.0 if info.swiglu_limit is None else float(info.swiglu_limit),
        }
    return None


def _check_quant_options(q: QuantOptions) -> None:
    from mxconv.mx.formats import FORMATS, SCALE_MODES

    if q.fmt not in FORMATS:
        raise BadInput(f"--format {q.fmt!r} is not supported; choose one of {', '.join(FORMATS)}")
    if q.scale_rounding not in SCALE_MODES + ("auto",):
        raise BadInput(f"--scale-rounding {q.scale_rounding!r} is not supported; choose auto or one of {', '.join(SCALE_MODES)}")
    for flag, pat in (("--include", q.include), ("--ignore", q.ignore)):
        check_patterns(flag, pat)
    if q.targets not in TARGETS:
        raise BadInput(f"--targets {q.targets!r} is not supported; choose one of {', '.join(TARGETS)}")
    if q.targets == "linear" and q.fmt != "mxfp8":
        raise BadInput("--targets linear quantizes every linear layer to MXFP8 (vLLM's online MXFP8 method); "
                       "pass --format mxfp8")


def build_plan(
    ckpt: Checkpoint,
    reader: FamilyReader,
    command: str,
    quant: QuantOptions,
    repack: RepackOptions | None = None,
) -> Plan:
    """Plan a quantize (repack=None) or repack run from headers only."""
    _check_quant_options(quant)
    quant = replace(quant, scale_rounding=resolve_scale_mode(quant.fmt, quant.scale_rounding))
    if (command == "repack" or repack is not None) and (quant.include or quant.ignore):
        # A kernel-layout output holds kernel tensors for every MoE layer (the output contract);
        # a partial repack would mix them with per-expert source tensors.
        raise BadInput("repack converts every MoE layer; --include/--ignore apply to quantize only")
    if (command == "repack" or repack is not None) and quant.targets != "experts":
        raise BadInput("--targets linear applies to quantize only (repack lays out the routed experts)")
    if ckpt.kind == "kernel":
        raise BadInput(
            f"{ckpt.root}: already a kernel-layout checkpoint (backend "
            f"{(ckpt.manifest or {}).get('backend') or ckpt.config.get('mxconv_layout', {}).get('backend', '?')}); "
            "convert from its canonical source instead"
        )
    info = reader.model_info()
    for what, size in (("hidden_size", info.hidden_size), ("intermediate_size", info.intermediate_size)):
        if size % 32:
            raise BadInput(
                f"{ckpt.root}: {what} {size} is not a multiple of 32; MX formats need the reduction "
                "dimension of every expert weight to split into 32-element blocks"
            )
    all_refs = reader.layer_refs()
    refs = [r for r in all_refs if quant.selects(r)]
    if not refs:
        raise BadInput("no MoE layer selected (check --include / --ignore)")
    selected = {r.layer for r in refs}
    for r in all_refs:
        kept = reader.layer_format(r)
        if r.layer not in selected and kept == "int4":
            raise BadInput(
                f"{r.module_prefix}.experts: --include/--ignore would leave this INT4 layer as it is next to {quant.fmt} "
                "layers, which one quantization_config cannot describe; quantize every MoE layer of an INT4 checkpoint"
            )
        if r.layer not in selected and kept in ("mxfp4", "mxfp8") and kept != quant.fmt:
            raise BadInput(
                f"{r.module_prefix}.experts: --include/--ignore leave this {kept} layer as it is, next to {quant.fmt} "
                f"layers; a checkpoint holds one MX format (select every MoE layer, or use --format {kept})"
            )
    consumed = {n for r in refs for n in r.source_names}
    ndest = repack.tp if repack else 1
    dests: list[list[PlannedTensor]] = [[] for _ in range(ndest)]
    items: list[WorkItem] = []
    plan = Plan(ckpt, reader, info, command, quant, repack, refs, items, dests)
    if repack is None:  # linear layers: quantized with --targets linear, described in the config either way
        plan.linears = select_linears(ckpt, all_refs, quant)
        if plan.linears.carried and quant.fmt != "mxfp8":
            raise BadInput(f"{ckpt.root}: linear layers such as {plan.linears.carried[0]} are MXFP8 already; an output holds "
                           f"one MX format (use --format mxfp8)")
        consumed |= plan.linears.source_names()
        plan.warnings += fused_part_warnings(plan.linears)
    lin_by_layer = plan.linears.by_layer() if plan.linears is not None else {}

    layout: Layout | None = None
    if repack is not None:
        layout = get_layout(repack.backend)
        if repack.activation not in layout.activations:
            raise BadInput(
                f"--activation {repack.activation!r} is not valid for backend {repack.backend}; "
                f"choose one of {', '.join(layout.activations)}"
            )
        if info.expert_format == "mxfp8":
            raise BadInput(
                f"{ckpt.root}: experts are MXFP8; backend layouts take MXFP4 experts "
                "(repack the bf16 source, or quantize it with --format mxfp4 first)"
            )
        # INT4 experts stay INT4 (layouts that take them); everything else becomes MXFP4 on the way
        wfmt = "int4" if info.expert_format == "int4" else "mxfp4"
        takes = getattr(layout, "weight_formats", ("mxfp4",))
        if wfmt not in takes:
            others = [n for n in backend_names() if wfmt in getattr(get_layout(n), "weight_formats", ("mxfp4",))]
            raise BadInput(
                f"{ckpt.root}: experts are {wfmt} (compressed-tensors INT4, bf16 group scales); backend {repack.backend} "
                f"takes {', '.join(takes)} experts only (backends that take {wfmt}: {', '.join(others) or 'none'}; "
                "or quantize the source first: mxconv quantize SRC OUT --format mxfp4)"
            )
        fmt_kw: dict[str, Any] = {} if wfmt == "mxfp4" else {"weight_format": wfmt}
        plan.rank_ranges = tp_ranges(info.intermediate_size, repack.tp)
        widths = {e - s for s, e in plan.rank_ranges}
        I_rank = max(widths)
        opts = layout.resolve_options(repack.layout_options)
        repack = plan.repack = replace(repack, layout_options=opts)
        Hp, Ip = layout.padded_sizes(info.hidden_size, I_rank, info.row_order, repack.activation, opts, **fmt_kw)
        for w in widths:  # every rank pads to the same Ip; make sure the smaller ones fit the rule too
            layout.padded_sizes(info.hidden_size, w, info.row_order, repack.activation, opts, **fmt_kw)
        if fmt_kw and len(widths) > 1:
            raise BadInput(
                f"--tp {repack.tp} splits intermediate size {info.intermediate_size} unevenly "
                f"({sorted(widths)} per rank); {wfmt} experts are never padded, so every rank needs the same width"
            )
        plan.sizes = LayoutSizes(info.num_experts, info.hidden_size, I_rank, Hp, Ip, info.row_order, info.has_expert_bias,
                                 wfmt)
        specs = layout.kernel_specs(plan.sizes, repack.activation, repack.layout_options)
        plan.layout_desc = layout.describe(plan.sizes, repack.activation, repack.layout_options)
        plan.warnings = layout.size_warnings(info.hidden_size, I_rank, opts)

    # group copy tensors by layer, interleave MoE layer items in layer order
    by_layer: dict[int, list[str]] = {}
    for name in ckpt.tensors:
        if name not in consumed:
            by_layer.setdefault(_layer_of(name), []).append(name)
    ref_by_layer = {r.layer: r for r in refs}
    routers = {n for r in all_refs for n in (r.router_weight, r.router_bias, r.correction_bias) if n}
    for layer in sorted(set(by_layer) | set(ref_by_layer) | set(lin_by_layer)):
        names = sorted(by_layer.get(layer, []))
        if names:
            for d in dests:
                for n in names:
                    role = "router" if n in routers else "copy"
                    d.append(PlannedTensor(n, TensorSpec(ckpt.tensors[n].shape, ckpt.tensors[n].dtype), role, ckpt.tensors[n]))
            items.append(WorkItem("copy", ckpt.total_bytes(names), copy_names=names))
        if layer in lin_by_layer:
            items.append(linear_item(ckpt, lin_by_layer[layer], dests))
        ref = ref_by_layer.get(layer)
        if ref is None:
            continue
        item = WorkItem("layer", ckpt.total_bytes(list(ref.source_names)), payload=ref)
        for d in dests:
            if layout is None:
                out = reader.quantized_specs(ref, quant.fmt)
                names_out = list(out)
                for n, spec in out.items():
                    d.append(PlannedTensor(n, spec, "expert"))
            else:
                names_out = []
                for k, spec in specs.items():
                    n = f"{ref.module_prefix}.experts.{k}"
                    names_out.append(n)
                    d.append(PlannedTensor(n, spec, "expert"))
            item.out_names.append(names_out)
        items.append(item)
    # Byte copies first, in shards of their own
    items[:] = [i for i in items if i.kind == "copy"] + [i for i in items if i.kind != "copy"]
    copied = set(plan.copied_names())
    for d in dests:
        d[:] = [t for t in d if t.name in copied] + [t for t in d if t.name not in copied]
    return plan
