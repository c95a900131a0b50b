"""``mxconv verify``: integrity, layout and numerics of a converted checkpoint (and, with ``--kernel``,
the engine's own kernel on the files)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from mxconv.errors import BadInput
from mxconv.cli.common import Command, DebugOpt, DeviceOpt, JsonOpt, QuietOpt, app, device_of, errors, print_json
from mxconv.cli.output import err, out, say, step_progress
from mxconv.experts.kernel_settings import KernelLocations

KERNEL_HELP = (
    "Also run the engine's own kernel on the files (--backend {runners}; the runner's GPU) and compare it with the reference runner. Exit 2 "
    "naming what is missing where it cannot run. Kernels are found via --triton-kernels / --marlin-ops, else "
    "MXCONV_TRITON_KERNELS / MXCONV_MARLIN_OPS, else in an installed triton_kernels or vLLM."
)
TritonKernelsOpt = Annotated[Optional[Path], typer.Option("--triton-kernels", metavar="DIR", help=(
    "With --kernel: the folder that contains triton_kernels/ (e.g. extracted from the vLLM 0.33 wheel); "
    "overrides MXCONV_TRITON_KERNELS and an installed copy."))]
MarlinOpsOpt = Annotated[Optional[Path], typer.Option("--marlin-ops", metavar="FILE", help=(
    "With --kernel: vLLM's compiled MoE ops library (_moe_C_stable_libtorch.abi3.so from the vLLM 0.33 wheel); "
    "overrides MXCONV_MARLIN_OPS and an installed vLLM."))]


class _VerifyCommand(Command):
    """The verify command, whose --kernel help names the backends with an engine runner now (read
    from the layouts, which import no torch, only when help is shown)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        from mxconv.engines.runner import runner_backends

        for param in self.params:
            if param.name == "kernel":
                param.help = KERNEL_HELP.format(runners=" or ".join(runner_backends()))
        super().format_help(ctx, formatter)


