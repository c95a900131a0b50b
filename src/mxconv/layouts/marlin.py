"""vLLM Marlin MoE layout (spec: docs/layout-marlin.md): MXFP4 experts (:class:`MarlinMxfp4`, below) and
MXFP8 experts (:mod:`mxconv.layouts.marlin_mxfp8`, §13), one :class:`~mxconv.layouts.forms.WeightForm`
each; :class:`MarlinLayout` declares them (``weight_forms``). The MXFP4 form:

Per expert, a weight matrix with N output rows and K inputs goes

    uint8 [N, K/2] (E2M1 pairs, low nibble = even k)  ->  int32 [K/16, 2N]   (tile stream, §4)
    uint8 [N, K/32] (E8M0 scales)                      ->  e8m0  [K/32, N]    (chunk permutation, §5)
    bias  [N]                                          ->  bf16  [N]          (32-chunk permutation, §6)

with w13: N = 2*Ip, K = Hp and w2: N = Hp, K = Ip, after zero padding to Hp = round_up(H, 256),
Ip = round_up(I, 128) (§3). Everything works on the whole [E, ...] stack at once with views,
permutes and index_select, so CPU and CUDA give the same bytes. ``to_kernel`` fuses the padding
into one row gather per tensor and builds the weight stream from 32-bit words
(:func:`marlin_weight_repack_words`); on CUDA the Triton kernels of ``mxconv.kernels.trtllm_aiter``
do each tensor in one pass (the legacy scale weave stays in torch).

Activations: "bf16" (16-bit activations, 16x64 weight tiles, the default) and "fp8" (W4A8-FP8,
32x32 weight tiles, scales +6).

Options (:class:`MarlinOptions`):
    marlin_scale_layout: "current" (vLLM >= 0.12, default) | "legacy" (vLLM 0.10.2 - 0.11.2,
                         bf16 activation only; extra row-pair weave of the scales, §5.3).

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.padding import unpad_canonical
from mxconv.experts.stack import ROW_ORDERS, CanonicalExperts, LayoutSizes, round_up
from mxconv.experts.tensors import KERNEL_TENSOR_NAMES, KernelTensors, TensorSpec, bias_specs, in_kernel_order
from mxconv.layouts.base import LayoutOption, LayoutOptions
from mxconv.layouts.forms import FormBase, FormsLayout
from mxconv.layouts.gathers import gather_padded_rows, layout_kernels
from mxconv.layouts.marlin_description import MarlinDescription
from mxconv.layouts.marlin_mxfp8 import MXFP8
from mxconv.layouts.marlin_scales import ScaleJob, kernel_scales, row_table
from mxconv.layouts.marlin_bytemap import (
    ACTIVATIONS, FP8_SCALE_MAX_INPUT, FP8_SCALE_OFFSET, SCALE_LAYOUTS, check_scale_mode, marlin_unbias, marlin_unscales,
    marlin_weight_repack_words, marlin_weight_unrepack,
)

__all__ = ["HIDDEN_MULTIPLE", "INTERMEDIATE_MULTIPLE", "LAYOUT", "MarlinLayout", "MarlinOptions"]

HIDDEN_MULTIPLE = 256  # Hp = round_up(H, 256)
INTERMEDIATE_MULTIPLE = 128  # Ip = round_up(I, 128)


# ---------------------------------------------------------------------------------------------
# The Layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MarlinOptions(LayoutOptions):
    """The marlin layout's resolved options: ``marlin_scale_layout``, one of SCALE_LAYOUTS."""

    marlin_scale_layout: str = "current"


