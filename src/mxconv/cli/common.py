"""What every ``mxconv`` command shares: the app, its command class, option declarations, error handling.

Streams: result tables and ``--json`` documents on stdout (:data:`out`); progress, notes, warnings
and errors on stderr (:data:`err`); both from :mod:`mxconv.cli.output`. Exit codes: 0 success / verification passed, 1 verification
failed, 2 bad usage or bad input (an interruption by SIGINT/SIGTERM included, see
docs/reliability.md), 3 internal error. Options that several commands take are declared once here
(``Annotated`` aliases) so the same flag is spelled and documented the same way everywhere; the
options of a conversion run (quantize, repack) come as one set, :class:`RunOptions`.
"""

from __future__ import annotations

import errno
import functools
import inspect
import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Optional, get_type_hints

import typer
from rich.table import Table
from typer.core import TyperCommand

from mxconv import __version__, sizes
from mxconv.cli.flags import doc_in_cli_words
from mxconv.cli.output import err, out, say
from mxconv.errors import MxconvError
from mxconv.interrupt import Interrupted, late_signal, stop_signals
from mxconv.run.options import ScaleRounding

app = typer.Typer(
    name="mxconv",
    help=(
        "Convert Mixture-of-Experts checkpoints into kernel-ready MXFP4/MXFP8 weights, once, offline, "
        "and prove they compute what their source computes.\n\n"
        "Typical flow: mxconv inspect SRC; mxconv repack SRC OUT --backend trtllm; "
        "mxconv verify OUT --reference SRC."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,  # plain click help: no <bool>/<str> type columns
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)


class Command(TyperCommand):
    """How every mxconv command parses and presents itself (``@app.command(cls=Command)``): the usage
    line names arguments as the help does ("SOURCE OUTPUT", where Typer writes "{SOURCE} {OUTPUT}"),
    and a bad option value is one plain line naming the option, the value and what it accepts
    (Typer's pydantic conversion would prefix "Value error, ")."""

    def get_help(self, ctx: typer.Context) -> str:
        """The help text, wrapped at the terminal's width only at spaces: an option name ("--require-exact")
        or a word with a hyphen is never split across lines. Examples are blocks Click does not rewrap
        ("\\b" paragraphs), each at most 80 columns, so they copy and paste as they are."""
        import importlib

        # the Click that formats this context (Typer vendors its own copy): wrap_text reads TextWrapper
        # from its _textwrap module at each call
        click_textwrap = importlib.import_module(type(ctx).__module__.rsplit(".", 1)[0] + "._textwrap")
        plain = click_textwrap.TextWrapper

        class _Whole(plain):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**kwargs, "break_on_hyphens": False, "break_long_words": False})

        click_textwrap.TextWrapper = _Whole
        try:
            return super().get_help(ctx)
        finally:
            click_textwrap.TextWrapper = plain

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except typer.BadParameter as exc:
            exc.message = _conversion_message(exc)
            raise


def _conversion_message(exc: typer.BadParameter) -> str:
    """The reason of a failed conversion of an option's value: the validator's own words for a
    ValueError ("'fp3' is not one of 'mxfp4', 'mxfp8'."), else pydantic's with the value given."""
    details = getattr(exc.__cause__, "errors", None)  # Typer converts through a pydantic TypeAdapter
    first = details()[0] if callable(details) and details() else None
    if first is None:
        return exc.message
    if first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        return str(first["ctx"]["error"])
    return f"{first['msg']} (got {first['input']!r})" if "input" in first else first["msg"]


SOURCE_HELP = "Checkpoint directory or Hugging Face repo id (org/name)."

