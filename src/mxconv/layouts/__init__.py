"""Backend layout registry. Adding a backend = one new module + one line in ``_REGISTRY``.

Each entry names a :class:`~mxconv.layouts.base.LayoutBase` instance, imported on first use, so
``--help`` and ``inspect`` never import a backend they do not touch. Code outside this package asks
:func:`backend_names` and :func:`get_layout`; nothing else lists backends by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.errors import BadInput
from mxconv.registry import register, resolve

if TYPE_CHECKING:
    from mxconv.layouts.base import Layout

# The registry itself imports no torch (``mxconv --help`` lists the backends without it); the
# shared types of ``base`` are re-exported lazily.
_BASE_NAMES = ("CanonicalExperts", "EmptyOptions", "Layout", "LayoutBase", "LayoutOption", "LayoutOptions", "LayoutSizes",
               "TensorSpec")


def __getattr__(name: str) -> Any:
    if name in _BASE_NAMES:
        from mxconv.layouts import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# backend name -> "module:attribute" of its Layout instance (imported lazily), or the instance.
_REGISTRY: dict[str, Any] = {
    "trtllm": "mxconv.layouts.trtllm:LAYOUT",
    "marlin": "mxconv.layouts.marlin:LAYOUT",
    "aiter": "mxconv.layouts.aiter:LAYOUT",
    "triton": "mxconv.layouts.triton:LAYOUT",
    "deepgemm": "mxconv.layouts.deepgemm:LAYOUT",
    "cutlass": "mxconv.layouts.cutlass:LAYOUT",
    "humming": "mxconv.layouts.humming:LAYOUT",
    "cpu": "mxconv.layouts.cpu:LAYOUT",
    "flashinfer-cutlass": "mxconv.layouts.flashinfer_cutlass:LAYOUT",
    "xpu": "mxconv.layouts.xpu:LAYOUT",
}


def backend_names() -> tuple[str, ...]:
    """Every registered backend name, in registration order."""
    return tuple(_REGISTRY)


def register_layout(name: str, layout: Any) -> None:
    """Register ``layout`` (an instance, or a ``"module:attribute"`` string) under ``name``.

    The built-in backends are the lines of ``_REGISTRY``; this is for plug-ins and tests.
    """
    register(_REGISTRY, "backend", name, layout)


def unregister_layout(name: str) -> None:
    """Remove a backend added with :func:`register_layout` (tests clean up with it)."""
    _REGISTRY.pop(name, None)


def get_layout(name: str) -> "Layout":
    """The registered Layout for backend ``name``; BadInput listing the known ones otherwise."""
    if name not in _REGISTRY:
        raise BadInput(f"unknown backend {name!r}; supported backends: {', '.join(backend_names())}")
    return resolve(_REGISTRY, name)


def options_help() -> str:
    """Every backend's options, one line each, for ``mxconv repack --help``."""
    lines = []
    for name in backend_names():
        opts = get_layout(name).options
        lines.append(f"{name}: " + ("; ".join(o.describe() for o in opts) if opts else "no options"))
    return "\n".join(lines)


__all__ = [
    "CanonicalExperts", "EmptyOptions", "Layout", "LayoutBase", "LayoutOption", "LayoutOptions", "LayoutSizes", "TensorSpec",
    "backend_names", "get_layout", "options_help", "register_layout", "unregister_layout",
]
