"""``mxconv.json`` as a typed, frozen :class:`Manifest`: what the bytes of a converted checkpoint mean
(see contract.md).

Every reader (open a source, verify, inspect, the loader, the vLLM plugin) goes through
:func:`load_manifest`, which checks the file against the published schema
(:mod:`mxconv.source.manifest_schema`: required keys, types, enums, rules between fields) and
returns a :class:`Manifest`: a tampered or truncated manifest is refused with exit 2 naming the field,
never a crash later, and no reader indexes the JSON itself. The writer
(:mod:`mxconv.output.manifest`) serialises through the same type (:meth:`Manifest.to_json`), which
gives back exactly the JSON it was parsed from: keys a newer mxconv adds, absent optional keys and
key order are kept. Where there is no manifest, :func:`missing_manifest_message` says why (a run
writing it now, an interrupted run, one rank of a tensor-parallel output).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping

from mxconv.errors import BadInput, OutputDamaged
from mxconv.source.file_names import (CONFIG_NAME, IN_PROGRESS, MANIFEST_NAME, RANK_DIR, manifest_file_problem,
                                     output_path, rank_dir_name)
from mxconv.source.in_progress import live_writer
from mxconv.source.json_files import read_json
from mxconv.source.manifest_schema import FORMAT_VERSION, REQUIRED_KEYS, SCHEMA, validate_manifest
from mxconv.source.st_format import TensorInfo

__all__ = [
    "FORMAT_VERSION", "REQUIRED_KEYS", "SCHEMA", "LayerEntry", "LayoutPart", "Manifest", "ModelPart", "SourcePart",
    "TensorEntry", "check_own_paths", "complete_output_dir", "load_manifest", "missing_manifest_message", "plain_json", "stored_problem",
    "tensor_file", "validate_manifest",
]

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
    inverse of reading it (parts through their own ``to_json``)."""
    if isinstance(v, _Part):
        return v.to_json()
    if isinstance(v, Mapping):
        return {k: plain_json(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return [plain_json(x) for x in v]
    return v


@dataclass(frozen=True, kw_only=True)
class _Part:
    """One JSON object of the manifest: its known keys as typed fields (absent optional keys are
    None), every other key in ``extra`` (read-only, kept as written), ``json_keys`` the keys it was
    read with, in order, so that :meth:`to_json` gives back exactly that object."""

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

    def to_json(self) -> dict[str, Any]:
        """The JSON object: the keys it was read with, in order (built in code: every field, then ``extra``)."""
        names = self._names()
        keys = self.json_keys or (*names, *self.extra)
        return {k: plain_json(getattr(self, k) if k in names else self.extra[k]) for k in keys}


@dataclass(frozen=True, kw_only=True)
class SourcePart(_Part):
    """Where the checkpoint came from (``source``): a local path or a hub repo id at a revision."""

    fingerprint: str
    revision: str | None = None
    path: str | None = None
    repo_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class ModelPart(_Part):
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
class LayoutPart(_Part):
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
class LayerEntry(_Part):
    """One converted MoE layer (``layers[i]``): its module prefix and router tensors."""

    layer: int
    module_prefix: str
    router_weight: str
    router_bias: str | None = None
    correction_bias: str | None = None


@dataclass(frozen=True, kw_only=True)
class TensorEntry(_Part):
    """One written tensor (``tensors[name]``): its file (``rank-R/...`` for rank R > 0 of a
    tensor-parallel output), shape, dtype, the sha256 of its bytes and its role."""

    file: str
    shape: tuple[int, ...]
    dtype: str
    sha256: str
    role: str


def _layers(v: Any) -> tuple[LayerEntry, ...]:
    return tuple(LayerEntry.from_json(x) for x in v)


def _tensors(v: Any) -> Mapping[str, TensorEntry]:
    return MappingProxyType({k: TensorEntry.from_json(x) for k, x in v.items()})


@dataclass(frozen=True, kw_only=True)
class Manifest(_Part):
    """A validated ``mxconv.json`` (:meth:`parse`), frozen; :meth:`to_json` writes it back."""

    format_version: int
    tool_version: str
    command: tuple[str, ...]
    created: str
    source: SourcePart
    family: str
    kind: str  # "canonical" | "kernel"
    weight_format: str  # "mxfp4" | "mxfp8" | "int4" | "fp8-block"
    scale_rounding: str | None
    backend: str | None  # the mxconv backend of a kernel-layout output
    activation: str | None  # its --activation
    tp_size: int  # positive
    layout: LayoutPart
    model: ModelPart
    layers: tuple[LayerEntry, ...]
    tensors: Mapping[str, TensorEntry]
    numerics: Mapping[str, Any] | None = None
    fp8_tiles: Mapping[str, Any] | None = None
    linears: Mapping[str, Any] | None = None  # quantize --targets linear (mxconv.run.linears)
    source_bytes_by_role: Mapping[str, int] | None = None
    quant_config: Mapping[str, Any] | None = None  # mxconv.output.engine_quant_config.EngineQuantConfig
    served_vllm_backends: tuple[str, ...] | None = None
    served_vllm_methods: Mapping[str, tuple[str, ...]] | None = None
    output_files: tuple[str, ...] | None = None
    output_file_hashes: Mapping[str, Mapping[str, Any]] | None = None  # name -> {size, sha256}

    _parts: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "source": SourcePart.from_json, "layout": LayoutPart.from_json, "model": ModelPart.from_json,
        "layers": _layers, "tensors": _tensors,
    }

    @classmethod
    def parse(cls, obj: Any, path: Path | str) -> "Manifest":
        """``obj`` (parsed JSON) checked against the schema and the rules between fields
        (:func:`~mxconv.source.manifest_schema.validate_manifest`: OutputDamaged naming the field that
        breaks one, Unsupported for a newer format), as a Manifest."""
        return typing.cast(Manifest, cls.from_json(validate_manifest(obj, path)))

    @property
    def is_kernel(self) -> bool:
        return self.kind == "kernel"

    @property
    def layer_numbers(self) -> list[int]:
        """The converted MoE layers, in the manifest's order."""
        return [entry.layer for entry in self.layers]

    def layer(self, number: int) -> LayerEntry | None:
        """The entry of MoE layer ``number`` (None: not converted)."""
        return next((entry for entry in self.layers if entry.layer == number), None)

    @property
    def rank_ranges(self) -> tuple[tuple[int, int], ...]:
        """Each rank's [start, end) of the intermediate size (one range over all of it without tp_ranges)."""
        if self.layout.tp_ranges is not None:
            return self.layout.tp_ranges
        return ((0, self.layout.intermediate_size_total or self.layout.intermediate_size),)

    def with_keys(self, path: Path | str, **values: Any) -> "Manifest":
        """This manifest with top-level keys set to ``values`` (JSON; new keys go last), checked again
        (:meth:`parse`; ``path`` names it in the message)."""
        return Manifest.parse({**self.to_json(), **values}, path)


def complete_output_dir(path: str | Path) -> Path:
    """The directory of the complete mxconv output at ``path`` (resolved), or BadInput: no such directory,
    or one without ``mxconv.json`` (not an output, still being written, or left by an interrupted run).
    Reads no weights and imports no torch: commands call it before their heavy imports."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise BadInput(f"{path}: no such directory")
    if not (root / MANIFEST_NAME).exists():
        raise BadInput(missing_manifest_message(root))
    return root


def missing_manifest_message(root: Path) -> str:
    """Why ``root`` has no usable mxconv.json, and what to run instead (for BadInput)."""
    if (root / IN_PROGRESS).exists():
        pid = live_writer(root)
        if pid is not None:
            return f"{root}: no {MANIFEST_NAME} yet; mxconv (pid {pid}) is writing this output now: wait for it to finish"
        return f"{root}: no {MANIFEST_NAME}; not a complete mxconv output (an interrupted mxconv run? rerun it)"
    if RANK_DIR.fullmatch(root.name) and (root.parent / MANIFEST_NAME).exists():
        return (
            f"{root}: no {MANIFEST_NAME}; this is one rank of a tensor-parallel mxconv output: "
            f"pass the output directory {root.parent} (its {MANIFEST_NAME} describes every rank)"
        )
    try:
        cfg = read_json(root / CONFIG_NAME, CONFIG_NAME)
    except BadInput:
        cfg = None
    if isinstance(cfg, dict) and isinstance(cfg.get("mxconv_layout"), dict):
        return (
            f"{root}: no {MANIFEST_NAME}; config.json says this is an mxconv kernel-layout output, but without its "
            f"manifest it is incomplete or damaged (rerun the repack)"
        )
    return f"{root}: no {MANIFEST_NAME}; not a complete mxconv output"


def load_manifest(root: Path) -> Manifest:
    """Read and validate ``root/mxconv.json`` (BadInput when missing, malformed or off-schema)."""
    path = root / MANIFEST_NAME
    if not path.exists():
        raise BadInput(missing_manifest_message(root))
    try:
        doc = read_json(path, "the manifest", "malformed manifest")
    except BadInput as exc:
        raise OutputDamaged(str(exc)) from None
    return Manifest.parse(doc, path)


def tensor_file(root: Path, manifest: Manifest, key: str) -> Path:
    """The file the manifest of the output at ``root`` names for tensor entry ``key``, inside ``root``
    (OutputDamaged where the name leaves it: :func:`~mxconv.source.file_names.manifest_file_problem`;
    :func:`validate_manifest` refuses such a manifest already, this guards one built elsewhere; and
    where the file or its rank directory is a link: :func:`~mxconv.source.file_names.output_path`)."""
    entry = manifest.tensors[key]
    problem = manifest_file_problem(key, entry.file, manifest.tp_size)
    if problem:
        raise OutputDamaged(f"{root / MANIFEST_NAME}: tensor {key!r}: file {problem}")
    return output_path(root, entry.file, f"{root / MANIFEST_NAME}: tensor {key!r}")


def check_own_paths(root: Path, manifest: Manifest) -> None:
    """OutputDamaged (:func:`~mxconv.source.file_names.output_path`) where a rank directory of the
    output at ``root`` or a file its manifest names for a tensor is a link: checked before the ranks
    are opened, so that no shard is read from outside the output."""
    tp = manifest.tp_size
    for r in range(tp) if tp > 1 else []:
        output_path(root, rank_dir_name(r), f"{root / MANIFEST_NAME} (tp_size {tp})")
    for key in manifest.tensors:
        tensor_file(root, manifest, key)


def stored_problem(root: Path, manifest: Manifest, key: str, info: TensorInfo | None) -> str | None:
    """What the files of the output at ``root`` contradict of manifest entry ``key``, given ``info``,
    where its tensor was found (None: not found); None when they agree. The one check of where a
    tensor is, and of its shape and dtype, that ``verify`` (which finds tensors through the index)
    and the loader (through the file the manifest names) share."""
    entry = manifest.tensors[key]
    if info is None:
        return f"{key}: listed in the manifest but missing from the checkpoint"
    if info.file != tensor_file(root, manifest, key):
        stored = info.file.relative_to(root).as_posix() if info.file.is_relative_to(root) else info.file
        return f"{key}: stored in {stored}, manifest says {entry.file}"
    if tuple(info.shape) != entry.shape or info.dtype != entry.dtype:
        return f"{key}: {info.dtype}{list(info.shape)} on disk, manifest says {entry.dtype}{list(entry.shape)}"
    return None
