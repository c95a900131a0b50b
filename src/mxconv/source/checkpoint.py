"""A checkpoint on disk: config, index, validated shard headers, tensor reads.

``open_checkpoint(SOURCE)`` accepts a local directory or a Hugging Face repo id. For a repo id only
the config/tokenizer files, the index and the shards the index names are fetched (the local cache
and ``HF_HUB_OFFLINE=1`` are honoured). Every shard header is validated up front
(:func:`mxconv.source.st_format.read_header`), so later reads cannot run off the end of a file.

torch is named in type annotations only (imported under TYPE_CHECKING), so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mxconv.errors import BadInput
from mxconv.source.file_names import CONFIG_NAME, IN_PROGRESS, INDEX_NAME, MANIFEST_NAME, plain_name
from mxconv.source.manifest import Manifest, load_manifest, missing_manifest_message
from mxconv.source.json_files import read_json
from mxconv.source.side_files import side_file_size
from mxconv.source.st_format import TensorInfo, read_header, read_tensor

if TYPE_CHECKING:
    import torch

# Top-level files we never copy into an output (they are rewritten or are weights).
_NOT_COPIED = {INDEX_NAME, MANIFEST_NAME, CONFIG_NAME}
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Files fetched from the Hub besides the shards.
HUB_SMALL_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "tokenizer*", "*.tiktoken", "*.py"]


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor belongs to (``...layers.{L}...``), None for global tensors."""
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else None


@dataclass
class SourceInfo:
    """Where a checkpoint came from (recorded in the manifest)."""

    path: str
    repo_id: str | None = None
    revision: str | None = None
    fingerprint: str = ""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"revision": self.revision, "fingerprint": self.fingerprint}
        if self.repo_id:
            d["repo_id"] = self.repo_id
        d["path"] = self.path
        return d


@dataclass
class Checkpoint:
    """A safetensors checkpoint directory with validated headers."""

    root: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    shard_files: list[Path]
    source: SourceInfo
    manifest: Manifest | None = None
    has_index: bool = False
    extra_files: list[Path] = field(default_factory=list)

    # ---- config helpers -------------------------------------------------------------------
    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config (``text_config`` for multimodal models, else the config)."""
        tc = self.config.get("text_config")
        return tc if isinstance(tc, dict) else self.config

    def cfg(self, *keys: str, default: Any = None) -> Any:
        """First of ``keys`` present in text_config, then in the top-level config."""
        for src in (self.text_config, self.config):
            for k in keys:
                if k in src and src[k] is not None:
                    return src[k]
        return default

    # ---- tensors --------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise BadInput(f"{self.root}: tensor {name!r} is missing from the checkpoint") from None

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Read tensor ``name`` (only rows [r0, r1) of dim 0 when ``rows`` is given) into a new CPU tensor."""
        return read_tensor(self.info(name), rows)

    def total_bytes(self, names: list[str] | None = None) -> int:
        it = self.tensors.values() if names is None else (self.tensors[n] for n in names)
        return sum(i.nbytes for i in it)

    @property
    def kind(self) -> str:
        """'kernel' when an mxconv manifest says so, else 'canonical'."""
        if self.manifest is not None and self.manifest.is_kernel:
            return "kernel"
        if isinstance(self.config.get("mxconv_layout"), dict):  # e.g. one rank-N/ of a TP output
            return "kernel"
        return "canonical"


def _copied_along(name: str) -> bool:
    """Small top-level files an output carries over (tokenizer, generation config, chat template,
    remote code, README/LICENSE); never weights (*.bin, *.pt, other formats' indexes) or our own."""
    if name in _NOT_COPIED or name.startswith(".") or name.endswith(".index.json"):
        return False
    if name.upper().startswith(("README", "LICENSE", "NOTICE", "USE_POLICY")):
        return True
    return any(fnmatch.fnmatch(name, pat) for pat in HUB_SMALL_FILES)


def _fingerprint(root: Path, files: list[Path]) -> str:
    """sha256 over (name, size, mtime_ns) of the files: cheap identity of a local checkpoint."""
    h = hashlib.sha256()
    for f in sorted(files):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return "sha256:" + h.hexdigest()


def resolve_source(source: str, revision: str | None = None) -> tuple[Path, SourceInfo]:
    """Local directory or Hugging Face repo id -> (local directory, SourceInfo)."""
    if check_source_name(source):
        root = Path(source).expanduser().resolve()
        return root, SourceInfo(path=str(root), revision=revision)
    return _fetch_from_hub(source, revision)


def check_source_name(source: str) -> bool:
    """True for a local directory, False for a Hugging Face repo id; BadInput for anything else (a file,
    a missing path that is no repo id). No file is read and nothing is fetched: commands call it first."""
    p = Path(source).expanduser()
    if p.exists():
        if not p.is_dir():
            raise BadInput(f"{source}: not a directory (expected a checkpoint directory or a repo id)")
        return True
    if not _REPO_ID.match(source):
        raise BadInput(f"{source}: no such directory, and not a Hugging Face repo id (org/name)")
    return False


