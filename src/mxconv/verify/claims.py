"""verify, check 1 (integrity), the manifest's model and layout claims against what the output shows
itself, for every output kind: a claim the loader or an engine acts on (top_k, sizes, routing) that
no byte contradicts would otherwise pass.

* **config.json**: the fields the model family reads from config.json alone
  (:meth:`~mxconv.families.base.FamilyReader.config_claims`: sizes, top_k, routing, activation) must
  be the manifest's ``model`` ones. A canonical output is read back whole by its own reader
  (:func:`mxconv.verify.integrity.check_manifest_claims`); a kernel output, whose experts no longer
  carry the family's names, is held to its config here.
* **The layout table** repeats the model: ``hidden_size``, the intermediate size (``intermediate_size``
  of a canonical output, ``intermediate_size_total`` and the TP ranges of a kernel output),
  ``w13_row_order``; the padded sizes are the layout's padding of them; a kernel output holds a
  weight format its backend takes.
* **Tensor shapes**: every router is ``[num_experts, hidden]``; every kernel expert tensor of every
  layer and rank has the shape and dtype the layout gives for the manifest's sizes, and every layer
  holding kernel experts is in the manifest's ``layers``.
* **The engines' quant config** (``quant_config``), the served lists and ``numerics``: derived again
  by the rules that wrote them (:mod:`mxconv.verify.recorded`).

Options that change bytes but not shapes (``weight_format`` between MX formats, ``scale_rounding``,
the layout options) are covered by the layout check and, with ``--reference``, the exact bytes
(:mod:`mxconv.verify.exact`).
"""

from __future__ import annotations

import re
from typing import Any

from mxconv.errors import BadInput, LayoutError
from mxconv.experts.stack import WEIGHT_FORMATS, LayoutSizes
from mxconv.experts.tp import tp_ranges
from mxconv.families import reader_class
from mxconv.families.base import FamilyReader, ModelInfo
from mxconv.layouts import get_layout
from mxconv.source.checkpoint import Checkpoint
from mxconv.source.file_names import rank_dir_name
from mxconv.source.manifest import Manifest, plain_json
from mxconv.verify.layout import manifest_sizes
from mxconv.verify.recorded import numerics_claims, quant_config_claims

_KERNEL_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<name>w13_weight|w13_weight_scale|w13_bias|w2_weight|"
                            r"w2_weight_scale|w2_bias|w13_input_scale|w2_input_scale)$")

_QUANTIZED_FROM = frozenset({"bf16", "fp16", "fp32", "fp8_block"})  # source expert formats an MX output is quantized from


def check_model_claims(manifest: Manifest, info: ModelInfo, ckpts: list[Checkpoint],
                       own_reader: FamilyReader | None = None) -> list[str]:
    """Problems (module docstring) with the manifest's model and layout claims; [] when they hold.
    ``own_reader``: a canonical output read back by its family reader (None where it does not read)."""
    problems = _layout_repeats_model(manifest, info)
    if manifest.is_kernel:
        problems += config_disagreements(manifest, info, ckpts[0])
        problems += _router_shapes(manifest, info, ckpts[0])
        problems += _kernel_shapes(manifest, ckpts)
    elif own_reader is not None:
        problems += _converted_formats(manifest, own_reader)
    quantized = manifest.weight_format in ("mxfp4", "mxfp8") and info.expert_format in _QUANTIZED_FROM
    if quantized and not manifest.scale_rounding:
        problems.append(f"manifest scale_rounding is {manifest.scale_rounding!r}, but MX experts quantized from "
                        f"{info.expert_format} ones (model.expert_format) were rounded by a rule the manifest must name")
    return problems + _source_format(manifest, info) + quant_config_claims(manifest) + numerics_claims(manifest)


