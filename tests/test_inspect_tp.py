"""``mxconv inspect`` of a tensor-parallel output: the root shows the TP size and every rank's
directory, shard files, bytes on disk and intermediate slice; one ``rank-N`` directory says which rank
of how many it is. Damaged TP outputs end in exit 2 naming the directory and the rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mxconv.examples import ModelSizes

from support.cli import mx
from support.workspace import copy_checkpoint, MadeCheckpoints

WIDE = {"COLUMNS": "200"}  # rich wraps long cells at the default 80 columns


@pytest.fixture(scope="module")
def tp_out(made: MadeCheckpoints) -> Path:
    """A triton --tp 2 output of a source with I = 160: ranks hold [0, 96) and [96, 160), both padded to 128."""
    src = made.source("qwen3-moe", ModelSizes(hidden_size=256, intermediate_size=160)).path
    return made.repack(src, "triton", "--tp", "2")


def _shards_on_disk(rank_dir: Path) -> list[dict[str, object]]:
    """The rank's shard files (those its index names) with their sizes on disk."""
    index = json.loads((rank_dir / "model.safetensors.index.json").read_text())
    return [{"file": f, "bytes": (rank_dir / f).stat().st_size} for f in sorted(set(index["weight_map"].values()))]


def test_inspect_tp_output_json_lists_every_rank(tp_out: Path) -> None:
    code, stdout, err = mx("inspect", tp_out, "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["path"] == str(tp_out.resolve()) and doc["tp_size"] == 2 and "rank" not in doc
    ranks = doc["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["dir"] for r in ranks] == ["rank-0", "rank-1"]
    assert [r["intermediate_range"] for r in ranks] == [[0, 96], [96, 160]]
    assert [r["intermediate_size"] for r in ranks] == [96, 64]
    assert all((r["padded_hidden_size"], r["padded_intermediate_size"]) == (256, 128) for r in ranks)
    for r in ranks:
        d = tp_out / r["dir"]
        assert r["path"] == str(d.resolve())
        assert r["shards"] == _shards_on_disk(d) and len(r["shards"]) == 2
        assert r["bytes"] == sum(s["bytes"] for s in _shards_on_disk(d))
    # the totals cover the whole output: every rank's tensors and shards
    manifest = json.loads((tp_out / "mxconv.json").read_text())
    assert doc["tensors"] == len(manifest["tensors"]) == sum(r["tensors"] for r in ranks)
    assert doc["shards"] == 4
    assert doc["bytes"]["experts"] == sum(r["expert_bytes"] for r in ranks)
    assert doc["bytes_by_role"]["after_label"] == "this output, 2 ranks"
    assert doc["bytes_by_role"]["after"]["experts"] == doc["bytes"]["experts"]


def test_inspect_tp_output_table_names_tp_size_and_rank_files(tp_out: Path) -> None:
    code, stdout, err = mx("inspect", tp_out, env=WIDE)
    assert code == 0, err
    assert "tensor parallel" in stdout and "tp_size 2: rank-0, rank-1" in stdout
    rows = [line for line in stdout.splitlines() if "rank-0/" in line or "rank-1/" in line]
    assert len(rows) == 2
    assert "[0, 96) = 96" in rows[0] and "[96, 160) = 64" in rows[1]
    for row in rows:
        assert "model-00001-of-00002.safetensors" in row and "│ 256 " in row and "│ 128 " in row
    assert stdout.count("model-00002-of-00002.safetensors") == 2


def test_inspect_one_rank_says_which_rank_of_how_many(tp_out: Path) -> None:
    code, stdout, err = mx("inspect", tp_out / "rank-1", env=WIDE)
    assert code == 0, err
    assert f"rank 1 of 2 (output {tp_out.resolve()})" in stdout
    assert "[96, 160) = 64" in stdout and "rank-0/" not in stdout
    code, stdout, err = mx("inspect", tp_out / "rank-1", "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert (doc["rank"], doc["tp_size"], doc["output"]) == (1, 2, str(tp_out.resolve()))
    assert doc["path"] == str((tp_out / "rank-1").resolve()) and doc["kind"] == "kernel"
    assert [r["dir"] for r in doc["ranks"]] == ["rank-1"]
    assert doc["ranks"][0]["shards"] == _shards_on_disk(tp_out / "rank-1")
    assert doc["shards"] == 2 and doc["bytes_by_role"]["after_label"] == "rank 1 of 2"


def test_inspect_tp_output_missing_a_rank(tp_out: Path, tmp_path: Path) -> None:
    k = copy_checkpoint(tp_out, tmp_path / "k")
    (k / "rank-1").rename(k / "rank-2")
    code, _, err = mx("inspect", k)
    assert code == 2 and "Traceback" not in err
    assert f"{k.resolve() / 'rank-1'}: missing" in err and "says tp_size 2" in err
    code, _, err = mx("inspect", k / "rank-2")
    assert code == 2 and f"{k.resolve() / 'rank-2'}: not a rank of this output" in err and "tp_size 2" in err
