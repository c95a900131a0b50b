"""triton, imported optionally (CPU-only installs, macOS): ``triton`` and ``tl`` are None and
``TRITON_IMPORT_ERROR`` says why when it does not import. Every kernel module takes them from here."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    TRITON_IMPORT_ERROR = exc


__all__ = ["TRITON_IMPORT_ERROR", "tl", "triton"]
