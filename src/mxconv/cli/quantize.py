"""``mxconv quantize``: a MoE checkpoint -> canonical MXFP4/MXFP8 checkpoint that loaders read as is."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from mxconv.cli.common import (
    DebugOpt, DeviceOpt, DryRunOpt, JsonOpt, MaxShardOpt, NonfiniteOpt, OutputArg, OverwriteOpt, QuietOpt,
    RevisionOpt, Rounding, RoundingOpt, SourceArg, app, errors, run_convert,
)


class Fmt(str, Enum):
    mxfp4 = "mxfp4"
    mxfp8 = "mxfp8"


@app.command()
def quantize(
    source: SourceArg,
    output: OutputArg,
    format: Annotated[Fmt, typer.Option("--format", help="Expert weight format.")] = Fmt.mxfp4,
    scale_rounding: RoundingOpt = Rounding.auto,
    include: Annotated[Optional[str], typer.Option("--include", metavar="REGEX", help="Regex over '<module>.experts' names: quantize only matching MoE layers.")] = None,
    ignore: Annotated[Optional[str], typer.Option("--ignore", metavar="REGEX", help="Regex over '<module>.experts' names: leave matching MoE layers as they are (config.json lists them as not converted).")] = None,
    allow_nonfinite: NonfiniteOpt = False,
    device: DeviceOpt = "auto",
    revision: RevisionOpt = None,
    max_shard_size: MaxShardOpt = "5GB",
    overwrite: OverwriteOpt = False,
    dry_run: DryRunOpt = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """bf16/fp16/fp32, FP8-block or MXFP4 MoE checkpoint -> canonical MXFP4/MXFP8 checkpoint.

    gpt-oss is written in the published gpt-oss MXFP4 convention (*_blocks/*_scales); other families
    as compressed-tensors (mxfp4-pack-quantized / mxfp8-quantized). Only routed-expert weights are
    quantized; every other tensor is copied byte for byte. Example:

        mxconv quantize Qwen/Qwen3-30B-A3B ./qwen3-mxfp4 --format mxfp4
    """
    from mxconv.plan import QuantOptions

    with errors(debug):
        q = QuantOptions(format.value, scale_rounding.value, allow_nonfinite, include, ignore)
        run_convert("quantize", source, output, quant=q, repack=None, device=device, revision=revision,
                    max_shard_size=max_shard_size, overwrite=overwrite, dry_run=dry_run, as_json=as_json, quiet=quiet)
