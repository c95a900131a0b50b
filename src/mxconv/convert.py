"""The conversion jobs behind ``quantize`` and ``repack``: plan, then stream.

A plan is built from headers alone (so ``--dry-run`` costs no data reads): every output tensor with
its shape and dtype, grouped into ordered work items (byte copies, and one item per MoE layer), and
the shard split of every output directory (one per TP rank). ``execute`` then runs the plan through
the overlapped pipeline and writes the manifest last.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from mxconv.checkpoint import CONFIG_NAME, Checkpoint, layer_index
from mxconv.errors import BadInput
from mxconv.families import FamilyReader, FP8BlockStack, ModelInfo, MoELayer, MoELayerRef, MXStack
from mxconv.layouts import Layout, LayoutSizes, TensorSpec, get_layout
from mxconv.layouts.base import CanonicalExperts, slice_tp, tp_ranges
from mxconv.manifest import base_manifest, tensor_table, write_manifest
from mxconv.pipeline import WorkItem, run_pipeline
from mxconv.writer import PlannedTensor, ShardedWriter, atomic_write_json, plan_shards, prepare_output_dir



@dataclass
class QuantOptions:
    """What `quantize` (and `repack` of a float source) does to expert weights."""

    fmt: str = "mxfp4"
    scale_rounding: str = "rceil"
    allow_nonfinite: bool = False
    include: str | None = None  # regex over "<module_prefix>.experts"; default: every MoE layer
    ignore: str | None = None

    def selects(self, ref: MoELayerRef) -> bool:
        target = f"{ref.module_prefix}.experts"
        if self.include and not re.search(self.include, target):
            return False
        if self.ignore and re.search(self.ignore, target):
            return False
        return True


@dataclass
class RepackOptions:
    backend: str
    activation: str
    tp: int = 1
    layout_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ErrorStats:
    """Running relative-RMS error of quantized experts against their float source."""

    sq_err: float = 0.0
    sq_ref: float = 0.0
    tensors: int = 0

    def add(self, ref: torch.Tensor, approx: torch.Tensor) -> None:
        """Accumulate ||approx - ref||² and ||ref||²; ``approx`` (a fresh fp32 tensor) is consumed."""
        r = ref.float()
        self.sq_ref += float(r.square().sum())
        self.sq_err += float(approx.float().sub_(r).square_().sum())
        self.tensors += 1

    @property
    def rel_rms(self) -> float | None:
        return (self.sq_err / self.sq_ref) ** 0.5 if self.sq_ref > 0 else None


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

    @property
    def bytes_in(self) -> int:
        return sum(i.in_bytes for i in self.items)

    @property
    def bytes_out(self) -> int:
        return sum(t.nbytes for d in self.dests for t in d)

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
        return "mxfp4" if self.command == "repack" else self.quant.fmt


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
    from mxconv.numerics import FORMATS, SCALE_MODES

    if q.fmt not in FORMATS:
        raise BadInput(f"--format {q.fmt!r} is not supported; choose one of {', '.join(FORMATS)}")
    if q.scale_rounding not in SCALE_MODES:
        raise BadInput(f"--scale-rounding {q.scale_rounding!r} is not supported; choose one of {', '.join(SCALE_MODES)}")
    for flag, pat in (("--include", q.include), ("--ignore", q.ignore)):
        if pat:
            try:
                re.compile(pat)
            except re.error as exc:
                raise BadInput(f"{flag}: invalid regular expression {pat!r} ({exc})") from None


def build_plan(
    ckpt: Checkpoint,
    reader: FamilyReader,
    command: str,
    quant: QuantOptions,
    repack: RepackOptions | None = None,
) -> Plan:
    """Plan a quantize (repack=None) or repack run from headers only."""
    _check_quant_options(quant)
    if (command == "repack" or repack is not None) and (quant.include or quant.ignore):
        # A kernel-layout output holds kernel tensors for every MoE layer (the output contract);
        # a partial repack would mix them with per-expert source tensors.
        raise BadInput("repack converts every MoE layer; --include/--ignore apply to quantize only")
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
        plan.rank_ranges = tp_ranges(info.intermediate_size, repack.tp)
        widths = {e - s for s, e in plan.rank_ranges}
        I_rank = max(widths)
        opts = layout.resolve_options(repack.layout_options)
        repack = plan.repack = replace(repack, layout_options=opts)
        Hp, Ip = layout.padded_sizes(info.hidden_size, I_rank, info.row_order, repack.activation, opts)
        for w in widths:  # every rank pads to the same Ip; make sure the smaller ones fit the rule too
            layout.padded_sizes(info.hidden_size, w, info.row_order, repack.activation, opts)
        plan.sizes = LayoutSizes(info.num_experts, info.hidden_size, I_rank, Hp, Ip, info.row_order, info.has_expert_bias)
        specs = layout.kernel_specs(plan.sizes, repack.activation, repack.layout_options)
        plan.layout_desc = layout.describe(plan.sizes, repack.activation, repack.layout_options)

    # group copy tensors by layer, interleave MoE layer items in layer order
    by_layer: dict[int, list[str]] = {}
    for name in ckpt.tensors:
        if name not in consumed:
            by_layer.setdefault(_layer_of(name), []).append(name)
    ref_by_layer = {r.layer: r for r in refs}
    routers = {n for r in all_refs for n in (r.router_weight, r.router_bias, r.correction_bias) if n}
    for layer in sorted(set(by_layer) | set(ref_by_layer)):
        names = sorted(by_layer.get(layer, []))
        if names:
            for d in dests:
                for n in names:
                    role = "router" if n in routers else "copy"
                    d.append(PlannedTensor(n, TensorSpec(ckpt.tensors[n].shape, ckpt.tensors[n].torch_dtype), role, ckpt.tensors[n]))
            items.append(WorkItem("copy", ckpt.total_bytes(names), copy_names=names))
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
    return plan


# ---------------------------------------------------------------------------------------------
# per-layer compute
# ---------------------------------------------------------------------------------------------


def _mxfp4_to_mxfp8(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 codes -> E4M3 bytes with the same block scales (every E2M1 value is an E4M3 value)."""
    from mxconv.numerics import E2M1_VALUES, unpack_fp4

    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=data.device)
    vals = lut[unpack_fp4(data).long()]
    return vals.to(torch.float8_e4m3fn).view(torch.uint8)


