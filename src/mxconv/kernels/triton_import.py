"""triton, imported optionally (CPU-only installs, macOS): ``triton`` and ``tl`` are None and
``TRITON_IMPORT_ERROR`` says why when it does not import. Every kernel module takes them from here."""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    TRITON_IMPORT_ERROR = exc


def interpreter_on() -> bool:
    """True under the Triton interpreter (``TRITON_INTERPRET=1``: kernels run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


__all__ = ["TRITON_IMPORT_ERROR", "interpreter_on", "tl", "triton"]