class MarlinMxfp4(FormBase):
    """The marlin layout's MXFP4 form (module docstring)."""

    weight_format = "mxfp4"
    activations = ACTIVATIONS
    # fp8 is the same backends with VLLM_MARLIN_INPUT_DTYPE=fp8 (W4A8-FP8)
    vllm_backends = {"bf16": ("MARLIN", "BATCHED_MARLIN"), "fp8": ("MARLIN", "BATCHED_MARLIN")}

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: MarlinOptions) -> tuple[int, int]:  # fmt: skip
        """(Hp, Ip) = (round_up(H, 256), round_up(I, 128)); H and I must be positive multiples of 32."""
        _check_activation(activation)
        if row_order not in ROW_ORDERS:
            raise LayoutError(f"unknown w13 row order {row_order!r} (expected one of {ROW_ORDERS})")
        for label, size in (("hidden size", hidden_size), ("intermediate size", intermediate_size)):
            if size <= 0 or size % 32:
                raise LayoutError(
                    f"{label} {size} cannot be laid out for Marlin: MXFP4 needs a positive multiple of 32 "
                    "(one E8M0 scale per 32 elements)"
                )
        return round_up(hidden_size, HIDDEN_MULTIPLE), round_up(intermediate_size, INTERMEDIATE_MULTIPLE)

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: MarlinOptions) -> dict[str, TensorSpec]:
        """w13_weight int32 [E, Hp/16, 4Ip], w13_weight_scale e8m0 [E, Hp/32, 2Ip], w13_bias bf16 [E, 2Ip],
        w2_weight int32 [E, Ip/16, 2Hp], w2_weight_scale e8m0 [E, Ip/32, Hp], w2_bias bf16 [E, Hp]."""
        check_scale_mode(activation, options.marlin_scale_layout)
        E, Hp, Ip = sizes.num_experts, sizes.padded_hidden_size, sizes.padded_intermediate_size
        return in_kernel_order({
            "w13_weight": TensorSpec((E, Hp // 16, 4 * Ip), "I32"),
            "w13_weight_scale": TensorSpec((E, Hp // 32, 2 * Ip), "F8_E8M0"),
            "w2_weight": TensorSpec((E, Ip // 16, 2 * Hp), "I32"),
            "w2_weight_scale": TensorSpec((E, Ip // 32, Hp), "F8_E8M0"),
            **bias_specs(sizes, Hp, Ip, "BF16"),
        })

    def to_kernel(self, c: CanonicalExperts, activation: str, options: MarlinOptions,
                  kernel_choice: KernelChoice) -> KernelTensors:  # fmt: skip
        """Pad (zero weights, zero scale bytes, zero bias) and lay out the whole stack on c's device;
        ``kernel_choice`` picks the Triton layout kernels or torch ops (same bytes)."""
        import torch

        scale_layout = options.marlin_scale_layout
        check_scale_mode(activation, scale_layout)
        c.validate()  # includes: both biases or neither
        Hp, Ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation, options)
        H, I = c.hidden_size, c.intermediate_size
        # Padding is a row map (padded row <- source row, -1 = zero row) plus zero K columns.
        tab13 = row_table(2 * I, 2 * Ip, c.row_order, None, c.device)
        tab2 = row_table(H, Hp, None, None, c.device)
        lt = layout_kernels(c.w13, kernel_choice)
        out: KernelTensors = {}
        if lt is not None:
            out["w13_weight"] = lt.marlin_weights(c.w13, tab13, Hp, activation)
            out["w2_weight"] = lt.marlin_weights(c.w2, tab2, Ip, activation)
        else:
            out["w13_weight"] = marlin_weight_repack_words(gather_padded_rows(c.w13, tab13, Hp // 2), activation, "w13_weight")
            out["w2_weight"] = marlin_weight_repack_words(gather_padded_rows(c.w2, tab2, Ip // 2), activation, "w2_weight")
        scale_jobs = (
            ScaleJob("w13_weight_scale", c.w13_scale, 2 * I, 2 * Ip, Hp // 32, c.row_order),
            ScaleJob("w2_weight_scale", c.w2_scale, H, Hp, Ip // 32, None),
        )
        scale_kernels = lt if scale_layout == "current" else None  # the legacy weave stays in torch
        too_big = None
        if scale_kernels is not None and activation == "fp8":
            # fp8 range check as a device flag: one sync at the end instead of one per tensor
            too_big = (c.w13_scale > FP8_SCALE_MAX_INPUT).any() | (c.w2_scale > FP8_SCALE_MAX_INPUT).any()
        for job in scale_jobs:
            out[job.name] = kernel_scales(scale_kernels, job, activation, scale_layout)
        if c.w13_bias is not None and c.w2_bias is not None:
            # bias: the 32-chunk permutation folded into the row map
            b13 = row_table(2 * I, 2 * Ip, c.row_order, 32, c.device)
            b2 = row_table(H, Hp, None, 32, c.device)
            out["w13_bias"] = gather_padded_rows(c.w13_bias.to(torch.bfloat16), b13)
            out["w2_bias"] = gather_padded_rows(c.w2_bias.to(torch.bfloat16), b2)
        if too_big is not None and bool(too_big):
            for job in scale_jobs:  # the torch path names the byte
                kernel_scales(None, job, activation, scale_layout)
        return in_kernel_order(out)

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: MarlinOptions) -> CanonicalExperts:
        """Exact inverse of :meth:`to_kernel`; LayoutError on wrong shapes/dtypes or non-zero padding.
        Biases come back as float32."""
        import torch

        scale_layout = options.marlin_scale_layout
        specs = self.kernel_specs(sizes, activation, options)
        for name in KERNEL_TENSOR_NAMES:
            if name not in specs:
                if name in k:
                    raise LayoutError(f"{name} present but the layer is declared without biases")
                continue
            if name not in k:
                raise LayoutError(f"{name} is missing from the Marlin kernel tensors")
            t, want = k[name], specs[name]
            if tuple(t.shape) != want.shape or t.dtype != want.dtype:
                raise LayoutError(
                    f"{name} has shape {tuple(t.shape)} dtype {t.dtype}, expected shape {want.shape} dtype {want.dtype}"
                )
        padded = CanonicalExperts(
            w13=marlin_weight_unrepack(k["w13_weight"], activation, "w13_weight"),
            w13_scale=marlin_unscales(
                k["w13_weight_scale"].view(torch.uint8), activation, scale_layout, "w13_weight_scale"
            ),
            w2=marlin_weight_unrepack(k["w2_weight"], activation, "w2_weight"),
            w2_scale=marlin_unscales(
                k["w2_weight_scale"].view(torch.uint8), activation, scale_layout, "w2_weight_scale"
            ),
            w13_bias=marlin_unbias(k["w13_bias"]) if sizes.has_bias else None,
            w2_bias=marlin_unbias(k["w2_bias"]) if sizes.has_bias else None,
            row_order=sizes.row_order,
        )
        return unpad_canonical(padded, sizes.hidden_size, sizes.intermediate_size, scale_fill=0, check=True)

    def describe(self, sizes: LayoutSizes, activation: str, options: MarlinOptions) -> dict[str, Any]:
        """Manifest `layout` fields: name, version, engine_compat, activation, tile and scale layout."""
        scale_layout = options.marlin_scale_layout
        check_scale_mode(activation, scale_layout)
        compat = {"vllm": ">=0.12"} if scale_layout == "current" else {"vllm": ">=0.10.2,<=0.11.2"}
        d = MarlinDescription(activation=activation, scale_layout=scale_layout)  # variant: MXFP4, not written
        info: dict[str, Any] = {
            "name": "marlin",
            "version": 1,
            "engine_compat": compat,
            "activation": d.activation,
            "weight_tile": {"k": 16, "n": 64} if activation == "bf16" else {"k": 32, "n": 32},
            "scale_layout": d.scale_layout,
            "scale_chunk": 64 if activation == "bf16" else 32,
            "scale_offset": FP8_SCALE_OFFSET if activation == "fp8" else 0,
            "bias_chunk": 32,
            "padding": {"hidden_multiple": HIDDEN_MULTIPLE, "intermediate_multiple": INTERMEDIATE_MULTIPLE},
        }
        if activation == "fp8":
            info["runtime_env"] = {"VLLM_MARLIN_INPUT_DTYPE": "fp8"}
        return info


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise LayoutError(f"unknown Marlin activation {activation!r} (expected one of {ACTIVATIONS})")


MXFP4 = MarlinMxfp4()


class MarlinLayout(FormsLayout):
    """vLLM Marlin MoE backend: MXFP4 (:class:`MarlinMxfp4`) or MXFP8 (:mod:`marlin_mxfp8`) experts
    (see module docstring for options)."""

    name = "marlin"
    version = 1
    weight_forms = {"mxfp4": MXFP4, "mxfp8": MXFP8}
    engine_runner = "mxconv.engines.marlin_moe:RUNNER"  # the engine's own kernel on these bytes (verify --kernel)
    options_type = MarlinOptions
    options = (
        LayoutOption(
            "marlin_scale_layout", str, "current",
            "current (vLLM >= 0.12) or legacy (vLLM 0.10.2 - 0.11.2, bf16 activations only; MXFP4 only)",
            choices=SCALE_LAYOUTS,
        ),
    )


LAYOUT = MarlinLayout()