def _nan_policy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace non-finite values by 0 and return the mask of blocks that held any ([..., K/32])."""
    bad = ~torch.isfinite(x)
    blocks = bad.view(*x.shape[:-1], x.shape[-1] // 32, 32).any(dim=-1)
    return torch.where(bad, torch.zeros((), dtype=x.dtype, device=x.device), x), blocks


# Largest expert chunk quantized at once (elements): bounds the fp32 temporaries on the device
# (input, dequantized copy for the error statistic) to a few GB whatever the layer size; a
# gpt-oss-20b w13 stack (530M elements) is still one launch.
CHUNK_ELEMENTS = 1 << 29


def quantize_stack(
    shape: tuple[int, int, int],
    chunk: Callable[[int, int], torch.Tensor],
    fmt: str,
    q: QuantOptions,
    where: str | Callable[[tuple[int, ...]], str],
    stats: ErrorStats | None,
    device: torch.device,
) -> MXStack:
    """Float stack [E, N, K] -> MXStack on ``device``, in expert chunks: ``chunk(e0, e1)`` returns
    experts [e0, e1) as a float tensor on ``device``. NaN/Inf are refused unless allowed."""
    from mxconv.numerics import dequantize_mx, first_nonfinite
    from mxconv.quantizer import quantize_mx

    E, N, K = shape
    data = torch.empty((E, N, K // 2 if fmt == "mxfp4" else K), dtype=torch.uint8, device=device)
    scales = torch.empty((E, N, K // 32), dtype=torch.uint8, device=device)
    step = max(1, CHUNK_ELEMENTS // max(1, N * K))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        x = chunk(e0, e1).contiguous()
        bad_blocks = None
        idx = first_nonfinite(x)
        if idx is not None:
            idx = (idx[0] + e0, *idx[1:])
            if not q.allow_nonfinite:
                val = x[(idx[0] - e0, *idx[1:])].item()
                loc = where(idx) if callable(where) else f"{where} at index {list(idx)} (expert, row, column)"
                raise BadInput(
                    f"non-finite value {val} in {loc}; "
                    "pass --allow-nonfinite to write NaN scales (0xFF) for such blocks"
                )
            x, bad_blocks = _nan_policy(x)
        d, s = quantize_mx(x, fmt, q.scale_rounding)
        if bad_blocks is not None:
            s = s.masked_fill(bad_blocks, 0xFF)
        data[e0:e1], scales[e0:e1] = d, s
        if stats is not None:
            deq = dequantize_mx(d, s, fmt)
            if bad_blocks is not None:
                keep = ~bad_blocks.repeat_interleave(32, dim=-1)
                stats.add(x[keep], deq[keep])
            else:
                stats.add(x, deq)
            del deq
        del x, d, s
    return MXStack(fmt, data, scales)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move ``t`` to ``device``; a dense permuted view (gpt-oss BF16's transposed experts) travels in
    its storage order and is re-permuted there, so no CPU transpose copy is made."""
    if t.device == device or t.is_contiguous():
        return t.to(device, non_blocking=True)
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    base = t.permute(order)
    if not base.is_contiguous():
        return t.contiguous().to(device, non_blocking=True)
    inverse = [order.index(d) for d in range(t.dim())]
    return base.to(device, non_blocking=True).permute(inverse)


