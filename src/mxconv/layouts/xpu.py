"""``--backend xpu``: what vLLM 0.33's ``Fp8MoeBackend.XPU`` (Intel Xe2/Xe3 GPUs, ``XPUExpertsMxFp8`` over
``vllm_xpu_kernels``' fused MoE) holds after loading MXFP8 experts.

``CompressedTensorsW8A8Mxfp8MoEMethod`` allocates the checkpoint's tensors unpadded (float8_e4m3fn
[E, 2I, H] / [E, H, I], uint8 E8M0 group-32 scales [E, 2I, H/32] / [E, H, I/32], no expert biases);
``process_weights_after_loading`` hands them to ``convert_to_fp8_moe_kernel_format``
(``fused_moe/oracle/fp8.py``), whose XPU branch calls ``prepare_fp8_moe_layer_for_xpu``
(``fused_moe/experts/xpu_moe.py``): every weight and every 3-d scale tensor has its last two axes
swapped and is made contiguous. Nothing is padded, no byte changes value, dtypes stay as allocated:

| name             | shape           | dtype         | content |
|------------------|-----------------|---------------|---------|
| w13_weight       | [E, H, 2I]      | float8_e4m3fn | canonical w13 [E, 2I, H] with its last two axes swapped |
| w13_weight_scale | [E, H/32, 2I]   | uint8 (E8M0)  | canonical w13 scales [E, 2I, H/32], the same |
| w2_weight        | [E, I, H]       | float8_e4m3fn | canonical w2 [E, H, I], the same |
| w2_weight_scale  | [E, I/32, H]    | uint8 (E8M0)  | canonical w2 scales [E, H, I/32], the same |

The 2I axis keeps the rows as loaded: vLLM's MXFP8 path reorders nothing, and a compressed-tensors MXFP8
checkpoint holds [gate; up] halves (``halves``); an ``interleaved`` stack keeps its order, recorded in
``w13_kernel_row_order`` (as the other MXFP8 forms record it). Activations: vLLM hands the XPU experts
bf16 hidden states (``XPUExperts.expects_unquantized_inputs`` on Xe2/Xe3) under an MXFP8 quant config
(``quant_dtype`` mxfp8, ``kMxfp8Dynamic``), so the layout's activation is ``bf16`` and the quantization to
MXFP8 is the kernel's. Refusals (LayoutError): another activation, sizes that are not multiples of 32,
expert biases (the method creates none), and MXFP4 experts: vLLM's ``Mxfp4MoeBackend.XPU`` runs the
checkpoint's MXFP4 tensors as loaded (``convert_weight_to_mxfp4_moe_kernel_format`` does nothing for it),
so a ``quantize`` MXFP4 output holds XPU's bytes wherever vLLM pads nothing (a compressed-tensors one always; a
gpt-oss one, whose method rounds I up to 64 for XPU, when each rank's I is a multiple of 64).

No Intel XPU kernel runs here (``vllm_xpu_kernels`` needs an Intel GPU), so ``verify --kernel`` has no
runner; the bytes are checked against vLLM's own ``prepare_fp8_moe_layer_for_xpu`` on CPU
(tests/test_vllm_xpu.py) and a plain-torch model (tests/test_layout_xpu.py).

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.experts.kernel_settings import KernelChoice, KernelLocations
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.experts.tensors import KernelTensors, TensorSpec, in_kernel_order
from mxconv.layouts.checks import check_kernel_tensors
from mxconv.layouts.forms import FormsLayout, MXFP8_METHOD_PADDING, MXFP8_ORACLE, Mxfp8MethodForm

if TYPE_CHECKING:
    import torch

    from mxconv.source.manifest import Manifest

__all__ = ["LAYOUT", "MXFP8", "VLLM_BACKEND", "XpuLayout", "XpuMxfp8"]

NAME = "xpu"
VLLM_BACKEND = "XPU"  # Fp8MoeBackend value
ACTIVATION = "bf16"
WEIGHT_FORMAT = "mxfp8"
WEIGHT_NAMES = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
MXFP4_REFUSAL = ("vLLM 0.33's Mxfp4MoeBackend.XPU runs MXFP4 experts on the checkpoint's tensors as loaded "
                 "(convert_weight_to_mxfp4_moe_kernel_format changes nothing for XPU): it holds the canonical MXFP4 "
                 "output of quantize where vLLM pads nothing (compressed-tensors: always; gpt-oss: when each rank's "
                 "intermediate size is a multiple of 64; inspect names the backends holding an output); this layout is "
                 "the MXFP8 form (Fp8MoeBackend.XPU, prepare_fp8_moe_layer_for_xpu)")  # fmt: skip


def _swap_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` [E, A, B] -> [E, B, A], contiguous: what prepare_fp8_moe_layer_for_xpu does to each tensor."""
    return t.transpose(-1, -2).contiguous()


