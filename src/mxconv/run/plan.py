"""Planning a ``quantize`` or ``repack`` run from headers alone (``--dry-run`` reads no data).

A :class:`Plan` holds every output tensor with its shape and dtype, grouped into ordered work items
(byte copies, and one item per MoE layer), the padded sizes and layout description of a repack,
and the shard split of every output directory (one per TP rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mxconv.experts.stack import LayoutSizes
from mxconv.experts.tensors import TensorSpec
from mxconv.experts.tp import tp_ranges
from mxconv.source.checkpoint import Checkpoint, layer_index
from mxconv.errors import BadInput
from mxconv.families.base import FamilyReader, ModelInfo, MoELayerRef
from mxconv.families.config_values import check_config_values
from mxconv.families.quant_config import FLOAT_DTYPES
from mxconv.layouts import get_layout
from mxconv.layouts.base import Layout
from mxconv.run.linears import LinearSelection, fused_part_warnings, linear_item, select_linears
from mxconv.run.options import ConversionKind, Job, QuantOptions, RepackOptions, Targets, WeightFormat
from mxconv.run.pipeline import WorkItem
from mxconv.run.repack_formats import ExpertShape, chosen_format_note, default_weight_format, experts_are, weight_format_hint
from mxconv.output.shards import PlannedTensor, ShardPlan, plan_shards

if TYPE_CHECKING:
    from mxconv.run.memory import MemoryPlan


@dataclass(frozen=True)
class Plan:
    """Everything a run needs, computed from headers only by :func:`build_plan`, and not changed
    afterwards (the memory plan of a run is made beside it: :mod:`mxconv.run.plan_costs`)."""

    ckpt: Checkpoint
    reader: FamilyReader
    info: ModelInfo
    quant: QuantOptions
    repack: RepackOptions | None
    refs: list[MoELayerRef]  # converted MoE layers
    items: list[WorkItem]
    dests: list[list[PlannedTensor]]  # per output directory (rank), tensors in write order
    sizes: LayoutSizes | None = None  # per-rank sizes (repack)
    rank_ranges: list[tuple[int, int]] = field(default_factory=list)
    layout_desc: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # sizes the engine takes but computes wrongly
    linears: LinearSelection | None = None  # the model's linear layers (mxconv.run.linears); None for repack

    @property
    def command(self) -> Job:
        return Job.REPACK if self.repack is not None else Job.QUANTIZE

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

    def summary(self, memory: MemoryPlan | None = None) -> dict[str, Any]:
        """What the run does, for --dry-run and the run's summary; ``memory``: its memory plan."""
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
        if memory is not None:
            s["memory"] = memory.describe()
        if self.warnings:
            s["warnings"] = list(self.warnings)
        if self.repack is not None and (note := chosen_format_note(self.info.expert_format, get_layout(self.repack.backend),
                                                                   self.repack.weight_format)):
            s["weight_format_note"] = note
        if self.sizes is not None:
            s["sizes"] = {
                "hidden_size": self.sizes.hidden_size,
                "intermediate_size_per_rank": self.sizes.intermediate_size,
                "padded_hidden_size": self.sizes.padded_hidden_size,
                "padded_intermediate_size": self.sizes.padded_intermediate_size,
            }
        return s

    @property
    def weight_format(self) -> WeightFormat:
        """Format of the written experts: quantize's --format; repack: the layout's (_layout_weight_format)."""
        if self.repack is not None:
            return WeightFormat(self.sizes.weight_format if self.sizes is not None else WeightFormat.MXFP4)
        return self.quant.fmt

    def conversion(self, ref: MoELayerRef) -> ConversionKind:
        """How layer ``ref``'s experts become :attr:`weight_format` (see :class:`ConversionKind`)."""
        src = self.reader.layer_format(ref)
        if src == self.weight_format:
            return ConversionKind.AS_IS
        if src == WeightFormat.MXFP4 and self.weight_format == WeightFormat.MXFP8:
            return ConversionKind.MXFP4_TO_MXFP8
        if src == WeightFormat.MXFP4 and self.weight_format == WeightFormat.FP8_BLOCK:
            return ConversionKind.MXFP4_TO_FP8_BLOCK
        return ConversionKind.QUANTIZE


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




