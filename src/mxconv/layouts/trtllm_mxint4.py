"""TRT-LLM-gen MxInt4 variant of the "trtllm" layout (docs/layout-trtllm.md section 9): what vLLM
builds for FlashInfer's ``trtllm_mxint4_block_scale_moe`` from compressed-tensors INT4 experts.

:data:`MXINT4` is the form (:class:`mxconv.layouts.forms.WeightForm`) :class:`mxconv.layouts.trtllm.TrtllmLayout` declares for a canonical
stack whose ``weight_format`` is "int4" (one registry entry, three weight formats; the MXFP4 form is
:class:`mxconv.layouts.trtllm.TrtllmMxfp4`). The layout's options do not shape these bytes. Input: a canonical int4 stack (``mxconv.mx.int4``:
offset-binary bytes ``[E, N, K/2]``, bf16 scales ``[E, N, K/32]``, rows in "halves" order, no bias).
Per layer and TP rank, with no padding (H and I must be multiples of 256):

1. sign: ``^ 0x88`` on every weight byte (offset-binary -> two's-complement int4);
2. rows: w13 exactly as MXFP4 halves (step A up/gate pairs + step B MMA shuffle, ``src13``);
   w2 by the MMA shuffle ``s`` -- the same row tables as MXFP4, applied to weights and scales;
3. weights block-major along K in 128-byte (256-value) chunks:
   ``[E, N, K/2] -> [E, K/256, N, 128]``, ``out[e, kb, n, x] = rows[e, n, 128*kb + x]``;
4. scales: the 128x4 swizzle of each expert's row-permuted bf16 matrix, kept flat ``[E, N*K/32]``.

| name             | shape               | dtype    |
|------------------|---------------------|----------|
| w13_weight       | [E, H/256, 2I, 128] | uint8 (two's-complement int4 pairs, low nibble = even k) |
| w13_weight_scale | [E, 2I*H/32]        | bfloat16 (swizzled) |
| w2_weight        | [E, I/256, H, 128]  | uint8    |
| w2_weight_scale  | [E, H*I/32]         | bfloat16 (swizzled) |

The kernel takes bf16 activations and plain SiLU (gemm1 alpha/beta/clamp_limit None).

torch is named in type annotations only (imported under TYPE_CHECKING), so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.experts.tensors import KernelTensors, TensorSpec
from mxconv.layouts.gathers import gather_padded_rows
from mxconv.mx.int4 import GROUP_SIZE, SCALE_DTYPE, to_twos_complement
from mxconv.layouts.base import LayoutOptions
from mxconv.layouts.forms import FormBase
from mxconv.layouts.trtllm_bytemap import (
    BACKEND_NAME, EPILOGUE_TILE_M, LAYOUT_VERSION, SF_TILE_COLS, SF_TILE_ROWS, SHUFFLE_BLOCK_ROWS, check_kernel_tensors,
    swizzle_128x4, unswizzle_128x4, w13_row_dst, w13_row_table, w2_row_dst, w2_row_table,
)

if TYPE_CHECKING:
    import torch

VARIANT = "mxint4"
WEIGHT_FORMAT = "int4"
SIZE_ALIGN = 256  # H and I: 256 int4 values = one 128-byte K chunk
K_CHUNK_BYTES = 128
ACTIVATIONS: tuple[str, ...] = ("bf16",)
ROW_ORDER = "halves"
ENGINE_COMPAT = {"flashinfer": ">=0.7.2"}  # its row helpers take bf16 scales (checked by the tests)
KERNEL = "trtllm_mxint4_block_scale_moe"


def to_block_major(rows: torch.Tensor) -> torch.Tensor:
    """uint8 ``[E, N, K/2]`` -> ``[E, K/256, N, 128]``: 128-byte K chunks made the outer axis."""
    E, N, kb = rows.shape
    return rows.view(E, N, kb // K_CHUNK_BYTES, K_CHUNK_BYTES).permute(0, 2, 1, 3).contiguous()


def from_block_major(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_block_major`: ``[E, K/256, N, 128]`` -> ``[E, N, K/2]``."""
    E, nb, N, chunk = blocks.shape
    return blocks.permute(0, 2, 1, 3).reshape(E, N, nb * chunk).contiguous()

BIAS_REFUSAL = "trtllm MxInt4 takes no expert biases (compressed-tensors INT4 experts have none)"