class XpuMxfp8(Mxfp8MethodForm):
    """The xpu layout's MXFP8 form (module docstring); the layout has no options."""

    label = "xpu MXFP8"
    activation = ACTIVATION
    vllm_backend = VLLM_BACKEND
    activation_rule = ("vLLM hands the XPU experts bf16 hidden states (XPUExperts.expects_unquantized_inputs) and "
                       "the XPU kernel quantizes them to MXFP8; got activation {activation!r}")  # fmt: skip

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, TensorSpec]:
        """The module table's tensors."""
        H, I = self.method_sizes(sizes, activation, options)
        E = sizes.num_experts
        return in_kernel_order({
            "w13_weight": TensorSpec((E, H, 2 * I), "F8_E4M3"),
            "w13_weight_scale": TensorSpec((E, H // 32, 2 * I), "U8"),
            "w2_weight": TensorSpec((E, I, H), "F8_E4M3"),
            "w2_weight_scale": TensorSpec((E, I // 32, H), "U8"),
        })  # fmt: skip

    def to_kernel(self, c: CanonicalExperts, activation: str, options: Any, kernel_choice: KernelChoice) -> KernelTensors:
        """Canonical MXFP8 stack -> the module table's tensors on ``c``'s device (torch ops)."""
        import torch

        c.validate()
        self.kernel_specs(c.sizes(c.hidden_size, c.intermediate_size), activation, options)
        return in_kernel_order({
            "w13_weight": _swap_last(c.w13).view(torch.float8_e4m3fn), "w13_weight_scale": _swap_last(c.w13_scale),
            "w2_weight": _swap_last(c.w2).view(torch.float8_e4m3fn), "w2_weight_scale": _swap_last(c.w2_scale),
        })  # fmt: skip

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: Any) -> CanonicalExperts:
        """Exact inverse of :meth:`to_kernel`; LayoutError for a wrong tensor set, shape or dtype (nothing is
        padded, so no fill to check)."""
        import torch

        check_kernel_tensors(NAME, k, self.kernel_specs(sizes, activation, options))
        w13, s13, w2, s2 = (_swap_last(k[n].view(torch.uint8)) for n in WEIGHT_NAMES)
        return CanonicalExperts(w13, s13, w2, s2, row_order=sizes.row_order, weight_format=WEIGHT_FORMAT)

    def describe(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, Any]:
        """Manifest ``layout`` fields of the MXFP8 form."""
        self.kernel_specs(sizes, activation, options)
        return {
            "name": NAME,
            "version": 1,
            **MXFP8_ORACLE,
            "vllm_moe_backend": VLLM_BACKEND,
            "engine_compat": {"vllm": "0.33", "gpu": "Intel Xe2/Xe3"},
            "activation": activation,
            "kernel": "XPUExpertsMxFp8 (vllm_xpu_kernels XpuFusedMoe; bf16 hidden states in, quant_dtype mxfp8)",
            "padding": dict(MXFP8_METHOD_PADDING),
            "transform": "prepare_fp8_moe_layer_for_xpu: weights and scales with their last two axes swapped, contiguous",
            "w13_kernel_row_order": sizes.row_order,
            "scale_dtype": "uint8 E8M0",
            "torch_dtype": {"w13_weight": "float8_e4m3fn", "w2_weight": "float8_e4m3fn",
                            "w13_weight_scale": "uint8", "w2_weight_scale": "uint8"},
        }  # fmt: skip


MXFP8 = XpuMxfp8()


class XpuLayout(FormsLayout):
    """vLLM's Intel XPU MoE experts (``Fp8MoeBackend.XPU``) for MXFP8 experts; MXFP4 experts are refused
    (:data:`MXFP4_REFUSAL`: vLLM's XPU backend loads the canonical MXFP4 output as it is, where unpadded)."""

    name = NAME
    version = 1
    weight_forms = {WEIGHT_FORMAT: MXFP8}
    weight_format_refusals = {"mxfp4": MXFP4_REFUSAL}

    def kernel_unavailable(self, manifest: Manifest, device: Any = "cuda",
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        """No Intel XPU kernel runs here."""
        return ("vLLM's XPU MoE kernels (vllm_xpu_kernels XpuFusedMoe) need an Intel Xe2/Xe3 GPU; mxconv has no "
                "runner for them")  # fmt: skip


LAYOUT = XpuLayout()
