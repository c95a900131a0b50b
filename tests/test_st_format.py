"""safetensors header validation and checkpoint opening: every bad input is a BadInput naming the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mxconv.source.checkpoint import open_checkpoint
from mxconv.errors import BadInput
from mxconv.source.regular_files import read_exactly
from mxconv.source.st_format import iter_tensor_chunks, read_header, read_tensor


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _ckpt(tmp_path: Path, tensors: dict[str, torch.Tensor], *, index: bool = True) -> Path:
    save_file(tensors, str(tmp_path / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    if index:
        wm = {n: "model-00001-of-00001.safetensors" for n in tensors}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return tmp_path


def test_reads_every_dtype_byte_exact(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "u8": torch.randint(0, 256, (7, 3), generator=g, dtype=torch.uint8),
        "e8m0": torch.randint(0, 255, (4,), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "e4m3": torch.randn(2, 32, generator=g).to(torch.float8_e4m3fn),
        "f32": torch.randn(6, generator=g),
    }
    save_file(tensors, str(tmp_path / "a.safetensors"))
    infos, _ = read_header(tmp_path / "a.safetensors")
    for name, t in tensors.items():
        got = read_tensor(infos[name])
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_truncated_file_names_tensor(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(10), "b": torch.ones(100)}, str(tmp_path / "x.safetensors"))
    p = tmp_path / "x.safetensors"
    p.write_bytes(p.read_bytes()[:-8])
    with pytest.raises(BadInput, match=r"x.safetensors: tensor 'b'.*truncated"):
        read_header(p)


def test_tensor_chunks_are_its_bytes_and_a_file_cut_short_names_the_tensor(tmp_path: Path) -> None:
    """iter_tensor_chunks (the copy and the sha256 of verify) reads a tensor's bytes in pieces through
    read_exactly; a file that became shorter after its header was read names the tensor."""
    save_file({"a": torch.zeros(10), "b": torch.arange(100, dtype=torch.float32)}, str(tmp_path / "x.safetensors"))
    p = tmp_path / "x.safetensors"
    info = read_header(p)[0]["b"]
    chunks = list(iter_tensor_chunks(info, 64))
    assert [len(c) for c in chunks] == [64] * 6 + [16]
    assert b"".join(chunks) == torch.arange(100, dtype=torch.float32).numpy().tobytes()
    p.write_bytes(p.read_bytes()[:-8])
    with pytest.raises(BadInput, match=r"x\.safetensors: tensor 'b' is truncated$"):
        list(iter_tensor_chunks(info, 64))
    with p.open("rb") as f, pytest.raises(BadInput, match="^ended early$"):
        list(read_exactly(f, p.stat().st_size + 1, 1 << 20, "ended early"))


@pytest.mark.parametrize(
    "header, data, pattern",
    [
        (None, b"", r"corrupt safetensors header \(invalid JSON"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, r"tensor 'a'.*truncated"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, r"tensor 'a'.*needs 16"),
        ({"a": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, r"tensor 'a': unknown dtype"),
        ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, r"malformed shape"),
        ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 0]}}, b"\0" * 4, r"malformed data_offsets"),
        (
            {"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}, "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}},
            b"\0" * 12,
            r"tensors 'a' and 'b' overlap",
        ),
    ],
)
def test_corrupt_headers(tmp_path: Path, header, data, pattern) -> None:
    p = tmp_path / "bad.safetensors"
    if header is None:
        raw = b"{not json"
        p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    else:
        _raw_file(p, header, data)
    with pytest.raises(BadInput, match=pattern) as ei:
        read_header(p)
    assert "bad.safetensors" in str(ei.value)


def test_header_length_past_end(tmp_path: Path) -> None:
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(BadInput, match=r"header length 10000 but the file has 10 bytes"):
        read_header(p)


def test_tiny_file(tmp_path: Path) -> None:
    p = tmp_path / "t.safetensors"
    p.write_bytes(b"\1\2")
    with pytest.raises(BadInput, match="truncated"):
        read_header(p)


def test_open_checkpoint_ok(tmp_path: Path) -> None:
    root = _ckpt(tmp_path, {"w": torch.arange(6, dtype=torch.float32)})
    (tmp_path / "tokenizer.json").write_text("{}")
    ck = open_checkpoint(root)
    assert list(ck.tensors) == ["w"] and ck.has_index
    assert torch.equal(ck.read("w"), torch.arange(6, dtype=torch.float32))
    assert [f.name for f in ck.extra_files] == ["tokenizer.json"]
    assert ck.source.fingerprint.startswith("sha256:")


def test_missing_config(tmp_path: Path) -> None:
    root = _ckpt(tmp_path, {"w": torch.zeros(2)})
    (root / "config.json").unlink()
    with pytest.raises(BadInput, match=r"config.json: config.json is missing"):
        open_checkpoint(root)


def test_malformed_config(tmp_path: Path) -> None:
    root = _ckpt(tmp_path, {"w": torch.zeros(2)})
    (root / "config.json").write_text("{oops")
    with pytest.raises(BadInput, match=r"malformed config.json"):
        open_checkpoint(root)


def test_malformed_index(tmp_path: Path) -> None:
    root = _ckpt(tmp_path, {"w": torch.zeros(2)})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    with pytest.raises(BadInput, match=r"malformed index"):
        open_checkpoint(root)


def test_index_names_missing_shard(tmp_path: Path) -> None:
    root = _ckpt(tmp_path, {"w": torch.zeros(2)})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(BadInput, match=r"names shard 'model-00002-of-00002.safetensors', which does not exist"):
        open_checkpoint(root)


def test_index_names_tensor_not_in_shard(tmp_path: Path) -> None:
    root = _ckpt(tmp_path, {"w": torch.zeros(2)})
    wm = {"w": "model-00001-of-00001.safetensors", "ghost": "model-00001-of-00001.safetensors"}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(BadInput, match=r"tensor 'ghost' is mapped to"):
        open_checkpoint(root)


def test_no_shards(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(BadInput, match=r"no model.safetensors.index.json and no \*.safetensors"):
        open_checkpoint(tmp_path)


def test_not_a_repo_id(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"no such directory, and not a Hugging Face repo id"):
        open_checkpoint(str(tmp_path / "does" / "not" / "exist"))
