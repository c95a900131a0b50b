"""Streaming, atomic safetensors output.

The whole output is planned before a byte is written (names, dtypes, shapes, hence sizes), so each
shard's header is known up front. Tensors then stream into their shard in plan order; each shard is
written under a temporary name and renamed into place once complete and fsync'd; the index follows,
and the caller writes ``mxconv.json`` last. An interrupted run leaves the shards finished so far,
at most one temporary file and the ``.mxconv-in-progress`` marker, but never ``mxconv.json``: it
never looks complete, and the next run into the same directory cleans it up.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxconv.checkpoint import INDEX_NAME, MANIFEST_NAME
from mxconv.errors import BadInput
from mxconv.layouts.base import TensorSpec
from mxconv.st_format import TORCH_TO_ST, TensorInfo, expected_nbytes, iter_tensor_chunks

IN_PROGRESS = ".mxconv-in-progress"
TMP_SUFFIX = ".mxconv-tmp"
COPY_CHUNK = 64 * 1024 * 1024


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '2GiB' / '1000000' -> bytes (decimal units as huggingface uses them)."""
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
        raise BadInput(f"--max-shard-size: cannot parse {text!r} (use e.g. 5GB, 500MB, 2GiB)") from None
    if not math.isfinite(value) or value * mult < 1:
        raise BadInput(f"--max-shard-size must be at least one byte, got {text!r}")
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