# ---- options shared by several commands -----------------------------------------------------
SourceArg = Annotated[str, typer.Argument(metavar="SOURCE", help=SOURCE_HELP)]
OutputArg = Annotated[Path, typer.Argument(metavar="OUTPUT", help="Output directory (must be empty unless --overwrite).")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE", help="auto | cpu | cuda | cuda:N (auto = CUDA when present).")]
RevisionOpt = Annotated[Optional[str], typer.Option("--revision", metavar="REV", help="Hub revision (branch, tag or commit) of a repo-id source.")]
MaxShardOpt = Annotated[str, typer.Option("--max-shard-size", metavar="SIZE", help="Largest output shard, e.g. 5GB, 500MB.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an earlier mxconv output in OUTPUT (swapped in only when the new one is complete).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan (tensors, bytes in/out, padding, memory); write nothing.")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option("--max-memory", metavar="SIZE", help=(
    "Host memory budget (peak RSS), e.g. 16GB, 2GiB. Default: 75% of the memory available at start. A layer "
    "that does not fit is read, converted and written in groups of experts; same output bytes."))]
MaxGpuMemoryOpt = Annotated[Optional[str], typer.Option("--max-gpu-memory", metavar="SIZE", help=(
    "GPU memory budget for --device cuda, e.g. 20GB. Default: 80% of the device's free memory."))]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable document on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", help="No progress bar or tables; reasons for a failure are still shown.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show Python tracebacks.")]
RoundingOpt = Annotated[ScaleRounding, typer.Option("--scale-rounding", help=(
    "E8M0 scale rule. auto: even for mxfp4, rceil for mxfp8 (least error, docs/numerics.md). rceil matches "
    "NVIDIA hardware/TRT-LLM/vLLM online MXFP8, ModelOpt and llm-compressor; floor is OCP v1.0 and torchao's "
    "default; even matches AMD Quark."))]
TraceOpt = Annotated[Optional[Path], typer.Option("--trace", metavar="FILE", hidden=True, help=(
    "Write the run's timeline (every stage of every work item) to FILE as JSON (scripts/bench_e2e.py reads it)."))]
NonfiniteOpt = Annotated[bool, typer.Option("--allow-nonfinite", help="Carry NaN/Inf over instead of refusing: NaN scales (0xFF) for blocks holding them, and NaN/Inf biases, routers and 0xFF scales of MX sources as they are.")]


@dataclass(frozen=True)
class RunOptions:
    """The options every conversion command (quantize, repack) takes, after its own and in this
    order; :func:`run_options` declares them on the command."""

    allow_nonfinite: NonfiniteOpt = False
    device: DeviceOpt = "auto"
    revision: RevisionOpt = None
    max_shard_size: MaxShardOpt = "5GB"
    overwrite: OverwriteOpt = False
    max_memory: MaxMemoryOpt = None
    max_gpu_memory: MaxGpuMemoryOpt = None
    dry_run: DryRunOpt = False
    as_json: JsonOpt = False
    quiet: QuietOpt = False
    debug: DebugOpt = False
    trace: TraceOpt = None


def run_options(command: Callable[..., None]) -> Callable[..., None]:
    """Declare the :class:`RunOptions` on ``command`` (whose last parameter is ``run: RunOptions``):
    Typer reads them from the signature after the command's own options, and the command gets them
    gathered into ``run``, so both conversion commands spell, document and default them alike."""
    hints = get_type_hints(RunOptions, include_extras=True)
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "run"]
    shared = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
              for f in fields(RunOptions)]

    @functools.wraps(command)
    def with_run_options(**kwargs: Any) -> None:
        run = RunOptions(**{f.name: kwargs.pop(f.name) for f in fields(RunOptions)})
        command(**kwargs, run=run)

    with_run_options.__signature__ = inspect.Signature(own + shared)  # type: ignore[attr-defined]
    return with_run_options


