"""TRT-LLM-gen MXFP8 x MXFP8 form of the "trtllm" layout (docs/layout-trtllm.md section 15): what vLLM
0.33 holds for ``Fp8MoeBackend.FLASHINFER_TRTLLM`` after loading compressed-tensors MXFP8 experts (SM100
family; FlashInfer's ``trtllm_fp8_block_scale_moe`` with ``Fp8QuantizationType.MxFp8``,
``WeightLayout.MajorK``, shuffled weights, activations quantized to MXFP8 at run time).

Used by :class:`mxconv.layouts.trtllm.TrtllmLayout` when the stack's (or ``LayoutSizes``') weight format
is "mxfp8". vLLM's path, per layer and TP rank (``CompressedTensorsW8A8Mxfp8MoEMethod`` allocates
float8_e4m3fn [E, 2I, H] / [E, H, I] and uint8 E8M0 [E, 2I, H/32] / [E, H, I/32], unpadded;
``convert_to_fp8_moe_kernel_format`` -> ``prepare_fp8_moe_layer_for_fi(is_trtllm=True)``,
``quantization/utils/flashinfer_utils.py``):

1. ``align_mxfp8_moe_weights_for_fi_trtllm``: (Hp, Ip) = (roundup(H, 256), roundup(I, 128)); each w13
   half padded on its own; weights 0x00, **scales 0x7F** (E8M0 1.0) in every padded row and column;
2. ``swap_w13_to_w31`` then ``get_reorder_rows_for_gated_act_gemm_row_indices``: kernel row 2i = up_i,
   2i+1 = gate_i (the MXFP4 layout's step A);
3. ``get_shuffle_matrix_a_row_indices(.., epilogue_tile_m=128)`` on weights and scale rows (step B, blocks
   of 32 rows: the row map does not depend on the element width);
4. ``block_scale_interleave`` of each expert's scale matrix (the 128x4 swizzle, step C), kept uint8 in
   the matrix shape.

Steps 1-3 are the MXFP4 layout's row tables (:mod:`mxconv.layouts.trtllm_bytemap`), one gather with
the column padding; only the element width, the scale fill and the stored dtypes differ.

| name             | shape            | dtype |
|------------------|------------------|-------|
| w13_weight       | [E, 2Ip, Hp]     | float8_e4m3fn |
| w13_weight_scale | [E, 2Ip, Hp/32]  | uint8 (swizzled E8M0) |
| w2_weight        | [E, Hp, Ip]      | float8_e4m3fn |
| w2_weight_scale  | [E, Hp, Ip/32]   | uint8 (swizzled E8M0) |

The layer's sizes stay (H, I): the compressed-tensors method allocates them unpadded and the padding
happens inside vLLM's conversion (it updates ``moe_config.hidden_dim`` and
``intermediate_size_per_partition``), so the manifest's padded sizes are (H, I) and (Hp, Ip) is inside
the tensors, as for marlin's MXFP8 form. Refusals (LayoutError): activations other than mxfp8 (the
kernel takes MXFP8 x MXFP8 only), an ``intermediate_align`` other than 128 (vLLM's rule), expert biases
(the method creates none), sizes that are not multiples of 32.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.padding import unpad_canonical
from mxconv.experts.stack import CanonicalExperts, LayoutSizes, round_up
from mxconv.experts.tensors import KernelTensors, TensorSpec
from mxconv.layouts.checks import check_block_sizes
from mxconv.layouts.forms import FormBase, MXFP8_ORACLE
from mxconv.layouts.gathers import gather_padded_rows
from mxconv.layouts.trtllm_bytemap import (
    BACKEND_NAME, EPILOGUE_TILE_M, LAYOUT_VERSION, SF_TILE_COLS, SF_TILE_ROWS, SHUFFLE_BLOCK_ROWS, check_kernel_tensors,
    swizzle_128x4, unswizzle_128x4, w13_row_dst, w13_row_table, w2_row_dst, w2_row_table,
)

if TYPE_CHECKING:
    import torch

__all__ = ["ACTIVATIONS", "VLLM_BACKEND", "WEIGHT_FORMAT", "describe", "from_kernel", "kernel_specs", "padded_sizes",
           "to_kernel"]  # fmt: skip

VARIANT = "mxfp8"
WEIGHT_FORMAT = "mxfp8"
ACTIVATIONS: tuple[str, ...] = ("mxfp8",)
VLLM_BACKEND = "FLASHINFER_TRTLLM"  # Fp8MoeBackend value
HIDDEN_ALIGN = 256  # align_mxfp8_moe_weights_for_fi_trtllm(hidden_alignment=256)
INTERMEDIATE_ALIGN = 128  # min_alignment=128
MX_BLOCK = 32
SCALE_FILL = 0x7F  # vLLM pads scales with E8M0 1.0 (padded weights are zero, so they add nothing)
BIAS_REFUSAL = ("trtllm MXFP8 takes no expert biases: vLLM's CompressedTensorsW8A8Mxfp8MoEMethod creates none, so no "
                "vLLM layer holds them")
WEIGHT_DTYPE, SCALE_DTYPE = "F8_E4M3", "U8"
ENGINE_COMPAT = {"vllm": "0.33", "flashinfer": ">=0.7"}
KERNEL = "trtllm_fp8_block_scale_moe (Fp8QuantizationType.MxFp8, WeightLayout.MajorK)"


def padded_sizes(hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                 intermediate_align: int = INTERMEDIATE_ALIGN) -> tuple[int, int]:  # fmt: skip
    """(H, I): the method pads nothing (the kernel padding is inside the tensors). LayoutError for an
    activation other than mxfp8, another ``intermediate_align`` than vLLM's 128, or sizes that are not
    positive multiples of 32."""
    if activation not in ACTIVATIONS:
        raise LayoutError(f"trtllm MXFP8: FlashInfer's TRT-LLM FP8 MoE runs MXFP8 experts with MXFP8 activations only "
                          f"(vLLM's TrtLlmFp8Experts: kMxfp8Static x kMxfp8Dynamic); got activation {activation!r}; "
                          "set RepackOptions.activation mxfp8")  # fmt: skip
    if intermediate_align != INTERMEDIATE_ALIGN:
        raise LayoutError(f"trtllm MXFP8: intermediate_align {intermediate_align} is not vLLM 0.33's "
                          f"{INTERMEDIATE_ALIGN} (align_mxfp8_moe_weights_for_fi_trtllm pads I to a multiple of "
                          f"{INTERMEDIATE_ALIGN}); the option applies to MXFP4 experts")  # fmt: skip
    check_block_sizes("trtllm MXFP8", hidden_size, intermediate_size, row_order, MX_BLOCK)
    return hidden_size, intermediate_size


def kernel_sizes(hidden_size: int, intermediate_size: int) -> tuple[int, int]:
    """(Hp, Ip) inside the tensors: vLLM's padding for the kernel."""
    return round_up(hidden_size, HIDDEN_ALIGN), round_up(intermediate_size, INTERMEDIATE_ALIGN)


