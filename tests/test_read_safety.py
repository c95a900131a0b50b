"""What mxconv reads, it reads inside the checkpoint, from regular files, as strict JSON (issue 29,
reproductions 2, 6, 7 and 8).

* File names from a manifest, an index or a rank listing are plain names inside their directory:
  the loader (``resolve_layer``, ``read_layer_tensors``, ``load_model``) refuses a manifest that
  names ``../elsewhere/x.safetensors`` or an absolute path, as ``verify`` does (exit 1) and
  ``inspect`` (exit 2); the loader and verify check where a tensor is with one function.
* JSON of any nesting depth, with a repeated key, a ``NaN`` or a number that overflows is bad input
  (exit 2), or damage of the output verify checks (exit 1); never an internal error (3).
* Config values out of range (the SwiGLU limit and alpha, routed scaling, epsilon, RoPE) stop a
  conversion at plan time naming config.json and the field; mxconv's own JSON is strict.
* A FIFO, a device or an oversized file where config.json, the index, mxconv.json or a shard
  should be is refused at once. Those cases run the CLI in a child process with a time and memory
  limit, so that a regression fails instead of hanging or exhausting the machine.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import mxconv
from mxconv.engines.loader import read_layer_tensors, resolve_layer
from mxconv.engines.model_load import load_model
from mxconv.errors import BadInput, OutputDamaged
from mxconv.source.checkpoint import open_checkpoint
from mxconv.source.file_names import is_plain_name, manifest_file_problem
from mxconv.source.json_files import MAX_NESTING, dumps_strict, loads_strict, read_json
from mxconv.source.manifest import Manifest, load_manifest
from mxconv.source.st_format import read_header
from mxconv.examples import ModelSizes
from support.cli import mx
from support.workspace import MadeCheckpoints, copy_checkpoint, link_workspace

INDEX = "model.safetensors.index.json"
DEEP = 100_000  # levels of '[': far past Python's recursion limit


@pytest.fixture(scope="module")
def outs(made: MadeCheckpoints, tmp_path_factory) -> Path:
    """A gpt-oss bf16 source, its MXFP4 quantization, a marlin repack and a two-rank one."""
    src = made.source("gpt-oss-bf16", ModelSizes(hidden_size=128, intermediate_size=96)).path
    q4 = made.quantize(src)
    return link_workspace(tmp_path_factory.mktemp("read-safety"), {
        "src": src, "q4": q4, "marlin": made.repack(q4, "marlin"), "tp": made.repack(q4, "marlin", "--tp", "2")})


def _edit_json(path: Path, fn: Callable[[Any], Any]) -> None:
    doc = json.loads(path.read_text())
    out = fn(doc)
    path.write_text(json.dumps(doc if out is None else out))


def _insert(path: Path, text: str) -> None:
    """Put ``"extra": <text>`` first in the JSON object of ``path`` (its text otherwise unchanged)."""
    body = path.read_text().lstrip()
    assert body.startswith("{")
    path.write_text('{"extra": ' + text + ", " + body[1:])


def _clean(code: int, err: str) -> None:
    assert "Traceback" not in err and "internal error" not in err, err


# ---- file names: a plain name inside the directory, everywhere (reproduction 2) ----------------


def test_plain_names() -> None:
    for ok in ("model-00001-of-00002.safetensors", "config.json", "rank-1", "a b.safetensors"):
        assert is_plain_name(ok), ok
    for bad in ("", ".", "..", "../x.safetensors", "/etc/passwd", "a/b", "a\\b", ".hidden", "a\0b", None, 3):
        assert not is_plain_name(bad), bad
    assert manifest_file_problem("w", "x.safetensors", 1) is None
    assert manifest_file_problem("rank-1/w", "rank-1/x.safetensors", 2) is None
    assert "not a plain file name" in manifest_file_problem("w", "../x.safetensors", 1)
    assert manifest_file_problem("rank-0/w", "rank-1/x.safetensors", 2)  # another rank's file
    assert manifest_file_problem("rank-2/w", "rank-2/x.safetensors", 2)  # no such rank
    assert manifest_file_problem("rank-01/w", "rank-01/x.safetensors", 2)  # not the rank's directory
    assert manifest_file_problem("rank-0/w", "rank-0/../../x.safetensors", 2)


def _point_outside(out: Path, how: str) -> tuple[str, str]:
    """Copy the shard holding layer 0's w13_weight out of ``out`` (to ``out/../elsewhere``) and make
    the manifest name the copy for each of its tensors: (tensor, the file name the manifest now gives)."""
    m = json.loads((out / "mxconv.json").read_text())
    name = "model.layers.0.mlp.experts.w13_weight"
    shard = m["tensors"][name]["file"]
    elsewhere = out.parent / "elsewhere"
    elsewhere.mkdir()
    shutil.copyfile(out / shard, elsewhere / shard)
    named = f"../elsewhere/{shard}" if how == "dotdot" else str(elsewhere / shard)
    for entry in m["tensors"].values():
        if entry["file"] == shard:
            entry["file"] = named
    (out / "mxconv.json").write_text(json.dumps(m))
    return name, named


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_loader_refuses_a_manifest_that_names_a_file_outside_the_output(outs: Path, tmp_path: Path, how: str) -> None:
    out = copy_checkpoint(outs / "marlin", tmp_path / "out")
    name, named = _point_outside(out, how)
    rule = rf"mxconv.json: malformed manifest: field 'tensors\.{name}\.file' is '{re.escape(named)}', not a plain file name"
    with pytest.raises(OutputDamaged, match=rule):
        read_layer_tensors(resolve_layer(out, 0), "cpu", check_hashes=True)
    with pytest.raises(OutputDamaged, match=rule):
        load_model(out, device="cpu", check_hashes=True)
    # a manifest an integration hands over is a parsed one: the same check
    m = json.loads((out / "mxconv.json").read_text())
    with pytest.raises(OutputDamaged, match=rule):
        resolve_layer(out, 0, manifest=Manifest.parse(m, out / "mxconv.json"))
    code, _, err = mx("verify", out, "--quiet")
    assert code == 1 and f"field 'tensors.{name}.file' is '{named}'" in err, err
    code, _, err = mx("inspect", out)
    assert code == 2 and f"field 'tensors.{name}.file'" in err, err


def test_loader_refuses_another_ranks_file(outs: Path, tmp_path: Path) -> None:
    out = copy_checkpoint(outs / "tp", tmp_path / "tp")
    key = "rank-0/model.layers.0.mlp.experts.w13_weight"
    _edit_json(out / "mxconv.json", lambda m: m["tensors"][key].update(file=m["tensors"][key]["file"].replace("rank-0", "rank-1")))
    with pytest.raises(OutputDamaged, match=rf"field 'tensors\.{key}\.file' is 'rank-1/.*', not 'rank-0/' followed by"):
        resolve_layer(out, 0, rank=0)
    code, _, err = mx("verify", out, "--quiet")
    assert code == 1 and f"field 'tensors.{key}.file'" in err, err


def test_manifest_output_files_are_plain_names(outs: Path, tmp_path: Path) -> None:
    out = copy_checkpoint(outs / "q4", tmp_path / "q4")
    _edit_json(out / "mxconv.json", lambda m: m["output_files"].append("../victim.txt"))
    with pytest.raises(OutputDamaged, match=r"field 'output_files\[\d+\]' is '../victim.txt', not a plain file name"):
        load_manifest(out)


def test_index_shard_names_are_plain_names(outs: Path, tmp_path: Path) -> None:
    src = copy_checkpoint(outs / "src", tmp_path / "src")
    _edit_json(src / INDEX, lambda i: i["weight_map"].update({k: "../" + v for k, v in i["weight_map"].items()}))
    code, _, err = mx("quantize", src, tmp_path / "o", "--dry-run")
    assert code == 2 and "weight_map: file name '../model-" in err and "not a plain file name" in err, err


def test_a_source_shard_may_be_a_link_out_of_its_directory(outs: Path, tmp_path: Path) -> None:
    """The Hugging Face cache: each file of a snapshot links to ../../blobs/<hash>."""
    src = copy_checkpoint(outs / "src", tmp_path / "snapshots" / "abc")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values())):
        (src / shard).rename(blobs / shard)
        (src / shard).symlink_to(Path("../../blobs") / shard)
    assert open_checkpoint(src).tensors


def _move_out_and_link(out: Path, name: str) -> Path:
    """Move ``out / name`` (a rank directory or a shard) to ``out/../elsewhere`` and leave a link to it
    under its name: the output's bytes, but read from outside the output. Returns the moved path."""
    moved = out.parent / "elsewhere" / name
    moved.parent.mkdir(parents=True, exist_ok=True)
    (out / name).rename(moved)
    (out / name).symlink_to(moved, target_is_directory=moved.is_dir())
    return moved


