"""vLLM 0.33 HUMMING MoE layout (humming-kernels 0.1.19) for MXFP4 and MXFP8 experts on SM90, bf16
activations (spec: docs/layout-humming.md).

What vLLM holds after ``convert_to_humming_moe_kernel_format`` (``quantization/utils/humming/moe.py``)
-> humming ``prepare_and_transform_humming_tensors`` with ``pad_n_to_multiple=256``,
``pad_k_to_multiple=128``, per layer and TP rank:

1. vLLM's own padding (``mxfp4_round_up_hidden_size_and_intermediate_size``: HUMMING takes the CUDA
   default) Ip = roundup(I, 64), H unchanged; w13 rows keep the source order (gpt-oss "interleaved",
   others "halves", each half padded on its own), zero weights, zero scale bytes, zero bias;
2. humming's padding of each GEMM (N rows, K inputs): N to a multiple of 256 and K to 128, appended
   at the end: zero weights, E8M0 scale byte 127 (``F.pad(value=1)``), zero bias;
3. weights -> int32 [E, K/16, 2N] (``humming_bytemap.repack_weights``), scales -> E8M0 [E, K/32, N]
   (transpose + 8x8 transpose per 64 columns), bias -> bf16 [E, N] (32-chunk permutation).

| name             | shape                  | dtype |
|------------------|------------------------|-------|
| w13_weight       | [E, K13/16, 2*N13]     | int32, N13 = roundup(2Ip, 256), K13 = roundup(H, 128) |
| w13_weight_scale | [E, K13/32, N13]       | float8_e8m0fnu |
| w13_bias         | [E, N13]               | bfloat16 |
| w2_weight        | [E, K2/16, 2*N2]       | int32, N2 = roundup(H, 256), K2 = roundup(Ip, 128) |
| w2_weight_scale  | [E, K2/32, N2]         | float8_e8m0fnu |
| w2_bias          | [E, N2]                | bfloat16 |

MXFP8 experts (``weight_format`` "mxfp8"; vLLM's ``Fp8MoeBackend.HUMMING`` through
``convert_to_fp8_moe_kernel_format``): the same except what :mod:`mxconv.layouts.humming_mx` holds
per format: vLLM pads nothing (Ip = I), weights -> int32 [E, K/16, 4N] (four E4M3 bytes a word),
``b_dtype`` float8e4m3.

Compressed-tensors INT4 experts (``weight_format`` "int4"): :mod:`mxconv.layouts.humming_int4` (no
vLLM padding, codes as humming's ``convert_symmetric_integer_weight`` leaves them, bf16 scales).

The layer configs humming's forward needs (``humming.config.LayerConfig`` fields, SM90) are
recorded in the manifest (``describe()["layer_configs"]``); the runner refuses another SM.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from mxconv.errors import LayoutError
from mxconv.layouts import humming_int4
from mxconv.layouts.base import LayoutBase, LayoutOption, LayoutOptions
from mxconv.layouts.canonical import (
    CanonicalExperts,
    KernelTensors,
    LayoutSizes,
    TensorSpec,
    check_block_sizes,
    check_kernel_tensors,
    in_kernel_order,
    round_up,
)
from mxconv.layouts.humming_bytemap import (
    K_MULTIPLE,
    N_MULTIPLE,
    SCALE_PAD_BYTE,
    lay_out_bias,
    lay_out_scales,
    pad_matrix,
    pad_vector,
    unlay_bias,
    unlay_scales,
)
from mxconv.layouts.humming_mx import MX_FORMATS, HummingMX, mx_format
from mxconv.layouts.padding import (
    KernelChoice,
    check_fill,
    gather_padded_rows,
    pad_row_source,
    unpad_canonical,
)

if TYPE_CHECKING:
    import torch

__all__ = ["LAYOUT", "HummingLayout", "gemm_shapes", "layer_configs"]

BACKEND_NAME = "humming"
LAYOUT_VERSION = 1
MX_BLOCK = 32
INTERMEDIATE_ALIGN = 64  # vLLM 0.33 rounds the per-rank intermediate size up to 64 for HUMMING (MXFP4)
SM_VERSION = 90  # the layout is humming's for this SM (SM100+ uses native dequant: other bytes)
HUMMING_VERSION = "0.1.19"
# (activation, w13 row order) -> humming's activation kind (vLLM humming/activation.py)
ACTIVATION_TYPES = {"interleaved": "binary_interleaved", "halves": "binary_split"}


def gemm_shapes(hidden: int, padded_intermediate: int) -> dict[str, tuple[int, int, int, int]]:
    """Per GEMM ("w13", "w2"): (N, K) before humming's padding and (N_pad, K_pad) after it."""
    n13, k13 = 2 * padded_intermediate, hidden
    n2, k2 = hidden, padded_intermediate
    return {
        "w13": (n13, k13, round_up(n13, N_MULTIPLE), round_up(k13, K_MULTIPLE)),
        "w2": (n2, k2, round_up(n2, N_MULTIPLE), round_up(k2, K_MULTIPLE)),
    }


