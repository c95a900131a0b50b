"""Files in an output directory, written so that nothing outside OUTPUT is ever touched.

OUTPUT may hold entries mxconv did not make: a symbolic link named like a file mxconv writes
(``tokenizer.json`` linking into the Hugging Face cache, or anywhere), the marker as a link, a
leftover temporary file. mxconv never writes through them. Every file it writes is created new
(:func:`create_new`): whatever entry had the name is unlinked first (a link goes, its target is not
touched), and the file is opened with ``O_CREAT | O_EXCL | O_NOFOLLOW``, so an open never follows a
link or reuses a file something else made. Small files (config, index, manifest, marker, copied side
files) are written to a temporary name that way and renamed onto their final name
(:func:`write_new_file`); a rename replaces the entry itself, never a link's target. Shards follow
the same rule (:mod:`mxconv.output.writer`). docs/reliability.md ("Links inside OUTPUT") tells users.

:func:`write_new_file` returns what it wrote (:class:`FileRecord`: size and sha256), which the
manifest records, so that a later ``--overwrite`` deletes such a file only while it is still the one
mxconv wrote (:func:`is_recorded_file`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

from mxconv.errors import BadInput
from mxconv.source.json_files import dumps_strict
from mxconv.source.regular_files import NotRegular, open_regular, read_exactly
from mxconv.source.side_files import SIDE_FILE_LIMIT, open_side_file

TMP_SUFFIX = ".mxconv-tmp"
_CHUNK = 1 << 20


def no_follow(path: str | os.PathLike[str], flags: int) -> int:
    """``open(..., opener=no_follow)``: the open never follows a link (``O_NOFOLLOW``)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def clear_name(path: Path) -> None:
    """Unlink whatever non-directory entry has ``path``'s name (a link: the link itself)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def create_new(path: Path) -> IO[bytes]:
    """``path`` opened for writing as a new binary file that this process created: the entry that had
    the name is removed first, and the open refuses a link or an existing file (``O_EXCL``)."""
    clear_name(path)
    return open(path, "xb", opener=no_follow)


def tmp_name(path: Path) -> Path:
    """The temporary name ``path`` is written under before its rename: ``.NAME.mxconv-tmp``."""
    return path.with_name("." + path.name + TMP_SUFFIX)


@dataclass(frozen=True)
class FileRecord:
    """What mxconv wrote under a name: its size and sha256 (the manifest's ``output_file_hashes``)."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}


def write_new_file(path: Path, chunks: Iterable[bytes]) -> FileRecord:
    """Write ``chunks`` to ``path`` atomically: into a new temporary file (:func:`create_new`),
    fsync'd, then renamed onto ``path`` (replacing the entry, a link included). Returns its record."""
    tmp = tmp_name(path)
    h = hashlib.sha256()
    size = 0
    try:
        with create_new(tmp) as f:
            for chunk in chunks:
                f.write(chunk)
                h.update(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return FileRecord(size, h.hexdigest())


def atomic_write_text(path: Path, text: str) -> FileRecord:
    return write_new_file(path, [text.encode("utf-8")])


def atomic_write_json(path: Path, obj: Any) -> FileRecord:
    return atomic_write_text(path, dumps_strict(obj, indent=2, sort_keys=False) + "\n")  # never NaN / Infinity


def _read_unchanged(f: IO[bytes], size: int, src: Path) -> Iterator[bytes]:
    """``src``'s ``size`` bytes from ``f``; BadInput where it became shorter or grew while it was read."""
    yield from read_exactly(f, size, _CHUNK, f"{src}: became shorter while it was being copied into the output; "
                            "rerun once it is stable")
    if f.read(1):
        raise BadInput(f"{src}: grew while it was being copied into the output; rerun once it is stable")


def copy_side_file(src: Path, dst: Path) -> FileRecord:
    """Copy source side file ``src`` (a regular file within the size bound, links in the source
    followed: :func:`~mxconv.source.side_files.open_side_file`) to ``dst`` as a new file."""
    f, size = open_side_file(src)
    with f:
        return write_new_file(dst, _read_unchanged(f, size, src))


def is_recorded_file(path: Path, record: FileRecord) -> bool:
    """Whether ``path`` is still the file a manifest recorded: a regular file (not a link:
    :func:`~mxconv.source.regular_files.open_regular` without following) of the recorded size and
    sha256, no larger than a side file may be (so the check reads little)."""
    if record.size > SIDE_FILE_LIMIT:
        return False
    try:
        f, size = open_regular(path, follow=False)
    except (NotRegular, OSError):
        return False
    h = hashlib.sha256()
    left = record.size + 1  # a byte more than recorded: one that grew is not it
    try:
        with f:
            if size != record.size:
                return False
            while left and (chunk := f.read(min(left, _CHUNK))):
                h.update(chunk)
                left -= len(chunk)
    except OSError:
        return False
    return left == 1 and h.hexdigest() == record.sha256