def _check_request(ckpt: Checkpoint, quant: QuantOptions, repack: RepackOptions | None) -> None:
    """BadInput for what no plan can do with ``ckpt``, whatever its layers."""
    if repack is not None and (quant.include or quant.ignore):
        # A kernel-layout output holds kernel tensors for every MoE layer (the output contract);
        # a partial repack would mix them with per-expert source tensors.
        raise BadInput("repack converts every MoE layer; QuantOptions.include/QuantOptions.ignore apply to quantize only")
    if repack is not None and quant.targets != Targets.EXPERTS:
        raise BadInput("QuantOptions.targets linear applies to quantize only (repack lays out the routed experts)")
    if ckpt.kind == "kernel":
        backend = ckpt.manifest.backend if ckpt.manifest is not None else None
        raise BadInput(
            f"{ckpt.root}: already a kernel-layout checkpoint (backend "
            f"{backend or ckpt.config.get('mxconv_layout', {}).get('backend', '?')}); "
            "convert from its canonical source instead"
        )


def _check_sizes(ckpt: Checkpoint, info: ModelInfo) -> None:
    for what, size in (("hidden_size", info.hidden_size), ("intermediate_size", info.intermediate_size)):
        if size % 32:
            raise BadInput(
                f"{ckpt.root}: {what} {size} is not a multiple of 32; MX formats need the reduction "
                "dimension of every expert weight to split into 32-element blocks"
            )


def _select_layers(reader: FamilyReader, quant: QuantOptions) -> list[MoELayerRef]:
    """The MoE layers ``quant`` converts; BadInput where the layers left out could not stay as they are."""
    all_refs = reader.layer_refs()
    refs = [r for r in all_refs if quant.selects(r.module_prefix)]
    if not refs:
        raise BadInput("no MoE layer selected (check QuantOptions.include / QuantOptions.ignore)")
    selected = {r.layer for r in refs}
    mx = (WeightFormat.MXFP4, WeightFormat.MXFP8)  # fp8-block outputs: _check_fp8_block
    for r in all_refs:
        kept = reader.layer_format(r)
        if r.layer not in selected and kept == WeightFormat.INT4:
            raise BadInput(
                f"{r.module_prefix}.experts: QuantOptions.include/QuantOptions.ignore would leave this INT4 layer as it is next to {quant.fmt} "
                "layers, which one quantization_config cannot describe; quantize every MoE layer of an INT4 checkpoint"
            )
        if r.layer not in selected and kept in mx and quant.fmt in mx and kept != quant.fmt:
            raise BadInput(
                f"{r.module_prefix}.experts: QuantOptions.include/QuantOptions.ignore leave this {kept} layer as it is, next to {quant.fmt} "
                f"layers; a checkpoint holds one MX format (select every MoE layer, or set QuantOptions.fmt {kept})"
            )
    return refs


def _check_fp8_block(ckpt: Checkpoint, reader: FamilyReader, refs: list[MoELayerRef]) -> None:
    """BadInput for a block-FP8 output that no loader would read right: an MoE layer --include/--ignore
    leave out that is not float (the config lists a left-out layer as not converted, which loaders read
    as float weights), or block-FP8 experts already."""
    selected = {r.layer for r in refs}
    for r in reader.layer_refs():
        kept = reader.layer_format(r)
        if r.layer not in selected and kept not in FLOAT_DTYPES.values():
            raise BadInput(f"{r.module_prefix}.experts: QuantOptions.include/QuantOptions.ignore leave this {kept} MoE layer as it is; a "
                           "block-FP8 output lists the layers it leaves out as not converted, which loaders read as "
                           "float weights (select this layer too)")
        if r.layer in selected and kept == "fp8_block":
            raise BadInput(f"{ckpt.root}: {r.module_prefix}.experts are block-FP8 already; nothing to convert")


def _select_linears(ckpt: Checkpoint, all_refs: list[MoELayerRef], quant: QuantOptions) -> LinearSelection:
    """The model's linear layers: quantized with --targets linear, described in the config either way."""
    linears = select_linears(ckpt, all_refs, quant)
    if linears.carried and quant.fmt != WeightFormat.MXFP8:
        raise BadInput(f"{ckpt.root}: linear layers such as {linears.carried[0]} are MXFP8 already; an output holds "
                       f"one MX format (set QuantOptions.fmt mxfp8)")
    return linears


@dataclass(frozen=True)
class _LayoutPlan:
    """A repack's layout: the options resolved, per-rank sizes and ranges, the kernel tensors' specs."""

    layout: Layout
    repack: RepackOptions
    sizes: LayoutSizes
    rank_ranges: list[tuple[int, int]]
    specs: dict[str, TensorSpec]
    desc: dict[str, Any]
    warnings: list[str]