def _source_format(manifest: Manifest, info: ModelInfo) -> list[str]:
    """``model.expert_format`` is what ``numerics.source_format`` records: the exact check decides from
    it whether the output's expert bytes can be re-derived from a reference, so an edit of one alone
    must not pass."""
    numerics = manifest.numerics
    recorded, up = (numerics.source_format, numerics.upstream) if numerics is not None else (None, None)
    problems = []
    if recorded is not None and recorded != info.expert_format:
        problems.append(f"manifest model.expert_format is {info.expert_format!r}, but its numerics.source_format gives "
                        f"{recorded!r}")
    if up is not None and up.weight_format != info.expert_format:  # the upstream run made the experts this one read
        problems.append(f"manifest numerics.upstream.weight_format is {up.weight_format!r}, but model.expert_format "
                        f"(the experts this conversion read) is {info.expert_format!r}")
    return problems


def reference_source_claims(manifest: Manifest, info: ModelInfo, ref_reader: FamilyReader, ref_ckpt: Checkpoint,
                            reference: str) -> list[str]:
    """With a ``--reference`` that is the output's own source (the fingerprint its manifest records),
    the experts the conversion read are the reference's: a manifest that says they were of another
    format is the output's damage (it would turn the exact check of the expert bytes off), and every
    ``numerics`` field is derived (:func:`~mxconv.verify.recorded.numerics_claims`). The format for the
    source of the output's input (``numerics.upstream``) too."""
    fingerprint = ref_ckpt.source.fingerprint
    if not fingerprint:
        return []
    problems, rinfo = [], ref_reader.model_info()
    if fingerprint == manifest.source.fingerprint:
        if rinfo.expert_format != info.expert_format:
            problems.append(f"manifest model.expert_format is {info.expert_format!r}, but the reference {reference}, this "
                            f"output's source (the fingerprint its manifest records), holds {rinfo.expert_format} experts")
        else:
            problems += numerics_claims(manifest, (ref_reader, ref_ckpt.manifest), reference)
    up = manifest.numerics.upstream if manifest.numerics is not None else None
    if up is not None and fingerprint == up.fingerprint and rinfo.expert_format != up.source_format:
        problems.append(f"manifest numerics.upstream.source_format is {up.source_format!r}, but the reference "
                        f"{reference}, the source of this output's input (numerics.upstream.fingerprint), holds "
                        f"{rinfo.expert_format} experts")
    return problems


def _converted_formats(manifest: Manifest, own_reader: FamilyReader) -> list[str]:
    """Every layer a canonical output's manifest lists as converted holds its ``weight_format``."""
    want = {"fp8-block": "fp8_block"}.get(manifest.weight_format, manifest.weight_format)
    refs = {r.layer: r for r in own_reader.layer_refs()}
    problems = []
    for row in manifest.layers:
        ref = refs.get(row.layer)
        have = None if ref is None else own_reader.layer_format(ref)
        if have is not None and have != want:
            problems.append(f"manifest weight_format is {manifest.weight_format!r}, but layer {row.layer}'s "
                            f"experts ({row.module_prefix}.experts) are {have}")
            break
    return problems


def config_disagreements(manifest: Manifest, info: ModelInfo, ckpt: Checkpoint) -> list[str]:
    """The manifest's model fields that ``ckpt``'s config.json, read by the manifest family's reader,
    gives otherwise (nothing for a family not registered in this process)."""
    try:
        claims = reader_class(manifest.family)(ckpt).config_claims()
    except KeyError:
        return []
    except BadInput as exc:
        return [f"{ckpt.root / 'config.json'}: does not give the model the manifest describes: {exc}"]
    return [f"manifest model.{f} is {getattr(info, f)!r}, but {ckpt.root / 'config.json'} gives {v!r}"
            for f, v in claims.items() if getattr(info, f) != v]


