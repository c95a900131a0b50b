"""Backend layout registry. Adding a backend = one new module + one line in ``_REGISTRY``."""

from __future__ import annotations

import importlib

from mxconv.errors import BadInput
from mxconv.layouts.base import CanonicalExperts, Layout, LayoutSizes, TensorSpec

# backend name -> "module:attribute" of its Layout instance (imported lazily).
_REGISTRY: dict[str, str] = {
    "trtllm": "mxconv.layouts.trtllm:LAYOUT",
    "marlin": "mxconv.layouts.marlin:LAYOUT",
    "aiter": "mxconv.layouts.aiter:LAYOUT",
}

BACKENDS: tuple[str, ...] = tuple(_REGISTRY)


def get_layout(name: str) -> Layout:
    """The registered Layout for backend ``name``; BadInput listing the known ones otherwise."""
    if name not in _REGISTRY:
        raise BadInput(f"unknown backend {name!r}; supported backends: {', '.join(BACKENDS)}")
    module, attr = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["BACKENDS", "CanonicalExperts", "Layout", "LayoutSizes", "TensorSpec", "get_layout"]
