"""The checks every backend layout makes around its kernel tensors: the sizes ``padded_sizes`` takes
(:func:`check_block_sizes`), the padded sizes recorded for it (:func:`check_padded_sizes`,
:func:`check_mxfp8_method_sizes`) and the tensors ``from_kernel`` is given
(:func:`check_kernel_tensors`). The stack and sizes they check are :mod:`mxconv.experts`'.
"""

from __future__ import annotations

from mxconv.errors import LayoutError
from mxconv.experts.stack import ROW_ORDERS, LayoutSizes
from mxconv.experts.tensors import KernelTensors, TensorSpec


def check_block_sizes(backend: str, hidden_size: int, intermediate_size: int, row_order: str, block: int = 32) -> None:
    """LayoutError unless ``row_order`` is known and both sizes are positive multiples of ``block``
    (what a layout's ``padded_sizes`` checks before it pads)."""
    if row_order not in ROW_ORDERS:
        raise LayoutError(f"unknown w13 row order {row_order!r} (expected one of {ROW_ORDERS})")
    for what, size in (("hidden", hidden_size), ("intermediate", intermediate_size)):
        if size <= 0 or size % block:
            raise LayoutError(f"{backend}: {what} size {size} must be a positive multiple of {block}")


def check_mxfp8_method_sizes(backend: str, sizes: LayoutSizes, want: tuple[int, int]) -> tuple[int, int]:
    """``want`` = (H, I) of an MXFP8 form whose bytes vLLM's MXFP8 method (CompressedTensorsW8A8Mxfp8MoEMethod)
    allocates: nothing padded, no expert biases; LayoutError otherwise."""
    check_padded_sizes(backend, sizes, want, "vLLM's MXFP8 methods pad nothing")
    if sizes.has_bias:
        raise LayoutError(mxfp8_method_bias_refusal(backend))
    return want


def mxfp8_method_bias_refusal(backend: str) -> str:
    """Why ``backend``'s MXFP8 form, whose tensors vLLM's MXFP8 method allocates, holds no expert biases."""
    return (f"{backend} takes no expert biases: vLLM's MXFP8 methods (CompressedTensorsW8A8Mxfp8MoEMethod) "
            "create none, so no verified layout holds them")


def check_padded_sizes(backend: str, sizes: LayoutSizes, want: tuple[int, int], rule: str) -> tuple[int, int]:
    """``want`` (the layout's (Hp, Ip) for ``sizes``' H and I); LayoutError naming ``rule`` (how the
    layout pads) when ``sizes`` records other padded sizes."""
    got = (sizes.padded_hidden_size, sizes.padded_intermediate_size)
    if got != want:
        raise LayoutError(f"{backend}: padded sizes (Hp, Ip) = {got} do not match the layout's {want} for "
                          f"H = {sizes.hidden_size}, I = {sizes.intermediate_size} ({rule})")
    return want


def check_kernel_tensors(backend: str, k: KernelTensors, specs: dict[str, TensorSpec]) -> None:
    """LayoutError unless ``k`` holds exactly the tensors of ``specs``, each of its shape and dtype,
    all on one device (what a layout's ``from_kernel`` checks first)."""
    missing = [n for n in specs if n not in k]
    unexpected = [n for n in k if n not in specs]
    if missing or unexpected:
        raise LayoutError(f"{backend} kernel tensors: missing {missing}, unexpected {unexpected}")
    for n, spec in specs.items():
        if tuple(k[n].shape) != spec.shape or k[n].dtype != spec.dtype:
            raise LayoutError(f"{backend} kernel tensor {n} is {tuple(k[n].shape)} {k[n].dtype}, expected {spec.shape} {spec.dtype}")
    devices = sorted({str(t.device) for t in k.values()})
    if len(devices) > 1:
        raise LayoutError(f"{backend} kernel tensors are on different devices: {devices}")
