"""Interruptions and disk trouble (docs/reliability.md): SIGINT/SIGTERM mid-write, --overwrite that
keeps the old output whole until the new one is complete, the free-space check, a full disk.

The signal tests run the CLI in a subprocess whose writer pauses after every tensor
(``support/slow_write.py`` patches it in) and signal it once its first temporary shard exists, so the
run is always mid-write when the signal lands, however slow the machine.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest

import mxconv.output.directory as output_dir_mod
import mxconv.output.writer as writer_mod
from mxconv.output.directory import STAGING, TMP_SUFFIX
from mxconv.source.file_names import IN_PROGRESS
from support.cli import mx
from support.workspace import MadeCheckpoints

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
SLOW_WRITE = Path(__file__).resolve().parent / "support" / "slow_write.py"


@pytest.fixture(scope="module")
def src(made: MadeCheckpoints) -> Path:
    return made.source("qwen3-moe").path


def snapshot(d: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file below ``d`` (hidden ones included)."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def leftovers(root: Path) -> list[str]:
    """Temporary shards, staging/set-aside directories and markers anywhere below ``root``."""
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*")
        if p.name.endswith(TMP_SUFFIX) or ".mxconv-staging-" in p.name or ".mxconv-old-" in p.name or p.name == IN_PROGRESS
    )


def start_slow(args: list[str], delay: float = 1.0) -> subprocess.Popen:
    """``mxconv ARGS`` in a subprocess whose writer pauses ``delay`` seconds after every tensor."""
    return subprocess.Popen([sys.executable, str(SLOW_WRITE), str(delay), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(pattern_root: Path, pattern: str, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    """Wait until a file matching ``pattern`` exists below ``pattern_root`` (the run is mid-write)."""
    deadline = time.monotonic() + timeout
    while not list(pattern_root.glob(pattern)):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before writing (exit {proc.returncode}): {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {pattern} below {pattern_root} after {timeout} s")
        time.sleep(0.05)


def stop(proc: subprocess.Popen, sig: int) -> tuple[int, str, str]:
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=120)  # a hanging thread would show up here
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def test_sigterm_mid_write_removes_the_partial_output_and_the_documented_rerun_works(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["quantize", str(src), str(out), "--max-shard-size", "20kB", "--device", "cpu", "--quiet"]
    proc = start_slow(args)
    wait_for(out, ".*" + TMP_SUFFIX, proc)
    code, stdout, stderr = stop(proc, signal.SIGTERM)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted by SIGTERM"), stderr
    assert "Traceback" not in stderr and stdout == ""
    assert not out.exists()  # this run created OUTPUT: nothing of it is left
    assert leftovers(tmp_path) == []
    # docs/reliability.md: after an interruption, rerun the same command
    assert "rerun the same command" in DOC.read_text() and "rerun the same command" in lines[0]
    code, _, err = mx(*args)
    assert code == 0, err
    code, _, err = mx("verify", out, "--reference", src, "--quiet")
    assert code == 0, err


def test_sigint_during_overwrite_keeps_the_old_output_whole(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, _, err = mx("quantize", src, out, "--quiet", "--device", "cpu")
    assert code == 0, err
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    args = ["quantize", str(src), str(out), "--format", "mxfp8", "--overwrite", "--max-shard-size", "20kB",
            "--device", "cpu", "--quiet"]
    proc = start_slow(args)
    wait_for(tmp_path, f"out.{STAGING}-*/.*{TMP_SUFFIX}", proc)  # the new output is staged beside OUTPUT
    code, stdout, stderr = stop(proc, signal.SIGINT)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted by SIGINT"), stderr
    assert "still holds the earlier output, unchanged" in lines[0]
    assert snapshot(out) == before
    assert leftovers(tmp_path) == []
    code, _, err = mx(*args)  # the documented next step: the same command
    assert code == 0, err
    m = json.loads((out / "mxconv.json").read_text())
    assert m["weight_format"] == "mxfp8" and (out / "notes.txt").read_text() == "mine"


def test_in_process_sigterm_joins_every_thread(src: Path, tmp_path: Path, monkeypatch) -> None:
    """SIGTERM while the writer is busy: exit 2, every mxconv thread has ended, nothing is left."""
    out = tmp_path / "out"
    real_end = writer_mod.ShardedWriter._end
    count = [0]

    def end_then_signal(self, planned, digest) -> None:
        real_end(self, planned, digest)
        count[0] += 1
        if count[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread, mid-run
            time.sleep(0.5)

    monkeypatch.setattr(writer_mod.ShardedWriter, "_end", end_then_signal)
    previous = signal.getsignal(signal.SIGTERM)
    code, _, err = mx("quantize", src, out, "--max-shard-size", "20kB", "--device", "cpu", "--quiet")
    assert code == 2 and "interrupted by SIGTERM" in err, err
    assert signal.getsignal(signal.SIGTERM) == previous  # the CLI put the old handler back
    assert not out.exists() and leftovers(tmp_path) == []
    deadline = time.monotonic() + 30
    while [t for t in threading.enumerate() if t.name.startswith("mxconv-")] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [t.name for t in threading.enumerate() if t.name.startswith("mxconv-")] == []


def test_overwrite_leaves_no_stale_files(src: Path, tmp_path: Path) -> None:
    """A TP output overwritten by a single-rank one: rank dirs and the old shards go; files mxconv
    never writes stay, a model.safetensors it did not write too, with a warning (verify fails on it)."""
    q4 = tmp_path / "q4"
    code, _, err = mx("quantize", src, q4, "--quiet", "--device", "cpu")
    assert code == 0, err
    out = tmp_path / "out"
    code, _, err = mx("repack", q4, out, "--backend", "trtllm", "--tp", "2", "--quiet", "--device", "cpu")
    assert code == 0, err
    (out / "model.safetensors").write_bytes(b"a loader would read this before the index")
    (out / "README.md").write_text("mine")
    (out / "rank-data").mkdir()
    code, _, err = mx("quantize", src, out, "--overwrite", "--quiet", "--device", "cpu", "--max-shard-size", "200kB")
    assert code == 0, err
    assert f"warning: {out} keeps model.safetensors (mxconv did not write it)" in " ".join(err.split()), err
    names = sorted(p.name for p in out.iterdir())
    m = json.loads((out / "mxconv.json").read_text())
    shards = sorted({t["file"] for t in m["tensors"].values()})
    assert names == sorted(["README.md", "rank-data", "config.json", "generation_config.json", "mxconv.json",
                            "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
                            "tokenizer_config.json", *shards])
    assert leftovers(tmp_path) == []
    (out / "model.safetensors").unlink()
    code, _, err = mx("verify", out, "--reference", src, "--quiet")
    assert code == 0, err


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_killed_overwrite_is_cleaned_up_by_the_rerun(src: Path, tmp_path: Path) -> None:
    """What SIGKILL leaves during an --overwrite (a staging dir beside OUTPUT, a set-aside dir) is
    removed by the next run; a live run's staging dir makes OUTPUT busy."""
    out = tmp_path / "out"
    code, _, err = mx("quantize", src, out, "--quiet", "--device", "cpu")
    assert code == 0, err
    pid = dead_pid()
    stale = tmp_path / f"out.{STAGING}-{pid}"
    stale.mkdir()
    (stale / ("." + "model-00001-of-00002.safetensors" + TMP_SUFFIX)).write_bytes(b"partial")
    (out / f".mxconv-old-{pid}").mkdir()
    code, _, err = mx("quantize", src, out, "--overwrite", "--quiet", "--device", "cpu")
    assert code == 0, err
    assert leftovers(tmp_path) == []
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f"out.{STAGING}-{other.pid}").mkdir()
        code, _, err = mx("quantize", src, out, "--overwrite", "--quiet", "--device", "cpu")
        assert code == 2 and f"being written by another mxconv run (pid {other.pid}" in err, err
    finally:
        other.kill()
        other.wait()
        shutil.rmtree(tmp_path / f"out.{STAGING}-{other.pid}")