def _version(value: bool) -> None:
    if value:
        out.print(f"mxconv {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """mxconv: MoE checkpoints -> kernel-ready MX weights."""


@contextmanager
def errors(debug: bool) -> Iterator[None]:
    """Turn expected failures into a one-line message and the contract's exit code; SIGINT and
    SIGTERM stop the command cleanly (exit 2, see :mod:`mxconv.interrupt`), except once its output
    is complete: then the command ends as it would have, with a note naming the signal."""
    try:
        with stop_signals():
            yield
        late = late_signal()
        if late is not None:
            say(err, "note:", "bold yellow", f"{late} arrived after the output was complete; "
                "nothing was stopped and the output is kept as written")
    except typer.Exit:
        raise
    except MxconvError as exc:
        if debug:
            raise
        say(err, "error:", "bold red", str(exc))  # say() names the library's settings by their flags
        raise typer.Exit(exc.exit_code) from None
    except OSError as exc:
        if debug:
            raise
        what = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        where = f": {exc.filename}" if exc.filename else ""
        say(err, "error:", "bold red", f"{what}{where} (nothing partial was kept; fix this and rerun)")
        raise typer.Exit(2) from None
    except KeyboardInterrupt as exc:
        why = f"interrupted by {exc.signame}" if isinstance(exc, Interrupted) else "interrupted"
        note = exc.note if isinstance(exc, Interrupted) and exc.note else "stopped; nothing partial was kept"
        say(err, "error:", "bold red", f"{why}; {note}")
        raise typer.Exit(2) from None
    except Exception as exc:  # noqa: BLE001 - never let a crash look like "verification failed" (1)
        if debug:
            raise
        say(err, "internal error:", "bold red",
            f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback; please report it)")
        raise typer.Exit(3) from None


def device_of(spec: str):
    import torch

    from mxconv.errors import BadInput

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise BadInput(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise BadInput(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BadInput(f"--device {spec}: no CUDA device is available (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise BadInput(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) present")
    return dev


def human_bytes(n: float | int | None) -> str:
    """:func:`mxconv.sizes.human_bytes`, and "-" for an unknown size (None)."""
    return "-" if n is None else sizes.human_bytes(n)


def print_json(doc: Any) -> None:
    """``doc`` as indented JSON on stdout, the library's setting names said as flags (cli/flags.py)."""
    sys.stdout.write(json.dumps(doc_in_cli_words(doc), indent=2, default=str) + "\n")


# Summary keys (the --json names) as people read them; other keys: underscores as spaces.
SUMMARY_LABELS = {
    "seconds": "time", "gb_per_s": "throughput", "compute_seconds": "compute time", "stage_seconds": "time per stage",
    "peak_host_rss_bytes": "peak host memory (RSS)", "relative_rms_error": "relative RMS error",
    "moe_layers_converted": "MoE layers converted", "bytes_in": "bytes in", "bytes_out": "bytes out",
}
# Below this run time a throughput measures start-up, not conversion: the summary leaves it out.
MEANINGFUL_RATE_SECONDS = 1.0


def summary_table(plan_summary: dict[str, Any], title: str) -> Table:
    """Two-column summary: human labels (SUMMARY_LABELS), bytes human-readable, seconds rounded, nested
    values compact; a throughput only for a run long enough to measure one."""
    t = Table(title=title, show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    for k, v in doc_in_cli_words(plan_summary).items():
        if v is None:
            continue
        if k == "gb_per_s" and float(plan_summary.get("seconds") or 0.0) < MEANINGFUL_RATE_SECONDS:
            continue
        if isinstance(v, (int, float)) and ("bytes" in k) and not isinstance(v, bool):
            v = human_bytes(v)
        elif k == "gb_per_s":
            v = f"{v:.2f} GB/s"
        elif k.endswith("seconds") and isinstance(v, float):
            v = f"{v:.2f} s"
        elif k == "stage_seconds" and isinstance(v, dict):
            v = " · ".join(f"{name.removesuffix('_s').replace('_', ' ')} {sec:.2f} s" for name, sec in v.items())
        elif isinstance(v, float):
            v = f"{v:.4g}"
        elif isinstance(v, dict):
            v = ", ".join(f"{a}={b}" for a, b in v.items())
        elif isinstance(v, list):
            v = ", ".join(map(str, v))
        t.add_row(SUMMARY_LABELS.get(k, k.replace("_", " ")), str(v))
    return t
