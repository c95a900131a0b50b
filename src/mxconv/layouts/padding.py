"""Padding, the shared row gathers and tensor-parallel slicing of a canonical expert stack
(:mod:`mxconv.layouts.canonical`), used by every backend layout.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable

from mxconv.errors import LayoutError
from mxconv.layouts.canonical import CanonicalExperts

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------------------------
# Padding shared by all backends: vLLM allocates zeroed params at padded sizes and copies the
# checkpoint into the leading corner; for the halves order each half is padded on its own.
# ---------------------------------------------------------------------------------------------


def _pad_rows(t: torch.Tensor, rows: int, row_order: str, fill: int | float) -> torch.Tensor:
    """Pad dim 1 of a w13-like tensor [E, 2I, ...] to [E, 2*Ip, ...] following ``row_order``."""
    import torch

    E, n = t.shape[0], t.shape[1]
    I, Ip = n // 2, rows // 2
    if n == rows:
        return t
    out = torch.full((E, rows, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    if row_order == "halves":
        out[:, :I] = t[:, :I]
        out[:, Ip : Ip + I] = t[:, I:]
    else:
        out[:, :n] = t
    return out


def pad_last(t: torch.Tensor, cols: int, fill: int | float) -> torch.Tensor:
    """Pad the last axis of ``t`` to ``cols`` with ``fill`` (``t`` itself when already that wide)."""
    import torch

    if t.shape[-1] == cols:
        return t
    out = torch.full((*t.shape[:-1], cols), fill, dtype=t.dtype, device=t.device)
    out[..., : t.shape[-1]] = t
    return out


def _pad_dim1(t: torch.Tensor, rows: int, fill: int | float) -> torch.Tensor:
    import torch

    if t.shape[1] == rows:
        return t
    out = torch.full((t.shape[0], rows, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    out[:, : t.shape[1]] = t
    return out


def pad_canonical(c: CanonicalExperts, Hp: int, Ip: int, scale_fill: int = 0) -> CanonicalExperts:
    """Pad a canonical stack to (Hp, Ip): zero weights, ``scale_fill`` scales, zero biases.

    w13 rows follow the row order (interleaved: new pairs appended; halves: each half padded),
    columns (the K axis) are padded at the end; w2 rows padded at the end.
    """
    H, I, vpb = c.hidden_size, c.intermediate_size, c.values_per_byte
    if Hp < H or Ip < I:
        raise LayoutError(f"padded sizes ({Hp}, {Ip}) smaller than ({H}, {I})")
    w13 = pad_last(_pad_rows(c.w13, 2 * Ip, c.row_order, 0), Hp // vpb, 0)
    s13 = pad_last(_pad_rows(c.w13_scale, 2 * Ip, c.row_order, scale_fill), Hp // 32, scale_fill)
    w2 = pad_last(_pad_dim1(c.w2, Hp, 0), Ip // vpb, 0)
    s2 = pad_last(_pad_dim1(c.w2_scale, Hp, scale_fill), Ip // 32, scale_fill)
    b13 = None if c.w13_bias is None else _pad_rows(c.w13_bias, 2 * Ip, c.row_order, 0)
    b2 = None if c.w2_bias is None else _pad_dim1(c.w2_bias, Hp, 0)
    return CanonicalExperts(w13, s13, w2, s2, b13, b2, c.row_order, c.weight_format, c.input_scales)


def pad_row_source(rows: int, padded_rows: int, row_order: str | None = None) -> torch.Tensor:
    """Row of the unpadded tensor that each row of its padded version holds (pad_canonical's rule),
    -1 for padding rows. CPU LongTensor [padded_rows].

    ``row_order="halves"`` (w13 and its scales/bias: rows = 2I, padded_rows = 2Ip): each half padded
    on its own; otherwise rows are appended at the end (interleaved w13, w2).
    """
    import torch

    if padded_rows < rows:
        raise LayoutError(f"padded row count {padded_rows} smaller than {rows}")
    p = torch.arange(padded_rows, dtype=torch.long)
    if row_order == "halves" and padded_rows != rows:
        if rows % 2 or padded_rows % 2:
            raise LayoutError(f"halves row order needs even row counts, got {rows} -> {padded_rows}")
        half, padded_half = rows // 2, padded_rows // 2
        upper = p >= padded_half
        local = torch.where(upper, p - padded_half, p)
        src = local + torch.where(upper, half, 0)
        return torch.where(local < half, src, -1)
    return torch.where(p < rows, p, -1)


class KernelChoice(Enum):
    """Which code lays out the kernel tensors in ``Layout.to_kernel``; the bytes are the same either way."""

    AUTO = "auto"  # the Triton layout kernels for CUDA tensors where triton imports, torch ops otherwise
    TORCH = "torch"  # torch ops everywhere (benchmarks, bisecting a layout bug)


def layout_kernels(t: torch.Tensor, choice: KernelChoice) -> Any:
    """The Triton layout-kernel module (``mxconv.kernels.trtllm_aiter``) when ``choice`` is AUTO, ``t``
    is a CUDA tensor and triton imports, else None (use the torch path). Imports triton lazily."""
    if choice is KernelChoice.TORCH or not t.is_cuda:
        return None
    from mxconv.kernels import trtllm_aiter
    from mxconv.kernels.triton_common import layout_kernels_enabled

    return trtllm_aiter if layout_kernels_enabled(t) else None


_INDEX_CACHE: dict[tuple[Any, ...], torch.Tensor] = {}
_INDEX_CACHE_MAX = 256


def cached_index(key: tuple[Any, ...], device: torch.device | str | None, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``build()`` (an index tensor, any device) as int32 on ``device``, computed once per (key, device).

    int32 is what the Triton kernels read and what ``index_select`` accepts. The returned tensor is
    shared between callers: never modify it in place.
    """
    import torch

    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    full_key = (*key, str(dev))
    hit = _INDEX_CACHE.get(full_key)
    if hit is None:
        if len(_INDEX_CACHE) >= _INDEX_CACHE_MAX:
            _INDEX_CACHE.clear()
        hit = build().to(device=dev, dtype=torch.int32).contiguous()
        _INDEX_CACHE[full_key] = hit
    return hit


def _word_dtype(nbytes: int) -> torch.dtype:
    import torch

    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if nbytes % size == 0:
            return dtype
    return torch.uint8


def gather_padded_rows(t: torch.Tensor, tab: torch.Tensor, cols: int | None = None, fill: int | float = 0) -> torch.Tensor:
    """Rows of ``t`` [E, R, *rest] picked by ``tab`` (int32/int64 [R_out] on t's device, -1 =
    a row of ``fill``), last dim padded to ``cols`` with ``fill``: the padding of
    :func:`pad_canonical` and any row permutation in one gather. Returns [E, R_out, *rest'].
    """
    import torch

    E, R = t.shape[0], t.shape[1]
    rest = tuple(t.shape[2:])
    out_rest = rest if cols is None or not rest else (*rest[:-1], cols)
    ext = torch.empty((E, R + 1, *out_rest), dtype=t.dtype, device=t.device)
    if rest and out_rest[-1] != rest[-1]:
        ext[:, :R, ..., : rest[-1]] = t
        ext[:, :R, ..., rest[-1] :] = fill
    else:
        ext[:, :R] = t
    ext[:, R] = fill
    idx = torch.where(tab < 0, R, tab)
    row_bytes = math.prod(out_rest) * t.element_size()
    if rest and t.dtype == torch.uint8 and ext.is_contiguous():
        word = _word_dtype(row_bytes)
        wide = ext.view(E, R + 1, row_bytes).view(word)
        return wide.index_select(1, idx).view(torch.uint8).view(E, int(idx.numel()), *out_rest)
    return ext.index_select(1, idx)


def check_fill(name: str, region: torch.Tensor, fill: int | float, offset: tuple[int, ...]) -> None:
    """Raise LayoutError naming the first element of ``region`` that is not ``fill``."""
    if region.numel() == 0:
        return
    bad = region != fill
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0].tolist()]
        where = tuple(o + i for o, i in zip(offset, idx))
        raise LayoutError(
            f"padding of {name} at index {list(where)} holds {region[tuple(idx)].item()!r}, expected {fill!r}"
        )