Usage = namedtuple("Usage", "total used free")


def test_free_space_is_checked_before_writing(src: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 1234, 1234))
    out = tmp_path / "new" / "out"
    code, _, err = mx("quantize", src, out, "--quiet", "--device", "cpu")
    assert code == 2 and "not enough free space for the output" in err, err
    assert "(1234 bytes) are free on the filesystem of " + str(tmp_path) in err
    needed = int(err.split(" bytes), ")[0].rsplit("(", 1)[1])
    assert needed > 400_000  # the shards alone are about half a megabyte
    assert not (tmp_path / "new").exists()
    # with --overwrite the old output stays until the new one is complete: both must fit
    old = tmp_path / "old"
    monkeypatch.undo()
    code, _, err = mx("quantize", src, old, "--quiet", "--device", "cpu")
    assert code == 0, err
    before = snapshot(old)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - needed + 1, needed - 1))
    code, _, err = mx("quantize", src, old, "--overwrite", "--quiet", "--device", "cpu")
    assert code == 2 and "--overwrite keeps the old output" in err, err
    assert snapshot(old) == before and leftovers(tmp_path) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 0, 10**9))
    code, _, err = mx("quantize", src, old, "--overwrite", "--quiet", "--device", "cpu")
    assert code == 0, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_unwritable_output_location_is_named_not_called_full(src: Path) -> None:
    """/proc takes no files (and reports 0 B free): the message says it is not writable, not that the disk is full."""
    code, _, err = mx("quantize", src, "/proc/no-such-output", "--quiet", "--device", "cpu")
    assert code == 2 and "/proc/no-such-output: cannot write there: /proc is not writable" in err, err
    assert "free space" not in err


