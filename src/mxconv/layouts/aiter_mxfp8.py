"""``--backend aiter --format mxfp8``: what vLLM 0.33's ``Fp8MoeBackend.AITER_MXFP8`` (gfx950, AITER's FlyDSL
two-stage MXFP8 MoE, ``gate_mode`` INTERLEAVE) holds after loading (spec: docs/layout-aiter.md §8).

``CompressedTensorsW8A8Mxfp8MoEMethod`` allocates the checkpoint's tensors unpadded (float8_e4m3fn
[E, 2I, H] / [E, H, I], uint8 E8M0 group-32 scales, no expert biases); ``convert_to_fp8_moe_kernel_format``
(``fused_moe/oracle/fp8.py``) hands them to ``rocm_aiter_ops.shuffle_mxfp8_moe_weights`` (``_aiter_ops.py``),
which calls aiter's ``shuffle_weight``/``shuffle_scale`` (``aiter/ops/shuffle.py``). In the primitives of
docs/layout-aiter.md §2, on one byte per value:

| name             | shape                              | dtype   | bytes |
|------------------|------------------------------------|---------|-------|
| w13_weight       | [E, 2I, H]                         | float8_e4m3fn | ``W16 o GU16`` per expert (``is_guinterleave``, ``gate_up``) |
| w13_weight_scale | [E*2I, roundup(H/32, 8)]           | uint8   | columns padded with 0x7F, ``GU16``, ``S32x8`` per expert |
| w2_weight        | [E, H, I]                          | float8_e4m3fn | ``W16`` per expert |
| w2_weight_scale  | [roundup(E*H, 256), roundup(I/32, 8)] | uint8 | ``e8m0_shuffle`` of the 2-D [E*H, I/32] view (padding uninitialised upstream; mxconv writes 0x7F) |

The w13 rows are shuffled as they were loaded (vLLM's MXFP8 path reorders nothing first; its kernel reads
[gate; up] halves, the row order of every compressed-tensors MXFP8 checkpoint). Limits, each a LayoutError
naming why: H and I per rank multiples of 64 (``shuffle_weight`` views K in 64-byte groups and vLLM pads
nothing), bf16 activations (what vLLM hands the experts; aiter quantizes them to MXFP8 inside), no expert
biases (the method creates none).

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import CanonicalExperts, LayoutSizes, round_up
from mxconv.experts.tensors import KernelTensors, TensorSpec, in_kernel_order
from mxconv.layouts.aiter_bytemap import (
    SCALE_PAD_FILL, e8m0_shuffle, e8m0_unshuffle, gu16, gu16_inverse, shuffle_scale_a16w4, unshuffle_scale_a16w4,
    w16_bytes, w16_inverse,
)
from mxconv.layouts.checks import check_kernel_tensors
from mxconv.layouts.forms import MXFP8_METHOD_PADDING, MXFP8_ORACLE, Mxfp8MethodForm

if TYPE_CHECKING:
    import torch

__all__ = ["MXFP8", "VLLM_BACKEND", "WEIGHT_FORMAT", "AiterMxfp8"]

WEIGHT_FORMAT = "mxfp8"
VLLM_BACKEND = "AITER_MXFP8"
ACTIVATION = "bf16"
K_GROUP = 64  # shuffle_weight(is_guinterleave): K_pk // (KLane 4 * KPack 16) bytes a group


def _check_pad(name: str, view: torch.Tensor, keep_rows: int, keep_cols: int) -> None:
    """LayoutError unless every byte of the unshuffled 2-D ``view`` outside [:keep_rows, :keep_cols] is 0x7F."""
    for part, (r0, c0) in ((view[:, keep_cols:], (0, keep_cols)), (view[keep_rows:, :keep_cols], (keep_rows, 0))):
        bad = (part != SCALE_PAD_FILL).nonzero()
        if len(bad):
            r, q = (int(v) for v in bad[0].tolist())
            raise LayoutError(f"aiter MXFP8: {name} padding at [{r0 + r}, {c0 + q}] of the unshuffled [rows, scale columns] "
                              f"view holds {int(part[r, q])}, expected {SCALE_PAD_FILL} (0x7F)")  # fmt: skip


class AiterMxfp8(Mxfp8MethodForm):
    """The aiter layout's MXFP8 form (module docstring); ``options``: the layout's AiterOptions."""

    label = "aiter MXFP8"
    activation = ACTIVATION
    vllm_backend = VLLM_BACKEND
    activation_rule = ("vLLM's AITER_MXFP8 experts take bf16 activations (aiter quantizes them to MXFP8 per 1x32 "
                       "inside fused_moe), got activation {activation!r}")
    whole_layers = ("aiter MXFP8's w2_weight_scale is one e8m0_shuffle of the layer's [E*H, I/32] scales, in 256-row "
                    "tiles that cross experts and padded at the end, so a layer is laid out whole")

    def check_sizes(self, hidden_size: int, intermediate_size: int) -> None:
        """LayoutError unless both are multiples of 64 (per rank)."""
        for what, size in (("hidden", hidden_size), ("intermediate", intermediate_size)):
            if size % K_GROUP:
                raise LayoutError(f"aiter MXFP8: {what} size {size} per rank is not a multiple of {K_GROUP}: aiter's "
                                  "shuffle_weight views K in 64-byte groups and vLLM's MXFP8 methods pad nothing")  # fmt: skip

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, TensorSpec]:
        """The module table's tensors."""
        H, I = self.method_sizes(sizes, activation, options)
        E = sizes.num_experts
        return in_kernel_order({
            "w13_weight": TensorSpec((E, 2 * I, H), "F8_E4M3"),
            "w13_weight_scale": TensorSpec((E * 2 * I, round_up(H // 32, 8)), "U8"),
            "w2_weight": TensorSpec((E, H, I), "F8_E4M3"),
            "w2_weight_scale": TensorSpec((round_up(E * H, 256), round_up(I // 32, 8)), "U8"),
        })  # fmt: skip

    def to_kernel(self, c: CanonicalExperts, activation: str, options: Any, kernel_choice: KernelChoice) -> KernelTensors:
        """Canonical MXFP8 stack -> the module table's tensors on ``c``'s device (torch ops)."""
        import torch

        c.validate()
        E, H, I = c.num_experts, c.hidden_size, c.intermediate_size
        self.kernel_specs(c.sizes(H, I), activation, options)
        return in_kernel_order({
            "w13_weight": w16_bytes(gu16(c.w13).contiguous()).view(torch.float8_e4m3fn),
            "w13_weight_scale": shuffle_scale_a16w4(c.w13_scale, gate_up=True).contiguous(),
            "w2_weight": w16_bytes(c.w2.contiguous()).view(torch.float8_e4m3fn),
            "w2_weight_scale": e8m0_shuffle(c.w2_scale.reshape(E * H, I // 32)).contiguous(),
        })  # fmt: skip

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: Any) -> CanonicalExperts:
        """Exact inverse of :meth:`to_kernel`. LayoutError for a wrong tensor set, shape or dtype, or scale
        padding other than 0x7F (w2's, which aiter leaves uninitialised, only with the option
        ``check_undefined_scale_padding``)."""
        import torch

        check_kernel_tensors("aiter", k, self.kernel_specs(sizes, activation, options))
        E, H, I = sizes.num_experts, sizes.hidden_size, sizes.intermediate_size
        s13 = unshuffle_scale_a16w4(k["w13_weight_scale"], E, gate_up=True)
        _check_pad("w13_weight_scale", s13.reshape(E * 2 * I, -1), E * 2 * I, H // 32)
        s2 = e8m0_unshuffle(k["w2_weight_scale"])
        if options.check_undefined_scale_padding:
            _check_pad("w2_weight_scale", s2, E * H, I // 32)
        return CanonicalExperts(
            gu16_inverse(w16_inverse(k["w13_weight"].view(torch.uint8))).contiguous(), s13[..., : H // 32].contiguous(),
            w16_inverse(k["w2_weight"].view(torch.uint8)).contiguous(), s2[: E * H, : I // 32].reshape(E, H, I // 32).contiguous(),
            row_order=sizes.row_order, weight_format=WEIGHT_FORMAT,
        )  # fmt: skip

    def describe(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, Any]:
        """Manifest ``layout`` fields of the MXFP8 form."""
        self.kernel_specs(sizes, activation, options)
        H, I, E = sizes.hidden_size, sizes.intermediate_size, sizes.num_experts
        return {
            "name": "aiter",
            "version": 1,
            **MXFP8_ORACLE,
            "vllm_backend": VLLM_BACKEND,
            "engine_compat": {"vllm": "0.33", "aiter": "fused_moe with gate_mode (>= 0.1.14)", "gfx": "gfx950"},
            "activation": activation,
            "kernel": "FlyDSL a8w8 MXFP8 (fused_moe per_1x32, gate_mode INTERLEAVE; activations quantized inside)",
            "is_shuffled": True,
            "padding": dict(MXFP8_METHOD_PADDING),
            "weight_shuffle": "W16 o GU16 (w13), W16 (w2), one byte a value",
            "weight_tile": [16, 16],
            "w13_kernel_row_order": "gate_up_16row_blocks" if sizes.row_order == "halves" else "16row_blocks_of_interleaved_rows",
            "scale_shuffle": "shuffle_scale(is_guinterleave, gate_up) (w13), e8m0_shuffle (w2)",
            "scale_layout": "2d: w13 [E*2I, round_up(H/32,8)], w2 [round_up(E*H,256), round_up(I/32,8)]",
            "scale_pad_fill": SCALE_PAD_FILL,
            "scale_pad_defined_upstream": (E * H) % 256 == 0 and (I // 32) % 8 == 0,
            "torch_dtype": {"w13_weight": "float8_e4m3fn", "w2_weight": "float8_e4m3fn",
                            "w13_weight_scale": "uint8", "w2_weight_scale": "uint8"},
        }  # fmt: skip


MXFP8 = AiterMxfp8()
