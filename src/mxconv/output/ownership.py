"""Which entries of an output directory mxconv wrote, and so may remove when it replaces the output.

Cleaning up an interrupted run and the swap of ``--overwrite`` remove only these (:func:`is_ours`):

* by name, what every mxconv output has and what would make a loader misread the new one:
  ``model-NNNNN-of-NNNNN.safetensors`` shards, ``model.safetensors`` (loaders read it before an index),
  the index, temporary ``*.mxconv-tmp`` files, the hidden staging directories of dead runs, and
  ``rank-N`` directories that hold a (possibly unfinished) checkpoint;
* by content, the other files an earlier run wrote (config, tokenizer and other side files): only
  while the file is still the one that run's manifest recorded, a regular file of the recorded size
  and sha256 (``output_file_hashes``, :class:`OldOutput`). A name the old manifest lists without a
  record (manifests written before the records, or edited), or whose file has changed since, is the
  user's and stays.

Anything else (a README, notes, a LoRA adapter, ``rank-data/``) is the user's and stays; the swap
replaces an entry only where the new output writes a file of the same name. :func:`kept_weight_files`
says in advance which kept files ``verify`` will count as stray weight files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxconv.output.files import TMP_SUFFIX, FileRecord, is_recorded_file
from mxconv.source.file_names import IN_PROGRESS, INDEX_NAME, LOCK_NAME, MANIFEST_NAME, RANK_DIR, WEIGHT_FILE
from mxconv.source.side_files import SIDE_FILE_LIMIT

STAGING = "mxconv-staging"  # OUT.mxconv-staging-<pid>: an --overwrite's new output, until the swap
ASIDE = "mxconv-old"  # OUT.mxconv-old-<pid>: the old output during the swap, deleted right after
OUR_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# Weight files of a checkpoint; loaders read model.safetensors in preference to an index, so one
# left behind by an old output would shadow the new shards: an overwrite never keeps either.
_WEIGHT_FILES = {INDEX_NAME, "model.safetensors"}
SIDE_DIR = re.compile(rf"^(?P<base>.*)\.(?:{STAGING}|{ASIDE})-(?P<pid>\d+)$")
RUN_FILES = (IN_PROGRESS, LOCK_NAME)  # the running writer's own: never moved, kept or counted as content


def entries(out: Path) -> list[Path]:
    """What ``out`` holds, but the lock file (which only says who writes it)."""
    return [p for p in out.iterdir() if p.name != LOCK_NAME]


def side_dirs(out: Path) -> list[tuple[Path, int]]:
    """Staging and set-aside directories of ``--overwrite`` runs into ``out`` (beside it as
    ``OUT.mxconv-staging-<pid>``, or inside it as ``.mxconv-staging-<pid>``), with their pids."""
    found = []
    for parent, base in ((out.parent, out.name), (out, "")):
        try:
            found_here = list(parent.iterdir()) if parent.is_dir() else []
        except OSError:
            continue
        for p in found_here:
            m = SIDE_DIR.match(p.name)
            if m and m["base"] == base and p.is_dir():
                found.append((p, int(m["pid"])))
    return found


def _read_manifest(out: Path) -> dict[str, Any] | None:
    """The old manifest as a JSON object, or None: missing, a link or no regular file (mxconv writes
    neither), too large, or not JSON. Whatever it says only narrows what is removed."""
    try:
        fd = os.open(out / MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > SIDE_FILE_LIMIT:
                return None
            m = json.loads(f.read(SIDE_FILE_LIMIT + 1))
    except (OSError, ValueError, RecursionError):
        return None
    return m if isinstance(m, dict) else None


def _top_name(value: Any) -> str | None:
    return value.split("/")[0] if isinstance(value, str) and value.split("/")[0] not in ("", ".", "..") else None


@dataclass
class OldOutput:
    """What the manifest of the output in a directory says it wrote there: the top-level names it
    lists (``output_files``, the tensors' files) and, for the files it recorded, size and sha256."""

    listed: set[str] = field(default_factory=set)
    records: dict[str, FileRecord] = field(default_factory=dict)

    @classmethod
    def read(cls, out: Path) -> OldOutput:
        m = _read_manifest(out)
        if m is None:
            return cls()
        old = cls()
        tensors = m.get("tensors")
        files = m.get("output_files")
        for entry in tensors.values() if isinstance(tensors, dict) else []:
            name = _top_name(entry.get("file")) if isinstance(entry, dict) else None
            if name is not None:
                old.listed.add(name)
        old.listed.update(n for n in map(_top_name, files if isinstance(files, list) else []) if n is not None)
        hashes = m.get("output_file_hashes")
        for name, rec in hashes.items() if isinstance(hashes, dict) else []:
            size, sha = (rec.get("size"), rec.get("sha256")) if isinstance(rec, dict) else (None, None)
            if "/" not in name and type(size) is int and size >= 0 and isinstance(sha, str):
                old.records[name] = FileRecord(size, sha)
        return old


def is_ours(p: Path, old: OldOutput) -> bool:
    """Whether entry ``p`` of OUTPUT belongs to an mxconv output (see the module docstring), so that
    replacing the output removes it."""
    name = p.name
    if name in RUN_FILES:
        return False
    if p.is_dir() and not p.is_symlink():
        if SIDE_DIR.match(name) and name.startswith("."):
            return True
        if not RANK_DIR.fullmatch(name):
            return False
        inner = [q.name for q in p.iterdir()]
        return not inner or any(
            n in (INDEX_NAME, IN_PROGRESS) or n.endswith(TMP_SUFFIX) or OUR_SHARD.match(n) for n in inner
        )
    if name in _WEIGHT_FILES or name.endswith(TMP_SUFFIX) or OUR_SHARD.match(name):
        return True
    record = old.records.get(name)
    return record is not None and is_recorded_file(p, record)


def remove(p: Path) -> None:
    """Remove entry ``p``: a directory with what is inside it (links inside are removed, never
    followed), anything else (a link included) by unlinking it."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def kept_weight_files(out: Path) -> list[str]:
    """Files that replacing the output in ``out`` keeps (mxconv did not write them) and that
    ``verify`` of the new output will count as weight files its index does not name (their names
    end in .safetensors, .bin, .pt, .pth or .gguf): the run says so before it starts."""
    if not out.is_dir():
        return []
    old = OldOutput.read(out)
    return sorted(p.name for p in entries(out) if WEIGHT_FILE.search(p.name) and p.is_file() and not is_ours(p, old))