class _FullDisk:
    """A binary file that takes ``room`` bytes, then fails every write with ENOSPC."""

    room = 150_000
    used = 0

    def __init__(self, f) -> None:
        self._f = f

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if _FullDisk.used + n > _FullDisk.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _FullDisk.used += n
        return self._f.write(data)

    def __getattr__(self, name: str):
        return getattr(self._f, name)


@pytest.mark.parametrize("overwrite", [False, True])
def test_disk_full_names_the_output_file_and_leaves_nothing(src: Path, tmp_path: Path, monkeypatch, overwrite: bool) -> None:
    out = tmp_path / "out"
    before = {}
    if overwrite:
        code, _, err = mx("quantize", src, out, "--quiet", "--device", "cpu")
        assert code == 0, err
        before = snapshot(out)
    _FullDisk.used = 0
    def full_open(path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)
        return _FullDisk(f) if "b" in mode else f

    monkeypatch.setattr(writer_mod, "open", full_open, raising=False)  # the shard files the writer opens
    args = ["quantize", src, out, "--max-shard-size", "100kB", "--device", "cpu", "--quiet"]
    code, _, err = mx(*args, *(["--overwrite"] if overwrite else []))
    assert code == 2, err
    line = err.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in err
    # the first shard written (the byte copies' shards come first)
    assert re.search(rf"disk full \({os.strerror(errno.ENOSPC)}\) while writing {re.escape(str(out.resolve()))}/model-\d{{5}}-of-\d{{5}}\.safetensors;", line), line
    assert str(src) not in line
    assert "free space (or choose an OUTPUT on another disk) and rerun the same command" in line
    if overwrite:
        assert "still holds the earlier output, unchanged" in line and snapshot(out) == before
    else:
        assert not out.exists()
    assert leftovers(tmp_path) == []


