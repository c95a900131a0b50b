"""The last phase of a conversion: what the output says about itself. ``config.json`` (the source
config with the quantization_config of what was written), the manifest ``mxconv.json`` (the
run's source, numerics, layout, layers and tensor table, with the engines' quant_config), the
top-level files the run owns, and the notes shown after a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from mxconv.families.base import MoELayerRef
from mxconv.families.gpt_oss_output import FORMAT_KEY
from mxconv.layouts.vllm_serving import OutputForm, VllmMethod, served_backends, vllm_serving
from mxconv.output.engine_quant_config import VLLM_LOAD_FORMAT, VLLM_QUANT_METHOD, quant_config_keys, quant_config_of
from mxconv.output.files import FileRecord
from mxconv.output.manifest import manifest_of, provenance
from mxconv.run.linear_config import with_linears
from mxconv.run.linears import manifest_extras
from mxconv.run.options import WeightFormat
from mxconv.run.plan import Plan, kernel_params
from mxconv.source.file_names import CONFIG_NAME, INDEX_NAME
from mxconv.source.manifest import Manifest, plain_json


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
    if src_q and reader.quantize_keeps_config and all(f == plan.weight_format for _, f in formats.values()):
        pass  # MX source kept as is: its quantization_config already describes the experts
    else:
        cfg["quantization_config"] = reader.quantization_config(plan.weight_format, plan.quant.scale_rounding, skipped)
    if plan.linears is not None and plan.linears.mx_modules():  # MXFP8 linear layers: named exactly, as the rest
        cfg["quantization_config"] = with_linears(cfg["quantization_config"], plan.linears.mx_modules(), plan.linears.kept)
    if plan.repack is not None:
        cfg["mxconv_layout"] = {
            "backend": plan.repack.backend,
            "activation": plan.repack.activation,
            "tp_size": plan.repack.tp,
            "manifest": "mxconv.json",
        }
        # Kernel-layout experts are for engine integrations (mxconv's vLLM plugin, mxconv.engines.loader),
        # never for from_pretrained. quant_method "mxconv": vLLM without the plugin stops ("Unknown
        # quantization method: mxconv"), with it loads the output (load_format mxconv). transformers
        # does not know it either (docs/vllm-plugin.md: what it does then).
        # the first backend the one "served by" rule (layouts.vllm_serving, the manifest's served_vllm_methods)
        # finds under the method the plugin loads with (GptOssMxfp4MoEMethod), not the layout's first candidate
        lay, sz = plan.layout_desc, plan.sizes
        assert sz is not None
        form = OutputForm(plan.repack.backend, plan.repack.activation, plan.weight_format,
                          (plan.info.hidden_size, sz.intermediate_size, sz.padded_hidden_size, sz.padded_intermediate_size),
                          plan.info.to_json(), dict(lay.get("engine_compat") or {}).get("vllm"),
                          None if lay.get("arch") is None else str(lay["arch"]), plan.repack.tp)  # fmt: skip
        vllm_backends = served_backends(vllm_serving(form), VllmMethod.MXFP4)
        cfg["quantization_config"] = {
            "quant_method": VLLM_QUANT_METHOD,
            FORMAT_KEY: "kernel-layout",  # the key gpt-oss MXFP8 outputs use too
            "mxconv_backend": plan.repack.backend,
            "mxconv_vllm_moe_backend": vllm_backends[0] if vllm_backends else None,
            "mxconv_note": (f"MoE experts in the {plan.repack.backend} kernel layout (mxconv.json): serve with vLLM and "
                            f"mxconv's plugin (pip install 'mxconv[vllm]'; --load-format {VLLM_LOAD_FORMAT}), or load "
                            "them with mxconv.engines.loader; not with from_pretrained"),
            "mxconv_expert_quantization_config": cfg.get("quantization_config"),
        }
    return cfg


def layer_table(refs: list[MoELayerRef]) -> list[dict[str, Any]]:
    """The manifest's ``layers``: where each converted MoE layer and its router are."""
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
    """The manifest's ``layout``: canonical, or the backend's description with the per-rank sizes."""
    info = plan.info
    if plan.sizes is None and plan.weight_format == WeightFormat.FP8_BLOCK:
        lay = {
            "name": "canonical-fp8-block",
            "version": 1,
            "engine_compat": {"transformers": ">=4.51", "vllm": ">=0.8"},  # FineGrainedFP8 / Fp8 MoE block quant
            "hidden_size": info.hidden_size,
            "intermediate_size": info.intermediate_size,
            "padded_hidden_size": info.hidden_size,
            "padded_intermediate_size": info.intermediate_size,
        }
    elif plan.sizes is None:
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
            lay["options"] = plan.repack.layout_options.to_json()
    lay["w13_row_order"] = info.row_order
    lay["kernel_params"] = kernel_params(info)
    return lay


