"""``mxconv verify``: integrity, layout and numerics of a converted checkpoint.

1. Integrity — every tensor the manifest lists exists with its shape, dtype and sha256; no unlisted
   tensors; every shard the index names exists (header validation included).
2. Layout — kernel-layout tensors are inverted with the backend's inverse (padding must hold its
   fill), re-laid-out and compared byte for byte with what is stored; with an MXFP4 reference the
   recovered canonical bytes must equal the reference bytes exactly.
3. Numerics — seeded hidden states through router + experts of the converted weights vs the
   reference (a source checkpoint or outputs saved earlier), with per-format thresholds. A value
   that is not a number fails, never passes: an E8M0 scale byte 0xFF, a NaN/Inf bias or router
   (converted or reference, named by tensor and index), or a non-finite layer output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxconv.checkpoint import Checkpoint, layer_index, open_checkpoint
from mxconv.errors import BadInput, LayoutError
from mxconv.families import FamilyReader, FP8BlockStack, Int4Stack, ModelInfo, MoELayer, MXStack, detect_family
from mxconv.families.base import nonfinite_tensors
from mxconv.layouts import LayoutSizes, get_layout
from mxconv.layouts.base import CanonicalExperts, unpad_canonical
from mxconv.manifest import load_manifest
from mxconv.engines import KERNEL_THRESHOLDS
from mxconv.runner import Comparison, ExpertFn, Routing, compare, hidden_states, moe_forward, route
from mxconv.verify_kernel import KernelResult, check_kernel_layer, kernel_preflight
from mxconv.st_format import iter_tensor_chunks, read_tensor

# Pass/fail thresholds of the numerics check, by (converted weight format, reference kind).
# MX error figures from mx-numerics.md §6: a weight's relative RMS error is ≈ 0.115 (MXFP4) and
# ≈ 0.027 (MXFP8 E4M3); through gate/up, the activation and down it compounds to ≈ 0.16 / 0.04
# on layer outputs (0.19-0.21 measured on the demo's Gaussian experts). The limits leave headroom
# for heavy-tailed weights (Student-t MXFP4 weight error ≈ 0.15) and are far below what a layout
# bug gives (≈ 1.0 or more: wrong rows or experts decorrelate the output).
THRESHOLDS: dict[str, dict[str, float]] = {
    "exact": {"rel_rms": 1e-6, "cosine": 0.999999, "topk_agreement": 1.0},
    "mxfp4": {"rel_rms": 0.30, "cosine": 0.95, "topk_agreement": 1.0},
    "mxfp8": {"rel_rms": 0.06, "cosine": 0.998, "topk_agreement": 1.0},
    # INT4 (group 32, bf16 scales) outputs against a float reference: 16 levels per group, an error of
    # the MXFP4 order (an INT4 reference holds the same values: "exact")
    "int4": {"rel_rms": 0.30, "cosine": 0.95, "topk_agreement": 1.0},
}


@dataclass
class LayerReport:
    layer: int
    integrity: str = "ok"
    layout: str = "n/a"
    numerics: str = "skipped"
    comparison: Comparison | None = None
    threshold: str | None = None
    problems: list[str] = field(default_factory=list)
    kernel: KernelResult | None = None  # verify --kernel

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "integrity": self.integrity,
            "layout": self.layout,
            "numerics": self.numerics,
            "threshold": self.threshold,
            "comparison": self.comparison.to_json() if self.comparison else None,
            "kernel": self.kernel.to_json() if self.kernel else None,
            "problems": self.problems,
            "passed": self.passed,
        }


@dataclass
class VerifyReport:
    path: str
    kind: str
    backend: str | None
    layers: list[LayerReport]
    problems: list[str]  # not tied to one layer
    notes: list[str]

    @property
    def passed(self) -> bool:
        return not self.problems and all(r.passed for r in self.layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "backend": self.backend,
            "passed": self.passed,
            "problems": self.problems,
            "notes": self.notes,
            "layers": [r.to_json() for r in self.layers],
            "thresholds": THRESHOLDS,
        }


# ---------------------------------------------------------------------------------------------


def _sha256_of(ckpt: Checkpoint, name: str) -> str:
    h = hashlib.sha256()
    for chunk in iter_tensor_chunks(ckpt.tensors[name]):
        h.update(chunk)
    return h.hexdigest()


def check_integrity(root: Path, manifest: dict[str, Any], ckpts: list[Checkpoint]) -> dict[int | None, list[str]]:
    """Problems by layer (None = not in a layer)."""
    problems: dict[int | None, list[str]] = {}
    tp = len(ckpts)
    seen: set[str] = set()
    for key, entry in manifest["tensors"].items():
        rank, name = 0, key
        if tp > 1:
            prefix, _, name = key.partition("/")
            try:
                rank = int(prefix.removeprefix("rank-"))
                if not 0 <= rank < tp:
                    raise ValueError
            except ValueError:
                problems.setdefault(None, []).append(f"{key}: manifest names no valid rank directory (rank-0 .. rank-{tp - 1})")
                continue
        ckpt = ckpts[rank]
        seen.add(key)
        where = problems.setdefault(layer_index(name), [])
        info = ckpt.tensors.get(name)
        if info is None:
            where.append(f"{key}: listed in the manifest but missing from the checkpoint")
            continue
        rel = info.file.relative_to(root).as_posix()
        if rel != entry["file"]:
            where.append(f"{key}: stored in {rel}, manifest says {entry['file']}")
        if list(info.shape) != list(entry["shape"]) or info.dtype != entry["dtype"]:
            where.append(f"{key}: {info.dtype}{list(info.shape)} on disk, manifest says {entry['dtype']}{entry['shape']}")
            continue
        if _sha256_of(ckpt, name) != entry["sha256"]:
            where.append(f"{key}: sha256 mismatch (corrupted or modified bytes)")
    for r, ckpt in enumerate(ckpts):
        for name in ckpt.tensors:
            key = name if tp == 1 else f"rank-{r}/{name}"
            if key not in seen:
                problems.setdefault(layer_index(name), []).append(f"{key}: present in the checkpoint but not in the manifest")
    return problems


# Manifest layout keys that convert sets itself (the others come from the backend's describe()).
_LAYOUT_KEYS_SET_BY_CONVERT = frozenset({"hidden_size", "intermediate_size", "intermediate_size_total", "padded_hidden_size",
                                         "padded_intermediate_size", "tp_ranges", "options", "w13_row_order", "kernel_params"})
# ModelInfo fields a canonical output's own config and tensors must repeat (not the formats: those
# of the output differ from the source's, which the manifest's model table describes).
_MODEL_FIELDS = ("family", "num_layers", "moe_layers", "num_experts", "top_k", "hidden_size", "intermediate_size",
                 "row_order", "has_expert_bias", "routing", "norm_topk_prob", "n_group", "topk_group",
                 "routed_scaling_factor", "activation", "swiglu_alpha", "swiglu_limit")


def check_manifest_claims(manifest: dict[str, Any], info: ModelInfo, ckpts: list[Checkpoint],
                          own_reader: FamilyReader | None) -> list[str]:
    """What the manifest says that the files can contradict (the schema checked its types):

    * ``layout.kernel_params`` are the model's activation constants;
    * kernel outputs: the backend's own description of the layout (``describe``) matches the
      manifest's ``layout`` table, and the router tensors ``layers`` names are in the checkpoint;
    * canonical outputs: the output reads back as the model ``model`` describes, and ``layers``
      names the layers' modules and routers as the output's own reader finds them.
    """
    from mxconv.plan import kernel_params

    problems: list[str] = []
    lay = manifest["layout"]
    want = kernel_params(info)
    if lay.get("kernel_params") != want:
        problems.append(f"manifest layout.kernel_params is {lay.get('kernel_params')}, but the model's activation gives {want}")
    if manifest["kind"] == "kernel":
        try:
            layout = get_layout(manifest["backend"])
            desc = layout.describe(_sizes(manifest), manifest["activation"], layout.resolve_options(lay.get("options") or {}))
        except BadInput:  # unknown backend or options: the layout check of every layer says so
            desc = {}
        for key, value in json.loads(json.dumps(desc)).items():
            if key not in _LAYOUT_KEYS_SET_BY_CONVERT and lay.get(key) != value:
                problems.append(f"manifest layout.{key} is {lay.get(key)!r}, but the {manifest['backend']} layout of these "
                                f"sizes and options has {value!r}")
        for row in manifest["layers"]:
            for key in ("router_weight", "router_bias", "correction_bias"):
                name = row.get(key)
                if name and name not in ckpts[0].tensors:
                    problems.append(f"manifest layers: layer {row['layer']} {key} {name!r} is not in the checkpoint")
    elif own_reader is not None:
        own = own_reader.model_info()
        for f in _MODEL_FIELDS:
            if getattr(own, f) != getattr(info, f):
                problems.append(f"manifest model.{f} is {getattr(info, f)!r}, but the checkpoint's config and tensors give "
                                f"{getattr(own, f)!r}")
        refs = {r.layer: r for r in own_reader.layer_refs()}
        for row in manifest["layers"]:
            ref = refs.get(row["layer"])
            for key in ("module_prefix", "router_weight", "router_bias", "correction_bias"):
                if ref is not None and row.get(key) != getattr(ref, key):
                    problems.append(f"manifest layers: layer {row['layer']} {key} is {row.get(key)!r}, but the checkpoint "
                                    f"has {getattr(ref, key)!r}")
    return problems


def _sizes(manifest: dict[str, Any]) -> LayoutSizes:
    lay, model = manifest["layout"], manifest["model"]
    return LayoutSizes(
        num_experts=int(model["num_experts"]),
        hidden_size=int(lay["hidden_size"]),
        intermediate_size=int(lay["intermediate_size"]),
        padded_hidden_size=int(lay["padded_hidden_size"]),
        padded_intermediate_size=int(lay["padded_intermediate_size"]),
        row_order=lay["w13_row_order"],
        has_bias=bool(model["has_expert_bias"]),
        weight_format="int4" if manifest["weight_format"] == "int4" else "mxfp4",
    )


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
    return CanonicalExperts(
        w13=cat13([p.w13 for p in parts]),
        w13_scale=cat13([p.w13_scale for p in parts]),
        w2=torch.cat([p.w2 for p in parts], dim=2),
        w2_scale=torch.cat([p.w2_scale for p in parts], dim=2),
        w13_bias=b13,
        w2_bias=parts[0].w2_bias,
        row_order=order,
        weight_format=parts[0].weight_format,
    )


def kernel_layer_canonical(
    manifest: dict[str, Any], ckpts: list[Checkpoint], prefix: str, problems: list[str]
) -> CanonicalExperts | None:
    """Invert one layer's kernel tensors (all ranks), check the round trip; None on failure."""
    backend = manifest["backend"]
    try:
        layout = get_layout(backend)
    except BadInput as exc:
        problems.append(f"manifest backend: {exc}")
        return None
    activation = manifest["activation"]
    try:
        options = layout.resolve_options(manifest["layout"].get("options") or {})
    except LayoutError as exc:
        problems.append(f"{prefix}.experts: not a valid {backend} layout: manifest layout options: {exc}")
        return None
    sizes = _sizes(manifest)
    ranges = [tuple(r) for r in manifest["layout"].get("tp_ranges") or [[0, sizes.intermediate_size]]]
    parts: list[CanonicalExperts] = []
    for rank, ckpt in enumerate(ckpts):
        names = {k: f"{prefix}.experts.{k}" for k in ("w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias")}
        tensors = {k: read_tensor(ckpt.tensors[n]) for k, n in names.items() if n in ckpt.tensors}
        s, e = ranges[rank]
        # every rank was laid out at the widest rank's width (slice_tp's pad_to), then padded
        rank_sizes = LayoutSizes(sizes.num_experts, sizes.hidden_size, sizes.intermediate_size, sizes.padded_hidden_size,
                                 sizes.padded_intermediate_size, sizes.row_order, sizes.has_bias, sizes.weight_format)
        tag = f"{prefix}.experts" + (f" (rank {rank})" if len(ckpts) > 1 else "")
        try:
            canon = layout.from_kernel(tensors, rank_sizes, activation, options)
        except LayoutError as exc:
            problems.append(f"{tag}: not a valid {backend} layout: {exc}")
            return None
        again = layout.to_kernel(canon, activation, options)
        for k, t in again.items():
            stored = tensors.get(k)
            if stored is None or stored.shape != t.shape or not torch.equal(stored.view(torch.uint8), t.contiguous().view(torch.uint8)):
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
    return merge_tp(parts, ranges, sizes.intermediate_size)