def _layout_weight_format(ckpt: Checkpoint, info: ModelInfo, layout: Layout, repack: RepackOptions, I_rank: int) -> WeightFormat:
    """The experts' format in the layout: ``repack.weight_format`` when given, else the source's
    (repack_formats.default_weight_format); BadInput when the layout does not take it, saying what the
    experts are and what would work (repack_formats.weight_format_hint, which inspect quotes too)."""
    src, asked = info.expert_format, repack.weight_format
    if src == WeightFormat.INT4 and asked is not None:
        raise BadInput(f"{ckpt.root}: experts are INT4 (compressed-tensors, bf16 group scales); repack keeps them INT4 "
                       f"(RepackOptions.weight_format {asked} applies to float or MX sources; quantize the source first)")
    if src == WeightFormat.MXFP8 and asked == WeightFormat.MXFP4:
        raise BadInput(f"{ckpt.root}: experts are MXFP8; repack moves MX bytes as they are and never re-quantizes "
                       "them to MXFP4 (repack the bf16 source with RepackOptions.weight_format mxfp4, or leave RepackOptions.weight_format out)")
    wfmt = asked or default_weight_format(src, layout)
    if wfmt not in layout.weight_formats:
        lead = f"RepackOptions.weight_format {wfmt}" if asked is not None else f"{ckpt.root}: experts are {experts_are(src)}"
        shape = ExpertShape(info.num_experts, info.hidden_size, I_rank, info.row_order, info.has_expert_bias)
        hint = weight_format_hint(src, layout, wfmt, shape, repack.activation, repack.layout_options)
        raise BadInput(f"{lead}; backend {repack.backend} takes {', '.join(layout.weight_formats)} experts only: {hint}")
    return wfmt


def _plan_layout(ckpt: Checkpoint, info: ModelInfo, repack: RepackOptions) -> _LayoutPlan:
    """Check ``repack`` against the model and size its layout (per TP rank, padded)."""
    layout = get_layout(repack.backend)
    if repack.activation is not None and repack.activation not in layout.activations:
        raise BadInput(
            f"RepackOptions.activation {repack.activation!r} is not valid for backend {repack.backend}; "
            f"choose one of {', '.join(layout.activations)}"
        )
    rank_ranges = tp_ranges(info.intermediate_size, repack.tp)
    widths = {e - s for s, e in rank_ranges}
    I_rank = max(widths)
    wfmt = _layout_weight_format(ckpt, info, layout, repack, I_rank)
    if repack.activation is None:
        repack = replace(repack, activation=layout.default_activation(str(wfmt)))
    opts = layout.resolve_options(repack.layout_options)
    why = layout.tp_refusal(repack.tp, opts)
    if why:
        raise BadInput(f"RepackOptions.tp {repack.tp} RepackOptions.backend {repack.backend}: {why}")
    repack = replace(repack, layout_options=opts)
    Hp, Ip = layout.padded_sizes(info.hidden_size, I_rank, info.row_order, repack.activation, opts, weight_format=str(wfmt))
    for w in widths:  # every rank pads to the same Ip; make sure the smaller ones fit the rule too
        layout.padded_sizes(info.hidden_size, w, info.row_order, repack.activation, opts, weight_format=str(wfmt))
    if wfmt != WeightFormat.MXFP4 and len(widths) > 1:
        raise BadInput(
            f"RepackOptions.tp {repack.tp} splits intermediate size {info.intermediate_size} unevenly "
            f"({sorted(widths)} per rank); vLLM never pads {wfmt} experts up to a common rank width, so every rank "
            "needs the same width"
        )
    sizes = LayoutSizes(info.num_experts, info.hidden_size, I_rank, Hp, Ip, info.row_order, info.has_expert_bias, wfmt)
    return _LayoutPlan(layout, repack, sizes, rank_ranges, layout.kernel_specs(sizes, repack.activation, opts),
                       layout.describe(sizes, repack.activation, opts), layout.size_warnings(info.hidden_size, I_rank, opts))


def _check_input_scales(ckpt: Checkpoint, reader: FamilyReader, refs: list[MoELayerRef], layout: Layout, activation: str) -> None:
    """BadInput naming the missing tensors when ``activation`` stores the source's static FP8 input
    scales (the layout's ``input_scale_activations``) and a layer's experts do not all carry them."""
    if activation not in layout.input_scale_activations:
        return
    for ref in refs:
        names = reader.input_scale_names(ref)
        missing = [n for n in names if n not in ckpt.tensors]
        if names and not missing:
            continue
        p = f"{ref.module_prefix}.experts"
        if not names or len(missing) == len(names):  # none at all: the per-expert patterns
            listed = f"{p}.*.gate_up_proj.input_scale, {p}.*.down_proj.input_scale"
        else:
            listed = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise BadInput(
            f"{ckpt.root}: RepackOptions.activation {activation} stores the source's static FP8 input scales, and tensors "
            f"{listed} are missing (a W4A8 source, e.g. an AMD Quark export with FP8 input scales, carries them; "
            f"{reader.title} checkpoints without them take RepackOptions.activation bf16)"
        )


