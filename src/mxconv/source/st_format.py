"""safetensors file format: strict header parsing and validation, dtype tables, streaming reads.

A ``.safetensors`` file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` and then the
data section; offsets are relative to the data section. Every header is validated before a byte of
data is used (:func:`read_header`), rule by rule, so a truncated, shifted or edited file is refused
with a message that names the file, the tensor and the rule instead of converting garbage:

* the header length fits the file (and the 100 MB cap of the format);
* the header is a JSON object without duplicate keys: tensor entries, plus ``__metadata__``
  (an object of strings, or absent);
* every entry has a known dtype, a shape that is a list of non-negative integers (``true``, ``1.0``
  and ``-1`` are refused) and ``data_offsets``, a pair of integers ``begin <= end`` whose span is
  exactly dtype x shape bytes;
* the entries, sorted by offset, tile the data section exactly: from byte 0 to the end of the
  file, without a gap, an overlap or trailing bytes.

Why a hand-written parser: reads stream (``readinto`` straight into a preallocated tensor, hashing
in chunks), which needs each tensor's absolute byte range, and the safetensors library does not
expose offsets; and its errors do not say which rule a header broke. The library's own parser is
still run on every file as a second opinion (:func:`library_check`: it is what the loaders of the
output use), and the tests check that the two agree on damaged headers.

torch is imported lazily (headers need none), so ``mxconv inspect`` stays torch-free: the dtype
tables are keyed by safetensors name, and the torch ones (``ST_DTYPES``, ``TORCH_TO_ST``,
:func:`torch_dtype`, :func:`st_name`) are built on first use.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mxconv.errors import BadInput
from mxconv.source.json_files import loads_strict, open_regular
from mxconv.source.regular_files import read_exactly

if TYPE_CHECKING:
    import torch

# safetensors dtype string -> (torch dtype name, bits per element)
_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 64),
    "F32": ("float32", 32),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "I64": ("int64", 64),
    "I32": ("int32", 32),
    "I16": ("int16", 16),
    "I8": ("int8", 8),
    "U8": ("uint8", 8),
    "BOOL": ("bool", 8),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "F4": ("float4_e2m1fn_x2", 4),
    "U16": ("uint16", 16),
    "U32": ("uint32", 32),
    "U64": ("uint64", 64),
}


@functools.cache
def _torch_tables() -> tuple[dict[str, tuple[torch.dtype, int]], dict[torch.dtype, str]]:
    import torch

    st_dtypes = {name: (getattr(torch, attr), bits) for name, (attr, bits) in _DTYPES.items()}
    return st_dtypes, {dtype: name for name, (dtype, _) in st_dtypes.items()}


def __getattr__(name: str) -> Any:
    # ST_DTYPES: safetensors dtype string -> (torch dtype, bits per element); TORCH_TO_ST: the reverse
    if name in ("ST_DTYPES", "TORCH_TO_ST"):
        return _torch_tables()[name == "TORCH_TO_ST"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of safetensors dtype ``name`` ("F4": ``float4_e2m1fn_x2``, two values a byte)."""
    return _torch_tables()[0][name][0]


def st_name(dtype: torch.dtype) -> str:
    """The safetensors name of torch ``dtype``."""
    return _torch_tables()[1][dtype]


def element_bytes(name: str) -> int:
    """Bytes per element of the torch dtype of safetensors dtype ``name`` (F4: 1, a pair of values)."""
    return (_DTYPES[name][1] + 7) // 8


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
        return torch_dtype(self.dtype)