def unpad_canonical(
    c: CanonicalExperts, H: int, I: int, scale_fill: int | None = 0, check: bool = True
) -> CanonicalExperts:
    """Inverse of :func:`pad_canonical`: crop to (H, I), checking every padding region holds its fill.

    ``scale_fill=None`` skips the scale-padding check (bytes the engine leaves undefined).
    """
    import torch

    Ip, vpb = c.intermediate_size, c.values_per_byte
    halves = c.row_order == "halves"

    def rows13(t: torch.Tensor) -> torch.Tensor:
        if halves:
            return torch.cat([t[:, :I], t[:, Ip : Ip + I]], dim=1)
        return t[:, : 2 * I]

    if check:
        pads13 = [(I, Ip), (Ip + I, 2 * Ip)] if halves else [(2 * I, 2 * Ip)]
        checks: list[tuple[str, torch.Tensor, int | float | None, int]] = [
            ("w13_weight", c.w13, 0, H // vpb),
            ("w13_weight_scale", c.w13_scale, scale_fill, H // 32),
        ]
        for name, t, fill, kcols in checks:
            if fill is None:
                continue
            for lo, hi in pads13:
                check_fill(name, t[:, lo:hi], fill, (0, lo, 0))
            check_fill(name, t[..., kcols:], fill, (0, 0, kcols))
        for name, t, fill, kcols in (("w2_weight", c.w2, 0, I // vpb), ("w2_weight_scale", c.w2_scale, scale_fill, I // 32)):
            if fill is None:
                continue
            check_fill(name, t[:, H:], fill, (0, H, 0))
            check_fill(name, t[..., kcols:], fill, (0, 0, kcols))
        if c.w13_bias is not None:
            for lo, hi in pads13:
                check_fill("w13_bias", c.w13_bias[:, lo:hi], 0, (0, lo))
        if c.w2_bias is not None:
            check_fill("w2_bias", c.w2_bias[:, H:], 0, (0, H))
    return CanonicalExperts(
        w13=rows13(c.w13)[..., : H // vpb].contiguous(),
        w13_scale=rows13(c.w13_scale)[..., : H // 32].contiguous(),
        w2=c.w2[:, :H, : I // vpb].contiguous(),
        w2_scale=c.w2_scale[:, :H, : I // 32].contiguous(),
        w13_bias=None if c.w13_bias is None else rows13(c.w13_bias).contiguous(),
        w2_bias=None if c.w2_bias is None else c.w2_bias[:, :H].contiguous(),
        row_order=c.row_order,
        weight_format=c.weight_format,
        input_scales=c.input_scales,
    )


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: the intermediate axis is split in whole 32-element blocks (vLLM's loader).
# ---------------------------------------------------------------------------------------------


def tp_ranges(intermediate_size: int, tp: int) -> list[tuple[int, int]]:
    """[start, end) of the intermediate axis for each rank: per_rank = ceil((I/32)/tp)*32."""
    if tp < 1:
        raise LayoutError(f"--tp must be >= 1, got {tp}")
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
            f"--tp {tp} leaves a rank with no intermediate channels (I = {intermediate_size}, "
            f"split in blocks of 32): use a smaller --tp"
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
