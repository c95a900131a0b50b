"""``--backend deepgemm --format mxfp8``: what vLLM 0.33's ``Fp8MoeBackend.DEEPGEMM`` (``DeepGemmExperts`` with
block shape [1, 32], SM100 family only) holds after loading MXFP8 experts (spec: docs/layout-deepgemm.md §8).

``CompressedTensorsW8A8Mxfp8MoEMethod`` allocates the checkpoint's tensors unpadded and sets
``weight_block_size = [1, 32]``; ``convert_to_fp8_moe_kernel_format`` (``fused_moe/oracle/fp8.py``) calls
``prepare_fp8_moe_layer_for_deepgemm`` (``quantization/utils/fp8_utils.py``): the uint8 E8M0 scales skip the
UE8M0 re-quantization (only float32 scales take it), so the e4m3 weights stay as loaded, and the scales go
through ``deepgemm_post_process_weight_scale_block`` (byte << 23 to float32, then DeepGEMM's
``transform_sf_into_required_layout`` with recipe (1, 1, 32) on SM100: packed UE8M0, MN-major), as for
``DEEPGEMM_MXFP4`` (:mod:`mxconv.layouts.deepgemm`) but with K/32 blocks padded with zero bytes to a whole
int32 word (DeepGEMM's pack reads blocks past K/32 as 0) and nothing padded by vLLM:

| name             | shape                       | dtype | content |
|------------------|-----------------------------|-------|---------|
| w13_weight       | [E, 2I, H]                  | float8_e4m3fn | the checkpoint's bytes, rows as loaded |
| w13_weight_scale | [E, ceil(H/128), 2I]        | int32 | word [e, j, n] = scale bytes (n, 4j..4j+3), low byte first, 0 past H/32 |
| w2_weight        | [E, H, I]                   | float8_e4m3fn | |
| w2_weight_scale  | [E, ceil(I/128), H]         | int32 | as w13 |

The scale tensors are the storage of the engine's ``stored.transpose(1, 2)``. The activation is called
``fp8`` (e4m3 activations with 1x32 UE8M0 scales, quantized by vLLM: ``kMxfp8Dynamic``); no expert biases
(the method creates none).

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.padding import check_fill, pad_last
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.experts.tensors import KernelTensors, TensorSpec, in_kernel_order
from mxconv.layouts.checks import check_kernel_tensors
from mxconv.layouts.forms import MXFP8_METHOD_PADDING, MXFP8_ORACLE, Mxfp8MethodForm

if TYPE_CHECKING:
    import torch

__all__ = ["MXFP8", "VLLM_BACKEND", "WEIGHT_FORMAT", "DeepgemmMxfp8"]

WEIGHT_FORMAT = "mxfp8"
VLLM_BACKEND = "DEEPGEMM"
ACTIVATION = "fp8"
PACK = 4  # UE8M0 scales per int32 word


def _words(k: int) -> int:
    return -(-(k // 32) // PACK)


def _pack(s: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, C] -> int32 [E, ceil(C/4), N]: word [e, j, n] holds bytes (n, 4j..4j+3), zero past C."""
    import torch

    from mxconv.kernels.triton_common import as_words

    E, N, C = (int(d) for d in s.shape)
    J = -(-C // PACK)
    words = pad_last(s, J * PACK, 0).reshape(E, N, J, PACK).permute(0, 2, 1, 3).contiguous()
    return as_words(words, torch.int32).reshape(E, J, N)  # a copy where ``s`` sits at an odd storage offset


def _unpack(words: torch.Tensor, cols: int, name: str) -> torch.Tensor:
    """Inverse of :func:`_pack` (LayoutError naming the index when a byte past ``cols`` is not zero)."""
    import torch

    E, J, N = (int(d) for d in words.shape)
    raw = words.contiguous().view(torch.uint8).reshape(E, J, N, PACK).permute(0, 2, 1, 3).reshape(E, N, J * PACK)
    check_fill(name, raw[..., cols:], 0, (0, 0, cols))
    return raw[..., :cols].contiguous()


class DeepgemmMxfp8(Mxfp8MethodForm):
    """The deepgemm layout's MXFP8 form (module docstring); the layout's options do not shape these bytes."""

    label = "deepgemm MXFP8"
    activation = ACTIVATION
    vllm_backend = VLLM_BACKEND
    activation_rule = ("DeepGemmExperts run MXFP8 activations (e4m3, 1x32 UE8M0 scales), the layout's activation fp8; "
                       "got {activation!r}")

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, TensorSpec]:
        """The module table's tensors."""
        H, I = self.method_sizes(sizes, activation, options)
        E = sizes.num_experts
        return in_kernel_order({
            "w13_weight": TensorSpec((E, 2 * I, H), "F8_E4M3"),
            "w13_weight_scale": TensorSpec((E, _words(H), 2 * I), "I32"),
            "w2_weight": TensorSpec((E, H, I), "F8_E4M3"),
            "w2_weight_scale": TensorSpec((E, _words(I), H), "I32"),
        })  # fmt: skip

    def to_kernel(self, c: CanonicalExperts, activation: str, options: Any, kernel_choice: KernelChoice) -> KernelTensors:
        """Canonical MXFP8 stack -> the module table's tensors on ``c``'s device (torch ops)."""
        import torch

        c.validate()
        self.kernel_specs(c.sizes(c.hidden_size, c.intermediate_size), activation, options)
        return in_kernel_order({
            "w13_weight": c.w13.contiguous().view(torch.float8_e4m3fn), "w13_weight_scale": _pack(c.w13_scale),
            "w2_weight": c.w2.contiguous().view(torch.float8_e4m3fn), "w2_weight_scale": _pack(c.w2_scale),
        })  # fmt: skip

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: Any) -> CanonicalExperts:
        """Exact inverse of :meth:`to_kernel`; LayoutError for a wrong tensor set, shape or dtype, or a
        non-zero byte in a word's blocks past K/32 (tensor and index named, in the unpacked [E, N, 4 * words] view)."""
        import torch

        check_kernel_tensors("deepgemm", k, self.kernel_specs(sizes, activation, options))
        H, I = sizes.hidden_size, sizes.intermediate_size
        return CanonicalExperts(
            k["w13_weight"].view(torch.uint8).contiguous(), _unpack(k["w13_weight_scale"], H // 32, "w13_weight_scale"),
            k["w2_weight"].view(torch.uint8).contiguous(), _unpack(k["w2_weight_scale"], I // 32, "w2_weight_scale"),
            row_order=sizes.row_order, weight_format=WEIGHT_FORMAT,
        )  # fmt: skip

    def describe(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, Any]:
        """Manifest ``layout`` fields of the MXFP8 form."""
        self.kernel_specs(sizes, activation, options)
        return {
            "name": "deepgemm",
            "version": 1,
            **MXFP8_ORACLE,
            "vllm_moe_backend": VLLM_BACKEND,
            "engine_compat": {"vllm": "0.33", "deep_gemm": "vendored by vLLM 0.33", "gpu": "SM100 family"},
            "activation": activation,
            "padding": dict(MXFP8_METHOD_PADDING),
            "w13_kernel_row_order": sizes.row_order,
            "scale_format": "ue8m0 packed 4 per int32 (low byte = lowest K block; blocks past K/32 zero), MN-major",
            "scale_storage": "[E, ceil(K/128), N] int32; the engine tensor is stored.transpose(1, 2) = [E, N, ceil(K/128)]",
            "runtime_env": {"VLLM_USE_DEEP_GEMM_E8M0": "1"},
        }


MXFP8 = DeepgemmMxfp8()