def _layout_repeats_model(manifest: Manifest, info: ModelInfo) -> list[str]:
    """The layout table's sizes and row order against the model's, and the padding of a layout."""
    lay = manifest.layout
    problems = []

    def differs(key: str, want: Any, why: str) -> None:
        have = plain_json(getattr(lay, key))
        if have != want:
            problems.append(f"manifest layout.{key} is {have!r}, but {why} gives {want!r}")

    differs("hidden_size", info.hidden_size, "the manifest's model.hidden_size")
    differs("w13_row_order", info.row_order, "the manifest's model.row_order")
    if not manifest.is_kernel:
        differs("intermediate_size", info.intermediate_size, "the manifest's model.intermediate_size")
        differs("padded_hidden_size", info.hidden_size, "a canonical output (never padded)")
        differs("padded_intermediate_size", info.intermediate_size, "a canonical output (never padded)")
        return problems
    tp = manifest.tp_size
    total = lay.intermediate_size_total is not None
    if total or tp == 1:
        differs("intermediate_size_total" if total else "intermediate_size",
                info.intermediate_size, "the manifest's model.intermediate_size")
    ranges = tp_ranges(info.intermediate_size, tp)
    if lay.tp_ranges is not None:
        differs("tp_ranges", [list(r) for r in ranges], f"splitting model.intermediate_size over tp_size {tp}")
    return problems + _padding(manifest, max(e - s for s, e in ranges))


def _padding(manifest: Manifest, width: int) -> list[str]:
    """A kernel output's weight format and padded sizes against its backend's rules."""
    lay, backend = manifest.layout, manifest.backend
    try:
        layout = get_layout(str(backend))
        options = layout.resolve_options(lay.option_values)
    except (BadInput, LayoutError):  # the layout check of every layer names it
        return []
    fmt = manifest.weight_format
    takes = layout.weight_formats
    if fmt not in takes:
        return [f"manifest weight_format is {fmt!r}, but backend {backend} holds {' or '.join(takes)} experts"]
    problems = []
    if lay.intermediate_size != width:
        problems.append(f"manifest layout.intermediate_size is {lay.intermediate_size!r}, but the widest TP rank "
                        f"of model.intermediate_size has {width}")
    try:
        padded = layout.padded_sizes(lay.hidden_size, width, lay.w13_row_order, manifest.activation, options, weight_format=fmt)
    except (LayoutError, ValueError, TypeError) as exc:
        return problems + [f"manifest layout: the {backend} layout cannot take these sizes: {exc}"]
    for key, want in zip(("padded_hidden_size", "padded_intermediate_size"), padded):
        if getattr(lay, key) != want:
            problems.append(f"manifest layout.{key} is {getattr(lay, key)!r}, but the {backend} layout pads "
                            f"hidden_size {lay.hidden_size}, intermediate_size {width} to {want}")
    return problems


def _router_shapes(manifest: Manifest, info: ModelInfo, ckpt: Checkpoint) -> list[str]:
    """Every router of the manifest's layers is [num_experts, hidden] (biases [num_experts])."""
    problems = []
    for row in manifest.layers:
        for key, want in (("router_weight", [info.num_experts, info.hidden_size]), ("router_bias", [info.num_experts]),
                          ("correction_bias", [info.num_experts])):
            name = getattr(row, key)
            t = ckpt.tensors.get(name or "")
            if t is not None and list(t.shape) != want:
                problems.append(f"{name}: shape {list(t.shape)}, but the manifest's model (num_experts "
                                f"{info.num_experts}, hidden_size {info.hidden_size}) makes it {want}")
    return problems


def _kernel_shapes(manifest: Manifest, ckpts: list[Checkpoint]) -> list[str]:
    """Every layer's kernel expert tensors, on every rank, have the shapes and dtypes the layout gives
    for the manifest's sizes, and every layer that holds some is one of the manifest's layers."""
    backend = manifest.backend
    try:
        layout = get_layout(str(backend))
        specs = layout.kernel_specs(manifest_sizes(manifest), manifest.activation,
                                    layout.resolve_options(manifest.layout.option_values))
    except (BadInput, LayoutError, ValueError, TypeError):  # the layout check of every layer names it
        return []
    listed = {row.module_prefix for row in manifest.layers}
    problems = []
    for r, ckpt in enumerate(ckpts):
        where = f"{rank_dir_name(r)}/" if len(ckpts) > 1 else ""
        held: dict[str, set[str]] = {}
        for name, t in ckpt.tensors.items():
            m = _KERNEL_EXPERT.match(name)
            if m is None:
                continue
            held.setdefault(m["prefix"], set()).add(m["name"])
            spec = specs.get(m["name"])
            if spec is None:
                problems.append(f"{where}{name}: the {backend} layout of the manifest's sizes has no such tensor")
            elif list(t.shape) != list(spec.shape) or t.dtype != spec.st_dtype:
                problems.append(f"{where}{name}: {t.dtype}{list(t.shape)}, but the {backend} layout of the "
                                f"manifest's sizes gives {spec.st_dtype}{list(spec.shape)}")
        for prefix in sorted(set(held) - listed):
            problems.append(f"{where}{prefix}.experts: kernel expert tensors of a layer the manifest's layers do not list")
    return problems