def layer_configs(sizes: LayoutSizes, int4_codes: str | Mapping[str, str] = "uint4") -> dict[str, dict[str, Any]]:
    """humming ``LayerConfig`` keyword arguments per GEMM, as vLLM 0.33 builds them on SM90 with bf16
    activations and no input quantization (``transform.prepare_layer_config``); MX experts with their
    format's ``b_dtype``, INT4 experts with ``int4_codes`` ("uint4" or "e0m3", or one per weight
    tensor: ``layout.stack_choices``) as their weight type and bf16 group scales."""
    int4 = sizes.weight_format == humming_int4.WEIGHT_FORMAT
    b_dtype = None if int4 else mx_format(sizes.weight_format).b_dtype
    shapes = (humming_int4.gemm_shapes(sizes.hidden_size, sizes.intermediate_size) if int4
              else gemm_shapes(sizes.hidden_size, sizes.padded_intermediate_size))  # fmt: skip
    out = {}
    for w, (n, k, n_pad, k_pad) in shapes.items():
        out[w] = {
            "sm_version": SM_VERSION, "shape_n": n_pad, "shape_k": k_pad, "pad_shape_n": n_pad - n,
            "pad_shape_k": k_pad - k, "num_experts": sizes.num_experts, "a_dtype": "bfloat16",
            "b_dtype": b_dtype, "c_dtype": "bfloat16", "bs_dtype": "float8e8m0", "as_dtype": None,
            "input_quant_mode": "none", "input_scale_group_size": 0, "weight_scale_group_size": MX_BLOCK,
            "weight_scale_group_size_n": 0, "weight_scale_type": "group", "weight_scale_2_type": "none",
            "has_zero_point": False, "is_fp_zero_point": False, "has_bias": sizes.has_bias,
        }  # fmt: skip
        if int4:
            codes = int4_codes if isinstance(int4_codes, str) else int4_codes[f"{w}_weight"]
            out[w].update(humming_int4.layer_config_fields(codes))
    return out


