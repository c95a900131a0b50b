"""Fuzz the CLI with damaged inputs (issue 10, item 4): hundreds of seeded cases.

Each case copies a tiny checkpoint (a source, or an mxconv output), damages one thing — a
safetensors header (length shifted, entry dropped, shape/dtype/offset changed, key duplicated,
file truncated or extended, metadata retyped), the index, or ``mxconv.json`` (key deleted, type
changed, value changed) — and runs quantize / inspect / verify through the CLI. Every damage that
breaks a rule must give exit 2 (bad input) or 1 (verification failed) with a one-line message and
no traceback; nothing may give 3 (internal error), and only harmless edits (a changed value the
files cannot contradict) may give 0. verify of a damaged output fails it (1); other commands
refuse it as bad input (2).
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from mxconv.cli import app
from mxconv.source.st_format import ST_DTYPES
from support.checkpoints import ModelSizes, make_checkpoint
from support.workspace import copy_checkpoint
from test_strict_read import _library_accepts  # tests/ is on sys.path (pytest rootdir import mode)

runner = CliRunner()
INDEX = "model.safetensors.index.json"
HEADER_SEEDS = range(300)
INDEX_SEEDS = range(60)
MANIFEST_SEEDS = range(300)


def mx(*args: Any) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stderr


def assert_refused(code: int, err: str, allowed: tuple[int, ...], what: str) -> None:
    """Exit code in ``allowed``; a failure is explained on stderr, an error in exactly one line."""
    assert code in allowed, f"{what}: exit {code}, expected one of {allowed}\n{err}"
    assert "Traceback" not in err and "internal error" not in err, f"{what}\n{err}"
    if code == 2:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and len(errors[0]) > len("error: "), f"{what}: no one-line message\n{err}"
    elif code == 1:
        assert "FAIL" in err, f"{what}: verification failed without saying why\n{err}"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Tiny inputs: a gpt-oss bf16 source (two shards + index), its MXFP4 quantization, a trtllm
    repack and a two-rank marlin repack."""
    root = tmp_path_factory.mktemp("fuzz")
    make_checkpoint(root / "src", "gpt-oss-bf16", ModelSizes(num_layers=1, num_experts=2))
    for args in (("quantize", root / "src", root / "q4"),
                 ("repack", root / "q4", root / "k", "--backend", "trtllm"),
                 ("repack", root / "q4", root / "tp", "--backend", "marlin", "--tp", "2")):
        code, err = mx(*args, "--quiet", "--device", "cpu")
        assert code == 0, err
    return root


