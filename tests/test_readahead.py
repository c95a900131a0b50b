"""mxconv.readahead: the start-up read of a local source (order, limit, stop, no torch import)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mxconv.readahead import Readahead, shard_order


def _source(root: Path, sizes: dict[str, int], weight_map: dict[str, str] | None) -> Path:
    root.mkdir()
    for name, n in sizes.items():
        (root / name).write_bytes(bytes(range(256)) * (n // 256))
    if weight_map is not None:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def test_order_follows_layers_globals_last(tmp_path: Path) -> None:
    root = _source(tmp_path / "m", {"a.safetensors": 1024, "b.safetensors": 1024, "c.safetensors": 1024}, {
        "model.embed_tokens.weight": "a.safetensors",  # only global tensors: read last
        "lm_head.weight": "a.safetensors",
        "model.layers.10.mlp.experts.0.up_proj.weight": "b.safetensors",
        "model.layers.2.mlp.experts.0.up_proj.weight": "c.safetensors",
        "model.layers.11.self_attn.q_proj.weight": "c.safetensors",
    })
    assert [f.name for f in shard_order(root)] == ["c.safetensors", "b.safetensors", "a.safetensors"]


def test_without_index_all_shards_by_name_and_bad_index_reads_nothing(tmp_path: Path) -> None:
    root = _source(tmp_path / "m", {"x-2.safetensors": 512, "x-1.safetensors": 512}, None)
    assert [f.name for f in shard_order(root)] == ["x-1.safetensors", "x-2.safetensors"]
    (root / "model.safetensors.index.json").write_text("{not json")
    assert shard_order(root) == []


def test_reads_up_to_the_limit_and_stops(tmp_path: Path) -> None:
    mib = 1 << 20
    root = _source(tmp_path / "m", {"s1.safetensors": 12 * mib, "s2.safetensors": 12 * mib}, None)
    ra = Readahead.for_source(str(root), limit=20 * mib)
    assert ra is not None and ra._proc is not None  # a child process reads, not a thread of ours
    # whole 8 MiB chunks until the limit is passed: 8, 12 (end of s1), 20
    assert ra.wait(timeout=30) == 20 * mib and ra.stop() == 20 * mib
    everything = Readahead.for_source(str(root), limit=1 << 40)
    assert everything is not None
    assert everything.wait(timeout=30) == 24 * mib


def test_stop_ends_the_child_and_reports_what_it_read(tmp_path: Path) -> None:
    mib = 1 << 20
    root = _source(tmp_path / "m", {"s1.safetensors": 64 * mib}, None)
    ra = Readahead.for_source(str(root), limit=1 << 40)
    assert ra is not None
    proc = ra._proc
    got = ra.stop()
    assert proc is not None and proc.poll() is not None  # the reader is gone
    assert 0 <= got <= 64 * mib and got % (8 * mib) in (0, 64 * mib % (8 * mib))
    assert ra.stop() == got  # idempotent (atexit calls it again)


def test_without_a_child_a_thread_reads(tmp_path: Path, monkeypatch) -> None:
    import mxconv.readahead as readahead

    def no_child(*args, **kwargs):
        raise OSError("no fork here")

    monkeypatch.setattr(readahead.subprocess, "Popen", no_child)
    mib = 1 << 20
    root = _source(tmp_path / "m", {"s1.safetensors": 12 * mib, "s2.safetensors": 12 * mib}, None)
    ra = Readahead.for_source(str(root), limit=1 << 40)
    assert ra is not None and ra._proc is None
    assert ra.wait(timeout=30) == 24 * mib and ra.stop() == 24 * mib


def test_not_a_directory_is_not_read(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert Readahead.for_source("openai/gpt-oss-20b") is None  # a Hub id: the download is the read
    assert Readahead.for_source(str(tmp_path / "missing")) is None
    assert Readahead.for_source(str(tmp_path)) is None  # a directory without shards


def test_imports_no_torch() -> None:
    code = "import sys, mxconv.readahead; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_stop_after_wait_keeps_the_count(tmp_path: Path) -> None:
    mib = 1 << 20
    root = _source(tmp_path / "m", {"s1.safetensors": 12 * mib}, None)
    ra = Readahead.for_source(str(root), limit=1 << 40)
    assert ra is not None
    assert ra.wait() == 12 * mib and ra.stop() == 12 * mib


def test_a_run_that_fails_before_converting_ends_its_reader(tmp_path: Path, monkeypatch) -> None:
    """In-process callers (tests, libraries) keep running after a failed command: no reader may stay."""
    import mxconv.readahead as readahead
    from support.cli import mx

    started: list[Readahead] = []
    real = readahead.Readahead.start

    def track(self: Readahead) -> None:
        started.append(self)
        real(self)

    monkeypatch.setattr(readahead.Readahead, "start", track)
    mib = 1 << 20
    root = _source(tmp_path / "m", {"s1.safetensors": 64 * mib}, None)  # shards but no config.json: exit 2
    code, _, err = mx("quantize", root, tmp_path / "out")
    assert code == 2, err
    assert len(started) == 1 and started[0]._proc is None  # stopped and reaped
