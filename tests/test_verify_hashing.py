"""verify's sha256 checks beside the layer checks (mxconv.verify.hashing): every path a tensor's bytes
can take to the hasher — hashed by the layer reads as they pass, read by the pool, left to the end —
catches a changed byte and names the tensor, and the first bytes of a tensor decide."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from support.cli import mx
from support.tamper import patch_tensor
from support.workspace import copy_checkpoint

from mxconv.source.checkpoint import open_checkpoint
from mxconv.verify.hashing import Expected, TensorHashes, sha256_of

EXPERTS0 = "model.layers.0.mlp.experts.w13_weight"
ATTN1 = "model.layers.1.self_attn.q_proj.weight"
EXPERTS1 = "model.layers.1.mlp.experts.w2_weight"


def _flip(t: torch.Tensor) -> torch.Tensor:
    """``t`` with one bit of its fourth byte flipped."""
    raw = t.contiguous().view(torch.uint8).clone()
    raw.view(-1)[3] ^= 0x01
    return raw.view(t.dtype)


@pytest.fixture(scope="module")
def kernel_out(made) -> Path:
    return made.repack(made.quantize(made.source("qwen3-moe").path), "marlin")


def _verify(path: Path, *args: str) -> tuple[int, dict]:
    code, out, err = mx("verify", path, "--device", "cpu", "--json", *args)
    assert code in (0, 1), err
    return code, json.loads(out)


@pytest.mark.parametrize(("name", "layers"), [(EXPERTS0, None), (ATTN1, None), (EXPERTS1, "0")],
                         ids=["fed-by-layout-check", "read-by-pool", "layer-not-checked"])
def test_a_changed_byte_fails_integrity_of_its_layer(kernel_out: Path, tmp_path: Path, name: str, layers: str | None) -> None:
    k = copy_checkpoint(kernel_out, tmp_path / "k")
    patch_tensor(k, name, _flip, fix_manifest=False)
    code, rep = _verify(k, *(("--layers", layers) if layers else ()))
    assert code == 1
    layer = next(r for r in rep["layers"] if r["layer"] == int(name.split(".")[2]))
    assert layer["integrity"] == "FAIL"
    assert f"{name}: sha256 mismatch (corrupted or modified bytes)" in layer["problems"]


def test_an_untouched_output_passes_with_every_path(kernel_out: Path) -> None:
    code, rep = _verify(kernel_out, "--layers", "1")
    assert code == 0 and rep["passed"] and [r["layer"] for r in rep["layers"]] == [1]


def test_a_truncated_tensor_is_named_as_unreadable(kernel_out: Path, tmp_path: Path) -> None:
    k = copy_checkpoint(kernel_out, tmp_path / "k")
    ckpt = open_checkpoint(k)
    info = ckpt.tensors[EXPERTS1]
    want = sha256_of(ckpt, EXPERTS1)
    with open(info.file, "r+b") as f:  # cut the file inside the tensor, after its header was read
        f.truncate(info.begin + info.nbytes // 2)
    with TensorHashes([Expected(EXPERTS1, ckpt, EXPERTS1, want)], threads=2) as hashes:
        problems = hashes.problems()
    (line,) = problems[1]
    assert line.startswith(f"{EXPERTS1}: cannot be read") and "truncated" in line


def test_the_first_bytes_of_a_tensor_decide(kernel_out: Path) -> None:
    """A digest recorded after the pool started reading the tensor leaves the pool's hash (the bytes on disk)."""
    ckpt = open_checkpoint(kernel_out)
    want = sha256_of(ckpt, ATTN1)
    with TensorHashes([Expected(ATTN1, ckpt, ATTN1, want)], threads=1) as hashes:
        hashes.start_rest(set())
        hashes.record(ckpt, ATTN1, "0" * 64)
        assert hashes.problems() == {}


def test_a_read_error_during_verify_names_file_and_tensor(kernel_out: Path, made, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO in the middle of the layer reads (output and reference read side by side): exit 2, naming
    the file and the tensor, and no reading thread left behind."""
    import errno
    import os

    import mxconv.engines.staged_read as staged

    real, calls = os.preadv, []

    def failing(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 5:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(staged.os, "preadv", failing)
    before = threading.active_count()
    code, _, err = mx("verify", kernel_out, "--device", "cpu", "--reference", made.quantize(made.source("qwen3-moe").path))
    assert code == 2 and "[Errno 5]" in err and ".safetensors: tensor '" in err, err
    assert threading.active_count() <= before
