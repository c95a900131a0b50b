"""``mxconv demo``: tiny built-in checkpoints through quantize -> repack (every backend) -> verify."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from mxconv.cli.common import DebugOpt, DeviceOpt, JsonOpt, QuietOpt, app, device_of, err, errors, out, print_json


@app.command()
def demo(
    workdir: Annotated[Optional[Path], typer.Option("--workdir", metavar="DIR", help="Where to build the demo checkpoints (default: a temporary directory, removed afterwards).")] = None,
    device: DeviceOpt = "auto",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Build tiny gpt-oss-style and Qwen-style checkpoints, run quantize -> repack (every backend)
    -> verify, and print one table. Exit 0 only if every step passes."""
    from mxconv.demo import run_demo

    with errors(debug):
        results = run_demo(workdir, device_of(device), progress=lambda msg: (None if as_json or quiet else err.print(f"[dim]{msg}[/]", highlight=False)))
        if as_json:
            print_json(results)
        elif not quiet:
            t = Table(title="mxconv demo")
            for col in ("source", "step", "result", "rel RMS", "detail"):
                t.add_column(col)
            for r in results["steps"]:
                t.add_row(r["source"], r["step"], "[green]ok[/]" if r["ok"] else "[red]FAIL[/]",
                          "-" if r.get("rel_rms") is None else f"{r['rel_rms']:.4f}", r.get("detail", ""))
            out.print(t)
            out.print("[bold green]demo passed[/]" if results["passed"] else "[bold red]demo failed[/]")
        for r in results["steps"]:
            if not r["ok"]:
                err.print(f"[red]FAIL[/] {r['source']} {r['step']}: {r.get('detail', '')}", highlight=False, soft_wrap=True)
        if not results["passed"]:
            raise typer.Exit(1)
