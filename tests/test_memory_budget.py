"""Memory budget (issue 13 item 1): layers cut into groups of experts give the same bytes.

Covers: reading a range of experts (every family and format), the writer's parts (sha256 and bytes
equal to whole writes, across shard boundaries), the planning function (pipeline depth, group
sizes, GPU budget, errors naming the sizes), and whole conversions (quantize mxfp4/mxfp8 and
repack on every backend, TP 2 included) whose every output file and manifest tensor table equal
the unsplit run's. Peak RSS is measured by scripts/bench_memory.py, not here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mxconv.experts.tensors import TensorSpec
from mxconv.source.checkpoint import open_checkpoint
from mxconv.cli import app
from mxconv.run.conversion import Conversion, RunSettings
from mxconv.run.options import QuantOptions, RepackOptions
from mxconv.run.plan import build_plan
from mxconv.errors import BadInput
from mxconv.families import detect_family
from mxconv.layouts import get_layout
from mxconv.run.memory import Baseline, ExpertCost, ItemCosts, MemoryBudget, MemoryPlan, balance, plan_memory
from mxconv.run.plan_costs import work_items
from support.checkpoints import INT4_KINDS, KINDS, ModelSizes, make_checkpoint
from mxconv.output.shards import PlannedTensor, plan_shards
from mxconv.output.writer import ShardedWriter

from support.registry_cases import format_cases
from support.tamper import patch_tensor
from support.workspace import copy_checkpoint, link_workspace, MadeCheckpoints

runner = CliRunner()
CPU = torch.device("cpu")
E = 8


def mx(*args: object) -> tuple[int, str, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


# ---- reading a range of experts ----------------------------------------------------------------


def _stacks(layer) -> dict[str, torch.Tensor]:
    out = {}
    for key in ("w13", "w2", "w13_bias", "w2_bias"):
        if getattr(layer, key) is not None:
            out[key] = getattr(layer, key)
    for key in ("w13_mx", "w2_mx", "w13_int4", "w2_int4"):
        s = getattr(layer, key)
        if s is not None:
            out[key + ".data"], out[key + ".scales"] = s.data, s.scales
    for key in ("w13_fp8", "w2_fp8"):
        s = getattr(layer, key)
        for j, (d, sc) in enumerate(s.parts if s is not None else ()):
            out[f"{key}.{j}.data"], out[f"{key}.{j}.scale_inv"] = d, sc
    return out


@pytest.mark.parametrize("kind", KINDS + INT4_KINDS)
def test_read_layer_of_a_range_of_experts(kind: str, tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "src", kind, ModelSizes(num_experts=5))
    reader = detect_family(open_checkpoint(tmp_path / "src"))
    assert reader.reads_expert_ranges
    for ref in reader.layer_refs():
        whole = reader.read_layer(ref)
        want = _stacks(whole.select_experts(1, 4))
        part = reader.read_checked_layer(ref, experts=(1, 4))
        got = _stacks(part)
        assert part.first_expert == 1 and set(got) == set(want)
        for k in want:
            assert got[k].shape[0] == 3 and torch.equal(got[k].contiguous().view(torch.uint8), want[k].contiguous().view(torch.uint8)), k


def test_reader_without_ranges_cuts_groups_from_the_whole_layer(tmp_path: Path, monkeypatch) -> None:
    make_checkpoint(tmp_path / "src", "qwen3-moe", ModelSizes(num_experts=5))
    reader = detect_family(open_checkpoint(tmp_path / "src"))
    ref = reader.layer_refs()[0]
    want = _stacks(reader.read_layer(ref, (2, 5)))
    monkeypatch.setattr(type(reader), "reads_expert_ranges", False)
    got = reader.read_checked_layer(ref, experts=(2, 5))
    assert got.first_expert == 2 and all(torch.equal(got_t, want[k]) for k, got_t in _stacks(got).items())


# ---- the writer's parts ----------------------------------------------------------------------


def _pt(name: str, shape: tuple[int, ...], dtype=torch.uint8) -> PlannedTensor:
    return PlannedTensor(name, TensorSpec(shape, dtype), "expert")


def test_write_part_equals_whole_writes_across_shards(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "l.a": torch.randint(0, 255, (6, 5, 4), dtype=torch.uint8, generator=g),
        "l.e0": torch.randn(3, 4, generator=g).to(torch.bfloat16),  # one tensor per expert
        "l.e1": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "l.b": torch.randn(6, 7, generator=g),
        "l.empty": torch.empty(6, 0),
        "l.c": torch.randint(0, 255, (6, 33), dtype=torch.uint8, generator=g),
    }
    plan = [_pt(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    shards = plan_shards(plan, 150)  # the layer's stacks fall in several shards
    assert len(shards) > 2
    (tmp_path / "whole").mkdir()
    w = ShardedWriter(tmp_path / "whole", shards)
    for n, t in tensors.items():
        w.write_tensor(n, t)
    whole = w.finish()
    (tmp_path / "parts").mkdir()
    w = ShardedWriter(tmp_path / "parts", plan_shards(plan, 150))
    for e0, e1 in ((0, 1), (1, 4), (4, 6)):  # uneven groups, as the pipeline writes them
        for n, t in tensors.items():
            if n in ("l.e0", "l.e1"):
                if e0 == 0:
                    w.write_part(n, t)  # a whole per-expert tensor is a one-part write
            else:
                w.write_part(n, t[e0:e1])
    parts = w.finish()
    assert {n: v.sha256 for n, v in parts.items()} == {n: v.sha256 for n, v in whole.items()}
    for n, t in tensors.items():
        assert whole[n].sha256 == hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    for f in sorted((tmp_path / "whole").iterdir()):
        assert f.read_bytes() == (tmp_path / "parts" / f.name).read_bytes(), f.name


def test_write_part_refuses_what_the_plan_does_not_hold(tmp_path: Path) -> None:
    w = ShardedWriter(tmp_path, plan_shards([_pt("a", (4, 8)), _pt("b", (2,))], 1000))
    with pytest.raises(RuntimeError, match="parts are runs of dim-0 rows"):
        w.write_part("a", torch.zeros(2, 7, dtype=torch.uint8))
    w.write_part("a", torch.zeros(3, 8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="gets 40 bytes, plan says 32"):
        w.write_part("a", torch.zeros(2, 8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="begun in parts"):
        w.write_tensor("a", torch.zeros(4, 8, dtype=torch.uint8))
    w.write_tensor("b", torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"written in part only, e.g. a \(24 of 32 bytes\)"):
        w.finish()
    w.abort()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".mxconv-tmp")]


# ---- planning ----------------------------------------------------------------------------------

MB = 10**6
# one expert: 10 MB read, 2 MB output, 40 MB of quantize temporaries (at most 4 experts at once), 4 MB layout
COST = ExpertCost(read=10 * MB, out=2 * MB, work=40 * MB, work_cap=4, out_temp=4 * MB)


def _plan(host: int | None, gpu: int | None = None, dev: str = "cpu", item_read_cap: int | None = None, **items) -> MemoryPlan:
    return plan_memory(ItemCosts({0: COST, 1: COST}, 128, **items), MemoryBudget(host, gpu, dev), Baseline(500 * MB),
                       item_read_cap=item_read_cap)


def test_plan_whole_layers_when_they_fit() -> None:
    for host in (None, 10**12):
        m = _plan(host)
        assert (m.prefetch, m.queue_depth, m.groups, m.split) == (2, 2, {0: 128, 1: 128}, False)
    # whole layers with one result queued: 128 x (2 x 10 + 4 + 3 x 2) + 4 x 40 = 4000 MB, +10 %
    m = _plan(500 * MB + 4400 * MB)
    assert (m.prefetch, m.queue_depth, m.split) == (2, 1, False)
    assert m.peak_host <= m.host_budget


def test_plan_groups_of_experts_within_the_budget() -> None:
    # room 1500 MB; groups of g with one result queued: 20g + 40 x min(g, 4) + 4g + 3 x 2g, +10 % -> g <= 40,
    # and 40 needs 4 groups of 128: 4 equal groups of 32
    m = _plan(2 * 10**9)
    assert m.split and (m.prefetch, m.queue_depth, m.groups) == (2, 1, {0: 32, 1: 32})
    assert m.peak_host <= 2 * 10**9
    assert m.describe().startswith("groups of 32 of 128 experts (4 per layer); 2 read ahead, 1 queued for writing")
    assert m.to_json()["groups_per_layer"] == {"0": 4, "1": 4}
    # one expert with two read ahead takes 77 MB, with one 66 MB
    m = _plan(500 * MB + 70 * MB)
    assert (m.prefetch, m.queue_depth, m.groups[0]) == (1, 1, 1)
    assert m.min_host == 566 * MB


def test_balance_makes_equal_groups() -> None:
    assert balance(50, 128) == 43 and balance(64, 128) == 64 and balance(1, 5) == 1 and balance(127, 128) == 64


def test_plan_refuses_a_budget_below_one_expert_naming_the_sizes() -> None:
    with pytest.raises(BadInput) as exc:
        _plan(500 * MB + 50 * MB, names={0: "model.layers.0.mlp.experts", 1: "x"})
    msg = str(exc.value)
    assert "MemoryBudget.host 550.00 MB is too small for one expert of model.layers.0.mlp.experts" in msg
    assert "takes about 66.00 MB (read 10.00 MB, output 2.00 MB, compute 44.00 MB)" in msg
    assert "on top of the 500.00 MB the process holds already; give at least 566.00 MB" in msg
    with pytest.raises(BadInput, match="too small for one expert"):
        _plan(100 * MB)  # below what the process holds already


def test_plan_on_cuda_keeps_temporaries_on_the_gpu_budget() -> None:
    # GPU: input + temporaries + result of one item, 10g + 40 x min(g, 4) + 4g + 2g, +10 % <= 1000 MB -> g <= 46,
    # i.e. 3 groups: 43 experts each
    m = _plan(10**12, gpu=1000 * MB, dev="cuda")
    assert m.groups == {0: 43, 1: 43} and m.peak_gpu <= 1000 * MB and m.gpu_budget == 1000 * MB
    # the host holds reads and pinned results only: whole layers fit where the CPU would need groups
    uncapped = {0: ExpertCost(10 * MB, 2 * MB, 40 * MB, 128, 4 * MB)}  # temporaries of every expert at once
    for dev, split in (("cuda", False), ("cpu", True)):
        m = plan_memory(ItemCosts(uncapped, 128), MemoryBudget(6500 * MB, 10**12, dev), Baseline(500 * MB))
        assert m.split == split and m.peak_host <= 6500 * MB
    with pytest.raises(BadInput, match=r"MemoryBudget.gpu 50.00 MB is too small for one expert of layer 0: .* 61.60 MB on the GPU"):
        _plan(10**12, gpu=50 * MB, dev="cuda")


def test_plan_keeps_items_converted_whole_within_the_budget() -> None:
    """Other computed items (one layer's linears, --targets linear) are converted whole: they must fit
    the pipeline the layers get, and one that cannot fit at all is named."""
    linears = {"the linear item writing a.weight": ExpertCost(300 * MB, 150 * MB, 800 * MB, 1, 300 * MB)}
    # with two read ahead and one queued it takes (2 x 300 + 800 + 300 + 3 x 150) MB + 10 % = 2365 MB
    m = _plan(500 * MB + 3000 * MB, whole=linears)
    assert (m.prefetch, m.queue_depth) == (2, 1) and m.split
    assert 500 * MB + 2365 * MB <= m.peak_host <= 3500 * MB
    assert m.min_host == 500 * MB + 2035 * MB  # one read ahead: 1 x 300 + 800 + 300 + 3 x 150, +10 %
    with pytest.raises(BadInput, match=r"too small for the linear item writing a.weight \(converted whole\): it in flight"):
        _plan(2 * 10**9, whole=linears)


def test_plan_cuts_big_layers_for_overlap_where_the_reader_can() -> None:
    # 128 experts of 10 MB read = 1280 MB per layer; at most 256 MB per item -> 25 experts, balanced to 6 groups of 22
    m = _plan(None, item_read_cap=256 * MB)
    assert m.groups == {0: 22, 1: 22} and m.split and m.item_read_cap == 256 * MB
    assert m.describe().startswith("groups of 22 of 128 experts (6 per layer), each reading at most 256.00 MB")
    assert m.to_json()["item_read_cap"] == 256 * MB
    # a budget that already cuts smaller is not cut again (and says nothing about overlap)
    m = _plan(2 * 10**9, item_read_cap=1000 * MB)
    assert m.groups == {0: 32, 1: 32} and m.item_read_cap is None
    # a cap below one expert still leaves one expert per item; whole layers where nothing can be cut
    assert _plan(None, item_read_cap=1).groups == {0: 1, 1: 1}
    m = _plan(None, splittable=False, item_read_cap=256 * MB)
    assert not m.split and m.item_read_cap is None


def test_plan_of_a_reader_that_reads_whole_layers() -> None:
    assert not _plan(None, splittable=False).split
    with pytest.raises(BadInput, match="reads whole layers"):
        _plan(2 * 10**9, splittable=False)
    # an output whose layout writes whole layers (Layout.whole_layers) is refused with its own reason
    with pytest.raises(BadInput, match=r"too small for layer 0: its w2 scales cross experts, and one layer in flight"):
        _plan(2 * 10**9, splittable=False, whole_why="its w2 scales cross experts")
    # the host has room for a layer, the GPU has not: the GPU budget is the one named (it said host before)
    with pytest.raises(BadInput, match=r"MemoryBudget.gpu 1.00 MB is too small for layer 0: its w2 scales cross experts"):
        _plan(10**12, gpu=10**6, dev="cuda", splittable=False, whole_why="its w2 scales cross experts")


# ---- whole conversions: the same bytes with and without groups ------------------------------


def _digests(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != "mxconv.json"}


def _run(src: Path, out: Path, q: QuantOptions, r: RepackOptions | None, group: int | None, device: torch.device = CPU) -> dict:
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), q, r)
    memory_plan = None
    if group is not None:  # a fixed grouping, as a small --max-memory plans it
        layers = [i.payload.layer for i in plan.items if i.kind == "layer"]
        memory_plan = MemoryPlan(None, None, 0, 2, 1, plan.info.num_experts, {L: group for L in layers})
        assert sum(i.kind == "layer" for i in work_items(plan.items, memory_plan)) == len(layers) * -(-plan.info.num_experts // group)
    return Conversion(plan).run(out, device=device, settings=RunSettings(40_000, True, argv=("test",)), memory_plan=memory_plan)


def _same_output(src: Path, tmp_path: Path, q: QuantOptions, r: RepackOptions | None = None, groups=(3, 1)) -> None:
    base = _run(src, tmp_path / "whole", q, r, None)
    want = _digests(tmp_path / "whole")
    want_tensors = json.loads((tmp_path / "whole" / "mxconv.json").read_text())["tensors"]
    assert len(want) > 3
    for g in groups:
        out = tmp_path / f"g{g}"
        s = _run(src, out, q, r, g)
        assert _digests(out) == want, g
        assert json.loads((out / "mxconv.json").read_text())["tensors"] == want_tensors
        assert s["quantized_tensors"] == base["quantized_tensors"]
        if base["relative_rms_error"] is None:
            assert s["relative_rms_error"] is None
        else:
            assert s["relative_rms_error"] == pytest.approx(base["relative_rms_error"], rel=1e-6)


@pytest.fixture(scope="module")
def ws(made: MadeCheckpoints, tmp_path_factory) -> Path:
    kinds = ("qwen3-moe", "gpt-oss-bf16", "gpt-oss-mxfp4", "deepseek-v3-fp8", "kimi-k2-int4")
    return link_workspace(tmp_path_factory.mktemp("budget"), {kind: made.source(kind, ModelSizes(num_experts=E), shards=3).path for kind in kinds})


@pytest.mark.parametrize("kind", ["qwen3-moe", "gpt-oss-bf16", "gpt-oss-mxfp4", "deepseek-v3-fp8", "kimi-k2-int4"])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_quantize_bytes_do_not_depend_on_the_budget(ws: Path, tmp_path: Path, kind: str, fmt: str) -> None:
    _same_output(ws / kind, tmp_path, QuantOptions(fmt))


# every backend with each weight format it takes (its first activation for that format), plus TP and the
# other activations of a few; the source of each format is SOURCE_OF's
# aiter's MXFP8 w2_weight_scale is one e8m0_shuffle over the layer's E*H rows padded to 256: a layout that
# declares whole_layers is never cut into expert groups (its own test below), so it is left out here.
REPACKS = [(b, f, get_layout(b).default_activation(f), 1) for b, f in format_cases() if get_layout(b).whole_layers(f) is None] + [
    ("trtllm", "mxfp4", "mxfp8", 2), ("marlin", "mxfp4", "bf16", 2), ("aiter", "mxfp4", "mxfp4", 1),
    ("triton", "mxfp4", "bf16", 2), ("deepgemm", "mxfp4", "fp8", 2), ("humming", "mxfp8", "bf16", 2),
]
# an MXFP4 release (biases), a Qwen3-MoE quantized to MXFP8 at sizes every MXFP8 form takes, the Kimi INT4 release
SOURCE_OF = {"mxfp4": "gpt-oss-mxfp4", "mxfp8": "qwen3-moe-mxfp8", "int4": "kimi-k2-int4"}


@pytest.fixture(scope="module")
def q8(ws: Path, made: MadeCheckpoints) -> Path:
    """ws's MXFP8 source: Qwen3-MoE (no biases: MXFP8 forms take none) at H = I = 128 (I % 64, H % 64: every form)."""
    out = ws / SOURCE_OF["mxfp8"]
    if not out.exists():
        src = made.source("qwen3-moe", ModelSizes(num_experts=E, hidden_size=128, intermediate_size=128), shards=3).path
        _run(src, out, QuantOptions("mxfp8"), None, None)
    return out


def test_default_plan_cuts_items_and_keeps_the_bytes(ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The overlap cap goes through plan_for (as every run plans): with a cap of one expert's read
    every layer item becomes one expert, and the output is the uncut run's, byte for byte."""
    import mxconv.run.plan_costs as plan_costs

    src = ws / "gpt-oss-bf16"
    _run(src, tmp_path / "whole", QuantOptions(), None, None)
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), QuantOptions(), None)
    monkeypatch.setattr(plan_costs, "ITEM_READ_BYTES", 1)
    mem = plan_costs.plan_for(plan, MemoryBudget())
    assert mem.groups and set(mem.groups.values()) == {1} and mem.item_read_cap == 1
    Conversion(plan).run(tmp_path / "cut", device=CPU, settings=RunSettings(40_000, True, argv=("test",)), memory_plan=mem)
    assert _digests(tmp_path / "cut") == _digests(tmp_path / "whole")


