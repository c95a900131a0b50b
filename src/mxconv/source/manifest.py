"""``mxconv.json`` as a typed, frozen :class:`Manifest`: what the bytes of a converted checkpoint mean
(see contract.md).

Every reader (open a source, verify, inspect, the loader, the vLLM plugin) goes through
:func:`load_manifest`, which checks the file against the published schema
(:mod:`mxconv.source.manifest_schema`: required keys, types, enums, rules between fields) and
returns a :class:`Manifest`: a tampered or truncated manifest is refused with exit 2 naming the field,
never a crash later, and no reader indexes the JSON itself (each JSON object is a typed part:
:mod:`mxconv.source.manifest_parts`). The writer
(:mod:`mxconv.output.manifest`) serialises through the same type (:meth:`Manifest.as_written`), which
gives back exactly the JSON it was parsed from: keys a newer mxconv adds, absent optional keys and
key order are kept. Where there is no manifest, :func:`missing_manifest_message` says why (a run
writing it now, an interrupted run, one rank of a tensor-parallel output).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

from mxconv.errors import BadInput, OutputDamaged
from mxconv.source.file_names import (CONFIG_NAME, IN_PROGRESS, MANIFEST_NAME, RANK_DIR, manifest_file_problem,
                                     output_path, rank_dir_name)
from mxconv.source.in_progress import live_writer
from mxconv.source.json_files import read_json
from mxconv.source.manifest_parts import (Fp8TilesPart, LayerEntry, LayoutPart, LinearsPart, ModelPart, NumericsPart, Part,
                                          SourcePart, TensorEntry, UpstreamPart, layers_of, plain_json, tensors_of)
from mxconv.source.manifest_schema import FORMAT_VERSION, REQUIRED_KEYS, SCHEMA, validate_manifest
from mxconv.source.st_format import TensorInfo

__all__ = [
    "FORMAT_VERSION", "REQUIRED_KEYS", "SCHEMA", "Fp8TilesPart", "LayerEntry", "LayoutPart", "LinearsPart", "Manifest",
    "ModelPart", "NumericsPart", "SourcePart", "TensorEntry", "UpstreamPart", "check_own_paths", "complete_output_dir",
    "load_manifest", "missing_manifest_message", "plain_json", "stored_problem", "tensor_file", "validate_manifest",
]


@dataclass(frozen=True, kw_only=True)
class Manifest(Part):
    """A validated ``mxconv.json`` (:meth:`parse`), frozen; :meth:`as_written` writes it back."""

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
    numerics: NumericsPart | None = None
    fp8_tiles: Fp8TilesPart | None = None
    linears: LinearsPart | None = None  # quantize --targets linear (mxconv.run.linears)
    source_bytes_by_role: Mapping[str, int] | None = None
    quant_config: Mapping[str, Any] | None = None  # mxconv.output.engine_quant_config.EngineQuantConfig
    served_vllm_backends: tuple[str, ...] | None = None
    served_vllm_methods: Mapping[str, tuple[str, ...]] | None = None
    output_files: tuple[str, ...] | None = None
    output_file_hashes: Mapping[str, Mapping[str, Any]] | None = None  # name -> {size, sha256}

    _parts: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "source": SourcePart.from_json, "layout": LayoutPart.from_json, "model": ModelPart.from_json,
        "layers": layers_of, "tensors": tensors_of, "numerics": NumericsPart.from_json, "fp8_tiles": Fp8TilesPart.from_json,
        "linears": LinearsPart.from_json,
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
        return Manifest.parse({**self.as_written(), **values}, path)


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
