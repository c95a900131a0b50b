"""Nothing outside OUTPUT (issue 29, the write side; docs/reliability.md "Links inside OUTPUT",
"One writer per OUTPUT", "What --overwrite removes"):

* a link inside OUTPUT named like a file mxconv writes (a side file, the marker, config.json, a rank
  directory) is replaced, never written through, in place and under ``--overwrite``;
* a source side file that is a FIFO, a device or huge is refused at once (exit 2) naming file and rule;
* one writer per OUTPUT: a run that finds the lock held exits 2 naming the holder's pid, a lock left
  by a SIGKILLed run is taken over;
* ``--overwrite`` deletes a file an old manifest lists only while it has the size and sha256 that
  manifest recorded, and says before the run which kept files ``verify`` will fail on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mxconv.output.lock import OutputLock
from mxconv.source.file_names import IN_PROGRESS, LOCK_NAME
from mxconv.source.side_files import SIDE_FILE_LIMIT
from support.cli import mx
from support.workspace import MadeCheckpoints, copy_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def src(made: MadeCheckpoints) -> Path:
    return made.source("qwen3-moe").path


def quantize(src: Path, out: Path, *options: object) -> tuple[int, str, str]:
    return mx("quantize", src, out, "--device", "cpu", "--quiet", *options)


def victim(tmp_path: Path, name: str = "victim") -> Path:
    """A file outside OUTPUT that a link inside it points to: it must never change."""
    v = tmp_path / name
    v.write_text(f"{name}: not mxconv's\n")
    return v


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


# --- links inside OUTPUT are replaced, never written through ---------------------------------------


def test_a_link_named_like_a_side_file_in_an_interrupted_output_is_replaced(src: Path, tmp_path: Path) -> None:
    """Reproduction 1: mkdir o; marker of a dead run; o/tokenizer.json -> victim; quantize SRC o."""
    v = victim(tmp_path)
    before = v.read_text()
    out = tmp_path / "o"
    out.mkdir()
    (out / IN_PROGRESS).write_text(f"{dead_pid()}\n")
    (out / "tokenizer.json").symlink_to(v)
    code, _, err = quantize(src, out)
    assert code == 0, err
    assert v.read_text() == before
    assert not (out / "tokenizer.json").is_symlink()
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    code, _, err = mx("verify", out, "--quiet")
    assert code == 0, err


def test_a_marker_that_is_a_link_is_replaced(src: Path, tmp_path: Path) -> None:
    """Reproduction 1, the marker itself a link: the victim never gets the marker's text."""
    v = victim(tmp_path)
    before = v.read_text()
    out = tmp_path / "o"
    out.mkdir()
    (out / IN_PROGRESS).symlink_to(v)
    code, _, err = quantize(src, out)
    assert code == 0, err
    assert v.read_text() == before
    assert not os.path.lexists(out / IN_PROGRESS) and (out / "mxconv.json").is_file()


def test_links_inside_a_complete_output_are_replaced_by_overwrite(src: Path, tmp_path: Path) -> None:
    """Reproduction 1 under --overwrite: links named like the marker, config, side files and a
    temporary file of a complete output; the new output's files replace them, the targets stay."""
    out = tmp_path / "o"
    code, _, err = quantize(src, out)
    assert code == 0, err
    names = [IN_PROGRESS, "config.json", "tokenizer.json", "generation_config.json", ".config.json.mxconv-tmp"]
    victims = {}
    for i, name in enumerate(names):
        victims[name] = victim(tmp_path, f"victim{i}")
        (out / name).unlink(missing_ok=True)
        (out / name).symlink_to(victims[name])
    before = {name: v.read_text() for name, v in victims.items()}
    code, _, err = quantize(src, out, "--overwrite", "--format", "mxfp8")
    assert code == 0, err
    assert {name: v.read_text() for name, v in victims.items()} == before
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file() and not (out / name).is_symlink()
    assert not os.path.lexists(out / IN_PROGRESS) and not os.path.lexists(out / ".config.json.mxconv-tmp")
    code, _, err = mx("verify", out, "--quiet")
    assert code == 0, err