@pytest.mark.parametrize("what", ["rank directory", "shard"])
def test_a_linked_rank_directory_or_shard_is_refused_by_verify_the_loader_and_the_plugin(
        outs: Path, tmp_path: Path, what: str) -> None:
    """A rank directory (or a shard) of the output replaced by a link to the same bytes elsewhere:
    verify ended in an internal error (a ValueError from the resolved path), the loader read through
    the link and the vLLM plugin refused it by a rule of its own. All three refuse it with one rule."""
    from mxconv.integrations.vllm.checks import inside

    out = copy_checkpoint(outs / "tp", tmp_path / "tp")
    shard = json.loads((out / "mxconv.json").read_text())["tensors"]["rank-1/model.layers.0.mlp.experts.w13_weight"]["file"]
    linked = "rank-1" if what == "rank directory" else shard
    _move_out_and_link(out, linked)
    rule = rf"{re.escape(str(out / linked))} is a symbolic link \(mxconv writes no links into an output"
    code, _, err = mx("verify", out, "--quiet")
    _clean(code, err)
    assert code == 1 and re.search(rule, err), err
    with pytest.raises(OutputDamaged, match=rule):
        read_layer_tensors(resolve_layer(out, 0, rank=1), "cpu", check_hashes=True)
    with pytest.raises(OutputDamaged, match=rule):
        inside(out, linked)
    inside(out, "rank-0")  # the other rank is a plain directory of the output
    for bad in ("../tp/rank-0", str(out / "rank-0")):
        with pytest.raises(OutputDamaged, match="not a path of plain names inside the output"):
            inside(out, bad)


