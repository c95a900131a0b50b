"""The output directory's lifecycle: where a run writes and how the result becomes OUTPUT.

:class:`OutputTarget` decides where a run writes and how the result becomes OUTPUT: into OUTPUT
itself when it is new, empty or holds an interrupted run, or, for ``--overwrite`` of an existing
output, into a staging directory beside it that replaces the old output only once complete. A run
that fails or is interrupted (SIGINT/SIGTERM) removes everything it wrote. A run killed outright
(SIGKILL, power loss) leaves the shards finished so far, at most one temporary file per rank and the
``.mxconv-in-progress`` marker (or a ``*.mxconv-staging-<pid>`` directory), but never ``mxconv.json``
in OUTPUT: it never looks complete, and the next run cleans it up. docs/reliability.md tells users.

A run holds OUTPUT's lock (:mod:`mxconv.output.lock`) from before its checks to the end, removes
only what an mxconv output owns (:mod:`mxconv.output.ownership`) and writes every file new, never
through a link (:mod:`mxconv.output.files`).

Also here: the checks before a run (:func:`check_output_dir`, :func:`check_free_space`), the
in-progress marker and :func:`writing` (an OSError reported as :class:`OutputWriteError` naming the
output file). The shards themselves are streamed by :mod:`mxconv.output.writer`.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mxconv.errors import BadInput
from mxconv.interrupt import deferred_signals, next_step, output_complete
from mxconv.output.files import TMP_SUFFIX, atomic_write_text
from mxconv.output.lock import OutputLock
from mxconv.output.ownership import (ASIDE, RUN_FILES, STAGING, OldOutput, clear_old_rank_dirs, entries, is_ours,
                                     is_rank_dir, kept_inside_note, kept_listed_note, kept_weight_files, remove,
                                     remove_ours, side_dirs)
from mxconv.sizes import human_bytes
from mxconv.source.file_names import IN_PROGRESS, MANIFEST_NAME
from mxconv.source.in_progress import live_writer, marker_text, process_alive

__all__ = ["ASIDE", "STAGING", "TMP_SUFFIX", "OutputTarget", "OutputWriteError", "check_free_space", "check_output_dir",
           "kept_weight_files", "prepare_output_dir", "writing"]
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


def check_output_dir(out: Path, sources: list[Path], overwrite: bool) -> bool:
    """Validate OUTPUT without touching it; returns True when it holds an interrupted mxconv run.

    OUTPUT must not be (or be inside, or contain) a SOURCE, must not be a file, must not be written
    by another live mxconv run (in place or staged beside it), and must be empty unless
    ``overwrite`` or it is an interrupted mxconv run (marker present, no manifest). Made without
    the lock this answers for now only; :class:`OutputTarget` asks again holding it.
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
    for side, pid in side_dirs(out):
        if pid != os.getpid() and process_alive(pid):
            raise BadInput(f"OUTPUT {out} is being written by another mxconv run (pid {pid}, in {side}); wait for it or choose another directory")
    if not out.exists() or not entries(out):
        return False
    interrupted = os.path.lexists(out / IN_PROGRESS) and not os.path.lexists(out / MANIFEST_NAME)
    if interrupted:
        pid = live_writer(out)
        if pid is not None:
            raise BadInput(f"OUTPUT {out} is being written by another mxconv run (pid {pid}); wait for it or choose another directory")
    if not overwrite and not interrupted:
        raise BadInput(f"OUTPUT {out} is not empty; set RunSettings.overwrite to replace its contents")
    return interrupted


def _write_marker(d: Path) -> None:
    atomic_write_text(d / IN_PROGRESS, marker_text(os.getpid()))


def _clear_in_place(out: Path, interrupted: bool) -> list[str]:
    """Remove what an earlier mxconv run wrote into ``out`` (see :mod:`mxconv.output.ownership`);
    returns the notes to show."""
    if not out.exists() or not entries(out):
        return []
    notes = [f"cleaning up an interrupted mxconv run in {out}" if interrupted else f"overwriting {out}"]
    old = OldOutput.read(out)
    # The manifest goes first so that a crash from here on never leaves a 'complete' look.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    kept_inside: list[str] = []
    for p in entries(out):
        if is_ours(p, old):
            kept_inside += remove_ours(p, old)
    notes += kept_listed_note(out, old) + kept_inside_note(out, kept_inside)
    return notes