def test_a_link_named_like_a_rank_directory_is_replaced(made: MadeCheckpoints, src: Path, tmp_path: Path) -> None:
    """A tensor-parallel run into an interrupted output whose rank-0 links to a directory elsewhere:
    the shards go into a real rank-0 inside OUTPUT; the linked directory is untouched."""
    q4 = made.quantize(src)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    out = tmp_path / "o"
    out.mkdir()
    (out / IN_PROGRESS).write_text(f"{dead_pid()}\n")
    (out / "rank-0").symlink_to(elsewhere, target_is_directory=True)
    code, _, err = mx("repack", q4, out, "--backend", "trtllm", "--tp", "2", "--device", "cpu", "--quiet")
    assert code == 0, err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]
    assert not (out / "rank-0").is_symlink() and (out / "rank-0" / "model.safetensors.index.json").is_file()
    code, _, err = mx("verify", out, "--quiet")
    assert code == 0, err


# --- side files of the source: regular files within a bound, or exit 2 at once ----------------------


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_a_side_file_that_is_no_regular_file_or_is_huge_is_refused_at_once(src: Path, tmp_path: Path, kind: str) -> None:
    s = copy_checkpoint(src, tmp_path / "src")
    side = s / "tokenizer.json"
    side.unlink()
    if kind == "fifo":
        os.mkfifo(side)
        rule = "is a FIFO; mxconv copies the files beside the weights"
    elif kind == "device":
        side.symlink_to("/dev/zero")
        rule = "is a character device; mxconv copies the files beside the weights"
    else:
        with open(side, "wb") as f:
            f.truncate(SIDE_FILE_LIMIT + 1)  # sparse: takes no room
        rule = f"is 268.44 MB ({SIDE_FILE_LIMIT + 1} bytes), more than the {SIDE_FILE_LIMIT} bytes (256 MiB) a file copied beside the weights"
    out = tmp_path / "o"
    code, _, err = quantize(s, out)
    assert code == 2, err
    assert f"{side}: {rule}" in " ".join(err.split()), err
    assert not out.exists()


# --- one writer per OUTPUT --------------------------------------------------------------------------


