"""``mxconv quantize``: a MoE checkpoint -> canonical MXFP4/MXFP8 checkpoint that loaders read as is."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from mxconv.cli.common import Command, OutputArg, RoundingOpt, RunOptions, SourceArg, app, errors, run_options
from mxconv.cli.conversion import convert
from mxconv.run.options import QUANTIZE_FORMATS, QuantOptions, ScaleRounding, Targets

Fmt = Enum("Fmt", {str(f): str(f) for f in QUANTIZE_FORMATS}, type=str)  # type: ignore[misc] - --format's choices


@app.command(cls=Command)
@run_options
def quantize(
    source: SourceArg,
    output: OutputArg,
    format: Annotated[Fmt, typer.Option("--format", help="Expert weight format.")] = Fmt.mxfp4,
    scale_rounding: RoundingOpt = ScaleRounding.AUTO,
    targets: Annotated[Targets, typer.Option("--targets", help=(
        "experts: routed-expert weights only. linear: every linear layer too (attention, dense MLPs, shared experts), "
        "MXFP8 like vLLM's online MXFP8 method (with --format mxfp8), or block FP8 (with --format fp8-block); embeddings, "
        "lm_head, routers and norms stay."))] = Targets.EXPERTS,
    include: Annotated[Optional[list[str]], typer.Option("--include", metavar="PATTERN", help=(
        "Repeatable. Quantize only matching MoE layers ('<module>.experts' names) and, with --targets linear, linear "
        "modules: a regex found anywhere in the name, or compressed-tensors' 're:REGEX' (matched from the start)."))] = None,
    ignore: Annotated[Optional[list[str]], typer.Option("--ignore", metavar="PATTERN", help=(
        "Repeatable. Leave matching MoE layers and linear modules as they are (same patterns as --include; "
        "config.json lists them as not converted)."))] = None,
    skip_unaligned: Annotated[bool, typer.Option("--skip-unaligned", help=(
        "With --targets linear --format mxfp8: leave a linear whose input size is not a multiple of 32 unquantized "
        "(listed in config.json) instead of refusing."))] = False,
    require_exact: Annotated[bool, typer.Option("--require-exact", help=(
        "With --format fp8-block from MXFP4: exit 2, naming layer, expert and 128x128 block, when a block cannot be "
        "re-encoded exactly (its binade spread exceeds E4M3's) instead of writing it with the least-loss scale."))] = False,
    *,
    run: RunOptions,
) -> None:
    """bf16/fp16/fp32, FP8-block or MXFP4 MoE checkpoint -> canonical MXFP4/MXFP8 or block-FP8 checkpoint.

    gpt-oss is written in the published gpt-oss MXFP4 convention (*_blocks/*_scales); other families
    as compressed-tensors (mxfp4-pack-quantized / mxfp8-quantized). Routed-expert weights are
    quantized (with --targets linear every linear layer, MXFP8 or block FP8); every other tensor is copied byte
    for byte.

    Who reads the output (README, "Which loaders read each output"): MXFP4 of every family loads in
    transformers (gpt-oss through its MXFP4 loader, the others with compressed-tensors installed),
    compressed-tensors, vLLM and mxconv. MXFP8 of the compressed-tensors families: compressed-tensors,
    vLLM and mxconv; transformers 5.24 refuses it (raises). gpt-oss MXFP8 is mxconv's own variant
    (quant_method null, mxconv_quant_method mxfp8): transformers and vLLM refuse it, mxconv reads it.
    fp8-block (E4M3, fp32 weight_scale_inv per 128x128 block, quant_method fp8, the DeepSeek-V3 convention;
    every family but gpt-oss): vLLM's Fp8 MoE method and transformers' fine-grained FP8 load it. From MXFP4
    the blocks get power-of-two scales, exact wherever the block's spread allows (counted otherwise).
    Examples:

    \b
        mxconv quantize Qwen/Qwen3-30B-A3B ./qwen3-mxfp4 --format mxfp4
        mxconv quantize Qwen/Qwen3-30B-A3B ./qwen3-mxfp8 --format mxfp8 \\
            --targets linear
        mxconv quantize ./qwen3-mxfp4 ./qwen3-fp8 --format fp8-block \\
            --require-exact
    """
    with errors(run.debug):
        quant = QuantOptions(format.value, scale_rounding, run.allow_nonfinite, tuple(include or ()) or None,
                             tuple(ignore or ()) or None, targets, skip_unaligned, require_exact)
        convert(source, output, quant, None, run)
