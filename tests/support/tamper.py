"""Changing a checkpoint's stored bytes in place, the way a corruption or a planted bug would."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import torch

from mxconv.source.st_format import read_header, read_tensor

__all__ = ["patch_tensor"]


def patch_tensor(ckpt_dir: Path, name: str, fn: Callable[[torch.Tensor], torch.Tensor], fix_manifest: bool) -> None:
    """Rewrite tensor ``name``'s bytes in place with ``fn(tensor)`` (same shape and dtype).

    ``fix_manifest`` puts the new bytes' sha256 into ``mxconv.json``, so that only a value or
    layout check can catch the change.
    """
    index = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())
    f = ckpt_dir / index["weight_map"][name]
    info = read_header(f)[0][name]
    t = fn(read_tensor(info).clone())
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert len(raw) == info.nbytes
    with open(f, "r+b") as fh:
        fh.seek(info.begin)
        fh.write(raw)
    if fix_manifest:
        m = json.loads((ckpt_dir / "mxconv.json").read_text())
        m["tensors"][name]["sha256"] = hashlib.sha256(raw).hexdigest()
        (ckpt_dir / "mxconv.json").write_text(json.dumps(m))
