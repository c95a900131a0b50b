"""verify's sha256 of every tensor, computed beside the other checks instead of in a pass of its own.

The manifest lists a sha256 per tensor. Reading every byte once for the hashes and again for the
layout check cost a whole extra pass over the output (and hashing on one thread ran far below the
disk's speed). :class:`TensorHashes` keeps one hash per listed tensor:

* the expert tensors verify's layer reads load (:mod:`mxconv.verify.prefetch`) are hashed by the
  staged reader as their bytes pass and handed over with :meth:`TensorHashes.record`, so each of
  them is read from disk once;
* every other listed tensor is read and hashed on a pool of threads (:meth:`TensorHashes.start_rest`;
  ``hashlib`` releases the GIL on large buffers), while the main thread checks layers.

:meth:`TensorHashes.problems` gives the mismatches by layer, like the other integrity checks.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from mxconv.engines.staged_read import usable_cpus
from mxconv.source.checkpoint import Checkpoint, layer_index
from mxconv.source.st_format import iter_tensor_chunks

MAX_HASH_THREADS = 8
MISMATCH = "sha256 mismatch (corrupted or modified bytes)"


def sha256_of(ckpt: Checkpoint, name: str) -> str:
    """sha256 of tensor ``name``'s bytes as stored in ``ckpt`` (read in chunks)."""
    h = hashlib.sha256()
    for chunk in iter_tensor_chunks(ckpt.tensors[name]):
        h.update(chunk)
    return h.hexdigest()


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
        workers = threads or min(MAX_HASH_THREADS, usable_cpus())
        self._read_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mxconv-sha256-read")

    def __enter__(self) -> TensorHashes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record(self, ckpt: Checkpoint, name: str, digest: str) -> None:
        """Take ``digest`` (sha256 hex) as the hash of ``ckpt``'s tensor ``name``, computed by the
        reader as the bytes passed. Ignored for a tensor the manifest does not list, or one whose
        hash is already taken or started (the first bytes of a tensor decide)."""
        key = self._by_tensor.get((id(ckpt), name))
        if key is None or key in self._jobs:
            return
        done: Future[str] = Future()
        done.set_result(digest)
        self._jobs[key] = done

    def start_rest(self, skip: set[str]) -> None:
        """Read and hash, on the pool, every expected tensor not in ``skip`` (the keys the caller
        will record) and not hashed yet."""
        for key, e in self._expected.items():
            if key not in skip and key not in self._jobs:
                self._jobs[key] = self._read_pool.submit(sha256_of, e.ckpt, e.name)

    def start_other(self, ckpt: Checkpoint, names: list[str]) -> dict[str, Future[str]]:
        """Read and hash tensors ``names`` of another checkpoint (verify's ``--reference``) on the
        pool, beside the output's: name -> the future sha256 hex."""
        return {n: self._read_pool.submit(sha256_of, ckpt, n) for n in names}

    def problems(self) -> dict[int | None, list[str]]:
        """Mismatches by layer (None = not in a layer), after hashing whatever was neither recorded nor
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
        self._read_pool.shutdown(wait=True, cancel_futures=True)
