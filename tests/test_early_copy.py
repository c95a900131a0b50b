"""The early-copy child (mxconv.early_copy): the CLI's output is the in-process output byte for
byte; the child's errors reach the parent as the same exceptions; a stopped child, or one whose
parent is gone, deletes its unfinished shards."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch

from mxconv.checkpoint import open_checkpoint
from mxconv.convert import QuantOptions, RepackOptions, build_plan, execute
from mxconv.early_copy import EarlyCopy, job_json
from mxconv.families import detect_family
from mxconv.layouts import get_layout
from mxconv.output_dir import OutputWriteError
from mxconv.writer import TMP_SUFFIX, WRITE_DELAY_ENV
from support.checkpoints import make_checkpoint
from support.cli import mx


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("early")
    make_checkpoint(root / "gpt", "gpt-oss-bf16", num_experts=4, shards=3)
    make_checkpoint(root / "gpt-q4", "gpt-oss-mxfp4", num_experts=4, shards=3)
    return root


def _files(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != "mxconv.json"}


def _in_process(src: Path, out: Path, command: str, repack: RepackOptions | None) -> None:
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), command, QuantOptions(), repack)
    execute(plan, out, device=torch.device("cpu"), max_shard_size=50_000, overwrite=False, argv=["test"])


@pytest.mark.parametrize("command, args, repack", [
    ("quantize", (), None),
    ("repack", ("--backend", "marlin", "--tp", "2"), RepackOptions("marlin", get_layout("marlin").activations[0], 2)),
])
def test_cli_output_is_the_in_process_output(ws: Path, tmp_path: Path, command: str, args: tuple, repack) -> None:
    src = ws / ("gpt" if command == "quantize" else "gpt-q4")
    code, stdout, err = mx(command, src, tmp_path / "cli", *args, "--device", "cpu", "--max-shard-size", "50kB", "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["early_copy_bytes"] > 0  # the child wrote the byte copies
    _in_process(src, tmp_path / "lib", command, repack)
    got, want = _files(tmp_path / "cli"), _files(tmp_path / "lib")
    assert got == want and sum(n.endswith(".safetensors") for n in got) >= 3
    tensors = lambda d: json.loads((d / "mxconv.json").read_text())["tensors"]  # noqa: E731
    assert tensors(tmp_path / "cli") == tensors(tmp_path / "lib")
    # the byte copies fill the first shards, the converted tensors the others
    index = json.loads(((tmp_path / "lib") / ("rank-0" if repack else ".") / "model.safetensors.index.json").read_text())
    roles = {n: t["role"] for n, t in tensors(tmp_path / "lib").items()}
    shard_roles: dict[str, set] = {}
    for name, f in index["weight_map"].items():
        shard_roles.setdefault(f, set()).add(roles[("rank-0/" if repack else "") + name] in ("copy", "router"))
    kinds = [shard_roles[f] for f in sorted(shard_roles)]
    assert all(len(k) == 1 for k in kinds) and kinds[0] == {True} and kinds[-1] == {False}
    assert kinds == sorted(kinds, key=lambda k: not next(iter(k)))


def _job(ws: Path, out: Path) -> tuple[dict, int]:
    ckpt = open_checkpoint(ws / "gpt")
    plan = build_plan(ckpt, detect_family(ckpt), "quantize", QuantOptions(), None)
    names = plan.copied_names()
    shards = [s for s in plan.shard_plans(50_000)[0] if s.tensors[0].name in set(names)]
    assert len(shards) >= 3
    return job_json([(out, out, shards)], names, check=True), ckpt.total_bytes(names)


def test_child_reports_an_unwritable_output_as_the_parents_error(ws: Path, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    job, n = _job(ws, tmp_path / "a-file" / "out")
    copier = EarlyCopy.start(job, n)
    assert copier is not None
    with pytest.raises(OutputWriteError, match=r"cannot write .*a-file/out/model-00001-of-"):
        copier.result()


def test_child_progress_reaches_a_late_callback_and_tables_come_back(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job, n = _job(ws, out)
    copier = EarlyCopy.start(job, n)
    time.sleep(0.5)  # progress before anyone listens is kept
    seen: list[int] = []
    copier.on_progress = seen.append
    tables = copier.result()
    assert sum(seen) == n and len(tables) == 1
    table = tables[0]
    assert list(table) == job["names"]
    for name, w in table.items():
        assert (out / w.file).is_file() and len(w.sha256) == 64
    assert not list(out.glob(f"*{TMP_SUFFIX}"))


def _slow_child(ws: Path, out: Path, parent: int | None = None) -> EarlyCopy:
    out.mkdir()
    job, n = _job(ws, out)
    if parent is not None:
        job["parent"] = parent
    os.environ[WRITE_DELAY_ENV] = "0.2"  # the child's writer pauses after every tensor (cancellable)
    try:
        copier = EarlyCopy.start(job, n)
    finally:
        del os.environ[WRITE_DELAY_ENV]
    assert copier is not None
    return copier


def test_a_stopped_child_deletes_its_unfinished_shards(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    copier = _slow_child(ws, out)
    got: list[int] = []
    copier.on_progress = got.append
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    assert got, "the child never finished a tensor"
    t0 = time.monotonic()
    copier.stop()
    assert time.monotonic() - t0 < 5
    assert copier._proc.returncode == 3
    assert not list(out.glob(f"*{TMP_SUFFIX}"))
    with pytest.raises(RuntimeError, match=r"failed \(exit 3\)"):
        copier.result()


def test_a_child_whose_parent_is_gone_stops(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    copier = _slow_child(ws, out, parent=1)  # not our pid: the child takes its parent for gone
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exit 3"):
        copier.result()
    assert time.monotonic() - t0 < 10
    assert not list(out.glob(f"*{TMP_SUFFIX}"))


def test_a_failed_child_stops_the_parent_early(ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN in the first copied tensor: the child fails at once, and the parent, whose writer pauses
    0.5 s after every tensor here (MXCONV_TEST_WRITE_DELAY), stops within a tensor or two instead of
    converting on to the end before reporting it."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ws / "gpt", src)
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), "quantize", QuantOptions(), None)
    first = ckpt.info(plan.copied_names()[0])
    assert first.dtype == "BF16"
    with open(first.file, "r+b") as f:
        f.seek(first.begin)
        f.write(b"\xc0\x7f")  # bf16 NaN, element 0
    computed = sum(len(names) for i in plan.items if i.kind != "copy" for names in i.out_names)
    assert computed >= 8  # >= 4 s of pauses had the parent gone on to the end
    monkeypatch.setenv(WRITE_DELAY_ENV, "0.5")
    t0 = time.monotonic()
    code, _, err = mx("quantize", src, tmp_path / "out", "--device", "cpu", "--quiet")
    took = time.monotonic() - t0
    assert code == 2 and f"non-finite value (NaN/Inf) in {first.name} [" in err, err
    assert took < 0.5 * computed - 1.5, took
    assert not (tmp_path / "out").exists()


def test_ctrl_c_while_the_child_copies_removes_everything(ws: Path, tmp_path: Path) -> None:
    """Ctrl-C reaches the whole process group: the child ignores it, the parent stops it, deletes
    what both wrote and says so (exit 2); no child is left running."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    mark = f"mxconv-test-{os.getpid()}-{time.monotonic_ns()}"  # finds this run's child, not another test session's
    env = dict(os.environ, **{WRITE_DELAY_ENV: "0.3", "MXCONV_TEST_MARK": mark})
    p = subprocess.Popen([sys.executable, "-m", "mxconv.cli", "quantize", str(ws / "gpt"), str(out), "--quiet",
                          "--device", "cpu", "--max-shard-size", "50kB"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out.is_dir() and any(out.glob("*.safetensors*"))):
        time.sleep(0.02)  # the child has begun writing its shards
    assert out.is_dir(), "the run never started writing"
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "interrupted by SIGINT" in err and "was removed" in err, err
    assert not out.exists()
    assert not _early_copy_children(mark), "an early-copy child outlived its run"


def _early_copy_children(mark: str) -> list[int]:
    """Pids of running early-copy children whose environment holds MXCONV_TEST_MARK=mark (/proc)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"child_main" in (d / "cmdline").read_bytes() and f"MXCONV_TEST_MARK={mark}".encode() in (d / "environ").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def test_a_source_read_error_in_the_child_is_the_parents_os_error(ws: Path, tmp_path: Path) -> None:
    """Reading a copied tensor's source fails in the child (here: the shard became a directory):
    the parent raises the same OSError the in-process copy would (exit 2 from the CLI), not an
    internal error."""
    import errno

    job, n = _job(ws, tmp_path / "out")
    (tmp_path / "out").mkdir()
    first = job["ranks"][0]["shards"][0]["tensors"][0]["source"]
    (tmp_path / "gone").mkdir()
    first["file"] = str(tmp_path / "gone")
    copier = EarlyCopy.start(job, n)
    with pytest.raises(OSError) as exc:
        copier.result()
    assert exc.value.errno == errno.EISDIR and exc.value.filename == str(tmp_path / "gone")
    assert not list((tmp_path / "out").glob(f"*{TMP_SUFFIX}"))


def test_a_late_refusal_leaves_no_directory_behind(ws: Path, tmp_path: Path) -> None:
    """--max-memory is checked once torch is loaded, after OUTPUT was made ready (the early copy
    starts first): the refusal still exits 2 and removes OUTPUT and the parents this run created."""
    out = tmp_path / "a" / "b" / "out"
    code, _, err = mx("quantize", ws / "gpt", out, "--device", "cpu", "--max-memory", "1MB", "--quiet")
    assert code == 2 and "--max-memory" in err, err
    assert not (tmp_path / "a").exists()