def test_loader_and_verify_check_where_a_tensor_is_with_one_rule(outs: Path, tmp_path: Path) -> None:
    """A manifest whose shape for a tensor is not the file's: verify failed it, the loader read it."""
    out = copy_checkpoint(outs / "marlin", tmp_path / "out")
    name = "model.layers.1.mlp.experts.w2_weight"
    _edit_json(out / "mxconv.json", lambda m: m["tensors"][name]["shape"].__setitem__(0, 99))
    want = rf"{name}: I32\[4, .*\] on disk, manifest says I32\[99, "
    with pytest.raises(OutputDamaged, match=want):
        read_layer_tensors(resolve_layer(out, 1), "cpu")
    with pytest.raises(OutputDamaged, match=want):
        load_model(out, device="cpu")
    code, _, err = mx("verify", out, "--quiet")
    assert code == 1 and f"{name}: " in err and "on disk, manifest says I32[99, " in err, err


# ---- JSON: deep, duplicated, non-finite (reproductions 6 and 7) --------------------------------


def test_loads_strict_rules() -> None:
    ok = loads_strict('{"a": [1, 2.5, -3e-7, {"b": null}], "c": 18446744073709551615}', "f", "bad")
    assert ok == {"a": [1, 2.5, -3e-7, {"b": None}], "c": (1 << 64) - 1}
    nested = lambda n: "[" * n + "]" * n  # noqa: E731
    assert loads_strict(nested(MAX_NESTING), "f", "bad") is not None  # as deep as allowed
    for text, rule in [
        (nested(DEEP), "nested too deeply"),
        (nested(MAX_NESTING + 1), f"nested more than {MAX_NESTING} levels deep"),
        ('{"a": 1, "a": 2}', "key 'a' appears twice in one object"),
        ('{"a": NaN}', "NaN is not a number JSON allows"),
        ('{"a": -Infinity}', "-Infinity is not a number JSON allows"),
        ('{"a": 1e400}', "number 1e400 is out of the range of a double"),
        ('{"a": 18446744073709551616}', "does not fit in 64 bits"),
        ('{"a": ' + "9" * 5000 + "}", "invalid JSON"),
        ('{"a": ', "invalid JSON"),
        (b'{"a": "\xff"}', "not UTF-8"),
    ]:
        with pytest.raises(BadInput, match=rf"^f: bad \(.*{rule}"):
            loads_strict(text, "f", "bad")
    with pytest.raises(BadInput, match="nested too deeply"):  # a header: no bound but the parser's own
        loads_strict(nested(DEEP), "f", "bad", document=False)


