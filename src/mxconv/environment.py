"""The one module that reads the process environment.

mxconv takes no behaviour switches from the environment; what it reads here is where things are:

* ``MXCONV_TRITON_KERNELS`` - a folder that contains ``triton_kernels/`` (the engines' Triton MoE
  kernels, e.g. extracted from the vLLM 0.33 wheel);
* ``MXCONV_MARLIN_OPS`` - vLLM's compiled MoE ops library (``_moe_C_stable_libtorch.abi3.so``);
* ``TRITON_INTERPRET`` - triton's own switch: set, its kernels run on CPU tensors (tests).

The two kernel locations are also settings (:class:`mxconv.experts.kernel_settings.KernelLocations`:
``mxconv verify --triton-kernels DIR --marlin-ops FILE``, the loader API); one given there wins over
the variable here, which wins over an installed copy (:mod:`mxconv.engines.discover`).
"""

from __future__ import annotations

import os
from pathlib import Path

TRITON_KERNELS_ENV = "MXCONV_TRITON_KERNELS"
MARLIN_OPS_ENV = "MXCONV_MARLIN_OPS"
TRITON_INTERPRET_ENV = "TRITON_INTERPRET"


def _path_from(name: str) -> Path | None:
    """The path in environment variable ``name`` (``~`` expanded, made absolute), None when unset or empty."""
    value = os.environ.get(name, "").strip()
    return Path(value).expanduser().resolve() if value else None


def triton_kernels_dir() -> Path | None:
    """The folder named by ``$MXCONV_TRITON_KERNELS`` (absolute), None when unset or empty."""
    return _path_from(TRITON_KERNELS_ENV)


def marlin_ops_file() -> Path | None:
    """The library named by ``$MXCONV_MARLIN_OPS`` (absolute), None when unset or empty."""
    return _path_from(MARLIN_OPS_ENV)


def triton_interpreter_on() -> bool:
    """True under the Triton interpreter (``TRITON_INTERPRET=1``: triton kernels run on CPU tensors)."""
    return os.environ.get(TRITON_INTERPRET_ENV, "0") not in ("", "0")


__all__ = [
    "MARLIN_OPS_ENV", "TRITON_INTERPRET_ENV", "TRITON_KERNELS_ENV", "marlin_ops_file", "triton_interpreter_on",
    "triton_kernels_dir",
]