class HummingLayout(LayoutBase):
    """vLLM 0.33 HUMMING MoE backend (humming-kernels 0.1.19), MXFP4 / MXFP8 (:mod:`humming_mx`) or
    INT4 (:mod:`humming_int4`) weights, bf16 activations, SM90."""

    name = BACKEND_NAME
    version = LAYOUT_VERSION
    activations: tuple[str, ...] = ("bf16",)
    vllm_backends = {"bf16": ("HUMMING",)}
    # compressed-tensors INT4 (vLLM WNA16MoEBackend) on SM90 goes to HUMMING too: humming_int4
    vllm_int4_backends = {"bf16": ("HUMMING",)}
    # MXFP8 experts on SM90 (fused_moe/oracle/mxfp8.py; prioritize_humming moves it ahead of Marlin):
    # Fp8MoeBackend.HUMMING, bf16 activations (VLLM_HUMMING_INPUT_QUANT_CONFIG unset)
    vllm_mxfp8_backends = {"bf16": ("HUMMING",)}
    weight_formats = (*MX_FORMATS, humming_int4.WEIGHT_FORMAT)
    options = (
        LayoutOption(
            "int4_codes", str, humming_int4.AUTO,
            "INT4 experts only: the codes of each GEMM's stack (auto: as humming chooses per layer, GEMM and "
            "TP rank, recorded in the manifest; uint4: offset-binary, what it keeps for a stack holding "
            "q = -8; e0m3: sign-magnitude float4e0m3, what it makes of one that does not); with uint4 or "
            "e0m3, repack refuses a stack for which humming would pick the other",
            choices=humming_int4.CODES,
        ),
    )
    engine_runner = "mxconv.engines.humming_moe:RUNNER"

    def stack_choices(self, c: CanonicalExperts, options: LayoutOptions | None) -> dict[str, str]:
        """INT4 experts: the code form of each GEMM's stack of ``c`` (by weight tensor), as
        :meth:`to_kernel` writes it under ``options`` (``humming_int4.stack_codes``); else none."""
        if c.weight_format != humming_int4.WEIGHT_FORMAT:
            return {}
        return humming_int4.stack_codes(c, self._codes(options))

    def with_choices(self, options: LayoutOptions | None, choices: Mapping[str, str]) -> LayoutOptions:
        """``options`` with the recorded per-stack code forms fixed (none recorded: as they are)."""
        opts = self.options_of(options)
        return dataclasses.replace(opts, int4_codes=tuple(sorted(choices.items()))) if choices else opts

    def _codes(self, options: LayoutOptions | None) -> str | dict[str, str]:
        codes = self.options_of(options).int4_codes
        return codes if isinstance(codes, str) else dict(codes)

    def padded_sizes(
        self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
        options: LayoutOptions | None = None, *, weight_format: str = "mxfp4",
    ) -> tuple[int, int]:
        """(Hp, Ip) = (H, roundup(I, a)): the layer vLLM allocates for HUMMING (humming's own GEMM
        padding is inside the kernel tensors), a = 64 for MXFP4, 1 for MXFP8 (``humming_mx``).
        LayoutError unless H, I are multiples of 32. ``weight_format="int4"``: (H, I), nothing
        padded (humming_int4)."""
        self.check_activation(activation)
        if weight_format == humming_int4.WEIGHT_FORMAT:
            return humming_int4.padded_sizes(hidden_size, intermediate_size, row_order)
        fmt = mx_format(weight_format)
        check_block_sizes(BACKEND_NAME, hidden_size, intermediate_size, row_order, MX_BLOCK)
        return hidden_size, round_up(intermediate_size, fmt.intermediate_align)

    def _shapes(self, sizes: LayoutSizes) -> tuple[HummingMX, dict[str, tuple[int, int, int, int]]]:
        fmt = mx_format(sizes.weight_format)
        want = self.padded_sizes(sizes.hidden_size, sizes.intermediate_size, sizes.row_order, "bf16",
                                 weight_format=fmt.weight_format)  # fmt: skip
        got = (sizes.padded_hidden_size, sizes.padded_intermediate_size)
        if got != want:
            raise LayoutError(f"humming: padded sizes (Hp, Ip) = {got} do not match the layout's {want} "
                              f"(Hp = H, Ip = roundup(I, {fmt.intermediate_align}) for {fmt.weight_format})")  # fmt: skip
        return fmt, gemm_shapes(sizes.hidden_size, sizes.padded_intermediate_size)

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: LayoutOptions) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the stored tensors (module table)."""
        self.check_activation(activation)
        if sizes.weight_format == humming_int4.WEIGHT_FORMAT:
            return humming_int4.kernel_specs(sizes)
        E, specs = sizes.num_experts, {}
        fmt, shapes = self._shapes(sizes)
        for w, (_n, _k, n_pad, k_pad) in shapes.items():
            specs[f"{w}_weight"] = TensorSpec((E, k_pad // 16, fmt.words_per_row(n_pad)), "I32")
            specs[f"{w}_weight_scale"] = TensorSpec((E, k_pad // MX_BLOCK, n_pad), "F8_E8M0")
            if sizes.has_bias:
                specs[f"{w}_bias"] = TensorSpec((E, n_pad), "BF16")
        return in_kernel_order(specs)

    def to_kernel(self, c: CanonicalExperts, activation: str, options: LayoutOptions,
                  kernel_choice: KernelChoice = KernelChoice.AUTO) -> KernelTensors:  # fmt: skip
        """Canonical stack -> stored tensors on ``c``'s device (module table); torch ops only."""
        import torch

        self.check_activation(activation)
        if c.weight_format == humming_int4.WEIGHT_FORMAT:
            return humming_int4.to_kernel(c, self._codes(options))
        c.validate()
        fmt = mx_format(c.weight_format)
        H, Ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation,
                                  weight_format=fmt.weight_format)  # fmt: skip
        shapes, vpb = gemm_shapes(H, Ip), fmt.values_per_byte
        tabs = {"w13": pad_row_source(2 * c.intermediate_size, 2 * Ip, c.row_order).to(c.device),
                "w2": pad_row_source(H, H).to(c.device)}  # fmt: skip
        out: KernelTensors = {}
        for w, (_n, k, n_pad, k_pad) in shapes.items():
            # vLLM's layer (zeros, w2's K axis padded to Ip too), then humming's own padding
            weight = pad_matrix(gather_padded_rows(getattr(c, w), tabs[w], k // vpb), n_pad, k_pad // vpb, 0)
            out[f"{w}_weight"] = fmt.repack(weight, f"{w}_weight")
            scale = gather_padded_rows(getattr(c, f"{w}_scale"), tabs[w], k // MX_BLOCK)
            scale = pad_matrix(scale, n_pad, k_pad // MX_BLOCK, SCALE_PAD_BYTE)
            out[f"{w}_weight_scale"] = lay_out_scales(scale).view(torch.float8_e8m0fnu)
            bias = getattr(c, f"{w}_bias")
            if bias is not None:
                out[f"{w}_bias"] = lay_out_bias(pad_vector(gather_padded_rows(bias.to(torch.bfloat16), tabs[w]), n_pad))
        return in_kernel_order(out)

    def from_kernel(
        self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: LayoutOptions
    ) -> CanonicalExperts:
        """Exact inverse of :meth:`to_kernel` (biases as bf16); LayoutError for a wrong tensor set,
        shape or dtype, or a padding byte other than its fill (tensor and index named)."""
        import torch

        specs = self.kernel_specs(sizes, activation, options)
        check_kernel_tensors(BACKEND_NAME, k, specs)
        if sizes.weight_format == humming_int4.WEIGHT_FORMAT:
            return humming_int4.from_kernel(k, sizes, self._codes(options))
        H, Ip = sizes.hidden_size, sizes.padded_intermediate_size
        parts: dict[str, Any] = {}
        fmt, shapes = self._shapes(sizes)
        for w, (n, kk, _n_pad, _k_pad) in shapes.items():
            weight = fmt.unrepack(k[f"{w}_weight"], f"{w}_weight")
            parts[w] = _crop(f"{w}_weight", weight, n, kk // fmt.values_per_byte, 0)
            scale = unlay_scales(k[f"{w}_weight_scale"].view(torch.uint8))
            parts[f"{w}_scale"] = _crop(f"{w}_weight_scale", scale, n, kk // MX_BLOCK, SCALE_PAD_BYTE)
            if sizes.has_bias:
                bias = unlay_bias(k[f"{w}_bias"])
                check_fill(f"{w}_bias", bias[:, n:], 0, (0, n))
                parts[f"{w}_bias"] = bias[:, :n].contiguous()
        padded = CanonicalExperts(row_order=sizes.row_order, weight_format=fmt.weight_format, **parts)
        if padded.intermediate_size != Ip or padded.hidden_size != H:
            raise LayoutError("humming: kernel tensors do not match the declared sizes")
        return unpad_canonical(padded, H, sizes.intermediate_size, scale_fill=0, check=True)

    def describe(self, sizes: LayoutSizes, activation: str, options: LayoutOptions) -> dict[str, Any]:
        """Manifest ``layout`` fields: versions, device, padding, row order and humming's layer configs."""
        self.check_activation(activation)
        if sizes.weight_format == humming_int4.WEIGHT_FORMAT:
            return self._describe_int4(sizes, activation, self.options_of(options).int4_codes)
        fmt, shapes = self._shapes(sizes)
        return {
            "name": self.name,
            "version": self.version,
            **fmt.manifest_extra,
            "engine_compat": {"vllm": "0.33", "humming_kernels": HUMMING_VERSION, "gpu": f"SM{SM_VERSION} (Hopper)"},
            "activation": activation,
            "vllm_moe_backend": "HUMMING",
            "sm_version": SM_VERSION,
            "intermediate_align": fmt.intermediate_align,
            "gemm_padding": {"n_multiple": N_MULTIPLE, "k_multiple": K_MULTIPLE,
                             "w13": list(shapes["w13"]), "w2": list(shapes["w2"])},
            "w13_kernel_row_order": sizes.row_order,
            "activation_type": ACTIVATION_TYPES[sizes.row_order],
            "scale_pad_byte": SCALE_PAD_BYTE,
            "weight_dtype": fmt.weight_dtype,
            "scale_dtype": "float8_e8m0fnu",
            "bias_dtype": "bfloat16",
            "layer_configs": layer_configs(sizes),
        }  # fmt: skip

    def _describe_int4(self, sizes: LayoutSizes, activation: str, codes: str) -> dict[str, Any]:
        humming_int4.kernel_specs(sizes)
        shapes = humming_int4.gemm_shapes(sizes.hidden_size, sizes.intermediate_size)
        return {
            "name": self.name,
            "version": self.version,
            "variant": "int4",
            "engine_compat": {"vllm": "0.33", "humming_kernels": HUMMING_VERSION, "gpu": f"SM{SM_VERSION} (Hopper)"},
            "activation": activation,
            "vllm_moe_backend": "HUMMING",
            "vllm_oracle": "WNA16MoEBackend",
            "sm_version": SM_VERSION,
            "intermediate_align": 1,
            "gemm_padding": {"n_multiple": N_MULTIPLE, "k_multiple": K_MULTIPLE,
                             "w13": list(shapes["w13"]), "w2": list(shapes["w2"])},
            "w13_kernel_row_order": sizes.row_order,
            "activation_type": ACTIVATION_TYPES[sizes.row_order],
            "int4_codes": codes,
            "weight_dtype": f"int32 words of eight {humming_int4.nibble_type(codes)} nibbles (humming weight_repack_nk, "
                            "interleave_mode 3)",
            "scale_dtype": "bfloat16",
            "group_size": humming_int4.GROUP_SIZE,
            "scale_fill": 0.0,
            "layer_configs": layer_configs(sizes, codes),
        }  # fmt: skip


def _crop(name: str, x: torch.Tensor, rows: int, cols: int, fill: int) -> torch.Tensor:
    """[E, R, C] -> [E, rows, cols] after checking humming's padding region holds ``fill``."""
    check_fill(name, x[:, rows:], fill, (0, rows, 0))
    check_fill(name, x[:, :rows, cols:], fill, (0, 0, cols))
    return x[:, :rows, :cols].contiguous()


LAYOUT = HummingLayout()