def prepare_output_dir(out: Path, sources: list[Path], overwrite: bool) -> list[str]:
    """Check OUTPUT (see :func:`check_output_dir`), clear what an earlier mxconv run wrote there, in
    place, and drop the in-progress marker. Files mxconv did not write are never deleted.
    (:class:`OutputTarget` does this, holding the output's lock, for a new OUTPUT or an interrupted
    run; an ``--overwrite`` of a finished output is staged beside it instead.)"""
    interrupted = check_output_dir(out, sources, overwrite)
    out = out.expanduser().resolve()
    notes = _clear_in_place(out, interrupted)
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

    :meth:`prepare` checks OUTPUT (:func:`check_output_dir`), takes its lock
    (:class:`~mxconv.output.lock.OutputLock`: one writer per OUTPUT) and checks again holding it,
    removes what dead runs left beside it, checks free space and picks :attr:`write_dir`: OUTPUT itself
    when it is new, empty or holds an interrupted run (cleaned up in place), or, for ``--overwrite``
    of existing contents, a staging directory on the same filesystem, so that the old output stays
    whole until the new one is complete. :meth:`commit` (after the manifest is written) moves a
    staged output in: the old output's files go aside, the new ones in, the manifest last, the old
    files are deleted; signals are held meanwhile. :meth:`abort` removes what this run wrote and says
    what OUTPUT holds now. Both give the lock up.
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
        self._lock: OutputLock | None = None

    @property
    def staged(self) -> bool:
        return self.write_dir is not None and self.write_dir != self.out

    def prepare(self, needed_bytes: int) -> Path:
        """Make :attr:`write_dir` ready (see the class doc) for about ``needed_bytes``; returns it.
        A signal noted after an earlier output of this command was complete stops it here."""
        next_step()
        check_output_dir(self.out, self.sources, self.overwrite)  # refusals before anything is made
        if not self.out.exists():
            check_free_space(self.out, needed_bytes)
        self._take_lock()
        interrupted = check_output_dir(self.out, self.sources, self.overwrite)  # now for certain
        for side, _pid in side_dirs(self.out):  # a dead run's (check_output_dir refused live ones)
            with writing(side):
                remove(side)
        kept = kept_weight_files(self.out)
        if kept:
            self.notes.append(kept_weights_warning(self.out, kept))
        if entries(self.out) and not interrupted:
            return self._prepare_staging(needed_bytes)
        if not interrupted:
            check_free_space(self.out, needed_bytes)
        with writing(self.out):
            self.notes += _clear_in_place(self.out, interrupted)
            _write_marker(self.out)
        self.write_dir = self.out
        self._kept = frozenset(p.name for p in entries(self.out)) - {IN_PROGRESS}
        if interrupted:  # counted once what the interrupted run left is gone
            check_free_space(self.out, needed_bytes)
        return self.out

    def _take_lock(self) -> None:
        """Make OUTPUT (and the directories above it) where missing, remembering which this run
        made, and take its lock (BadInput naming the run that holds it)."""
        with writing(self.out):
            for d in [d for d in [*reversed(self.out.parents), self.out] if not d.exists()]:
                try:
                    d.mkdir()
                except FileExistsError:  # made by another run meanwhile
                    continue
                if d == self.out:
                    self.created = True
                else:
                    self._made_parents.append(d)  # outermost first; abort() removes them again (empty)
            self._lock = OutputLock.acquire(self.out)

    def _prepare_staging(self, needed_bytes: int) -> Path:
        staging = _staging_dir(self.out)
        check_free_space(staging.parent, needed_bytes, " (--overwrite keeps the old output until the new one is complete)")
        self.write_dir = staging  # before mkdir: from here on abort() removes it
        with writing(staging):
            staging.mkdir()
            _write_marker(staging)
        self.notes.append(f"overwriting {self.out}: writing the new output to {staging}; the old one is replaced only once it is complete")
        return staging

    def commit(self) -> None:
        """The output in :attr:`write_dir` is complete (manifest written): make it OUTPUT. From then
        on a signal stops nothing (:func:`mxconv.interrupt.output_complete`): the run has succeeded."""
        if not self.staged:
            self.committed = True
            output_complete()
            self._release()
            return
        out, new = self.out, self.write_dir
        assert new is not None
        pid = os.getpid()
        aside = out / f".{ASIDE}-{pid}" if new.parent == out else out.parent / f"{out.name}.{ASIDE}-{pid}"
        moves: list[tuple[Path, Path]] = []
        made_aside = False

        def move(src: Path, dst: Path) -> None:
            os.replace(src, dst)
            moves.append((src, dst))

        with deferred_signals(), writing(out):
            try:
                old = OldOutput.read(out)  # before the marker, which would make it read as an interrupted run's
                aside.mkdir()
                made_aside = True
                _write_marker(out)  # until the new manifest is in, OUTPUT reads as an interrupted run
                incoming = frozenset(p.name for p in new.iterdir() if p.name not in (MANIFEST_NAME, *RUN_FILES))
                if os.path.lexists(out / MANIFEST_NAME):
                    move(out / MANIFEST_NAME, aside / MANIFEST_NAME)
                in_place = []  # old rank directories the new output has no name for: emptied of ours after the swap
                for p in sorted(entries(out)):
                    if p in (new, aside) or p.name in RUN_FILES or not (p.name in incoming or is_ours(p, old)):
                        continue
                    if p.name not in incoming and is_rank_dir(p):
                        in_place.append(p)
                    else:
                        move(p, aside / p.name)
                kept_note = kept_listed_note(out, old, incoming)
                for name in sorted(incoming):
                    move(new / name, out / name)
                move(new / MANIFEST_NAME, out / MANIFEST_NAME)
            except BaseException:
                for src, dst in reversed(moves):  # put the old output back as it was
                    try:
                        os.replace(dst, src)
                    except OSError:
                        pass
                if made_aside:
                    shutil.rmtree(aside, ignore_errors=True)
                (out / IN_PROGRESS).unlink(missing_ok=True)
                raise
            self.committed = True
            output_complete()  # a signal held during the swap is only noted when the block ends
            (out / IN_PROGRESS).unlink(missing_ok=True)
            self.notes += kept_note + clear_old_rank_dirs(out, aside, in_place, old)
            shutil.rmtree(new, ignore_errors=True)
            shutil.rmtree(aside, ignore_errors=True)
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def abort(self) -> str:
        """Remove what this run wrote (best effort), give the lock up and remove the directories this
        run made for OUTPUT where they are empty again; returns what OUTPUT holds now, as a clause."""
        try:
            said = self._remove_written()
        finally:
            self._release()
        if self.created:
            for d in [self.out, *reversed(self._made_parents)]:  # innermost first; a non-empty one stays
                try:
                    d.rmdir()
                except OSError:
                    break
        return said

    def _remove_written(self) -> str:
        out = self.out
        if self.committed:
            return f"the conversion had finished: {out} holds the complete new output"
        if self.write_dir is None:
            return f"nothing was written to {out}"
        try:
            if self.staged:
                if self.write_dir.exists():
                    remove(self.write_dir)
                return f"the unfinished new output was removed; {out} still holds the earlier output, unchanged"
            if self._kept is None:
                return f"{out} holds an unfinished output (no mxconv.json); rerunning the command cleans it up"
            for p in entries(out) if out.is_dir() else []:
                if p.name not in self._kept:
                    remove(p)
            return f"the unfinished output in {out} was removed"
        except OSError as exc:
            return f"could not remove everything this run wrote ({exc}); {out} has no mxconv.json, rerunning the command cleans it up"


def kept_weights_warning(out: Path, names: list[str]) -> str:
    """What replacing the output in ``out`` keeps that ``verify`` will fail on (see
    :func:`~mxconv.output.ownership.kept_weight_files`), as a warning to show before the run."""
    return (f"{out} keeps {', '.join(names)} (mxconv did not write {'them' if len(names) > 1 else 'it'}): "
            "verify of the new output will fail on weight files its index does not name (a loader may read one "
            f"instead of the indexed shards); move {'them' if len(names) > 1 else 'it'} out of {out} before using the output")
