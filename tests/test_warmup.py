"""The kernels' warm-up: launches recorded, then compiled side by side; the pipeline's hook after its
first computed item (where the CLI stops reading ahead). On the GPU: after the warm-up of a plan,
converting it compiles no kernel the warm-up did not (the warm-up meets every specialisation).

GPU tests are marked ``gpu`` and skip without CUDA."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from mxconv.kernels.triton_common import _launch, collect_launches, run_collected
from mxconv.pipeline import WorkItem, run_pipeline
from mxconv.writer import ShardedWriter, plan_shards
from support.checkpoints import make_checkpoint
from test_writer import _pt


class FakeKernel:
    """Stands in for a JIT function: ``k[grid](*args)`` records (name, grid, args, thread id, start, end)."""

    def __init__(self, name: str, log: list, delay: float = 0.0, fail: bool = False) -> None:
        self.name, self.log, self.delay, self.fail = name, log, delay, fail

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            start = time.perf_counter()
            time.sleep(self.delay)
            if self.fail:
                raise RuntimeError(f"{self.name} failed to compile")
            self.log.append((self.name, grid, args, threading.get_ident(), start, time.perf_counter()))
        return launch


def test_collect_launches_records_instead_of_launching() -> None:
    log: list = []
    k = FakeKernel("a", log)
    cpu = torch.zeros(1)
    with collect_launches() as launches:
        _launch(k, (2, 1, 1), cpu, 7, BLOCK=4)
    assert log == []
    assert launches == [(k, (2, 1, 1), cpu, (7,), {"BLOCK": 4})]
    _launch(k, (3,), cpu, 8)  # outside the context: launched at once
    assert [(n, g, a) for n, g, a, *_ in log] == [("a", (3,), (8,))]


def test_run_collected_runs_every_launch_first_alone_then_kernels_side_by_side(monkeypatch) -> None:
    import mxconv.kernels.triton_common as tc

    monkeypatch.setattr(tc, "_threaded_compiles", lambda: True)  # whatever triton is installed
    log: list = []
    a, b, c = (FakeKernel(n, log, delay=0.4) for n in "abc")
    cpu = torch.zeros(1)
    launches = [(a, (1,), cpu, (0,), {}), (b, (1,), cpu, (1,), {}), (c, (1,), cpu, (2,), {}), (b, (1,), cpu, (3,), {})]
    t0 = time.perf_counter()
    run_collected(launches)
    took = time.perf_counter() - t0
    assert sorted(args for _, _, args, *_ in log) == [(0,), (1,), (2,), (3,)]
    first = log[0]
    assert first[2] == (0,) and all(start >= first[5] for *_, start, _end in log[1:])  # the first one alone
    # b's two launches on one thread, in order; c beside them: 0.4 + 0.8 s, not 1.6 s
    b_runs = [e for e in log if e[0] == "b"]
    assert [e[2] for e in b_runs] == [(1,), (3,)] and b_runs[0][3] == b_runs[1][3]
    c_run = next(e for e in log if e[0] == "c")
    assert c_run[3] != b_runs[0][3] and c_run[4] < b_runs[1][4]  # c ran beside b
    assert took < 1.45, took
    for threaded, max_threads in ((True, 1), (False, 8)):  # one after another: asked for, or an older triton
        monkeypatch.setattr(tc, "_threaded_compiles", lambda threaded=threaded: threaded)
        log.clear()
        run_collected([(FakeKernel(n, log), (1,), cpu, (i,), {}) for i, n in enumerate("abcd")], max_threads=max_threads)
        assert [e[2] for e in log] == [(0,), (1,), (2,), (3,)] and len({e[3] for e in log}) == 1


def test_collect_launches_records_only_this_threads_launches() -> None:
    log: list = []
    k = FakeKernel("a", log)
    cpu = torch.zeros(1)
    with collect_launches() as launches:
        other = threading.Thread(target=_launch, args=(k, (1,), cpu, 5))
        other.start()
        other.join()
    assert launches == [] and [e[2] for e in log] == [(5,)]


def test_run_collected_raises_a_failure_and_accepts_nothing() -> None:
    log: list = []
    cpu = torch.zeros(1)
    run_collected([])
    with pytest.raises(RuntimeError, match="b failed"):
        run_collected([(FakeKernel("a", log), (1,), cpu, (), {}), (FakeKernel("b", log, fail=True), (1,), cpu, (), {})])


def test_pipeline_calls_on_first_compute_once_after_the_first_item(tmp_path: Path) -> None:
    plan = [_pt(f"t{i}", (8,)) for i in range(5)]
    w = ShardedWriter(tmp_path, plan_shards(plan, 1 << 20))
    items = [WorkItem("layer", 8, payload=i, out_names=[[f"t{i}"]]) for i in range(5)]
    events: list = []

    def compute(item: WorkItem, d: int):
        events.append(("compute", d))
        return [{f"t{d}": torch.full((8,), d, dtype=torch.uint8)}]

    run_pipeline(items, [w], load=lambda it: it.payload, compute=compute,
                 on_first_compute=lambda: events.append("started"))
    w.finish()
    assert events == [("compute", 0), "started"] + [("compute", d) for d in range(1, 5)]


# --------------------------------------------------------------------------------------------- GPU


def _compiled() -> dict[str, int]:
    """Compiled variants per mxconv Triton kernel (every device): JITFunction.device_caches holds
    one kernel cache per device as its first field (triton 3.x)."""
    import mxconv.kernels.layout_triton as lt
    import mxconv.kernels.marlin_triton as mt
    import mxconv.kernels.mx_triton as qt
    import mxconv.kernels.triton_swizzle as st

    counts = {}
    for mod in (lt, mt, qt, st):
        for name, obj in vars(mod).items():
            caches = getattr(obj, "device_caches", None)
            if caches is not None:
                counts[f"{mod.__name__}.{name}"] = sum(len(c[0]) for c in caches.values())
    return counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind,command,backend", [
    ("gpt-oss-mxfp4", "repack", "trtllm"), ("gpt-oss-mxfp4", "repack", "marlin"), ("gpt-oss-mxfp4", "repack", "aiter"),
    ("gpt-oss-mxfp4", "repack", "triton"), ("gpt-oss-bf16", "quantize", None), ("qwen3-moe", "quantize", None),
    ("deepseek-v3-fp8", "quantize", None),  # block-FP8 experts reach the quantizer as fp32
    ("gpt-oss-bf16", "repack", "trtllm"),  # quantized on the way, then laid out
])
def test_gpu_warmup_compiles_every_kernel_the_run_needs(tmp_path: Path, monkeypatch, kind: str, command: str,
                                                         backend: str | None) -> None:
    from mxconv.checkpoint import open_checkpoint
    from mxconv.convert import QuantOptions, RepackOptions, _start_warmup, build_plan, execute
    from mxconv.families import detect_family
    from mxconv.layouts import get_layout

    src = make_checkpoint(tmp_path / "src", kind).path
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), command, QuantOptions(), RepackOptions(backend, get_layout(backend).activations[0]) if backend else None)
    dev = torch.device("cuda")
    _start_warmup(plan, dev).join()
    before = _compiled()
    assert sum(before.values()) > 0
    monkeypatch.setenv("MXCONV_WARMUP_CPU", "0")  # every layer through the GPU's kernels
    summary = execute(plan, tmp_path / "out", device=dev, max_shard_size=10**9, overwrite=True, argv=["test"])
    assert summary["items_computed_on_cpu"] == 0
    after = _compiled()
    assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}


def _fits_over_budgets(tmp_path: Path, kind: str) -> list[bool]:
    """_cpu_fits for each host budget (large to small) under which a GPU plan exists."""
    from mxconv.checkpoint import open_checkpoint
    from mxconv.convert import QuantOptions, RepackOptions, _cpu_fits, build_plan, plan_memory
    from mxconv.errors import BadInput
    from mxconv.families import detect_family
    from mxconv.memory import MemoryBudget

    src = make_checkpoint(tmp_path / kind, kind, num_layers=2, num_experts=8, hidden_size=512, intermediate_size=512).path
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), "repack", QuantOptions(), RepackOptions("trtllm", "bf16"))
    seen = []
    for host_mb in range(4000, 1000, -5):
        try:
            plan_memory(plan, MemoryBudget(host_mb << 20, 1 << 40), "cuda")
        except BadInput:  # below the GPU plan's minimum: nothing to compare
            continue
        seen.append(_cpu_fits(plan))
    return seen


def test_cpu_compute_while_warming_only_where_the_host_budget_allows(tmp_path: Path, monkeypatch) -> None:
    """A GPU-planned run keeps a layer's temporaries on the GPU; computing it on the CPU instead
    (while the GPU warms up) is allowed only where a CPU plan under the same host budget keeps the
    same groups and depths: under a roomy budget, not under the tightest ones."""
    import mxconv.memory as memory

    monkeypatch.setattr(memory, "process_rss", lambda: 400 << 20)  # the same baseline whatever ran before
    for kind in ("gpt-oss-mxfp4", "gpt-oss-bf16"):
        fits = _fits_over_budgets(tmp_path, kind)
        assert fits[0] is True, kind  # 4 GB for a few MB of experts
    # quantizing first puts the layer's fp32 temporaries on the host: refused under tight budgets
    assert False in _fits_over_budgets(tmp_path / "again", "gpt-oss-bf16")
