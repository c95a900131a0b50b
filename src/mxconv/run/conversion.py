"""The conversion jobs behind ``quantize`` and ``repack``: plan (:mod:`mxconv.run.plan`), compute
(:mod:`mxconv.run.compute`), then output: ``execute`` runs the plan through the overlapped pipeline,
writes the shards, the config and index files, and the manifest last, through an
:class:`~mxconv.output.directory.OutputTarget`: a failed or interrupted run removes what it wrote, and an
``--overwrite`` replaces the old output only once the new one is complete (docs/reliability.md).

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from mxconv.source.file_names import CONFIG_NAME
from mxconv.run.compute import RunStats, make_compute
from mxconv.source.copy_check import refuse_nonfinite_copy
from mxconv.families import MoELayerRef
from mxconv.families.gpt_oss_output import FORMAT_KEY
from mxconv.interrupt import Interrupted, deferred_signals
from mxconv.run.linear_config import with_linears
from mxconv.run.linears import linear_compute, linear_load, manifest_extras
from mxconv.output.manifest import base_manifest, tensor_table, write_manifest
from mxconv.run.memory import MemoryBudget, plan_for, process_peak_rss, resolve_budget, work_items
from mxconv.output.directory import DISK_FULL, OutputTarget, OutputWriteError, atomic_write_json, writing
from mxconv.run.pipeline import TRACE_ENV, StageTimes, run_pipeline, write_trace
from mxconv.run.plan import Plan, QuantOptions, RepackOptions, build_plan, kernel_params  # noqa: F401 - the job API
from mxconv.output.shards import ShardPlan, shards_size
from mxconv.output.writer import ShardedWriter

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------------------------
# execution
# ---------------------------------------------------------------------------------------------


def output_config(plan: Plan) -> dict[str, Any]:
    """config.json of the output: the source config with the quantization_config for the experts."""
    cfg = dict(plan.ckpt.config)
    src_q = cfg.get("quantization_config")
    reader = plan.reader
    selected = {r.layer for r in plan.refs}
    formats = {r.layer: (r, reader.layer_format(r)) for r in reader.layer_refs()}
    # Layers --include/--ignore left in a format other than the output's (float, block-FP8): the
    # config lists them as not converted, so that loaders do not take them for MX weights.
    skipped = [r for L, (r, f) in formats.items() if L not in selected and f != plan.weight_format]
    if src_q and all(f == plan.weight_format for _, f in formats.values()):
        pass  # MX source kept as is: its quantization_config already describes the experts
    else:
        cfg["quantization_config"] = reader.quantization_config(plan.weight_format, plan.quant.scale_rounding, skipped)
    if plan.linears is not None and plan.linears.mx_modules():  # MXFP8 linear layers: named exactly, as the rest
        cfg["quantization_config"] = with_linears(cfg["quantization_config"], plan.linears.mx_modules(), plan.linears.kept)
    if plan.repack is not None:
        cfg["mxconv_layout"] = {
            "backend": plan.repack.backend,
            "activation": plan.repack.activation,
            "tp_size": plan.repack.tp,
            "manifest": "mxconv.json",
        }
        # Kernel-layout experts are for engine integrations (mxconv.engines.loader), never for from_pretrained:
        # with a quant_method a loader knows, transformers finds none of its expert tensors and leaves the
        # experts randomly initialised. quant_method null makes transformers and vLLM refuse the directory.
        cfg["quantization_config"] = {
            "quant_method": None,
            FORMAT_KEY: "kernel-layout",  # the key gpt-oss MXFP8 outputs use too
            "mxconv_note": (f"MoE experts in the {plan.repack.backend} kernel layout (mxconv.json); load them with "
                            "mxconv.engines.loader or an engine integration, not with from_pretrained"),
            "mxconv_expert_quantization_config": cfg.get("quantization_config"),
        }
    return cfg


def layer_table(refs: list[MoELayerRef]) -> list[dict[str, Any]]:
    return [
        {
            "layer": r.layer,
            "module_prefix": r.module_prefix,
            "router_weight": r.router_weight,
            "router_bias": r.router_bias,
            "correction_bias": r.correction_bias,
        }
        for r in refs
    ]


def manifest_layout(plan: Plan) -> dict[str, Any]:
    info = plan.info
    if plan.sizes is None:
        lay = {
            "name": "canonical-gpt-oss" if info.family == "gpt-oss" else "canonical-compressed-tensors",
            "version": 1,
            "engine_compat": {"transformers": ">=4.55", "vllm": ">=0.10.2"} if info.family == "gpt-oss" else {"compressed-tensors": ">=0.11", "vllm": ">=0.11"},
            "hidden_size": info.hidden_size,
            "intermediate_size": info.intermediate_size,
            "padded_hidden_size": info.hidden_size,
            "padded_intermediate_size": info.intermediate_size,
        }
    else:
        lay = dict(plan.layout_desc)
        lay.update(
            {
                "hidden_size": info.hidden_size,
                "intermediate_size": plan.sizes.intermediate_size,
                "intermediate_size_total": info.intermediate_size,
                "padded_hidden_size": plan.sizes.padded_hidden_size,
                "padded_intermediate_size": plan.sizes.padded_intermediate_size,
                "tp_ranges": [list(r) for r in plan.rank_ranges],
            }
        )
        if plan.repack:
            lay["options"] = dict(plan.repack.layout_options)
    lay["w13_row_order"] = info.row_order
    lay["kernel_params"] = kernel_params(info)
    return lay


def output_bytes(plan: Plan, shard_plans: list[list[ShardPlan]]) -> int:
    """About what the output takes on disk: the shards with their headers, the copied files per
    rank, and a margin for config, index and manifest (under 1 kB per tensor)."""
    extra = sum(f.stat().st_size for f in plan.ckpt.extra_files)
    tensors = sum(len(d) for d in plan.dests)
    return sum(shards_size(s) for s in shard_plans) + len(shard_plans) * extra + 1024 * tensors + (1 << 20)


def plan_memory(plan: Plan, budget: MemoryBudget | None, device: torch.device | str) -> None:
    """Plan ``plan``'s memory (``plan.memory``: pipeline depth, experts per group) for ``device`` (a
    torch.device, or a device type: ``inspect`` plans for "cpu" without torch) under ``budget`` (None
    fields: the machine's defaults, see :mod:`mxconv.run.memory`); BadInput when one expert does not fit."""
    budget = budget or MemoryBudget()
    resolved, default = resolve_budget(budget.host, budget.gpu, device)
    plan.memory = plan_for(plan, resolved, default_budget=default)
    plan.memory_device = resolved.device_type


@dataclass
class _Output:
    """Where a run writes: OUTPUT's target, its shards per rank and the rank directories."""

    target: OutputTarget
    shard_plans: list[list[ShardPlan]]
    write_dir: Path
    rank_dirs: list[Path]


def execute(
    plan: Plan,
    out_dir: Path,
    *,
    device: torch.device,
    max_shard_size: int,
    overwrite: bool,
    argv: list[str] | None = None,
    on_progress: Callable[[int], None] | None = None,
    memory: MemoryBudget | None = None,
) -> dict[str, Any]:
    """Run ``plan`` into ``out_dir``; returns the summary (with timing and error statistics).

    Memory: ``plan.memory`` where :func:`plan_memory` planned it for this device, else the plan
    under ``memory`` (default: the machine's default budget, see :mod:`mxconv.run.memory`).

    On any failure or interruption everything this run wrote is removed (an ``--overwrite``'s old
    output stays whole) before the exception leaves; an :class:`Interrupted` carries what OUTPUT
    holds now in ``note``, an :class:`OutputWriteError` says it in its message."""
    target = OutputTarget(out_dir, [plan.ckpt.root], overwrite)
    writers: list[ShardedWriter] = []
    try:
        t0 = time.perf_counter()
        if plan.memory is None or memory is not None or plan.memory_device != device.type:
            plan_memory(plan, memory, device)
        output = _prepare(plan, target, max_shard_size)
        return _execute(plan, output, writers, device=device, argv=argv, on_progress=on_progress, t0=t0)
    except BaseException as exc:
        if isinstance(exc, OSError) and not isinstance(exc, OutputWriteError) and exc.errno in DISK_FULL:
            # mxconv writes nowhere but OUTPUT: a full disk is the output's, whoever raised it
            shown = next((f for f in (w.current_file() for w in writers) if f is not None), target.out)
            exc = OutputWriteError.from_os_error(exc, shown)
        with deferred_signals(raise_held=False):  # a second Ctrl-C must not cut the clean-up short
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


def _prepare(plan: Plan, target: OutputTarget, max_shard_size: int) -> _Output:
    """Make OUTPUT ready: free space checked, staging directory, rank directories."""
    shard_plans = plan.shard_plans(max_shard_size)
    write_dir = target.prepare(output_bytes(plan, shard_plans))
    rank_dirs = [write_dir] if len(plan.dests) == 1 else [write_dir / f"rank-{r}" for r in range(len(plan.dests))]
    for d in rank_dirs:
        with writing(target.out, write_dir):
            d.mkdir(parents=True, exist_ok=True)
    return _Output(target, shard_plans, write_dir, rank_dirs)


def _execute(
    plan: Plan,
    output: _Output,
    writers: list[ShardedWriter],
    *,
    device: torch.device,
    argv: list[str] | None,
    on_progress: Callable[[int], None] | None,
    t0: float,
) -> dict[str, Any]:
    """:func:`execute` without the clean-up: fills ``writers`` as it creates them."""
    import torch

    target, write_dir, rank_dirs = output.target, output.write_dir, output.rank_dirs
    notes = target.notes
    out_dir = target.out
    for d, shards in zip(rank_dirs, output.shard_plans):
        writers.append(ShardedWriter(d, shards, display_dir=out_dir / d.relative_to(write_dir)))
    stats = RunStats()
    compute = linear_compute(plan, make_compute(plan, device, stats), device, stats)  # + "linear" items
    reader = plan.reader
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # reader threads refuse NaN/Inf biases and routers and 0xFF scales (weights: where quantized)
    load = lambda item: reader.read_checked_layer(item.payload, plan.quant.allow_nonfinite, item.experts)  # noqa: E731
    load = linear_load(plan, load)
    mem = plan.memory
    items = work_items(plan.items, mem)
    trace_path = os.environ.get(TRACE_ENV)
    times = StageTimes(events=[] if trace_path else None, origin=t0)
    t_pipe = time.perf_counter()
    run_pipeline(items, writers, load=load, compute=compute, on_progress=on_progress,
                 prefetch=mem.prefetch, queue_depth=mem.queue_depth, read_threads=min(2, mem.prefetch),
                 check_copy=None if plan.quant.allow_nonfinite else refuse_nonfinite_copy, times=times)

    cfg = output_config(plan)
    tensors: dict[str, Any] = {}
    t_finish = time.perf_counter()
    for r, (d, w) in enumerate(zip(rank_dirs, writers)):
        written = w.finish()
        with writing(out_dir, write_dir):
            atomic_write_json(d / CONFIG_NAME, cfg)
            for f in plan.ckpt.extra_files:
                shutil.copyfile(f, d / f.name)
        prefix = "" if len(writers) == 1 else f"rank-{r}/"
        for name, entry in tensor_table(written, prefix).items():
            tensors[prefix + name if prefix else name] = entry
    q = plan.quant
    # From the converted layers' own formats (a mixed source holds MX and float layers).
    src_formats = {plan.reader.layer_format(r) for r in plan.refs}
    lossless = src_formats == {"mxfp4"} and plan.weight_format == "mxfp8"
    from_mx_untouched = src_formats == {plan.weight_format} or lossless
    manifest = base_manifest(
        source=plan.ckpt.source.to_json(),
        family=plan.info.family,
        kind="kernel" if plan.repack else "canonical",
        weight_format=plan.weight_format,
        scale_rounding=None if from_mx_untouched else q.scale_rounding,
        backend=plan.repack.backend if plan.repack else None,
        activation=plan.repack.activation if plan.repack else None,
        tp_size=plan.repack.tp if plan.repack else 1,
        layout=manifest_layout(plan),
        model=plan.info.to_json(),
        layers=layer_table(plan.refs),
        numerics={
            "element_format": {"mxfp4": "e2m1", "int4": "int4"}.get(plan.weight_format, "e4m3"),
            "scale_format": "bf16" if plan.weight_format == "int4" else "e8m0",
            "block_size": 32,
            "block_axis": "input (last dim of [out, in])",
            "rounding": "rne",
            "packing": "low_nibble_first" if plan.weight_format in ("mxfp4", "int4") else None,
            "source_format": plan.info.expert_format,
            "source_scale_scheme": plan.info.source_scale_scheme,
            "requantized": any(f in ("mxfp4", "mxfp8") and f != plan.weight_format for f in src_formats) and not lossless,
            "lossless_conversion": "mxfp4 -> mxfp8 (same block scales, E2M1 values are E4M3 values)" if lossless else None,
        },
        argv=argv,
    )
    manifest["tensors"] = tensors
    manifest.update(manifest_extras(plan))  # linear layers, source bytes by role
    from mxconv.output.engine_quant_config import attach  # quant_config + served_vllm_backends (reads the tensors table)

    attach(manifest)
    if manifest["kind"] == "kernel" and not manifest["served_vllm_backends"]:
        why = "; ".join(f"{b}: {r}" for b, r in manifest["quant_config"]["not_served"].items())
        notes.append(f"note: no vLLM {manifest['quant_config']['engine_version']} MXFP4 MoE backend holds these bytes as they are"
                     + (f" ({why})" if why else f" ({manifest['weight_format']} experts)")
                     + "; mxconv.engines.loader and its kernels read them, and the manifest's quant_config describes them")
    # Top-level names this run wrote (a later --overwrite removes exactly these, and nothing else).
    if len(rank_dirs) > 1:
        manifest["output_files"] = sorted({CONFIG_NAME, *(d.name for d in rank_dirs)})
    else:
        manifest["output_files"] = sorted({CONFIG_NAME, "model.safetensors.index.json", *(f.name for f in plan.ckpt.extra_files)})
    with deferred_signals():  # a signal waits for the commit, then stops nothing (interrupt.output_complete)
        with writing(out_dir, write_dir):
            if len(rank_dirs) > 1:
                atomic_write_json(write_dir / CONFIG_NAME, cfg)
            write_manifest(write_dir, manifest)
        target.commit()  # a staged --overwrite replaces the old output now
    skipped = plan.linears.unaligned if plan.linears is not None else []
    if skipped:
        notes.append(f"note: {len(skipped)} linear layer(s) left unquantized (input size not a multiple of 32, "
                     f"--skip-unaligned): {', '.join(skipped)}; the config lists them in 'ignore'")
    if plan.repack is None and any(n.endswith("weight_scale_inv") for d in plan.dests for n in (t.name for t in d)):
        notes.append(
            "note: block-FP8 tensors outside the routed experts (attention, dense and shared MLPs) were copied "
            "unchanged with their weight_scale_inv scales; the written quantization_config describes the MX "
            "experts only, so engines that load this checkpoint must be told about those FP8 modules separately"
        )
    wall = time.perf_counter() - t0
    if trace_path:
        times.mark("setup", -1, t0, t_pipe)
        times.mark("finish", -1, t_finish, t0 + wall)  # the last shards' fsync, config, manifest
        write_trace(Path(trace_path), items, times)
    summary = plan.summary()
    summary.update(
        {
            "output": str(out_dir),
            "seconds": wall,
            "gb_per_s": (plan.bytes_in + plan.bytes_out) / wall / 1e9 if wall > 0 else None,
            "compute_seconds": stats.compute_seconds,
            "quantized_tensors": stats.errors.tensors,
            "relative_rms_error": stats.errors.rel_rms,
            "device": str(device),
            "stage_seconds": times.to_json(),
            "peak_host_rss_bytes": process_peak_rss(),  # this process's own high-water mark (VmHWM)
            "notes": notes,
        }
    )
    if device.type == "cuda":
        summary["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    return summary