def copied_tensors(manifest: Manifest) -> dict[str, list[str]]:
    """The tensors an output copied as they are (roles copy and router): name -> its manifest keys
    (``rank-N/name`` in a TP output, one per rank)."""
    out: dict[str, list[str]] = {}
    for key, entry in manifest.tensors.items():
        if entry.role in ("copy", "router"):
            out.setdefault(key.partition("/")[2] if manifest.tp_size > 1 else key, []).append(key)
    return out


def reference_mismatch(manifest: Manifest, ckpts: list[Checkpoint], own: ModelInfo | None, rinfo: ModelInfo,
                       ref_ckpt: Checkpoint) -> str | None:
    """How ``--reference``'s tensors differ in shape from the output's (a different model: bad input),
    or None when they match: the tensors the output copied outside the experts (same names, same
    shapes) and the experts' sizes, from the output's own reader (canonical) or the layout of the
    reference's sizes against the stored kernel tensors (kernel)."""
    for name, keys in copied_tensors(manifest).items():
        if ".experts." in name:  # a MoE layer left unconverted: the reference may hold it converted
            continue
        t, shape = ref_ckpt.tensors.get(name), list(manifest.tensors[keys[0]].shape)
        if t is None:
            return f"it has no tensor {name}"
        if list(t.shape) != list(shape):
            return f"{name} is {list(t.shape)} there, {shape} here"
    sizes = ("num_experts", "hidden_size", "intermediate_size")
    if own is not None:
        for f in sizes:
            if getattr(own, f) != getattr(rinfo, f):
                return f"{f} {getattr(rinfo, f)} vs {getattr(own, f)} here"
    if manifest.is_kernel:
        return _kernel_mismatch(manifest, ckpts[0], rinfo)
    return None


def _kernel_mismatch(manifest: Manifest, ckpt: Checkpoint, rinfo: ModelInfo) -> str | None:
    """How the first layer's stored kernel tensors differ from the layout of the reference's sizes."""
    backend = manifest.backend
    try:
        layout = get_layout(str(backend))
        options = layout.resolve_options(manifest.layout.option_values)
        fmt = manifest.weight_format if manifest.weight_format in WEIGHT_FORMATS else "mxfp4"
        width = max(e - s for s, e in tp_ranges(rinfo.intermediate_size, manifest.tp_size))
        padded = layout.padded_sizes(rinfo.hidden_size, width, rinfo.row_order, manifest.activation, options,
                                     weight_format=fmt)
        specs = layout.kernel_specs(LayoutSizes(rinfo.num_experts, rinfo.hidden_size, width, *padded, rinfo.row_order,
                                                rinfo.has_expert_bias, fmt), manifest.activation, options)
    except (BadInput, LayoutError, ValueError) as exc:
        return f"the {backend} layout cannot take its sizes: {exc}"
    prefix = manifest.layers[0].module_prefix  # validated: never empty
    for name, spec in specs.items():
        t = ckpt.tensors.get(f"{prefix}.experts.{name}")
        if t is not None and list(t.shape) != list(spec.shape):
            return (f"its sizes (num_experts {rinfo.num_experts}, hidden_size {rinfo.hidden_size}, intermediate_size "
                    f"{rinfo.intermediate_size}) make {prefix}.experts.{name} {list(spec.shape)}, it is {list(t.shape)} here")
    return None
