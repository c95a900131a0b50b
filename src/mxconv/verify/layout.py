"""verify, check 2 (layout): kernel-layout tensors inverted with the backend's inverse (padding must
hold its fill), laid out again and compared byte for byte with what is stored; canonical outputs read
back by their own family reader. With ``--reference`` the recovered canonical bytes are compared with
the reference's (:mod:`mxconv.verify.exact`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mxconv.experts.padding import unpad_canonical
from mxconv.experts.stack import WEIGHT_FORMATS, CanonicalExperts, LayoutSizes
from mxconv.experts.tensors import KERNEL_TENSOR_NAMES
from mxconv.source.checkpoint import Checkpoint
from mxconv.errors import BadInput, LayoutError
from mxconv.families.base import Int4Stack, MoELayer, MXStack
from mxconv.layouts import get_layout
from mxconv.source.manifest import LayerEntry, Manifest
from mxconv.source.st_format import read_tensor
from mxconv.verify.report import LayerReport

if TYPE_CHECKING:  # the state's plan reads the manifest's sizes here
    from mxconv.verify.state import VerifyState


def manifest_sizes(manifest: Manifest) -> LayoutSizes:
    """The (per-rank) sizes of the manifest's layout, as the layouts take them."""
    lay, fmt = manifest.layout, manifest.weight_format
    return LayoutSizes(manifest.model.num_experts, *lay.sizes, lay.w13_row_order, manifest.model.has_expert_bias,
                       fmt if fmt in WEIGHT_FORMATS else "mxfp4")


def merge_tp(parts: list[CanonicalExperts], ranges: list[tuple[int, int]], I: int) -> CanonicalExperts:
    """Inverse of slicing a canonical stack by rank (see layouts.base.slice_tp)."""
    order = parts[0].row_order

    def cat13(ts: list[torch.Tensor]) -> torch.Tensor:
        if order == "interleaved":
            return torch.cat(ts, dim=1)
        gates = [t[:, : (e - s)] for t, (s, e) in zip(ts, ranges)]
        ups = [t[:, (e - s) :] for t, (s, e) in zip(ts, ranges)]
        return torch.cat(gates + ups, dim=1)

    b13 = None if parts[0].w13_bias is None else cat13([p.w13_bias for p in parts])
    scales = [p.input_scales for p in parts]
    if any(s is not None for s in scales):  # every rank stores the same reduced scalars (W4A8)
        first = scales[0]
        for rank, s in enumerate(scales):
            if s is None or first is None or not all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(s.reduced(), first.reduced())):
                raise LayoutError(f"w13_input_scale / w2_input_scale of rank {rank} differ from rank 0's "
                                  "(every rank holds the same max over experts)")
    return CanonicalExperts(
        w13=cat13([p.w13 for p in parts]),
        w13_scale=cat13([p.w13_scale for p in parts]),
        w2=torch.cat([p.w2 for p in parts], dim=2),
        w2_scale=torch.cat([p.w2_scale for p in parts], dim=2),
        w13_bias=b13,
        w2_bias=parts[0].w2_bias,
        row_order=order,
        weight_format=parts[0].weight_format,
        input_scales=scales[0],
    )


