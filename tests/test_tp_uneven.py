"""Uneven TP splits: the last rank is narrower, yet every rank's kernel tensors share one shape and
verify recovers each rank's true width (the padding between is checked to be zero)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mxconv.source.checkpoint import open_checkpoint
from mxconv.cli import app
from support.checkpoints import ModelSizes, make_checkpoint

runner = CliRunner()


def mx(*args: object) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    return r.exit_code, r.stderr


@pytest.mark.parametrize("backend, options", [("triton", ()), ("trtllm", ("--layout-option", "intermediate_align=128")), ("marlin", ())])
def test_uneven_tp_ranks_share_one_shape_and_verify(tmp_path: Path, backend: str, options: tuple[str, ...]) -> None:
    # I = 160 at --tp 2 splits in blocks of 32 into 96 + 64 channels: triton pads them to 128 / 64 and
    # trtllm (align 128) to 128 / 128 unless the narrower rank is laid out at the wider one's width
    src = make_checkpoint(tmp_path / "src", "qwen3-moe", ModelSizes(hidden_size=256, intermediate_size=160)).path
    out = tmp_path / "k"
    code, err = mx("repack", src, out, "--backend", backend, "--tp", "2", "--quiet", "--device", "cpu", *options)
    assert code == 0, err
    m = json.loads((out / "mxconv.json").read_text())
    assert m["layout"]["tp_ranges"] == [[0, 96], [96, 160]]
    ranks = [open_checkpoint(out / f"rank-{r}") for r in range(2)]
    w13 = "model.layers.0.mlp.experts.w13_weight"
    assert ranks[0].tensors[w13].shape == ranks[1].tensors[w13].shape
    code, err = mx("verify", out, "--reference", src, "--tokens", "16")
    assert code == 0, err
