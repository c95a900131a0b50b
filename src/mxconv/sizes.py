"""Byte counts as people write and read them: ``--max-shard-size``/``--max-memory`` values parsed
(:func:`parse_size`) and sizes shown in messages and tables (:func:`human_bytes`)."""

from __future__ import annotations

import math

from mxconv.errors import BadInput


def human_bytes(n: float) -> str:
    """Bytes in the largest decimal unit that keeps a leading digit (as huggingface-cli shows them)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """'5GB' / '500MB' / '2GiB' / '1000000' -> bytes (decimal units as huggingface uses them);
    errors name ``flag``."""
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
        raise BadInput(f"{flag}: cannot parse {text!r} (use e.g. 5GB, 500MB, 2GiB)") from None
    if not math.isfinite(value) or value * mult < 1:
        raise BadInput(f"{flag} must be at least one byte, got {text!r}")
    return int(value * mult)