_FORMAT_CODES = ("float", "mxfp4", "mxfp8", "int4")


def _same_mx_bytes(reference_format: str, converted_format: str) -> bool:
    """True when the converted weights hold exactly the reference's values: same MX format, or an
    MXFP4 reference converted to MXFP8 (lossless). Then the outputs must match exactly."""
    return reference_format == converted_format or (reference_format == "mxfp4" and converted_format == "mxfp8")


def _first_difference(a: CanonicalExperts, b: CanonicalExperts) -> str | None:
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        x, y = getattr(a, name), getattr(b, name)
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
        if x is not None and not torch.equal(x.float(), y.float()):
            e, r = (x.float() != y.float()).nonzero()[0][:2].tolist()
            return f"{name}: first difference at expert {e}, row {r}"
    return None


def _canonical_from_layer(layer: MoELayer) -> CanonicalExperts | None:
    if layer.w13_int4 is not None and layer.w2_int4 is not None:
        return CanonicalExperts(layer.w13_int4.data, layer.w13_int4.scales, layer.w2_int4.data, layer.w2_int4.scales,
                                row_order=layer.row_order, weight_format="int4")
    if layer.w13_mx is None or layer.w13_mx.fmt != "mxfp4":
        return None
    return CanonicalExperts(layer.w13_mx.data, layer.w13_mx.scales, layer.w2_mx.data, layer.w2_mx.scales,
                            layer.w13_bias, layer.w2_bias, layer.row_order)