@pytest.mark.parametrize("backend, fmt, act, tp", REPACKS)
def test_repack_bytes_do_not_depend_on_the_budget(ws: Path, q8: Path, tmp_path: Path, backend: str, fmt: str, act: str,
                                                  tp: int) -> None:  # fmt: skip
    _same_output(ws / SOURCE_OF[fmt], tmp_path, QuantOptions(), RepackOptions(backend, act, tp), groups=(3,))


def test_a_whole_layers_layout_is_never_cut_into_expert_groups(q8: Path, tmp_path: Path) -> None:
    """aiter MXFP8 declares whole_layers (its w2 scale shuffle crosses experts): a memory plan that cuts
    layers is refused naming why (it was a RuntimeError in the writer, exit 3), the planner never cuts one
    (a budget without room for a layer is refused with the same reason), and a whole layer writes as before."""
    why = get_layout("aiter").whole_layers("mxfp8")
    assert why and "w2_weight_scale" in why and get_layout("aiter").whole_layers("mxfp4") is None
    r = RepackOptions("aiter", "bf16", 1)
    with pytest.raises(BadInput, match=r"cuts MoE layers into groups of experts .*aiter MXFP8's w2_weight_scale .*MemoryBudget.host"):
        _run(q8, tmp_path / "g3", QuantOptions(), r, 3)
    assert not (tmp_path / "g3").exists()
    plan = build_plan(open_checkpoint(q8), detect_family(open_checkpoint(q8)), QuantOptions(), r)
    assert not Conversion(plan).plan_memory(CPU, MemoryBudget(host=None)).split
    with pytest.raises(BadInput, match=r"MemoryBudget.host .* is too small for .*: aiter MXFP8's w2_weight_scale"):
        Conversion(plan).plan_memory(CPU, MemoryBudget(host=Conversion(plan).plan_memory(CPU, MemoryBudget(host=None)).peak_host // 2))
    _run(q8, tmp_path / "whole", QuantOptions(), r, None)
    assert (tmp_path / "whole" / "mxconv.json").exists()


@pytest.mark.parametrize("src, backend, tp", [("qwen3-moe", "marlin", 2), ("deepseek-v3-fp8", "trtllm", 1), ("kimi-k2-int4", "trtllm", 1)])
def test_repack_of_quantized_on_the_way_sources(ws: Path, tmp_path: Path, src: str, backend: str, tp: int) -> None:
    _same_output(ws / src, tmp_path, QuantOptions(), RepackOptions(backend, get_layout(backend).activations[0], tp), groups=(3,))


def test_nonfinite_in_a_later_group_names_the_source_expert(ws: Path, tmp_path: Path) -> None:
    src = copy_checkpoint(ws / "qwen3-moe", tmp_path / "src")
    name = "model.layers.1.mlp.experts.6.up_proj.weight"

    def plant(t: torch.Tensor) -> torch.Tensor:
        t[2, 5] = float("nan")
        return t

    patch_tensor(src, name, plant, False)
    with pytest.raises(BadInput, match=rf"non-finite value nan in {name} \[2, 5\]"):
        _run(src, tmp_path / "o", QuantOptions(), None, 3)
    gpt = copy_checkpoint(ws / "gpt-oss-mxfp4", tmp_path / "gpt")
    scales = "model.layers.0.mlp.experts.down_proj_scales"

    def nan_scale(t: torch.Tensor) -> torch.Tensor:
        t.view(torch.uint8)[7, 1, 0] = 0xFF
        return t

    patch_tensor(gpt, scales, nan_scale, False)
    with pytest.raises(BadInput, match=rf"E8M0 NaN scale byte 0xFF in {scales} \[7, 1, 0\]"):
        _run(gpt, tmp_path / "o2", QuantOptions(), RepackOptions("trtllm", "bf16"), 3)


@pytest.mark.gpu
@pytest.mark.parametrize("kind, q, r", [
    ("qwen3-moe", QuantOptions("mxfp4"), None),
    ("gpt-oss-bf16", QuantOptions("mxfp8"), None),
    ("deepseek-v3-fp8", QuantOptions(), RepackOptions("trtllm", "bf16")),
    ("gpt-oss-mxfp4", QuantOptions(), RepackOptions("triton", "bf16", 2)),
    ("gpt-oss-bf16", QuantOptions(), RepackOptions("marlin", "bf16")),
], ids=["qwen-q4", "gpt-q8", "ds-trtllm", "gpt-triton-tp2", "gpt-bf16-marlin"])
def test_cuda_groups_give_the_cpu_bytes(ws: Path, tmp_path: Path, kind: str, q: QuantOptions, r: RepackOptions | None,
                                       monkeypatch) -> None:
    """Groups of experts computed on the GPU (what --max-gpu-memory plans) write the CPU's bytes."""
    _run(ws / kind, tmp_path / "cpu", q, r, None)
    s = _run(ws / kind, tmp_path / "cuda", q, r, 3, torch.device("cuda"))
    assert s["device"].startswith("cuda")
    assert _digests(tmp_path / "cuda") == _digests(tmp_path / "cpu")


# ---- the CLI: --max-memory, --dry-run ------------------------------------------------------------


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """Experts of ~12 MB each: whole layers need ~0.9 GB more than one expert, so a budget 150 MB
    above the smallest splits layers whatever the test process's RSS does between two plans."""
    return make_checkpoint(tmp_path_factory.mktemp("big") / "qwen", "qwen3-moe", ModelSizes(num_experts=8, hidden_size=2048, intermediate_size=1024)).path


def mx_process(*args: object) -> tuple[int, str, str]:
    """``mxconv ARGS...`` in a fresh process: a budget's plan depends on the process's RSS, and the
    test process's own RSS moves with every run it made before."""
    r = subprocess.run([sys.executable, "-m", "mxconv.cli", *map(str, args)], capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def _split_budget(big: Path, out: Path, *args: str) -> int:
    """A --max-memory a third of the way from the smallest that works to what whole layers need
    (the dry run's estimates): runs split, with hundreds of MB to spare either way."""
    code, out_text, err = mx_process("quantize", big, out, *args, "--dry-run", "--json")
    assert code == 0, err
    mem = json.loads(out_text)["memory"]
    assert mem["max_memory_default"] and mem["experts_per_group"] == {"0": 8, "1": 8} and mem["prefetch"] == 2
    smallest, whole = mem["smallest_max_memory"], mem["estimated_peak_host_bytes"]
    assert whole - smallest > 500 * 10**6, mem
    return smallest + (whole - smallest) // 3


def test_cli_max_memory_groups_experts_and_keeps_the_bytes(big: Path, tmp_path: Path) -> None:
    budget = _split_budget(big, tmp_path / "d", "--device", "cpu")
    code, out, err = mx_process("quantize", big, tmp_path / "d", "--dry-run", "--json", "--device", "cpu",
                                "--max-memory", budget)
    assert code == 0, err
    mem = json.loads(out)["memory"]
    assert mem["max_memory"] == budget and not mem["max_memory_default"]
    assert 1 <= mem["experts_per_group"]["0"] < 8 and mem["estimated_peak_host_bytes"] <= budget
    code, out, err = mx_process("quantize", big, tmp_path / "d", "--dry-run", "--device", "cpu", "--max-memory", budget)
    assert code == 0 and "groups of" in out and "experts" in out, out
    for name, extra in (("whole", []), ("split", ["--max-memory", budget])):
        code, out, err = mx_process("quantize", big, tmp_path / name, "--device", "cpu", "--json", "--quiet", *extra)
        assert code == 0, err
        assert ("groups of" in json.loads(out)["memory"]) == (name == "split")
    assert _digests(tmp_path / "whole") == _digests(tmp_path / "split")


def test_cli_budget_too_small_is_a_usage_error(big: Path, tmp_path: Path) -> None:
    for cmd in (["quantize"], ["repack", "--backend", "trtllm"]):
        code, _, err = mx(cmd[0], big, tmp_path / "o", *cmd[1:], "--max-memory", "200MB", "--device", "cpu")
        assert code == 2 and "--max-memory 200.00 MB is too small for one expert of model.layers.0.mlp.experts" in err, err
        assert "give at least" in err and "Traceback" not in err and not (tmp_path / "o").exists()
    code, _, err = mx("quantize", big, tmp_path / "o", "--max-memory", "lots", "--device", "cpu")
    assert code == 2 and "--max-memory: cannot parse 'lots'" in err, err


def test_cli_max_memory_with_linear_targets(big: Path, tmp_path: Path) -> None:
    """--targets linear: the linears of each layer are converted whole within the same budget."""
    args = ["--format", "mxfp8", "--targets", "linear", "--device", "cpu"]
    budget = _split_budget(big, tmp_path / "d", *args)
    for name, extra in (("whole", []), ("split", ["--max-memory", budget])):
        code, out, err = mx_process("quantize", big, tmp_path / name, *args, "--json", "--quiet", *extra)
        assert code == 0, err
        assert ("groups of" in json.loads(out)["memory"]) == (name == "split")
    assert _digests(tmp_path / "whole") == _digests(tmp_path / "split")


def test_process_peak_rss_is_this_process_high_water_mark() -> None:
    """VmHWM: at least the RSS now, and it keeps a peak that is gone (what the summary reports as
    peak_host_rss_bytes; a parent's wait4 ru_maxrss would also count the parent's own peak). Measured
    in a fresh process: the test process's other threads and allocator state would blur it."""
    code = ("from mxconv.run.machine import process_peak_rss, process_rss\n"
            "MB = 1_000_000\n"
            "before = process_peak_rss()\n"
            "assert before is not None and before > 0 and process_rss() > 0\n"
            "block = bytearray(300 * MB)\n"
            "block[::4096] = b'\\x01' * len(block[::4096])\n"
            "with_block = process_rss()\n"
            "assert with_block >= 250 * MB, with_block\n"
            "del block\n"
            "after = process_rss()\n"
            "assert with_block - after >= 250 * MB, (with_block, after)\n"
            "assert process_peak_rss() >= with_block - 16 * MB, (process_peak_rss(), with_block)\n")  # VmHWM: page batches
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr


def test_cli_budget_counts_what_the_process_holds(tmp_path: Path) -> None:
    """A 1 MB model converts under --max-memory 400MB, its measured peak within it; a budget below
    what the process holds is refused naming the RSS it holds (not a projection) apart from the reserve."""
    src = make_checkpoint(tmp_path / "tiny", "qwen3-moe").path
    code, out, err = mx_process("quantize", src, tmp_path / "o", "--device", "cpu", "--json", "--quiet",
                                "--max-memory", "400MB")
    assert code == 0, err
    summary = json.loads(out)
    peak = summary["peak_host_rss_bytes"]
    assert peak <= 400 * 10**6 and summary["memory"].endswith("of 400.00 MB"), summary
    code, _, err = mx_process("quantize", src, tmp_path / "r", "--device", "cpu", "--max-memory", "50MB")
    m = re.search(r"on top of the ([\d.]+) MB the process holds now and ([\d.]+) MB set aside for threads, byte-copy "
                  r"chunks and freed blocks the allocator keeps; give at least ([\d.]+) MB", err)
    assert code == 2 and m, err
    held, aside, least = (float(g) * 10**6 for g in m.groups())
    assert 0.7 * peak <= held <= peak  # the RSS when it planned: below the whole run's peak, most of it
    assert aside < 64 * 10**6 and held + aside < least < 400 * 10**6
    assert not (tmp_path / "r").exists()