def numerics_of(plan: Plan) -> tuple[dict[str, Any], bool]:
    """The manifest's ``numerics`` of ``plan``'s output, and whether the experts' MX bytes were kept
    (:func:`recorded_numerics`)."""
    # From the converted layers' own formats (a mixed source holds MX and float layers).
    src_formats = {plan.reader.layer_format(r) for r in plan.refs}
    return recorded_numerics(plan.weight_format, plan.info.expert_format, plan.info.source_scale_scheme, src_formats,
                             plan.ckpt.manifest)


def recorded_numerics(fmt: str, source_format: str, source_scale_scheme: str | None, src_formats: set[str],
                      input_manifest: Manifest | None) -> tuple[dict[str, Any], bool]:
    """The manifest's ``numerics`` of an output in ``fmt`` converted from layers of ``src_formats``
    (a source of ``source_format``, the model's), and whether the experts' MX bytes were kept (same
    format, or the lossless MXFP4 -> MXFP8 re-coding): then no scale rounding was applied, and an
    mxconv input's own rounding is carried as ``upstream`` (:func:`upstream_of`). verify derives the
    same from the reference where the reference is the source."""
    if fmt == WeightFormat.FP8_BLOCK:
        numerics, kept = fp8_block_numerics(source_format, source_scale_scheme, src_formats), True
    else:
        lossless = src_formats == {WeightFormat.MXFP4} and fmt == WeightFormat.MXFP8
        numerics = {
            "element_format": {WeightFormat.MXFP4: "e2m1", WeightFormat.INT4: "int4"}.get(fmt, "e4m3"),
            "scale_format": "bf16" if fmt == WeightFormat.INT4 else "e8m0",
            "block_size": 32,
            "block_axis": "input (last dim of [out, in])",
            "rounding": "rne",
            "packing": "low_nibble_first" if fmt in (WeightFormat.MXFP4, WeightFormat.INT4) else None,
            "source_format": source_format,
            "source_scale_scheme": source_scale_scheme,
            "requantized": any(f in (WeightFormat.MXFP4, WeightFormat.MXFP8) and f != fmt for f in src_formats)
            and not lossless,
            "lossless_conversion": "mxfp4 -> mxfp8 (same block scales, E2M1 values are E4M3 values)" if lossless else None,
        }
        kept = src_formats == {fmt} or lossless
    upstream = upstream_of(input_manifest) if kept and not numerics["requantized"] else None
    return (numerics if upstream is None else {**numerics, "upstream": upstream}), kept


def fp8_block_numerics(source_format: str, source_scale_scheme: str | None, src_formats: set[str]) -> dict[str, Any]:
    """The manifest's ``numerics`` of a block-FP8 output (docs/numerics.md, "Block FP8")."""
    from_mx = src_formats == {WeightFormat.MXFP4}
    return {
        "element_format": "e4m3",
        "scale_format": "fp32 scale_inv (W = fp32(weight) * scale_inv)",
        "block_size": [128, 128],
        "block_axis": "128 output rows x 128 input columns ([out, in] tiles)",
        "rounding": "rne",
        "packing": None,
        "source_format": source_format,
        "source_scale_scheme": source_scale_scheme,
        "scale_rule": ("power of two 2^(top - 8) per tile (exact where the tile's binade spread <= 17)" if from_mx
                       else "amax / 448 per tile (DeepSeek-V3)"),
        "requantized": not from_mx,
        "lossless_conversion": None,
    }


def upstream_of(input_manifest: Manifest | None) -> dict[str, Any] | None:
    """The manifest's ``numerics.upstream`` (docs/contract.md) where this run kept the MX bytes of an
    mxconv output that an earlier run quantized (or re-encoded them exactly): that run's source format,
    weight format, scale rounding and source fingerprint, so that ``verify --reference`` of the first
    source re-derives the bytes through it. A chain carries the first run's; None where the input is
    no mxconv output or its experts were not rounded by mxconv (an MXFP4 release, INT4)."""
    if input_manifest is None:
        return None
    carried = input_manifest.numerics.upstream if input_manifest.numerics is not None else None
    if carried is not None:
        return plain_json(carried)
    if not input_manifest.scale_rounding:
        return None
    return {"source_format": input_manifest.model.expert_format, "weight_format": input_manifest.weight_format,
            "scale_rounding": input_manifest.scale_rounding, "fingerprint": input_manifest.source.fingerprint}


