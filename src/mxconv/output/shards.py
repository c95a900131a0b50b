"""The planned output: every tensor's name, spec and role, cut into safetensors shards.

The whole output is planned before a byte is written (names, dtypes, shapes, hence sizes), so each
shard's header is known up front: :func:`plan_shards` cuts the planned tensors into shards in plan
order, :func:`shard_header` is the exact header bytes a shard starts with, :func:`shards_size` what
the shards take on disk. :class:`mxconv.output.writer.ShardedWriter` streams the bytes in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mxconv.experts.tensors import TensorSpec
from mxconv.source.st_format import TensorInfo, expected_nbytes


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
        return self.spec.st_dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape if self.source is not None else self.spec.shape

    @property
    def nbytes(self) -> int:
        return expected_nbytes(self.st_dtype, self.shape)


@dataclass
class ShardPlan:
    """One output shard: its file name (``model-0000i-of-0000n.safetensors``) and tensors, in plan order."""

    file: str
    tensors: list[PlannedTensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(tensors: list[PlannedTensor], max_shard_size: int, first_group: int = 0) -> list[ShardPlan]:
    """Greedy split in plan order; a tensor larger than the limit gets a shard of its own. The
    first ``first_group`` tensors never share a shard with the others."""
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for i, t in enumerate(tensors):
        if groups[-1] and (size + t.nbytes > max_shard_size or i == first_group):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    return [ShardPlan(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def shard_header(shard: ShardPlan, metadata: dict[str, str]) -> bytes:
    """The bytes a shard file starts with: the 8-byte little-endian header length, then the JSON
    header (``__metadata__`` and each tensor's dtype, shape and data offsets, in plan order), padded
    with spaces to a multiple of 8 bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    off = 0
    for t in shard.tensors:
        header[t.name] = {"dtype": t.st_dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def shards_size(shards: list[ShardPlan], metadata: dict[str, str] | None = None) -> int:
    """Bytes ``shards`` take on disk, headers included (as :class:`mxconv.output.writer.ShardedWriter` writes them)."""
    md = {"format": "pt"} if metadata is None else metadata
    return sum(len(shard_header(s, md)) + s.nbytes for s in shards)
