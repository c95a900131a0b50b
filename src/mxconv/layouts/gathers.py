"""The row gathers the backend layouts share: the padding rule as an index (:func:`pad_row_source`),
padding and any row permutation in one gather (:func:`gather_padded_rows`), the index cache, and
the Triton layout kernels where the caller's :class:`~mxconv.experts.kernel_settings.KernelChoice`
allows them (:func:`layout_kernels`). The padding itself is :mod:`mxconv.experts.padding`.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice

if TYPE_CHECKING:
    import torch


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


def extend_rows(tab: torch.Tensor, rows: int) -> torch.Tensor:
    """The row table ``tab`` with padding rows (-1) appended up to ``rows`` entries (a second
    padding after the first, e.g. humming's N after vLLM's intermediate size)."""
    import torch

    if rows < tab.numel():
        raise LayoutError(f"cannot extend a table of {tab.numel()} rows to {rows}")
    return torch.nn.functional.pad(tab, (0, rows - tab.numel()), value=-1)


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
