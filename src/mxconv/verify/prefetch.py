"""verify's reads of a layer, made one layer ahead of its checks on a GPU.

Checking a layer (the layout inverse, the reference MoE) and reading the next one's bytes use
different resources, so on a CUDA device a background thread reads layer ``L + 1`` — the output's
expert tensors, and on a second thread at the same time the ``--reference`` layer — while layer ``L``
is checked. Every read goes through
:class:`mxconv.engines.staged_read.StagedReader`: parallel ``preadv`` into bounded pinned staging
buffers and straight onto the device, so host memory stays at the staging buffers whatever the
layer's size, and the output's sha256 digests are computed from the bytes as they pass (each byte
read once). On the CPU the same reads run when the layer is checked (no read-ahead: the layer's
bytes are the host memory, and holding two layers would double it).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import torch

from mxconv.engines.loader import HeldTensor
from mxconv.engines.staged_read import MIB, StagedReader, StagingOptions
from mxconv.experts.tensors import KERNEL_TENSOR_NAMES
from mxconv.families import detect_family
from mxconv.families.base import MoELayer
from mxconv.source.checkpoint import Checkpoint
from mxconv.source.st_format import TensorInfo
from mxconv.verify.state import VerifyState

REFERENCE_STAGING = StagingOptions(buffer_bytes=64 * MIB)
EXPERT_TENSORS = KERNEL_TENSOR_NAMES  # the input scales of a W4A8 output too


@dataclass
class _OnDevice(Checkpoint):
    """A checkpoint whose ``read`` lands on the staged reader's device (what a family reader reads
    through, unchanged)."""

    reader: Any = None  # StagedReader

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        info = self.info(name)
        if rows is not None:
            info = _rows_of(info, rows)
        return self.reader.read({name: info})[name]


def _rows_of(info: TensorInfo, rows: tuple[int, int]) -> TensorInfo:
    """Rows [r0, r1) of dim 0 of a stored tensor: a contiguous byte range of its file."""
    r0, r1 = rows
    if not info.shape or not 0 <= r0 <= r1 <= info.shape[0]:
        raise ValueError(f"rows {rows} of tensor {info.name!r} with shape {list(info.shape)}")
    row = info.nbytes // info.shape[0] if info.shape[0] else 0
    return TensorInfo(info.name, info.file, info.dtype, (r1 - r0, *info.shape[1:]), info.begin + r0 * row, info.begin + r1 * row)


@dataclass
class LayerBytes:
    """One layer as read: the output's expert tensors per TP rank (kernel outputs; ``{short name:
    tensor}`` on the device) with their sha256 digests, and the reference layer (None without one)."""

    kernel: list[dict[str, torch.Tensor]] | None
    digests: list[tuple[Checkpoint, str, str]]  # (checkpoint, tensor name, sha256 hex)
    reference: MoELayer | None
    sources: list[dict[str, TensorInfo]] | None = None  # where each of ``kernel``'s tensors was read from

    def held(self) -> list[dict[str, HeldTensor]] | None:
        """The output's tensors as the engine loader takes them (``verify --kernel``: no second read)."""
        if self.kernel is None or self.sources is None:
            return None
        return [{k: HeldTensor(where[k].file, where[k].name, t) for k, t in rank.items()}
                for rank, where in zip(self.kernel, self.sources)]  # fmt: skip


class LayerReads:
    """Reads the chosen layers in order, one ahead on a GPU (see the module docstring). Use as a
    context manager: closing waits for a read in flight and frees the staging buffers."""

    def __init__(self, state: VerifyState, prefixes: dict[int, str]) -> None:
        self._state, self._prefixes = state, prefixes
        self._reader = StagedReader(state.plan.device)
        self._ref_reader = StagedReader(state.plan.device, REFERENCE_STAGING)  # the reference is read beside the output
        self._ref_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxconv-verify-read-ref")
        self._ahead = 1 if self._reader.device.type == "cuda" else 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mxconv-verify-read")
        self._jobs: dict[int, Future[LayerBytes]] = {}
        self._ref_family = None
        self._ref_refs: dict[int, Any] = {}
        if state.ref_ckpt is not None and state.ref_reader is not None:
            on_device = _OnDevice(**{f.name: getattr(state.ref_ckpt, f.name) for f in fields(Checkpoint)}, reader=self._ref_reader)
            self._ref_family = detect_family(on_device)
            self._ref_refs = {r.layer: r for r in state.ref_reader.layer_refs()}

    def __enter__(self) -> LayerReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ref_pool.shutdown(wait=True, cancel_futures=True)
        self._jobs.clear()
        self._reader.close()
        self._ref_reader.close()

    def get(self, L: int, then: list[int]) -> LayerBytes:
        """Layer ``L``'s bytes (read now, or taken from the read ahead); starts reading the first
        of ``then`` (the layers checked next) on a GPU."""
        job = self._jobs.pop(L, None) or self._pool.submit(self._read, L)
        for nxt in then[: self._ahead]:
            if nxt not in self._jobs:
                self._jobs[nxt] = self._pool.submit(self._read, nxt)
        return job.result()

    def _read(self, L: int) -> LayerBytes:
        """Layer ``L``'s output tensors (this thread) and reference layer (the reference thread, at
        the same time: two streams of reads keep the disk busier than one)."""
        reference = None
        if self._ref_family is not None and L in self._ref_refs:
            reference = self._ref_pool.submit(self._ref_family.read_layer, self._ref_refs[L])
        try:
            kernel, digests, sources = self._read_output(L)
        except BaseException:
            if reference is not None:  # let the reference read finish; the output's error is the one raised
                reference.exception()
            raise
        return LayerBytes(kernel, digests, reference.result() if reference is not None else None, sources)

    def _read_output(self, L: int) -> tuple[list[dict[str, torch.Tensor]] | None, list[tuple[Checkpoint, str, str]],
                                            list[dict[str, TensorInfo]] | None]:  # fmt: skip
        """Layer ``L``'s expert tensors of a kernel output (per rank), their digests and where each was
        read from (nothing for a canonical output: its own reader reads it)."""
        prefix = self._prefixes[L]
        kernel, digests, sources = None, [], None
        if self._state.plan.kind == "kernel":
            kernel, sources = [], []
            for ckpt in self._state.plan.ckpts:
                names = {k: f"{prefix}.experts.{k}" for k in EXPERT_TENSORS if f"{prefix}.experts.{k}" in ckpt.tensors}
                infos = {k: ckpt.tensors[n] for k, n in names.items()}
                tensors, sums = self._reader.read_hashed(infos)
                kernel.append(tensors)
                sources.append(infos)
                digests.extend((ckpt, names[k], sums[k]) for k in names)
        return kernel, digests, sources