def _canonical_stack(c: CanonicalExperts, which: str) -> MXStack | Int4Stack:
    """``c``'s w13 or w2 with its scales, as the stack type of its weight format."""
    data, scales = getattr(c, which), getattr(c, f"{which}_scale")
    return Int4Stack(data, scales) if c.weight_format == "int4" else MXStack("mxfp4", data, scales)


def _weights(layer: MoELayer, which: str) -> MXStack | FP8BlockStack | torch.Tensor:
    """A layer's stack in whatever form the reader gave it (MX, block-FP8, INT4 or float)."""
    for form in (f"{which}_mx", f"{which}_fp8", f"{which}_int4", which):
        t = getattr(layer, form)
        if t is not None:
            return t
    raise BadInput(f"{layer.ref.module_prefix}.experts: no {which} weights")


def expert_fn(w13: MXStack | FP8BlockStack | torch.Tensor, w2: MXStack | FP8BlockStack | torch.Tensor, b13: torch.Tensor | None,
              b2: torch.Tensor | None, device: torch.device | str = "cpu") -> ExpertFn:
    """Per-expert fp32 weights on ``device``, dequantized there on demand (one expert at a time)."""
    from mxconv.numerics import dequantize_mx

    def get(t: MXStack | FP8BlockStack | torch.Tensor, e: int) -> torch.Tensor:
        if isinstance(t, MXStack):
            return dequantize_mx(t.data[e].to(device), t.scales[e].to(device), t.fmt)
        if isinstance(t, (FP8BlockStack, Int4Stack)):  # exact fp32 dequantization
            return t.dequantize(e, e + 1, device)[0]
        return t[e].to(device).float()

    def bias(b: torch.Tensor | None, e: int) -> torch.Tensor | None:
        return None if b is None else b[e].to(device).float()

    def fn(e: int):
        return (get(w13, e), get(w2, e), bias(b13, e), bias(b2, e))

    return fn


