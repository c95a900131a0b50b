"""The conversion object and its typed options (issue 19 items 1, 4, 5): options resolved once where
they are made, a plan that cannot change after it is built, the memory plan beside it, and the
run's timeline written where ``--trace`` says."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mxconv.cli.flags import in_cli_words
from mxconv.errors import BadInput
from support.checkpoints import make_checkpoint
from support.cli import mx
from mxconv.run.conversion import Conversion, RunSettings
from mxconv.run.options import QuantOptions, RepackOptions, ScaleRounding, Targets, WeightFormat


def test_quant_options_resolve_auto_and_strings_once() -> None:
    assert QuantOptions().scale_rounding is ScaleRounding.EVEN
    q = QuantOptions("mxfp8", "auto", targets="linear", include="layers\\.0\\.")
    assert (q.fmt, q.scale_rounding, q.targets, q.include) == (WeightFormat.MXFP8, ScaleRounding.RCEIL, Targets.LINEAR, ("layers\\.0\\.",))
    assert QuantOptions("mxfp4", "floor").scale_rounding is ScaleRounding.FLOOR
    with pytest.raises(BadInput, match="QuantOptions.fmt 'int4' is not supported"):
        QuantOptions("int4")
    with pytest.raises(BadInput, match="QuantOptions.scale_rounding 'up' is not supported") as caught:
        QuantOptions("mxfp4", "up")
    assert in_cli_words(str(caught.value)).startswith("--scale-rounding 'up' is not supported")
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.fmt = WeightFormat.MXFP4  # type: ignore[misc]


def test_plan_is_frozen_and_memory_is_planned_beside_it(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    conversion = Conversion.open(src, QuantOptions(), RepackOptions("trtllm", "bf16", 2))
    plan = conversion.plan
    assert plan.command == "repack" and plan.weight_format == "mxfp4" and len(plan.dests) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.sizes = None  # type: ignore[misc]
    memory_plan = conversion.plan_memory("cpu")
    assert memory_plan.prefetch >= 1 and "memory" in plan.summary(memory_plan) and "memory" not in plan.summary()
    summary = conversion.run(tmp_path / "out", device=torch.device("cpu"), memory_plan=memory_plan)
    assert summary["memory"] == memory_plan.describe() and summary["tensors_out"] == plan.summary()["tensors_out"]


def test_trace_option_writes_the_timeline(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    trace = tmp_path / "trace.json"
    code, _, err = mx("quantize", src, tmp_path / "q", "--device", "cpu", "--quiet", "--trace", trace)
    assert code == 0, err
    doc = json.loads(trace.read_text())
    stages = {e[0] for e in doc["events"]}
    assert {"setup", "load", "compute", "write", "finish"} <= stages and doc["items"]
    Conversion.open(src, QuantOptions()).run(tmp_path / "api", device=torch.device("cpu"),
                                             settings=RunSettings(trace=tmp_path / "api.json"))
    assert json.loads((tmp_path / "api.json").read_text())["stage_seconds"]["write_s"] >= 0


def test_a_trace_that_cannot_be_written_leaves_the_complete_output_and_exit_0(tmp_path: Path) -> None:
    """The trace is written after the commit: failing to write it is a note, never 'nothing was kept'."""
    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    code, _, err = mx("quantize", src, tmp_path / "q", "--device", "cpu", "--trace", tmp_path / "no-such-dir" / "t.json")
    assert code == 0, err
    assert (tmp_path / "q" / "mxconv.json").is_file()
    assert "--trace file" in err and "could not be written" in err and "the output is complete" in err, err