def test_a_run_that_finds_the_lock_held_exits_2_naming_the_holder(src: Path, tmp_path: Path) -> None:
    """Reproduction 5: while another process holds OUTPUT's lock (taken the way a run takes it,
    before any check), a run of the CLI in its own process stops with exit 2 naming that pid and
    changes nothing; once the lock is released the same command runs."""
    out = tmp_path / "o"
    code, _, err = quantize(src, out)
    assert code == 0, err
    before = snapshot(out)
    lock = OutputLock.acquire(out)
    try:
        r = subprocess.run([sys.executable, "-m", "mxconv.cli", "quantize", str(src), str(out), "--overwrite",
                            "--device", "cpu", "--quiet"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        assert r.returncode == 2, r.stderr
        assert f"is being written by another mxconv run (pid {os.getpid()})" in r.stderr, r.stderr
        # in this process too (a second open of the lock file conflicts with the first)
        code, _, err = quantize(src, out, "--overwrite")
        assert code == 2 and f"(pid {os.getpid()})" in err, err
    finally:
        lock.release()
    assert snapshot(out) == before
    assert not [p for p in tmp_path.iterdir() if ".mxconv-" in p.name]
    code, _, err = quantize(src, out, "--overwrite")
    assert code == 0, err
    assert not os.path.lexists(out / LOCK_NAME)


def test_a_lock_left_by_a_killed_run_is_taken_over(src: Path, tmp_path: Path) -> None:
    """The kernel drops a flock when its holder dies: a SIGKILLed holder's lock file stays, with its
    pid, and the next run takes the lock over (and removes the file when done)."""
    out = tmp_path / "o"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from mxconv.output.lock import OutputLock; "
         "OutputLock.acquire(Path(sys.argv[1])); print('locked', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        code, _, err = quantize(src, out)
        assert code == 2 and f"(pid {holder.pid})" in err, err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert f"(pid {holder.pid})" in (out / LOCK_NAME).read_text()  # what the killed run left
    code, _, err = quantize(src, out)
    assert code == 0, err
    assert not os.path.lexists(out / LOCK_NAME)


def test_the_lock_is_exclusive_and_released(tmp_path: Path) -> None:
    from mxconv.errors import BadInput

    first = OutputLock.acquire(tmp_path)
    with pytest.raises(BadInput, match=rf"being written by another mxconv run \(pid {os.getpid()}\)"):
        OutputLock.acquire(tmp_path)
    first.release()
    first.release()  # twice is harmless
    assert not os.path.lexists(tmp_path / LOCK_NAME)
    (tmp_path / LOCK_NAME).symlink_to(victim(tmp_path))  # a link at the lock's name: replaced
    second = OutputLock.acquire(tmp_path)
    assert not (tmp_path / LOCK_NAME).is_symlink() and (tmp_path / "victim").read_text() == "victim: not mxconv's\n"
    second.release()


def test_without_flock_the_lock_file_alone_is_the_lock(tmp_path: Path, monkeypatch) -> None:
    """A filesystem that cannot flock (Lustre mounted without it) answers ENOSYS: the lock is then the
    file, made exclusively and holding the pid; a dead pid's file is taken over."""
    import errno

    import mxconv.output.lock as lock_mod
    from mxconv.errors import BadInput

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(lock_mod.fcntl, "flock", no_flock)
    first = OutputLock.acquire(tmp_path)
    assert f"(pid {os.getpid()})" in (tmp_path / LOCK_NAME).read_text()
    with pytest.raises(BadInput, match=rf"being written by another mxconv run \(pid {os.getpid()}\)"):
        OutputLock.acquire(tmp_path)
    first.release()
    assert not os.path.lexists(tmp_path / LOCK_NAME)
    pid = dead_pid()
    (tmp_path / LOCK_NAME).write_text(f"an mxconv run (pid {pid}) is writing this directory\n")
    second = OutputLock.acquire(tmp_path)
    assert f"(pid {os.getpid()})" in (tmp_path / LOCK_NAME).read_text()
    second.release()


# --- --overwrite deletes only what mxconv wrote --------------------------------------------------------


def test_overwrite_deletes_a_listed_file_only_while_it_is_the_file_mxconv_wrote(src: Path, tmp_path: Path) -> None:
    """Reproduction 9: a name edited into the old manifest's output_files (notes.txt) stays; a side
    file the old run wrote and the new one does not (chat_template.jinja) goes while unchanged, and
    stays once edited or when the manifest records no hash for it (older manifests)."""
    s = copy_checkpoint(src, tmp_path / "src-with-template")
    (s / "chat_template.jinja").write_text("{{ messages }}")
    out = tmp_path / "o"

    def old_output(edit_template: bool = False, drop_hashes: bool = False) -> None:
        shutil.rmtree(out, ignore_errors=True)
        code, _, err = quantize(s, out)
        assert code == 0, err
        m = json.loads((out / "mxconv.json").read_text())
        assert m["output_file_hashes"]["chat_template.jinja"] == {
            "size": 14, "sha256": hashlib.sha256(b"{{ messages }}").hexdigest()}
        m["output_files"].append("notes.txt")
        if drop_hashes:
            del m["output_file_hashes"]
        (out / "mxconv.json").write_text(json.dumps(m))
        (out / "notes.txt").write_text("mine")
        if edit_template:
            (out / "chat_template.jinja").write_text("my own template")

    old_output()
    code, _, err = mx("quantize", src, out, "--overwrite", "--device", "cpu")
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "mine" and not (out / "chat_template.jinja").exists()
    assert f"kept notes.txt in {out}" in err
    for kwargs in ({"edit_template": True}, {"drop_hashes": True}):
        old_output(**kwargs)
        template = (out / "chat_template.jinja").read_text()
        code, _, err = mx("quantize", src, out, "--overwrite", "--device", "cpu")
        assert code == 0, err
        assert (out / "chat_template.jinja").read_text() == template and (out / "notes.txt").read_text() == "mine"
        assert f"kept chat_template.jinja, notes.txt in {out}" in err
        code, _, err = mx("verify", out, "--quiet")
        assert code == 0, err


def test_overwrite_says_up_front_which_kept_files_verify_will_fail_on(src: Path, tmp_path: Path) -> None:
    """Reproduction 9, the second half: an adapter the overwrite keeps (mxconv did not write it) is a
    weight file the new index does not name; the run says so before it starts (with --dry-run too),
    and verify then fails on exactly that file. notes.txt is no weight file: not named."""
    out = tmp_path / "o"
    code, _, err = quantize(src, out)
    assert code == 0, err
    (out / "adapter_model.safetensors").write_bytes(b"lora")
    (out / "notes.txt").write_text("mine")
    warning = f"warning: {out} keeps adapter_model.safetensors (mxconv did not write it): verify of the new output will fail"
    code, _, err = mx("quantize", src, out, "--overwrite", "--device", "cpu", "--quiet", "--dry-run")
    assert code == 0 and warning in " ".join(err.split()), err
    code, _, err = quantize(src, out, "--overwrite")
    assert code == 0 and warning in " ".join(err.split()) and "notes.txt" not in err, err
    assert (out / "adapter_model.safetensors").read_bytes() == b"lora"
    code, _, err = mx("verify", out, "--quiet")
    assert code == 1 and "adapter_model.safetensors: a weight file the output's index does not name" in err, err


def test_overwrite_of_a_complete_output_deletes_only_what_its_manifest_lists(src: Path, tmp_path: Path) -> None:
    """A rank-0/ directory (with an index and the user's notes) and a shard-named file that the old
    manifest (tp_size 1) does not list were deleted by name. They stay now, and the run warns before
    it starts about the weight file verify will fail on."""
    out = tmp_path / "o"
    code, _, err = quantize(src, out)
    assert code == 0, err
    (out / "rank-0").mkdir()
    (out / "rank-0" / "notes.txt").write_text("mine")
    (out / "rank-0" / "model.safetensors.index.json").write_text("{}")
    (out / "model-00007-of-00009.safetensors").write_text("mine")
    (out / "model.safetensors").write_text("mine")
    code, _, err = quantize(src, out, "--overwrite")
    assert code == 0, err
    assert (out / "rank-0" / "notes.txt").read_text() == "mine"
    assert (out / "rank-0" / "model.safetensors.index.json").read_text() == "{}"
    assert (out / "model-00007-of-00009.safetensors").read_text() == "mine"
    assert (out / "model.safetensors").read_text() == "mine"
    flat = " ".join(err.split())
    assert f"warning: {out} keeps model-00007-of-00009.safetensors, model.safetensors (mxconv did not write them)" in flat, err


@pytest.mark.parametrize("tp", [1, 2])
def test_overwrite_never_deletes_a_file_mxconv_did_not_write_inside_a_rank_directory(
        made: MadeCheckpoints, src: Path, tmp_path: Path, tp: int) -> None:
    """A TP output's rank-0/ is mxconv's (its manifest lists it), but notes.txt inside it is not:
    the whole directory was removed (rmtree). Now its files go one by one; notes.txt stays, in the
    directory left behind (new output of one rank) or in the new output's rank-0/ (two ranks)."""
    q4 = made.quantize(src)
    out = tmp_path / "o"
    code, _, err = mx("repack", q4, out, "--backend", "trtllm", "--tp", "2", "--quiet", "--device", "cpu")
    assert code == 0, err
    (out / "rank-0" / "notes.txt").write_text("mine")
    extra = ("--tp", "2") if tp == 2 else ()
    code, _, err = mx("repack", q4, out, "--backend", "trtllm", *extra, "--overwrite", "--device", "cpu")
    assert code == 0, err
    assert (out / "rank-0" / "notes.txt").read_text() == "mine"
    assert "kept rank-0/notes.txt" in " ".join(err.split()), err
    if tp == 1:
        assert sorted(p.name for p in (out / "rank-0").iterdir()) == ["notes.txt"] and not (out / "rank-1").exists()
    code, _, err = mx("verify", out, "--quiet")
    assert code == 0, err


def test_cleaning_up_an_interrupted_run_keeps_the_users_files_in_a_rank_directory(tmp_path: Path) -> None:
    """An interrupted run is cleaned up by name, but a rank directory was removed whole: notes.txt in it too."""
    from mxconv.output.directory import prepare_output_dir

    source, out = tmp_path / "src", tmp_path / "out"
    source.mkdir()
    (out / "rank-0").mkdir(parents=True)
    (out / IN_PROGRESS).write_text(f"an mxconv run (pid {dead_pid()}) is writing this directory\n")
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json", "notes.txt"):
        (out / "rank-0" / name).write_text("x")
    (out / "rank-1").mkdir()
    (out / "rank-1" / "model-00001-of-00002.safetensors").write_text("x")
    notes = prepare_output_dir(out, [source], overwrite=False)
    assert sorted(p.name for p in out.iterdir()) == [IN_PROGRESS, "rank-0"]
    assert [p.name for p in (out / "rank-0").iterdir()] == ["notes.txt"]
    assert any("kept rank-0/notes.txt" in n for n in notes), notes


def test_an_old_manifest_that_is_not_strict_json_names_nothing_to_delete(src: Path, tmp_path: Path) -> None:
    """The old output's manifest was read with Python's lenient parser, unlike every other manifest
    read: a key written twice (the last wins) could record the user's notes.txt, which --overwrite
    then deleted. mxconv writes strict JSON; read as every reader reads it, such a manifest names
    nothing, so only temporary files go (the old shards stay, with the warning)."""
    out = tmp_path / "o"
    code, _, err = quantize(src, out)
    assert code == 0, err
    (out / "notes.txt").write_text("mine")
    record = {"notes.txt": {"size": 4, "sha256": hashlib.sha256(b"mine").hexdigest()}}
    text = (out / "mxconv.json").read_text().rstrip()
    assert text.endswith("}") and '"output_file_hashes"' in text
    (out / "mxconv.json").write_text(text[:-1] + ', "output_file_hashes": ' + json.dumps(record) + "}")
    code, _, err = quantize(src, out, "--overwrite")
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "mine"


def test_one_rule_and_one_set_of_words_for_a_file_that_is_not_regular(tmp_path: Path) -> None:
    """config.json, the index, manifests, shards, side files, the marker and the old output's files are
    opened by one primitive: a FIFO is refused without being opened (an open would wait), a link is
    refused where it must not be followed, and the words for the kind are the same everywhere."""
    from mxconv.errors import BadInput
    from mxconv.source.json_files import read_json
    from mxconv.source.regular_files import NotRegular, open_regular
    from mxconv.source.side_files import open_side_file

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotRegular, match="a FIFO"):
        open_regular(fifo)
    for read in (lambda p: read_json(p, "config.json"), open_side_file):
        with pytest.raises(BadInput, match=r"is a FIFO[,;]"):
            read(fifo)
        with pytest.raises(BadInput, match=r"is a character device[,;]"):
            read(Path("/dev/null"))
    real = tmp_path / "real"
    real.write_text("x")
    (tmp_path / "link").symlink_to(real)
    f, size = open_regular(tmp_path / "link")
    f.close()
    assert size == 1
    with pytest.raises(NotRegular, match="a symbolic link"):
        open_regular(tmp_path / "link", follow=False)
