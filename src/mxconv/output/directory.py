"""The output directory's lifecycle: where a run writes and how the result becomes OUTPUT.

:class:`OutputTarget` decides where a run writes and how the result becomes OUTPUT: into OUTPUT
itself when it is new, empty or holds an interrupted run, or, for ``--overwrite`` of an existing
output, into a staging directory beside it that replaces the old output only once complete. A run
that fails or is interrupted (SIGINT/SIGTERM) removes everything it wrote. A run killed outright
(SIGKILL, power loss) leaves the shards finished so far, at most one temporary file per rank and the
``.mxconv-in-progress`` marker (or a ``*.mxconv-staging-<pid>`` directory), but never ``mxconv.json``
in OUTPUT: it never looks complete, and the next run cleans it up. docs/reliability.md tells users.

Also here: the checks before a run (:func:`check_output_dir`, :func:`check_free_space`), the
in-progress marker, :func:`writing` (an OSError reported as :class:`OutputWriteError` naming the
output file) and atomic writes of small files (:func:`atomic_write_json`). The shards themselves
are streamed by :mod:`mxconv.output.writer`.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from mxconv.source.file_names import IN_PROGRESS, INDEX_NAME, MANIFEST_NAME, RANK_DIR
from mxconv.source.in_progress import live_writer, marker_text, process_alive
from mxconv.errors import BadInput
from mxconv.interrupt import deferred_signals, next_step, output_complete
from mxconv.sizes import human_bytes

TMP_SUFFIX = ".mxconv-tmp"
STAGING = "mxconv-staging"  # OUT.mxconv-staging-<pid>: an --overwrite's new output, until the swap
ASIDE = "mxconv-old"  # OUT.mxconv-old-<pid>: the old output during the swap, deleted right after
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


_OUR_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
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
        if pid != os.getpid() and process_alive(pid):
            raise BadInput(f"OUTPUT {out} is being written by another mxconv run (pid {pid}, in {side}); wait for it or choose another directory")
    if not out.exists() or not any(out.iterdir()):
        return False
    interrupted = (out / IN_PROGRESS).exists() and not (out / MANIFEST_NAME).exists()
    if interrupted:
        pid = live_writer(out)
        if pid is not None:
            raise BadInput(f"OUTPUT {out} is being written by another mxconv run (pid {pid}); wait for it or choose another directory")
    if not overwrite and not interrupted:
        raise BadInput(f"OUTPUT {out} is not empty; set overwrite=True (RunSettings) to replace its contents",
                       cli=f"OUTPUT {out} is not empty; pass --overwrite to replace its contents")
    return interrupted


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
        if not RANK_DIR.fullmatch(name):
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
    (d / IN_PROGRESS).write_text(marker_text(os.getpid()))


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
    why = _not_writable(probe)
    if why is not None:  # before the free space: an unwritable place (/proc, a read-only mount) reads as 0 B free
        raise BadInput(f"{where}: cannot write there: {probe} is not writable ({why}); choose an OUTPUT in a writable directory")
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise BadInput(
            f"not enough free space for the output: it needs about {human_bytes(needed)} ({needed} bytes), "
            f"{human_bytes(free)} ({free} bytes) are free on the filesystem of {probe}{hint}; free "
            f"{human_bytes(needed - free)} or choose an OUTPUT on another disk"
        )


def _not_writable(directory: Path) -> str | None:
    """Why no file can be created in ``directory`` (the OS's words), or None when one can: a file is
    created and removed, so permissions, read-only mounts and pseudo filesystems all answer truly."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".mxconv-write-check-")
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(name)
    return None


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
        self._made_parents: list[Path] = []

    @property
    def staged(self) -> bool:
        return self.write_dir is not None and self.write_dir != self.out

    def prepare(self, needed_bytes: int) -> Path:
        """Make :attr:`write_dir` ready (see the class doc) for about ``needed_bytes``; returns it.
        A signal noted after an earlier output of this command was complete stops it here."""
        next_step()
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
        # the missing directories above OUTPUT, outermost first: abort() removes them again (empty)
        self._made_parents = [d for d in reversed(self.out.parents) if not d.exists()]
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
        """The output in :attr:`write_dir` is complete (manifest written): make it OUTPUT. From then
        on a signal stops nothing (:func:`mxconv.interrupt.output_complete`): the run has succeeded."""
        if not self.staged:
            self.committed = True
            output_complete()
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
            output_complete()  # a signal held during the swap is only noted when the block ends
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
                for d in reversed(self._made_parents):  # innermost first; a non-empty one stays
                    if d.is_dir() and not any(d.iterdir()):
                        d.rmdir()
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
