"""The Marlin scale and row tables that the MXFP4 (:mod:`mxconv.layouts.marlin`) and MXFP8
(:mod:`mxconv.layouts.marlin_mxfp8`) forms share: padding as a row map, the scale byte maps folded
into it, and one scale tensor laid out by the Triton kernel or the torch path (same bytes).

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mxconv.layouts.gathers import cached_index, gather_padded_rows, pad_row_source
from mxconv.layouts.marlin_bytemap import FP8_SCALE_OFFSET, chunk32_perm, marlin_scales, permute_chunks, scale_perm_bf16

if TYPE_CHECKING:
    import torch

__all__ = ["ScaleJob", "kernel_scales", "row_table"]


def _chunk_perm_cpu(chunk: int) -> torch.Tensor:
    return scale_perm_bf16() if chunk == 64 else chunk32_perm()


def row_table(
    rows: int, padded_rows: int, row_order: str | None, chunk: int | None, device: torch.device
) -> torch.Tensor:
    """Source row (unpadded) behind each padded row, -1 = padding (cached, on ``device``). With
    ``chunk`` (64: bf16 scale map, 32: fp8 scale / bias map) the padded rows are first permuted in
    chunks: entry p holds the source of padded row ``chunk*(p//chunk) + perm[p % chunk]``."""

    def build() -> torch.Tensor:
        pad = pad_row_source(rows, padded_rows, row_order)
        if chunk is None:
            return pad
        return permute_chunks(pad[None], _chunk_perm_cpu(chunk))[0]

    return cached_index(("marlin", rows, padded_rows, row_order, chunk), device, build)


@dataclass(frozen=True)
class ScaleJob:
    """One scale tensor to lay out: canonical ``scales`` [E, rows, G] -> kernel [E, cols, padded_rows]
    (``row_order``: the w13 rows' order, None for w2)."""

    name: str
    scales: torch.Tensor
    rows: int
    padded_rows: int
    cols: int
    row_order: str | None


def kernel_scales(lt: Any, job: ScaleJob, activation: str, scale_layout: str) -> torch.Tensor:
    """Unpadded canonical scales [E, rows, G] -> kernel tensor float8_e8m0fnu [E, cols, padded_rows].

    ``lt`` (the Triton kernel module, current/fp8 maps only; it does not range-check fp8 bytes) or
    None: the torch path, which raises LayoutError for fp8 bytes above 249."""
    import torch

    fp8, s = activation == "fp8", job.scales
    if lt is not None:
        tab = row_table(job.rows, job.padded_rows, job.row_order, 32 if fp8 else 64, s.device)
        out = lt.transpose_rows(s, tab, job.cols, FP8_SCALE_OFFSET if fp8 else 0)
    else:
        tab = row_table(job.rows, job.padded_rows, job.row_order, None, s.device)
        out = marlin_scales(gather_padded_rows(s, tab, job.cols, 0), activation, scale_layout, job.name)
    return out.view(torch.float8_e8m0fnu)