def test_raw_enospc_from_anywhere_in_the_writer_names_the_output(src: Path, tmp_path: Path, monkeypatch) -> None:
    """An OSError(ENOSPC) without a file name (as a buffered write raises it) still names OUTPUT."""
    real = writer_mod.ShardedWriter.write_tensor
    calls = [0]

    def write_then_fill(self, name, tensor) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, name, tensor)

    monkeypatch.setattr(writer_mod.ShardedWriter, "write_tensor", write_then_fill)
    out = tmp_path / "out"
    code, _, err = mx("quantize", src, out, "--max-shard-size", "100kB", "--device", "cpu", "--quiet")
    assert code == 2 and f"while writing {out.resolve()}" in err and str(src) not in err, err
    assert not out.exists() and leftovers(tmp_path) == []


def test_inspect_and_verify_of_a_directory_being_written_say_so(tmp_path: Path) -> None:
    """An output a live run is writing is not 'an interrupted run to rerun': the message says to wait."""
    import subprocess as sp

    from support.cli import mx

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    live = sp.Popen(["sleep", "30"])
    try:
        (out / ".mxconv-in-progress").write_text(f"an mxconv run (pid {live.pid}) is writing this directory\n")
        for cmd in ("verify", "inspect"):
            code, _, err = mx(cmd, out)
            assert code == 2 and f"mxconv (pid {live.pid}) is writing this output now" in err.replace("\n", ""), (cmd, err)
    finally:
        live.kill()
        live.wait()
    code, _, err = mx("verify", out)  # the writer is gone: an interrupted run
    assert code == 2 and "an interrupted mxconv run? rerun it" in err.replace("\n", ""), err


# ---- signals at the edges of a run: while mxconv starts, once its output is complete -----------

SRC_DIR = str(Path(__file__).resolve().parents[1] / "src")

# Runs ``python -m mxconv.cli ARGS`` (argv[2:]) with an import finder that, when the CLI's modules
# import typer, writes the file argv[1] and waits: the test signals the process there, mid start-up.
_HELD_START = """
import pathlib, runpy, sys, time
marker = pathlib.Path(sys.argv[1])
class HoldTyper:
    def find_spec(self, name, path=None, target=None):
        if name == "typer":
            marker.write_text("importing typer")
            time.sleep(300)
        return None
sys.meta_path.insert(0, HoldTyper())
sys.argv = ["mxconv", *sys.argv[2:]]
runpy.run_module("mxconv.cli", run_name="__main__", alter_sys=True)
"""


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_DIR, env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_while_mxconv_starts_exits_2_without_a_traceback(src: Path, tmp_path: Path, sig: int) -> None:
    out, marker = tmp_path / "out", tmp_path / "starting"
    proc = subprocess.Popen([sys.executable, "-c", _HELD_START, str(marker), "quantize", str(src), str(out),
                             "--device", "cpu", "--quiet"], env=_cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path, marker.name, proc)
    code, stdout, stderr = stop(proc, sig)
    name = signal.Signals(sig).name
    assert code == 2 and "Traceback" not in stderr and stdout == "", (code, stderr)
    assert stderr == f"error: interrupted by {name}; mxconv was starting and had written nothing\n"
    assert not out.exists()


def _commit_then(sig: int):
    real = output_dir_mod.OutputTarget.commit

    def commit_then_signal(self) -> None:
        real(self)
        os.kill(os.getpid(), sig)  # handled in the main thread, once the output is complete

    return commit_then_signal


