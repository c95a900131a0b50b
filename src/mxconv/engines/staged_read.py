"""Reading safetensors tensors onto a device at the speed of the host-to-device copy.

A layer's tensors are read straight from their files at their byte offsets (``os.preadv`` on several
threads; the page cache or the disk behind it) into a few bounded **pinned staging buffers**, and
each full buffer is copied to the GPU on a side stream while the next one is read: reads overlap
copies, and nothing of the layer is ever built in pageable host memory. Host memory is the staging
buffers (``buffers x buffer_bytes``, :class:`StagingOptions`); GPU memory is the tensors themselves.

On a CPU destination (or a machine without CUDA, where pinned memory does not exist) the same reads
go straight into the destination tensors, cut into the same staging-sized fills, so both paths read
the same bytes from the same offsets (:func:`plan_fills`).

Every file's header is validated first (:func:`mxconv.source.st_format.read_header`): a truncated or
edited shard is refused naming the file and the tensor before a byte of data is used; a file that
shrinks while it is read is refused the same way. Optionally each tensor's sha256 is computed from
the bytes as they pass (the hashes the manifest lists, the ones ``mxconv verify`` checks).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ALL_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxconv.errors import BadInput, OutputDamaged
from mxconv.source.st_format import TensorInfo

MIB = 1 << 20
MAX_READ_THREADS = 16  # the default read_threads: one a core up to this
HASH_LANES = 4  # tensors hashed in parallel (a layer's largest tensor is about 2/3 of its bytes)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which containers narrow), else the host's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class StagingOptions:
    """How much host memory a read may stage and how it reads.

    ``buffer_bytes``: one pinned staging buffer (default 128 MiB); ``buffers``: how many (2: double
    buffering); ``read_threads``: parallel ``preadv`` calls filling one buffer (default one per CPU
    this process may use, at most 16); ``piece_bytes``: the largest single read (default 8 MiB). On
    an H200 machine with 16 cores, 16 threads of 8 MiB pieces read a gpt-oss-120b layer from the page
    cache 1.23x faster than 8 of 16 MiB, and evicted files no slower (docs/benchmarks.md, session 4)."""

    buffer_bytes: int = 128 * MIB
    buffers: int = 2
    read_threads: int = field(default_factory=lambda: min(MAX_READ_THREADS, usable_cpus()))
    piece_bytes: int = 8 * MIB

    def __post_init__(self) -> None:
        for name in ("buffer_bytes", "buffers", "read_threads", "piece_bytes"):
            if int(getattr(self, name)) < 1:
                raise BadInput(f"StagingOptions.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def host_bytes(self) -> int:
        """The pinned host memory the staging buffers take."""
        return self.buffer_bytes * self.buffers


@dataclass(frozen=True)
class Segment:
    """Bytes [start, start + nbytes) of tensor ``key`` (``info``), at ``buffer_offset`` in its fill."""

    key: str
    info: TensorInfo
    start: int
    nbytes: int
    buffer_offset: int

    @property
    def file_offset(self) -> int:
        return self.info.begin + self.start


def plan_fills(infos: Iterable[tuple[str, TensorInfo]], buffer_bytes: int) -> list[list[Segment]]:
    """Cut the tensors (read in the order given) into fills of at most ``buffer_bytes``: small
    tensors share a fill, a tensor larger than one buffer spans several."""
    fills: list[list[Segment]] = []
    current: list[Segment] = []
    used = 0
    for key, info in infos:
        start = 0
        while start < info.nbytes:
            if used == buffer_bytes:
                fills.append(current)
                current, used = [], 0
            n = min(info.nbytes - start, buffer_bytes - used)
            current.append(Segment(key, info, start, n, used))
            start += n
            used += n
    if current:
        fills.append(current)
    return fills


def storage_shape(info: TensorInfo) -> tuple[int, ...]:
    """The torch shape of a stored tensor (F4: two values a byte, so the last dimension halves)."""
    if info.dtype == "F4" and info.shape:
        return (*info.shape[:-1], info.shape[-1] // 2)
    return tuple(info.shape)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (same storage)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _read_exact(fd: int, target: memoryview, offset: int, seg: Segment) -> None:
    """Fill ``target`` from ``fd`` at ``offset``; BadInput naming file and tensor on a short read or
    an OS error (EIO, a file system gone away, ...)."""
    info = seg.info
    got = 0
    while got < len(target):
        try:
            n = os.preadv(fd, [target[got:]], offset + got)
        except OSError as exc:
            raise BadInput(f"{info.file}: tensor {info.name!r}: {exc}") from exc
        if n <= 0:
            raise OutputDamaged(f"{info.file}: tensor {info.name!r} is truncated (the file ends at byte {offset + got}, "
                           f"the tensor needs bytes up to {info.end})")  # fmt: skip
        got += n


def _open(info: TensorInfo) -> int:
    """A read-only fd of ``info.file``; BadInput naming the file and the tensor otherwise."""
    try:
        return os.open(info.file, os.O_RDONLY)
    except OSError as exc:
        raise BadInput(f"{info.file}: tensor {info.name!r}: {exc}") from exc


def _check_hashes_given(ordered: list[tuple[str, TensorInfo]], hashes: dict[str, str]) -> None:
    """Refuse, before anything is read, a hash check that would leave a tensor unchecked."""
    for key, info in ordered:
        if key not in hashes:
            raise OutputDamaged(f"{info.file}: tensor {info.name!r}: no sha256 to check its bytes against "
                           "(a hash check needs one for every tensor read)")  # fmt: skip


def _check_sizes(fds: dict[Path, int], infos: list[tuple[str, TensorInfo]]) -> None:
    """Refuse a file shorter than a tensor it should hold before anything is read."""
    sizes = {f: os.fstat(fd).st_size for f, fd in fds.items()}
    for _, info in infos:
        if info.end > sizes[info.file]:
            raise OutputDamaged(f"{info.file}: tensor {info.name!r} is truncated (the file has {sizes[info.file]} bytes, "
                           f"the tensor needs bytes {info.begin}..{info.end})")  # fmt: skip


class StagedReader:
    """Reads tensors of safetensors files onto one device; keeps its threads, pinned buffers and
    copy stream between reads (use as a context manager, or call :meth:`close`).

    Not thread-safe: one :meth:`read` at a time. Two threads reading through one reader would fill
    the same staging buffers; give each thread its own reader."""

    def __init__(self, device: str | torch.device = "cuda", staging: StagingOptions | None = None) -> None:
        self.device = torch.device(device)
        self.staging = staging = staging or StagingOptions()
        self._pool = ThreadPoolExecutor(max_workers=staging.read_threads, thread_name_prefix="mxconv-read")
        self._hashers = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxconv-read-sha256") for _ in range(HASH_LANES)]
        self._lane_of: dict[str, int] = {}  # this read's tensors -> hash lanes
        self._buffers: list[torch.Tensor] = []
        self._stream: Any = None
        self.bytes_read = 0

    def __enter__(self) -> StagedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for lane in self._hashers:
            lane.shutdown(wait=True)
        self._buffers = []

    def read(self, infos: dict[str, TensorInfo], hashes: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
        """``{key: tensor}`` for ``{key: where it lives}``, dtypes and shapes as stored, on the
        reader's device. ``hashes`` ({key: sha256 hex}) checks each tensor's bytes as they pass:
        BadInput naming the file and tensor on a mismatch, or for a tensor it has no hash of. On
        any error nothing is left reading files or copying into the tensors when it is raised."""
        ordered = sorted(infos.items(), key=lambda kv: (str(kv[1].file), kv[1].begin))
        if hashes is not None:
            _check_hashes_given(ordered, hashes)
        out, digests = self._read(ordered, hashes is not None)
        if hashes is not None:
            for key, info in ordered:
                if digests[key] != hashes[key]:
                    raise OutputDamaged(f"{info.file}: tensor {info.name!r}: sha256 mismatch with the manifest (corrupted or modified bytes)")
        return out

    def read_hashed(self, infos: dict[str, TensorInfo]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """:meth:`read`, and each tensor's sha256 (hex) of the bytes as they passed, for a caller
        that judges the hashes itself (``mxconv verify`` reports a mismatch instead of raising)."""
        return self._read(sorted(infos.items(), key=lambda kv: (str(kv[1].file), kv[1].begin)), True)

    def _read(self, ordered: list[tuple[str, TensorInfo]], hashed: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        out = {key: torch.empty(storage_shape(info), dtype=info.torch_dtype, device=self.device) for key, info in ordered}
        views = {key: byte_view(t) for key, t in out.items()}
        hashers = {key: hashlib.sha256() for key, _ in ordered} if hashed else None
        self._lane_of = {key: i % HASH_LANES for i, (key, _) in enumerate(ordered)}
        fds: dict[Path, int] = {}
        try:
            for _, info in ordered:
                if info.file not in fds:
                    fds[info.file] = _open(info)
            _check_sizes(fds, ordered)
            fills = plan_fills(ordered, self.staging.buffer_bytes)
            if self.device.type == "cuda":
                self._read_staged(fills, fds, views, hashers)
            else:
                self._read_direct(fills, fds, views, hashers)
        finally:
            for fd in fds.values():
                os.close(fd)
        self.bytes_read += sum(info.nbytes for _, info in ordered)
        return out, {key: h.hexdigest() for key, h in (hashers or {}).items()}

    def _jobs(self, fill: list[Segment], fds: dict[Path, int], target: Any) -> list[tuple[int, memoryview, int, Segment]]:
        """(fd, destination memoryview, file offset, segment) reads of at most ``piece_bytes``;
        ``target(seg)`` is the memoryview a segment lands in."""
        step = self.staging.piece_bytes
        jobs = []
        for seg in fill:
            mv = target(seg)
            for at in range(0, seg.nbytes, step):
                jobs.append((fds[seg.info.file], mv[at:at + step], seg.file_offset + at, seg))
        return jobs

    def _run(self, jobs: list[tuple[int, memoryview, int, Segment]]) -> None:
        """Every job on the pool; returns (or raises the first job's error) only once all are done,
        so no read outlives the call (the caller closes the fds and reuses the buffers next)."""
        if len(jobs) == 1:
            _read_exact(*jobs[0])
            return
        _settle([self._pool.submit(_read_exact, *job) for job in jobs])

    def _hash_later(self, hashers: dict[str, Any] | None, fill: list[Segment], source: Any) -> list[Future[None]]:
        """Hash ``fill``'s bytes (``source(seg)``: where a segment landed) while the next fill is
        read: each tensor on its own lane (one thread, so its bytes go in file order), different
        tensors in parallel (one sha256 stream runs below a disk's speed)."""
        if hashers is None:
            return []
        lanes: dict[int, list[Segment]] = {}
        for s in fill:
            lanes.setdefault(self._lane_of[s.key], []).append(s)

        def run(segs: list[Segment]) -> None:
            for s in segs:
                hashers[s.key].update(source(s))

        return [self._hashers[lane].submit(run, segs) for lane, segs in lanes.items()]

    def _read_direct(self, fills: list[list[Segment]], fds: dict[Path, int], views: dict[str, torch.Tensor],
                     hashers: dict[str, Any] | None) -> None:  # fmt: skip
        """CPU destination: each fill read straight into the tensors."""
        mvs = {key: memoryview(v.numpy()) for key, v in views.items()}
        pending: list[Future[None]] = []
        try:
            for fill in fills:
                self._run(self._jobs(fill, fds, lambda s: mvs[s.key][s.start:s.start + s.nbytes]))
                pending += self._hash_later(hashers, fill, lambda s: mvs[s.key][s.start:s.start + s.nbytes])
        finally:
            _settle(pending)

    def _staging_buffers(self) -> list[torch.Tensor]:
        if not self._buffers:
            n, size = self.staging.buffers, self.staging.buffer_bytes
            self._buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
            self._stream = torch.cuda.Stream(self.device)
        return self._buffers

    def _read_staged(self, fills: list[list[Segment]], fds: dict[Path, int], views: dict[str, torch.Tensor],
                     hashers: dict[str, Any] | None) -> None:  # fmt: skip
        """GPU destination: fill a pinned buffer (threads), queue its copies on the side stream (and
        its hashing on the hash thread), fill the next buffer while they run; a buffer is refilled
        once its copies and its hashing are done."""
        buffers = self._staging_buffers()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the destinations were allocated there
        events: list[Any] = [None] * len(buffers)
        hashing: list[list[Future[None]]] = [[] for _ in buffers]
        mvs = [memoryview(b.numpy()) for b in buffers]
        try:
            for i, fill in enumerate(fills):
                b = i % len(buffers)
                if events[b] is not None:
                    events[b].synchronize()
                _settle(hashing[b])
                mv = mvs[b]
                self._run(self._jobs(fill, fds, lambda s, mv=mv: mv[s.buffer_offset:s.buffer_offset + s.nbytes]))
                hashing[b] = self._hash_later(hashers, fill, lambda s, mv=mv: mv[s.buffer_offset:s.buffer_offset + s.nbytes])
                with torch.cuda.stream(stream):
                    for s in fill:
                        src = buffers[b][s.buffer_offset:s.buffer_offset + s.nbytes]
                        views[s.key][s.start:s.start + s.nbytes].copy_(src, non_blocking=True)
                    events[b] = stream.record_event()
        finally:  # also on an error: no queued copy or hash may still read the buffers or write the tensors
            stream.synchronize()
            _settle([j for jobs in hashing for j in jobs])


def _settle(jobs: list[Future[None]]) -> None:
    """Wait for every job; then raise the first one's error, if any."""
    wait(jobs, return_when=ALL_COMPLETED)
    for j in jobs:
        j.result()


def read_tensors(infos: dict[str, TensorInfo], device: str | torch.device = "cuda",
                 staging: StagingOptions | None = None, hashes: dict[str, str] | None = None,
                 ) -> dict[str, torch.Tensor]:  # fmt: skip
    """One-shot :meth:`StagedReader.read` (a fresh reader: threads and buffers for this call only)."""
    with StagedReader(device, staging) as reader:
        return reader.read(infos, hashes)
