"""Which entries of an output directory mxconv wrote, and so may remove when it replaces the output.

Cleaning up an interrupted run and the swap of ``--overwrite`` remove only these (:meth:`OldOutput.owns`,
:func:`is_ours`):

* always: temporary ``*.mxconv-tmp`` files and the hidden staging directories of dead runs;
* **an interrupted run** (the marker, no ``mxconv.json``: nothing says what it wrote), by name, what
  every mxconv output has and what would make a loader misread the new one:
  ``model-NNNNN-of-NNNNN.safetensors`` shards, ``model.safetensors`` (loaders read it before an
  index), the index, and inside ``rank-N`` directories the same names and ``config.json``;
* **a complete output**, only what its manifest says that run wrote: the weight files it lists (the
  shards its ``tensors`` name, the index in ``output_files``; older manifests record no hash for
  them) and the other files it wrote (config, tokenizer and other side files, in ``rank-N``
  directories too) while each is still the file that manifest recorded, a regular file of the
  recorded size and sha256 (``output_file_hashes``). A name the old manifest lists without a record
  (manifests written before the records, or edited), or whose file has changed since, is the user's
  and stays; so does every weight-named file it does not list (:func:`kept_weight_files` warns).

A ``rank-N`` directory is never removed with what is inside it: its files mxconv wrote go one by one
(:func:`remove_ours`) and the directory only once it is empty. Anything else (a README, notes, a LoRA
adapter, ``rank-data/``) is the user's and stays; the swap replaces an entry only where the new output
writes one of the same name, and puts the user's files of a replaced rank directory into the new one.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxconv.errors import BadInput
from mxconv.output.files import TMP_SUFFIX, FileRecord, is_recorded_file
from mxconv.source.file_names import (CONFIG_NAME, IN_PROGRESS, INDEX_NAME, LOCK_NAME, MANIFEST_NAME, RANK_DIR, WEIGHT_FILE,
                                     is_plain_name)
from mxconv.source.json_files import loads_strict, read_bounded

STAGING = "mxconv-staging"  # OUT.mxconv-staging-<pid>: an --overwrite's new output, until the swap
ASIDE = "mxconv-old"  # OUT.mxconv-old-<pid>: the old output during the swap, deleted right after
OUR_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# What an interrupted run may have left under these names is removed by name (model.safetensors
# would shadow the new shards: loaders read it in preference to an index).
_WEIGHT_FILES = {INDEX_NAME, "model.safetensors"}
_RANK_FILES = {CONFIG_NAME, IN_PROGRESS}  # and, inside a rank-N directory of an interrupted run, these
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
    neither), too large, or not strict JSON (the rules every reader applies). Whatever it says only
    narrows what is removed: where it says nothing, nothing but temporary files is."""
    path = out / MANIFEST_NAME
    try:
        m = loads_strict(read_bounded(path, "the manifest", follow=False), str(path), "malformed manifest")
    except (BadInput, OSError):
        return None
    return m if isinstance(m, dict) else None


def _rel_path(value: Any) -> str | None:
    """``value`` when it is a path of the output (one or two plain names, joined by '/'), else None."""
    ok = isinstance(value, str) and 0 < len(value.split("/")) <= 2 and all(is_plain_name(n) for n in value.split("/"))
    return value if ok else None


def _is_weight_name(name: str) -> bool:
    return name == INDEX_NAME or WEIGHT_FILE.search(name) is not None


@dataclass
class OldOutput:
    """What is known of the output in a directory before it is replaced: whether it is an
    interrupted run's (:attr:`interrupted`: cleaned up by name), and what its manifest says it wrote:
    the paths it lists (``output_files``, the tensors' files), the top-level names among them, and,
    for the files it recorded, size and sha256, by path."""

    interrupted: bool = False
    paths: set[str] = field(default_factory=set)
    records: dict[str, FileRecord] = field(default_factory=dict)

    @property
    def listed(self) -> set[str]:
        return {p.split("/")[0] for p in self.paths}

    @classmethod
    def read(cls, out: Path) -> OldOutput:
        old = cls(interrupted=os.path.lexists(out / IN_PROGRESS) and not os.path.lexists(out / MANIFEST_NAME))
        m = _read_manifest(out)
        if m is None:
            return old
        tensors, files, hashes = m.get("tensors"), m.get("output_files"), m.get("output_file_hashes")
        named = [e.get("file") for e in tensors.values() if isinstance(e, dict)] if isinstance(tensors, dict) else []
        named += files if isinstance(files, list) else []
        old.paths.update(p for p in map(_rel_path, named) if p is not None)
        for name, rec in hashes.items() if isinstance(hashes, dict) else []:
            size, sha = (rec.get("size"), rec.get("sha256")) if isinstance(rec, dict) else (None, None)
            if _rel_path(name) and type(size) is int and size >= 0 and isinstance(sha, str):
                old.records[name] = FileRecord(size, sha)
        return old

    def owns(self, rel: str, p: Path) -> bool:
        """Whether file (or link) ``p``, at path ``rel`` in the output, is one mxconv wrote (the module
        docstring's rules)."""
        name = p.name
        if name.endswith(TMP_SUFFIX):
            return True
        if self.interrupted and (name in _WEIGHT_FILES or OUR_SHARD.match(name) or ("/" in rel and name in _RANK_FILES)):
            return True
        if rel in self.paths and _is_weight_name(name):
            return True
        record = self.records.get(rel)
        return record is not None and is_recorded_file(p, record)


