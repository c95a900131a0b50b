"""The published contract of ``mxconv.json`` as checks: :data:`SCHEMA` (the contract's required keys
plus the ``model`` and ``layers`` tables verify runs on: types, enums) and the rules between fields.
:func:`validate_manifest` runs both on parsed JSON; :meth:`mxconv.source.manifest.Manifest.parse`
calls it before it builds the typed manifest, so every reader sees a valid one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from mxconv.errors import OutputDamaged, Unsupported
from mxconv.source.file_names import PLAIN_RULE, is_plain_name, manifest_file_problem

FORMAT_VERSION = 1  # the newest manifest format this mxconv reads (and the one it writes)
REQUIRED_KEYS = (
    "format_version",
    "tool_version",
    "command",
    "created",
    "source",
    "family",
    "kind",
    "weight_format",
    "scale_rounding",
    "backend",
    "activation",
    "tp_size",
    "layout",
    "tensors",
)


# ---------------------------------------------------------------------------------------------
# schema: what every reader of a manifest (verify, inspect, the loader) relies on
# ---------------------------------------------------------------------------------------------

Check = Callable[[Any, str], None]


class _Invalid(Exception):
    """One field of a manifest breaks the schema: ``field`` is its dotted path, ``why`` the rule."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field, self.why = field, why


def _show(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (dict, list, str, int, float, bool, type(None))) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(name: str, test: Callable[[Any], bool]) -> Check:
    def check(v: Any, at: str) -> None:
        if not test(v):
            raise _Invalid(at, f"must be {name}, got {_show(v)}")

    return check


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


INT = _kind("an integer", _is_int)
NONNEG = _kind("a non-negative integer", lambda v: _is_int(v) and v >= 0)
POSITIVE = _kind("a positive integer", lambda v: _is_int(v) and v > 0)
STR = _kind("a string", lambda v: isinstance(v, str))
NONEMPTY = _kind("a non-empty string", lambda v: isinstance(v, str) and bool(v))
BOOL = _kind("true or false", lambda v: isinstance(v, bool))
NUMBER = _kind("a finite number", lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v))
ANY: Check = lambda v, at: None  # noqa: E731


def _enum(*values: Any) -> Check:
    return _kind(" or ".join(_show(v) for v in values), lambda v: any(v == x and type(v) is type(x) for x in values))


def _nullable(check: Check) -> Check:
    def nullable(v: Any, at: str) -> None:
        if v is not None:
            check(v, at)

    return nullable


def _list(item: Check, length: int | None = None) -> Check:
    def check(v: Any, at: str) -> None:
        if not isinstance(v, list):
            raise _Invalid(at, f"must be a list, got {_show(v)}")
        if length is not None and len(v) != length:
            raise _Invalid(at, f"must hold {length} items, got {len(v)}")
        for i, x in enumerate(v):
            item(x, f"{at}[{i}]")

    return check


