"""The staged reader (mxconv.engines.staged_read) against safetensors' own reader, on CPU.

Shards written by hand with tensors at odd byte offsets (a 1-byte tensor first, an odd-length header),
several shards at once, staging buffers smaller than one tensor (reads cut into pieces), the sha256
check, and truncated shards (refused naming the file and the tensor). The GPU path (pinned buffers,
copies on a side stream) is the same plan of fills; tests/test_loader_gpu.py compares its bytes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mxconv.engines import staged_read
from mxconv.engines.staged_read import (
    StagedReader,
    StagingOptions,
    byte_view,
    plan_fills,
    read_tensors,
)
from mxconv.errors import BadInput
from mxconv.source.st_format import TORCH_TO_ST, read_header


def write_unaligned(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file whose tensors sit back to back (no alignment) after a header of odd length."""
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    if len(raw) % 2 == 0:  # an odd header length: every data offset is shifted by one
        raw += b" "
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            f.write(byte_view(t.contiguous()).numpy().tobytes())


def _shards(tmp_path: Path) -> dict[str, Path]:
    g = torch.Generator().manual_seed(3)
    a = {
        "tiny": torch.tensor([7], dtype=torch.uint8),
        "bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "scales": torch.randint(0, 256, (5, 3, 9), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "i32": torch.randint(-1000, 1000, (7, 13), generator=g, dtype=torch.int32),
    }
    b = {
        "odd": torch.randint(0, 256, (3,), generator=g, dtype=torch.uint8),
        "big": torch.randn(4, 257, generator=g),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }
    write_unaligned(tmp_path / "a.safetensors", a)
    write_unaligned(tmp_path / "b.safetensors", b)
    return {"a": tmp_path / "a.safetensors", "b": tmp_path / "b.safetensors"}


def _infos(files: dict[str, Path]) -> dict[str, object]:
    out = {}
    for tag, f in files.items():
        for name, info in read_header(f)[0].items():
            out[f"{tag}.{name}"] = info
    return out


def _reference(files: dict[str, Path]) -> dict[str, torch.Tensor]:
    out = {}
    for tag, f in files.items():
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                out[f"{tag}.{name}"] = h.get_tensor(name)
    return out


@pytest.mark.parametrize("staging", [StagingOptions(), StagingOptions(buffer_bytes=100, buffers=2, read_threads=3, piece_bytes=7),
                                     StagingOptions(buffer_bytes=1, buffers=1, read_threads=1)])
