"""Checkpoints made once per test session, and the copies a test may change.

:class:`MadeCheckpoints` (the session fixture ``made`` in ``tests/conftest.py``) makes each tiny
source with :func:`support.checkpoints.make_checkpoint` and each ``mxconv quantize`` / ``repack``
output through the in-process CLI (:func:`support.cli.mx`), once per session, keyed by what made
it: test files that need the same gpt-oss bf16 source, its MXFP4 quantization or a trtllm repack of
that share one copy on disk. What it returns is read-only by convention: a test that corrupts,
deletes or rewrites files works on :func:`copy_checkpoint`'s copy in its own ``tmp_path``.
:func:`link_workspace` gives a test module the folder of names it reads (``ws / "gpt-q4"``), each
a symbolic link to the shared checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import fields
import shutil
from pathlib import Path
from typing import Any

from support.checkpoints import GroundTruth, ModelSizes, make_checkpoint
from support.cli import mx

__all__ = ["MadeCheckpoints", "copy_checkpoint", "link_workspace"]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A full copy of checkpoint folder ``src`` (rank folders included) at ``dst``; returns ``dst``."""
    shutil.copytree(src, dst)
    return dst


def link_workspace(root: Path, checkpoints: dict[str, Path]) -> Path:
    """Folder ``root`` holding a link ``root / name`` to each checkpoint; returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for name, target in checkpoints.items():
        (root / name).symlink_to(target, target_is_directory=True)
    return root


def _folder_name(*parts: object) -> str:
    """A readable folder name for the options that made a checkpoint."""
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", "-".join(map(str, parts)))


class MadeCheckpoints:
    """Sources by (kind, make_checkpoint options) and CLI outputs by (command, input, options),
    each made once under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sources: dict[tuple[Any, ...], GroundTruth] = {}
        self.outputs: dict[tuple[str, ...], Path] = {}

    def source(self, kind: str, sizes: ModelSizes = ModelSizes(), **options: Any) -> GroundTruth:
        """``make_checkpoint(folder, kind, sizes, **options)``, made on first use; ``.path`` is the folder."""
        key = (kind, sizes, *sorted(options.items()))
        if key not in self.sources:
            given = {f.name: getattr(sizes, f.name) for f in fields(sizes) if getattr(sizes, f.name) != f.default}
            folder = self.root / _folder_name(kind, *(f"{k}={v}" for k, v in sorted({**given, **options}.items())))
            self.sources[key] = make_checkpoint(folder, kind, sizes, **options)
        return self.sources[key]

    def quantize(self, src: Path, *options: object) -> Path:
        """``mxconv quantize SRC OUT OPTIONS... --device cpu --quiet``'s OUT."""
        return self.convert("quantize", src, *options)

    def repack(self, src: Path, backend: str, *options: object) -> Path:
        """``mxconv repack SRC OUT --backend BACKEND OPTIONS... --device cpu --quiet``'s OUT."""
        return self.convert("repack", src, "--backend", backend, *options)

    def convert(self, command: str, src: Path, *options: object) -> Path:
        """``mxconv COMMAND SRC OUT OPTIONS... --device cpu --quiet``'s OUT, made on first use."""
        key = (command, str(src), *map(str, options))
        if key not in self.outputs:
            out = self.root / _folder_name(f"{len(self.outputs):02d}", command, *options)
            code, _, err = mx(command, src, out, *options, "--device", "cpu", "--quiet")
            assert code == 0, f"mxconv {' '.join(key)} failed ({code}): {err}"
            self.outputs[key] = out
        return self.outputs[key]