def build_manifest(plan: Plan, tensors: dict[str, Any], rank_dirs: list[Path], argv: list[str] | None,
                   fp8_tiles: dict[str, Any] | None = None, files: dict[str, FileRecord] | None = None,
                   stack_choices: dict[int, list[dict[str, str]]] | None = None) -> Manifest:
    """The manifest of ``plan``'s output: ``tensors`` (the written tensor table), the engines'
    quant_config and served backends, ``output_files``: the top-level names this run wrote, and
    ``output_file_hashes``: size and sha256 of each file it wrote but the shards (which ``tensors``
    covers) and the manifest, by path (``files``). A later --overwrite deletes such a file only while
    it still has the recorded size and sha256 (mxconv.output.ownership). ``stack_choices``: what the
    layout chose from each layer's data, per rank (``layout.stack_choices``; none: the key is left out).
    Checked as every reader checks it (``manifest_of``): an output never gets a manifest its readers refuse."""
    numerics, from_mx_untouched = numerics_of(plan)
    repack = plan.repack
    layout = manifest_layout(plan)
    if stack_choices:
        layout["stack_choices"] = {str(n): stack_choices[n] for n in sorted(stack_choices)}
    doc = {
        **provenance(argv),
        "source": plan.ckpt.source.to_json(),
        "family": plan.info.family,
        "kind": "kernel" if repack else "canonical",
        "weight_format": plan.weight_format,
        "scale_rounding": None if from_mx_untouched else plan.quant.scale_rounding,
        "backend": repack.backend if repack else None,
        "activation": repack.activation if repack else None,
        "tp_size": repack.tp if repack else 1,
        "layout": layout,
        "numerics": numerics,
        "model": plan.info.to_json(),
        "layers": layer_table(plan.refs),
        "tensors": tensors,
    }
    if fp8_tiles is not None:  # tiles, inexact ones (MXFP4 sources) and the largest error, per layer
        doc = {**doc, "fp8_tiles": fp8_tiles}
    doc = {**doc, **manifest_extras(plan)}  # linear layers, source bytes by role
    # quant_config + served_vllm_backends, computed from the manifest so far (reads the tensors table)
    doc = {**doc, **quant_config_keys(manifest_of(doc))}
    if len(rank_dirs) > 1:
        doc = {**doc, "output_files": sorted({CONFIG_NAME, *(d.name for d in rank_dirs)})}
    else:
        doc = {**doc, "output_files": sorted({CONFIG_NAME, INDEX_NAME, *(f.name for f in plan.ckpt.extra_files)})}
    if files is not None:
        doc = {**doc, "output_file_hashes": {name: files[name].to_json() for name in sorted(files)}}
    return manifest_of(doc)


def served_backends_note(manifest: Manifest) -> str | None:
    """A kernel-layout output that no vLLM MoE backend of its format holds as it is: the note that says so."""
    if not manifest.is_kernel or manifest.served_vllm_backends:
        return None
    quant_config = quant_config_of(manifest)
    why = "; ".join(f"{b}: {r}" for b, r in quant_config.not_served)
    fmt = manifest.weight_format.upper()  # MXFP4, MXFP8 (Fp8MoeBackend) or INT4 (WNA16MoEBackend)
    return (f"note: no vLLM {quant_config.engine_version} {fmt} MoE backend holds these bytes as they are"
            + (f" ({why})" if why else f" ({manifest.weight_format} experts)")
            + "; mxconv.engines.loader and its kernels read them, and the manifest's quant_config describes them")


def run_notes(plan: Plan) -> Iterable[str]:
    """What a user should know about the written output beyond the summary (shown after the run)."""
    skipped = plan.linears.unaligned if plan.linears is not None else []
    if skipped:
        yield (f"note: {len(skipped)} linear layer(s) left unquantized (input size not a multiple of 32, "
               f"QuantOptions.skip_unaligned): {', '.join(skipped)}; the config lists them in 'ignore'")
    if plan.repack is None and any(t.name.endswith("weight_scale_inv") and t.role != "expert" for d in plan.dests for t in d):
        yield ("note: block-FP8 tensors outside the routed experts (attention, dense and shared MLPs) were copied "
               "unchanged with their weight_scale_inv scales; the written quantization_config describes the MX "
               "experts only, so engines that load this checkpoint must be told about those FP8 modules separately")