# ---- safetensors headers ------------------------------------------------------------------------


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _join(path: Path, raw: bytes, data: bytes, length: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def damage_shard(path: Path, rng: random.Random) -> str:
    """Break one rule of the format in ``path``; returns what was done (for the failure message)."""
    header, data = _split(path)
    meta = header.pop("__metadata__", None)
    names = sorted(header, key=lambda n: header[n]["data_offsets"])
    name = rng.choice(names)
    entry = header[name]
    kind = rng.choice(["length", "drop", "shape", "shape-type", "dtype", "offset", "duplicate", "truncate",
                       "extend", "metadata"])

    def dump() -> bytes:
        h = dict(header)
        if meta is not None:
            h["__metadata__"] = meta
        return json.dumps(h).encode()

    if kind == "length":
        raw = dump()
        delta = rng.choice([-1, 1]) * rng.randint(1, 24)
        _join(path, raw, data, len(raw) + delta)
    elif kind == "drop":
        del header[name]
        _join(path, dump(), data)
    elif kind == "shape":  # one more or one less element along a dimension: the byte count no longer fits
        shape = entry["shape"] or [1]
        d = rng.randrange(len(shape))
        shape[d] = shape[d] + 1 if shape[d] <= 1 or rng.random() < 0.5 else shape[d] - 1
        entry["shape"] = shape
        _join(path, dump(), data)
    elif kind == "shape-type":
        entry["shape"] = rng.choice([[True], [1.5], [-1], "4", None, [[2]]])
        _join(path, dump(), data)
    elif kind == "dtype":  # a dtype of another element size, or none known
        bits = ST_DTYPES[entry["dtype"]][1]
        entry["dtype"] = rng.choice([d for d, (_, b) in sorted(ST_DTYPES.items()) if b != bits] + ["Q7", "f32", ""])
        _join(path, dump(), data)
    elif kind == "offset":
        b, e = entry["data_offsets"]
        k = rng.randint(1, 7)
        which = rng.choice(["begin", "end", "both"])
        if which in ("begin", "both"):
            b = b + k if rng.random() < 0.5 or b < k else b - k
        if which in ("end", "both"):
            e = e + k if which == "end" else b + (entry["data_offsets"][1] - entry["data_offsets"][0])
        entry["data_offsets"] = [b, e]
        _join(path, dump(), data)
    elif kind == "duplicate":
        raw = dump()
        other = json.dumps({name: header[rng.choice(names)]})[1:-1].encode()
        raw = raw[:-1] + b", " + other + b"}"
        _join(path, raw, data)
    elif kind == "truncate":
        _join(path, dump(), data[: -rng.randint(1, min(64, len(data)))])
    elif kind == "extend":
        _join(path, dump(), data + bytes(rng.randint(1, 64)))
    else:  # metadata
        if meta is None:
            kind, entry["data_offsets"] = "offset", [entry["data_offsets"][0], entry["data_offsets"][1] + 1]
            _join(path, dump(), data)
        else:
            meta["format"] = rng.choice([1, None, ["pt"], {"a": "b"}, True])
            _join(path, dump(), data)
    return f"{kind} on {path.name}:{name}"


def _shards(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors")) + sorted(root.glob("rank-*/*.safetensors"))


@pytest.mark.parametrize("seed", HEADER_SEEDS)
def test_damaged_header(base: Path, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    which = ["src", "q4", "k", "tp"][seed % 4]
    d = copy_checkpoint(base / which, tmp_path / which)
    shard = rng.choice(_shards(d))
    what = f"seed {seed}: {which}: " + damage_shard(shard, rng)
    commands = [("inspect", d)] + ([("verify", d)] if which != "src" else [])
    if which in ("src", "q4"):
        commands.append(("quantize", d, tmp_path / "out", "--device", "cpu", "--format", "mxfp8"))
    for args in commands:
        code, err = mx(*args)
        assert_refused(code, err, (1,) if args[0] == "verify" else (2,), f"{what}; mxconv {args[0]}")
        assert shard.name in err, f"{what}: the message does not name the file\n{err}"
    assert not (tmp_path / "out").exists() or not (tmp_path / "out" / "mxconv.json").exists()
    if " duplicate " not in what:  # serde keeps one of two equal keys; every other rule is the library's too
        assert not _library_accepts(shard), f"{what}: the safetensors library accepts what mxconv refuses"


# ---- index ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", INDEX_SEEDS)
def test_damaged_index(base: Path, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    d = copy_checkpoint(base / "src", tmp_path / "src")
    index = json.loads((d / INDEX).read_text())
    wm = index["weight_map"]
    name = rng.choice(sorted(wm))
    shards = sorted(set(wm.values()))
    kind = rng.choice(["drop", "move", "ghost", "duplicate", "shard-path", "type"])
    text = None
    if kind == "drop":
        del wm[name]
    elif kind == "move":
        wm[name] = next(s for s in shards if s != wm[name])
    elif kind == "ghost":
        wm[name + ".ghost"] = rng.choice(shards)
    elif kind == "duplicate":
        text = json.dumps(index).replace('"weight_map": {', '"weight_map": {' + json.dumps(name) + ': "x.safetensors", ', 1)
    elif kind == "shard-path":
        wm[name] = rng.choice(["../" + wm[name], "/etc/" + wm[name], "missing.safetensors", ""])
    else:
        index["weight_map"] = rng.choice([list(wm), None, "model.safetensors", {name: 3}])
    (d / INDEX).write_text(text if text is not None else json.dumps(index))
    what = f"seed {seed}: index {kind} {name}"
    for args in (("quantize", d, tmp_path / "out", "--device", "cpu"), ("inspect", d)):
        code, err = mx(*args)
        assert_refused(code, err, (2,), f"{what}; mxconv {args[0]}")
        assert INDEX in err or ".safetensors" in err, f"{what}\n{err}"


# ---- manifests -----------------------------------------------------------------------------------

# Keys every reader relies on (contract.md plus what verify runs on): deleting or retyping one is
# always refused.
REQUIRED = [
    ("format_version",), ("tool_version",), ("command",), ("created",), ("source",), ("family",), ("kind",),
    ("weight_format",), ("scale_rounding",), ("backend",), ("activation",), ("tp_size",), ("layout",), ("model",),
    ("layers",), ("tensors",), ("source", "fingerprint"), ("source", "revision"),
    ("layout", "name"), ("layout", "version"), ("layout", "engine_compat"), ("layout", "hidden_size"),
    ("layout", "intermediate_size"), ("layout", "padded_hidden_size"), ("layout", "padded_intermediate_size"),
    ("layout", "w13_row_order"), ("layout", "kernel_params"),
    ("model", "family"), ("model", "num_layers"), ("model", "moe_layers"), ("model", "num_experts"), ("model", "top_k"),
    ("model", "hidden_size"), ("model", "intermediate_size"), ("model", "expert_format"), ("model", "row_order"),
    ("model", "has_expert_bias"), ("model", "routing"),
    ("layers", 0, "layer"), ("layers", 0, "module_prefix"), ("layers", 0, "router_weight"),
    ("tensors", "*", "file"), ("tensors", "*", "shape"), ("tensors", "*", "dtype"), ("tensors", "*", "sha256"),
]
_WRONG = ["7", 7, 2.5, True, [1], {"a": 1}, -3]
_NULLABLE = {"scale_rounding": str, "backend": str, "activation": str, "revision": str, "kernel_params": dict}


def _resolve(m: dict[str, Any], path: tuple[Any, ...], rng: random.Random) -> tuple[Any, Any, tuple[Any, ...]]:
    """(parent container, key, concrete path) of ``path`` in ``m`` ("*" = a random tensor)."""
    parent: Any = m
    concrete: list[Any] = []
    for i, key in enumerate(path):
        if key == "*":
            key = rng.choice(sorted(parent))
        concrete.append(key)
        if i < len(path) - 1:
            parent = parent[key]
    return parent, concrete[-1], tuple(concrete)


def _leaves(o: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ()
    for k, v in items:
        out.append(path + (k,))
        out.extend(_leaves(v, path + (k,)))
    return out


def _perturb(v: Any, rng: random.Random) -> Any:
    """Same type, another value."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return rng.choice([v + 1, v - 1, v * 2, 0])
    if isinstance(v, float):
        return rng.choice([v * 2, -v, 0.0])
    if isinstance(v, str):
        return rng.choice([v + "x", "", v[:-1]])
    if isinstance(v, list):
        return v[:-1] if v else [1]
    if isinstance(v, dict):
        return {}
    return 1


@pytest.mark.parametrize("seed", MANIFEST_SEEDS)
def test_damaged_manifest(base: Path, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    which = ["q4", "k", "tp"][seed % 3]
    d = copy_checkpoint(base / which, tmp_path / which)
    m = json.loads((d / "mxconv.json").read_text())
    kind = ["delete", "retype", "anything"][seed // 3 % 3]
    if kind == "anything":  # any key anywhere, any change: never an internal error
        path = rng.choice(_leaves(m))
        parent, key, _ = _resolve(m, path, rng)
        op = rng.choice(["delete", "retype", "value"])
        if op == "delete":
            parent.pop(key) if isinstance(parent, dict) else parent.pop(key)
        elif op == "retype":
            parent[key] = rng.choice([w for w in _WRONG if type(w) is not type(parent[key])] + [None])
        else:
            parent[key] = _perturb(parent[key], rng)
        allowed: tuple[int, ...] = (0, 1, 2)
        what = f"seed {seed}: {which}: {op} {list(path)}"
    else:
        parent, key, path = _resolve(m, rng.choice(REQUIRED), rng)
        if kind == "delete":
            del parent[key]
        else:
            declared = _NULLABLE.get(path[-1], type(parent[key]))  # a null field: its type when set
            parent[key] = rng.choice([w for w in _WRONG if type(w) is not declared] + ([] if path[-1] in _NULLABLE else [None]))
        allowed = (2,)  # 1 for verify: the output's manifest is damaged
        what = f"seed {seed}: {which}: {kind} {list(path)}"
    (d / "mxconv.json").write_text(json.dumps(m))
    commands = [("verify", d), ("inspect", d)]
    if which == "q4":  # an mxconv output as a source
        commands.append(("quantize", d, tmp_path / "out", "--device", "cpu", "--format", "mxfp8", "--quiet"))
    for args in commands:
        code, err = mx(*args)
        damaged = allowed == (2,)
        assert_refused(code, err, (1,) if damaged and args[0] == "verify" else allowed, f"{what}; mxconv {args[0]}")
        if damaged:
            assert "mxconv.json" in err and f"'{path[0]}" in err, f"{what}: field not named\n{err}"


def test_truncated_and_empty_manifest(base: Path, tmp_path: Path) -> None:
    d = copy_checkpoint(base / "k", tmp_path / "k")
    text = (d / "mxconv.json").read_text()
    for broken in (text[: len(text) // 2], "", "[]", "null", '{"format_version": 1}'):
        (d / "mxconv.json").write_text(broken)
        for cmd in ("verify", "inspect"):
            code, err = mx(cmd, d)
            assert_refused(code, err, (1,) if cmd == "verify" else (2,), f"manifest {broken[:20]!r}; mxconv {cmd}")
            assert "mxconv.json" in err
