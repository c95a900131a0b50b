"""verify's sha256 of every tensor, computed beside the other checks instead of in a pass of its own.

The manifest lists a sha256 per tensor. Reading every byte once for the hashes and again for the
layout check cost a whole extra pass over the output (and hashing on one thread ran far below the
disk's speed). :class:`TensorHashes` hashes on a pool of threads (``hashlib`` releases the GIL on
large buffers):

* bytes the layout check has already read are handed over with :meth:`TensorHashes.feed` and hashed
  from memory, so each expert tensor is read from disk once;
* every other listed tensor is read and hashed by the pool itself (:meth:`TensorHashes.start_rest`),
  while the main thread checks layers;
* :meth:`TensorHashes.settle` waits for the bytes fed so far, so the host memory held for hashing
  stays at about one layer's tensors. Fed bytes have a pool of their own: queued behind the other
  tensors' reads, they would make ``settle`` wait for all of those.

:meth:`TensorHashes.problems` gives the mismatches by layer, like the other integrity checks.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mxconv.engines.staged_read import usable_cpus
from mxconv.source.checkpoint import Checkpoint, layer_index
from mxconv.source.st_format import iter_tensor_chunks

if TYPE_CHECKING:
    import torch

MAX_HASH_THREADS = 8
MISMATCH = "sha256 mismatch (corrupted or modified bytes)"


def sha256_of(ckpt: Checkpoint, name: str) -> str:
    """sha256 of tensor ``name``'s bytes as stored in ``ckpt`` (read in chunks)."""
    h = hashlib.sha256()
    for chunk in iter_tensor_chunks(ckpt.tensors[name]):
        h.update(chunk)
    return h.hexdigest()


def sha256_of_tensor(t: "torch.Tensor") -> str:
    """sha256 of a contiguous CPU tensor's bytes (what :func:`sha256_of` gives for the stored tensor
    that ``read_tensor`` returned)."""
    import torch

    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(flat.numpy())).hexdigest()


@dataclass(frozen=True)
class Expected:
    """One manifest tensor to hash: ``key`` as the manifest names it (``rank-N/`` prefixed in a TP
    output), where it is stored, and the sha256 the manifest records."""

    key: str
    ckpt: Checkpoint
    name: str
    sha256: str


class TensorHashes:
    """The sha256 checks of one verify run (see the module docstring). Use as a context manager, or
    call :meth:`close`."""

    def __init__(self, expected: list[Expected], threads: int | None = None) -> None:
        self._expected = {e.key: e for e in expected}
        self._by_tensor = {(id(e.ckpt), e.name): e.key for e in expected}
        self._jobs: dict[str, Future[str]] = {}
        self._fed: list[Future[str]] = []
        workers = threads or min(MAX_HASH_THREADS, usable_cpus())
        self._fed_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mxconv-sha256-fed")
        self._read_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mxconv-sha256-read")

    def __enter__(self) -> TensorHashes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def feed(self, ckpt: Checkpoint, name: str, t: "torch.Tensor") -> None:
        """Hash ``t``, the bytes of ``ckpt``'s tensor ``name`` just read (a CPU tensor, as stored;
        kept alive until hashed). A tensor the manifest does not list, or one already hashed, is
        ignored."""
        key = self._by_tensor.get((id(ckpt), name))
        if key is None or key in self._jobs:
            return
        job = self._fed_pool.submit(sha256_of_tensor, t)
        self._jobs[key] = job
        self._fed.append(job)

    def record(self, ckpt: Checkpoint, name: str, digest: str) -> None:
        """Take ``digest`` (sha256 hex) as the hash of ``ckpt``'s tensor ``name``, computed by the
        reader as the bytes passed. Ignored like :meth:`feed` for a tensor not listed or hashed."""
        key = self._by_tensor.get((id(ckpt), name))
        if key is None or key in self._jobs:
            return
        done: Future[str] = Future()
        done.set_result(digest)
        self._jobs[key] = done

    def settle(self) -> None:
        """Wait until every fed tensor is hashed (bounds the memory held for hashing)."""
        for job in self._fed:
            job.exception()
        self._fed.clear()

    def start_rest(self, skip: set[str]) -> None:
        """Read and hash, on the pool, every expected tensor not in ``skip`` (the keys the caller
        will feed) and not hashed yet."""
        for key, e in self._expected.items():
            if key not in skip and key not in self._jobs:
                self._jobs[key] = self._read_pool.submit(sha256_of, e.ckpt, e.name)

    def problems(self) -> dict[int | None, list[str]]:
        """Mismatches by layer (None = not in a layer), after hashing whatever was neither fed nor
        started; a truncated tensor is named with its file."""
        self.start_rest(set())
        found: dict[int | None, list[str]] = {}
        for key, e in self._expected.items():
            try:
                ok = self._jobs[key].result() == e.sha256
                why = MISMATCH
            except Exception as exc:  # noqa: BLE001 - a read error is this tensor's integrity problem
                ok, why = False, f"cannot be read: {exc}"
            if not ok:
                found.setdefault(layer_index(e.name), []).append(f"{key}: {why}")
        return found

    def close(self) -> None:
        for pool in (self._fed_pool, self._read_pool):
            pool.shutdown(wait=True, cancel_futures=True)