def to_format(stack: MXStack | None, float_w: torch.Tensor | FP8BlockStack | None, fmt: str, q: QuantOptions,
              where: str | Callable[[tuple[int, ...]], str], stats: ErrorStats | None, device: torch.device) -> MXStack:
    """One expert stack (MX or float) -> MXStack in ``fmt`` on ``device``; MX bytes move untouched when
    the format already matches, MXFP4 -> MXFP8 is lossless, anything else re-quantizes."""
    from mxconv.numerics import dequantize_mx

    if stack is None:
        if isinstance(float_w, FP8BlockStack):
            src = float_w
            return quantize_stack(src.shape, lambda e0, e1: src.dequantize(e0, e1, device), fmt, q, where, stats, device)
        assert float_w is not None
        w = float_w
        return quantize_stack(tuple(w.shape), lambda e0, e1: to_device(w[e0:e1], device), fmt, q, where, stats, device)
    data = stack.data.to(device, non_blocking=True)
    scales = stack.scales.to(device, non_blocking=True)
    if stack.fmt == fmt:
        return MXStack(fmt, data, scales)
    if stack.fmt == "mxfp4" and fmt == "mxfp8":
        return MXStack(fmt, _mxfp4_to_mxfp8(data, scales), scales)
    E, N = data.shape[:2]
    K = scales.shape[-1] * 32
    return quantize_stack((E, N, K), lambda e0, e1: dequantize_mx(data[e0:e1], scales[e0:e1], stack.fmt), fmt, q,
                          where, stats, device)


@dataclass
class RunStats:
    errors: ErrorStats = field(default_factory=ErrorStats)
    compute_seconds: float = 0.0