@app.command(cls=_VerifyCommand)
def verify(
    path: Annotated[Path, typer.Argument(metavar="PATH", help="A checkpoint written by mxconv quantize or repack.")],
    reference: Annotated[Optional[str], typer.Option("--reference", metavar="SOURCE", help="The checkpoint the conversion came from (bf16 or MXFP4).")] = None,
    reference_outputs: Annotated[Optional[Path], typer.Option("--reference-outputs", metavar="FILE", exists=True, dir_okay=False, help="Compare with outputs saved earlier by --save-reference.")] = None,
    save_reference: Annotated[Optional[Path], typer.Option("--save-reference", metavar="FILE", help="Save the reference's outputs (safetensors) for later runs without the source.")] = None,
    layers: Annotated[Optional[str], typer.Option("--layers", metavar="L,L", help="MoE layers to check, e.g. 0,3 (default: all).")] = None,
    tokens: Annotated[int, typer.Option("--tokens", metavar="N", min=1, help="Synthetic tokens per layer.")] = 64,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Seed of the synthetic hidden states.")] = 0,
    revision: Annotated[Optional[str], typer.Option("--revision", metavar="REV", help="Hub revision of a repo-id --reference.")] = None,
    kernel: Annotated[bool, typer.Option("--kernel", help=(
        KERNEL_HELP.format(runners="with an engine runner")))] = False,
    triton_kernels: TritonKernelsOpt = None,
    marlin_ops: MarlinOpsOpt = None,
    strict: Annotated[bool, typer.Option("--strict", help=(
        "Fail (exit 1) unless numerics were checked too: without --reference or --reference-outputs a PASS "
        "covers integrity and layout only (the verdict line says so), which --strict does not accept; with "
        "--reference, also unless the expert bytes were re-derived from it."))] = False,
    device: DeviceOpt = "auto",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check a converted checkpoint: integrity (sha256, manifest claims), layout (inverse + padding),
    and with --reference its bytes (the reference converted again, copied tensors byte for byte) and
    numerics.

    The verdict line says what it covers, e.g. "PASS (integrity, layout, bytes and numerics vs SRC)",
    "PASS (integrity, layout; numerics not checked: no --reference or --reference-outputs given)";
    --strict fails the latter. Exit 0 when every check
    passes; 1 when one fails, or when PATH's own files are damaged or disagree (manifest, index,
    shards: named by file, tensor and rule); 2 on bad usage, a PATH that is no mxconv output, or a
    --reference / --reference-outputs that cannot be read. Example:

    \b
        mxconv verify ./gpt-oss-20b-trtllm --reference openai/gpt-oss-20b
    """
    with errors(debug):
        locations = _kernel_locations(kernel, triton_kernels, marlin_ops)  # the flags first, then the paths
        _check_paths(path, reference)  # before torch is imported: a typo is answered at once
        from mxconv.verify import VerifyOptions, verify as run_verify

        with step_progress(f"verify {path}", quiet or as_json) as on_step:
            options = VerifyOptions(
                reference=reference,
                reference_outputs=str(reference_outputs) if reference_outputs else None,
                save_reference=str(save_reference) if save_reference else None,
                layers=layers,
                tokens=tokens,
                seed=seed,
                revision=revision,
                kernel=kernel,
                kernel_locations=locations,
                strict=strict,
                device=device_of(device),
            )
            rep = run_verify(path, options, on_step)
        _show(rep, as_json, quiet)
        if not rep.passed:
            raise typer.Exit(1)


def _show(rep: Any, as_json: bool, quiet: bool) -> None:
    """The report: JSON, or the layer tables, notes and verdict; the FAIL lines (and a byte check that
    was skipped) under --quiet too."""
    problems = rep.problems + [p for r in rep.layers for p in r.problems] + [p for r in rep.linears for p in r.problems]
    if as_json:
        print_json(rep.to_json())
    elif not quiet and rep.layers:
        out.print(_layer_table(rep))
        if rep.linears:
            from mxconv.verify.linears import role_summary

            lt = Table(title="MXFP8 linear layers")
            for col in ("role", "linears", "passed", "max rel RMS", "bit-exact bytes"):
                lt.add_column(col)
            for row in role_summary(rep.linears):
                worst = "-" if row["max_rel_rms"] is None else f"{row['max_rel_rms']:.3g}"
                lt.add_row(row["role"], str(row["linears"]), str(row["linears"] - row["failed"]), worst, str(row["bit_exact"]))
            out.print(lt)
        for n in rep.notes:
            say(err, n, "dim")
        _say_verdict(rep)
    elif not quiet:  # PATH's files do not read as a checkpoint: no layer was checked, no table
        _say_verdict(rep)
    elif "bytes" in rep.scope.not_checked:  # --quiet: a reference was given, its bytes not compared: said still
        say(err, "note:", "yellow", f"expert bytes not re-derived: {rep.scope.not_checked['bytes']}")
    for p in problems:  # the reasons for a failure: shown with --quiet and --json too
        say(err, "FAIL", "red", p)


def _say_verdict(rep) -> None:
    """The last line on stdout: PASS or FAIL, then what the run covered (rep.scope)."""
    verdict, scope = rep.verdict.split(" ", 1)
    say(out, verdict, "bold green" if rep.passed else "bold red", scope)


def _check_paths(path: Path, reference: str | None) -> None:
    """PATH is a complete mxconv output and --reference a directory or a repo id: BadInput otherwise,
    from the headers-free checks the library runs later (no torch, nothing read or fetched)."""
    from mxconv.source.checkpoint import check_source_name
    from mxconv.source.manifest import complete_output_dir

    complete_output_dir(path)
    if reference is not None:
        check_source_name(reference)


def _kernel_locations(kernel: bool, triton_kernels: Path | None, marlin_ops: Path | None) -> KernelLocations:
    """``--triton-kernels`` / ``--marlin-ops`` as :class:`KernelLocations`; BadInput (exit 2) when
    either is given without ``--kernel``."""
    if (triton_kernels or marlin_ops) and not kernel:
        raise BadInput("--triton-kernels / --marlin-ops name the engine kernels for --kernel; add --kernel")
    return KernelLocations(triton_kernels=triton_kernels, marlin_ops=marlin_ops)


def _layer_table(rep: Any) -> Table:
    """One row per checked layer: integrity, layout, numerics and, with --kernel, the kernel's figures."""
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
    return t
