"""What ``quantize`` and ``repack`` share after parsing their own options: the run options turned
into :class:`~mxconv.run.conversion.RunSettings`, the :class:`~mxconv.run.conversion.Conversion`
driven phase by phase, and its plan (``--dry-run``) or summary printed."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mxconv.cli.common import RunOptions, device_of, print_json, summary_table
from mxconv.cli.output import err, out, progress, say
from mxconv.run.options import QuantOptions, RepackOptions

if TYPE_CHECKING:  # imported when a command runs, so that --help stays light
    from mxconv.run.conversion import Conversion, RunSettings
    from mxconv.run.memory import MemoryPlan
    from mxconv.run.plan import Plan

DRY_RUN_TENSORS_SHOWN = 12


def progress_label(plan: Plan) -> str:
    """What a run does, for its progress bar: family, source format -> output format (and backend),
    e.g. "quantize gpt-oss: bf16 -> mxfp8", "repack mixtral: bf16 -> mxfp4 trtllm"."""
    to = plan.weight_format + (f" {plan.repack.backend}" if plan.repack is not None else "")
    if plan.linears is not None and plan.linears.mx_modules():
        to += " (every linear)"
    return f"{plan.command} {plan.info.family}: {plan.info.expert_format} -> {to}"


def run_settings(run: RunOptions) -> RunSettings:
    """``run``'s sizes, budget, trace file and command line as the conversion's settings."""
    from mxconv.run.conversion import RunSettings
    from mxconv.run.memory import MemoryBudget, parse_memory
    from mxconv.sizes import parse_size

    budget = MemoryBudget(parse_memory(run.max_memory, "--max-memory"), parse_memory(run.max_gpu_memory, "--max-gpu-memory"))
    return RunSettings(parse_size(run.max_shard_size), run.overwrite, budget, run.trace, ("mxconv", *sys.argv[1:]))


def convert(source: str, output: Path, quant: QuantOptions, repack: RepackOptions | None, run: RunOptions) -> None:
    """Plan, check OUTPUT, then print the plan (``--dry-run``) or run it with progress and print
    the summary; everything up to the run reads headers only and imports no torch."""
    from mxconv.run.conversion import Conversion

    settings = run_settings(run)
    if run.dry_run or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", run.device):
        device_of(run.device)  # a malformed --device is refused before anything is read (torch: now)
    conversion = Conversion.open(source, quant, repack, revision=run.revision)
    plan = conversion.plan
    output_warnings = conversion.check_output(output, run.overwrite)  # kept files that verify will fail on
    if not run.as_json:
        for warning in [*plan.warnings, *output_warnings]:  # shown even with --quiet (a wrong output, or one verify fails)
            say(err, "warning:", "bold yellow", warning)
    device = device_of(run.device)
    memory_plan = conversion.plan_memory(device, settings.budget)  # exit 2 when one expert does not fit
    if run.dry_run:
        return _print_dry_run(conversion, memory_plan, output, run)
    with progress(plan.bytes_in, progress_label(plan), run.quiet or run.as_json) as advance:
        summary = conversion.run(output, device=device, settings=settings, memory_plan=memory_plan, on_progress=advance)
    if run.as_json:
        print_json(summary)
    elif not run.quiet:
        for n in summary.get("notes", []):
            if n not in output_warnings:  # said before the run
                say(err, n, "dim")
        out.print(summary_table({k: v for k, v in summary.items() if k != "notes"}, f"mxconv {plan.command}: done"))


def _print_dry_run(conversion: Conversion, memory_plan: MemoryPlan, output: Path, run: RunOptions) -> None:
    """--dry-run: the plan, its memory and its expert tensors, as JSON or a table."""
    plan = conversion.plan
    doc = plan.summary(memory_plan)
    doc["dry_run"] = True
    doc["output"] = str(output)
    doc["memory"] = memory_plan.to_json()
    doc["tensors"] = [
        {"name": t.name, "shape": list(t.shape), "dtype": t.st_dtype, "bytes": t.nbytes, "role": t.role}
        for t in plan.dests[0]
        if t.role == "expert"
    ]
    if run.as_json:
        print_json(doc)
    elif not run.quiet:
        out.print(summary_table(plan.summary(memory_plan), f"mxconv {plan.command} --dry-run (nothing written)"))
        for t in doc["tensors"][:DRY_RUN_TENSORS_SHOWN]:
            out.print(f"  {t['name']}  {t['dtype']}{t['shape']}", highlight=False)
        if len(doc["tensors"]) > DRY_RUN_TENSORS_SHOWN:
            out.print(f"  ... {len(doc['tensors']) - DRY_RUN_TENSORS_SHOWN} more expert tensors")
