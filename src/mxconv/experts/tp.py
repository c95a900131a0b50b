"""Tensor parallelism over a canonical expert stack: the intermediate axis split in whole 32-element
blocks as vLLM's loader splits it (:func:`tp_ranges`), and each rank's share of a stack
(:func:`tp_share`, :func:`slice_tp`). The plan, the conversion, verify and the refit of a served
model use the one split.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.errors import LayoutError
from mxconv.experts.padding import pad_canonical
from mxconv.experts.stack import CanonicalExperts

if TYPE_CHECKING:
    import torch


def tp_ranges(intermediate_size: int, tp: int) -> list[tuple[int, int]]:
    """[start, end) of the intermediate axis for each rank: per_rank = ceil((I/32)/tp)*32."""
    if tp < 1:
        raise LayoutError(f"RepackOptions.tp must be >= 1, got {tp}")
    if intermediate_size % 32:
        raise LayoutError(f"intermediate size {intermediate_size} is not a multiple of 32")
    per_rank = -(-(intermediate_size // 32) // tp) * 32
    ranges = []
    for r in range(tp):
        start = min(r * per_rank, intermediate_size)
        end = min((r + 1) * per_rank, intermediate_size)
        ranges.append((start, end))
    if any(e <= s for s, e in ranges):
        raise LayoutError(
            f"RepackOptions.tp {tp} leaves a rank with no intermediate channels (I = {intermediate_size}, "
            f"split in blocks of 32): set a smaller RepackOptions.tp"
        )
    return ranges


def tp_share(t: dict[str, Any], row_order: str, start: int, end: int, rank: int) -> dict[str, Any]:
    """Rank's share of one layer's canonical expert tensors by name: intermediate channels [start, end).

    w13 rows (``w13``, ``w13_scale``, ``w13_bias``): interleaved -> [2*start, 2*end); halves ->
    gate[start:end] ++ up[start:end]. w2 columns (``w2``): [start/v, end/v), v values per element (2
    for 4-bit bytes, 1 for MXFP8 bytes and floats: I over its width); ``w2_scale`` columns
    [start/32, end/32). ``w2_bias``: rank 0 only, zero on the others (the engine sums rank outputs).
    Floats and MX bytes alike: quantization blocks run along K in 32s and the ranges are multiples of
    32, so the share of float experts quantizes to the share of the quantized ones.
    """
    import torch

    I = t["w13"].shape[1] // 2
    if row_order == "interleaved":

        def rows(x: torch.Tensor) -> torch.Tensor:
            return x[:, 2 * start : 2 * end]

    else:

        def rows(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[:, start:end], x[:, I + start : I + end]], dim=1)

    per = I // t["w2"].shape[-1]
    cols = {"w2": (start // per, end // per), "w2_scale": (start // 32, end // 32)}
    out = {}
    for key, x in t.items():
        if x is None:
            out[key] = None
        elif key in cols:
            out[key] = x[..., cols[key][0] : cols[key][1]].contiguous()
        elif key == "w2_bias":
            out[key] = (x if rank == 0 else torch.zeros_like(x)).contiguous()
        else:
            out[key] = rows(x).contiguous()
    return out


def slice_tp(c: CanonicalExperts, start: int, end: int, rank: int, pad_to: int | None = None) -> CanonicalExperts:
    """Rank's share of a canonical stack: intermediate channels [start, end) (:func:`tp_share`).
    ``pad_to``: zero-pad a narrower last rank to this intermediate width (the widest rank's), so
    every rank's kernel tensors have one shape; the bytes equal padding straight to the layout's Ip.
    """
    names = ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias")
    share = tp_share({k: getattr(c, k) for k in names}, c.row_order, start, end, rank)
    part = CanonicalExperts(**share, row_order=c.row_order, weight_format=c.weight_format, input_scales=c.input_scales)
    if pad_to is not None and pad_to > end - start:
        part = pad_canonical(part, part.hidden_size, pad_to)
    return part
