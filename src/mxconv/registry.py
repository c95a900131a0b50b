"""The plug-in tables (layout backends in :mod:`mxconv.layouts`, model families in
:mod:`mxconv.families`): name -> a ``"module:attribute"`` string, imported on first use (so ``--help``
imports no backend and no torch), or the object itself for plug-ins and tests. Imports nothing heavy."""

from __future__ import annotations

import importlib
from typing import Any


def register(table: dict[str, Any], what: str, name: str, entry: Any) -> None:
    """Add ``entry`` under ``name``; ValueError if the name is taken (``what``: "backend", "family")."""
    if name in table:
        raise ValueError(f"{what} {name!r} is registered already")
    table[name] = entry


def resolve(table: dict[str, Any], name: str) -> Any:
    """The object registered under ``name``, importing a ``"module:attribute"`` entry."""
    return resolve_entry(table[name])


def resolve_entry(entry: Any) -> Any:
    """``entry`` itself, or the object a ``"module:attribute"`` string names (imported now)."""
    if not isinstance(entry, str):
        return entry
    module, attr = entry.split(":")
    return getattr(importlib.import_module(module), attr)