def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of ``dtype``/``shape`` occupies (F4 shapes count 4-bit elements)."""
    bits = _DTYPES[dtype][1] * math.prod(shape)
    return (bits + 7) // 8


def _is_int(v: Any) -> bool:
    """A JSON integer (``True``/``False`` are Python ints, but not safetensors sizes)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(path: Path, name: str, entry: Any, data_start: int) -> TensorInfo:
    """One validated header entry -> TensorInfo (offsets made absolute)."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise BadInput(f"{where}: corrupt header entry (not an object with dtype, shape, data_offsets)")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise BadInput(f"{where}: corrupt header entry (no {key!r})")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise BadInput(f"{where}: unknown dtype {dtype!r} (known: {', '.join(sorted(_DTYPES))})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise BadInput(f"{where}: malformed shape {shape!r} (must be a list of non-negative integers)")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise BadInput(f"{where}: malformed data_offsets {offsets!r} (must be [begin, end], integers, begin <= end)")
    if dtype == "F4" and shape and shape[-1] % 2:
        raise BadInput(f"{where}: F4 shape {shape} has an odd last dimension (two 4-bit values per byte)")
    want = expected_nbytes(dtype, tuple(shape))
    if offsets[1] - offsets[0] != want:
        raise BadInput(
            f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs {want}"
        )
    return TensorInfo(name, path, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _check_tiling(path: Path, infos: dict[str, TensorInfo], data_start: int, size: int) -> None:
    """The tensors, sorted by offset, must cover the data section exactly: no gap, no overlap, no
    trailing bytes, nothing past the end of the file (a truncated file)."""
    at, prev = data_start, None
    for info in sorted(infos.values(), key=lambda i: (i.begin, i.end)):
        rel = (info.begin - data_start, info.end - data_start)
        if info.begin > at:
            after = f"after tensor {prev!r}" if prev else "at the start of the data section"
            raise BadInput(
                f"{path}: tensor {info.name!r}: data_offsets {list(rel)} leave a gap of {info.begin - at} bytes {after} "
                f"(tensors must tile the data section)"
            )
        if info.begin < at:
            raise BadInput(f"{path}: corrupt safetensors header (tensors {prev!r} and {info.name!r} overlap)")
        if info.end > size:
            raise BadInput(
                f"{path}: tensor {info.name!r}: data ends at byte {info.end} but the file has only {size} bytes "
                f"(truncated file?)"
            )
        at, prev = info.end, info.name
    if at < size:
        last = f"after the last tensor {prev!r}" if prev else "but the header lists no tensor"
        raise BadInput(
            f"{path}: {size - at} trailing bytes {last} (the data section must end where the last tensor ends)"
        )


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate the header of ``path`` (every rule of the module docstring).

    Returns ({tensor name: TensorInfo}, metadata). Raises BadInput naming the file, the tensor and
    the rule it breaks; then the safetensors library reads the header too (:func:`library_check`).
    """
    path = Path(path)
    try:
        f, size = open_regular(path, "the safetensors file")
    except FileNotFoundError:
        raise BadInput(f"{path}: cannot read (No such file or directory)") from None
    try:
        with f:
            head = f.read(8)
            if len(head) < 8:
                raise BadInput(f"{path}: not a safetensors file (only {len(head)} bytes; truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise BadInput(
                    f"{path}: corrupt safetensors header (header length {n} but the file has {size} bytes)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read ({exc.strerror or exc})") from None
    header = loads_strict(raw, str(path), "corrupt safetensors header", document=False)
    if not isinstance(header, dict):
        raise BadInput(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + n
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BadInput(f"{path}: corrupt safetensors header (__metadata__ must be an object of strings)")
    infos = {name: _entry(path, name, entry, data_start) for name, entry in header.items()}
    _check_tiling(path, infos, data_start, size)
    library_check(path)
    return infos, dict(meta)


def library_check(path: Path) -> None:
    """Open ``path`` with the safetensors library (header only): a second parser of the same bytes,
    the one the loaders of an output use. BadInput when it refuses the file. The header parser is the
    same for every framework; "numpy" opens the file without importing torch (``mxconv inspect``)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
    except SafetensorError as exc:
        raise BadInput(f"{path}: the safetensors library refuses the file ({exc})") from None


def read_tensor(info: TensorInfo, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Read one tensor's bytes from disk into a new CPU tensor (header already validated).

    Reads with ``readinto`` straight into the tensor's storage: one copy, no mmap page faults,
    and it works for every dtype (F8_E8M0, F4 included). ``rows=(r0, r1)``: only rows [r0, r1)
    of dim 0 (a contiguous byte range of the file), e.g. a group of experts of a fused stack.
    """
    import torch

    dtype = info.torch_dtype
    shape = info.shape
    if info.dtype == "F4" and shape:
        shape = (*shape[:-1], shape[-1] // 2)
    begin, nbytes = info.begin, info.nbytes
    if rows is not None:
        r0, r1 = rows
        if not shape or not 0 <= r0 <= r1 <= shape[0]:
            raise ValueError(f"rows {rows} of tensor {info.name!r} with shape {list(info.shape)}")
        row_bytes = nbytes // shape[0] if shape[0] else 0
        begin, nbytes, shape = begin + r0 * row_bytes, (r1 - r0) * row_bytes, (r1 - r0, *shape[1:])
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        mv = memoryview(buf.numpy()).cast("B")
        with open(info.file, "rb", buffering=0) as f:
            f.seek(begin)
            got = 0
            while got < nbytes:
                r = f.readinto(mv[got:])
                if not r:
                    raise BadInput(f"{info.file}: tensor {info.name!r} is truncated (read {got} of {nbytes} bytes)")
                got += r
    return buf.view(dtype).reshape(shape)


def iter_tensor_chunks(info: TensorInfo, chunk: int = 64 << 20):
    """Yield a tensor's raw bytes from its file in chunks of at most ``chunk`` bytes."""
    with open(info.file, "rb") as f:
        f.seek(info.begin)
        yield from read_exactly(f, info.nbytes, chunk, f"{info.file}: tensor {info.name!r} is truncated")
