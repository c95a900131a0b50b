"""Streaming, atomic safetensors output.

The whole output is planned before a byte is written (names, dtypes, shapes, hence sizes), so each
shard's header is known up front. Tensors then stream into their shard in plan order; each shard is
written under a temporary name and renamed into place once complete and fsync'd; the index follows,
and the caller writes ``mxconv.json`` last.

:class:`OutputTarget` decides where a run writes and how the result becomes OUTPUT: into OUTPUT
itself when it is new, empty or holds an interrupted run, or, for ``--overwrite`` of an existing
output, into a staging directory beside it that replaces the old output only once complete. A run
that fails or is interrupted (SIGINT/SIGTERM) removes everything it wrote. A run killed outright
(SIGKILL, power loss) leaves the shards finished so far, at most one temporary file per rank and the
``.mxconv-in-progress`` marker (or a ``*.mxconv-staging-<pid>`` directory), but never ``mxconv.json``
in OUTPUT: it never looks complete, and the next run cleans it up. docs/reliability.md tells users.

Test hook: ``MXCONV_TEST_WRITE_DELAY=SECONDS`` makes the writer pause that long after every tensor
(cancellable), so that tests can interrupt a run mid-write at a predictable point.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import threading
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from mxconv.checkpoint import INDEX_NAME, MANIFEST_NAME
from mxconv.errors import BadInput
from mxconv.interrupt import deferred_signals
from mxconv.layouts.base import TensorSpec
from mxconv.st_format import TORCH_TO_ST, TensorInfo, expected_nbytes, iter_tensor_chunks

IN_PROGRESS = ".mxconv-in-progress"
TMP_SUFFIX = ".mxconv-tmp"
COPY_CHUNK = 64 * 1024 * 1024
STAGING = "mxconv-staging"  # OUT.mxconv-staging-<pid>: an --overwrite's new output, until the swap
ASIDE = "mxconv-old"  # OUT.mxconv-old-<pid>: the old output during the swap, deleted right after
WRITE_DELAY_ENV = "MXCONV_TEST_WRITE_DELAY"
DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # the errnos of a full disk or quota


class OutputWriteError(BadInput):
    """Writing the output failed (disk full, quota, I/O error): names the output file (exit 2)."""

    disk_full = False

    @classmethod
    def from_os_error(cls, exc: OSError, path: Path) -> "OutputWriteError":
        if exc.errno in DISK_FULL:
            err = cls(f"disk full ({exc.strerror or 'no space left on device'}) while writing {path}")
            err.disk_full = True
            return err
        return cls(f"cannot write {path}: {exc.strerror or exc}")


class WriteCancelled(Exception):
    """The writer was cancelled (the run is stopping); raised on the writer's thread."""


