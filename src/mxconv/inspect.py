"""``mxconv inspect``: what a checkpoint is, from headers and the manifest alone (no weights read).

Imports no torch, nor does anything it calls (tests/test_startup.py): inspect starts in well under a
second. The memory plan counts the RSS torch will add to the quantize run (``memory.TORCH_RSS``).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from mxconv.experts.stack import LayoutSizes
from mxconv.source.checkpoint import Checkpoint, open_checkpoint
from mxconv.source.file_names import MANIFEST_NAME, rank_dir_name
from mxconv.families import detect_family
from mxconv.layouts import backend_names, get_layout
from mxconv.output.engine_quant_config import quant_config_of
from mxconv.errors import BadInput, LayoutError
from mxconv.source.manifest import Manifest, load_manifest, missing_manifest_message, plain_json
from mxconv.layouts.vllm_serving import OutputForm, served_backends, served_methods, vllm_serving


def canonical_expert_bytes(E: int, H: int, I: int, has_bias: bool, scale_bytes: int = 1, per_byte: int = 2) -> int:
    """Canonical (unpadded) bytes of one layer's experts, bf16 biases included: MXFP4 (``scale_bytes``
    1, E8M0 scales; ``per_byte`` 2 values a byte), MXFP8 (1, 1) or INT4 (2, 2: bf16 group-32 scales)."""
    w13 = 2 * I * (H // per_byte + scale_bytes * H // 32)
    w2 = H * (I // per_byte + scale_bytes * I // 32)
    bias = 2 * (2 * I + H) if has_bias else 0
    return E * (w13 + w2) + E * bias


def backend_table(
    E: int, H: int, I: int, row_order: str, has_bias: bool, layers: int, model_activation: str = "silu",
    source_format: str = "mxfp4",
) -> list[dict[str, Any]]:
    """Per backend/activation: the experts' format in it (``weight_format``), padded sizes, kernel bytes,
    padding overhead vs the canonical experts of that format, and the vLLM 0.33 backends that would hold the
    output as is, per vLLM quantization method (``vllm_methods``; :func:`mxconv.layouts.vllm_serving.vllm_serving`,
    the manifest's rule; ``model_activation``: "silu" | "swigluoai").
    ``source_format``: the source's experts (ModelInfo.expert_format); each layout gets what ``repack`` writes
    of them by default (:func:`mxconv.run.repack_formats.default_weight_format`: a float source's MXFP4, or
    MXFP8 for a layout that takes no MXFP4; an MX or INT4 source's own format), and a layout that does not take
    that an error row saying what would work (the words of repack's refusal)."""
    from mxconv.run.repack_formats import ExpertShape, default_weight_format, weight_format_hint

    rows = []
    for name in backend_names():
        layout = get_layout(name)
        formats, weight_format = layout.weight_formats, str(default_weight_format(source_format, layout))
        base = canonical_expert_bytes(E, H, I, has_bias, 2 if weight_format == "int4" else 1,
                                      1 if weight_format == "mxfp8" else 2) * layers  # fmt: skip
        for act in layout.activations:
            if weight_format not in formats:
                hint = weight_format_hint(source_format, layout, weight_format, ExpertShape(E, H, I, row_order, has_bias))
                rows.append({"backend": name, "activation": act, "error": (
                    f"takes {', '.join(formats)} experts, not {weight_format}: {hint}")})
                continue
            try:
                opts = layout.resolve_options()
                Hp, Ip = layout.padded_sizes(H, I, row_order, act, opts, weight_format=weight_format)
                sizes = LayoutSizes(E, H, I, Hp, Ip, row_order, has_bias, weight_format)
                nbytes = sum(s.nbytes for s in layout.kernel_specs(sizes, act, opts).values()) * layers
                desc = layout.describe(sizes, act, opts)
                model = {"activation": model_activation, "has_expert_bias": has_bias}
                servings = vllm_serving(OutputForm(name, act, weight_format, (H, I, Hp, Ip), model,
                                                   desc.get("engine_compat", {}).get("vllm"), desc.get("arch")))
                rows.append(
                    {
                        "backend": name,
                        "activation": act,
                        "weight_format": weight_format,
                        "padded_hidden_size": Hp,
                        "padded_intermediate_size": Ip,
                        "expert_bytes": nbytes,
                        "padding_overhead": nbytes / base - 1 if base else 0.0,
                        "vllm_backends": list(served_backends(servings)),
                        "vllm_methods": served_methods(servings),
                    }
                )
            except LayoutError as exc:
                rows.append({"backend": name, "activation": act, "error": str(exc)})
    return rows


def role_bytes(ckpt: Checkpoint, routers: list[str], reader: Any = None) -> dict[str, Any]:
    """Bytes per role (mxconv.run.linears.ROLES) before and after: an mxconv output against its source
    (recorded in the manifest); a source against what ``quantize --format mxfp8 --targets linear``
    would write (planned from the headers; ``after_error`` where it would refuse)."""
    from mxconv.run.linears import bytes_by_role

    now = bytes_by_role(((n, i.nbytes) for n, i in ckpt.tensors.items()), routers)
    m = ckpt.manifest
    if m is not None:
        return {"before": plain_json(m.source_bytes_by_role), "before_label": "source", "after": now, "after_label": "this output"}
    doc: dict[str, Any] = {"before": now, "before_label": "this checkpoint", "after": None,
                           "after_label": "quantize --format mxfp8 --targets linear"}
    if reader is not None:
        from mxconv.run.options import QuantOptions, Targets, WeightFormat
        from mxconv.run.plan import build_plan

        try:
            plan = build_plan(ckpt, reader, QuantOptions(WeightFormat.MXFP8, targets=Targets.LINEAR, skip_unaligned=True))
            doc["after"] = bytes_by_role(((t.name, t.nbytes) for t in plan.dests[0]), routers)
        except BadInput as exc:
            doc["after_error"] = str(exc)
    return doc


def inspect_checkpoint(ckpt: Checkpoint) -> dict[str, Any]:
    """A JSON-able description of ``ckpt`` (see the CLI's inspect command)."""
    dtypes = Counter(i.dtype for i in ckpt.tensors.values())
    out: dict[str, Any] = {
        "path": str(ckpt.root),
        "source": ckpt.source.to_json(),
        "kind": ckpt.kind,
        "tensors": len(ckpt.tensors),
        "shards": len(ckpt.shard_files),
        "dtypes": dict(sorted(dtypes.items())),
        "total_bytes": ckpt.total_bytes(),
    }
    m = ckpt.manifest
    if m is not None:
        out["manifest"] = {k: getattr(m, k) for k in ("tool_version", "created", "family", "kind", "weight_format", "scale_rounding", "backend", "activation", "tp_size")}
        out["manifest"]["layout"] = m.layout.as_written()  # shown as written, not read
        if m.linears is not None and m.linears.targets == "linear":
            out["linears"] = plain_json(m.linears)  # which linear layers are MXFP8, which were left alone and why
        try:  # stored in the manifest, or recomputed from it (manifests older than the quant config)
            qc = quant_config_of(m)
            out["quant_config"], out["served_vllm_backends"] = qc.to_json(), list(qc.served_vllm_backends)
        except BadInput as exc:
            out["quant_config_error"] = str(exc)
    if ckpt.kind == "kernel":
        if m is None:  # an output that lost its manifest (a TP output's rank-N is read with its root's)
            raise BadInput(missing_manifest_message(ckpt.root))
        model = m.model.as_written()  # shown as written (plus the sizes below), not read
        model["source_expert_format"] = m.model.expert_format
        model["expert_format"] = m.weight_format
        model["padded_hidden_size"], model["padded_intermediate_size"] = m.layout.padded_hidden_size, m.layout.padded_intermediate_size
        expert = sum(i.nbytes for n, i in ckpt.tensors.items() if ".experts." in n)
        out.update(
            {
                "family": m.family,
                "model": model,
                "bytes": {"experts": expert, "rest": ckpt.total_bytes() - expert},
                "bytes_by_role": role_bytes(ckpt, [name for r in m.layers for name in
                                                   (r.router_weight, r.router_bias, r.correction_bias) if name]),
            }
        )
        return out
    reader = detect_family(ckpt)
    info = reader.model_info()
    refs = reader.layer_refs()
    expert_names = {n for r in refs for n in r.source_names}
    expert_bytes = ckpt.total_bytes(sorted(expert_names))
    out.update(
        {
            "family": info.family,
            "family_title": reader.title,
            "model": info.to_json(),
            "moe_layers": len(refs),
            "bytes": {"experts": expert_bytes, "rest": ckpt.total_bytes() - expert_bytes},
            "bytes_by_role": role_bytes(ckpt, [n for r in refs for n in (r.router_weight, r.router_bias, r.correction_bias) if n],
                                        reader),
            "backends": backend_table(
                info.num_experts, info.hidden_size, info.intermediate_size, info.row_order, info.has_expert_bias, len(refs),
                info.activation, info.expert_format,
            ),
        }
    )
    memory = memory_plan(ckpt, reader)
    if memory is not None:
        out["memory"] = memory
    return out


_RANK_DIR = re.compile(r"rank-(0|[1-9][0-9]*)")


def inspect_path(source: str, revision: str | None = None) -> dict[str, Any]:
    """``mxconv inspect SOURCE``: :func:`inspect_checkpoint` of the checkpoint at SOURCE, where a
    tensor-parallel output is read through its root ``mxconv.json``: at the root the document covers
    every rank (tensors, shards and bytes summed over the ranks; ``tp_size``; ``ranks``, one entry per
    rank), at one ``rank-N`` directory that rank alone (``rank``, ``tp_size``, ``output``, ``ranks``
    holding its entry)."""
    path = Path(source).expanduser()
    if path.is_dir():
        path = path.resolve()
        if (m := _tp_manifest(path)) is not None:
            return _inspect_tp_output(path, m)
        rank = None if (path / MANIFEST_NAME).exists() else _RANK_DIR.fullmatch(path.name)
        if rank and (m := _tp_manifest(path.parent)) is not None:
            return _inspect_tp_rank(path.parent, int(rank.group(1)), m)
    return inspect_checkpoint(open_checkpoint(source, revision))


def _tp_manifest(root: Path) -> Manifest | None:
    """The manifest of the tensor-parallel output ``root`` (tp_size > 1, rank-0/ beside it), else None."""
    if not ((root / MANIFEST_NAME).is_file() and (root / "rank-0").is_dir()):
        return None
    m = load_manifest(root)
    return m if m.tp_size > 1 else None


def _open_rank(root: Path, rank: int, m: Manifest) -> Checkpoint:
    """Rank ``rank`` of the TP output ``root``, its headers validated, read with the root manifest ``m``."""
    d = root / rank_dir_name(rank)
    if not d.is_dir():
        raise BadInput(f"{d}: missing; {root / MANIFEST_NAME} says tp_size {m.tp_size}, so the output "
                       f"holds one directory per rank, rank-0 to rank-{m.tp_size - 1}")
    ckpt = open_checkpoint(d)
    ckpt.manifest = m
    return ckpt


def _rank_entry(ckpt: Checkpoint, rank: int, m: Manifest) -> dict[str, Any]:
    """One rank of a TP output: its directory, its shard files with their bytes on disk, its slice
    of the intermediate size (``layout.tp_ranges``) and the padded sizes its tensors are laid out at
    (every rank shares them: a narrower rank is padded to the widest one's shape)."""
    lay = m.layout
    span = plain_json((lay.tp_ranges or [None] * m.tp_size)[rank])  # required of kernel outputs with tp_size > 1
    shards = [{"file": f.name, "bytes": f.stat().st_size} for f in ckpt.shard_files]
    return {
        "rank": rank,
        "dir": ckpt.root.name,
        "path": str(ckpt.root),
        "intermediate_range": span,
        "intermediate_size": span[1] - span[0] if span else None,
        "padded_hidden_size": lay.padded_hidden_size,
        "padded_intermediate_size": lay.padded_intermediate_size,
        "tensors": len(ckpt.tensors),
        "expert_bytes": sum(i.nbytes for n, i in ckpt.tensors.items() if ".experts." in n),
        "shards": shards,
        "bytes": sum(s["bytes"] for s in shards),
    }


def _inspect_tp_output(root: Path, m: Manifest) -> dict[str, Any]:
    """The whole TP output at ``root``: rank 0's description with counts and bytes over every rank."""
    ckpts = [_open_rank(root, r, m) for r in range(m.tp_size)]
    docs = [inspect_checkpoint(c) for c in ckpts]
    doc = docs[0]
    doc["path"] = str(root)
    for key in ("tensors", "shards", "total_bytes"):
        doc[key] = sum(d[key] for d in docs)
    doc["dtypes"] = dict(sorted(sum((Counter(d["dtypes"]) for d in docs), Counter()).items()))
    doc["bytes"] = {k: sum(d["bytes"][k] for d in docs) for k in doc["bytes"]}
    roles = doc["bytes_by_role"]
    roles["after"] = dict(sum((Counter(d["bytes_by_role"]["after"]) for d in docs), Counter()))
    roles["after_label"] = f"this output, {m.tp_size} ranks"
    doc["tp_size"] = m.tp_size
    doc["ranks"] = [_rank_entry(c, r, m) for r, c in enumerate(ckpts)]
    return doc


def _inspect_tp_rank(root: Path, rank: int, m: Manifest) -> dict[str, Any]:
    """Rank ``rank`` alone of the TP output at ``root``, saying which rank of how many it is."""
    if rank >= m.tp_size:
        raise BadInput(f"{root / rank_dir_name(rank)}: not a rank of this output; {root / MANIFEST_NAME} says "
                       f"tp_size {m.tp_size} (rank-0 to rank-{m.tp_size - 1})")
    ckpt = _open_rank(root, rank, m)
    doc = inspect_checkpoint(ckpt)
    doc["bytes_by_role"]["after_label"] = f"rank {rank} of {m.tp_size}"
    doc.update({"tp_size": m.tp_size, "rank": rank, "output": str(root), "ranks": [_rank_entry(ckpt, rank, m)]})
    return doc


def memory_plan(ckpt: Checkpoint, reader: Any) -> dict[str, Any] | None:
    """How ``mxconv quantize`` (default options, CPU) would use memory at the default ``--max-memory``:
    experts per group, pipeline depth, estimated peak and the smallest budget that works (None where
    quantize refuses this source)."""
    from mxconv.run.options import QuantOptions
    from mxconv.run.plan import build_plan
    from mxconv.run.plan_costs import memory_plan_for

    try:
        planned = memory_plan_for(build_plan(ckpt, reader, QuantOptions()), None, "cpu")
    except BadInput:
        return None
    return {"command": "quantize --device cpu", "plan": planned.describe(), **planned.to_json()}


def engine_forms(ckpt: Checkpoint, family: str | None) -> tuple[list[tuple[str, Any]], dict[str, Any] | None]:
    """``inspect --engine``: the forms an engine may see, (label, engine_picks.SourceKind or None), the
    checkpoint as it is first, then each quantize output it can become; for a kernel output, the
    canonical form it was made from. Also that output's served backends (None for a checkpoint)."""
    from mxconv.families.quant_config import quantization_dict
    from mxconv.layouts.engine_picks import SourceKind
    from mxconv.layouts.engine_report import source_kind

    m = ckpt.manifest
    gpt_oss = family == "gpt-oss"
    if m is not None and m.is_kernel:
        fmt = m.weight_format
        kinds = {"int4": (SourceKind.CT_INT4, SourceKind.CT_INT4), "mxfp8": (SourceKind.MXCONV_MXFP8, SourceKind.CT_MXFP8)}
        kind = kinds.get(fmt, (SourceKind.GPT_OSS_MXFP4, SourceKind.CT_MXFP4))[0 if gpt_oss else 1]
        forms: list[tuple[str, Any]] = [(f"its canonical {fmt} form", kind)]
        if kind is SourceKind.CT_MXFP4:  # the same bytes may be held under quant_method mxfp4 (Mxfp4MoEMethod)
            forms.append(("this output, as quant_method mxfp4", SourceKind.MXFP4))
        methods = {k: list(v) for k, v in quant_config_of(m).served_vllm_methods}
        return forms, {"served_vllm_methods": methods}
    as_is = source_kind(quantization_dict(ckpt), ckpt.config.get("model_type"))
    forms = [("as is", as_is)]
    if m is None or m.kind != "canonical":
        mx4, mx8 = (SourceKind.GPT_OSS_MXFP4, SourceKind.MXCONV_MXFP8) if gpt_oss else (SourceKind.CT_MXFP4, SourceKind.CT_MXFP8)
        forms += [(f"quantize --format {f}", k) for f, k in (("mxfp4", mx4), ("mxfp8", mx8)) if k != as_is]
        if not gpt_oss:  # a repack output is loaded under the method holding its bytes: quant_method mxfp4
            forms.append(("repack, as quant_method mxfp4", SourceKind.MXFP4))
    return forms, None


def inspect_engine(source: str, engine: str, gpus: tuple[str, ...] | None, revision: str | None = None) -> dict[str, Any]:
    """``mxconv inspect SRC --engine E [--gpu G]``: :func:`inspect_path`'s document plus ``engine``: per
    GPU (all of engine_picks.Gpu when ``gpus`` is None), what the engine picks for each form of the
    checkpoint, which mxconv outputs hold those bytes and the padding each implies."""
    from mxconv.layouts.engine_picks import ENGINES, Gpu
    from mxconv.layouts.engine_report import engine_report

    if engine not in ENGINES:  # the options first: a hub source is not fetched for a typo
        raise BadInput(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    try:
        chosen = tuple(Gpu(g) for g in gpus) if gpus else tuple(Gpu)
    except ValueError:
        raise BadInput(f"unknown GPU {', '.join(gpus or ())}; choose from {', '.join(g.value for g in Gpu)}") from None
    doc = inspect_path(source, revision)
    if "ranks" in doc:  # a TP output (or one rank of it): rank 0 read with the root manifest
        root = Path(doc.get("output") or doc["path"])
        ckpt = _open_rank(root, 0, load_manifest(root))
    else:
        ckpt = open_checkpoint(doc["path"])
    forms, served = engine_forms(ckpt, doc.get("family"))
    model = dict(doc.get("model") or {})
    if ckpt.manifest is not None:
        model["hidden_size"], model["intermediate_size"] = ckpt.manifest.layout.hidden_size, ckpt.manifest.layout.intermediate_size
    report = engine_report(engine, chosen, forms, model, _repack_source(source, ckpt))
    if served is not None:
        for g in report["gpus"]:
            for row in g["rows"]:
                if row.get("method"):  # held under the method this form is loaded with (vllm_serving's rule)
                    row["this_output_holds_it"] = row.get("backend") in served["served_vllm_methods"].get(row["method"], [])
                    row["this_output_served"] = served["served_vllm_methods"]
    doc["engine"] = report
    return doc


def _repack_source(given: str, ckpt: Checkpoint) -> tuple[str, str]:
    """(what a repack command starts from, the stem of its output paths): the checkpoint as the user named
    it, or for a kernel output the source its manifest records; outputs beside a local source, in the
    current directory for a Hugging Face repo id."""
    m = ckpt.manifest
    if m is not None and m.is_kernel:
        given = str(m.source.repo_id or m.source.path or given)
    local = Path(given).expanduser()
    if local.is_dir():
        return str(local.resolve()), str(local.resolve())
    return given, given.rstrip("/").rsplit("/", 1)[-1]
