"""Reading the small files of a checkpoint as untrusted input, and writing mxconv's own as strict JSON.

Every JSON file mxconv reads (``config.json``, ``model.safetensors.index.json``, ``mxconv.json``) and
every safetensors header comes from a directory mxconv did not make, or one that may have been edited
since. Two rules hold for all of them, so that no such file can hang a command, exhaust its memory or
end it in an internal error:

* **Regular files of bounded size** (:func:`open_regular`, :func:`read_bounded`, on
  :mod:`mxconv.source.regular_files`): the path is ``stat``-ed before it is opened (a symbolic link is
  followed: the Hugging Face cache links every file of a snapshot to its blob), and anything but a
  regular file (a FIFO, ``/dev/zero``, a directory, a socket) is refused without being opened; the
  file is opened non-blocking and checked again, and at most ``limit`` bytes are read
  (:data:`MAX_JSON_BYTES` for a JSON file).
* **Strict JSON** (:func:`loads_strict`): malformed text, a key repeated within one object, the
  ``NaN`` / ``Infinity`` literals, a number that overflows a double, an integer beyond 64 bits and
  nesting deeper than :data:`MAX_NESTING` levels are refused, naming the file and the rule (Python's
  parser would accept the first four silently and end the deepest nesting in a RecursionError).

A violation is :class:`~mxconv.errors.BadInput` (exit 2); ``mxconv verify`` reports the same
violation in the output it checks as a failed verification (exit 1). :func:`dumps_strict` is the
writing side: mxconv's own JSON files are standard JSON, never ``NaN``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, BinaryIO

from mxconv.errors import BadInput
from mxconv.source import regular_files

MAX_JSON_BYTES = 64 << 20  # config.json, index, mxconv.json: the largest real ones are a few MB
MAX_NESTING = 64  # real configs nest 4 or 5 levels; Python's parser gives up near 1000
_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a 64-bit signed or unsigned integer holds


def _not_regular(path: Path, what: str, kind: str) -> BadInput:
    return BadInput(f"{path}: {what} is {kind}, not a regular file; mxconv reads a checkpoint's files only from "
                    "regular files (or links to them)")


def open_regular(path: str | Path, what: str, *, follow: bool = True) -> tuple[BinaryIO, int]:
    """``path`` opened for reading and its size, once it is known to be a regular file (a link to one
    counts, unless ``follow`` is False): :func:`mxconv.source.regular_files.open_regular`.
    FileNotFoundError where nothing is there; BadInput for anything else that is not a regular file,
    refused before it is opened (a FIFO would block the open, a device read forever), and for a file
    that cannot be opened."""
    path = Path(path)
    try:
        return regular_files.open_regular(path, follow=follow)
    except regular_files.NotRegular as exc:
        raise _not_regular(path, what, exc.kind) from None
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise BadInput(f"{path}: cannot read {what} ({exc.strerror or exc})") from None


def read_bounded(path: str | Path, what: str, limit: int = MAX_JSON_BYTES, *, follow: bool = True) -> bytes:
    """The bytes of regular file ``path`` (:func:`open_regular`), BadInput where it holds more than
    ``limit`` bytes (checked on its size, and on what is read: a file that grows is cut short)."""
    f, size = open_regular(path, what, follow=follow)
    with f:
        if size > limit:
            raise BadInput(f"{path}: {what} is {size} bytes, more than the {limit} bytes mxconv reads of such a file")
        try:
            data = regular_files.read_at_most(f, limit)
        except OSError as exc:
            raise BadInput(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise BadInput(f"{path}: {what} grew past {limit} bytes while it was read")
    return data


class _Refused(ValueError):
    """A rule of :func:`loads_strict` that Python's parser does not enforce, broken at ``what``."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text} is out of the range of a double")
    return value


def _int64(text: str) -> int:
    value = int(text)
    if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
        raise _Refused(f"integer {text[:24]}{'...' if len(text) > 24 else ''} does not fit in 64 bits")
    return value


def _nesting(doc: Any, limit: int) -> int:
    """How deeply ``doc``'s arrays and objects nest (1 for a flat one), counted up to ``limit`` + 1."""
    deepest, stack = 0, [(doc, 1)] if isinstance(doc, (dict, list)) else []
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > limit:
            break
        items = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    return deepest


def loads_strict(text: str | bytes, where: str, problem: str, *, document: bool = True) -> Any:
    """``text`` parsed as strict JSON (the module docstring's rules); BadInput
    ``"{where}: {problem} (...)"`` naming the rule it breaks. ``document=False`` (a safetensors header,
    whose entries are checked field by field after this) skips the nesting and integer bounds, which
    cost time on a header of 100,000 tensors and guard nothing its own checks do not."""
    hooks: dict[str, Any] = {"object_pairs_hook": _unique_pairs, "parse_constant": _constant, "parse_float": _finite_float}
    if document:
        hooks["parse_int"] = _int64
    try:
        doc = json.loads(text, **hooks)
    except _Refused as exc:
        raise BadInput(f"{where}: {problem} ({exc})") from None
    except RecursionError:
        raise BadInput(f"{where}: {problem} (nested too deeply for a JSON reader; at most {MAX_NESTING} levels)") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"{where}: {problem} (not UTF-8 text: {exc.reason} at byte {exc.start})") from None
    except ValueError as exc:  # json.JSONDecodeError, or an integer of more digits than Python converts
        raise BadInput(f"{where}: {problem} (invalid JSON: {exc})") from None
    if document and _nesting(doc, MAX_NESTING) > MAX_NESTING:
        raise BadInput(f"{where}: {problem} (nested more than {MAX_NESTING} levels deep)")
    return doc


def read_json(path: str | Path, what: str, problem: str | None = None) -> Any:
    """The strict JSON document in regular file ``path`` (at most :data:`MAX_JSON_BYTES`): BadInput
    ``"{path}: {what} is missing"`` where there is none, ``"{path}: {problem} (...)"`` (default
    ``malformed {what}``) naming the rule it breaks."""
    try:
        data = read_bounded(path, what)
    except FileNotFoundError:
        raise BadInput(f"{path}: {what} is missing") from None
    return loads_strict(data, str(path), problem or f"malformed {what}")


def dumps_strict(obj: Any, **options: Any) -> str:
    """``json.dumps`` that never writes ``NaN`` or ``Infinity`` (ValueError instead: a value the
    plan's checks should have refused, so a bug)."""
    return json.dumps(obj, allow_nan=False, **options)