def is_ours(p: Path, old: OldOutput) -> bool:
    """Whether entry ``p`` of OUTPUT belongs to an mxconv output (see the module docstring), so that
    replacing the output removes it; for a ``rank-N`` directory, that its files mxconv wrote go
    (:func:`remove_ours`)."""
    name = p.name
    if name in RUN_FILES:
        return False
    if p.is_dir() and not p.is_symlink():
        if SIDE_DIR.match(name) and name.startswith("."):
            return True
        return RANK_DIR.fullmatch(name) is not None and (old.interrupted or name in old.listed)
    return old.owns(name, p)


def remove(p: Path) -> None:
    """Remove entry ``p`` that mxconv made whole (a staging directory, this run's own files): a
    directory with what is inside it (links inside are removed, never followed), anything else (a
    link included) by unlinking it."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def remove_ours(p: Path, old: OldOutput) -> list[str]:
    """Remove entry ``p`` of OUTPUT, one :func:`is_ours` says mxconv wrote: a file or link by
    unlinking it, a hidden staging directory whole, a ``rank-N`` directory file by file (only the
    files mxconv wrote, :meth:`OldOutput.owns`), then the directory itself where that leaves it empty.
    Returns the paths it keeps (``rank-0/notes.txt``)."""
    if not (p.is_dir() and not p.is_symlink()) or SIDE_DIR.match(p.name):
        remove(p)
        return []
    kept = []
    for q in sorted(p.iterdir()):
        rel = f"{p.name}/{q.name}"
        if not (q.is_dir() and not q.is_symlink()) and old.owns(rel, q):
            q.unlink(missing_ok=True)
        else:
            kept.append(rel)
    if not kept:
        p.rmdir()
    return kept


def is_rank_dir(p: Path) -> bool:
    """Whether ``p`` is a ``rank-N`` directory (not a link to one)."""
    return RANK_DIR.fullmatch(p.name) is not None and p.is_dir() and not p.is_symlink()


def clear_replaced_dir(old_dir: Path, new_dir: Path, old: OldOutput) -> list[str]:
    """After the swap, empty ``old_dir``: an old ``rank-N`` directory set aside because the new output
    has ``new_dir`` under its name. What mxconv wrote goes (:func:`remove_ours`); the user's files move
    into ``new_dir`` where it has no entry of their name (one it has replaces them, as at the top).
    Returns the paths moved (``rank-0/notes.txt``)."""
    moved = []
    for rel in remove_ours(old_dir, old):
        name = rel.split("/", 1)[1]
        if not os.path.lexists(new_dir / name):
            os.replace(old_dir / name, new_dir / name)
            moved.append(rel)
    return moved


def kept_inside_note(out: Path, kept: list[str]) -> list[str]:
    """The note naming files mxconv did not write that stay in a ``rank-N`` directory of ``out``."""
    if not kept:
        return []
    return [f"note: kept {', '.join(sorted(kept))} in {out}: mxconv did not write {'them' if len(kept) > 1 else 'it'}, "
            "so the directory that holds it stays; delete what is not yours"]


def kept_listed_note(out: Path, old: OldOutput, replaced: frozenset[str] = frozenset()) -> list[str]:
    """A note naming what the old manifest lists that stays (not the file it recorded there; a rank
    directory that stays has its own note, :func:`~mxconv.output.ownership.kept_inside_note`)."""
    kept = sorted(n for n in old.listed - replaced - set(RUN_FILES) if os.path.lexists(out / n) and not is_rank_dir(out / n))
    if not kept:
        return []
    return [f"note: kept {', '.join(kept)} in {out}: the earlier {MANIFEST_NAME} lists them, but they are not the "
            "files mxconv wrote there (changed since, or that manifest records no size and sha256 for them); "
            "delete them yourself if they are not yours"]


def clear_old_rank_dirs(out: Path, aside: Path, in_place: list[Path], old: OldOutput) -> list[str]:
    """After a swap: remove what mxconv wrote of the old output's rank directories, keeping the user's
    files (:func:`~mxconv.output.ownership.remove_ours`; those of a directory the new output replaced
    move into the new one), so that deleting ``aside`` deletes only what mxconv wrote or the new
    output replaced. Returns the notes to show. The new output is complete: a failure here is a note."""
    kept: list[str] = []
    try:
        for p in in_place:
            kept += remove_ours(p, old)
        for p in sorted(aside.iterdir()):
            if is_rank_dir(p):
                kept += clear_replaced_dir(p, out / p.name, old)
    except OSError as exc:
        return [f"note: could not remove all of the earlier output's files ({exc}); the new output in {out} is complete"]
    return kept_inside_note(out, kept)


def kept_weight_files(out: Path) -> list[str]:
    """Files that replacing the output in ``out`` keeps (mxconv did not write them) and that
    ``verify`` of the new output will count as weight files its index does not name (their names
    end in .safetensors, .bin, .pt, .pth or .gguf): the run says so before it starts."""
    if not out.is_dir():
        return []
    old = OldOutput.read(out)
    return sorted(p.name for p in entries(out) if WEIGHT_FILE.search(p.name) and p.is_file() and not is_ours(p, old))
