"""What every layout Triton kernel module shares: triton imported optionally, whether the kernels
can run on a tensor, the launch shapes of the layout kernels, and the checks and views the
launchers use (:mod:`mxconv.kernels.trtllm_aiter`,
:mod:`mxconv.kernels.marlin_triton`, :mod:`mxconv.kernels.triton_swizzle`)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from mxconv.environment import triton_interpreter_on
from mxconv.kernels.triton_import import TRITON_IMPORT_ERROR, tl, triton

# Launch shapes per kernel (block sizes are powers of two), picked by a sweep on an H100 (byte_tiles: an H200) at
# gpt-oss-120b sizes (E=128, H=I=2880).
KERNEL_CONFIG: dict[str, dict[str, int]] = {
    "gather_rows": {"BR": 32, "BW": 128, "num_warps": 8},
    "swizzle_128x4": {"BG": 8, "num_warps": 4},
    "marlin_bf16": {"BK": 64, "num_warps": 8},
    "marlin_fp8": {"BK": 16, "num_warps": 4},
    "transpose_rows": {"BN": 128, "BG": 16, "num_warps": 4},
    "w16_tiles": {"BC": 32, "num_warps": 4},
    "s32x8_tiles": {"BT": 8, "num_warps": 4},
    "transposed_copy": {"BR": 64, "BC": 64, "num_warps": 4},
    "byte_tiles": {"BK": 16, "num_warps": 8},  # H200 sweep, 128x5760x2880: 95-97 % of copy (docs/benchmarks.md)
    "nibble_tiles": {"BK": 32, "num_warps": 4},  # H200 sweep, 128x5760x1440 packed: 89 % of copy
}


if triton is not None:

    @triton.jit
    def load_rows(src, e, s_e, s_r, s, c, C_in, other):
        """Tile ``src[e, s, c]`` ([len(s), len(c)]): ``other`` where the source row ``s`` is -1
        (padding) or ``c >= C_in``."""
        m = (s >= 0)[:, None] & (c < C_in)[None, :]
        return tl.load(src + e * s_e + s[:, None] * s_r + c[None, :], mask=m, other=other)

    @triton.jit
    def _transposed_copy_kernel(src, dst, R, C, s_e, s_c, BR: tl.constexpr, BC: tl.constexpr):
        """dst[e] (contiguous [R, C]) = src[e], whose rows are its contiguous dim (strides (s_e, 1,
        s_c)): a [BR, BC] tile read along r, written along c (the compiler exchanges it)."""
        e = tl.program_id(2).to(tl.int64)
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        m = (r < R)[:, None] & (c < C)[None, :]
        x = tl.load(src + e * s_e + r[:, None] + c[None, :].to(tl.int64) * s_c, mask=m)
        tl.store(dst + e * R * C + r[:, None] * C + c[None, :], x, mask=m)


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    return TRITON_IMPORT_ERROR is None


def layout_kernels_enabled(t: torch.Tensor) -> bool:
    """True when ``t`` is a CUDA tensor and triton imports (the layouts' dispatch,
    :func:`mxconv.layouts.gathers.layout_kernels`, also honours the caller's ``KernelChoice``)."""
    return t.is_cuda and _triton_importable()


def _check_runnable(t: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(f"triton is not importable: {TRITON_IMPORT_ERROR}")
    if not t.is_cuda and not triton_interpreter_on():
        raise RuntimeError("the layout kernels need CUDA tensors (or TRITON_INTERPRET=1 for testing)")


def kernel_dims(src: torch.Tensor, tab: torch.Tensor) -> tuple[int, int, int]:
    """(experts, last dim of ``src`` [E, R_in, W_in], rows of the row table ``tab``), once the
    kernels can run on ``src`` (:func:`_check_runnable`)."""
    _check_runnable(src)
    E, _, width = src.shape
    return E, width, int(tab.numel())


def as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (uint8, last dim contiguous) viewed as ``dtype`` words; copies only when misaligned."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(dtype)
    except RuntimeError:  # storage offset or a row stride not a whole number of words
        return t.contiguous().clone().view(dtype)


def _device_ctx(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dim contiguous (a copy only where it is not). A stack [E, R, C] whose
    dim R is the contiguous one (a transposed view, e.g. gpt-oss' ``gate_up_proj`` [E, H, 2I] seen
    as [E, 2I, H]) is copied by a Triton tile transpose where the kernels can run: on an H200, w13
    of gpt-oss-120b in 2.12 ms (94 % of copy) against 15.2 ms for torch's copy (docs/benchmarks.md)."""
    if t.stride(-1) == 1:
        return t
    if t.dim() == 3 and t.stride(-2) == 1 and t.numel() and triton is not None and (t.is_cuda or triton_interpreter_on()):
        return transposed_copy(t)
    return t.contiguous()


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()`` for a 3-d ``t`` whose dim 1 has stride 1 (any dtype), by one Triton launch."""
    E, R, C = t.shape
    out = torch.empty((E, R, C), dtype=t.dtype, device=t.device)
    cfg = KERNEL_CONFIG["transposed_copy"]
    grid = (-(-R // cfg["BR"]), -(-C // cfg["BC"]), E)
    launch(_transposed_copy_kernel, grid, t, t, out, R, C, t.stride(0), t.stride(2), **cfg)
    return out


def launch(kernel: Any, grid: tuple[int, ...], on: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` on the device of ``on``."""
    with _device_ctx(on):
        kernel[grid](*args, **kwargs)


def row_table(tab: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The row table ``tab`` as contiguous int32 on ``device`` (a copy only where it is not)."""
    if tab.dtype != torch.int32 or tab.device != device:
        tab = tab.to(device=device, dtype=torch.int32)
    return tab.contiguous()


def gather_operands(
    src: torch.Tensor, tab: torch.Tensor, out_shape: tuple[int, ...], dtype: torch.dtype = torch.uint8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every layout launcher starts with: ``(out, src, tab)`` with ``out`` a new uninitialised
    ``dtype`` tensor of ``out_shape`` on ``src``'s device. When ``out`` is empty there is nothing to
    launch and ``src``, ``tab`` come back as given; otherwise ``src`` has its last dim contiguous
    (:func:`rows_contiguous`) and ``tab`` is the kernels' int32 row table (:func:`row_table`)."""
    out = torch.empty(out_shape, dtype=dtype, device=src.device)
    if out.numel() == 0:
        return out, src, tab
    return out, rows_contiguous(src), row_table(tab, src.device)


# (load_rows, defined only when triton imports, is left out)
__all__ = ["KERNEL_CONFIG", "as_words", "gather_operands", "kernel_dims", "launch", "layout_kernels_enabled", "row_table", "rows_contiguous",
           "transposed_copy"]
