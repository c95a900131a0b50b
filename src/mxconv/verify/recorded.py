"""verify, check 1 (integrity): what the manifest records about how the experts' bytes were made
(``numerics``, ``scale_rounding``) and who serves them (``served_vllm_backends``,
``served_vllm_methods`` and the engines' ``quant_config``), derived again by the rules that wrote them
and compared.

* **Served lists**: :func:`mxconv.output.engine_quant_config.from_manifest` (the one rule,
  :func:`mxconv.layouts.vllm_serving.vllm_serving`, on the manifest's layout, format and model), as
  the writer does: the top-level lists and the quant config's, with its routing and activation.
* **numerics**: :func:`mxconv.run.finalize.recorded_numerics`, as the writer does. The fields that
  follow from the weight format alone always (element and scale format, block, rounding, packing,
  the source's scale scheme); with a reference that is the output's source, every field: the
  converted layers' source formats are the reference's, and its own manifest (an mxconv output)
  gives ``upstream``. ``numerics.source_format`` against ``model.expert_format``:
  :mod:`mxconv.verify.claims`.
"""

from __future__ import annotations

from typing import Any

from mxconv.errors import BadInput
from mxconv.families.base import FamilyReader
from mxconv.source.manifest import Manifest, plain_json

# numerics fields that follow from the weight format and the model alone (source_format: claims.py)
_FORMAT_KEYS = ("element_format", "scale_format", "block_size", "block_axis", "rounding", "packing", "source_scale_scheme")


def quant_config_claims(manifest: Manifest) -> list[str]:
    """The stored engine quant config's routing, activation and served lists, and the manifest's
    top-level served lists, against what the manifest's model, layout and format give."""
    from mxconv.output.engine_quant_config import SCHEMA_VERSION, from_manifest

    try:
        want = from_manifest(manifest).to_json()
    except BadInput:
        return []
    problems = []
    top = {"served_vllm_backends": manifest.served_vllm_backends, "served_vllm_methods": manifest.served_vllm_methods}
    problems += _served(top, want, "manifest ")
    stored = plain_json(manifest.quant_config)  # the whole stored table against the rule's, key by key
    if not isinstance(stored, dict) or stored.get("schema_version") != SCHEMA_VERSION:
        return problems
    for key in ("routing", "activation"):
        have = stored.get(key) if isinstance(stored.get(key), dict) else {}
        problems += [f"manifest quant_config.{key}.{k} is {have.get(k)!r}, but the manifest's model gives {v!r}"
                     for k, v in want[key].items() if have.get(k) != v]
        problems += [f"manifest quant_config.{key}.{k}: not a field of the quant config"
                     for k in sorted(set(have) - set(want[key]))]
    return problems + _served(stored, want, "manifest quant_config.")


def _served(have: Any, want: dict[str, Any], where: str) -> list[str]:
    """The served lists in ``have`` (those present) against ``want``'s."""
    problems = []
    for key in ("served_vllm_backends", "served_vllm_methods"):
        value = plain_json(have.get(key))
        if value is not None and value != want[key]:
            problems.append(f"{where}{key} is {value!r}, but the vLLM serving rule (mxconv.layouts.vllm_serving) "
                            f"gives {want[key]!r} for this layout, format and model")
    return problems


def numerics_claims(manifest: Manifest, source: tuple[FamilyReader, Manifest | None] | None = None,
                    reference: str | None = None) -> list[str]:
    """``numerics`` (and, where derivable, ``scale_rounding``) against the rule that wrote them.
    ``source``: the reader of a reference that is the output's source, and its own manifest (None:
    no mxconv output): then every field is derived (module docstring)."""
    recorded = plain_json(manifest.numerics)  # the whole table against the rule that wrote it, key by key
    if not isinstance(recorded, dict):
        return []
    from mxconv.run.finalize import recorded_numerics

    model = manifest.model
    src_formats = None if source is None else _source_formats(manifest, source[0])
    want, kept = recorded_numerics(manifest.weight_format, model.expert_format, model.source_scale_scheme,
                                   src_formats or {model.expert_format}, None if source is None else source[1])
    if src_formats is None:
        keys, by = _FORMAT_KEYS, "the manifest's weight_format and model give"
    else:
        keys = tuple(k for k in (*want, "upstream") if k != "source_format")
        by = f"converting the reference {reference} (this output's source) gives"
    problems = [f"manifest numerics.{k} is {recorded.get(k)!r}, but {by} {want.get(k)!r}"
                for k in keys if k in recorded and recorded[k] != want.get(k)]
    if src_formats is not None and kept and manifest.scale_rounding is not None:
        problems.append(f"manifest scale_rounding is {manifest.scale_rounding!r}, but the conversion kept the "
                        f"reference {reference}'s {manifest.weight_format} bytes (this output's source): nothing was rounded")
    return problems


def _source_formats(manifest: Manifest, reader: FamilyReader) -> set[str] | None:
    """The formats of the source layers the manifest's layers were converted from (None: the reader
    lacks one of them)."""
    refs = {r.layer: r for r in reader.layer_refs()}
    if any(row.layer not in refs for row in manifest.layers):
        return None
    return {reader.layer_format(refs[row.layer]) for row in manifest.layers}