def human_bytes(n: float) -> str:
    """Bytes in the largest decimal unit that keeps a leading digit (as huggingface-cli shows them)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """'5GB' / '500MB' / '2GiB' / '1000000' -> bytes (decimal units as huggingface uses them);
    errors name ``flag``."""
    s = text.strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for u, mult in units.items():
        if s.endswith(u):
            num = s[: -len(u)]
            break
    else:
        num, mult = s, 1
    try:
        value = float(num)
    except ValueError:
        raise BadInput(f"{flag}: cannot parse {text!r} (use e.g. 5GB, 500MB, 2GiB)") from None
    if not math.isfinite(value) or value * mult < 1:
        raise BadInput(f"{flag} must be at least one byte, got {text!r}")
    return int(value * mult)


@dataclass
class PlannedTensor:
    """One output tensor: its name, spec, role and (for byte copies) the source it comes from."""

    name: str
    spec: TensorSpec
    role: str  # "expert" | "router" | "copy"
    source: TensorInfo | None = None  # set for tensors copied byte for byte

    @property
    def st_dtype(self) -> str:
        if self.source is not None:
            return self.source.dtype
        return TORCH_TO_ST[self.spec.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape if self.source is not None else self.spec.shape

    @property
    def nbytes(self) -> int:
        return expected_nbytes(self.st_dtype, self.shape)


@dataclass
class ShardPlan:
    file: str
    tensors: list[PlannedTensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(tensors: list[PlannedTensor], max_shard_size: int) -> list[ShardPlan]:
    """Greedy split in plan order; a tensor larger than the limit gets a shard of its own."""
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    return [ShardPlan(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def _header_bytes(shard: ShardPlan, metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    off = 0
    for t in shard.tensors:
        header[t.name] = {"dtype": t.st_dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def shards_size(shards: list[ShardPlan], metadata: dict[str, str] | None = None) -> int:
    """Bytes ``shards`` take on disk, headers included (as :class:`ShardedWriter` writes them)."""
    md = {"format": "pt"} if metadata is None else metadata
    return sum(len(_header_bytes(s, md)) + s.nbytes for s in shards)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's raw little-endian bytes (contiguous) as a memoryview."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


_OUR_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_OUR_RANK_DIR = re.compile(r"^rank-\d+$")
# Weight files of a checkpoint; loaders read model.safetensors in preference to an index, so one
# left behind by an old output would shadow the new shards: an overwrite never keeps either.
_WEIGHT_FILES = {INDEX_NAME, "model.safetensors"}
_SIDE_DIR = re.compile(rf"^(?P<base>.*)\.(?:{STAGING}|{ASIDE})-(?P<pid>\d+)$")


def _side_dirs(out: Path) -> list[tuple[Path, int]]:
    """Staging and set-aside directories of ``--overwrite`` runs into ``out`` (beside it as
    ``OUT.mxconv-staging-<pid>``, or inside it as ``.mxconv-staging-<pid>``), with their pids."""
    found = []
    for parent, base in ((out.parent, out.name), (out, "")):
        try:
            entries = list(parent.iterdir()) if parent.is_dir() else []
        except OSError:
            continue
        for p in entries:
            m = _SIDE_DIR.match(p.name)
            if m and m["base"] == base and p.is_dir():
                found.append((p, int(m["pid"])))
    return found


def check_output_dir(out: Path, sources: list[Path], overwrite: bool) -> bool:
    """Validate OUTPUT without touching it; returns True when it holds an interrupted mxconv run.

    OUTPUT must not be (or be inside, or contain) a SOURCE, must not be a file, must not be written
    by another live mxconv run (in place or staged beside it), and must be empty unless
    ``overwrite`` or it is an interrupted mxconv run (marker present, no manifest).
    """
    out = out.expanduser().resolve()
    for src in sources:
        src = src.resolve()
        if out == src or src in out.parents:
            raise BadInput(f"OUTPUT {out} is the SOURCE or inside it ({src}); choose another directory")
        if out in src.parents:
            raise BadInput(f"OUTPUT {out} contains the SOURCE ({src}); choose another directory")
    if out.exists() and not out.is_dir():
        raise BadInput(f"OUTPUT {out} exists and is not a directory")
    for side, pid in _side_dirs(out):
        if pid != os.getpid() and _alive(pid):
            raise BadInput(f"OUTPUT {out} is being written by another mxconv run (pid {pid}, in {side}); wait for it or choose another directory")
    if not out.exists() or not any(out.iterdir()):
        return False
    interrupted = (out / IN_PROGRESS).exists() and not (out / MANIFEST_NAME).exists()
    if interrupted:
        pid = _writer_pid(out / IN_PROGRESS)
        if pid is not None and pid != os.getpid() and _alive(pid):
            raise BadInput(f"OUTPUT {out} is being written by another mxconv run (pid {pid}); wait for it or choose another directory")
    if not overwrite and not interrupted:
        raise BadInput(f"OUTPUT {out} is not empty; pass --overwrite to replace its contents")
    return interrupted


def _writer_pid(marker: Path) -> int | None:
    m = re.search(r"\(pid (\d+)\)", marker.read_text(errors="replace"))
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _previous_outputs(out: Path) -> set[str]:
    """Top-level names a previous mxconv run wrote into ``out`` (from its manifest, if any)."""
    try:
        m = json.loads((out / MANIFEST_NAME).read_text())
        files = {str(t["file"]).split("/")[0] for t in m.get("tensors", {}).values()}
        return files | set(m.get("output_files", []))
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return set()


def _is_ours(p: Path, previous: set[str]) -> bool:
    """Whether entry ``p`` of OUTPUT belongs to an mxconv output, so that replacing the output
    removes it: what the old manifest lists, shards, index, ``model.safetensors``, temporary files,
    dead runs' staging directories, and ``rank-N`` directories holding a (possibly unfinished)
    checkpoint. Anything else (a README, a LoRA, ``rank-data``) is the user's and stays."""
    name = p.name
    if p.is_dir() and not p.is_symlink():
        if _SIDE_DIR.match(name) and name.startswith("."):
            return True
        if not _OUR_RANK_DIR.match(name):
            return False
        inner = [q.name for q in p.iterdir()]
        return name in previous or not inner or any(
            n in (INDEX_NAME, IN_PROGRESS) or n.endswith(TMP_SUFFIX) or _OUR_SHARD.match(n) for n in inner
        )
    return name in previous or name in _WEIGHT_FILES or name.endswith(TMP_SUFFIX) or bool(_OUR_SHARD.match(name))


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def _write_marker(d: Path) -> None:
    (d / IN_PROGRESS).write_text(
        f"an mxconv run (pid {os.getpid()}) is writing this directory; it is incomplete until mxconv.json exists\n"
    )


