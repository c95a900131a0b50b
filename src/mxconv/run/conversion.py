"""One conversion, one path: the :class:`Conversion` behind ``quantize``, ``repack``, ``demo`` and the
Python API, phase by phase:

1. open the source and plan the run from headers only (:meth:`Conversion.open`, :mod:`mxconv.run.plan`);
2. plan its memory for a device (:meth:`Conversion.plan_memory`, :mod:`mxconv.run.plan_costs`);
3. prepare OUTPUT (free space, staging directory, rank directories) through an
   :class:`~mxconv.output.directory.OutputTarget`;
4. run the overlapped read -> compute -> write pipeline (:mod:`mxconv.run.pipeline`);
5. finalize: config, index and manifest (:mod:`mxconv.run.finalize`), then commit.

A failed or interrupted run removes what it wrote, and an ``--overwrite`` replaces the old output only
once the new one is complete (docs/reliability.md). Nothing here prints: progress is a callback.

torch is imported lazily, in the phases that compute, so planning (and ``mxconv inspect``) stays torch-free.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from mxconv.families import detect_family
from mxconv.interrupt import Interrupted, deferred_signals
from mxconv.output.directory import (DISK_FULL, OutputTarget, OutputWriteError, check_output_dir, kept_weight_files,
                                     kept_weights_warning, writing)
from mxconv.output.files import FileRecord, atomic_write_json, copy_side_file
from mxconv.output.manifest import tensor_table, write_manifest
from mxconv.output.shards import ShardPlan, shards_size
from mxconv.output.writer import ShardedWriter
from mxconv.run.compute import RunStats, make_compute
from mxconv.run.finalize import build_manifest, output_config, run_notes, served_backends_note
from mxconv.run.machine import process_peak_rss
from mxconv.run.memory import MemoryBudget, MemoryPlan
from mxconv.run.linear_compute import linear_compute, linear_load
from mxconv.run.options import QuantOptions, RepackOptions, WeightFormat
from mxconv.run.pipeline import PipelineDepth, WorkItem, run_pipeline
from mxconv.run.plan import Plan, build_plan
from mxconv.run.plan_costs import memory_plan_for, whole_layers_why, work_items
from mxconv.run.trace import StageTimes, write_trace
from mxconv.source.checkpoint import Checkpoint, open_checkpoint
from mxconv.source.file_names import CONFIG_NAME, INDEX_NAME, rank_dir_name, rank_dirs
from mxconv.source.copy_check import refuse_nonfinite_copy

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # --max-shard-size 5GB


@dataclass(frozen=True)
class RunSettings:
    """How a conversion writes: the largest shard (bytes), whether it may replace an earlier
    output, the memory budget (None fields: the machine's defaults), where to write its timeline
    (``--trace FILE``; None: nowhere) and the command line recorded in the manifest."""

    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    overwrite: bool = False
    budget: MemoryBudget = field(default_factory=MemoryBudget)
    trace: Path | None = None
    argv: tuple[str, ...] | None = None


def output_bytes(plan: Plan, shard_plans: list[list[ShardPlan]]) -> int:
    """About what the output takes on disk: the shards with their headers, the copied files per
    rank, and a margin for config, index and manifest (under 1 kB per tensor)."""
    extra = sum(f.stat().st_size for f in plan.ckpt.extra_files)
    tensors = sum(len(d) for d in plan.dests)
    return sum(shards_size(s) for s in shard_plans) + len(shard_plans) * extra + 1024 * tensors + (1 << 20)


@dataclass
class _Output:
    """Where a run writes: OUTPUT's target, the staging (or final) directory, one directory and
    one writer per rank (filled as they are made, so that a failure aborts each)."""

    target: OutputTarget
    write_dir: Path | None = None
    rank_dirs: list[Path] = field(default_factory=list)
    writers: list[ShardedWriter] = field(default_factory=list)


class Conversion:
    """One quantize (``repack`` None) or repack run of a planned source; see the module docstring
    for its phases. ``plan`` is fixed once made; each :meth:`run` writes one OUTPUT."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    @classmethod
    def open(cls, source: str | Path | Checkpoint, quant: QuantOptions, repack: RepackOptions | None = None, *,
             revision: str | None = None) -> Conversion:
        """Phases 1-2: open ``source`` (a directory, a Hub repo id, or an opened checkpoint), detect
        its family and plan the run from headers only; BadInput for what cannot be converted."""
        ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(str(source), revision)
        return cls(build_plan(ckpt, detect_family(ckpt), quant, repack))

    def check_output(self, out_dir: Path, overwrite: bool) -> list[str]:
        """Refuse an OUTPUT this run could not write (a SOURCE, a file, another live run, not empty
        without ``overwrite``) before anything is computed; touches nothing. Returns the warnings to
        show before the run: files in OUTPUT that it keeps and that verify will fail on."""
        check_output_dir(out_dir, [self.plan.ckpt.root], overwrite)
        out = out_dir.expanduser().resolve()
        kept = kept_weight_files(out)
        return [kept_weights_warning(out, kept)] if kept else []

    def plan_memory(self, device: torch.device | str, budget: MemoryBudget | None = None) -> MemoryPlan:
        """The run's memory plan on ``device`` under ``budget`` (pipeline depth, experts per group);
        BadInput when one expert does not fit."""
        return memory_plan_for(self.plan, budget, device)

    def run(self, out_dir: Path, *, device: torch.device, settings: RunSettings = RunSettings(),
            memory_plan: MemoryPlan | None = None, on_progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Phases 3-5 into ``out_dir`` on ``device``; returns the summary (with timing and error
        statistics). ``memory_plan``: :meth:`plan_memory`'s for this device (default: planned now
        under ``settings.budget``). ``on_progress`` gets the source bytes of each item written.

        On any failure or interruption everything this run wrote is removed (an ``--overwrite``'s
        old output stays whole) before the exception leaves; an :class:`Interrupted` carries what
        OUTPUT holds now in ``note``, an :class:`OutputWriteError` says it in its message."""
        t0 = time.perf_counter()
        memory_plan = memory_plan or self.plan_memory(device, settings.budget)
        output = _Output(OutputTarget(out_dir, [self.plan.ckpt.root], settings.overwrite))
        items = work_items(self.plan.items, memory_plan, whole_layers_why(self.plan))
        times = StageTimes(events=[] if settings.trace else None, origin=t0)
        try:
            _prepare(self.plan, output, settings.max_shard_size)
            t_pipe = time.perf_counter()
            stats = _run_pipeline(self.plan, items, output, memory_plan, device, on_progress, times)
            t_finish = time.perf_counter()
            _finalize(self.plan, output, settings.argv, stats)
        except BaseException as exc:
            _clean_up_and_raise(exc, output)
        wall = time.perf_counter() - t0
        if settings.trace:
            times.mark("setup", -1, t0, t_pipe)
            times.mark("finish", -1, t_finish, t0 + wall)  # the last shards' fsync, config, manifest
            try:  # the output is committed: a trace that cannot be written is a note, not a failure
                write_trace(settings.trace, items, times)
            except OSError as exc:
                output.target.notes.append(f"note: the RunSettings.trace file {settings.trace} could not be written "
                                           f"({exc.strerror or exc}); the output is complete")
        return self.summary(output, memory_plan, stats, times, device, wall)

    def summary(self, output: _Output, memory_plan: MemoryPlan, stats: RunStats, times: StageTimes,
                device: torch.device, wall: float) -> dict[str, Any]:
        """The plan's summary with what the run measured, and the notes shown after it."""
        import torch

        plan = self.plan
        summary = plan.summary(memory_plan)
        summary.update(
            {
                "output": str(output.target.out),
                "seconds": wall,
                "gb_per_s": (plan.bytes_in + plan.bytes_out) / wall / 1e9 if wall > 0 else None,
                "compute_seconds": stats.compute_seconds,
                "quantized_tensors": stats.errors.tensors,
                "relative_rms_error": stats.errors.rel_rms,
                "device": str(device),
                "stage_seconds": times.to_json(),
                "peak_host_rss_bytes": process_peak_rss(),  # this process's own high-water mark (VmHWM)
                "notes": output.target.notes,
            }
        )
        if plan.weight_format == WeightFormat.FP8_BLOCK:
            summary["fp8_tiles"] = stats.fp8_tiles.to_json()
        if device.type == "cuda":
            summary["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
        return summary


def _prepare(plan: Plan, output: _Output, max_shard_size: int) -> None:
    """Phase 3: OUTPUT ready (free space checked, staging directory, rank directories, writers)."""
    target = output.target
    shard_plans = plan.shard_plans(max_shard_size)
    write_dir = output.write_dir = target.prepare(output_bytes(plan, shard_plans))
    output.rank_dirs = rank_dirs(write_dir, len(plan.dests))
    for d in output.rank_dirs:
        with writing(target.out, write_dir):
            if d != write_dir and d.is_symlink():  # a link named like a rank directory: replaced, never written through
                d.unlink()
            d.mkdir(parents=True, exist_ok=True)
    for d, shards in zip(output.rank_dirs, shard_plans):
        output.writers.append(ShardedWriter(d, shards, display_dir=target.out / d.relative_to(write_dir)))


def _run_pipeline(plan: Plan, items: list[WorkItem], output: _Output, memory_plan: MemoryPlan, device: torch.device,
                  on_progress: Callable[[int], None] | None, times: StageTimes) -> RunStats:
    """Phase 4: every work item (``items``: the plan's, cut into the memory plan's groups) read,
    computed on ``device`` and written."""
    import torch

    stats = RunStats()
    compute = linear_compute(plan, make_compute(plan, device, stats), device, stats)  # + "linear" items
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    reader, allow_nonfinite = plan.reader, plan.quant.allow_nonfinite
    # reader threads refuse NaN/Inf biases and routers and 0xFF scales (weights: where quantized)
    load = linear_load(plan, lambda item: reader.read_checked_layer(item.payload, allow_nonfinite, item.experts))
    depth = PipelineDepth(read_threads=min(2, memory_plan.prefetch), prefetch=memory_plan.prefetch,
                          queue_depth=memory_plan.queue_depth)
    run_pipeline(items, output.writers, load=load, compute=compute, depth=depth, on_progress=on_progress,
                 check_copy=None if allow_nonfinite else refuse_nonfinite_copy, times=times)
    return stats


def _finalize(plan: Plan, output: _Output, argv: tuple[str, ...] | None, stats: RunStats) -> None:
    """Phase 5: per rank its index (the writer's finish), config and copied files; the manifest;
    then the commit (a staged --overwrite replaces the old output now)."""
    target, write_dir, rank_dirs = output.target, output.write_dir, output.rank_dirs
    assert write_dir is not None
    cfg = output_config(plan)
    tensors: dict[str, Any] = {}
    files: dict[str, FileRecord] = {}  # every file but shards and manifest: what a later --overwrite may delete
    for r, (d, w) in enumerate(zip(rank_dirs, output.writers)):
        written = w.finish()
        prefix = "" if len(output.writers) == 1 else f"{rank_dir_name(r)}/"
        assert w.index_record is not None
        files[prefix + INDEX_NAME] = w.index_record
        with writing(target.out, write_dir):
            files[prefix + CONFIG_NAME] = atomic_write_json(d / CONFIG_NAME, cfg)
            for f in plan.ckpt.extra_files:  # regular source files within a size bound; never written through a link
                files[prefix + f.name] = copy_side_file(f, d / f.name)
        for name, entry in tensor_table(written, prefix).items():
            tensors[prefix + name if prefix else name] = entry
    with writing(target.out, write_dir):
        if len(rank_dirs) > 1:
            files[CONFIG_NAME] = atomic_write_json(write_dir / CONFIG_NAME, cfg)
    fp8 = stats.fp8_tiles.to_json() if plan.weight_format == WeightFormat.FP8_BLOCK else None
    manifest = build_manifest(plan, tensors, rank_dirs, list(argv) if argv is not None else None, fp8, files,
                              stats.stack_choices)
    note = served_backends_note(manifest)
    if note:
        target.notes.append(note)
    with deferred_signals():  # a signal waits for the commit, then stops nothing (interrupt.output_complete)
        with writing(target.out, write_dir):
            write_manifest(write_dir, manifest)
        target.commit()
    target.notes.extend(run_notes(plan))


def _clean_up_and_raise(exc: BaseException, output: _Output) -> NoReturn:
    """Remove what the run wrote (a second Ctrl-C cannot cut it short), then raise: a full disk as
    an :class:`OutputWriteError` naming the file, an interruption as an :class:`Interrupted` saying
    what OUTPUT holds now, anything else as it is. Called in the ``except`` block handling ``exc``."""
    target, writers = output.target, output.writers
    if isinstance(exc, OSError) and not isinstance(exc, OutputWriteError) and exc.errno in DISK_FULL:
        # mxconv writes nowhere but OUTPUT: a full disk is the output's, whoever raised it
        shown = next((f for f in (w.current_file() for w in writers) if f is not None), target.out)
        exc = OutputWriteError.from_os_error(exc, shown)
    with deferred_signals(raise_held=False):
        for w in writers:
            w.abort()
        left = target.abort()
    if isinstance(exc, KeyboardInterrupt):
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        stop.note = left if target.committed else f"{left}; rerun the same command to convert again"
        if stop is exc:
            raise
        raise stop from None
    if isinstance(exc, OutputWriteError):
        todo = "free space (or choose an OUTPUT on another disk)" if exc.disk_full else "fix that"
        raise OutputWriteError(f"{exc}; {left}; {todo} and rerun the same command") from exc
    raise
