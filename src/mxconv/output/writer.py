"""Streaming, atomic safetensors output.

The shards are planned up front (:mod:`mxconv.output.shards`), so each shard's header is known
before a byte is written. Tensors then stream into their shard in plan order; each shard is written
under a temporary name and renamed into place once complete and fsync'd; the index follows, and the
caller writes ``mxconv.json`` last (:mod:`mxconv.output.manifest`). Where a run writes, and how what
it wrote becomes OUTPUT (staging, cleanup, markers), is :mod:`mxconv.output.directory`.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from mxconv.output.directory import OutputWriteError, writing
from mxconv.output.files import TMP_SUFFIX, FileRecord, atomic_write_json, clear_name, no_follow
from mxconv.output.shards import PlannedTensor, ShardPlan, shard_header
from mxconv.source.diskio import read_ahead, start_writeback
from mxconv.source.file_names import INDEX_NAME
from mxconv.source.st_format import TensorInfo, iter_tensor_chunks

if TYPE_CHECKING:
    import torch

COPY_CHUNK = 64 * 1024 * 1024


class WriteCancelled(Exception):
    """The writer was cancelled (the run is stopping); raised on the writer's thread."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's raw little-endian bytes (contiguous) as a memoryview."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # reshape first: a 0-dim tensor cannot be viewed as bytes


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
    index_record: FileRecord | None = None  # the index's size and sha256, once :meth:`finish` wrote it

    def __post_init__(self) -> None:
        # sha256 runs on its own thread while the same bytes are being written (hashlib and file
        # writes both release the GIL), so hashing does not add to the write time.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxconv-sha256")
        # A finished shard is fsync'd and renamed into place on its own thread, so the writer goes
        # straight on with the next shard instead of waiting for the disk to flush this one.
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxconv-fsync")
        # A byte-for-byte copy reads its next chunk here while this one is written (mxconv.source.diskio).
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxconv-copy-read")
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
        start_writeback(f.fileno(), offset, len(chunk))  # the disk starts now, not at the shard's fsync

    def _open_shard(self, si: int) -> None:
        for fut in self._synced:  # an earlier shard's failed fsync/rename stops the run here already
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
        shard = self.shards[si]
        try:  # a new file, never one reached through a link (mxconv.output.files)
            clear_name(self._tmp(shard))
            self._files[si] = open(self._tmp(shard), "xb", opener=no_follow)
        except OSError as exc:
            raise OutputWriteError.from_os_error(exc, self._shown(shard)) from exc
        self._fpos[si] = 0
        self._left[si] = len(shard.tensors)
        header = shard_header(shard, self.metadata)
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
        """Check every planned tensor was written, then write the index. Returns the tensor table,
        in plan order."""
        self._hasher.shutdown(wait=True)
        self._reader.shutdown(wait=True)
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
        self.written = {t.name: self.written[t.name] for s in self.shards for t in s.tensors}
        weight_map = {name: w.file for name, w in self.written.items()}
        total = sum(s.nbytes for s in self.shards)
        with writing(self.display_dir or self.out_dir, self.out_dir):
            self.index_record = atomic_write_json(self.out_dir / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        return self.written

    def abort(self) -> None:
        """Stop the helper threads, close and delete the temporary files of the shards in progress
        (best effort; safe to call twice). Finished shards stay: the caller's OutputTarget removes them."""
        self._cancelled.set()
        self._hasher.shutdown(wait=True, cancel_futures=True)  # at most one chunk being hashed
        self._reader.shutdown(wait=True, cancel_futures=True)  # at most one chunk being read
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


def _stream(targets: list[Target], h: Any, chunks: Iterable[memoryview | bytes],
            check: Callable[[int, bytes], None] | None = None) -> int:
    """Write ``chunks`` at consecutive offsets of every target (one per TP rank), updating sha256
    ``h`` with each chunk on the first writer's hashing thread while the chunk is being written
    (``check(offset, chunk)`` runs there too, after the hash, and raises to stop); returns the bytes
    written per target."""
    hasher = targets[0][0]._hasher
    pending: Future | None = None
    pos = 0
    try:
        for chunk in chunks:
            if pending is not None:
                pending.result()
            pending = hasher.submit(_digest, h, chunk, pos, check)
            for w, si, off in targets:
                w._write_at(si, off + pos, chunk)
            pos += len(chunk)
    finally:
        if pending is not None:
            pending.result()
    return pos


def _digest(h: Any, chunk: memoryview | bytes, pos: int, check: Callable[[int, bytes], None] | None) -> None:
    h.update(chunk)
    if check is not None:
        check(pos, chunk)


def copy_tensor_to(writers: list[ShardedWriter], name: str,
                   check: Callable[[TensorInfo, int, bytes], None] | None = None) -> int:
    """Copy planned tensor ``name`` byte for byte into every writer (one per TP rank), reading and
    hashing its source once; returns the bytes read. ``check(source, byte_offset, chunk)`` sees every
    chunk on the hashing thread, beside the write (it raises to stop the copy: the run fails and
    nothing it wrote is kept)."""
    planned = [w._begin(name) for w in writers]
    src = planned[0].source
    assert src is not None
    h = hashlib.sha256()
    on_chunk = None if check is None else (lambda pos, chunk: check(src, pos, chunk))
    chunks = read_ahead(iter_tensor_chunks(src, COPY_CHUNK), writers[0]._reader)  # read k+1 while k is written
    try:
        _stream([(w, w._shard_of[name], w._offsets[name]) for w in writers], h, chunks, on_chunk)
    finally:
        chunks.close()  # a failed write leaves no read running
    digest = h.hexdigest()
    for w, p in zip(writers, planned):
        w.bytes_written += src.nbytes
        w._end(p, digest)
    return src.nbytes

