"""The file names a checkpoint reader and the mxconv writer agree on.

Owned here, at the bottom of the stack, because reading a checkpoint (:mod:`mxconv.source.checkpoint`)
already needs every one of them; :mod:`mxconv.output` writes the same names.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mxconv.errors import BadInput, OutputDamaged

INDEX_NAME = "model.safetensors.index.json"  # the shard index: {"metadata": ..., "weight_map": {tensor: shard}}
MANIFEST_NAME = "mxconv.json"  # what the bytes of an mxconv output mean; written last (contract.md)
CONFIG_NAME = "config.json"  # the model's Hugging Face config
IN_PROGRESS = ".mxconv-in-progress"  # in an output directory while a run writes it (mxconv.source.in_progress)
LOCK_NAME = ".mxconv-lock"  # in an output directory: the one writer's lock (mxconv.output.lock)
WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|gguf)$")  # a weight file by its name (search): verify's stray check
RANK_DIR = re.compile(r"rank-(\d+)")  # a TP output's rank directory (fullmatch; group 1: the rank)


PLAIN_RULE = "a plain file name (no '/' or '\\', not '..', not absolute, no leading '.')"


def is_plain_name(name: Any) -> bool:
    """Whether ``name`` can only mean a file directly inside its directory: a non-empty string without a
    directory part ('/' or '\\'), a NUL, or a leading '.' (which '.', '..', hidden files and mxconv's
    temporary files have). Every file name read from an index, a manifest or a rank listing must be
    one; what it names may be a symbolic link (the Hugging Face cache links a snapshot's files to its
    blobs), but the name itself never leaves the directory."""
    return isinstance(name, str) and bool(name) and not name.startswith(".") and not any(c in name for c in "/\\\0")


def plain_name(name: Any, where: str) -> str:
    """``name`` when :func:`is_plain_name`, else BadInput ``"{where}: file name ... is not a plain file name"``."""
    if not is_plain_name(name):
        raise BadInput(f"{where}: file name {name!r} is not {PLAIN_RULE}; a checkpoint's files lie in its own directory")
    return name


OWN_FILE_RULE = ("mxconv writes no links into an output, so its rank directories and the files its manifest names "
                 "are never links, and never lead outside it")


def output_path_problem(root: Path, name: str) -> str | None:
    """Why ``name`` (a rank directory, or a file the manifest names, relative to the output at ``root``,
    parts joined by '/') is not one of the output's own to read; None when it is. It must be a path of
    plain names (:func:`is_plain_name`) none of which is a symbolic link below ``root``: with no link
    and no '..', it cannot resolve outside ``root``. (A source's files may be links, the Hugging Face
    cache's; an output's are not, and a link there would let a read leave the output.) Checks the
    disk: one ``lstat`` per part."""
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or not all(is_plain_name(part) for part in parts):
        return f"{name!r} is not a path of plain names inside the output"
    p = root
    for part in parts:
        p = p / part
        if p.is_symlink():
            return f"{p} is a symbolic link ({OWN_FILE_RULE})"
    return None


def output_path(root: Path, name: str, where: str) -> Path:
    """``root / name`` when :func:`output_path_problem` finds nothing, else OutputDamaged
    ``"{where}: {problem}"`` (exit 1 in ``verify``, a BadInput where the output is read)."""
    problem = output_path_problem(root, name)
    if problem:
        raise OutputDamaged(f"{where}: {problem}")
    return root / name


def rank_dir_name(rank: int) -> str:
    """The directory (and manifest key prefix) of TP rank ``rank``: ``rank-N``."""
    return f"rank-{rank}"


def rank_dirs(root: Path, tp_size: int) -> list[Path]:
    """The directories an output of ``tp_size`` ranks writes its checkpoints to: ``root`` itself
    without tensor parallelism, else ``root/rank-0`` .. ``root/rank-{tp_size - 1}``."""
    return [root] if tp_size == 1 else [root / rank_dir_name(r) for r in range(tp_size)]


def manifest_file_problem(key: str, file: Any, tp_size: int) -> str | None:
    """Why ``file``, the file a manifest names for its tensor entry ``key``, is not one an output of
    ``tp_size`` ranks holds (None when it is): a plain file name of the output's directory, or with
    tensor parallelism ``rank-R/`` and a plain file name, where ``key`` is ``rank-R/<tensor>``
    for a rank R below ``tp_size``."""
    if tp_size == 1:
        return None if is_plain_name(file) else f"is {file!r}, not {PLAIN_RULE}"
    prefix, sep, _ = key.partition("/")
    m = RANK_DIR.fullmatch(prefix)
    if not sep or m is None or rank_dir_name(int(m.group(1))) != prefix or int(m.group(1)) >= tp_size:
        return (f"is {file!r}, but the key names no rank directory (a tp_size {tp_size} output keys its tensors "
                f"'rank-R/<name>', R < {tp_size})")
    rank_dir, sep, name = file.partition("/") if isinstance(file, str) else ("", "", "")
    if rank_dir != prefix or not sep or not is_plain_name(name):
        return f"is {file!r}, not '{prefix}/' followed by {PLAIN_RULE}"
    return None