def kernel_specs(sizes: LayoutSizes, activation: str, intermediate_align: int = INTERMEDIATE_ALIGN) -> dict[str, TensorSpec]:
    """Shapes/dtypes of the kernel tensors (module table); LayoutError for biases or padded sizes other than (H, I)."""
    H, I = padded_sizes(sizes.hidden_size, sizes.intermediate_size, sizes.row_order, activation, intermediate_align)
    if (sizes.padded_hidden_size, sizes.padded_intermediate_size) != (H, I):
        raise LayoutError(f"trtllm MXFP8: padded sizes must equal (H, I) = {(H, I)} (compressed-tensors MXFP8 "
                          "allocates the layer unpadded; the kernel padding is inside the tensors)")  # fmt: skip
    if sizes.has_bias:
        raise LayoutError(BIAS_REFUSAL)
    E, (Hp, Ip) = sizes.num_experts, kernel_sizes(H, I)
    return {
        "w13_weight": TensorSpec((E, 2 * Ip, Hp), WEIGHT_DTYPE),
        "w13_weight_scale": TensorSpec((E, 2 * Ip, Hp // MX_BLOCK), SCALE_DTYPE),
        "w2_weight": TensorSpec((E, Hp, Ip), WEIGHT_DTYPE),
        "w2_weight_scale": TensorSpec((E, Hp, Ip // MX_BLOCK), SCALE_DTYPE),
    }


def to_kernel(c: CanonicalExperts, activation: str, intermediate_align: int = INTERMEDIATE_ALIGN) -> KernelTensors:
    """Canonical MXFP8 stack -> the tensors of the module table, on ``c``'s device (torch ops)."""
    import torch

    c.validate()
    H, I = c.hidden_size, c.intermediate_size
    kernel_specs(c.sizes(H, I), activation, intermediate_align)
    Hp, Ip = kernel_sizes(H, I)
    tab13, tab2 = w13_row_table(I, Ip, c.row_order, c.device), w2_row_table(H, Hp, c.device)

    def scales(s: torch.Tensor, tab: torch.Tensor, cols: int) -> torch.Tensor:
        rows = gather_padded_rows(s, tab, cols, SCALE_FILL)
        return swizzle_128x4(rows).reshape(rows.shape)

    return {
        "w13_weight": gather_padded_rows(c.w13, tab13, Hp, 0).view(torch.float8_e4m3fn),
        "w13_weight_scale": scales(c.w13_scale, tab13, Hp // MX_BLOCK),
        "w2_weight": gather_padded_rows(c.w2, tab2, Ip, 0).view(torch.float8_e4m3fn),
        "w2_weight_scale": scales(c.w2_scale, tab2, Ip // MX_BLOCK),
    }


def from_kernel(k: KernelTensors, sizes: LayoutSizes, activation: str,
                intermediate_align: int = INTERMEDIATE_ALIGN) -> CanonicalExperts:  # fmt: skip
    """Exact inverse of :func:`to_kernel`; LayoutError for a wrong tensor set, shape or dtype, or a padding
    byte other than its fill (weights 0, scales 0x7F; index in padded canonical coordinates)."""
    import torch

    check_kernel_tensors(k, kernel_specs(sizes, activation, intermediate_align))
    Hp, Ip = kernel_sizes(sizes.hidden_size, sizes.intermediate_size)
    device = k["w13_weight"].device
    dst13, dst2 = w13_row_dst(Ip, sizes.row_order, device), w2_row_dst(Hp, device)

    def rows(name: str, dst: torch.Tensor) -> torch.Tensor:
        t = k[name].view(torch.uint8)
        if name.endswith("_scale"):
            E, R, C = t.shape
            t = unswizzle_128x4(t.reshape(E, R * C), R, C)
        return t.index_select(1, dst)

    padded = CanonicalExperts(rows("w13_weight", dst13), rows("w13_weight_scale", dst13), rows("w2_weight", dst2),
                              rows("w2_weight_scale", dst2), row_order=sizes.row_order, weight_format=WEIGHT_FORMAT)  # fmt: skip
    return unpad_canonical(padded, sizes.hidden_size, sizes.intermediate_size, scale_fill=SCALE_FILL, check=True)


def describe(sizes: LayoutSizes, activation: str, intermediate_align: int = INTERMEDIATE_ALIGN) -> dict[str, Any]:
    """Manifest ``layout`` fields of the MXFP8 form (kernel_params are added by the caller)."""
    kernel_specs(sizes, activation, intermediate_align)
    Hp, Ip = kernel_sizes(sizes.hidden_size, sizes.intermediate_size)
    return {
        "name": BACKEND_NAME,
        "version": LAYOUT_VERSION,
        **MXFP8_ORACLE,
        "vllm_moe_backend": VLLM_BACKEND,
        "engine_compat": dict(ENGINE_COMPAT),
        "activation": activation,
        "kernel": KERNEL,
        "epilogue_tile_m": EPILOGUE_TILE_M,
        "shuffle_block_rows": SHUFFLE_BLOCK_ROWS,
        "scale_swizzle": f"{SF_TILE_ROWS}x{SF_TILE_COLS}",
        "scale_dtype": "uint8 E8M0 (swizzled)",
        "scale_fill": SCALE_FILL,
        "w13_kernel_row_order": "up_gate_pairs",
        "hidden_align": HIDDEN_ALIGN,
        "intermediate_align": INTERMEDIATE_ALIGN,
        "padding": {"kernel_hidden_size": Hp, "kernel_intermediate_size": Ip},
    }


class TrtllmMxfp8(FormBase):
    """The MXFP8 form of the trtllm layout (module docstring): this module's functions as a
    :class:`~mxconv.layouts.forms.WeightForm`; of the options, ``intermediate_align`` is read (it must
    stay vLLM's 128)."""

    weight_format = WEIGHT_FORMAT
    activations = ACTIVATIONS
    vllm_backends = {act: (VLLM_BACKEND,) for act in ACTIVATIONS}  # Fp8MoeBackend (prepare_fp8_moe_layer_for_fi)
    bias_refusal = BIAS_REFUSAL

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: Any) -> tuple[int, int]:  # fmt: skip
        return padded_sizes(hidden_size, intermediate_size, row_order, activation, options.intermediate_align)

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, TensorSpec]:
        return kernel_specs(sizes, activation, options.intermediate_align)

    def to_kernel(self, c: CanonicalExperts, activation: str, options: Any, kernel_choice: KernelChoice) -> KernelTensors:
        return to_kernel(c, activation, options.intermediate_align)

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: Any) -> CanonicalExperts:
        return from_kernel(k, sizes, activation, options.intermediate_align)

    def describe(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, Any]:
        return describe(sizes, activation, options.intermediate_align)


MXFP8 = TrtllmMxfp8()