def _obj(required: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
    """A JSON object with these keys (others are allowed and not checked)."""

    def check(v: Any, at: str) -> None:
        if not isinstance(v, dict):
            raise _Invalid(at, f"must be an object, got {_show(v)}")
        for key, sub in required.items():
            where = f"{at}.{key}" if at else key
            if key not in v:
                raise _Invalid(where, "is missing (a required key)")
            sub(v[key], where)
        for key, sub in (optional or {}).items():
            if key in v:
                sub(v[key], f"{at}.{key}" if at else key)

    return check


def _map(value: Check) -> Check:
    """A JSON object of any keys, each value checked by ``value``."""

    def check(v: Any, at: str) -> None:
        if not isinstance(v, dict):
            raise _Invalid(at, f"must be an object, got {_show(v)}")
        for key, x in v.items():
            value(x, f"{at}.{key}")

    return check


_TENSOR = _obj({"file": NONEMPTY, "shape": _list(NONNEG), "dtype": NONEMPTY, "sha256": NONEMPTY, "role": STR})
_LAYOUT = _obj(
    {
        "name": STR,
        "version": INT,
        "engine_compat": _map(STR),
        "hidden_size": POSITIVE,
        "intermediate_size": POSITIVE,
        "padded_hidden_size": POSITIVE,
        "padded_intermediate_size": POSITIVE,
        "w13_row_order": _enum("interleaved", "halves"),
        "kernel_params": _nullable(_map(NUMBER)),
    },
    {"options": _map(ANY), "tp_ranges": _list(_list(NONNEG, 2)), "intermediate_size_total": POSITIVE,
     "stack_choices": _map(_list(_map(NONEMPTY)))},
)
# The ModelInfo fields (families.base) the reference runner needs.
_MODEL = _obj(
    {
        "family": STR,
        "num_layers": NONNEG,
        "moe_layers": _list(NONNEG),
        "num_experts": POSITIVE,
        "top_k": POSITIVE,
        "hidden_size": POSITIVE,
        "intermediate_size": POSITIVE,
        "expert_format": STR,
        "row_order": _enum("interleaved", "halves"),
        "has_expert_bias": BOOL,
        "routing": _enum("topk_softmax", "softmax_topk", "sigmoid_grouped"),
    },
    {
        "norm_topk_prob": BOOL,
        "n_group": POSITIVE,
        "topk_group": POSITIVE,
        "routed_scaling_factor": NUMBER,
        "activation": _enum("swigluoai", "silu"),
        "swiglu_alpha": _nullable(NUMBER),
        "swiglu_limit": _nullable(NUMBER),
        "source_scale_scheme": _nullable(STR),
    },
)
_LAYER = _obj(
    {"layer": NONNEG, "module_prefix": NONEMPTY, "router_weight": NONEMPTY},
    {"router_bias": _nullable(NONEMPTY), "correction_bias": _nullable(NONEMPTY)},
)
# The E8M0 scale rules a manifest records (mxconv.run.options.ScaleRounding but "auto", which
# QuantOptions resolves to one of these before anything is written); null: no rounding was applied.
SCALE_ROUNDINGS = ("rceil", "floor", "even")
ROUNDING = _nullable(_enum(*SCALE_ROUNDINGS))
# quantize --targets linear (mxconv.run.linears.LinearSelection.to_json): what became MXFP8, what stayed and why.
_LINEARS = _obj(
    {"targets": _enum("experts", "linear"), "format": STR, "quantized": _list(NONEMPTY), "carried_mx": _list(NONEMPTY),
     "left_alone": _map(STR)},
    {"scale_rounding": ROUNDING},
)
# numerics.upstream (mxconv.run.finalize.upstream_of): the earlier mxconv run whose MX bytes this one kept
_UPSTREAM = _obj({"source_format": NONEMPTY, "weight_format": _enum("mxfp4", "mxfp8"),
                  "scale_rounding": _enum(*SCALE_ROUNDINGS), "fingerprint": STR})
_NUMERICS = _obj({}, {"upstream": _UPSTREAM, "source_format": NONEMPTY, "requantized": BOOL})
# output_file_hashes (mxconv.output.files.FileRecord): each file but shards and manifest, by path
_FILE_RECORD = _obj({"size": NONNEG, "sha256": NONEMPTY})
SCHEMA: Check = _obj(
    {
        "format_version": POSITIVE,
        "tool_version": STR,
        "command": _list(STR),
        "created": STR,
        "source": _obj({"revision": _nullable(STR), "fingerprint": STR}, {"path": STR, "repo_id": STR}),
        "family": STR,
        "kind": _enum("canonical", "kernel"),
        "weight_format": _enum("mxfp4", "mxfp8", "int4", "fp8-block"),
        "scale_rounding": ROUNDING,
        "backend": _nullable(STR),
        "activation": _nullable(STR),
        "tp_size": POSITIVE,
        "layout": _LAYOUT,
        "model": _MODEL,
        "layers": _list(_LAYER),
        "tensors": _map(_TENSOR),
    },
    {"numerics": _NUMERICS, "output_files": _list(STR), "output_file_hashes": _map(_FILE_RECORD),
     "source_bytes_by_role": _map(NONNEG), "linears": _LINEARS, "fp8_tiles": _map(ANY), "quant_config": _map(ANY),
     "served_vllm_backends": _list(STR), "served_vllm_methods": _map(_list(STR))},
)


def _consistency(m: dict[str, Any]) -> None:
    """Rules between fields (after the types are right)."""
    if "path" not in m["source"] and "repo_id" not in m["source"]:
        raise _Invalid("source", "needs 'path' or 'repo_id'")
    if m["kind"] == "kernel" and m["backend"] is None:
        raise _Invalid("backend", "a kernel-layout output must name its backend, got null")
    if m["kind"] == "canonical" and m["backend"] is not None:
        raise _Invalid("backend", f"must be null for a canonical output, got {_show(m['backend'])}")
    ranges = m["layout"].get("tp_ranges")
    if m["kind"] == "kernel" and m["tp_size"] > 1 and ranges is None:
        raise _Invalid("layout.tp_ranges", f"is missing (required with tp_size {m['tp_size']})")
    if ranges is not None:
        if len(ranges) != m["tp_size"]:
            raise _Invalid("layout.tp_ranges", f"must hold tp_size={m['tp_size']} ranges, got {len(ranges)}")
        for i, (s, e) in enumerate(ranges):
            if not s < e:
                raise _Invalid(f"layout.tp_ranges[{i}]", f"must be [start, end) with start < end, got {[s, e]}")
    _stack_choices(m)
    model = m["model"]
    if model["family"] != m["family"]:
        raise _Invalid("model.family", f"is {_show(model['family'])}, but 'family' is {_show(m['family'])}")
    if model["top_k"] > model["num_experts"]:
        raise _Invalid("model.top_k", f"{model['top_k']} is more than num_experts={model['num_experts']}")
    if not m["layers"]:
        raise _Invalid("layers", "is empty, but every mxconv output converts at least one MoE layer")
    for key, entry in m["tensors"].items():
        problem = manifest_file_problem(key, entry["file"], m["tp_size"])
        if problem:
            raise _Invalid(f"tensors.{key}.file", problem)
    for i, name in enumerate(m.get("output_files", [])):
        if not is_plain_name(name):
            raise _Invalid(f"output_files[{i}]", f"is {name!r}, not {PLAIN_RULE}")
    seen: set[int] = set()
    for i, layer in enumerate(m["layers"]):
        if layer["layer"] in seen:
            raise _Invalid(f"layers[{i}].layer", f"layer {layer['layer']} is listed twice")
        if layer["layer"] not in model["moe_layers"]:
            raise _Invalid(f"layers[{i}].layer", f"layer {layer['layer']} is not one of model.moe_layers {model['moe_layers']}")
        seen.add(layer["layer"])


def _stack_choices(m: dict[str, Any]) -> None:
    """``layout.stack_choices``: keys are converted layers, one object per rank."""
    layers = {str(entry["layer"]) for entry in m["layers"]}
    for key, per_rank in m["layout"].get("stack_choices", {}).items():
        if key not in layers:
            raise _Invalid(f"layout.stack_choices.{key}", "names no converted layer (a key of 'layers')")
        if len(per_rank) != m["tp_size"]:
            raise _Invalid(f"layout.stack_choices.{key}", f"must hold tp_size={m['tp_size']} objects, got {len(per_rank)}")


def validate_manifest(m: Any, path: Path | str) -> dict[str, Any]:
    """Check a parsed ``mxconv.json`` against :data:`SCHEMA` (types, required keys, enums) and the
    rules between fields, file names included (each a plain name inside the output, see
    :func:`~mxconv.source.file_names.manifest_file_problem`); OutputDamaged
    ``"{path}: malformed manifest: field 'a.b' ..."`` naming the first field that breaks one."""
    if not isinstance(m, dict):
        raise OutputDamaged(f"{path}: malformed manifest (not a JSON object)")
    missing = [k for k in REQUIRED_KEYS if k not in m]
    if missing:
        raise OutputDamaged(f"{path}: manifest lacks required keys {missing}")
    if _is_int(m["format_version"]) and m["format_version"] > FORMAT_VERSION:
        raise Unsupported(f"{path}: manifest format_version {m['format_version']} is newer than this mxconv understands")
    try:
        SCHEMA(m, "")
        _consistency(m)
    except _Invalid as exc:
        raise OutputDamaged(f"{path}: malformed manifest: field {exc.field!r} {exc.why}") from None
    return m