def prepare_output_dir(out: Path, sources: list[Path], overwrite: bool) -> list[str]:
    """Check OUTPUT (see :func:`check_output_dir`), clear what an earlier mxconv run wrote there, in
    place, and drop the in-progress marker. Files mxconv did not write are never deleted.
    (:class:`OutputTarget` uses this for a new OUTPUT or an interrupted run; an ``--overwrite`` of
    a finished output is staged beside it instead.)"""
    interrupted = check_output_dir(out, sources, overwrite)
    out = out.expanduser().resolve()
    notes: list[str] = []
    if out.exists() and any(out.iterdir()):
        notes.append(f"cleaning up an interrupted mxconv run in {out}" if interrupted else f"overwriting {out}")
        previous = _previous_outputs(out)
        # The manifest goes first so that a crash from here on never leaves a 'complete' look.
        (out / MANIFEST_NAME).unlink(missing_ok=True)
        for p in list(out.iterdir()):
            if p.name != IN_PROGRESS and _is_ours(p, previous):
                _remove(p)
    out.mkdir(parents=True, exist_ok=True)
    _write_marker(out)
    return notes


def check_free_space(where: Path, needed: int, hint: str = "") -> None:
    """Stop (exit 2) when the filesystem of ``where`` (or of its nearest existing parent) has less
    than ``needed`` bytes free, naming both numbers and the path."""
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise BadInput(
            f"not enough free space for the output: it needs about {human_bytes(needed)} ({needed} bytes), "
            f"{human_bytes(free)} ({free} bytes) are free on the filesystem of {probe}{hint}; free "
            f"{human_bytes(needed - free)} or choose an OUTPUT on another disk"
        )


@contextmanager
def writing(shown: Path, actual: Path | None = None) -> Iterator[None]:
    """Report an OSError of the block as :class:`OutputWriteError` naming the output file: the
    error's own file, moved from directory ``actual`` (a staging directory) to ``shown``, else ``shown``."""
    try:
        yield
    except OSError as exc:
        path = Path(exc.filename) if exc.filename else shown
        if actual is not None and exc.filename:
            path = shown / path.relative_to(actual) if path.is_relative_to(actual) else path
        raise OutputWriteError.from_os_error(exc, path) from exc


def _staging_dir(out: Path) -> Path:
    """``OUT.mxconv-staging-<pid>`` beside OUTPUT where its parent is writable and on OUTPUT's
    filesystem (the swap renames, which cannot cross filesystems), else ``OUT/.mxconv-staging-<pid>``."""
    try:
        if os.access(out.parent, os.W_OK) and out.parent.stat().st_dev == out.stat().st_dev:
            return out.parent / f"{out.name}.{STAGING}-{os.getpid()}"
    except OSError:
        pass
    return out / f".{STAGING}-{os.getpid()}"