def test_deep_json_in_a_source_is_bad_input(outs: Path, tmp_path: Path) -> None:
    for name in ("config.json", INDEX):
        src = copy_checkpoint(outs / "src", tmp_path / name)
        _insert(src / name, "[" * DEEP + "]" * DEEP)
        for cmd in (("quantize", src, tmp_path / "o", "--dry-run"), ("inspect", src)):
            code, _, err = mx(*cmd)
            _clean(code, err)
            assert code == 2 and f"{src / name}: malformed" in err and "nested too deeply" in err, (cmd, err)


def test_deep_json_in_a_shard_header_is_bad_input(tmp_path: Path) -> None:
    raw = (b'{"__metadata__": {"x": ' + b"[" * DEEP + b"]" * DEEP + b'}, "a": {"dtype": "U8", "shape": [1], '
           b'"data_offsets": [0, 1]}}')
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0")
    with pytest.raises(BadInput, match=r"model.safetensors: corrupt safetensors header \(nested too deeply"):
        read_header(f)


@pytest.mark.parametrize("name", ["mxconv.json", "config.json", INDEX])
def test_deep_json_in_the_verified_output_fails_it(outs: Path, tmp_path: Path, name: str) -> None:
    out = copy_checkpoint(outs / "marlin", tmp_path / "out")
    _insert(out / name, "[" * DEEP + "]" * DEEP)
    code, _, err = mx("verify", out, "--quiet")
    _clean(code, err)
    assert code == 1 and f"{out / name}: malformed" in err and "nested too deeply" in err, err
    code, _, err = mx("inspect", out)
    assert code == 2 and "nested too deeply" in err, err


@pytest.mark.parametrize("value, rule", [
    ("NaN", "NaN is not a number JSON allows"),
    ("Infinity", "Infinity is not a number JSON allows"),
    ("1e999", "number 1e999 is out of the range of a double"),
    ("-1.0", "swiglu_limit -1.0 must be a number greater than 0"),
    ("0", "swiglu_limit 0 must be a number greater than 0"),
])
def test_swiglu_limit_out_of_range_stops_the_plan(outs: Path, tmp_path: Path, value: str, rule: str) -> None:
    src = copy_checkpoint(outs / "src", tmp_path / "src")
    text = (src / "config.json").read_text()
    (src / "config.json").write_text(text.replace('"swiglu_limit": 7.0', f'"swiglu_limit": {value}'))
    assert f'"swiglu_limit": {value}' in (src / "config.json").read_text()
    code, _, err = mx("quantize", src, tmp_path / "out", "--device", "cpu")
    _clean(code, err)
    assert code == 2 and f"{src / 'config.json'}" in err and rule in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value, rule", [
    ("swiglu_alpha", -1.702, "swiglu_alpha -1.702 must be a number greater than 0"),
    ("rms_norm_eps", 0, "rms_norm_eps 0 must be a number between 0 and 1"),
    ("rope_theta", -150000, "rope_theta -150000 must be a number greater than 0"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 0.0}, "rope_scaling.factor 0.0 must be a number greater than 0"),
])
def test_config_values_out_of_range_stop_the_plan(outs: Path, tmp_path: Path, key: str, value: Any, rule: str) -> None:
    src = copy_checkpoint(outs / "src", tmp_path / "src")
    _edit_json(src / "config.json", lambda c: c.update({key: value}))
    code, _, err = mx("quantize", src, tmp_path / "out", "--dry-run")
    assert code == 2 and f"{src / 'config.json'}: {rule}" in err, err


def test_routed_scaling_factor_out_of_range_stops_the_plan(made: MadeCheckpoints, tmp_path: Path) -> None:
    src = copy_checkpoint(made.source("kimi-k2").path, tmp_path / "src")
    _edit_json(src / "config.json", lambda c: c.update(routed_scaling_factor=0))
    code, _, err = mx("quantize", src, tmp_path / "out", "--dry-run")
    assert code == 2 and f"{src / 'config.json'}: routed_scaling_factor 0 must be a number greater than 0" in err, err


