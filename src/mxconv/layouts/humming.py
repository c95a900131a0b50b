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

Forms: each weight format is one :class:`HummingForm` (a :class:`~mxconv.layouts.forms.WeightForm`)
around its part (``humming_mx.MXFP4`` / ``MXFP8``, ``humming_int4.INT4``), which owns its sizes,
bytes, stack choices and the manifest fields that differ; :meth:`HummingForm.describe` builds the one
manifest entry around them. All share ``humming_bytemap`` (GEMM padding, word and
scale maps).

The layer configs humming's forward needs (``humming.config.LayerConfig`` fields, SM90) are
recorded in the manifest (``describe()["layer_configs"]``); the runner refuses another SM.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.experts.tensors import KernelTensors, TensorSpec
from mxconv.layouts.base import LayoutOption, LayoutOptions, check_activation
from mxconv.layouts.checks import check_kernel_tensors
from mxconv.layouts.description import LayoutDescription
from mxconv.layouts.forms import FormBase, FormsLayout
from mxconv.layouts.humming_bytemap import K_MULTIPLE, N_MULTIPLE, gemm_shapes
from mxconv.layouts.humming_int4 import AUTO, CODES, INT4, HummingInt4
from mxconv.layouts.humming_mx import MXFP4, MXFP8, HummingMX

__all__ = ["LAYOUT", "HummingDescription", "HummingForm", "HummingLayout", "gemm_shapes", "layer_configs"]

BACKEND_NAME = "humming"
LAYOUT_VERSION = 1
MX_BLOCK = 32
SM_VERSION = 90  # the layout is humming's for this SM (SM100+ uses native dequant: other bytes)
HUMMING_VERSION = "0.1.19"
# (activation, w13 row order) -> humming's activation kind (vLLM humming/activation.py)
ACTIVATION_TYPES = {"interleaved": "binary_interleaved", "halves": "binary_split"}


@dataclass(frozen=True, kw_only=True)
class HummingDescription(LayoutDescription):
    """The keys of a humming output's manifest ``layout`` that the engine runner
    (:mod:`mxconv.engines.humming_moe`) reads. An MXFP4 output records no variant, only INT4 ones
    int4_codes; the defaults are what those (and outputs written before a key existed) mean: MXFP4
    weights, uint4 codes, and SM 0 (no SM recorded: refused on every GPU). w13_kernel_row_order has
    no default: every humming manifest records it."""

    variant: str = "mxfp4"  # the experts' weight format (written for MXFP8 and INT4)
    sm_version: int = 0  # the SM humming's bytes are laid out for
    w13_kernel_row_order: str  # "interleaved" | "halves"
    int4_codes: str = "uint4"  # INT4: the code form of an output written before stack_choices
    layer_configs: Mapping[str, Any] | None = None  # humming LayerConfig arguments per GEMM

    reader: ClassVar[str] = "the humming engine runner"


class HummingForm(FormBase):
    """One weight format on humming: ``part`` (``humming_mx.MXFP4`` / ``MXFP8``, ``humming_int4.INT4``)
    owns its sizes, bytes, stack choices and the manifest fields that differ (its ``codes`` argument: the
    int4_codes option, read by INT4 only); this object checks the activation, hands the part the option
    and builds the one manifest entry around the part's fields."""

    activations = ("bf16",)
    # HUMMING under each format's vLLM method: Mxfp4MoeBackend (MXFP4), WNA16MoEBackend (compressed-tensors
    # INT4 on SM90), Fp8MoeBackend (MXFP8 on SM90, prioritize_humming moves it ahead of Marlin; bf16
    # activations: VLLM_HUMMING_INPUT_QUANT_CONFIG unset)
    vllm_backends = {"bf16": ("HUMMING",)}

    def __init__(self, part: HummingMX | HummingInt4) -> None:
        self.part = part
        self.weight_format = part.weight_format
        self.bias_refusal = part.bias_refusal

    @staticmethod
    def codes(options: Any) -> str | dict[str, str]:
        """The int4_codes option as the parts take it: a form or "auto", or the recorded forms by tensor."""
        codes = options.int4_codes
        return codes if isinstance(codes, str) else dict(codes)

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: Any) -> tuple[int, int]:  # fmt: skip
        """(Hp, Ip) = (H, roundup(I, a)): the layer vLLM allocates for HUMMING (humming's own GEMM
        padding is inside the kernel tensors), a = 64 for MXFP4, 1 for MXFP8 (``humming_mx``).
        LayoutError unless H, I are multiples of 32. INT4: (H, I), nothing padded (humming_int4)."""
        check_activation(BACKEND_NAME, activation, self.activations)
        return self.part.padded_sizes(hidden_size, intermediate_size, row_order)

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the stored tensors (module table)."""
        check_activation(BACKEND_NAME, activation, self.activations)
        return self.part.kernel_specs(sizes)

    def stack_choices(self, c: CanonicalExperts, options: Any) -> dict[str, str]:
        """INT4 experts: the code form of each GEMM's stack of ``c`` (by weight tensor), as
        :meth:`to_kernel` writes it under ``options`` (``humming_int4.stack_codes``); else none."""
        return self.part.stack_choices(c, self.codes(options))

    def to_kernel(self, c: CanonicalExperts, activation: str, options: Any, kernel_choice: KernelChoice) -> KernelTensors:
        """Canonical stack -> stored tensors on ``c``'s device (module table); ``kernel_choice`` picks the
        Triton layout kernels for MX weights and scales on CUDA (same bytes), torch ops for biases and INT4."""
        check_activation(BACKEND_NAME, activation, self.activations)
        return self.part.to_kernel(c, self.codes(options), kernel_choice)

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: Any) -> CanonicalExperts:
        """Exact inverse of :meth:`to_kernel` (biases as bf16); LayoutError for a wrong tensor set,
        shape or dtype, or a padding byte other than its fill (tensor and index named)."""
        check_kernel_tensors(BACKEND_NAME, k, self.kernel_specs(sizes, activation, options))
        return self.part.from_kernel(k, sizes, self.codes(options))

    def describe(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, Any]:
        """Manifest ``layout`` fields: versions, device, padding, row order and humming's layer configs;
        the part's own fields (name, oracle, stored dtypes) in their places."""
        check_activation(BACKEND_NAME, activation, self.activations)
        v = self.part
        v.kernel_specs(sizes)  # the sizes checked against the part's padding (and INT4: no biases)
        shapes = gemm_shapes(sizes.hidden_size, sizes.padded_intermediate_size)
        # the runner's keys; variant (MXFP8, INT4) and int4_codes (INT4) are the part's own fields
        d = HummingDescription(sm_version=SM_VERSION, w13_kernel_row_order=sizes.row_order,
                               layer_configs=layer_configs(sizes, self.codes(options)))  # fmt: skip
        return {
            "name": BACKEND_NAME,
            "version": LAYOUT_VERSION,
            **v.manifest_head,
            "engine_compat": {"vllm": "0.33", "humming_kernels": HUMMING_VERSION, "gpu": f"SM{SM_VERSION} (Hopper)"},
            "activation": activation,
            "vllm_moe_backend": "HUMMING",
            **v.manifest_oracle,
            "sm_version": d.sm_version,
            "intermediate_align": v.intermediate_align,
            "gemm_padding": {"n_multiple": N_MULTIPLE, "k_multiple": K_MULTIPLE,
                             "w13": list(shapes["w13"]), "w2": list(shapes["w2"])},
            "w13_kernel_row_order": d.w13_kernel_row_order,
            "activation_type": ACTIVATION_TYPES[sizes.row_order],
            **v.storage_fields(options.int4_codes),
            "layer_configs": d.layer_configs,
        }  # fmt: skip