class OutputTarget:
    """Where one run writes, and how what it wrote becomes OUTPUT.

    :meth:`prepare` checks OUTPUT (:func:`check_output_dir`), removes what dead runs left beside it,
    checks free space and picks :attr:`write_dir`: OUTPUT itself when it is new, empty or holds an
    interrupted run (cleaned up in place), or, for ``--overwrite`` of existing contents, a staging
    directory on the same filesystem, so that the old output stays whole until the new one is
    complete. :meth:`commit` (after the manifest is written) moves a staged output in: the old
    output's files go aside, the new ones in, the manifest last, the old files are deleted; signals
    are held meanwhile. :meth:`abort` removes what this run wrote and says what OUTPUT holds now.
    """

    def __init__(self, out: Path, sources: list[Path], overwrite: bool) -> None:
        self.out = out.expanduser().resolve()
        self.sources = sources
        self.overwrite = overwrite
        self.write_dir: Path | None = None
        self.notes: list[str] = []
        self.created = False  # OUTPUT did not exist before this run
        self.committed = False
        self._kept: frozenset[str] | None = None  # in place: entries that predate this run's writes

    @property
    def staged(self) -> bool:
        return self.write_dir is not None and self.write_dir != self.out

    def prepare(self, needed_bytes: int) -> Path:
        """Make :attr:`write_dir` ready (see the class doc) for about ``needed_bytes``; returns it."""
        interrupted = check_output_dir(self.out, self.sources, self.overwrite)
        for side, _pid in _side_dirs(self.out):  # a dead run's (check_output_dir refused live ones)
            with writing(side):
                _remove(side)
        if self.out.is_dir() and any(self.out.iterdir()) and not interrupted:
            staging = _staging_dir(self.out)
            check_free_space(staging.parent, needed_bytes, " (--overwrite keeps the old output until the new one is complete)")
            self.write_dir = staging  # before mkdir: from here on abort() removes it
            with writing(staging):
                staging.mkdir()
                _write_marker(staging)
            self.notes.append(f"overwriting {self.out}: writing the new output to {staging}; the old one is replaced only once it is complete")
            return staging
        self.created = not self.out.exists()
        if not interrupted:
            check_free_space(self.out, needed_bytes)
        with writing(self.out):
            self.notes += prepare_output_dir(self.out, self.sources, self.overwrite)
        self.write_dir = self.out
        self._kept = frozenset(p.name for p in self.out.iterdir()) - {IN_PROGRESS}
        if interrupted:  # counted once what the interrupted run left is gone
            check_free_space(self.out, needed_bytes)
        return self.out

    def commit(self) -> None:
        """The output in :attr:`write_dir` is complete (manifest written): make it OUTPUT."""
        if not self.staged:
            self.committed = True
            return
        out, new = self.out, self.write_dir
        assert new is not None
        pid = os.getpid()
        aside = out / f".{ASIDE}-{pid}" if new.parent == out else out.parent / f"{out.name}.{ASIDE}-{pid}"
        moves: list[tuple[Path, Path]] = []

        def move(src: Path, dst: Path) -> None:
            os.replace(src, dst)
            moves.append((src, dst))

        with deferred_signals(), writing(out):
            try:
                aside.mkdir()
                _write_marker(out)  # until the new manifest is in, OUTPUT reads as an interrupted run
                previous = _previous_outputs(out)
                incoming = sorted(p.name for p in new.iterdir() if p.name not in (MANIFEST_NAME, IN_PROGRESS))
                if (out / MANIFEST_NAME).exists():
                    move(out / MANIFEST_NAME, aside / MANIFEST_NAME)
                for p in sorted(out.iterdir()):
                    if p not in (new, aside) and p.name != IN_PROGRESS and (p.name in incoming or _is_ours(p, previous)):
                        move(p, aside / p.name)
                for name in incoming:
                    move(new / name, out / name)
                move(new / MANIFEST_NAME, out / MANIFEST_NAME)
            except BaseException:
                for src, dst in reversed(moves):  # put the old output back as it was
                    try:
                        os.replace(dst, src)
                    except OSError:
                        pass
                shutil.rmtree(aside, ignore_errors=True)
                (out / IN_PROGRESS).unlink(missing_ok=True)
                raise
            self.committed = True
            (out / IN_PROGRESS).unlink(missing_ok=True)
            shutil.rmtree(new, ignore_errors=True)
            shutil.rmtree(aside, ignore_errors=True)

    def abort(self) -> str:
        """Remove what this run wrote (best effort); returns what OUTPUT holds now, as a clause."""
        out = self.out
        if self.committed:
            return f"the conversion had finished: {out} holds the complete new output"
        if self.write_dir is None:
            return f"nothing was written to {out}"
        try:
            if self.staged:
                if self.write_dir.exists():
                    _remove(self.write_dir)
                return f"the unfinished new output was removed; {out} still holds the earlier output, unchanged"
            if self._kept is None:
                return f"{out} holds an unfinished output (no mxconv.json); rerunning the command cleans it up"
            for p in list(out.iterdir()) if out.is_dir() else []:
                if p.name not in self._kept:
                    _remove(p)
            if self.created and out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            return f"the unfinished output in {out} was removed"
        except OSError as exc:
            return f"could not remove everything this run wrote ({exc}); {out} has no mxconv.json, rerunning the command cleans it up"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + TMP_SUFFIX)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@dataclass
