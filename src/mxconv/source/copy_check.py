"""NaN/Inf in tensors copied byte for byte (embeddings, attention, norms, routers), found from
their raw bytes.

A tensor mxconv copies as is is never decoded, so its NaN/Inf are found from bit patterns:
every exponent bit set (E4M3: the single NaN pattern 0x7F; E8M0 scales: 0xFF). numpy only: the
check runs beside the writer's hashing on a 64 MiB chunk at a time (an AND and a max per 8 MiB of
the chunk: ~7 ms per 64 MiB on the 2-core CI machine).
"""

from __future__ import annotations

import numpy as np

from mxconv.errors import BadInput
from mxconv.source.st_format import TensorInfo, element_bytes

SCAN_BYTES = 8 << 20  # the scan's temporary: a 64 MiB chunk is looked at 8 MiB at a time

# safetensors float dtype -> (integer view, mask of the bits but the sign, smallest magnitude pattern
# that is not a finite number)
NONFINITE_BITS: dict[str, tuple[type, int, int]] = {
    "BF16": (np.int16, 0x7FFF, 0x7F80),
    "F16": (np.int16, 0x7FFF, 0x7C00),
    "F32": (np.int32, 0x7FFFFFFF, 0x7F800000),
    "F64": (np.int64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
    "F8_E4M3": (np.uint8, 0x7F, 0x7F),
    "F8_E5M2": (np.uint8, 0x7F, 0x7C),
    "F8_E8M0": (np.uint8, 0xFF, 0xFF),  # E8M0 scales: 0xFF is NaN, the only byte that is not a number
}


def first_nonfinite_bytes(data: bytes | memoryview, st_dtype: str) -> int | None:
    """Element position of the first NaN/Inf in raw little-endian ``data`` of safetensors dtype
    ``st_dtype`` (bit patterns only: nothing is converted), or None; None for non-float dtypes.
    A trailing partial element (a short read of a truncated file) is left to the reader to report."""
    spec = NONFINITE_BITS.get(st_dtype)
    if spec is None:
        return None
    itype, mask, first_bad = spec
    size = np.dtype(itype).itemsize
    whole = len(data) - len(data) % size
    if not whole:
        return None
    bits = np.frombuffer(memoryview(data)[:whole], dtype=np.dtype(itype).newbyteorder("<"))
    step = max(1, SCAN_BYTES // size)
    magnitude = np.empty(min(step, len(bits)), dtype=bits.dtype)  # one small temporary, reused
    for start in range(0, len(bits), step):
        part = bits[start : start + step]
        m = np.bitwise_and(part, mask, out=magnitude[: len(part)])
        if int(m.max()) >= first_bad:
            return start + int(np.flatnonzero(m >= first_bad)[0])
    return None


def nonfinite_name(data: bytes | memoryview, st_dtype: str, pos: int) -> str:
    """What the non-finite element ``pos`` of raw ``data`` is, in the words the layer readers use:
    "nan", "inf", "-inf", or "E8M0 NaN scale byte 0xFF"."""
    itype, mask, first_bad = NONFINITE_BITS[st_dtype]
    size = np.dtype(itype).itemsize
    raw = int.from_bytes(bytes(memoryview(data)[pos * size : (pos + 1) * size]), "little")
    if st_dtype == "F8_E8M0":
        return "E8M0 NaN scale byte 0xFF"
    if st_dtype == "F8_E4M3" or (raw & mask) != first_bad:  # E4M3 has no infinities
        return "nan"
    return "-inf" if raw > mask else "inf"


def refuse_nonfinite_copy(src: TensorInfo, offset: int, chunk: bytes) -> None:
    """BadInput for a NaN/Inf in bytes [offset, offset + len(chunk)) of ``src``, a tensor copied
    byte for byte; the message names the file, the tensor and the element."""
    pos = first_nonfinite_bytes(chunk, src.dtype)
    if pos is not None:
        flat = offset // element_bytes(src.dtype) + pos
        index = [int(i) for i in np.unravel_index(flat, src.shape)] if src.shape else []
        raise BadInput(
            f"{src.file}: non-finite value {nonfinite_name(chunk, src.dtype, pos)} in {src.name} {index} "
            "(a tensor mxconv copies as is); "
            "fix the source, or set QuantOptions.allow_nonfinite to carry it over"
        )
