"""The caller's kernel settings that pass down through the layers: which code lays out the kernel
tensors (:class:`KernelChoice`: ``RepackOptions(kernel_choice=...)``, a layout's ``to_kernel``) and where
the engines' kernels are when not installed (:class:`KernelLocations`: ``VerifyOptions``, the loader,
a layout's or runner's ``kernel_unavailable``).

A location left None falls back to the environment variable (:mod:`mxconv.environment`), then to an
installed copy (:mod:`mxconv.engines.discover`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class KernelChoice(Enum):
    """Which code lays out the kernel tensors in ``Layout.to_kernel``; the bytes are the same either way."""

    AUTO = "auto"  # the Triton layout kernels for CUDA tensors where triton imports, torch ops otherwise
    TORCH = "torch"  # torch ops everywhere (benchmarks, bisecting a layout bug)


@dataclass(frozen=True)
class KernelLocations:
    """Where the engines' kernels are, when not installed. None: not given here."""

    triton_kernels: Path | None = None  # folder that contains triton_kernels/
    marlin_ops: Path | None = None  # vLLM's _moe_C*.so