def _router(ckpt: Checkpoint, lay: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    def opt(name: str | None) -> torch.Tensor | None:
        return None if not name else ckpt.read(name).float()

    return ckpt.read(lay["router_weight"]).float(), opt(lay.get("router_bias")), opt(lay.get("correction_bias"))


def _model_info(d: dict[str, Any]) -> ModelInfo:
    """The manifest's ``model`` table (validated by load_manifest) -> ModelInfo; keys a newer mxconv
    may add are ignored."""
    known = {f.name for f in dataclasses.fields(ModelInfo)}
    d = {k: v for k, v in d.items() if k in known}
    d["moe_layers"] = tuple(d["moe_layers"])
    return ModelInfo(**d)


def _kernel_nonfinite(canon: CanonicalExperts, prefix: str) -> str | None:
    """The first NaN scale byte / non-finite bias of experts recovered from a kernel layout, named
    by the manifest tensor and the canonical (expert, row, block) index."""
    from mxconv.numerics import first_nonfinite, first_nonnumber

    scales = {"w13_weight_scale": canon.w13_scale, "w2_weight_scale": canon.w2_scale}
    if canon.weight_format == "int4":  # bf16 group scales: NaN/Inf (E8M0 0xFF is an MX rule)
        for name, t in scales.items():
            at = first_nonfinite(t)
            if at is not None:
                return f"non-finite value {t[at].item()} in {prefix}.experts.{name} at canonical [{', '.join(map(str, at))}] (expert, row, block)"
        scales = {}
    hit = first_nonnumber({**scales, "w13_bias": canon.w13_bias, "w2_bias": canon.w2_bias})
    if hit is None:
        return None
    name, idx, what = hit
    coords = "expert, row, block" if name.endswith("_scale") else "expert, row"
    return f"{what} in {prefix}.experts.{name} at canonical [{', '.join(map(str, idx))}] ({coords})"


def _output_nonfinite(out: torch.Tensor, what: str) -> str | None:
    """Describe the first NaN/Inf of a runner output [tokens, hidden]; None when it is finite."""
    from mxconv.numerics import first_nonfinite

    idx = first_nonfinite(out)
    if idx is None:
        return None
    return f"the {what} holds {out[idx].item()} (token {idx[0]}, channel {idx[1]}): a non-finite output never passes"


def run_layer(info: ModelInfo, row_order: str, experts: ExpertFn, router: tuple, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
    """The reference MoE output [T, H] fp32 of one layer and its routing (top-k ids and weights)."""
    rw, rb, cb = (None if t is None else t.to(x.device) for t in router)
    r = route(x, rw, info, rb, cb)
    out = moe_forward(x, r, experts, info.num_experts, info, row_order).cpu()
    return out, Routing(r.ids.cpu(), r.weights.cpu())


def parse_layers(spec: str | None, available: list[int]) -> list[int]:
    if not spec:
        return available
    try:
        want = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise BadInput(f"--layers {spec!r}: expected comma-separated layer numbers, e.g. 0,3") from None
    if not want:
        raise BadInput(f"--layers {spec!r}: names no layer (available: {available})")
    missing = [w for w in want if w not in available]
    if missing:
        raise BadInput(f"--layers: {missing} are not converted MoE layers (available: {available})")
    return want


def verify(
    path: str | Path,
    *,
    reference: str | None = None,
    reference_outputs: str | None = None,
    save_reference: str | None = None,
    layers: str | None = None,
    tokens: int = 64,
    seed: int = 0,
    revision: str | None = None,
    kernel: bool = False,
    device: torch.device | str = "cpu",
) -> VerifyReport:
    """Run the three checks on ``path``; see the module docstring."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise BadInput(f"{path}: no such directory")
    manifest = load_manifest(root)
    tp = int(manifest.get("tp_size") or 1)
    dirs = [root] if tp == 1 else [root / f"rank-{r}" for r in range(tp)]
    for d in dirs:
        if not d.is_dir():
            raise BadInput(f"{d}: missing (manifest says tp_size {tp})")
    ckpts = [open_checkpoint(d) for d in dirs]
    if tokens < 1:
        raise BadInput("--tokens must be >= 1")
    if reference and reference_outputs:
        raise BadInput("give either --reference or --reference-outputs, not both")
    if save_reference and not reference:
        raise BadInput("--save-reference needs --reference (the outputs saved are the reference's)")
    info = _model_info(manifest["model"])
    lay_table = {int(l["layer"]): l for l in manifest["layers"]}
    chosen = parse_layers(layers, sorted(lay_table))
    kind = manifest["kind"]
    notes: list[str] = []
    general: list[str] = []

    integ = check_integrity(root, manifest, ckpts)
    klayout, kernel_size_problems = kernel_preflight(manifest) if kernel else (None, [])
    general.extend(integ.get(None, []))

    ref_ckpt: Checkpoint | None = None
    ref_reader: FamilyReader | None = None
    saved: dict[str, torch.Tensor] | None = None
    if reference:
        ref_ckpt = open_checkpoint(reference, revision)
        ref_reader = detect_family(ref_ckpt)
        rinfo = ref_reader.model_info()
        for field_name in ("num_experts", "hidden_size", "intermediate_size", "top_k", "row_order"):
            a, b = getattr(rinfo, field_name), getattr(info, field_name)
            if a != b:
                raise BadInput(
                    f"--reference {reference}: a different model ({field_name} {a} vs {b} in {root}); "
                    "pass the checkpoint this one was converted from"
                )
    if reference_outputs:
        saved = load_reference_outputs(Path(reference_outputs), seed, tokens)
        for name, t in saved.items():
            if name.endswith(".output") and tuple(t.shape) != (tokens, info.hidden_size):
                raise BadInput(
                    f"--reference-outputs {reference_outputs}: {name} has shape {list(t.shape)}, expected "
                    f"[{tokens}, {info.hidden_size}] (outputs of a different model?)"
                )
    to_save: dict[str, torch.Tensor] = {}

    own_reader: FamilyReader | None = None
    own_refs: dict[int, Any] = {}
    own_error: str | None = None
    if kind == "canonical":
        try:  # a damaged output (a tensor missing, a config edited) fails verification, naming why
            own_reader = detect_family(ckpts[0])
            own_refs = {r.layer: r for r in own_reader.layer_refs()}
        except BadInput as exc:
            own_error = str(exc)
            general.append(f"{root}: does not read back as a {manifest['family']} checkpoint: {exc}")
    if own_error is None:
        general.extend(check_manifest_claims(manifest, info, ckpts, own_reader))
    reports: list[LayerReport] = []
    for L in sorted(lay_table):
        rep = LayerReport(L)
        probs = integ.get(L, [])
        if probs:
            rep.integrity = "FAIL"
            rep.problems.extend(probs)
        if L not in chosen:
            if probs:
                reports.append(rep)
            continue
        lay = lay_table[L]
        prefix = lay["module_prefix"]
        # ---- layout: recover the canonical experts of the converted checkpoint
        canon: CanonicalExperts | None = None
        conv_layer: MoELayer | None = None
        if kind == "kernel":
            lprobs: list[str] = []
            try:
                canon = kernel_layer_canonical(manifest, ckpts, prefix, lprobs)
            except KeyError as exc:
                lprobs.append(f"{prefix}.experts: kernel tensor {exc} missing")
            rep.layout = "FAIL" if lprobs else "ok"
            rep.problems.extend(lprobs)
        elif own_error is not None:
            rep.layout = "not run"
        else:
            ref = own_refs.get(L)
            if ref is None:
                rep.layout = "FAIL"
                rep.problems.append(f"{prefix}: the manifest lists this MoE layer but the checkpoint has no experts for it")
            else:
                assert own_reader is not None
                conv_layer = own_reader.read_layer(ref)
                canon = _canonical_from_layer(conv_layer)
                rep.layout = "ok"
        # ---- values that are not numbers (NaN scale bytes, NaN/Inf biases and routers) fail
        if conv_layer is not None and own_reader is not None:
            bad_value = own_reader.nonfinite_problem(conv_layer)
        else:
            bad_value = None if canon is None else _kernel_nonfinite(canon, prefix)
            if bad_value is None and canon is not None:
                try:
                    bad_value = nonfinite_tensors(ckpts[0], (lay["router_weight"], lay.get("router_bias"), lay.get("correction_bias")))
                except BadInput:
                    pass  # a router the checkpoint lacks: the integrity check names it
        if bad_value:
            rep.problems.append(f"layer {L}: {bad_value}")
        # ---- reference layer (for bit-exact layout and numerics)
        ref_layer: MoELayer | None = None
        if ref_reader is not None:
            rrefs = {r.layer: r for r in ref_reader.layer_refs()}
            if L not in rrefs:
                raise BadInput(f"--reference {reference}: has no MoE layer {L}")
            ref_layer = ref_reader.read_layer(rrefs[L])
            ref_bad = ref_reader.nonfinite_problem(ref_layer)
            if ref_bad:
                bad_value = bad_value or ref_bad
                rep.problems.append(f"layer {L}: the reference {reference} holds a value that is not a number: {ref_bad}")
            rcanon = _canonical_from_layer(ref_layer)
            if rcanon is not None and canon is not None and manifest["weight_format"] in ("mxfp4", "int4") and (
                rcanon.weight_format == manifest["weight_format"]
            ):
                diff = _first_difference(canon, rcanon)
                if diff:
                    rep.layout = "FAIL"
                    rep.problems.append(f"{prefix}.experts: recovered canonical bytes differ from the reference: {diff}")
                else:
                    rep.layout = "bit-exact"
        # ---- numerics
        if bad_value:
            rep.numerics = "FAIL"
            reports.append(rep)
            continue
        if (ref_layer is None and saved is None and klayout is None) or (canon is None and conv_layer is None):
            rep.numerics = "skipped" if rep.layout != "FAIL" else "not run"
            reports.append(rep)
            continue
        x = hidden_states(tokens, info.hidden_size, seed, L, device)
        try:
            router = _router(ckpts[0], lay)
        except BadInput as exc:
            rep.problems.append(str(exc))
            reports.append(rep)
            continue
        if canon is not None:
            conv_fn = expert_fn(_canonical_stack(canon, "w13"), _canonical_stack(canon, "w2"),
                                canon.w13_bias, canon.w2_bias, device)
            row_order = canon.row_order
        else:
            assert conv_layer is not None
            conv_fn = expert_fn(_weights(conv_layer, "w13"), _weights(conv_layer, "w2"), conv_layer.w13_bias, conv_layer.w2_bias, device)
            row_order = conv_layer.row_order
        out, routing = run_layer(info, row_order, conv_fn, router, x)
        ids = routing.ids
        ref_fmt: str | None = None
        if saved is not None:
            try:
                ref_out, ref_ids = saved[f"layer.{L}.output"], saved[f"layer.{L}.topk_ids"]
            except KeyError:
                saved_layers = sorted({int(n.split(".")[1]) for n in saved if n.endswith(".output")})
                raise BadInput(
                    f"--reference-outputs {reference_outputs}: no outputs for layer {L} (the file holds layers "
                    f"{saved_layers}; pass --layers {','.join(map(str, saved_layers))})"
                ) from None
            code = int(saved[f"layer.{L}.format"].item()) if f"layer.{L}.format" in saved else 0
            ref_fmt = "exact" if _same_mx_bytes(_FORMAT_CODES[code], manifest["weight_format"]) else manifest["weight_format"]
        elif ref_layer is not None:
            assert ref_ckpt is not None
            rfn = expert_fn(_weights(ref_layer, "w13"), _weights(ref_layer, "w2"), ref_layer.w13_bias, ref_layer.w2_bias, device)
            ref_out, ref_routing = run_layer(info, ref_layer.row_order, rfn, _router(ref_ckpt, lay), x)
            ref_ids = ref_routing.ids
            ref_src_fmt = ref_layer.w13_mx.fmt if ref_layer.w13_mx is not None else "int4" if ref_layer.w13_int4 is not None else "float"
            ref_fmt = "exact" if _same_mx_bytes(ref_src_fmt, manifest["weight_format"]) else manifest["weight_format"]
            if save_reference:
                to_save[f"layer.{L}.output"] = ref_out.contiguous()
                to_save[f"layer.{L}.topk_ids"] = ref_ids.contiguous()
                to_save[f"layer.{L}.format"] = torch.tensor([_FORMAT_CODES.index(ref_src_fmt)], dtype=torch.uint8)
        if ref_fmt is not None:
            cmp = compare(out, ref_out, ids, ref_ids)
            th = THRESHOLDS[ref_fmt]
            rep.comparison, rep.threshold = cmp, ref_fmt
            bad = [b for b in (_output_nonfinite(out, "converted output"), _output_nonfinite(ref_out, "reference output")) if b]
            if not cmp.rel_rms <= th["rel_rms"]:
                bad.append(f"relative RMS error {cmp.rel_rms:.4g} > {th['rel_rms']}")
            if not cmp.cosine >= th["cosine"]:
                bad.append(f"cosine {cmp.cosine:.6f} < {th['cosine']}")
            if not cmp.topk_agreement >= th["topk_agreement"]:
                bad.append(f"top-k agreement {cmp.topk_agreement:.3f} < {th['topk_agreement']}")
            rep.numerics = "FAIL" if bad else "ok"
            rep.problems.extend(f"layer {L} numerics: {b}" for b in bad)
        # ---- the engine's own kernel on the files (verify --kernel)
        if klayout is not None:
            if kernel_size_problems:
                rep.kernel = KernelResult("FAIL", problems=[f"layer {L} kernel: {p}" for p in kernel_size_problems])
            else:
                ref_pair = None if ref_fmt is None else (ref_out, ref_ids, THRESHOLDS[ref_fmt])
                rep.kernel = check_kernel_layer(klayout, root, manifest, L, x, routing, out, ref_pair)
            rep.problems.extend(rep.kernel.problems)
        reports.append(rep)
    if save_reference:
        save_reference_outputs(Path(save_reference), to_save, seed, tokens)
        notes.append(f"reference outputs saved to {save_reference}")
    if klayout is not None and not kernel_size_problems:
        notes.append(f"--kernel: the {manifest['backend']} engine kernel ran on every checked layer "
                     f"(bound vs the converted bytes: relative RMS <= {KERNEL_THRESHOLDS['rel_rms']}, cosine >= {KERNEL_THRESHOLDS['cosine']})")
    if ref_reader is None and saved is None:
        notes.append("numerics skipped: no --reference or --reference-outputs given (integrity and layout checked)")
    return VerifyReport(str(root), kind, manifest.get("backend"), reports, general, notes)


def save_reference_outputs(path: Path, tensors: dict[str, torch.Tensor], seed: int, tokens: int) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"mxconv": "reference-outputs", "seed": str(seed), "tokens": str(tokens)})


def load_reference_outputs(path: Path, seed: int, tokens: int) -> dict[str, torch.Tensor]:
    from mxconv.st_format import read_header

    infos, meta = read_header(path)
    if meta.get("mxconv") != "reference-outputs":
        raise BadInput(f"{path}: not an mxconv reference-outputs file")
    if meta.get("seed") != str(seed) or meta.get("tokens") != str(tokens):
        raise BadInput(
            f"{path}: saved with --seed {meta.get('seed')} --tokens {meta.get('tokens')}; "
            f"run verify with the same values (got --seed {seed} --tokens {tokens})"
        )
    return {n: read_tensor(i) for n, i in infos.items()}
