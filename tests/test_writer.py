"""Streaming writer: shard planning, byte-exact output, sha256, atomic renames, output-dir rules."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mxconv.experts.tensors import TensorSpec
from mxconv.output import directory as output_dir
from mxconv.errors import BadInput
from mxconv.run.pipeline import PipelineDepth, WorkItem, run_pipeline
from mxconv.source.st_format import read_header
from mxconv.output.directory import TMP_SUFFIX, prepare_output_dir
from mxconv.output.shards import PlannedTensor, plan_shards
from mxconv.output.writer import ShardedWriter
from mxconv.sizes import parse_size
from mxconv.source.file_names import IN_PROGRESS
from support.checkpoints import make_checkpoint
from support.cli import mx


def _pt(name: str, shape: tuple[int, ...], dtype=torch.uint8) -> PlannedTensor:
    return PlannedTensor(name, TensorSpec(shape, dtype), "expert")


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1000") == 1000
    with pytest.raises(BadInput, match="cannot parse"):
        parse_size("lots")
    for bad in ("0MB", "nan", "inf", "0.1"):
        with pytest.raises(BadInput, match="at least one byte"):
            parse_size(bad)


def test_plan_shards_greedy_and_oversized() -> None:
    ts = [_pt("a", (60,)), _pt("b", (50,)), _pt("c", (300,)), _pt("d", (10,))]
    shards = plan_shards(ts, 100)
    assert [[t.name for t in s.tensors] for s in shards] == [["a"], ["b"], ["c"], ["d"]]
    assert [s.file for s in shards] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    shards = plan_shards(ts, 1000)
    assert len(shards) == 1 and shards[0].file == "model-00001-of-00001.safetensors"


def test_writer_bytes_sha_and_index(tmp_path: Path) -> None:
    src = tmp_path / "src.safetensors"
    copied = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    save_file({"keep.me": copied}, str(src))
    info = read_header(src)[0]["keep.me"]
    a = torch.randint(0, 255, (3, 8), dtype=torch.uint8)
    b = torch.randn(5, 4).to(torch.float8_e4m3fn)
    plan = [
        _pt("x.a", (3, 8)),
        PlannedTensor("keep.me", TensorSpec(info.shape, info.torch_dtype), "copy", info),
        _pt("x.b", (5, 4), torch.float8_e4m3fn),
    ]
    out = tmp_path / "out"
    out.mkdir()
    w = ShardedWriter(out, plan_shards(plan, 60))
    w.write_tensor("x.a", a)
    w.copy_tensor("keep.me")
    w.write_tensor("x.b", b)
    table = w.finish()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"x.a", "keep.me", "x.b"}
    assert index["metadata"]["total_size"] == 24 + 48 + 20
    for name, want in (("x.a", a), ("keep.me", copied), ("x.b", b)):
        f = out / index["weight_map"][name]
        with safe_open(str(f), "pt") as fh:
            got = fh.get_tensor(name)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert table[name].sha256 == hashlib.sha256(want.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    assert not list(out.glob("*" + TMP_SUFFIX)) and not list(out.glob(".*" + TMP_SUFFIX))


def test_writer_refuses_out_of_plan(tmp_path: Path) -> None:
    w = ShardedWriter(tmp_path, plan_shards([_pt("a", (4,)), _pt("b", (4,))], 100))
    with pytest.raises(RuntimeError, match="plan expects 'a'"):
        w.write_tensor("b", torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="plan says"):
        w.write_tensor("a", torch.zeros(5, dtype=torch.uint8))


def test_pipeline_failure_leaves_nothing_complete(tmp_path: Path) -> None:
    """A compute error mid-run: the finished shard may be renamed, the open one stays temporary."""
    plan = [_pt(f"t{i}", (16,)) for i in range(6)]
    w = ShardedWriter(tmp_path, plan_shards(plan, 32))  # 2 tensors per shard
    items = [WorkItem("layer", 16, payload=i, out_names=[[f"t{i}"]]) for i in range(6)]

    def compute(item: WorkItem, data: int):
        if data == 3:
            raise ValueError("boom")
        return [{f"t{data}": torch.full((16,), data, dtype=torch.uint8)}]

    with pytest.raises(ValueError, match="boom"):
        run_pipeline(items, [w], load=lambda it: it.payload, compute=compute)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors.index.json" not in names
    assert not any(n.endswith(TMP_SUFFIX) for n in names)  # the open shard's temp file was removed
    assert all(n.startswith("model-0000") for n in names)


def test_pipeline_writes_in_order(tmp_path: Path) -> None:
    plan = [_pt(f"t{i}", (8,)) for i in range(9)]
    w = ShardedWriter(tmp_path, plan_shards(plan, 24))
    items = [WorkItem("layer", 8, payload=i, out_names=[[f"t{i}"]]) for i in range(9)]
    seen = []
    run_pipeline(items, [w], load=lambda it: it.payload,
                 compute=lambda it, d: [{f"t{d}": torch.full((8,), d, dtype=torch.uint8)}],
                 on_progress=seen.append, depth=PipelineDepth(read_threads=3, prefetch=3))
    w.finish()
    assert sum(seen) == 72
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for i in range(9):
        with safe_open(str(tmp_path / index["weight_map"][f"t{i}"]), "pt") as fh:
            assert fh.get_tensor(f"t{i}").tolist() == [i] * 8


def test_prepare_output_dir_rules(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    with pytest.raises(BadInput, match="is the SOURCE or inside it"):
        prepare_output_dir(src, [src], overwrite=True)
    with pytest.raises(BadInput, match="is the SOURCE or inside it"):
        prepare_output_dir(src / "sub", [src], overwrite=True)
    with pytest.raises(BadInput, match="contains the SOURCE"):
        prepare_output_dir(tmp_path, [src], overwrite=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("x")
    with pytest.raises(BadInput, match=r"not empty; set RunSettings\.overwrite to replace"):
        prepare_output_dir(out, [src], overwrite=False)
    (out / "model-00001-of-00001.safetensors").write_bytes(b"old")
    (out / "mxconv.json").write_text(json.dumps({"tensors": {"a": {"file": "model-00001-of-00001.safetensors"}}}))
    notes = prepare_output_dir(out, [src], overwrite=True)
    assert notes == [f"overwriting {out.resolve()}"]
    assert not (out / "mxconv.json").exists() and not (out / "model-00001-of-00001.safetensors").exists()
    assert (out / IN_PROGRESS).exists()
    assert (out / "precious.txt").exists()  # files mxconv does not write are left alone


def test_overwrite_removes_only_what_mxconv_wrote(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "out"
    (out / "rank-0").mkdir(parents=True)
    (out / "rank-0" / "model.safetensors.index.json").write_text("{}")  # recorded below
    (out / "rank-0" / "model-00001-of-00001.safetensors").write_bytes(b"old")  # listed below
    (out / "rank-data").mkdir()
    (out / "my-lora.safetensors").write_bytes(b"user")
    (out / "chat_template.jinja").write_text("old")
    (out / "notes.txt").write_text("mine")  # listed, but the manifest records no size and sha256 for it
    (out / "tokenizer.json").write_text("edited")  # listed and recorded, but changed since
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    recorded = {"chat_template.jinja": {"size": 3, "sha256": hashlib.sha256(b"old").hexdigest()},
                "tokenizer.json": {"size": 6, "sha256": hashlib.sha256(b"before").hexdigest()},
                "rank-0/model.safetensors.index.json": {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}}
    tensors = {"a": {"file": "rank-0/model-00001-of-00001.safetensors"}, "b": {"file": "model-00001-of-00002.safetensors"}}
    (out / "mxconv.json").write_text(json.dumps({"tensors": tensors, "output_file_hashes": recorded,
                                                 "output_files": ["chat_template.jinja", "notes.txt", "tokenizer.json"]}))
    notes = prepare_output_dir(out, [src], overwrite=True)
    left = sorted(p.name for p in out.iterdir())
    assert left == [IN_PROGRESS, "my-lora.safetensors", "notes.txt", "rank-data", "tokenizer.json"]
    assert "kept notes.txt, tokenizer.json" in notes[-1]


def test_interrupted_output_is_cleaned_without_overwrite(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / IN_PROGRESS).write_text("")
    (out / (".model-00001-of-00002.safetensors" + TMP_SUFFIX)).write_bytes(b"partial")
    notes = prepare_output_dir(out, [src], overwrite=False)
    assert "interrupted" in notes[0]
    assert not list(out.glob("*" + TMP_SUFFIX)) and not list(out.glob(".*" + TMP_SUFFIX))


def test_refuses_output_another_live_run_is_writing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    import os
    import subprocess
    import sys

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (out / IN_PROGRESS).write_text(f"an mxconv run (pid {other.pid}) is writing this directory\n")
        with pytest.raises(BadInput, match=f"being written by another mxconv run \\(pid {other.pid}\\)"):
            prepare_output_dir(out, [src], overwrite=True)
    finally:
        other.kill()
        other.wait()
    notes = prepare_output_dir(out, [src], overwrite=False)  # that run is gone: cleaned up as interrupted
    assert "interrupted" in notes[0]
    assert str(os.getpid()) in (out / IN_PROGRESS).read_text()


@pytest.mark.parametrize("parent_writable", [True, False])
def test_cli_overwrite_stages_then_keeps_files_mxconv_did_not_write(tmp_path: Path, monkeypatch, parent_writable: bool) -> None:
    """README "Output": --overwrite stages beside OUTPUT (inside it, hidden, where the parent is not
    writable), swaps the new output in, and leaves the user's own files in OUTPUT alone."""
    src, out = tmp_path / "src", tmp_path / "out"
    make_checkpoint(src, "gpt-oss-bf16")
    code, _, err = mx("quantize", src, out, "--quiet", "--device", "cpu")
    assert code == 0, err
    (out / "notes.txt").write_text("mine")
    real_access = os.access
    if not parent_writable:
        def access(path, mode, **kw):  # root writes anywhere, so a chmod would not do
            return False if Path(path) == tmp_path and mode == os.W_OK else real_access(path, mode, **kw)
        monkeypatch.setattr(output_dir.os, "access", access)
    code, _, err = mx("quantize", src, out, "--format", "mxfp8", "--overwrite", "--device", "cpu")
    assert code == 0, err
    staging = f"{out}.mxconv-staging-" if parent_writable else f"{out}/.mxconv-staging-"
    assert f"writing the new output to {staging}" in " ".join(err.split()), err
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "mxconv.json").read_text())["weight_format"] == "mxfp8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no staging or set-aside dir left
    assert not [p for p in out.iterdir() if p.name.startswith(".mxconv") or p.name == IN_PROGRESS]
