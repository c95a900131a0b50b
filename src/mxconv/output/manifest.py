"""Writing ``mxconv.json``: what the bytes of a converted checkpoint mean (see contract.md).

Written last and atomically; its presence means the output is complete. The typed manifest, its
reading and its validation are :mod:`mxconv.source.manifest`: what is written is a
:class:`~mxconv.source.manifest.Manifest`, so it passed the checks every reader applies.
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any

from mxconv import __version__
from mxconv.output.files import atomic_write_json
from mxconv.output.writer import WrittenTensor
from mxconv.source.file_names import IN_PROGRESS, MANIFEST_NAME
from mxconv.source.json_files import dumps_strict
from mxconv.source.manifest import FORMAT_VERSION, Manifest


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """The manifest keys that say which mxconv run wrote an output (its first keys): the format and
    tool versions, the command (``argv``, default ``sys.argv``) and the time, to the second (UTC)."""
    return {
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "command": list(argv if argv is not None else sys.argv),
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
    }


def tensor_table(written: dict[str, WrittenTensor], prefix: str = "") -> dict[str, dict[str, Any]]:
    """Manifest ``tensors`` entries; ``prefix`` (e.g. 'rank-1/') is prepended to file names."""
    return {
        name: {"file": prefix + w.file, "shape": w.shape, "dtype": w.dtype, "sha256": w.sha256, "role": w.role}
        for name, w in written.items()
    }


def manifest_of(doc: dict[str, Any]) -> Manifest:
    """``doc`` (a manifest being built: enum values, tuples) as the JSON it will be written as, checked
    and typed as every reader reads it (:meth:`~mxconv.source.manifest.Manifest.parse`)."""
    return Manifest.parse(json.loads(dumps_strict(doc)), MANIFEST_NAME)


def write_manifest(out_dir: Path, manifest: Manifest) -> None:
    """Write mxconv.json (``manifest``'s JSON, :meth:`~mxconv.source.manifest.Manifest.as_written`)
    atomically, then drop the in-progress marker."""
    atomic_write_json(out_dir / MANIFEST_NAME, manifest.as_written())  # the writer: the one JSON of a Manifest
    (out_dir / IN_PROGRESS).unlink(missing_ok=True)
