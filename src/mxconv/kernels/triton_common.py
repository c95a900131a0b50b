"""What every layout Triton kernel module shares: triton imported optionally, the switch that turns
the kernels off (``MXCONV_LAYOUT_TRITON=0``), the launch shapes of the layout kernels, and the
checks and views the launchers use (:mod:`mxconv.kernels.layout_triton`,
:mod:`mxconv.kernels.marlin_triton`, :mod:`mxconv.kernels.triton_swizzle`)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

try:  # triton is optional at import time (CPU-only installs, macOS)
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = exc

ENV_SWITCH = "MXCONV_LAYOUT_TRITON"

# Launch shapes per kernel (block sizes are powers of two), picked by a sweep on an H100 at
# gpt-oss-120b sizes (E=128, H=I=2880).
KERNEL_CONFIG: dict[str, dict[str, int]] = {
    "gather_rows": {"BR": 32, "BW": 128, "num_warps": 8},
    "swizzle_128x4": {"BG": 8, "num_warps": 4},
    "marlin_bf16": {"BK": 64, "num_warps": 8},
    "marlin_fp8": {"BK": 16, "num_warps": 4},
    "transpose_rows": {"BN": 128, "BG": 16, "num_warps": 4},
    "w16_tiles": {"BC": 32, "num_warps": 4},
    "s32x8_tiles": {"BT": 8, "num_warps": 4},
}


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    return _TRITON_IMPORT_ERROR is None


def layout_kernels_enabled(t: torch.Tensor) -> bool:
    """True when ``t`` is a CUDA tensor, triton imports, and ``MXCONV_LAYOUT_TRITON`` is not "0"."""
    if not t.is_cuda or not _triton_importable():
        return False
    return os.environ.get(ENV_SWITCH, "1").strip() not in ("0", "false", "no", "off")


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_runnable(t: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(f"triton is not importable: {_TRITON_IMPORT_ERROR}")
    if not t.is_cuda and not _interpreter_on():
        raise RuntimeError("the layout kernels need CUDA tensors (or TRITON_INTERPRET=1 for testing)")


def _words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (uint8, last dim contiguous) viewed as ``dtype`` words; copies only when misaligned."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(dtype)
    except RuntimeError:  # storage offset or a row stride not a whole number of words
        return t.contiguous().clone().view(dtype)


def _device_ctx(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _table(tab: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tab.dtype != torch.int32 or tab.device != device:
        tab = tab.to(device=device, dtype=torch.int32)
    return tab.contiguous()
