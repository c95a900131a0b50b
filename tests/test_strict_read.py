"""Strict safetensors reading (issue 10, item 1) and manifest validation (item 4).

Every header rule is broken once and must give BadInput naming the file, the tensor and the rule;
the safetensors library (the loaders' parser) is asked for a second opinion on the same bytes; the
CLI turns each violation into exit 2 with one line for quantize and inspect, and into a failed
verification (exit 1, the same line after FAIL) for verify of the damaged output (issue 18, item 8).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mxconv.source.checkpoint import open_checkpoint
from mxconv.cli import app
from mxconv.errors import BadInput
from mxconv.source.manifest import load_manifest, validate_manifest
from mxconv.source.st_format import read_header
from support.checkpoints import ModelSizes, make_checkpoint
from support.workspace import copy_checkpoint, link_workspace, MadeCheckpoints

runner = CliRunner()
INDEX = "model.safetensors.index.json"


def mx(*args: Any) -> tuple[int, str, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def _write(path: Path, header: dict[str, Any] | bytes, data: bytes, *, length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _library_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
        return True
    except SafetensorError:
        return False


U8 = lambda shape, b, e: {"dtype": "U8", "shape": shape, "data_offsets": [b, e]}  # noqa: E731

# (case, header, data, regex the message must match)
HEADER_CASES = [
    ("shape-bool", {"a": U8([True], 0, 1)}, b"\0", r"tensor 'a': malformed shape \[True\] \(must be a list of non-negative integers\)"),
    ("shape-float", {"a": U8([1.0], 0, 1)}, b"\0", r"tensor 'a': malformed shape \[1.0\]"),
    ("shape-negative", {"a": U8([-1], 0, 1)}, b"\0", r"tensor 'a': malformed shape \[-1\]"),
    ("shape-not-list", {"a": U8(4, 0, 4)}, b"\0" * 4, r"tensor 'a': malformed shape 4"),
    ("offsets-bool", {"a": U8([1], False, True)}, b"\0", r"tensor 'a': malformed data_offsets"),
    ("offsets-three", {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, b"\0", r"tensor 'a': malformed data_offsets"),
    ("offsets-reversed", {"a": U8([4], 4, 0)}, b"\0" * 4, r"tensor 'a': malformed data_offsets \[4, 0\]"),
    ("offsets-size", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 12, r"tensor 'a': data_offsets \[0, 12\] span 12 bytes but F32\[4\] needs 16"),
    ("dtype-unknown", {"a": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, r"tensor 'a': unknown dtype 'Q9'"),
    ("dtype-missing", {"a": {"shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, r"tensor 'a': corrupt header entry \(no 'dtype'\)"),
    ("entry-not-object", {"a": [1, 2]}, b"", r"tensor 'a': corrupt header entry"),
    ("gap", {"a": U8([4], 0, 4), "b": U8([4], 8, 12)}, b"\0" * 12, r"tensor 'b': data_offsets \[8, 12\] leave a gap of 4 bytes after tensor 'a'"),
    ("gap-at-start", {"a": U8([4], 4, 8)}, b"\0" * 8, r"tensor 'a'.*gap of 4 bytes at the start of the data section"),
    ("overlap", {"a": U8([8], 0, 8), "b": U8([8], 4, 12)}, b"\0" * 12, r"tensors 'a' and 'b' overlap"),
    ("trailing", {"a": U8([4], 0, 4)}, b"\0" * 9, r"5 trailing bytes after the last tensor 'a'"),
    ("truncated", {"a": U8([4], 0, 4), "b": U8([8], 4, 12)}, b"\0" * 10, r"tensor 'b': data ends at byte \d+ but the file has only \d+ bytes \(truncated"),
    ("metadata-int", {"__metadata__": {"format": 1}, "a": U8([1], 0, 1)}, b"\0", r"__metadata__ must be an object of strings"),
    ("not-object", [1, 2], b"", r"corrupt safetensors header \(not a JSON object\)"),
]


@pytest.mark.parametrize("case, header, data, pattern", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_header_rule_names_file_tensor_and_rule(tmp_path: Path, case: str, header: Any, data: bytes, pattern: str) -> None:
    p = _write(tmp_path / "bad.safetensors", json.dumps(header).encode(), data)
    with pytest.raises(BadInput, match=pattern) as ei:
        read_header(p)
    assert str(ei.value).startswith(str(p) + ":")
    assert "\n" not in str(ei.value)
    assert not _library_accepts(p) or case in ("dtype-missing",), "the safetensors library should refuse it too"


def test_duplicate_tensor_name(tmp_path: Path) -> None:
    raw = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}'
    p = _write(tmp_path / "dup.safetensors", raw, b"\0" * 4)
    with pytest.raises(BadInput, match=r"dup.safetensors: corrupt safetensors header \(key 'a' appears twice"):
        read_header(p)


@pytest.mark.parametrize("delta", [-3, -1, 1, 5, 1 << 40])
def test_shifted_header_length(tmp_path: Path, delta: int) -> None:
    save_file({"a": torch.arange(8, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}, str(tmp_path / "s.safetensors"))
    p = tmp_path / "s.safetensors"
    blob = p.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    p.write_bytes(struct.pack("<Q", n + delta) + blob[8:])
    with pytest.raises(BadInput, match=r"s.safetensors: "):
        read_header(p)
    assert not _library_accepts(p)


def test_zero_length_tensors_and_empty_file_are_valid(tmp_path: Path) -> None:
    save_file({"e": torch.zeros(0, 3), "a": torch.ones(2)}, str(tmp_path / "z.safetensors"))
    infos, _ = read_header(tmp_path / "z.safetensors")
    assert infos["e"].nbytes == 0 and infos["a"].nbytes == 8
    save_file({}, str(tmp_path / "empty.safetensors"))
    assert read_header(tmp_path / "empty.safetensors")[0] == {}


def test_random_valid_files_agree_with_the_library(tmp_path: Path) -> None:
    """Whatever the library writes, we read back the same names, shapes and bytes."""
    g = torch.Generator().manual_seed(3)
    for i in range(20):
        tensors = {
            f"t{j}": torch.randint(0, 255, tuple(int(d) for d in torch.randint(0, 5, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)),
                                   generator=g, dtype=torch.uint8)
            for j in range(int(torch.randint(1, 6, (1,), generator=g)))
        }
        p = tmp_path / f"r{i}.safetensors"
        save_file(tensors, str(p))
        infos, _ = read_header(p)
        back = load_file(str(p))
        assert set(infos) == set(back)
        for n, info in infos.items():
            assert list(info.shape) == list(back[n].shape)


# ---- index <-> shards, both ways ----------------------------------------------------------------


@pytest.fixture()
def src(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "src", "qwen3-moe", ModelSizes(num_layers=1, num_experts=2)).path


def _index(root: Path) -> dict[str, Any]:
    return json.loads((root / INDEX).read_text())


def test_shard_tensor_missing_from_weight_map(src: Path) -> None:
    idx = _index(src)
    name = "model.norm.weight"
    shard = idx["weight_map"].pop(name)
    (src / INDEX).write_text(json.dumps(idx))
    with pytest.raises(BadInput, match=rf"{shard}: tensor '{name}' is in this shard, but the weight_map does not name it"):
        open_checkpoint(src)
    code, _, err = mx("inspect", src)
    assert code == 2 and name in err and "weight_map" in err and "Traceback" not in err


def test_weight_map_points_to_the_wrong_shard(src: Path) -> None:
    idx = _index(src)
    shards = sorted(set(idx["weight_map"].values()))
    name = next(n for n, s in idx["weight_map"].items() if s == shards[0])
    idx["weight_map"][name] = shards[1]
    (src / INDEX).write_text(json.dumps(idx))
    with pytest.raises(BadInput, match=rf"tensor '{name}' is mapped to '{shards[1]}', but that shard does not hold it"):
        open_checkpoint(src)


def test_index_with_duplicate_keys(src: Path) -> None:
    text = (src / INDEX).read_text()
    first = next(iter(_index(src)["weight_map"].items()))
    dup = text.replace('"weight_map": {', '"weight_map": {' + json.dumps(first[0]) + ": " + json.dumps(first[1]) + ", ", 1)
    (src / INDEX).write_text(dup)
    code, _, err = mx("quantize", src, src.parent / "o", "--device", "cpu")
    assert code == 2 and f"key '{first[0]}' appears twice" in err and INDEX in err


def test_damaged_source_shard_refused_by_every_command(src: Path, tmp_path: Path) -> None:
    shard = src / sorted(set(_index(src)["weight_map"].values()))[0]
    blob = bytearray(shard.read_bytes())
    blob[-1:] = b""  # one byte short: the last tensor is truncated
    shard.write_bytes(bytes(blob) + b"")
    for args in (("inspect", src), ("quantize", src, tmp_path / "o", "--device", "cpu"),
                 ("repack", src, tmp_path / "o2", "--backend", "trtllm", "--device", "cpu")):
        code, _, err = mx(*args)
        assert code == 2, (args, err)
        assert shard.name in err and "truncated" in err and "Traceback" not in err
    assert not (tmp_path / "o" / "mxconv.json").exists()


# ---- outputs: verify applies the same checks, manifests are validated ---------------------------


@pytest.fixture(scope="module")
def outs(made: MadeCheckpoints, tmp_path_factory) -> Path:
    """A gpt-oss bf16 source, its MXFP4 quantization, a trtllm repack and a two-rank aiter repack."""
    src = made.source("gpt-oss-bf16").path
    q4 = made.quantize(src)
    return link_workspace(tmp_path_factory.mktemp("strict"), {
        "gpt": src, "q4": q4, "k": made.repack(q4, "trtllm"), "tp": made.repack(q4, "aiter", "--tp", "2")})


def test_verify_fails_an_output_with_a_gap_in_a_shard(outs: Path, tmp_path: Path) -> None:
    k = copy_checkpoint(outs / "k", tmp_path / "k")
    shard = k / sorted(set(_index(k)["weight_map"].values()))[0]
    blob = shard.read_bytes()
    shard.write_bytes(blob + b"\0" * 16)  # trailing bytes after the last tensor
    code, out, err = mx("verify", k)
    assert code == 1 and f"FAIL {shard}: 16 trailing bytes after the last tensor" in err, err
    assert out.strip().splitlines()[-1] == (
        "FAIL (integrity; layout, numerics not checked: the output's own files do not read as a checkpoint)")


def test_verify_refuses_a_rank_dir(outs: Path) -> None:
    # (inspect reads one rank with its output's manifest: tests/test_inspect_tp.py)
    code, _, err = mx("verify", outs / "tp" / "rank-1")
    assert code == 2 and "no mxconv.json" in err and "one rank of a tensor-parallel mxconv output" in err
    assert str((outs / "tp").resolve()) in err  # outs / "tp" links to the session's made output


@pytest.mark.parametrize("cmd", ["inspect", "verify"])
def test_kernel_output_without_manifest(outs: Path, tmp_path: Path, cmd: str) -> None:
    k = copy_checkpoint(outs / "k", tmp_path / "k")
    (k / "mxconv.json").unlink()
    code, _, err = mx(cmd, k)
    assert code == 2 and "no mxconv.json" in err and "kernel-layout output" in err and "Traceback" not in err


def _tamper(path: Path, edit) -> None:
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


MANIFEST_CASES = [
    ("tp_size", lambda m: m.__setitem__("tp_size", "1"), r"field 'tp_size' must be a positive integer, got \"1\""),
    ("kind", lambda m: m.__setitem__("kind", "fused"), r"field 'kind' must be \"canonical\" or \"kernel\""),
    ("layout.padded", lambda m: m["layout"].__setitem__("padded_hidden_size", 25.6), r"field 'layout.padded_hidden_size' must be a positive integer"),
    ("layout.row_order", lambda m: m["layout"].pop("w13_row_order"), r"field 'layout.w13_row_order' is missing \(a required key\)"),
    ("model", lambda m: m.pop("model"), r"field 'model' is missing"),
    ("model.routing", lambda m: m["model"].__setitem__("routing", "magic"), r"field 'model.routing' must be"),
    ("layers", lambda m: m["layers"][0].__setitem__("layer", None), r"field 'layers\[0\].layer' must be a non-negative integer, got null"),
    ("tensors.shape", lambda m: next(iter(m["tensors"].values())).__setitem__("shape", [True]), r"field 'tensors\..*\.shape\[0\]' must be a non-negative integer"),
    ("tensors.sha", lambda m: next(iter(m["tensors"].values())).pop("sha256"), r"field 'tensors\..*\.sha256' is missing"),
    ("backend-null", lambda m: m.__setitem__("backend", None), r"field 'backend' a kernel-layout output must name its backend"),
    ("created", lambda m: m.pop("created"), r"manifest lacks required keys \['created'\]"),
    ("newer", lambda m: m.__setitem__("format_version", 99), r"format_version 99 is newer"),
]


@pytest.mark.parametrize("case, edit, pattern", MANIFEST_CASES, ids=[c[0] for c in MANIFEST_CASES])
def test_tampered_manifest_names_the_field(outs: Path, tmp_path: Path, case: str, edit, pattern: str) -> None:
    k = copy_checkpoint(outs / "k", tmp_path / "k")
    _tamper(k / "mxconv.json", edit)
    with pytest.raises(BadInput, match=pattern):
        load_manifest(k)
    for cmd, want in (("verify", 2 if case == "newer" else 1), ("inspect", 2)):  # newer: this mxconv cannot judge
        code, _, err = mx(cmd, k)
        assert code == want, (cmd, err)
        assert "mxconv.json" in err and "Traceback" not in err and "internal error" not in err


def test_tp_ranges_must_match_tp_size(outs: Path, tmp_path: Path) -> None:
    t = copy_checkpoint(outs / "tp", tmp_path / "tp")
    _tamper(t / "mxconv.json", lambda m: m["layout"]["tp_ranges"].pop())
    code, _, err = mx("verify", t)
    assert code == 1 and "field 'layout.tp_ranges' must hold tp_size=2 ranges, got 1" in err


def test_every_real_manifest_is_valid(outs: Path) -> None:
    for d in ("q4", "k", "tp"):
        m = json.loads((outs / d / "mxconv.json").read_text())
        assert validate_manifest(m, d) is m


def test_manifest_with_duplicate_key(outs: Path, tmp_path: Path) -> None:
    k = copy_checkpoint(outs / "k", tmp_path / "k")
    text = (k / "mxconv.json").read_text()
    (k / "mxconv.json").write_text(text.replace('{"format_version"', '{"kind": "canonical", "format_version"', 1)
                                   if text.startswith('{"format_version"') else "{" + '"kind": "canonical", ' + text.lstrip()[1:])
    code, _, err = mx("verify", k)
    assert code == 1 and "key 'kind' appears twice" in err


# ---- verify: a missing tensor fails (exit 1) naming it; an extra one is reported ----------------


def _drop_tensor(root: Path, name: str) -> None:
    idx = _index(root)
    f = root / idx["weight_map"].pop(name)
    tensors = load_file(str(f))
    del tensors[name]
    save_file(tensors, str(f), metadata={"format": "pt"})
    (root / INDEX).write_text(json.dumps(idx))


def _add_tensor(root: Path, name: str) -> None:
    idx = _index(root)
    shard = sorted(set(idx["weight_map"].values()))[0]
    tensors = load_file(str(root / shard))
    tensors[name] = torch.zeros(3)
    save_file(tensors, str(root / shard), metadata={"format": "pt"})
    idx["weight_map"][name] = shard
    (root / INDEX).write_text(json.dumps(idx))


@pytest.mark.parametrize(
    "out, name",
    [
        ("q4", "model.layers.0.mlp.experts.gate_up_proj_blocks"),
        ("q4", "model.layers.1.mlp.router.weight"),
        ("q4", "model.norm.weight"),
        ("k", "model.layers.0.mlp.experts.w13_weight"),
        ("k", "model.layers.1.mlp.experts.w2_bias"),
        ("k", "model.layers.0.mlp.router.weight"),
    ],
)
def test_verify_fails_naming_a_missing_tensor(outs: Path, tmp_path: Path, out: str, name: str) -> None:
    d = copy_checkpoint(outs / out, tmp_path / out)
    _drop_tensor(d, name)
    code, stdout, err = mx("verify", d, "--json")
    assert code == 1, err
    rep = json.loads(stdout)
    problems = rep["problems"] + [p for layer in rep["layers"] for p in layer["problems"]]
    assert any(name in p and "missing" in p for p in problems), problems
    assert not rep["passed"]


def test_verify_reports_an_extra_tensor(outs: Path, tmp_path: Path) -> None:
    d = copy_checkpoint(outs / "q4", tmp_path / "q4")
    _add_tensor(d, "model.extra.weight")
    code, _, err = mx("verify", d)
    assert code == 1 and "model.extra.weight: present in the checkpoint but not in the manifest" in err


# ---- verify: damage to the output's own files is a failed verification (exit 1), naming it -------

DAMAGED = "FAIL (integrity; layout, numerics not checked: the output's own files do not read as a checkpoint)"


def _rewrite_shard(shard: Path, edit) -> None:
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


@pytest.mark.parametrize("out, sub, name", [
    ("q4", "", "model.layers.0.mlp.experts.down_proj_blocks"),
    ("k", "", "model.layers.1.mlp.experts.w13_weight_scale"),
    ("tp", "rank-1", "model.layers.0.mlp.experts.w2_weight"),
])
def test_verify_fails_on_a_tensor_deleted_from_its_shard(outs: Path, tmp_path: Path, out: str, sub: str, name: str) -> None:
    """The index (and manifest) still name the tensor; its shard no longer holds it."""
    d = copy_checkpoint(outs / out, tmp_path / out)
    shard = _index(d / sub)["weight_map"][name]
    _rewrite_shard(d / sub / shard, lambda t: t.pop(name))
    code, stdout, err = mx("verify", d)
    assert code == 1, err
    assert f"FAIL {d / sub / INDEX}: tensor '{name}' is mapped to '{shard}', but that shard does not hold it" in err
    assert stdout.strip().splitlines() == [DAMAGED]  # no layer table: no layer was read
    code, stdout, err = mx("verify", d, "--json")
    rep = json.loads(stdout)
    assert code == 1 and not rep["passed"] and rep["verdict"] == DAMAGED and rep["layers"] == []
    assert rep["scope"]["checked"] == ["integrity"] and set(rep["scope"]["not_checked"]) == {"layout", "numerics"}
    assert any(name in p and shard in p for p in rep["problems"]), rep["problems"]


@pytest.mark.parametrize("out, sub", [("k", ""), ("tp", "rank-0")])
def test_verify_fails_on_a_tensor_in_a_shard_the_index_does_not_name(outs: Path, tmp_path: Path, out: str, sub: str) -> None:
    d = copy_checkpoint(outs / out, tmp_path / out)
    shard = d / sub / sorted(set(_index(d / sub)["weight_map"].values()))[0]
    _rewrite_shard(shard, lambda t: t.__setitem__("model.sneaked.weight", torch.zeros(3)))
    code, _, err = mx("verify", d, "--quiet")
    assert code == 1, err
    assert (f"FAIL {shard}: tensor 'model.sneaked.weight' is in this shard, but the weight_map does not name it "
            f"({INDEX})") in err


def test_verify_fails_on_a_missing_shard_or_rank(outs: Path, tmp_path: Path) -> None:
    d = copy_checkpoint(outs / "k", tmp_path / "k")
    shard = sorted(set(_index(d)["weight_map"].values()))[-1]
    (d / shard).unlink()
    code, _, err = mx("verify", d)
    assert code == 1 and f"FAIL {d / INDEX}: names shard '{shard}', which does not exist" in err, err
    t = copy_checkpoint(outs / "tp", tmp_path / "tp")
    shutil.rmtree(t / "rank-1")
    code, _, err = mx("verify", t)
    assert code == 1 and f"FAIL {t / 'rank-1'}: missing (manifest says tp_size 2)" in err, err


def test_verify_exits_2_for_a_reference_it_cannot_read(outs: Path, tmp_path: Path) -> None:
    """Damage to the other inputs is bad input (2), even where the same damage to PATH fails (1)."""
    ref = copy_checkpoint(outs / "q4", tmp_path / "ref")
    shard = sorted(set(_index(ref)["weight_map"].values()))[0]
    _rewrite_shard(ref / shard, lambda t: t.__setitem__("model.sneaked.weight", torch.zeros(3)))
    code, _, err = mx("verify", outs / "k", "--reference", ref)
    assert code == 2 and f"error: {ref / shard}: tensor 'model.sneaked.weight' is in this shard" in err, err
    code, _, err = mx("verify", outs / "k", "--reference", tmp_path / "nowhere")
    assert code == 2 and "nowhere: no such directory" in err, err
    (tmp_path / "saved.safetensors").write_bytes(b"not safetensors")
    code, _, err = mx("verify", outs / "k", "--reference-outputs", tmp_path / "saved.safetensors")
    assert code == 2 and "saved.safetensors" in err, err


@pytest.mark.parametrize("stray", ["model.safetensors", "model-00009-of-00009.safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize("out", ["q4", "k", "tp"])
def test_verify_fails_on_a_weight_file_the_index_does_not_name(outs: Path, tmp_path: Path, out: str, stray: str) -> None:
    """transformers reads model.safetensors before the index: a stray weight file makes a loader read
    something else than what verify checked, so it fails verification naming the file."""
    d = copy_checkpoint(outs / out, tmp_path / out)
    save_file({"foo": torch.zeros(3)}, str(d / stray))
    code, _, err = mx("verify", d)
    assert code == 1, err
    assert f"{stray}: a weight file the output's index does not name" in err


def test_a_manifest_that_lists_no_layer_is_refused(outs: Path, tmp_path: Path) -> None:
    d = copy_checkpoint(outs / "k", tmp_path / "k")
    _tamper(d / "mxconv.json", lambda m: m.__setitem__("layers", []))
    code, _, err = mx("verify", d)
    assert code == 1 and "layers" in err and "is empty" in err, err


def test_a_manifest_naming_an_unknown_backend_is_refused_once(outs: Path, tmp_path: Path) -> None:
    d = copy_checkpoint(outs / "k", tmp_path / "k")
    _tamper(d / "mxconv.json", lambda m: m.__setitem__("backend", "foo"))
    code, _, err = mx("verify", d)
    assert code == 2 and err.count("backend 'foo' is not one this mxconv knows") == 1, err
    code, out, err = mx("inspect", d, "--json")  # inspect still describes what the files and manifest say
    assert code == 0 and json.loads(out)["manifest"]["backend"] == "foo", out + err
