"""The row maps and the scale swizzle of the TRT-LLM-gen layout (docs/layout-trtllm.md steps 1-3 and
C): pure index functions and the cached kernel-row tables :mod:`mxconv.layouts.trtllm` gathers with;
the 128x4 scale swizzle (step C) is FlashInfer's, shared with flashinfer-cutlass: :mod:`mxconv.layouts.scale_swizzle`. The MxInt4 variant (:mod:`mxconv.layouts.trtllm_mxint4`) uses the
same tables.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mxconv.errors import LayoutError
from mxconv.experts.stack import ROW_ORDERS
from mxconv.experts.tensors import KernelTensors, TensorSpec
from mxconv.layouts.gathers import cached_index, pad_row_source
from mxconv.layouts.scale_swizzle import (  # noqa: F401 (step C, re-exported for the trtllm modules)
    SF_TILE_COLS, SF_TILE_ROWS, swizzle_128x4, swizzle_offsets, swizzle_slot_coords, swizzled_scale_size, unswizzle_128x4,
)

if TYPE_CHECKING:
    import torch

BACKEND_NAME = "trtllm"
LAYOUT_VERSION = 1  # of both variants (MXFP4, MxInt4); bump when the bytes written change
EPILOGUE_TILE_M = 128
SHUFFLE_BLOCK_ROWS = 32  # MMA row-shuffle block for epilogue_tile_m = 128


# ---------------------------------------------------------------------------------------------
# Row index functions (pure; LongTensors on ``device``). "src" = gather indices: out[j] = in[src[j]];
# "dst" = the inverse: in[r] = out[dst[r]].
# ---------------------------------------------------------------------------------------------


def _check_rows(num_rows: int, multiple: int, what: str) -> None:
    if num_rows <= 0 or num_rows % multiple:
        raise LayoutError(f"{what}: {num_rows} rows is not a positive multiple of {multiple}")


def mma_shuffle_src(num_rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Step B gather: ``s(j) = 32*(j//32) + 4*(j%8) + (j%32)//8`` for j in [0, num_rows).

    Returns a LongTensor [num_rows]; num_rows must be a multiple of 32.
    """
    import torch

    _check_rows(num_rows, SHUFFLE_BLOCK_ROWS, "MMA row shuffle")
    j = torch.arange(num_rows, dtype=torch.long, device=device)
    return (j // 32) * 32 + (j % 8) * 4 + (j % 32) // 8


def mma_shuffle_dst(num_rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse of :func:`mma_shuffle_src`: ``d(r) = 32*(r//32) + 8*(r%4) + (r%32)//4``. [num_rows] long."""
    import torch

    _check_rows(num_rows, SHUFFLE_BLOCK_ROWS, "MMA row shuffle")
    r = torch.arange(num_rows, dtype=torch.long, device=device)
    return (r // 32) * 32 + (r % 4) * 8 + (r % 32) // 4


def check_row_order(row_order: str) -> None:
    if row_order not in ROW_ORDERS:
        raise LayoutError(f"unknown w13 row order {row_order!r} (expected one of {ROW_ORDERS})")


def gate_up_pair_src(
    padded_intermediate: int, row_order: str, device: torch.device | str | None = None
) -> torch.Tensor:
    """Step A gather P(k), k in [0, 2*Ip): kernel row 2i = up_i, row 2i+1 = gate_i.

    halves (rows [gate; up]): P(k) = Ip + k/2 (k even), (k-1)/2 (k odd).
    interleaved (row 2i = gate_i, 2i+1 = up_i): P(k) = k XOR 1. Returns a LongTensor [2*Ip].
    """
    import torch

    check_row_order(row_order)
    Ip = padded_intermediate
    k = torch.arange(2 * Ip, dtype=torch.long, device=device)
    if row_order == "interleaved":
        return k ^ 1
    return torch.where(k % 2 == 0, Ip + k // 2, k // 2)


def gate_up_pair_dst(
    padded_intermediate: int, row_order: str, device: torch.device | str | None = None
) -> torch.Tensor:
    """Inverse of :func:`gate_up_pair_src`: P^-1(n) = 2n+1 (n < Ip), 2(n-Ip) (n >= Ip) for halves,
    n XOR 1 for interleaved. Returns a LongTensor [2*Ip]."""
    import torch

    check_row_order(row_order)
    Ip = padded_intermediate
    n = torch.arange(2 * Ip, dtype=torch.long, device=device)
    if row_order == "interleaved":
        return n ^ 1
    return torch.where(n < Ip, 2 * n + 1, 2 * (n - Ip))


def w13_row_src(padded_intermediate: int, row_order: str, device: torch.device | str | None = None) -> torch.Tensor:
    """Full w13 gather ``src13(j) = P(s(j))`` into the padded canonical rows. LongTensor [2*Ip]."""
    pair_src = gate_up_pair_src(padded_intermediate, row_order, device)
    return pair_src[mma_shuffle_src(2 * padded_intermediate, device)]


def w13_row_dst(padded_intermediate: int, row_order: str, device: torch.device | str | None = None) -> torch.Tensor:
    """Kernel row of each padded canonical w13 row: ``dst13(n) = d(P^-1(n))``. LongTensor [2*Ip]."""
    pair_dst = gate_up_pair_dst(padded_intermediate, row_order, device)
    return mma_shuffle_dst(2 * padded_intermediate, device)[pair_dst]


def w2_row_src(padded_hidden: int, device: torch.device | str | None = None) -> torch.Tensor:
    """w2 gather (step B only): ``s(j)``, LongTensor [Hp]."""
    return mma_shuffle_src(padded_hidden, device)


def w2_row_dst(padded_hidden: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Kernel row of each padded canonical w2 row: ``d(r)``, LongTensor [Hp]."""
    return mma_shuffle_dst(padded_hidden, device)


def w13_row_table(
    intermediate: int, padded_intermediate: int, row_order: str, device: torch.device | str | None = None
) -> torch.Tensor:
    """Source row of the *unpadded* w13 stack behind each kernel row (padding, step A and step B
    in one map), -1 for padding rows: ``pad_row_source(2I, 2Ip)[src13]``. Cached int32 tensor [2*Ip]."""

    def build() -> torch.Tensor:
        pad = pad_row_source(2 * intermediate, 2 * padded_intermediate, row_order)
        return pad[w13_row_src(padded_intermediate, row_order)]

    return cached_index(("trtllm-w13", intermediate, padded_intermediate, row_order), device, build)


def w2_row_table(hidden: int, padded_hidden: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Source row of the unpadded w2 stack behind each kernel row (-1 = padding). Cached int32 tensor [Hp]."""

    def build() -> torch.Tensor:
        return pad_row_source(hidden, padded_hidden)[w2_row_src(padded_hidden)]

    return cached_index(("trtllm-w2", hidden, padded_hidden), device, build)


def check_kernel_tensors(k: KernelTensors, specs: dict[str, TensorSpec]) -> None:
    """LayoutError unless ``k`` holds exactly the tensors of ``specs`` with those shapes/dtypes, on one device."""
    missing = [name for name in specs if name not in k]
    if missing:
        raise LayoutError(f"trtllm kernel tensors missing: {', '.join(missing)}")
    unexpected = [name for name in k if name not in specs]
    if unexpected:
        raise LayoutError(f"unexpected trtllm kernel tensors: {', '.join(unexpected)}")
    for name, spec in specs.items():
        t = k[name]
        if tuple(t.shape) != spec.shape:
            raise LayoutError(f"trtllm kernel tensor {name} has shape {tuple(t.shape)}, expected {spec.shape}")
        if t.dtype != spec.dtype:
            raise LayoutError(f"trtllm kernel tensor {name} has dtype {t.dtype}, expected {spec.dtype}")
    devices = {str(t.device) for t in k.values()}
    if len(devices) > 1:
        raise LayoutError(f"trtllm kernel tensors are on different devices: {sorted(devices)}")
