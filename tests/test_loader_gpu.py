"""The loader's GPU paths (``-m gpu``): pinned staging + side-stream copies give the bytes the CPU
path reads; load_model wraps every layer for the engine with GPU memory = the resident tensors; the
docs/loader.md example (an RL weight sync: update_layer on a live EngineLayer) changes the forward
as the new weights say. Kernels from ``MXCONV_TRITON_KERNELS`` / ``MXCONV_MARLIN_OPS``; absent -> skipped.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from support.checkpoints import ModelSizes, make_checkpoint
from support.gpu_outputs import need_kernels
from test_staged_read import _infos, _shards
from typer.testing import CliRunner

from mxconv.cli import app
from mxconv.engines.in_memory import update_layer
from mxconv.engines.loader import load_layer
from mxconv.engines.model_load import load_model
from mxconv.engines.staged_read import (
    StagedReader,
    StagingOptions,
    byte_view,
    read_tensors,
)
from mxconv.errors import BadInput
from mxconv.source.checkpoint import open_checkpoint
from mxconv.source.st_format import read_tensor

pytestmark = pytest.mark.gpu
H, I, E = 256, 192, 8
PREFIX = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loader-gpu")
    make_checkpoint(root / "src", "gpt-oss-bf16", ModelSizes(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2))
    cli = CliRunner()
    out = {"src": root / "src"}
    for backend in ("triton", "marlin"):
        r = cli.invoke(app, ["repack", str(root / "src"), str(root / backend), "--backend", backend, "--quiet", "--device", "cpu"])
        assert r.exit_code == 0, r.stdout + r.stderr
        out[backend] = root / backend
    return out


@pytest.mark.parametrize("staging", [StagingOptions(), StagingOptions(buffer_bytes=100, buffers=2, read_threads=3, piece_bytes=7),
                                     StagingOptions(buffer_bytes=333, buffers=3)])
def test_staged_gpu_bytes_equal_cpu(tmp_path: Path, staging: StagingOptions) -> None:
    infos = _infos(_shards(tmp_path))
    cpu = read_tensors(infos, "cpu")
    gpu = read_tensors(infos, "cuda", staging)
    for key, t in cpu.items():
        assert gpu[key].device.type == "cuda" and gpu[key].dtype == t.dtype and gpu[key].shape == t.shape
        assert torch.equal(byte_view(gpu[key]).cpu(), byte_view(t)), key


def test_failed_staged_read_leaves_no_copy_queued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails in a late fill returns only once the copies it queued on its side stream
    are done (they read the pinned buffers and write the tensors): the GPU work they waited on too."""
    files = _shards(tmp_path)
    infos = _infos(files)
    big, inode, real = infos["b.big"], files["b"].stat().st_ino, os.preadv

    def failing(fd: int, buffers, offset: int) -> int:
        if os.fstat(fd).st_ino == inode and offset >= big.end - 16:  # the last piece: the last fill
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    staging = StagingOptions(buffer_bytes=1024, buffers=8, piece_bytes=16)  # ~6 fills, no buffer reused
    with StagedReader("cuda", staging) as reader:
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s on the current stream: the side stream's copies queue behind it
        monkeypatch.setattr(os, "preadv", failing)
        with pytest.raises(BadInput, match=rf"b\.safetensors: tensor 'big': \[Errno {errno.EIO}\]"):
            reader.read(infos)
        assert torch.cuda.current_stream().query()  # the read waited for its copies (and so for the sleep)


@pytest.mark.parametrize("backend", ["triton", "marlin"])
def test_load_model_wraps_every_layer_and_holds_only_the_resident_bytes(outputs: dict[str, Path], backend: str) -> None:
    need_kernels(backend)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = load_model(outputs[backend], device="cuda", check_hashes=True)
    resident = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    assert model.wrapped and len(model.layers) >= 2
    held = sum(t.numel() * t.element_size() for layer in model.layers.values() for t in layer.tensors.values())
    assert held == model.bytes_read
    slack = 512 * sum(len(layer.tensors) for layer in model.layers.values())  # the allocator's rounding
    assert peak <= resident + slack and resident <= held + slack + (8 << 20)  # (the runners' small workspaces)
    x = torch.randn(16, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, E, (16, 1), device="cuda")
    ids = torch.cat([ids, (ids + 1) % E], dim=1)
    w = torch.full((16, 2), 0.5, device="cuda")
    one = load_layer(outputs[backend], 1)
    assert torch.equal(model.layers[1].forward(x, ids, w), one.forward(x, ids, w))


@pytest.mark.parametrize("backend", ["triton", "marlin"])
def test_docs_example_rl_weight_sync(outputs: dict[str, Path], backend: str) -> None:
    """docs/loader.md's example: new bf16 weights pushed into a live layer change its forward."""
    need_kernels(backend)
    ckpt = open_checkpoint(str(outputs["src"]))
    weights = {n[len(PREFIX) + 1:]: read_tensor(i).cuda() for n, i in ckpt.tensors.items() if n.startswith(PREFIX + ".")}
    weights["down_proj_bias"] = torch.zeros_like(weights["down_proj_bias"])  # y is then linear in w2

    layer = load_layer(outputs[backend], 1)  # the engine's live layer
    x = torch.randn(32, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(32, E, device="cuda")
    update_layer(layer, weights)  # step k: the trainer's weights
    y1 = layer.forward(x, logits=logits).float()
    weights["down_proj"] = weights["down_proj"] * 2  # step k+1: w2 doubled (MXFP4 scales +1, same codes)
    update_layer(layer, weights)
    y2 = layer.forward(x, logits=logits).float()
    assert y1.abs().max() > 0
    torch.testing.assert_close(y2, 2 * y1, rtol=2e-2, atol=2e-2 * float(y1.abs().max()))