def make_compute(plan: Plan, device: torch.device, stats: RunStats) -> Callable[[WorkItem, MoELayer], list[dict[str, torch.Tensor]]]:
    """The per-layer compute step for ``plan`` on ``device`` (returns CPU tensors per destination)."""
    layout = get_layout(plan.repack.backend) if plan.repack else None

    def compute(item: WorkItem, layer: MoELayer) -> list[dict[str, torch.Tensor]]:
        t0 = time.perf_counter()
        ref = layer.ref
        fmt = plan.weight_format
        def where(which: str) -> Callable[[tuple[int, ...]], str]:
            return lambda idx: plan.reader.source_location(ref, which, tuple(int(i) for i in idx))

        w13 = to_format(layer.w13_mx, layer.w13 if layer.w13_fp8 is None else layer.w13_fp8, fmt, plan.quant,
                        where("w13"), stats.errors, device)
        w2 = to_format(layer.w2_mx, layer.w2 if layer.w2_fp8 is None else layer.w2_fp8, fmt, plan.quant,
                       where("w2"), stats.errors, device)
        if layout is None:
            out_layer = MoELayer(ref, layer.row_order, w13_mx=_cpu(w13), w2_mx=_cpu(w2), w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the host copies must land before the reader repackages them
            results = [plan.reader.quantized_tensors(out_layer)]
        else:
            assert plan.repack is not None
            canon = CanonicalExperts(
                w13=w13.data, w13_scale=w13.scales, w2=w2.data, w2_scale=w2.scales,
                w13_bias=None if layer.w13_bias is None else layer.w13_bias.to(device),
                w2_bias=None if layer.w2_bias is None else layer.w2_bias.to(device),
                row_order=layer.row_order,
            )
            canon.validate()
            results = []
            for rank, (s, e) in enumerate(plan.rank_ranges):
                part = canon if plan.repack.tp == 1 else slice_tp(canon, s, e, rank)
                kt = layout.to_kernel(part, plan.repack.activation, plan.repack.layout_options)
                results.append({f"{ref.module_prefix}.experts.{k}": to_host(v) for k, v in kt.items()})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats.compute_seconds += time.perf_counter() - t0
        return results

    return compute


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Device -> host into pinned memory without waiting (the caller synchronizes once per layer).
    Pinned blocks come from torch's caching host allocator, so layer after layer reuses them."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _cpu(s: MXStack) -> MXStack:
    return MXStack(s.fmt, to_host(s.data), to_host(s.scales))


# ---------------------------------------------------------------------------------------------
# execution
# ---------------------------------------------------------------------------------------------


def output_config(plan: Plan) -> dict[str, Any]:
    """config.json of the output: the source config with the quantization_config for the experts."""
    cfg = dict(plan.ckpt.config)
    src_q = cfg.get("quantization_config")
    reader = plan.reader
    selected = {r.layer for r in plan.refs}
    formats = {r.layer: (r, reader.layer_format(r)) for r in reader.layer_refs()}
    # Layers --include/--ignore left in a format other than the output's (float, block-FP8): the
    # config lists them as not converted, so that loaders do not take them for MX weights.
    skipped = [r for L, (r, f) in formats.items() if L not in selected and f != plan.weight_format]
    if src_q and all(f == plan.weight_format for _, f in formats.values()):
        pass  # MX source kept as is: its quantization_config already describes the experts
    else:
        cfg["quantization_config"] = reader.quantization_config(plan.weight_format, plan.quant.scale_rounding, skipped)
    if plan.repack is not None:
        cfg["mxconv_layout"] = {
            "backend": plan.repack.backend,
            "activation": plan.repack.activation,
            "tp_size": plan.repack.tp,
            "manifest": "mxconv.json",
        }
    return cfg


def layer_table(refs: list[MoELayerRef]) -> list[dict[str, Any]]:
    return [
        {
            "layer": r.layer,
            "module_prefix": r.module_prefix,
            "router_weight": r.router_weight,
            "router_bias": r.router_bias,
            "correction_bias": r.correction_bias,
        }
        for r in refs
    ]


def manifest_layout(plan: Plan) -> dict[str, Any]:
    info = plan.info
    if plan.sizes is None:
        lay = {
            "name": "canonical-gpt-oss" if info.family == "gpt-oss" else "canonical-compressed-tensors",
            "version": 1,
            "engine_compat": {"transformers": ">=4.55", "vllm": ">=0.10.2"} if info.family == "gpt-oss" else {"compressed-tensors": ">=0.11", "vllm": ">=0.11"},
            "hidden_size": info.hidden_size,
            "intermediate_size": info.intermediate_size,
            "padded_hidden_size": info.hidden_size,
            "padded_intermediate_size": info.intermediate_size,
        }
    else:
        lay = dict(plan.layout_desc)
        lay.update(
            {
                "hidden_size": info.hidden_size,
                "intermediate_size": plan.sizes.intermediate_size,
                "intermediate_size_total": info.intermediate_size,
                "padded_hidden_size": plan.sizes.padded_hidden_size,
                "padded_intermediate_size": plan.sizes.padded_intermediate_size,
                "tp_ranges": [list(r) for r in plan.rank_ranges],
            }
        )
        if plan.repack:
            lay["options"] = dict(plan.repack.layout_options)
    lay["w13_row_order"] = info.row_order
    lay["kernel_params"] = kernel_params(info)
    return lay


def _start_warmup(plan: Plan, device: torch.device) -> threading.Thread:
    """Initialise CUDA and compile the quantize and layout kernels for this plan's shapes on a side thread,
    so the one-off start-up (seconds) overlaps reading the first layers instead of delaying them."""

    def work() -> None:
        try:
            with torch.cuda.device(device):
                if any(plan.reader.layer_format(r) not in ("mxfp4", "mxfp8") for r in plan.refs):
                    from mxconv.quantizer import quantize_mx

                    for k in {plan.info.hidden_size, plan.info.intermediate_size}:
                        quantize_mx(torch.zeros(1, 32, k, dtype=torch.bfloat16, device=device), plan.weight_format,
                                    plan.quant.scale_rounding)
                else:
                    torch.zeros(1, device=device)
                if plan.repack is not None and plan.sizes is not None:
                    # one expert at the real per-rank sizes: compiles the layout kernels' variants
                    layout = get_layout(plan.repack.backend)
                    H, I = plan.sizes.hidden_size, plan.sizes.intermediate_size
                    z = lambda *shape: torch.zeros(*shape, dtype=torch.uint8, device=device)  # noqa: E731
                    b = plan.sizes.has_bias
                    one = CanonicalExperts(
                        z(1, 2 * I, H // 2), z(1, 2 * I, H // 32), z(1, H, I // 2), z(1, H, I // 32),
                        torch.zeros(1, 2 * I, device=device) if b else None, torch.zeros(1, H, device=device) if b else None,
                        plan.sizes.row_order,
                    )
                    layout.to_kernel(one, plan.repack.activation, plan.repack.layout_options)
                torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - a failed warm-up only costs the time it would have saved
            pass

    t = threading.Thread(target=work, name="mxconv-warmup", daemon=True)
    t.start()
    return t


def execute(
    plan: Plan,
    out_dir: Path,
    *,
    device: torch.device,
    max_shard_size: int,
    overwrite: bool,
    argv: list[str] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run ``plan`` into ``out_dir``; returns the summary (with timing and error statistics)."""
    t0 = time.perf_counter()
    notes = prepare_output_dir(out_dir, [plan.ckpt.root], overwrite)
    out_dir = out_dir.expanduser().resolve()
    rank_dirs = [out_dir] if len(plan.dests) == 1 else [out_dir / f"rank-{r}" for r in range(len(plan.dests))]
    writers = []
    for d, tensors in zip(rank_dirs, plan.dests):
        d.mkdir(parents=True, exist_ok=True)
        writers.append(ShardedWriter(d, plan_shards(tensors, max_shard_size)))
    stats = RunStats()
    compute = make_compute(plan, device, stats)
    reader = plan.reader
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        warm = _start_warmup(plan, device)  # CUDA context + kernel compiles overlap the first reads

        def compute_after_warmup(item: WorkItem, layer: MoELayer) -> list[dict[str, torch.Tensor]]:
            warm.join()  # the first layer waits for the warm-up instead of racing it
            return compute(item, layer)

        run_compute = compute_after_warmup
    else:
        run_compute = compute
    times = run_pipeline(plan.items, writers, load=lambda item: reader.read_layer(item.payload), compute=run_compute,
                         on_progress=on_progress)

    cfg = output_config(plan)
    tensors: dict[str, Any] = {}
    for r, (d, w) in enumerate(zip(rank_dirs, writers)):
        written = w.finish()
        atomic_write_json(d / CONFIG_NAME, cfg)
        for f in plan.ckpt.extra_files:
            shutil.copyfile(f, d / f.name)
        prefix = "" if len(writers) == 1 else f"rank-{r}/"
        for name, entry in tensor_table(written, prefix).items():
            tensors[prefix + name if prefix else name] = entry
    q = plan.quant
    # From the converted layers' own formats (a mixed source holds MX and float layers).
    src_formats = {plan.reader.layer_format(r) for r in plan.refs}
    lossless = src_formats == {"mxfp4"} and plan.weight_format == "mxfp8"
    from_mx_untouched = src_formats == {plan.weight_format} or lossless
    manifest = base_manifest(
        source=plan.ckpt.source.to_json(),
        family=plan.info.family,
        kind="kernel" if plan.repack else "canonical",
        weight_format=plan.weight_format,
        scale_rounding=None if from_mx_untouched else q.scale_rounding,
        backend=plan.repack.backend if plan.repack else None,
        activation=plan.repack.activation if plan.repack else None,
        tp_size=plan.repack.tp if plan.repack else 1,
        layout=manifest_layout(plan),
        model=plan.info.to_json(),
        layers=layer_table(plan.refs),
        numerics={
            "element_format": "e2m1" if plan.weight_format == "mxfp4" else "e4m3",
            "scale_format": "e8m0",
            "block_size": 32,
            "block_axis": "input (last dim of [out, in])",
            "rounding": "rne",
            "packing": "low_nibble_first" if plan.weight_format == "mxfp4" else None,
            "source_format": plan.info.expert_format,
            "source_scale_scheme": plan.info.source_scale_scheme,
            "requantized": any(f in ("mxfp4", "mxfp8") and f != plan.weight_format for f in src_formats) and not lossless,
            "lossless_conversion": "mxfp4 -> mxfp8 (same block scales, E2M1 values are E4M3 values)" if lossless else None,
        },
        argv=argv,
    )
    manifest["tensors"] = tensors
    # Top-level names this run wrote (a later --overwrite removes exactly these, and nothing else).
    if len(rank_dirs) > 1:
        manifest["output_files"] = sorted({CONFIG_NAME, *(d.name for d in rank_dirs)})
    else:
        manifest["output_files"] = sorted({CONFIG_NAME, "model.safetensors.index.json", *(f.name for f in plan.ckpt.extra_files)})
    if len(rank_dirs) > 1:
        atomic_write_json(out_dir / CONFIG_NAME, cfg)
    write_manifest(out_dir, manifest)
    if plan.repack is None and any(n.endswith("weight_scale_inv") for d in plan.dests for n in (t.name for t in d)):
        notes.append(
            "note: block-FP8 tensors outside the routed experts (attention, dense and shared MLPs) were copied "
            "unchanged with their weight_scale_inv scales; the written quantization_config describes the MX "
            "experts only, so engines that load this checkpoint must be told about those FP8 modules separately"
        )
    wall = time.perf_counter() - t0
    summary = plan.summary()
    summary.update(
        {
            "output": str(out_dir),
            "seconds": wall,
            "gb_per_s": (plan.bytes_in + plan.bytes_out) / wall / 1e9 if wall > 0 else None,
            "compute_seconds": stats.compute_seconds,
            "quantized_tensors": stats.errors.tensors,
            "relative_rms_error": stats.errors.rel_rms,
            "device": str(device),
            "stage_seconds": times.to_json(),
            "notes": notes,
        }
    )
    if device.type == "cuda":
        summary["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    return summary