def kernel_layer_canonical(
    manifest: Manifest, ckpts: list[Checkpoint], prefix: str, problems: list[str],
    device: torch.device | str = "cpu", pre_read: list[dict[str, torch.Tensor]] | None = None,
    layer: int | None = None,
) -> CanonicalExperts | None:
    """Invert one layer's kernel tensors (all ranks) on ``device``, check the round trip; None on
    failure. ``pre_read``: the tensors already read (per rank, by short name; verify's layer reads,
    which hash them as they pass); otherwise they are read here. ``layer``: its MoE layer number, whose
    recorded stack choices (``layout.stack_choices``) the inverse uses (None: the entry of ``prefix``)."""
    backend = str(manifest.backend)
    try:
        layout = get_layout(backend)
    except BadInput as exc:
        problems.append(f"manifest backend: {exc}")
        return None
    activation = manifest.activation
    try:
        options = layout.resolve_options(manifest.layout.option_values)
    except LayoutError as exc:
        problems.append(f"{prefix}.experts: not a valid {backend} layout: manifest layout options: {exc}")
        return None
    sizes = manifest_sizes(manifest)
    ranges = list(manifest.layout.tp_ranges or ((0, sizes.intermediate_size),))
    parts: list[CanonicalExperts] = []
    for rank, ckpt in enumerate(ckpts):
        tensors = _read_rank(ckpt, prefix, device) if pre_read is None else {k: t.to(device) for k, t in pre_read[rank].items()}
        s, e = ranges[rank]
        # every rank was laid out at the widest rank's width (slice_tp's pad_to), then padded
        rank_sizes = LayoutSizes(sizes.num_experts, sizes.hidden_size, sizes.intermediate_size, sizes.padded_hidden_size,
                                 sizes.padded_intermediate_size, sizes.row_order, sizes.has_bias, sizes.weight_format)
        tag = f"{prefix}.experts" + (f" (rank {rank})" if len(ckpts) > 1 else "")
        recorded = manifest.layout.choices_of(_layer_of(manifest, prefix) if layer is None else layer, rank)
        try:  # inverted with the choices the run recorded; the layout checks them against the data it gets back
            canon = layout.from_kernel(tensors, rank_sizes, activation, layout.with_choices(options, recorded))
            chosen = layout.stack_choices(canon, options) if recorded else {}
            if chosen != recorded:
                raise LayoutError(f"the manifest records {recorded} (layout.stack_choices), the layout chooses "
                                  f"{chosen} for the stacks these bytes hold")
            again = layout.to_kernel(canon, activation, layout.with_choices(options, recorded))
        except LayoutError as exc:
            problems.append(f"{tag}: not a valid {backend} layout: {exc}")
            return None
        for k, t in again.items():
            stored = tensors.get(k)
            if stored is None or stored.shape != t.shape or not torch.equal(stored.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)):
                problems.append(f"{tag}.{k}: bytes are not what the {backend} layout of their own inverse gives")
                return None
        if e - s < sizes.intermediate_size:
            try:
                canon = unpad_canonical(canon, sizes.hidden_size, e - s)
            except LayoutError as exc:
                problems.append(f"{tag}: not a valid {backend} layout: {exc}")
                return None
        if canon.w2_bias is not None and rank > 0 and bool(canon.w2_bias.any()):
            problems.append(f"{tag}.w2_bias: must be zero on ranks other than 0")
            return None
        parts.append(canon)
    if len(parts) == 1:
        return parts[0]
    try:
        return merge_tp(parts, ranges, sizes.intermediate_size)
    except LayoutError as exc:
        problems.append(f"{prefix}.experts: {exc}")
        return None


def _layer_of(manifest: Manifest, prefix: str) -> int:
    return next((entry.layer for entry in manifest.layers if entry.module_prefix == prefix), -1)


def _read_rank(ckpt: Checkpoint, prefix: str, device: torch.device | str) -> dict[str, torch.Tensor]:
    """One rank's expert tensors of a layer on ``device``."""
    names = {k: f"{prefix}.experts.{k}" for k in KERNEL_TENSOR_NAMES}
    return {k: read_tensor(ckpt.tensors[n]).to(device) for k, n in names.items() if n in ckpt.tensors}


def first_difference(a: CanonicalExperts, b: CanonicalExperts) -> str | None:
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        x, y = getattr(a, name), getattr(b, name).to(getattr(a, name).device)
        if x.shape != y.shape:
            return f"{name}: shape {tuple(x.shape)} vs reference {tuple(y.shape)}"
        if x.is_floating_point():  # bf16 INT4 scales: compare bit patterns (-0.0 is not +0.0)
            x, y = x.view(torch.int16), y.view(torch.int16)
        diff = x != y
        if bool(diff.any()):
            e, r = diff.nonzero()[0][:2].tolist()
            return f"{name}: first difference at expert {e}, row {r}"
    for name in ("w13_bias", "w2_bias"):
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            return f"{name}: present on one side only"
        if x is not None and not torch.equal(x.float(), y.float().to(x.device)):
            e, r = (x.float() != y.float().to(x.device)).nonzero()[0][:2].tolist()
            return f"{name}: first difference at expert {e}, row {r}"
    if a.input_scales is not None and b.input_scales is None:
        return ("w13_input_scale: the output holds W4A8 input scales and the reference has none to check them "
                "against (pass the checkpoint they came from, e.g. the Quark source)")
    if a.input_scales is not None and b.input_scales is not None:  # stored: the reference's reduction (max)
        for name, x, y in zip(("w13_input_scale", "w2_input_scale"), a.input_scales.reduced(), b.input_scales.reduced()):
            if not torch.equal(x.cpu(), y.cpu()):
                return f"{name}: {x.item()!r}, the reference's max over experts is {y.item()!r}"
    return None


def canonical_from_layer(layer: MoELayer) -> CanonicalExperts | None:
    if layer.w13_int4 is not None and layer.w2_int4 is not None:
        return CanonicalExperts(layer.w13_int4.data, layer.w13_int4.scales, layer.w2_int4.data, layer.w2_int4.scales,
                                row_order=layer.row_order, weight_format="int4")
    if layer.w13_mx is None or layer.w13_mx.fmt not in ("mxfp4", "mxfp8"):
        return None
    return CanonicalExperts(layer.w13_mx.data, layer.w13_mx.scales, layer.w2_mx.data, layer.w2_mx.scales,
                            layer.w13_bias, layer.w2_bias, layer.row_order, layer.w13_mx.fmt, layer.input_scales)


