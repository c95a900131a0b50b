"""Float experts straight to the ``triton`` backend's Hopper buffers (``TritonLayout.float_to_kernel``):
the fused quantize + value and scale layout kernel of :mod:`mxconv.kernels.triton_fused`, so the
packed MXFP4 bytes and the plain scales never make a second trip through memory. The in-memory
hand-off (``mxconv.engines.in_memory.convert_layer``) asks for it first and takes the general path
(quantize, then ``to_kernel``) when it answers None.

The bytes are ``to_kernel``'s of the quantized stack (tests/test_triton_fused.py). torch is
imported in the function, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import LayoutSizes
from mxconv.experts.tensors import KernelTensors, in_kernel_order
from mxconv.layouts.gathers import gather_padded_rows, layout_kernels
from mxconv.layouts.triton_arch import Arch, spec_of
from mxconv.layouts.triton_bytemap import w2_row_table, w13_row_table

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

FUSED_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")  # what the fused kernel reads


def fused_applies(w13: torch.Tensor, activation: str, arch: Arch, fmt: str, kernel_choice: KernelChoice) -> bool:
    """Whether the fused kernel writes this layer: MXFP4 for the bf16-activation Hopper storage,
    from bf16/fp16/fp32 CUDA stacks, with the Triton layout kernels allowed (``KernelChoice.AUTO``)."""
    return (fmt == "mxfp4" and activation == "bf16" and spec_of(arch).layout_kernels and kernel_choice is KernelChoice.AUTO
            and str(w13.dtype) in FUSED_DTYPES and layout_kernels(w13, kernel_choice) is not None)  # fmt: skip


def float_to_kernel(
    layout: Any, t: Mapping[str, torch.Tensor], row_order: str, activation: str, options: Any,
    fmt: str, scale_rounding: str, kernel_choice: KernelChoice = KernelChoice.AUTO,
) -> KernelTensors | None:  # fmt: skip
    """One layer's float experts ``t`` (canonical names: ``w13`` [E, 2I, H] with rows in
    ``row_order``, ``w2`` [E, H, I], optional ``w13_bias`` / ``w2_bias``) quantized to ``fmt`` with
    ``scale_rounding`` and laid out as ``layout.to_kernel`` lays out that quantization, on their
    device. None, and nothing to use, when the fused kernel does not apply (:func:`fused_applies`)
    or an element is NaN or Inf (the general path names it or honours allow_nonfinite): one
    device -> host sync, for that flag. Shapes are the caller's to check (the general path does)."""
    import torch

    opts = layout.options_of(options)
    w13, w2 = t["w13"], t["w2"]
    if not fused_applies(w13, activation, opts.arch, fmt, kernel_choice) or w2.dtype != w13.dtype:
        return None
    from mxconv.kernels.triton_fused import fused_hopper_values

    E, n13, H = w13.shape
    has_bias = t.get("w13_bias") is not None
    hp, ip = layout.padded_sizes(H, n13 // 2, row_order, activation, opts)
    sizes = LayoutSizes(E, H, n13 // 2, hp, ip, row_order, has_bias)
    flag = torch.zeros(1, dtype=torch.int32, device=w13.device)
    out: KernelTensors = {}
    for w, (tab_v, row_bytes, scales, rows) in _plan(layout, opts, sizes, w13.device):
        out[f"{w}_weight"], out[f"{w}_weight_scale"] = fused_hopper_values(t[w], tab_v, row_bytes, scale_rounding, flag, scales)
        if has_bias:
            bias = t[f"{w}_bias"].to(device=w13.device, dtype=torch.float32)
            out[f"{w}_bias"] = gather_padded_rows(bias, tab_v[:rows])
    if flag.item():
        return None
    return in_kernel_order(out)


@functools.lru_cache(maxsize=64)
def _plan(layout: Any, opts: Any, sizes: LayoutSizes,
          device: torch.device) -> tuple[tuple[str, tuple[torch.Tensor, int, Any, int]], ...]:  # fmt: skip
    """Per matrix ("w13", "w2"): (value row table int32 [value rows] on ``device`` (source row of
    each kernel row, -1 = padding), value row bytes, the scale buffer's ``HopperScales``, real rows)
    for one layer's ``sizes`` (padded by ``layout.padded_sizes``). Cached (64 shapes): the in-memory
    hand-off converts the same shapes layer after layer, and this is host work before the first
    launch; the row tables are only read."""
    from mxconv.kernels.triton_fused import HopperScales

    plan = []
    for w, g in layout.geometry(sizes, opts).items():
        tab_v = (w13_row_table(sizes.intermediate_size, sizes.row_order, g.value_rows, device) if w == "w13"
                 else w2_row_table(sizes.hidden_size, g.value_rows, device))  # fmt: skip
        plan.append((w, (tab_v, g.value_row_bytes, HopperScales(g.scale_rows, g.scale_padded_cols, g.num_warps), g.rows)))
    return tuple(plan)


__all__ = ["FUSED_DTYPES", "float_to_kernel", "fused_applies"]