def _row_tables(H: int, I: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return w13_row_table(I, I, ROW_ORDER, device), w2_row_table(H, H, device)


class TrtllmMxInt4(FormBase):
    """The MxInt4 form of the trtllm layout (module docstring); ``options`` are taken and unused."""

    weight_format = WEIGHT_FORMAT
    activations = ACTIVATIONS
    vllm_backends: dict[str, tuple[str, ...]] = {}  # no vLLM WNA16MoEBackend holds these bytes
    kernel_label = "MxInt4"  # how kernel_unavailable names the FlashInfer kernels
    bias_refusal = BIAS_REFUSAL

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: LayoutOptions | None) -> tuple[int, int]:  # fmt: skip
        """(Hp, Ip) = (H, I) for one rank: MxInt4 is never padded. LayoutError naming the size that is
        not a positive multiple of 256, an activation other than bf16, or an order other than halves."""
        if activation not in ACTIVATIONS:
            raise LayoutError(
                f"trtllm MxInt4 (int4 experts) takes bf16 activations only, not RepackOptions.activation {activation!r} "
                "(the mxfp8 activation variant exists for MXFP4 weights)"
            )
        if row_order != ROW_ORDER:
            raise LayoutError(f"trtllm MxInt4 takes w13 rows in {ROW_ORDER!r} order ([gate; up]), got {row_order!r}")
        for what, size in (("hidden", hidden_size), ("intermediate (per TP rank)", intermediate_size)):
            if size <= 0 or size % SIZE_ALIGN:
                raise LayoutError(
                    f"trtllm MxInt4: {what} size {size} is not a positive multiple of {SIZE_ALIGN} (the layout stores "
                    f"weights in {SIZE_ALIGN}-value K blocks and is not padded; layout-trtllm.md section 9)"
                )
        return hidden_size, intermediate_size

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: LayoutOptions | None) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the MxInt4 kernel tensors for ``sizes`` (module table)."""
        H, I = self.padded_sizes(sizes.hidden_size, sizes.intermediate_size, sizes.row_order, activation, options)
        if (sizes.padded_hidden_size, sizes.padded_intermediate_size) != (H, I):
            raise LayoutError(
                f"trtllm MxInt4: padded sizes (Hp, Ip) = {(sizes.padded_hidden_size, sizes.padded_intermediate_size)} "
                f"must equal (H, I) = {(H, I)} (the MxInt4 layout is not padded)"
            )
        if sizes.has_bias:
            raise LayoutError(BIAS_REFUSAL)
        E = sizes.num_experts
        return {
            "w13_weight": TensorSpec((E, H // SIZE_ALIGN, 2 * I, K_CHUNK_BYTES), "U8"),
            "w13_weight_scale": TensorSpec((E, 2 * I * (H // GROUP_SIZE)), SCALE_DTYPE),
            "w2_weight": TensorSpec((E, I // SIZE_ALIGN, H, K_CHUNK_BYTES), "U8"),
            "w2_weight_scale": TensorSpec((E, H * (I // GROUP_SIZE)), SCALE_DTYPE),
        }

    def to_kernel(self, c: CanonicalExperts, activation: str, options: LayoutOptions | None,
                  kernel_choice: KernelChoice) -> KernelTensors:  # fmt: skip
        """Canonical int4 stack -> MxInt4 kernel tensors on ``c``'s device (module table); torch ops only."""
        c.validate()
        if c.w13_bias is not None:
            raise LayoutError(BIAS_REFUSAL)
        H, I = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation, options)
        tab13, tab2 = _row_tables(H, I, c.device)
        E = c.num_experts
        return {
            "w13_weight": to_block_major(to_twos_complement(gather_padded_rows(c.w13, tab13))),
            "w13_weight_scale": swizzle_128x4(gather_padded_rows(c.w13_scale, tab13)).view(E, -1),
            "w2_weight": to_block_major(to_twos_complement(gather_padded_rows(c.w2, tab2))),
            "w2_weight_scale": swizzle_128x4(gather_padded_rows(c.w2_scale, tab2)).view(E, -1),
        }

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str,
                    options: LayoutOptions | None) -> CanonicalExperts:  # fmt: skip
        """MxInt4 kernel tensors -> canonical int4 stack (offset-binary bytes, bf16 scales, halves).

        LayoutError for a missing or unexpected tensor, a wrong shape or dtype, or tensors on
        different devices. Every byte and scale element is used, so nothing else can be checked here;
        verify compares the result with the reference.
        """
        check_kernel_tensors(k, self.kernel_specs(sizes, activation, options))
        H, I, E = sizes.hidden_size, sizes.intermediate_size, sizes.num_experts
        device = k["w13_weight"].device
        dst13, dst2 = w13_row_dst(I, ROW_ORDER, device), w2_row_dst(H, device)

        def weights(name: str, dst: torch.Tensor) -> torch.Tensor:
            return to_twos_complement(from_block_major(k[name])).index_select(1, dst)

        def scales(name: str, rows: int, cols: int, dst: torch.Tensor) -> torch.Tensor:
            return unswizzle_128x4(k[name].reshape(E, rows * cols), rows, cols).index_select(1, dst)

        return CanonicalExperts(
            w13=weights("w13_weight", dst13),
            w13_scale=scales("w13_weight_scale", 2 * I, H // GROUP_SIZE, dst13),
            w2=weights("w2_weight", dst2),
            w2_scale=scales("w2_weight_scale", H, I // GROUP_SIZE, dst2),
            row_order=ROW_ORDER,
            weight_format=WEIGHT_FORMAT,
        )

    def describe(self, sizes: LayoutSizes, activation: str, options: LayoutOptions | None) -> dict[str, Any]:
        """Manifest ``layout`` fields of the MxInt4 form (kernel_params are added by the caller)."""
        self.kernel_specs(sizes, activation, options)
        return {
            "name": BACKEND_NAME,
            "version": LAYOUT_VERSION,
            "variant": VARIANT,
            "engine_compat": dict(ENGINE_COMPAT),
            "activation": activation,
            "flashinfer_kernel": KERNEL,
            "weight_dtype": "uint8: two's-complement int4 pairs (low nibble = even k), XOR 0x88 of compressed-tensors' offset-binary",
            "weight_block_layout": f"[E, K/{SIZE_ALIGN}, N, {K_CHUNK_BYTES}] (block-major K, {K_CHUNK_BYTES}-byte chunks)",
            "epilogue_tile_m": EPILOGUE_TILE_M,
            "shuffle_block_rows": SHUFFLE_BLOCK_ROWS,
            "group_size": GROUP_SIZE,
            "scale_swizzle": f"{SF_TILE_ROWS}x{SF_TILE_COLS}",
            "scale_dtype": "bfloat16",
            "scale_shape": "flat [E, N*K/32] per expert",
            "scale_fill": 0.0,
            "w13_kernel_row_order": "up_gate_pairs",
            "hidden_align": SIZE_ALIGN,
            "intermediate_align": SIZE_ALIGN,
        }


MXINT4 = TrtllmMxInt4()
