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
        show_results(results, as_json, quiet, workdir)
        if not results["passed"]:
            raise typer.Exit(1)


def show_results(results: dict, as_json: bool, quiet: bool, workdir: Path | None) -> None:
    """The demo's JSON, or its verdict line alone (``--quiet``), or its table, the verdict and where its
    checkpoints are; each failed step's reason on stderr in every mode."""
    verdict = ("demo passed", "bold green") if results["passed"] else ("demo failed", "bold red")
    if as_json:
        print_json(results)
    elif quiet:
        say(out, *verdict)
    else:
        t = Table(title="mxconv demo")
        for col in ("source", "step", "result", "rel RMS", "detail"):
            t.add_column(col)
        for r in results["steps"]:
            t.add_row(r["source"], r["step"], Text("ok", style="green") if r["ok"] else Text("FAIL", style="red"),
                      "-" if r.get("rel_rms") is None else f"{r['rel_rms']:.4f}", r.get("detail", ""))
        out.print(t)
        say(out, *verdict)
        if workdir is None:
            out.print("The checkpoints named above were built in a temporary directory, removed now; "
                      "to keep them, run: mxconv demo --workdir DIR", soft_wrap=True)
    for r in results["steps"]:
        if not r["ok"]:
            say(err, "FAIL", "red", f"{r['source']} {r['step']}: {r.get('detail', '')}")


def _make_workdir(workdir: Path) -> None:
    """Create --workdir (and its parents); BadInput naming it and the reason when that is impossible."""
    from mxconv.errors import BadInput

    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"--workdir {workdir}: cannot create it ({exc.strerror or exc})") from None