def test_duplicate_key_in_config_is_bad_input(outs: Path, tmp_path: Path) -> None:
    src = copy_checkpoint(outs / "src", tmp_path / "src")
    _insert(src / "config.json", "1")
    text = (src / "config.json").read_text()
    (src / "config.json").write_text(text.replace('"extra": 1, ', '"hidden_size": 64, ', 1))
    code, _, err = mx("quantize", src, tmp_path / "out", "--dry-run")
    assert code == 2 and "key 'hidden_size' appears twice in one object" in err, err


def _strict(path: Path) -> Any:
    return loads_strict(path.read_bytes(), str(path), "not strict JSON")


def test_written_json_is_strict(outs: Path) -> None:
    for out in ("q4", "marlin", "tp"):
        for name in ("config.json", "mxconv.json"):
            _strict(outs / out / name)
    with pytest.raises(ValueError):
        dumps_strict({"swiglu_limit": float("nan")})


def test_nan_in_the_verified_manifest_fails_it(outs: Path, tmp_path: Path) -> None:
    out = copy_checkpoint(outs / "q4", tmp_path / "q4")
    text = (out / "mxconv.json").read_text()
    (out / "mxconv.json").write_text(text.replace('"swiglu_limit": 7.0', '"swiglu_limit": NaN', 1))
    code, _, err = mx("verify", out, "--quiet")
    assert code == 1 and "NaN is not a number JSON allows" in err, err


# ---- side files: regular, bounded (reproduction 8) ----------------------------------------------


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))


def _cli(*args: object) -> tuple[int | None, str]:
    """``mxconv ARGS`` in a child process under a memory limit: (exit code, stderr), the code None
    where it had not ended after a minute (it hangs: a FIFO read, a device read without end)."""
    src = str(Path(mxconv.__file__).parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    try:
        r = subprocess.run([sys.executable, "-m", "mxconv.cli", *map(str, args)], capture_output=True, text=True,
                           env=env, timeout=60, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        return None, "timed out"
    return r.returncode, r.stderr


def _fifo(path: Path) -> str:
    path.unlink()
    os.mkfifo(path)
    return "is a FIFO, not a regular file"


def _zero(path: Path) -> str:
    path.unlink()
    path.symlink_to("/dev/zero")
    return "is a character device, not a regular file"


def _huge(path: Path) -> str:
    with open(path, "r+b") as f:
        f.truncate(65 << 20)  # sparse: no disk used
    return f"is {65 << 20} bytes, more than the {64 << 20} bytes mxconv reads"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name, make", [("config.json", _fifo), (INDEX, _zero), ("config.json", _huge)])
def test_a_source_side_file_that_is_not_a_regular_file_is_refused_at_once(outs: Path, tmp_path: Path, name: str,
                                                                        make: Callable[[Path], str]) -> None:
    src = copy_checkpoint(outs / "src", tmp_path / "src")
    rule = make(src / name)
    code, err = _cli("inspect", src)
    assert code == 2 and f"{src / name}: " in err and rule in err, err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name, make", [("mxconv.json", _fifo), ("config.json", _zero)])
def test_a_side_file_of_the_verified_output_that_is_not_a_regular_file_fails_it(
        outs: Path, tmp_path: Path, name: str, make: Callable[[Path], str]) -> None:
    out = copy_checkpoint(outs / "q4", tmp_path / "q4")
    rule = make(out / name)
    code, err = _cli("verify", out, "--device", "cpu", "--quiet")
    assert code == 1 and f"{out / name}: " in err and rule in err, err
    code, err = _cli("inspect", out)
    assert code == 2 and rule in err, err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_shard_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    os.mkfifo(tmp_path / "b.safetensors")
    (tmp_path / "config.json").write_text("{}")
    code, err = _cli("inspect", tmp_path)
    assert code == 2 and f"{tmp_path / 'b.safetensors'}: the safetensors file is a FIFO" in err, err
    with pytest.raises(BadInput, match="is a FIFO"):
        read_json(tmp_path / "b.safetensors", "x")