def canonical_stack(c: CanonicalExperts, which: str) -> MXStack | Int4Stack:
    """``c``'s w13 or w2 with its scales, as the stack type of its weight format."""
    data, scales = getattr(c, which), getattr(c, f"{which}_scale")
    return Int4Stack(data, scales) if c.weight_format == "int4" else MXStack(c.weight_format, data, scales)


def kernel_nonfinite(canon: CanonicalExperts, prefix: str) -> str | None:
    """The first NaN scale byte / non-finite bias of experts recovered from a kernel layout, named
    by the manifest tensor and the canonical (expert, row, block) index."""
    from mxconv.mx.numerics import first_nonfinite, first_nonnumber

    scales = {"w13_weight_scale": canon.w13_scale, "w2_weight_scale": canon.w2_scale}
    if canon.weight_format == "int4":  # bf16 group scales: NaN/Inf (E8M0 0xFF is an MX rule)
        for name, t in scales.items():
            at = first_nonfinite(t)
            if at is not None:
                return f"non-finite value {t[at].item()} in {prefix}.experts.{name} at canonical [{', '.join(map(str, at))}] (expert, row, block)"
        scales = {}
    if canon.input_scales is not None:  # static FP8 input scales: finite and positive
        for name, t in zip(("w13_input_scale", "w2_input_scale"), canon.input_scales.reduced()):
            if not (bool(torch.isfinite(t)) and float(t) > 0):
                return f"{prefix}.experts.{name} is {t.item()!r}; a static FP8 input scale must be finite and positive"
    hit = first_nonnumber({**scales, "w13_bias": canon.w13_bias, "w2_bias": canon.w2_bias})
    if hit is None:
        return None
    name, idx, what = hit
    coords = "expert, row, block" if name.endswith("_scale") else "expert, row"
    return f"{what} in {prefix}.experts.{name} at canonical [{', '.join(map(str, idx))}] ({coords})"


def recover_layer(state: VerifyState, L: int, lay: LayerEntry, rep: LayerReport,
                  stored: list[dict[str, torch.Tensor]] | None = None) -> tuple[CanonicalExperts | None, MoELayer | None]:
    """The layout check of one MoE layer: its canonical experts as the converted checkpoint holds them
    (a kernel output inverted and laid out again, from ``stored`` when its tensors were read already;
    a canonical output read back by its own reader), and for a canonical output the layer read back.
    ``rep.layout`` says how it went."""
    prefix = lay.module_prefix
    if state.plan.kind == "kernel":
        lprobs: list[str] = []
        canon = None
        try:
            canon = kernel_layer_canonical(state.plan.manifest, state.plan.ckpts, prefix, lprobs, state.plan.device, stored, layer=L)
        except KeyError as exc:
            lprobs.append(f"{prefix}.experts: kernel tensor {exc} missing")
        rep.layout = "FAIL" if lprobs else "ok"
        rep.problems.extend(lprobs)
        return canon, None
    if state.own_error is not None:
        rep.layout = "not run"
        return None, None
    ref = state.own_refs.get(L)
    if ref is None:
        rep.layout = "FAIL"
        rep.problems.append(f"{prefix}: the manifest lists this MoE layer but the checkpoint has no experts for it")
        return None, None
    assert state.own_reader is not None
    conv_layer = state.own_reader.read_layer(ref)
    rep.layout = "ok"
    return canonical_from_layer(conv_layer), conv_layer


def reference_layer(state: VerifyState, L: int, rep: LayerReport, ref_layer: MoELayer | None = None) -> tuple[MoELayer, str | None]:
    """Layer ``L`` of ``--reference`` (``ref_layer`` when it was read already) and the first value in
    it that is not a number (None when all are). Its bytes are compared by :mod:`mxconv.verify.exact`."""
    assert state.ref_reader is not None
    if ref_layer is None:
        rrefs = {r.layer: r for r in state.ref_reader.layer_refs()}
        if L not in rrefs:
            raise BadInput(f"VerifyOptions.reference {state.plan.options.reference}: has no MoE layer {L}")
        ref_layer = state.ref_reader.read_layer(rrefs[L])
    ref_bad = state.ref_reader.nonfinite_problem(ref_layer)
    if ref_bad:
        rep.problems.append(f"layer {L}: the reference {state.plan.options.reference} holds a value that is not a number: {ref_bad}")
    return ref_layer, ref_bad