def layer_configs(sizes: LayoutSizes, int4_codes: str | Mapping[str, str] = "uint4") -> dict[str, dict[str, Any]]:
    """humming ``LayerConfig`` keyword arguments per GEMM, as vLLM 0.33 builds them on SM90 with bf16
    activations and no input quantization (``transform.prepare_layer_config``); MX experts with their
    format's ``b_dtype``, INT4 experts with ``int4_codes`` ("uint4" or "e0m3", or one per weight
    tensor: ``layout.stack_choices``) as their weight type and bf16 group scales."""
    part = LAYOUT.form(sizes.weight_format).part
    out = {}
    for w, (n, k, n_pad, k_pad) in gemm_shapes(sizes.hidden_size, sizes.padded_intermediate_size).items():
        out[w] = {
            "sm_version": SM_VERSION, "shape_n": n_pad, "shape_k": k_pad, "pad_shape_n": n_pad - n,
            "pad_shape_k": k_pad - k, "num_experts": sizes.num_experts, "a_dtype": "bfloat16",
            "b_dtype": None, "c_dtype": "bfloat16", "bs_dtype": "float8e8m0", "as_dtype": None,
            "input_quant_mode": "none", "input_scale_group_size": 0, "weight_scale_group_size": MX_BLOCK,
            "weight_scale_group_size_n": 0, "weight_scale_type": "group", "weight_scale_2_type": "none",
            "has_zero_point": False, "is_fp_zero_point": False, "has_bias": sizes.has_bias,
        }  # fmt: skip
        out[w].update(part.layer_config_fields(w, int4_codes))
    return out


class HummingLayout(FormsLayout):
    """vLLM 0.33 HUMMING MoE backend (humming-kernels 0.1.19), MXFP4 / MXFP8 (:mod:`humming_mx`) or
    INT4 (:mod:`humming_int4`) weights, bf16 activations, SM90; every step is its weight format's
    :class:`HummingForm`'s."""

    name = BACKEND_NAME
    version = LAYOUT_VERSION
    weight_forms = {part.weight_format: HummingForm(part) for part in (MXFP4, MXFP8, INT4)}
    options = (
        LayoutOption(
            "int4_codes", str, AUTO,
            "INT4 experts only: the codes of each GEMM's stack (auto: as humming chooses per layer, GEMM and "
            "TP rank, recorded in the manifest; uint4: offset-binary, what it keeps for a stack holding "
            "q = -8; e0m3: sign-magnitude float4e0m3, what it makes of one that does not); with uint4 or "
            "e0m3, repack refuses a stack for which humming would pick the other",
            choices=CODES,
        ),
    )
    engine_runner = "mxconv.engines.humming_moe:RUNNER"

    def with_choices(self, options: LayoutOptions | None, choices: Mapping[str, str]) -> LayoutOptions:
        """``options`` with the recorded per-stack code forms fixed (none recorded: as they are)."""
        opts = self.options_of(options)
        return dataclasses.replace(opts, int4_codes=tuple(sorted(choices.items()))) if choices else opts


LAYOUT = HummingLayout()