class WrittenTensor:
    file: str
    shape: list[int]
    dtype: str
    sha256: str
    role: str


@dataclass
class _Part:
    """A planned tensor begun and not yet complete: where its bytes go and its running sha256."""

    planned: PlannedTensor
    shard: int
    offset: int  # absolute file offset of the tensor's first byte
    hasher: Any  # hashlib sha256 over the bytes written so far
    done: int = 0


@dataclass
class ShardedWriter:
    """Writes a planned set of shards into ``out_dir``, tensor by tensor, in plan order.

    A tensor is written whole (:meth:`write_tensor`, :meth:`copy_tensor`) or in parts
    (:meth:`write_part`: consecutive runs of its dim-0 rows, e.g. one group of experts of an
    ``[E, ...]`` stack at a time under a memory budget). Tensors begin in plan order; a tensor begun
    in parts may be continued after later tensors have begun (each part goes to its own offset in
    the shard, whose header is planned up front), so several shards can be open at once. The
    sha256 of a tensor covers its bytes in order whatever the parts, so the output and its manifest
    are the same however it was cut. A shard is fsync'd and renamed into place once its last
    tensor is complete.

    Errors name the file under ``display_dir`` (the final OUTPUT, where ``out_dir`` is a staging
    directory). :meth:`cancel` (any thread) stops a write between chunks of at most ``COPY_CHUNK``.
    """

    out_dir: Path
    shards: list[ShardPlan]
    metadata: dict[str, str] = field(default_factory=lambda: {"format": "pt"})
    written: dict[str, WrittenTensor] = field(default_factory=dict)
    bytes_written: int = 0
    display_dir: Path | None = None

    def __post_init__(self) -> None:
        # sha256 runs on its own thread while the same bytes are being written (hashlib and file
        # writes both release the GIL), so hashing does not add to the write time.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxconv-sha256")
        # A finished shard is fsync'd and renamed into place on its own thread, so the writer goes
        # straight on with the next shard instead of waiting for the disk to flush this one.
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxconv-fsync")
        self._synced: list[Future] = []
        self._queue = [(si, t) for si, s in enumerate(self.shards) for t in s.tensors]
        self._pos = 0  # tensors begun
        self._files: dict[int, Any] = {}  # open shard files (temporary names)
        self._fpos: dict[int, int] = {}  # each open file's position (a seek only where a part jumps)
        self._left: dict[int, int] = {}  # tensors of an open shard not yet complete
        self._offsets: dict[str, int] = {}  # absolute offsets of the tensors of opened shards
        self._shard_of: dict[str, int] = {}
        self._parts: dict[str, _Part] = {}
        self._last_shard = -1  # the shard written to last (named by errors)
        self._cancelled = threading.Event()
        self._open_at_abort: Path | None = None
        self._delay = float(os.environ.get(WRITE_DELAY_ENV) or 0)  # test hook (module doc)

    def _tmp(self, shard: ShardPlan) -> Path:
        return self.out_dir / f".{shard.file}{TMP_SUFFIX}"

    def _shown(self, shard: ShardPlan) -> Path:
        return (self.display_dir or self.out_dir) / shard.file

    def current_file(self) -> Path | None:
        """The output file (final name) of the shard being written (or that was, when aborted)."""
        if self._files and self._last_shard in self._files:
            return self._shown(self.shards[self._last_shard])
        return self._open_at_abort

    def cancel(self) -> None:
        """Make the write in progress (and any later one) raise :class:`WriteCancelled`."""
        self._cancelled.set()

    def _write_at(self, si: int, offset: int, chunk: memoryview | bytes) -> None:
        if self._cancelled.is_set():
            raise WriteCancelled()
        f = self._files[si]
        self._last_shard = si
        try:
            if self._fpos[si] != offset:
                f.seek(offset)
            f.write(chunk)
        except OSError as exc:
            raise OutputWriteError.from_os_error(exc, self._shown(self.shards[si])) from exc
        self._fpos[si] = offset + len(chunk)

    def _open_shard(self, si: int) -> None:
        for fut in self._synced:  # an earlier shard's failed fsync/rename stops the run here already
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
        shard = self.shards[si]
        try:
            self._files[si] = open(self._tmp(shard), "wb")
        except OSError as exc:
            raise OutputWriteError.from_os_error(exc, self._shown(shard)) from exc
        self._fpos[si] = 0
        self._left[si] = len(shard.tensors)
        header = _header_bytes(shard, self.metadata)
        off = len(header)
        for t in shard.tensors:
            self._offsets[t.name] = off
            off += t.nbytes
        self._write_at(si, 0, header)

    def _finish_shard(self, si: int) -> None:
        shard = self.shards[si]
        f = self._files.pop(si)
        del self._fpos[si], self._left[si]
        try:
            f.flush()  # here, so that a full disk stops the writer now
        except OSError as exc:
            self._files[si] = f  # abort() closes and deletes it
            raise OutputWriteError.from_os_error(exc, self._shown(shard)) from exc

        def sync_and_rename() -> None:
            try:
                try:
                    os.fsync(f.fileno())
                finally:
                    f.close()
                os.replace(self._tmp(shard), self.out_dir / shard.file)  # only once complete and durable
            except OSError as exc:
                raise OutputWriteError.from_os_error(exc, self._shown(shard)) from exc

        self._synced.append(self._syncer.submit(sync_and_rename))

    def _begin(self, name: str) -> PlannedTensor:
        """Begin the next planned tensor, which must be ``name`` (opening its shard)."""
        if self._pos >= len(self._queue):
            raise RuntimeError(f"writer: unexpected tensor {name!r} after the plan ended")
        si, planned = self._queue[self._pos]
        if planned.name != name:
            raise RuntimeError(f"writer: got tensor {name!r}, plan expects {planned.name!r}")
        if si not in self._files:
            self._open_shard(si)
        self._shard_of[name] = si
        self._pos += 1
        return planned

    def _end(self, planned: PlannedTensor, digest: str) -> None:
        si = self._shard_of[planned.name]
        self.written[planned.name] = WrittenTensor(
            self.shards[si].file, list(planned.shape), planned.st_dtype, digest, planned.role
        )
        self._left[si] -= 1
        if self._left[si] == 0:
            self._finish_shard(si)
        if self._delay and self._cancelled.wait(self._delay):
            raise WriteCancelled()

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (CPU or CUDA) as the next planned tensor ``name``, whole."""
        planned = self._queue[self._pos][1] if self._pos < len(self._queue) else None
        if planned is not None and planned.name == name and (
            tensor.dtype != planned.spec.dtype or tuple(tensor.shape) != tuple(planned.spec.shape)
        ):
            raise RuntimeError(
                f"writer: {name} is {tensor.dtype}{list(tensor.shape)}, plan says "
                f"{planned.spec.dtype}{list(planned.spec.shape)}"
            )
        if name in self._parts:
            raise RuntimeError(f"writer: {name} was begun in parts, got it whole")
        self.write_part(name, tensor)

    def write_part(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``, the next run of dim-0 rows of planned tensor ``name`` (its first part
        begins it, in plan order; the tensor is complete when all its bytes are in)."""
        part = self._parts.get(name)
        if part is None:
            if name in self.written and tensor.numel() == 0:
                return  # an empty tensor, complete since its first (empty) part
            planned = self._begin(name)
            si = self._shard_of[name]
            part = self._parts[name] = _Part(planned, si, self._offsets[name], hashlib.sha256())
        planned = part.planned
        if tensor.dtype != planned.spec.dtype or tuple(tensor.shape[1:]) != tuple(planned.spec.shape[1:]):
            raise RuntimeError(
                f"writer: part of {name} is {tensor.dtype}{list(tensor.shape)}, plan says "
                f"{planned.spec.dtype}{list(planned.spec.shape)} (parts are runs of dim-0 rows)"
            )
        data = tensor_bytes(tensor)
        if part.done + len(data) > planned.nbytes:
            raise RuntimeError(f"writer: {name} gets {part.done + len(data)} bytes, plan says {planned.nbytes}")
        _stream([(self, part.shard, part.offset + part.done)], part.hasher,
                (data[i : i + COPY_CHUNK] for i in range(0, len(data), COPY_CHUNK)))
        part.done += len(data)
        self.bytes_written += len(data)
        if part.done == planned.nbytes:
            del self._parts[name]
            self._end(planned, part.hasher.hexdigest())

    def copy_tensor(self, name: str) -> int:
        """Copy the next planned tensor byte for byte from its source file; returns bytes copied."""
        return copy_tensor_to([self], name)

    def finish(self) -> dict[str, WrittenTensor]:
        """Check every planned tensor was written, then write the index. Returns the tensor table."""
        self._hasher.shutdown(wait=True)
        self._syncer.shutdown(wait=True)
        for fut in self._synced:
            fut.result()  # re-raise a failed fsync/rename (e.g. disk full) before the index is written
        if self._pos != len(self._queue):
            raise RuntimeError(f"writer: {len(self._queue) - self._pos} planned tensors were never written")
        if self._parts:
            name, part = next(iter(self._parts.items()))
            raise RuntimeError(
                f"writer: {len(self._parts)} tensors were written in part only, e.g. {name} "
                f"({part.done} of {part.planned.nbytes} bytes)"
            )
        # in plan order (tensors written in parts complete out of it): same index and table however cut
        self.written = {t.name: self.written[t.name] for _, t in self._queue}
        weight_map = {name: w.file for name, w in self.written.items()}
        total = sum(s.nbytes for s in self.shards)
        with writing(self.display_dir or self.out_dir, self.out_dir):
            atomic_write_json(self.out_dir / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        return self.written

    def abort(self) -> None:
        """Stop the helper threads, close and delete the temporary files of the shards in progress
        (best effort; safe to call twice). Finished shards stay: the caller's OutputTarget removes them."""
        self._cancelled.set()
        self._hasher.shutdown(wait=True, cancel_futures=True)  # at most one chunk being hashed
        self._syncer.shutdown(wait=True)
        if self._files:
            self._open_at_abort = self.current_file() or self._shown(self.shards[min(self._files)])
        for si, f in list(self._files.items()):
            try:
                f.close()
            except OSError:
                pass
            finally:
                self._tmp(self.shards[si]).unlink(missing_ok=True)
                del self._files[si]


Target = tuple[ShardedWriter, int, int]  # (writer, shard, absolute file offset of the first byte)


def _stream(targets: list[Target], h: Any, chunks: Iterable[memoryview | bytes]) -> int:
    """Write ``chunks`` at consecutive offsets of every target (one per TP rank), updating sha256
    ``h`` with each chunk on the first writer's hashing thread while the chunk is being written;
    returns the bytes written per target."""
    hasher = targets[0][0]._hasher
    pending: Future | None = None
    pos = 0
    try:
        for chunk in chunks:
            if pending is not None:
                pending.result()
            pending = hasher.submit(h.update, chunk)
            for w, si, off in targets:
                w._write_at(si, off + pos, chunk)
            pos += len(chunk)
    finally:
        if pending is not None:
            pending.result()
    return pos


def copy_tensor_to(writers: list[ShardedWriter], name: str) -> int:
    """Copy planned tensor ``name`` byte for byte into every writer (one per TP rank), reading and
    hashing its source once; returns the bytes read."""
    planned = [w._begin(name) for w in writers]
    src = planned[0].source
    assert src is not None
    h = hashlib.sha256()
    _stream([(w, w._shard_of[name], w._offsets[name]) for w in writers], h, iter_tensor_chunks(src, COPY_CHUNK))
    digest = h.hexdigest()
    for w, p in zip(writers, planned):
        w.bytes_written += src.nbytes
        w._end(p, digest)
    return src.nbytes
