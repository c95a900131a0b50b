"""The file names a checkpoint reader and the mxconv writer agree on.

Owned here, at the bottom of the stack, because reading a checkpoint (:mod:`mxconv.source.checkpoint`)
already needs every one of them; :mod:`mxconv.output` writes the same names.
"""

from __future__ import annotations

import re
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"  # the shard index: {"metadata": ..., "weight_map": {tensor: shard}}
MANIFEST_NAME = "mxconv.json"  # what the bytes of an mxconv output mean; written last (contract.md)
CONFIG_NAME = "config.json"  # the model's Hugging Face config
IN_PROGRESS = ".mxconv-in-progress"  # in an output directory while a run writes it (mxconv.source.in_progress)
LOCK_NAME = ".mxconv-lock"  # in an output directory: the one writer's lock (mxconv.output.lock)
WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|gguf)$")  # a weight file by its name (search): verify's stray check
RANK_DIR = re.compile(r"rank-(\d+)")  # a TP output's rank directory (fullmatch; group 1: the rank)


def rank_dir_name(rank: int) -> str:
    """The directory (and manifest key prefix) of TP rank ``rank``: ``rank-N``."""
    return f"rank-{rank}"


def rank_dirs(root: Path, tp_size: int) -> list[Path]:
    """The directories an output of ``tp_size`` ranks writes its checkpoints to: ``root`` itself
    without tensor parallelism, else ``root/rank-0`` .. ``root/rank-{tp_size - 1}``."""
    return [root] if tp_size == 1 else [root / rank_dir_name(r) for r in range(tp_size)]
