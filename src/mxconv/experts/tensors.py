"""The tensors a conversion plans and a layout hands an engine: :class:`TensorSpec` (the planned shape
and dtype of one output tensor: the plan, ``--dry-run``, ``inspect`` and the writer read it), the
kernel tensors' names (vLLM FusedMoE parameter names) and their order, and the bias specs every
padded layout shares.

torch-free: planning and ``mxconv inspect`` import no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from mxconv.experts.stack import LayoutSizes
from mxconv.source.st_format import element_bytes, st_name, torch_dtype

if TYPE_CHECKING:
    import torch

_V = TypeVar("_V")

# Names of the kernel tensors every backend produces (vLLM FusedMoE parameter names, without prefix).
KERNEL_TENSOR_NAMES = (
    "w13_weight",
    "w13_weight_scale",
    "w13_bias",
    "w2_weight",
    "w2_weight_scale",
    "w2_bias",
    "w13_input_scale",  # static FP8 input scales (W4A8 layouts only): 0-dim float32
    "w2_input_scale",
)


# Kernel tensors: name (see KERNEL_TENSOR_NAMES) -> tensor. Biases absent when the model has none.
KernelTensors = dict[str, "torch.Tensor"]


@dataclass(frozen=True)
class TensorSpec:
    """Planned shape and dtype of one output tensor (used by --dry-run, inspect and the writer).

    Built from a torch dtype or its safetensors name (``TensorSpec(shape, "U8")``, what the layouts
    and readers give, so planning imports no torch); it keeps the name, ``dtype`` is the torch dtype.
    """

    shape: tuple[int, ...]
    st_dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.st_dtype, str):  # a torch dtype
            object.__setattr__(self, "st_dtype", st_name(self.st_dtype))

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.st_dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_bytes(self.st_dtype)


def bias_specs(sizes: LayoutSizes, hp: int, ip: int, st_dtype: str) -> dict[str, TensorSpec]:
    """The bias specs of a layout padded to (``hp``, ``ip``): ``w13_bias [E, 2*ip]`` and
    ``w2_bias [E, hp]`` of ``st_dtype``, or none when ``sizes.has_bias`` is false."""
    if not sizes.has_bias:
        return {}
    E = sizes.num_experts
    return {"w13_bias": TensorSpec((E, 2 * ip), st_dtype), "w2_bias": TensorSpec((E, hp), st_dtype)}


def in_kernel_order(tensors: dict[str, _V]) -> dict[str, _V]:
    """``tensors`` (kernel tensors or their specs, by name) in :data:`KERNEL_TENSOR_NAMES` order;
    other names are dropped."""
    return {name: tensors[name] for name in KERNEL_TENSOR_NAMES if name in tensors}