def check_output_dir(out: Path, sources: list[Path], overwrite: bool) -> bool:
    """Validate OUTPUT without touching it; returns True when it holds an interrupted mxconv run.

    OUTPUT must not be (or be inside, or contain) a SOURCE, must not be a file, and must be empty
    unless ``overwrite`` or it is an interrupted mxconv run (marker present, no manifest).
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


def prepare_output_dir(out: Path, sources: list[Path], overwrite: bool) -> list[str]:
    """Check OUTPUT (see :func:`check_output_dir`), clear what an earlier mxconv run wrote there,
    and drop the in-progress marker. Files mxconv did not write are never deleted."""
    interrupted = check_output_dir(out, sources, overwrite)
    out = out.expanduser().resolve()
    notes: list[str] = []
    if out.exists() and any(out.iterdir()):
        notes.append(f"cleaning up an interrupted mxconv run in {out}" if interrupted else f"overwriting {out}")
        previous = _previous_outputs(out)
        # The manifest goes first so that a crash from here on never leaves a 'complete' look.
        (out / MANIFEST_NAME).unlink(missing_ok=True)
        for p in out.iterdir():
            ours = p.name in previous or p.name.endswith(TMP_SUFFIX) or p.name == INDEX_NAME
            if p.is_file() and (ours or _OUR_SHARD.match(p.name)):
                p.unlink()
            elif p.is_dir() and _OUR_RANK_DIR.match(p.name) and (ours or (p / INDEX_NAME).exists() or (p / IN_PROGRESS).exists()):
                shutil.rmtree(p)
    out.mkdir(parents=True, exist_ok=True)
    (out / IN_PROGRESS).write_text(
        f"an mxconv run (pid {os.getpid()}) is writing this directory; it is incomplete until mxconv.json exists\n"
    )
    return notes


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
class ShardedWriter:
    """Writes a planned set of shards into ``out_dir``, tensor by tensor, in plan order."""

    out_dir: Path
    shards: list[ShardPlan]
    metadata: dict[str, str] = field(default_factory=lambda: {"format": "pt"})
    written: dict[str, WrittenTensor] = field(default_factory=dict)
    bytes_written: int = 0

    def __post_init__(self) -> None:
        # sha256 runs on its own thread while the same bytes are being written (hashlib and file
        # writes both release the GIL), so hashing does not add to the write time.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxconv-sha256")
        # A finished shard is fsync'd and renamed into place on its own thread, so the writer goes
        # straight on with the next shard instead of waiting for the disk to flush this one.
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxconv-fsync")
        self._synced: list = []
        self._queue = [(si, t) for si, s in enumerate(self.shards) for t in s.tensors]
        self._pos = 0
        self._file = None
        self._shard_idx = -1
        self._remaining_in_shard = 0

    def _tmp(self, shard: ShardPlan) -> Path:
        return self.out_dir / f".{shard.file}{TMP_SUFFIX}"

    def _open_next(self, si: int) -> None:
        shard = self.shards[si]
        self._file = open(self._tmp(shard), "wb")
        self._file.write(_header_bytes(shard, self.metadata))
        self._shard_idx = si
        self._remaining_in_shard = len(shard.tensors)

    def _finish_shard(self) -> None:
        assert self._file is not None
        shard = self.shards[self._shard_idx]
        f, self._file = self._file, None
        f.flush()

        def sync_and_rename() -> None:
            try:
                os.fsync(f.fileno())
            finally:
                f.close()
            os.replace(self._tmp(shard), self.out_dir / shard.file)  # only once complete and durable

        self._synced.append(self._syncer.submit(sync_and_rename))

    def _begin(self, name: str) -> PlannedTensor:
        if self._pos >= len(self._queue):
            raise RuntimeError(f"writer: unexpected tensor {name!r} after the plan ended")
        si, planned = self._queue[self._pos]
        if planned.name != name:
            raise RuntimeError(f"writer: got tensor {name!r}, plan expects {planned.name!r}")
        if self._file is None:
            self._open_next(si)
        return planned

    def _end(self, planned: PlannedTensor, digest: str) -> None:
        self.written[planned.name] = WrittenTensor(
            self.shards[self._shard_idx].file, list(planned.shape), planned.st_dtype, digest, planned.role
        )
        self._pos += 1
        self._remaining_in_shard -= 1
        if self._remaining_in_shard == 0:
            self._finish_shard()

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (CPU or CUDA) as the next planned tensor ``name``."""
        planned = self._begin(name)
        if tensor.dtype != planned.spec.dtype or tuple(tensor.shape) != tuple(planned.spec.shape):
            raise RuntimeError(
                f"writer: {name} is {tensor.dtype}{list(tensor.shape)}, plan says "
                f"{planned.spec.dtype}{list(planned.spec.shape)}"
            )
        data = tensor_bytes(tensor)
        if len(data) != planned.nbytes:
            raise RuntimeError(f"writer: {name} has {len(data)} bytes, plan says {planned.nbytes}")
        assert self._file is not None
        digest = self._hasher.submit(lambda: hashlib.sha256(data).hexdigest())
        self._file.write(data)
        self.bytes_written += len(data)
        self._end(planned, digest.result())

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
        weight_map = {name: w.file for name, w in self.written.items()}
        total = sum(s.nbytes for s in self.shards)
        atomic_write_json(self.out_dir / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        return self.written

    def abort(self) -> None:
        """Close and delete the temporary file of the shard in progress (best effort)."""
        self._hasher.shutdown(wait=False, cancel_futures=True)
        self._syncer.shutdown(wait=True)
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._tmp(self.shards[self._shard_idx]).unlink(missing_ok=True)
                self._file = None


def copy_tensor_to(writers: list[ShardedWriter], name: str) -> int:
    """Copy planned tensor ``name`` byte for byte into every writer (one per TP rank), reading and
    hashing its source once; returns the bytes read."""
    planned = [w._begin(name) for w in writers]
    src = planned[0].source
    assert src is not None and all(w._file is not None for w in writers)
    h = hashlib.sha256()
    hasher = writers[0]._hasher
    pending = None
    for chunk in iter_tensor_chunks(src, COPY_CHUNK):
        if pending is not None:
            pending.result()
        pending = hasher.submit(h.update, chunk)
        for w in writers:
            w._file.write(chunk)
    if pending is not None:
        pending.result()
    digest = h.hexdigest()
    for w, p in zip(writers, planned):
        w.bytes_written += src.nbytes
        w._end(p, digest)
    return src.nbytes
