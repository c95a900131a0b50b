"""The ``mxconv`` command line (Typer + rich).

Exit codes: 0 success / verification passed, 1 verification failed, 2 bad usage or bad input
(an interruption by SIGINT/SIGTERM included, see docs/reliability.md), 3 internal error.
Streams: result tables and ``--json`` documents on stdout; progress, notes, warnings and errors on
stderr. ``--quiet`` hides progress and tables, never the reason for a failure.
"""

from __future__ import annotations

import errno
import json
import sys
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, Optional

import click
import typer
from rich.console import Console
from typer.core import TyperCommand
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from mxconv import __version__
from mxconv.errors import MxconvError
from mxconv.interrupt import Interrupted, stop_signals
from mxconv.layouts import backend_names

app = typer.Typer(
    name="mxconv",
    help=(
        "Convert Mixture-of-Experts checkpoints into kernel-ready MXFP4/MXFP8 weights, once, offline, "
        "and prove they compute what their source computes.\n\n"
        "Typical flow: mxconv inspect SRC; mxconv repack SRC OUT --backend trtllm; "
        "mxconv verify OUT --reference SRC."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()


class Fmt(str, Enum):
    mxfp4 = "mxfp4"
    mxfp8 = "mxfp8"


Backend = Enum("Backend", {name: name for name in backend_names()}, type=str)  # type: ignore[misc]


class Rounding(str, Enum):
    auto = "auto"
    rceil = "rceil"
    floor = "floor"
    even = "even"


def _version(value: bool) -> None:
    if value:
        out.print(f"mxconv {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """mxconv: MoE checkpoints -> kernel-ready MX weights."""


# ---------------------------------------------------------------------------------------------
# shared plumbing
# ---------------------------------------------------------------------------------------------


@contextmanager
def _errors(debug: bool) -> Iterator[None]:
    """Turn expected failures into a one-line message and the contract's exit code; SIGINT and
    SIGTERM stop the command cleanly (exit 2, see :mod:`mxconv.interrupt`)."""
    try:
        with stop_signals():
            yield
    except typer.Exit:
        raise
    except MxconvError as exc:
        if debug:
            raise
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except OSError as exc:
        if debug:
            raise
        what = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        err.print(f"[bold red]error:[/] {what}: {exc.filename or ''} (the output is incomplete: it has no mxconv.json; rerun to clean it up)", highlight=False)
        raise typer.Exit(2) from None
    except KeyboardInterrupt as exc:
        why = f"interrupted by {exc.signame}" if isinstance(exc, Interrupted) else "interrupted"
        note = exc.note if isinstance(exc, Interrupted) and exc.note else "stopped before writing anything"
        err.print(f"[bold red]error:[/] {why}; {note}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except Exception as exc:  # noqa: BLE001 - never let a crash look like "verification failed" (1)
        if debug:
            raise
        err.print(
            f"[bold red]internal error:[/] {type(exc).__name__}: {exc} (rerun with --debug for the traceback; "
            "please report it)",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(3) from None


def _device(spec: str):
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


def _gb(n: float | int | None) -> str:
    """Bytes in the largest decimal unit that keeps a leading digit (what huggingface-cli shows)."""
    if n is None:
        return "-"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")


@contextmanager
def _progress(total: int, label: str, quiet: bool) -> Iterator[Any]:
    if quiet:
        yield None
        return
    prog = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=False),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,
    )
    with prog:
        task = prog.add_task(label, total=max(total, 1))
        yield lambda n: prog.advance(task, n)


def _plan_table(plan_summary: dict[str, Any], title: str) -> Table:
    """Two-column summary: bytes human-readable, seconds rounded, nested values compact."""
    t = Table(title=title, show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    for k, v in plan_summary.items():
        if v is None:
            continue
        if isinstance(v, (int, float)) and ("bytes" in k) and not isinstance(v, bool):
            v = _gb(v)
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
        t.add_row(k.replace("_", " "), str(v))
    return t


def _run_convert(
    command: str,
    source: str,
    output: Path,
    *,
    quant: Any,
    repack: Any,
    device: str,
    revision: Optional[str],
    max_shard_size: str,
    overwrite: bool,
    dry_run: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    from mxconv.checkpoint import open_checkpoint
    from mxconv.convert import build_plan, execute
    from mxconv.families import detect_family
    from mxconv.writer import check_output_dir, parse_size

    shard_bytes = parse_size(max_shard_size)
    dev = _device(device)
    ckpt = open_checkpoint(source, revision)
    reader = detect_family(ckpt)
    plan = build_plan(ckpt, reader, command, quant, repack)
    check_output_dir(output, [ckpt.root], overwrite)
    if not as_json:
        for warning in plan.warnings:  # shown even with --quiet: the output would compute wrongly
            err.print(f"[bold yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    if dry_run:
        doc = plan.summary()
        doc["dry_run"] = True
        doc["output"] = str(output)
        doc["tensors"] = [
            {"name": t.name, "shape": list(t.shape), "dtype": t.st_dtype, "bytes": t.nbytes, "role": t.role}
            for t in plan.dests[0]
            if t.role == "expert"
        ]
        if as_json:
            _print_json(doc)
        elif not quiet:
            out.print(_plan_table(plan.summary(), f"mxconv {command} --dry-run (nothing written)"))
            for t in doc["tensors"][:12]:
                out.print(f"  {t['name']}  {t['dtype']}{t['shape']}", highlight=False)
            if len(doc["tensors"]) > 12:
                out.print(f"  ... {len(doc['tensors']) - 12} more expert tensors")
        return
    with _progress(plan.bytes_in, f"{command} {reader.title}", quiet or as_json) as advance:
        summary = execute(plan, output, device=dev, max_shard_size=shard_bytes, overwrite=overwrite,
                          argv=["mxconv", *sys.argv[1:]], on_progress=advance)
    if as_json:
        _print_json(summary)
    elif not quiet:
        for n in summary.get("notes", []):
            err.print(f"[dim]{n}[/]", highlight=False, soft_wrap=True)
        out.print(_plan_table({k: v for k, v in summary.items() if k != "notes"}, f"mxconv {command}: done"))


# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------

_SOURCE_HELP = "Checkpoint directory or Hugging Face repo id (org/name)."


@app.command()
def quantize(
    source: str = typer.Argument(..., metavar="SOURCE", help=_SOURCE_HELP),
    output: Path = typer.Argument(..., metavar="OUTPUT", help="Output directory (must be empty unless --overwrite)."),
    format: Fmt = typer.Option(Fmt.mxfp4, "--format", help="Expert weight format."),
    scale_rounding: Rounding = typer.Option(Rounding.auto, "--scale-rounding", help="E8M0 scale rule. auto: even for mxfp4, rceil for mxfp8 (least error, docs/numerics.md). rceil matches NVIDIA hardware/TRT-LLM/vLLM online MXFP8, ModelOpt and llm-compressor; floor is OCP v1.0 and torchao's default; even matches AMD Quark."),
    include: Optional[str] = typer.Option(None, "--include", help="Regex over '<module>.experts' names: quantize only matching MoE layers."),
    ignore: Optional[str] = typer.Option(None, "--ignore", help="Regex over '<module>.experts' names: leave matching MoE layers as they are (config.json lists them as not converted)."),
    allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help="Write NaN scales (0xFF) for blocks holding NaN/Inf instead of refusing."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N (auto = CUDA when present)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of a repo-id SOURCE."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest output shard, e.g. 5GB, 500MB."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the contents of a non-empty OUTPUT."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (tensors, bytes in/out); write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable summary on stdout."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar or tables."),
    debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks."),
) -> None:
    """bf16/fp16/fp32, FP8-block or MXFP4 MoE checkpoint -> canonical MXFP4/MXFP8 checkpoint.

    gpt-oss is written in the published gpt-oss MXFP4 convention (*_blocks/*_scales); other families
    as compressed-tensors (mxfp4-pack-quantized / mxfp8-quantized). Only routed-expert weights are
    quantized; every other tensor is copied byte for byte. Example:

        mxconv quantize Qwen/Qwen3-30B-A3B ./qwen3-mxfp4 --format mxfp4
    """
    from mxconv.convert import QuantOptions

    with _errors(debug):
        q = QuantOptions(format.value, scale_rounding.value, allow_nonfinite, include, ignore)
        _run_convert("quantize", source, output, quant=q, repack=None, device=device, revision=revision,
                     max_shard_size=max_shard_size, overwrite=overwrite, dry_run=dry_run, as_json=as_json, quiet=quiet)


def _layout_options(pairs: list[str]) -> dict[str, str]:
    """``--layout-option NAME=VALUE`` pairs -> {NAME: VALUE} (typed and checked by the layout)."""
    from mxconv.errors import BadInput

    given: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise BadInput(f"--layout-option {pair!r}: expected NAME=VALUE")
        if name.strip() in given:
            raise BadInput(f"--layout-option {name.strip()} given twice")
        given[name.strip()] = value.strip()
    return given


class _RepackCommand(TyperCommand):
    """The repack command, whose --help ends with every backend's options (read from the layouts
    only when help is shown, so plain --help never imports torch)."""

    @property
    def epilog(self) -> str:
        from mxconv.layouts import options_help

        lines = options_help().splitlines()
        return "Backend options (--layout-option NAME=VALUE):\n\n" + "\n\n".join(lines)

    @epilog.setter
    def epilog(self, value: str | None) -> None:  # click assigns it in __init__; ours is computed
        pass


@app.command(cls=_RepackCommand)
def repack(
    source: str = typer.Argument(..., metavar="SOURCE", help=_SOURCE_HELP + " MXFP4 (moved, never re-quantized) or bf16 (quantized on the way)."),
    output: Path = typer.Argument(..., metavar="OUTPUT", help="Output directory (must be empty unless --overwrite)."),
    backend: Backend = typer.Option(..., "--backend", help="Engine backend whose kernel layout to write."),
    activation: Optional[str] = typer.Option(None, "--activation", help="trtllm: bf16|mxfp8; marlin: bf16|fp8; aiter: bf16 (a16w4)|mxfp4 (a4w4). Default: bf16."),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel size: writes OUTPUT/rank-{r}/ per rank."),
    layout_option: Optional[list[str]] = typer.Option(None, "--layout-option", metavar="NAME=VALUE", help="A backend option (repeatable); each backend's options are listed below."),
    marlin_scale_layout: Optional[str] = typer.Option(None, "--marlin-scale-layout", help="Same as --layout-option marlin_scale_layout=VALUE: current (vLLM >= 0.12, the default) | legacy (<= 0.11.2)."),
    triton_layout: Optional[str] = typer.Option(None, "--triton-layout", help="Same as --layout-option triton_layout=VALUE: 3.5 (triton_kernels vendored by vLLM 0.12-0.33, the default) | 3.6 (vLLM 0.20, triton main)."),
    scale_rounding: Rounding = typer.Option(Rounding.auto, "--scale-rounding", help="Scale rule when a bf16 SOURCE is quantized on the way (auto = even, the least MXFP4 error; see quantize --help)."),
    allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help="Quantize blocks holding NaN/Inf to NaN scales instead of refusing."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision of a repo-id SOURCE."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest output shard."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the contents of a non-empty OUTPUT."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (padded sizes, bytes); write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable summary on stdout."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar or tables."),
    debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks."),
) -> None:
    """MXFP4 (or bf16) checkpoint -> kernel-ready expert tensors for one engine backend.

    Writes exactly what vLLM's fused-MoE layer holds after its load-time processing
    (model.layers.L.mlp.experts.w13_weight, ...), padding included, so the engine can skip it.
    Every MoE layer is converted (--include/--ignore are quantize options). Example:

        mxconv repack openai/gpt-oss-20b ./gpt-oss-20b-trtllm --backend trtllm
    """
    from mxconv.convert import QuantOptions, RepackOptions
    from mxconv.errors import BadInput, LayoutError
    from mxconv.layouts import get_layout

    with _errors(debug):
        backend = backend.value
        layout = get_layout(backend)
        act = activation or layout.activations[0]
        given = _layout_options(layout_option or [])
        for flag, key, value in (("--marlin-scale-layout", "marlin_scale_layout", marlin_scale_layout),
                                 ("--triton-layout", "triton_layout", triton_layout)):
            if value is None:
                continue
            if key not in {o.name for o in layout.options}:
                owners = [b for b in backend_names() if key in {o.name for o in get_layout(b).options}]
                raise BadInput(f"{flag} applies to --backend {' / '.join(owners)} only (got --backend {backend})")
            given[key] = value
        try:
            opts = layout.resolve_options(given)
        except LayoutError as exc:
            raise BadInput(f"--backend {backend}: {exc}") from None
        q = QuantOptions("mxfp4", scale_rounding.value, allow_nonfinite)
        r = RepackOptions(backend, act, tp, opts)
        _run_convert("repack", source, output, quant=q, repack=r, device=device, revision=revision,
                     max_shard_size=max_shard_size, overwrite=overwrite, dry_run=dry_run, as_json=as_json, quiet=quiet)


@app.command()
def verify(
    path: Path = typer.Argument(..., metavar="PATH", help="A checkpoint written by mxconv quantize or repack."),
    reference: Optional[str] = typer.Option(None, "--reference", help="The checkpoint the conversion came from (bf16 or MXFP4)."),
    reference_outputs: Optional[Path] = typer.Option(None, "--reference-outputs", help="Compare with outputs saved earlier by --save-reference."),
    save_reference: Optional[Path] = typer.Option(None, "--save-reference", help="Save the reference's outputs (safetensors) for later runs without the source."),
    layers: Optional[str] = typer.Option(None, "--layers", help="MoE layers to check, e.g. 0,3 (default: all)."),
    tokens: int = typer.Option(64, "--tokens", help="Synthetic tokens per layer."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic hidden states."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision of a repo-id --reference."),
    kernel: bool = typer.Option(False, "--kernel", help="Also run the engine's own kernel on the files (triton: triton_kernels matmul_ogs; marlin: vLLM's Marlin MoE op; SM90 GPU) and compare it with the reference runner. Exit 2 naming what is missing where it cannot run. Kernels are found in an installed vLLM or triton_kernels, or via MXCONV_TRITON_KERNELS / MXCONV_MARLIN_OPS."),
    as_json: bool = typer.Option(False, "--json", help="JSON report on stdout."),
    quiet: bool = typer.Option(False, "--quiet", help="Only the exit code and errors."),
    debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks."),
) -> None:
    """Check a converted checkpoint: integrity (sha256), layout (inverse + padding), numerics.

    Exit 0 when everything passes, 1 when a check fails, 2 on bad input. Example:

        mxconv verify ./gpt-oss-20b-trtllm --reference openai/gpt-oss-20b
    """
    from mxconv.verify import verify as run_verify

    with _errors(debug):
        rep = run_verify(
            path,
            reference=reference,
            reference_outputs=str(reference_outputs) if reference_outputs else None,
            save_reference=str(save_reference) if save_reference else None,
            layers=layers,
            tokens=tokens,
            seed=seed,
            revision=revision,
            kernel=kernel,
        )
        problems = rep.problems + [p for r in rep.layers for p in r.problems]
        if as_json:
            _print_json(rep.to_json())
        elif not quiet:
            t = Table(title=f"mxconv verify {rep.path} ({rep.kind}{', ' + rep.backend if rep.backend else ''})")
            with_kernel = any(r.kernel is not None for r in rep.layers)
            for col in ("layer", "integrity", "layout", "numerics", "rel RMS", "cosine", "max abs", "top-k agree"):
                t.add_column(col)
            if with_kernel:
                for col in ("kernel", "kernel rel RMS (vs bytes / vs ref)"):
                    t.add_column(col)
            for r in rep.layers:
                c = r.comparison
                row = [
                    str(r.layer), r.integrity, r.layout, r.numerics,
                    *(("-",) * 4 if c is None else (f"{c.rel_rms:.3g}", f"{c.cosine:.6f}", f"{c.max_abs:.3g}", f"{c.topk_agreement:.3f}")),
                ]
                if with_kernel:
                    k = r.kernel
                    figs = "-" if k is None or k.vs_converted is None else f"{k.vs_converted.rel_rms:.3g}" + (
                        "" if k.vs_reference is None else f" / {k.vs_reference.rel_rms:.3g}")
                    row += ["-" if k is None else k.status, figs]
                t.add_row(*row)
            out.print(t)
            for n in rep.notes:
                err.print(f"[dim]{n}[/]", highlight=False)
            out.print("[bold green]PASS[/]" if rep.passed else "[bold red]FAIL[/]")
        for p in problems:  # the reasons for a failure: shown with --quiet and --json too
            err.print(f"[red]FAIL[/] {p}", highlight=False, soft_wrap=True)
        if not rep.passed:
            raise typer.Exit(1)


@app.command()
def inspect(
    path: str = typer.Argument(..., metavar="PATH", help=_SOURCE_HELP),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision of a repo-id PATH."),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout."),
    debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks."),
) -> None:
    """What a checkpoint is: family, sizes, formats, bytes, and per-backend padded sizes/overhead.

    Reads headers and the manifest only (no weights). Example:

        mxconv inspect openai/gpt-oss-20b
    """
    from mxconv.checkpoint import open_checkpoint
    from mxconv.inspect_ckpt import inspect_checkpoint

    with _errors(debug):
        root = Path(path)
        if root.is_dir() and (root / "rank-0").is_dir() and (root / "mxconv.json").exists():
            from mxconv.manifest import load_manifest

            ckpt = open_checkpoint(root / "rank-0", revision)  # a TP output: ranks share one manifest
            ckpt.manifest = load_manifest(root)
        else:
            ckpt = open_checkpoint(path, revision)
        doc = inspect_checkpoint(ckpt)
        if as_json:
            _print_json(doc)
            return
        t = Table(title=f"mxconv inspect {doc['path']}", show_header=False)
        t.add_column("key", style="bold")
        t.add_column("value")
        model = doc.get("model") or {}
        t.add_row("family", str(doc.get("family_title") or doc.get("family")))
        t.add_row("kind", doc["kind"] + (f" ({doc['manifest']['backend']}, {doc['manifest']['activation']})" if doc["kind"] == "kernel" else ""))
        for k in ("num_layers", "num_experts", "top_k", "hidden_size", "intermediate_size", "padded_hidden_size",
                  "padded_intermediate_size", "expert_format", "source_expert_format", "row_order", "routing", "activation"):
            if k in model:
                t.add_row(k, str(model[k]))
        if "moe_layers" in doc:
            t.add_row("moe_layers", str(doc["moe_layers"]))
        t.add_row("dtypes", ", ".join(f"{k} x{v}" for k, v in doc["dtypes"].items()))
        t.add_row("tensors / shards", f"{doc['tensors']} / {doc['shards']}")
        t.add_row("bytes: experts", _gb(doc["bytes"]["experts"]))
        t.add_row("bytes: rest", _gb(doc["bytes"]["rest"]))
        out.print(t)
        if doc.get("quant_config"):
            from mxconv.engine_config import EngineQuantConfig

            q = Table(title="engine quant config (fused MoE, per layer L)", show_header=False)
            for key, value in EngineQuantConfig.from_json(doc["quant_config"]).summary_rows():
                q.add_row(key, value)
            out.print(q)
        if doc.get("backends"):
            b = Table(title="per-backend kernel layout (MXFP4 experts)")
            for col in ("backend", "activation", "padded H", "padded I", "expert bytes", "padding overhead", "vLLM 0.33 backends"):
                b.add_column(col)
            for row in doc["backends"]:
                if "error" in row:
                    b.add_row(row["backend"], row["activation"], "-", "-", "-", row["error"], "-")
                else:
                    b.add_row(row["backend"], row["activation"], str(row["padded_hidden_size"]), str(row["padded_intermediate_size"]),
                              _gb(row["expert_bytes"]), f"{100 * row['padding_overhead']:+.1f}%", ", ".join(row["vllm_backends"]) or "-")
            out.print(b)


@app.command()
def demo(
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Where to build the demo checkpoints (default: a temporary directory, removed afterwards)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    as_json: bool = typer.Option(False, "--json", help="JSON results on stdout."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress or table; failed steps are still named."),
    debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks."),
) -> None:
    """Build tiny gpt-oss-style and Qwen-style checkpoints, run quantize -> repack (every backend)
    -> verify, and print one table. Exit 0 only if every step passes."""
    from mxconv.demo import run_demo

    with _errors(debug):
        results = run_demo(workdir, _device(device), progress=lambda msg: (None if as_json or quiet else err.print(f"[dim]{msg}[/]", highlight=False)))
        if as_json:
            _print_json(results)
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
