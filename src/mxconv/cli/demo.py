"""``mxconv demo``: tiny built-in checkpoints through quantize -> repack (every backend) -> verify."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from mxconv.cli.common import Command, DebugOpt, DeviceOpt, JsonOpt, QuietOpt, app, device_of, errors, print_json
from mxconv.cli.output import err, out, say


@app.command(cls=Command)
def demo(
    workdir: Annotated[Optional[Path], typer.Option("--workdir", metavar="DIR", help="Where to build the demo checkpoints (default: a temporary directory, removed afterwards).")] = None,
    device: DeviceOpt = "auto",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Build tiny gpt-oss-style and Qwen-style checkpoints, run quantize -> repack (every backend)
    -> verify, and print one table. Exit 0 only if every step passes."""
    with errors(debug):
        if workdir is not None:  # before torch is imported: a bad --workdir is answered at once
            _make_workdir(workdir)
        from mxconv.demo import run_demo

        results = run_demo(workdir, device_of(device), progress=lambda msg: (None if as_json or quiet else say(err, msg, "dim")))
        if as_json:
            print_json(results)
        elif not quiet:
            t = Table(title="mxconv demo")
            for col in ("source", "step", "result", "rel RMS", "detail"):
                t.add_column(col)
            for r in results["steps"]:
                t.add_row(r["source"], r["step"], Text("ok", style="green") if r["ok"] else Text("FAIL", style="red"),
                          "-" if r.get("rel_rms") is None else f"{r['rel_rms']:.4f}", r.get("detail", ""))
            out.print(t)
            say(out, "demo passed", "bold green") if results["passed"] else say(out, "demo failed", "bold red")
        for r in results["steps"]:
            if not r["ok"]:
                say(err, "FAIL", "red", f"{r['source']} {r['step']}: {r.get('detail', '')}")
        if not results["passed"]:
            raise typer.Exit(1)


def _make_workdir(workdir: Path) -> None:
    """Create --workdir (and its parents); BadInput naming it and the reason when that is impossible."""
    from mxconv.errors import BadInput

    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"--workdir {workdir}: cannot create it ({exc.strerror or exc})") from None