def _expert_specs(reader: FamilyReader, ref: MoELayerRef, quant: QuantOptions, lay: _LayoutPlan | None) -> dict[str, TensorSpec]:
    """Output tensor name -> spec of one MoE layer's experts."""
    if lay is None:
        return reader.quantized_specs(ref, quant.fmt)
    return {f"{ref.module_prefix}.experts.{k}": spec for k, spec in lay.specs.items()}


def _plan_items(ckpt: Checkpoint, reader: FamilyReader, quant: QuantOptions, refs: list[MoELayerRef],
                linears: LinearSelection | None, lay: _LayoutPlan | None) -> tuple[list[WorkItem], list[list[PlannedTensor]]]:
    """The work items in write order and, per destination (rank), its tensors: byte copies grouped
    by layer and MoE layer items interleaved in layer order, then the byte copies moved first (in
    shards of their own)."""
    all_refs = reader.layer_refs()
    consumed = {n for r in refs for n in r.source_names} | (linears.source_names() if linears is not None else set())
    lin_by_layer = linears.by_layer() if linears is not None else {}
    dests: list[list[PlannedTensor]] = [[] for _ in range(lay.repack.tp if lay else 1)]
    items: list[WorkItem] = []
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
            out = _expert_specs(reader, ref, quant, lay)
            d.extend(PlannedTensor(n, spec, "expert") for n, spec in out.items())
            item.out_names.append(list(out))
        items.append(item)
    items = [i for i in items if i.kind == "copy"] + [i for i in items if i.kind != "copy"]
    copied = {n for i in items if i.kind == "copy" for n in i.copy_names}
    dests = [[t for t in d if t.name in copied] + [t for t in d if t.name not in copied] for d in dests]
    return items, dests


def build_plan(ckpt: Checkpoint, reader: FamilyReader, quant: QuantOptions, repack: RepackOptions | None = None) -> Plan:
    """Plan a quantize (``repack`` None) or repack run of ``ckpt`` from headers only."""
    _check_request(ckpt, quant, repack)
    info = reader.model_info()
    check_config_values(ckpt, info)
    _check_sizes(ckpt, info)
    refs = _select_layers(reader, quant)
    fp8_warnings = []
    if quant.fmt == WeightFormat.FP8_BLOCK and repack is None:
        _check_fp8_block(ckpt, reader, refs)
        if info.hidden_size % 128 or info.intermediate_size % 128:
            fp8_warnings.append(
                f"hidden size {info.hidden_size} / expert intermediate size {info.intermediate_size} not multiples of 128: "
                "the edge 128x128 blocks are partial, which transformers' fine-grained FP8 dequantization misreads (it "
                "derives the block from the scale grid) and vLLM refuses under TP where a rank's share is not a multiple of 128")
    linears = _select_linears(ckpt, reader.layer_refs(), quant) if repack is None else None
    lay = _plan_layout(ckpt, info, repack) if repack is not None else None
    if lay is not None:
        _check_input_scales(ckpt, reader, refs, lay.layout, lay.repack.activation)
        wfmt = WeightFormat(lay.sizes.weight_format)
        if wfmt in (WeightFormat.MXFP4, WeightFormat.MXFP8) and wfmt != quant.fmt:
            # experts quantized on the way take the scale rule of the format they end up in (as given, else that
            # format's own): a float source defaulted to MXFP8, an explicit RepackOptions.weight_format, a
            # checkpoint whose other layers are block FP8 beside MXFP8 ones
            quant = quant.for_format(wfmt)
    items, dests = _plan_items(ckpt, reader, quant, refs, linears, lay)
    if lay is None:
        return Plan(ckpt, reader, info, quant, None, refs, items, dests, warnings=fused_part_warnings(linears) + fp8_warnings,
                    linears=linears)
    return Plan(ckpt, reader, info, quant, lay.repack, refs, items, dests, sizes=lay.sizes, rank_ranges=lay.rank_ranges,
                layout_desc=lay.desc, warnings=lay.warnings)
