"""The typed parts of ``mxconv.json`` (:mod:`mxconv.source.manifest` holds the whole :class:`Manifest` and its
files): each JSON object of the manifest as a frozen dataclass whose known keys are typed fields and whose
other keys stay in ``extra``, read as written, so that ``as_written`` gives back exactly that object. Besides
the model, layout, layers and tensors, the records a run adds (``numerics`` and its ``upstream``,
``linears``, ``fp8_tiles``) are parts too, so their readers (run, verify, inspect) read fields, not keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _frozen(v: Any) -> Any:
    """Parsed JSON, read-only: objects as mappings, lists as tuples."""
    if isinstance(v, dict):
        return MappingProxyType({k: _frozen(x) for k, x in v.items()})
    if isinstance(v, list):
        return tuple(_frozen(x) for x in v)
    return v


def plain_json(v: Any) -> Any:
    """A value of a :class:`Manifest` as plain JSON again (mappings as dicts, tuples as lists): the
    inverse of reading it (parts through their own ``as_written``)."""
    if isinstance(v, Part):
        return v.as_written()
    if isinstance(v, Mapping):
        return {k: plain_json(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return [plain_json(x) for x in v]
    return v


@dataclass(frozen=True, kw_only=True)
class Part:
    """One JSON object of the manifest: its known keys as typed fields (absent optional keys are
    None), every other key in ``extra`` (read-only, kept as written), ``json_keys`` the keys it was
    read with, in order, so that :meth:`as_written` gives back exactly that object."""

    extra: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    json_keys: tuple[str, ...] = field(default=(), compare=False, repr=False)

    _parts: ClassVar[dict[str, Callable[[Any], Any]]] = {}  # key -> how to read a typed sub-part

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("extra", "json_keys"))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Any:
        """The part of a validated JSON object (:func:`~mxconv.source.manifest_schema.validate_manifest`)."""
        names = cls._names()
        known = {k: cls._parts.get(k, _frozen)(v) for k, v in d.items() if k in names}
        extra = MappingProxyType({k: _frozen(v) for k, v in d.items() if k not in names})
        return cls(**known, extra=extra, json_keys=tuple(d))

    def as_written(self) -> dict[str, Any]:
        """The JSON object: the keys it was read with, in order (built in code: every field, then ``extra``).
        For the writer and for showing a manifest as written; readers take the typed fields (a name of its
        own, so that tests/test_architecture.py finds every call whatever holds the part)."""
        names = self._names()
        keys = self.json_keys or (*names, *self.extra)
        return {k: plain_json(getattr(self, k) if k in names else self.extra[k]) for k in keys}


@dataclass(frozen=True, kw_only=True)
class SourcePart(Part):
    """Where the checkpoint came from (``source``): a local path or a hub repo id at a revision."""

    fingerprint: str
    revision: str | None = None
    path: str | None = None
    repo_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class ModelPart(Part):
    """``model``: the :class:`~mxconv.families.base.ModelInfo` fields the reference runner needs
    (``ModelInfo.from_part`` builds one; an absent optional field takes ModelInfo's default)."""

    family: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    expert_format: str
    row_order: str
    has_expert_bias: bool
    routing: str
    norm_topk_prob: bool | None = None
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float | None = None
    activation: str | None = None
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    source_scale_scheme: str | None = None


@dataclass(frozen=True, kw_only=True)
class LayoutPart(Part):
    """``layout``: the layout's name and version, the (per-rank) sizes and their padding, the row
    order of w13, the activation's kernel parameters, the backend's resolved options and each rank's
    slice of the intermediate size; the rest of a backend's description (``describe()``: e.g. a
    Triton arch, a stored row order) stays in ``extra``."""

    name: str
    version: int
    engine_compat: Mapping[str, str]
    hidden_size: int
    intermediate_size: int
    padded_hidden_size: int
    padded_intermediate_size: int
    w13_row_order: str
    kernel_params: Mapping[str, float] | None
    options: Mapping[str, Any] | None = None
    tp_ranges: tuple[tuple[int, int], ...] | None = None
    intermediate_size_total: int | None = None
    # what the layout chose from each stack's data (Layout.stack_choices), by MoE layer number (as a
    # string), one object per TP rank, by kernel tensor name; absent where a layout chooses nothing
    stack_choices: Mapping[str, tuple[Mapping[str, str], ...]] | None = None

    def choices_of(self, layer: int, rank: int = 0) -> dict[str, str]:
        """Layer ``layer``'s recorded stack choices on rank ``rank`` (``{}`` when none are recorded)."""
        per_rank = (self.stack_choices or {}).get(str(layer))
        return dict(per_rank[rank]) if per_rank is not None and rank < len(per_rank) else {}

    @property
    def option_values(self) -> dict[str, Any]:
        """The recorded layout options (``{}`` when none), for ``Layout.resolve_options``."""
        return dict(self.options or {})

    def json_value(self, key: str) -> Any:
        """The JSON value of ``key`` as written (a typed field or a backend's own), None when absent:
        for comparing the whole table with a layout's ``describe()``."""
        names = self._names()
        return plain_json(getattr(self, key) if key in names else self.extra.get(key))

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(hidden, intermediate, padded hidden, padded intermediate), per rank."""
        return self.hidden_size, self.intermediate_size, self.padded_hidden_size, self.padded_intermediate_size


@dataclass(frozen=True, kw_only=True)
class LayerEntry(Part):
    """One converted MoE layer (``layers[i]``): its module prefix and router tensors."""

    layer: int
    module_prefix: str
    router_weight: str
    router_bias: str | None = None
    correction_bias: str | None = None


@dataclass(frozen=True, kw_only=True)
class TensorEntry(Part):
    """One written tensor (``tensors[name]``): its file (``rank-R/...`` for rank R > 0 of a
    tensor-parallel output), shape, dtype, the sha256 of its bytes and its role."""

    file: str
    shape: tuple[int, ...]
    dtype: str
    sha256: str
    role: str


def layers_of(v: Any) -> tuple[LayerEntry, ...]:
    return tuple(LayerEntry.from_json(x) for x in v)


def tensors_of(v: Any) -> Mapping[str, TensorEntry]:
    return MappingProxyType({k: TensorEntry.from_json(x) for k, x in v.items()})



@dataclass(frozen=True, kw_only=True)
class UpstreamPart(Part):
    """``numerics.upstream`` (mxconv.run.finalize.upstream_of): the earlier mxconv run whose MX bytes this one
    kept: the format it read, the format and scale rounding it wrote, and its source's fingerprint."""

    source_format: str
    weight_format: str
    scale_rounding: str
    fingerprint: str


@dataclass(frozen=True, kw_only=True)
class NumericsPart(Part):
    """``numerics`` (mxconv.run.finalize.recorded_numerics): how the expert bytes were made. The fields read
    one by one are typed; the format fields (element_format, scale_format, ...) stay in ``extra``, compared
    as a whole with the rule that wrote them (mxconv.verify.recorded)."""

    source_format: str | None = None
    requantized: bool | None = None
    upstream: UpstreamPart | None = None

    _parts: ClassVar[dict[str, Callable[[Any], Any]]] = {"upstream": UpstreamPart.from_json}


@dataclass(frozen=True, kw_only=True)
class LinearsPart(Part):
    """``linears`` (mxconv.run.linears.LinearSelection.to_json): what ``quantize --targets linear`` made
    MXFP8 (or block FP8), which MX linears it carried, which it left alone and why."""

    targets: str  # "experts" | "linear"
    format: str
    quantized: tuple[str, ...]
    carried_mx: tuple[str, ...]
    left_alone: Mapping[str, str]
    scale_rounding: str | None = None


@dataclass(frozen=True, kw_only=True)
class Fp8TilesPart(Part):
    """``fp8_tiles`` (mxconv.run.fp8_compute): the count of FP8 block tiles re-encoded from MXFP4, in all and
    per layer (``layers``, by layer number as a string: each with its ``inexact`` count)."""

    layers: Mapping[str, Any] | None = None

    def inexact(self, layer: int) -> int | None:
        """How many of layer ``layer``'s tiles the run recorded as inexact (None: no count recorded)."""
        return (self.layers or {}).get(str(layer), {}).get("inexact")