def _fetch_from_hub(repo_id: str, revision: str | None) -> tuple[Path, SourceInfo]:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError as exc:  # pragma: no cover - dependency is declared
        raise BadInput(f"{repo_id}: huggingface-hub is not installed ({exc})") from None
    try:
        small = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_SMALL_FILES))
        index = small / INDEX_NAME
        if index.exists():
            shards = _shard_names(index, read_json(index, "index"))
        else:
            shards = ["*.safetensors"]
        root = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_SMALL_FILES + shards))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadInput(f"{repo_id}: cannot fetch from the Hugging Face Hub or its local cache ({msg})") from None
    commit = root.name if root.parent.name == "snapshots" else None
    info = SourceInfo(path=str(root), repo_id=repo_id, revision=revision or "main")
    info.fingerprint = f"hf:{repo_id}@{commit}" if commit else ""
    return root, info


def _shard_names(index_path: Path, index: Any) -> list[str]:
    """The shard files an index's ``weight_map`` names, each a plain file name of its directory
    (BadInput naming the index otherwise: a name with a directory part, '..' or an absolute path
    would read a file outside the checkpoint)."""
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise BadInput(f"{index_path}: malformed index (no 'weight_map' object of tensor -> file)")
    return [plain_name(s, f"{index_path}: weight_map") for s in sorted(set(wm.values()))]


def _indexed_tensors(index_path: Path) -> tuple[dict[str, TensorInfo], list[Path]]:
    """The tensors of an indexed checkpoint, every shard header validated, and the index's
    ``weight_map`` checked against the shards both ways: each mapped tensor is in its shard, and
    each tensor of a shard is mapped to that shard (a tensor the map does not name would be dropped
    silently by every loader; one mapped elsewhere is a duplicate)."""
    root = index_path.parent
    index = read_json(index_path, "index")
    shard_files = [root / s for s in _shard_names(index_path, index)]
    wm = index["weight_map"]
    for f in shard_files:
        if not f.exists():
            raise BadInput(f"{index_path}: names shard {f.name!r}, which does not exist")
    headers = {f.name: read_header(f)[0] for f in shard_files}
    tensors: dict[str, TensorInfo] = {}
    for name, shard in wm.items():
        info = headers[shard].get(name)
        if info is None:
            raise BadInput(f"{index_path}: tensor {name!r} is mapped to {shard!r}, but that shard does not hold it")
        tensors[name] = info
    for shard, infos in headers.items():
        for name in infos:
            if wm.get(name) != shard:
                where = "the weight_map does not name it" if name not in wm else f"the weight_map maps it to {wm[name]!r}"
                raise BadInput(f"{root / shard}: tensor {name!r} is in this shard, but {where} ({index_path.name})")
    return tensors, shard_files


def open_checkpoint(source: str | Path, revision: str | None = None) -> Checkpoint:
    """Open and validate a checkpoint: config.json, index (or shard scan), every shard header."""
    root, sinfo = resolve_source(str(source), revision)
    if (root / IN_PROGRESS).exists() and not (root / MANIFEST_NAME).exists():
        raise BadInput(missing_manifest_message(root))  # an output being written, or an interrupted run
    config = read_json(root / CONFIG_NAME, "config.json")
    if not isinstance(config, dict):
        raise BadInput(f"{root / CONFIG_NAME}: malformed config.json (not a JSON object)")
    index_path = root / INDEX_NAME
    tensors: dict[str, TensorInfo] = {}
    if index_path.exists():
        tensors, shard_files = _indexed_tensors(index_path)
    else:
        shard_files = sorted(root.glob("*.safetensors"))
        if not shard_files:
            raise BadInput(f"{root}: no model.safetensors.index.json and no *.safetensors files")
        for f in shard_files:
            for name, info in read_header(f)[0].items():
                if name in tensors:
                    raise BadInput(f"{root}: tensor {name!r} appears in both {tensors[name].file.name} and {f.name}")
                tensors[name] = info
    manifest = None
    if (root / MANIFEST_NAME).exists():
        manifest = load_manifest(root)
    # copied into the output: regular files within a size bound only (a FIFO or a device is refused here)
    extra = [f for f in sorted(root.iterdir()) if _copied_along(f.name) and side_file_size(f) is not None]
    if not sinfo.fingerprint:
        sinfo.fingerprint = _fingerprint(root, shard_files + [root / CONFIG_NAME])
    return Checkpoint(
        root=root,
        config=config,
        tensors=tensors,
        shard_files=shard_files,
        source=sinfo,
        manifest=manifest,
        has_index=index_path.exists(),
        extra_files=extra,
    )