def test_bytes_equal_safe_open(tmp_path: Path, staging: StagingOptions) -> None:
    files = _shards(tmp_path)
    infos = _infos(files)
    assert any(i.begin % 2 for i in infos.values())  # odd offsets really occur
    got = read_tensors(infos, "cpu", staging)
    want = _reference(files)
    assert set(got) == set(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        assert torch.equal(byte_view(got[key]), byte_view(t.contiguous())), key


def test_plan_fills_cuts_and_packs() -> None:
    from mxconv.source.st_format import TensorInfo

    f = Path("x")
    infos = [("a", TensorInfo("a", f, "U8", (10,), 100, 110)), ("b", TensorInfo("b", f, "U8", (3,), 110, 113)),
             ("c", TensorInfo("c", f, "U8", (0,), 113, 113))]
    fills = plan_fills(infos, 4)
    assert [[(s.key, s.start, s.nbytes, s.buffer_offset) for s in fill] for fill in fills] == [
        [("a", 0, 4, 0)], [("a", 4, 4, 0)], [("a", 8, 2, 0), ("b", 0, 2, 2)], [("b", 2, 1, 0)]]
    assert sum(s.nbytes for fill in fills for s in fill) == 13
    assert all(sum(s.nbytes for s in fill) <= 4 for fill in fills)


def test_hash_check(tmp_path: Path) -> None:
    files = _shards(tmp_path)
    infos = _infos(files)
    want = _reference(files)
    hashes = {k: hashlib.sha256(byte_view(t.contiguous()).numpy().tobytes()).hexdigest() for k, t in want.items()}
    with StagedReader("cpu", StagingOptions(buffer_bytes=64, piece_bytes=16)) as reader:
        reader.read(infos, hashes)  # all match
        assert reader.bytes_read == sum(i.nbytes for i in infos.values())
        hashes["a.bf16"] = "0" * 64
        with pytest.raises(BadInput, match=r"a\.safetensors: tensor 'bf16': sha256 mismatch"):
            reader.read(infos, hashes)


def test_truncated_shard_names_file_and_tensor(tmp_path: Path) -> None:
    files = _shards(tmp_path)
    infos = _infos(files)  # headers read while the file was whole
    size = files["a"].stat().st_size
    os.truncate(files["a"], size - 5)  # cut into the last tensor of a.safetensors
    with pytest.raises(BadInput, match=r"a\.safetensors: tensor 'i32' is truncated"):
        read_tensors(infos, "cpu")
    with pytest.raises(BadInput, match=r"a\.safetensors: tensor 'i32'"):  # a fresh header read refuses it too
        read_header(files["a"])


def test_staging_options_refuse_zero() -> None:
    with pytest.raises(BadInput, match="buffer_bytes must be >= 1"):
        StagingOptions(buffer_bytes=0)
    assert StagingOptions(buffer_bytes=64 << 20, buffers=3).host_bytes == 192 << 20


def test_hash_check_refuses_a_tensor_without_a_hash(tmp_path: Path) -> None:
    files = _shards(tmp_path)
    infos = _infos(files)
    want = _reference(files)
    hashes = {k: hashlib.sha256(byte_view(t.contiguous()).numpy().tobytes()).hexdigest() for k, t in want.items() if k != "b.odd"}
    with pytest.raises(BadInput, match=r"b\.safetensors: tensor 'odd': no sha256 to check"):
        read_tensors(infos, "cpu", hashes=hashes)


def test_file_shrinking_after_the_size_check_is_a_short_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _shards(tmp_path)
    infos = _infos(files)
    checked = staged_read._check_sizes

    def check_then_shrink(fds, ordered) -> None:  # the sizes pass, then the file loses its last 5 bytes
        checked(fds, ordered)
        os.truncate(files["a"], files["a"].stat().st_size - 5)

    monkeypatch.setattr(staged_read, "_check_sizes", check_then_shrink)
    with pytest.raises(BadInput, match=r"a\.safetensors: tensor 'i32' is truncated \(the file ends at byte"):
        read_tensors(infos, "cpu", StagingOptions(buffer_bytes=64, piece_bytes=16))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open fds through /proc")
def test_os_error_in_the_middle_of_a_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _shards(tmp_path)
    infos = _infos(files)
    bad = infos["a.i32"]  # in a late fill of the read below
    inode = files["a"].stat().st_ino
    real, calls = os.preadv, []

    def failing(fd: int, buffers, offset: int) -> int:
        calls.append(offset)
        if offset == bad.begin and os.fstat(fd).st_ino == inode:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    with StagedReader("cpu", StagingOptions(buffer_bytes=64, piece_bytes=16, read_threads=2)) as reader:
        fds = _open_fds()
        monkeypatch.setattr(os, "preadv", failing)
        with pytest.raises(BadInput, match=rf"a\.safetensors: tensor 'i32': \[Errno {errno.EIO}\]"):
            reader.read(infos)
        assert calls and min(calls) < bad.begin  # earlier fills were read before the error
        monkeypatch.setattr(os, "preadv", real)
        assert _open_fds() == fds  # every file closed
        got = reader.read(infos)  # the reader works on
    for key, t in _reference(files).items():
        assert torch.equal(byte_view(got[key]), byte_view(t.contiguous())), key


def test_a_failed_piece_waits_for_the_pieces_still_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One piece of a fill fails while the others are inside preadv: read() must not raise (and
    close the files) before they are done, else they read a closed or reused fd."""
    path = tmp_path / "one.safetensors"
    write_unaligned(path, {"x": torch.arange(64, dtype=torch.uint8)})
    infos = {"x": read_header(path)[0]["x"]}
    first = infos["x"].begin
    pieces = 4  # 64 bytes in pieces of 16, one thread each
    started = threading.Barrier(pieces, timeout=30)
    release = threading.Event()
    lock = threading.Lock()
    in_flight, late = [0], []
    real = os.preadv

    def slow(fd: int, buffers, offset: int) -> int:
        with lock:
            in_flight[0] += 1
        try:
            started.wait()  # every piece is inside preadv
            if offset == first:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            release.wait(timeout=1.0)  # the others finish on their own a moment later
            try:
                return real(fd, buffers, offset)
            except OSError as exc:
                late.append(exc)
                raise
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(os, "preadv", slow)
    with StagedReader("cpu", StagingOptions(piece_bytes=16, read_threads=pieces)) as reader:
        with pytest.raises(BadInput, match=r"one\.safetensors: tensor 'x': "):
            reader.read(infos)
        still_reading = in_flight[0]
        release.set()
    assert still_reading == 0 and late == []


@pytest.mark.parametrize(("cores", "allowed", "threads"), [(64, 64, 16), (64, 4, 4), (16, 16, 16), (2, 2, 2), (None, 0, 1)])
def test_default_read_threads_are_one_a_usable_cpu_up_to_16(monkeypatch: pytest.MonkeyPatch, cores: int | None,
                                                            allowed: int, threads: int) -> None:  # fmt: skip
    """Taken when the options are made (not at import), from the CPUs the process may use (a
    container's affinity mask), the host's count where the mask is unknown (allowed 0)."""
    monkeypatch.setattr(staged_read.os, "cpu_count", lambda: cores)
    if allowed:
        monkeypatch.setattr(staged_read.os, "sched_getaffinity", lambda pid: set(range(allowed)))
    else:
        monkeypatch.delattr(staged_read.os, "sched_getaffinity")
    opts = StagingOptions()
    assert opts.read_threads == threads and opts.piece_bytes == 8 << 20
    with StagedReader("cpu") as reader:
        assert reader.staging.read_threads == threads
