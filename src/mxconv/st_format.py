"""safetensors file format: header parsing with full validation, dtype tables.

A ``.safetensors`` file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` and then the
data section; offsets are relative to the data section. We validate every header before a byte of
data is used, so a truncated or corrupt file is refused with a message that names the file and
tensor instead of a crash deep inside a loader.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from mxconv.errors import BadInput

# safetensors dtype string -> (torch dtype, bits per element)
ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 64),
    "F32": (torch.float32, 32),
    "F16": (torch.float16, 16),
    "BF16": (torch.bfloat16, 16),
    "I64": (torch.int64, 64),
    "I32": (torch.int32, 32),
    "I16": (torch.int16, 16),
    "I8": (torch.int8, 8),
    "U8": (torch.uint8, 8),
    "BOOL": (torch.bool, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 8),
    "F8_E5M2": (torch.float8_e5m2, 8),
    "F8_E8M0": (torch.float8_e8m0fnu, 8),
    "F4": (torch.float4_e2m1fn_x2, 4),
}
TORCH_TO_ST: dict[torch.dtype, str] = {v[0]: k for k, v in ST_DTYPES.items()}
for _extra, _name in ((torch.uint16, "U16"), (torch.uint32, "U32"), (torch.uint64, "U64")):
    ST_DTYPES[_name] = (_extra, int(_name[1:]))
    TORCH_TO_ST[_extra] = _name

MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype string, shape, absolute byte range in the file."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first data byte
    end: int  # absolute file offset one past the last data byte

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return ST_DTYPES[self.dtype][0]


def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of ``dtype``/``shape`` occupies (F4 shapes count 4-bit elements)."""
    bits = ST_DTYPES[dtype][1] * math.prod(shape)
    return (bits + 7) // 8


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate the header of ``path``.

    Returns ({tensor name: TensorInfo}, metadata). Raises BadInput naming the file (and tensor)
    for: a file shorter than its header, bad JSON, unknown dtype, malformed shape/offsets, a byte
    count that disagrees with dtype x shape, data past the end of the file (truncation), and
    overlapping tensors.
    """
    path = Path(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BadInput(f"{path}: not a safetensors file (only {len(head)} bytes; truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise BadInput(
                    f"{path}: corrupt safetensors header (header length {n} but the file has {size} bytes)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"{path}: corrupt safetensors header (invalid JSON: {exc})") from None
    if not isinstance(header, dict):
        raise BadInput(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + n
    data_len = size - data_start
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise BadInput(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise BadInput(f"{where}: corrupt header entry")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in ST_DTYPES:
            raise BadInput(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise BadInput(f"{where}: malformed shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and o >= 0 for o in offsets)
            or offsets[1] < offsets[0]
        ):
            raise BadInput(f"{where}: malformed data_offsets {offsets!r}")
        want = expected_nbytes(dtype, tuple(shape))
        if offsets[1] - offsets[0] != want:
            raise BadInput(
                f"{where}: data_offsets span {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs {want}"
            )
        if offsets[1] > data_len:
            raise BadInput(
                f"{where}: data ends at byte {data_start + offsets[1]} but the file has only {size} bytes "
                f"(truncated file?)"
            )
        infos[name] = TensorInfo(name, path, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
    spans = sorted((i.begin, i.end, i.name) for i in infos.values() if i.end > i.begin)
    for (b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise BadInput(f"{path}: corrupt safetensors header (tensors {n0!r} and {n1!r} overlap)")
    return infos, {str(k): str(v) for k, v in meta.items()}


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """Read one tensor's bytes from disk into a new CPU tensor (header already validated).

    Reads with ``readinto`` straight into the tensor's storage: one copy, no mmap page faults,
    and it works for every dtype (F8_E8M0, F4 included).
    """
    dtype = info.torch_dtype
    nbytes = info.nbytes
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        mv = memoryview(buf.numpy()).cast("B")
        with open(info.file, "rb", buffering=0) as f:
            f.seek(info.begin)
            got = 0
            while got < nbytes:
                r = f.readinto(mv[got:])
                if not r:
                    raise BadInput(f"{info.file}: tensor {info.name!r} is truncated (read {got} of {nbytes} bytes)")
                got += r
    if info.dtype == "F4":
        shape = (*info.shape[:-1], info.shape[-1] // 2) if info.shape else info.shape
        return buf.view(dtype).reshape(shape)
    return buf.view(dtype).reshape(info.shape)


def iter_tensor_chunks(info: TensorInfo, chunk: int = 64 << 20):
    """Yield a tensor's raw bytes from its file in chunks of at most ``chunk`` bytes."""
    left = info.nbytes
    with open(info.file, "rb") as f:
        f.seek(info.begin)
        while left:
            data = f.read(min(chunk, left))
            if not data:
                raise BadInput(f"{info.file}: tensor {info.name!r} is truncated")
            left -= len(data)
            yield data
