"""``mxconv repack``: MXFP4 / MXFP8 (or bf16) checkpoint -> the expert tensors one engine backend holds after
its load-time processing. Backends and their typed options come from the layout registry
(:mod:`mxconv.layouts`); nothing here names a backend."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Optional

import typer

from mxconv.cli.common import SOURCE_HELP, Command, OutputArg, RunOptions, app, errors, run_options
from mxconv.cli.conversion import convert
from mxconv.layouts import backend_names
from mxconv.run.options import QuantOptions, RepackOptions, ScaleRounding, WeightFormat



def registered_backend(name: str) -> str:
    """``--backend``'s value checked against the layout registry as it is now, so a backend
    registered after this module was imported is accepted too. ValueError naming the choices."""
    choices = backend_names()
    if name not in choices:
        raise ValueError(f"{name!r} is not one of {', '.join(repr(c) for c in choices)}.")
    return name


# --format's choices: the MX formats a layout can hold (INT4 sources stay INT4 without it)
RepackFmt = Enum("RepackFmt", {str(f): str(f) for f in (WeightFormat.MXFP4, WeightFormat.MXFP8)}, type=str)  # type: ignore[misc]

ACTIVATION_HELP = "The engine's activation format; default: the backend's first that takes the experts' format"


def backend_help() -> str:
    """``--backend``'s help in ``--help``: the registered backends, spaced so that the help wraps
    between names at any width (a metavar ``<a|b|...>`` is one word that overflows 80 columns)."""
    return "Engine backend whose kernel layout to write: " + " | ".join(backend_names()) + "."


def activation_help() -> str:
    """``--activation``'s help in ``--help``: each registered backend's activations."""
    from mxconv.layouts import get_layout

    per_backend = "; ".join(f"{name}: {'|'.join(get_layout(name).activations)}" for name in backend_names())
    return f"{ACTIVATION_HELP} ({per_backend})."


def layout_options(pairs: list[str]) -> dict[str, str]:
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


class _RepackCommand(Command):
    """The repack command, whose --help ends with every backend's options (read from the layouts
    only when help is shown, so plain --help never imports torch)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """The help, --backend and --activation listing the backends registered now."""
        for param in self.params:
            if param.name == "backend":
                param.help = backend_help()
            elif param.name == "activation":
                param.help = activation_help()
        super().format_help(ctx, formatter)

    @property
    def epilog(self) -> str:
        from mxconv.layouts import options_help

        lines = options_help().splitlines()
        return "Backend options (--layout-option NAME=VALUE):\n\n" + "\n\n".join(lines)

    @epilog.setter
    def epilog(self, value: str | None) -> None:  # click assigns it in __init__; ours is computed
        pass


@app.command(cls=_RepackCommand)
@run_options
def repack(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help=SOURCE_HELP + " MXFP4 or MXFP8 (moved, never re-quantized) or bf16 (quantized on the way).")],
    output: OutputArg,
    backend: Annotated[str, typer.Option("--backend", parser=registered_backend, metavar="NAME", help="Engine backend whose kernel layout to write.")],
    activation: Annotated[Optional[str], typer.Option("--activation", metavar="NAME", help=ACTIVATION_HELP + ".")] = None,
    tp: Annotated[int, typer.Option("--tp", metavar="N", min=1, help="Tensor-parallel size: writes OUTPUT/rank-{r}/ per rank.")] = 1,
    layout_option: Annotated[Optional[list[str]], typer.Option("--layout-option", metavar="NAME=VALUE", help="A backend option (repeatable); each backend's options are listed below.")] = None,
    marlin_scale_layout: Annotated[Optional[str], typer.Option("--marlin-scale-layout", metavar="current|legacy", help="Same as --layout-option marlin_scale_layout=VALUE: current (vLLM >= 0.12, the default) | legacy (<= 0.11.2).")] = None,
    triton_layout: Annotated[Optional[str], typer.Option("--triton-layout", metavar="3.5|3.6|3.8", help="Same as --layout-option triton_layout=VALUE: 3.5 (triton_kernels vendored by vLLM 0.12-0.33, the default) | 3.6 (vLLM 0.20) | 3.8 (matmul API; the 3.6 bytes).")] = None,
    format: Annotated[Optional[RepackFmt], typer.Option("--format", help="Expert format in the layout: mxfp4 or mxfp8 (the backend must take it; see the backend table). Default: an MXFP8 or INT4 source keeps its format, anything else becomes mxfp4, or the format the backend takes when it takes no mxfp4 (xpu: mxfp8; the summary says so).")] = None,
    scale_rounding: Annotated[ScaleRounding, typer.Option("--scale-rounding", help="Scale rule when a bf16 SOURCE is quantized on the way (auto = the format's default: even for mxfp4, the least error; see quantize --help).")] = ScaleRounding.AUTO,
    *,
    run: RunOptions,
) -> None:
    """MXFP4 / MXFP8 (or bf16) checkpoint -> kernel-ready expert tensors for one engine backend.

    Writes exactly what vLLM's fused-MoE layer holds after its load-time processing
    (model.layers.L.mlp.experts.w13_weight, ...), padding included, so the engine can skip it.
    A compressed-tensors INT4 source (Kimi-K2-Thinking style) with --backend trtllm gives
    TRT-LLM-gen MxInt4. Every MoE layer is converted (--include/--ignore are quantize options).
    mxconv.json's quant_config says what each tensor is and which vLLM backends hold the bytes
    as they are (Python: mxconv.output.engine_quant_config.quant_config_of). Example:

    \b
        mxconv repack openai/gpt-oss-20b ./gpt-oss-20b-trtllm --backend trtllm
    """
    from mxconv.errors import BadInput, LayoutError
    from mxconv.layouts import get_layout

    with errors(run.debug):
        layout = get_layout(backend)
        given = layout_options(layout_option or [])
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
        fmt = None if format is None else WeightFormat(format.value)
        quant = QuantOptions(fmt or WeightFormat.MXFP4, scale_rounding, run.allow_nonfinite)
        convert(source, output, quant, RepackOptions(backend, activation, tp, opts, weight_format=fmt), run)
