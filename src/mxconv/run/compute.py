"""The per-layer compute step of a conversion: source experts -> MX stacks -> kernel layout.

Float (or block-FP8) experts are quantized in bounded expert chunks on the compute device; MX
experts move untouched (MXFP4 -> MXFP8 is lossless); a repack then slices TP ranks and applies the
backend layout. Results come back as pinned host tensors, one dict per destination.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from mxconv.errors import BadInput, LayoutError
from mxconv.experts.stack import CanonicalExperts
from mxconv.experts.tp import slice_tp
from mxconv.families.base import FP8BlockStack, Int4Stack, MoELayer, MXStack
from mxconv.layouts import get_layout
from mxconv.run.fp8_compute import BlockStats, LayerTiles, Where, to_fp8_block
from mxconv.run.options import QuantOptions, WeightFormat
from mxconv.run.pipeline import WorkItem

if TYPE_CHECKING:
    import torch

    from mxconv.run.plan import Plan


@dataclass
class ErrorStats:
    """Running relative-RMS error of quantized experts against their float source."""

    sq_err: float = 0.0
    sq_ref: float = 0.0
    tensors: int = 0

    def add(self, ref: torch.Tensor, approx: torch.Tensor, count: bool = True) -> None:
        """Accumulate ||approx - ref||² and ||ref||²; ``approx`` (a fresh fp32 tensor) is consumed.
        ``count``: this is the first part of a tensor (later expert chunks add to its sums only)."""
        r = ref.float()
        self.sq_ref += float(r.square().sum())
        self.sq_err += float(approx.float().sub_(r).square_().sum())
        self.tensors += int(count)

    @property
    def rel_rms(self) -> float | None:
        return (self.sq_err / self.sq_ref) ** 0.5 if self.sq_ref > 0 else None


# ---------------------------------------------------------------------------------------------
# per-layer compute
# ---------------------------------------------------------------------------------------------


def _nan_policy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace non-finite values by 0 and return the mask of blocks that held any ([..., K/32])."""
    import torch

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
    import torch

    from mxconv.mx.numerics import dequantize_mx

    E, N, K = shape
    data = torch.empty((E, N, K // 2 if fmt == "mxfp4" else K), dtype=torch.uint8, device=device)
    scales = torch.empty((E, N, K // 32), dtype=torch.uint8, device=device)
    step = max(1, CHUNK_ELEMENTS // max(1, N * K))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        x = chunk(e0, e1).contiguous()
        d, s = data[e0:e1], scales[e0:e1]  # written in place: no per-chunk buffers, no copy
        x, bad_blocks = _quantize_chunk(x, e0, fmt, q, where, d, s)
        if stats is not None:
            deq = dequantize_mx(d, s, fmt)
            if bad_blocks is not None:
                keep = ~bad_blocks.repeat_interleave(32, dim=-1)
                stats.add(x[keep], deq[keep], count=e0 == 0)
            else:
                stats.add(x, deq, count=e0 == 0)
            del deq
        del x, d, s
    return MXStack(fmt, data, scales)


def _quantize_chunk(x: torch.Tensor, e0: int, fmt: str, q: QuantOptions, where: str | Callable[[tuple[int, ...]], str],
                    data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Quantize experts ``x`` (the first is expert ``e0``) into ``data`` / ``scales``. Finite input
    (the common case, tested inside the Triton kernel's one read) returns ``(x, None)``; otherwise
    BadInput naming the first NaN/Inf, or under ``allow_nonfinite`` its blocks quantized as zeros
    with NaN scales (0xFF), returning the zeroed input and the mask of those blocks."""
    from mxconv.kernels.quantize import quantize_mx, quantize_mx_finite_into
    from mxconv.mx.numerics import first_nonfinite

    if quantize_mx_finite_into(x, fmt, q.scale_rounding, data, scales):
        return x, None
    idx = first_nonfinite(x)
    if idx is None:  # the kernel's flag and the scan disagree: a bug, not bad input (exit 3)
        raise RuntimeError("the quantizer reported a NaN/Inf that the scan of the same chunk did not find")
    idx = (idx[0] + e0, *idx[1:])
    if not q.allow_nonfinite:
        val = x[(idx[0] - e0, *idx[1:])].item()
        loc = where(idx) if callable(where) else f"{where} at index {list(idx)} (expert, row, column)"
        raise BadInput(f"non-finite value {val} in {loc}; set QuantOptions.allow_nonfinite to write NaN scales (0xFF) for such blocks")
    x, bad_blocks = _nan_policy(x)
    d, s = quantize_mx(x, fmt, q.scale_rounding)
    data.copy_(d)
    scales.copy_(s.masked_fill(bad_blocks, 0xFF))
    return x, bad_blocks


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


def to_format(stack: MXStack | None, float_w: torch.Tensor | FP8BlockStack | Int4Stack | None, fmt: str, q: QuantOptions,
              where: str | Callable[[tuple[int, ...]], str], stats: ErrorStats | None, device: torch.device) -> MXStack | Int4Stack:
    """One expert stack (MX, INT4 or float) -> MXStack in ``fmt`` on ``device``; MX bytes move untouched when
    the format already matches, MXFP4 -> MXFP8 is lossless, anything else re-quantizes (INT4 and block-FP8
    from their exact fp32 dequantization). ``fmt == "int4"`` (a repack of an INT4 source): the Int4Stack as is."""
    from mxconv.mx.numerics import dequantize_mx, mxfp4_to_mxfp8

    if isinstance(float_w, Int4Stack) and fmt == "int4":
        return float_w.to(device)
    if stack is None:
        if isinstance(float_w, (FP8BlockStack, Int4Stack)):
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
        return MXStack(fmt, mxfp4_to_mxfp8(data, scales), scales)
    E, N = data.shape[:2]
    K = scales.shape[-1] * 32
    return quantize_stack((E, N, K), lambda e0, e1: dequantize_mx(data[e0:e1], scales[e0:e1], stack.fmt), fmt, q,
                          where, stats, device)


def source_stack(layer: MoELayer, which: str) -> torch.Tensor | FP8BlockStack | Int4Stack | None:
    """``layer``'s ``which`` ("w13" | "w2") stack when it is not MX: INT4, block-FP8 or float (None
    for an MX layer, whose stack is ``{which}_mx``). What :func:`to_format` takes as ``float_w``."""
    for form in (f"{which}_int4", f"{which}_fp8", which):
        if getattr(layer, form) is not None:
            return getattr(layer, form)
    return None


@dataclass
class RunStats:
    errors: ErrorStats = field(default_factory=ErrorStats)
    compute_seconds: float = 0.0
    fp8_tiles: BlockStats = field(default_factory=BlockStats)  # --format fp8-block: tiles, inexact ones per layer
    # Layout.stack_choices per MoE layer, one dict per TP rank (the manifest's layout.stack_choices)
    stack_choices: dict[int, list[dict[str, str]]] = field(default_factory=dict)

    def record_choices(self, layer: MoELayer, rank: int, choices: dict[str, str]) -> None:
        """Keep what the layout chose for ``layer``'s stack on ``rank``. A layer cut into groups of
        experts is laid out group by group, but the layout chooses once per whole stack: a group
        whose data gives another choice than the layer's earlier experts is refused (BadInput naming
        the tensor), since the earlier groups are already written in the other form."""
        if not choices:
            return
        ranks = self.stack_choices.setdefault(layer.ref.layer, [])
        if rank == len(ranks):
            ranks.append(dict(choices))
            return
        for name, chosen in choices.items():
            earlier = ranks[rank].get(name)
            if chosen != earlier:
                where = f"{layer.ref.module_prefix}.experts.{name}" + (f" (rank {rank})" if rank else "")
                raise BadInput(
                    f"{where}: experts from {layer.first_expert} on give {chosen!r}, the layer's earlier experts "
                    f"{earlier!r}; the layout chooses once per whole stack from its data, so this layer cannot be "
                    "converted in groups of experts: raise the host memory budget (max_memory) so that it is "
                    "converted whole, or name the choice in the layout options")


def make_compute(plan: Plan, device: torch.device, stats: RunStats) -> Callable[[WorkItem, MoELayer], list[dict[str, torch.Tensor]]]:
    """The per-layer compute step for ``plan`` on ``device`` (returns CPU tensors per destination)."""
    import torch

    layout = get_layout(plan.repack.backend) if plan.repack else None

    def compute(item: WorkItem, layer: MoELayer) -> list[dict[str, torch.Tensor]]:
        t0 = time.perf_counter()
        ref = layer.ref
        fmt = plan.weight_format
        def where(which: str) -> Callable[[tuple[int, ...]], str]:
            # idx[0] counts the experts read (a group under a memory budget starts at first_expert)
            return lambda idx: plan.reader.source_location(
                ref, which, (int(idx[0]) + layer.first_expert, *(int(i) for i in idx[1:])))

        counted = stats.errors.tensors
        if fmt == WeightFormat.FP8_BLOCK:
            results = [_fp8_block_layer(plan, layer, where, stats, device)]
            stats.compute_seconds += time.perf_counter() - t0
            return results
        w13 = to_format(layer.w13_mx, source_stack(layer, "w13"), fmt, plan.quant, where("w13"), stats.errors, device)
        w2 = to_format(layer.w2_mx, source_stack(layer, "w2"), fmt, plan.quant, where("w2"), stats.errors, device)
        if layer.first_expert:  # a later group of a layer's experts: its stacks are counted once, by the first
            stats.errors.tensors = counted
        if layout is None:
            out_layer = MoELayer(ref, layer.row_order, w13_mx=_cpu(w13), w2_mx=_cpu(w2), w13_bias=layer.w13_bias,
                                 w2_bias=layer.w2_bias, first_expert=layer.first_expert)
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
                weight_format=fmt,
                input_scales=layer.input_scales,
            )
            canon.validate()
            results = []
            for rank, (s, e) in enumerate(plan.rank_ranges):
                part = canon if plan.repack.tp == 1 else slice_tp(canon, s, e, rank, pad_to=plan.sizes.intermediate_size)
                choices = layout.stack_choices(part, plan.repack.layout_options)
                stats.record_choices(layer, rank, choices)
                options = layout.with_choices(plan.repack.layout_options, choices)
                try:
                    kt = layout.to_kernel(part, plan.repack.activation, options, plan.repack.kernel_choice)
                except LayoutError as exc:  # the layout names the tensor; say whose
                    rank_tag = f" (rank {rank})" if plan.repack.tp > 1 else ""
                    raise LayoutError(f"{ref.module_prefix}.experts{rank_tag}: {exc}") from None
                # a 0-dim tensor (a layer's reduced input scale) is not split over experts: the first group writes it
                results.append({f"{ref.module_prefix}.experts.{k}": to_host(v) for k, v in kt.items()
                                if v.dim() or not layer.first_expert})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats.compute_seconds += time.perf_counter() - t0
        return results

    return compute


def _fp8_block_layer(plan: Plan, layer: MoELayer, where: Callable[[str], Callable[[tuple[int, ...]], str]],
                     stats: RunStats, device: torch.device) -> dict[str, torch.Tensor]:
    """One MoE layer (or group of its experts) -> the reader's block-FP8 output tensors (host)."""
    import torch

    ref = layer.ref
    tiles = stats.fp8_tiles.layers.setdefault(ref.layer, LayerTiles(f"{ref.module_prefix}.experts"))
    counted = stats.errors.tensors
    stacks = {}
    for which, halves in (("w13", 2), ("w2", 1)):
        src = getattr(layer, f"{which}_mx") or source_stack(layer, which)
        w = Where(ref, which, layer.first_expert, where(which))
        s = to_fp8_block(src, halves, w, plan.quant.require_exact, tiles, stats.errors, device)
        stacks[which] = FP8BlockStack([(to_host(d), to_host(sc)) for d, sc in s.parts], s.block)
    if layer.first_expert:
        stats.errors.tensors = counted
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out = MoELayer(ref, layer.row_order, w13_fp8=stacks["w13"], w2_fp8=stacks["w2"], first_expert=layer.first_expert)
    return plan.reader.quantized_tensors(out)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Device -> host into pinned memory without waiting (the caller synchronizes once per layer).
    Pinned blocks come from torch's caching host allocator, so layer after layer reuses them."""
    import torch

    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _cpu(s: MXStack) -> MXStack:
    return MXStack(s.fmt, to_host(s.data), to_host(s.scales))