@pytest.mark.parametrize("overwrite", [False, True])
def test_signal_after_the_output_is_complete_keeps_it_and_exits_0(src: Path, tmp_path: Path, monkeypatch,
                                                                    overwrite: bool) -> None:
    out = tmp_path / "out"
    if overwrite:
        code, _, err = mx("quantize", src, out, "--quiet", "--device", "cpu")
        assert code == 0, err
    monkeypatch.setattr(output_dir_mod.OutputTarget, "commit", _commit_then(signal.SIGINT))
    code, stdout, err = mx("quantize", src, out, "--format", "mxfp8", "--device", "cpu", "--json",
                           *(["--overwrite"] if overwrite else []))
    assert code == 0, err
    assert "SIGINT arrived after the output was complete; nothing was stopped and the output is kept as written" in err
    assert "interrupted" not in err and json.loads(stdout)["weight_format"] == "mxfp8"
    assert json.loads((out / "mxconv.json").read_text())["weight_format"] == "mxfp8" and leftovers(tmp_path) == []
    monkeypatch.undo()
    code, _, err = mx("verify", out, "--reference", src, "--quiet")
    assert code == 0, err


def test_sigint_around_the_overwrite_swap_exit_code_agrees_with_the_output(src: Path, tmp_path: Path) -> None:
    """SIGINT as soon as the new manifest shows in OUTPUT (a real process, no hook): exit 0 with the
    complete new output, or exit 2 with the old output whole; never exit 2 over a complete new one."""
    out = tmp_path / "out"
    code, _, err = mx("quantize", src, out, "--quiet", "--device", "cpu")
    assert code == 0, err
    before = snapshot(out)
    proc = subprocess.Popen([sys.executable, "-m", "mxconv.cli", "quantize", str(src), str(out), "--format", "mxfp8",
                             "--overwrite", "--device", "cpu", "--quiet"], env=_cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    manifest = out / "mxconv.json"
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if json.loads(manifest.read_text())["weight_format"] == "mxfp8":  # renamed in whole: never partial
                break
        except (OSError, ValueError):
            pass  # moved aside during the swap
    code, stdout, stderr = stop(proc, signal.SIGINT)
    assert "Traceback" not in stderr and stdout == ""
    if code == 0:
        assert stderr in ("", "note: SIGINT arrived after the output was complete; nothing was stopped and the output "
                              "is kept as written\n"), stderr
        assert json.loads(manifest.read_text())["weight_format"] == "mxfp8"
        code, _, err = mx("verify", out, "--reference", src, "--quiet")
        assert code == 0, err
    else:
        assert code == 2 and "still holds the earlier output, unchanged" in stderr, (code, stderr)
        assert snapshot(out) == before
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("next_work", ["conversion", "verify"])
def test_a_signal_after_one_output_is_complete_stops_the_next_step_of_the_same_command(
        src: Path, tmp_path: Path, next_work: str) -> None:  # fmt: skip
    """A command that runs several conversions (``mxconv demo``): a signal noted once the first
    output is complete stops the next conversion or verification before it writes or reads anything,
    instead of being noted for the rest of the command."""
    import torch

    from mxconv.interrupt import Interrupted, late_signal, stop_signals
    from mxconv.run.conversion import Conversion
    from mxconv.run.options import QuantOptions
    from mxconv.verify import verify

    first, second = tmp_path / "first", tmp_path / "second"
    with pytest.raises(Interrupted) as stopped, stop_signals():
        Conversion.open(src, QuantOptions("mxfp4")).run(first, device=torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGINT)  # after the commit: noted, not raised
        assert late_signal() == "SIGINT"
        if next_work == "conversion":
            Conversion.open(src, QuantOptions("mxfp8")).run(second, device=torch.device("cpu"))
        else:
            verify(first)
    assert stopped.value.signame == "SIGINT"
    assert (first / "mxconv.json").is_file() and not second.exists()


def test_a_signal_while_the_process_exits_is_ignored() -> None:
    """After the command returned, a SIGINT during the interpreter's exit (atexit hooks, library
    finalizers) prints no traceback and leaves the exit code alone."""
    code = ("import atexit, os, signal, sys, time\n"
            "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))\n"
            "sys.argv = ['mxconv', 'inspect', '--help']\n"
            "from mxconv.cli import main\n"
            "main()\n")
    r = subprocess.run([sys.executable, "-c", code], env=_cli_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr
    assert "Usage:" in r.stdout
