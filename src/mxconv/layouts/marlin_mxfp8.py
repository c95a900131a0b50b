"""``--backend marlin`` for MXFP8 experts: what vLLM 0.33's ``prepare_mxfp8_moe_layer_for_marlin``
(``quantization/utils/marlin_utils_fp8.py``, weight block [1, 32], ``Fp8MoeBackend.MARLIN``) holds
(spec: docs/layout-marlin.md §13).

Per layer and TP rank, from the MXFP8 method's parameters (float8_e4m3fn [E, 2I, H] / [E, H, I], uint8
E8M0 scales, nothing padded by the method):

1. the intermediate size is padded to Ip = roundup(I, 64) (``marlin_moe_padded_intermediate`` with
   group 32): w13 and its scales **per half** (``_moe_pad_shard_rows`` views w13 as [E, 2, I, ...]),
   w2 and its scales on the last axis, zeros everywhere;
2. weights: per expert ``pack_fp8_to_int32`` + transpose + ``gptq_marlin_repack(num_bits=8)`` ->
   int32 [K/16, 4N] (:func:`repack_bytes`: the 16 x 64 tiles of Marlin's 16-bit activations, four
   bytes a word, byte order 0, 2, 1, 3 of each thread's four k);
3. scales: per expert transposed to [K/32, N], bf16 and back (exact), ``marlin_permute_scales``
   (group 32 < K) then ``mxfp8_marlin_process_scales`` -> float8_e8m0fnu [K/32, N]: the same byte
   permutation as MXFP4's 16-bit map (``marlin_bytemap.scale_perm_bf16``).

| name             | shape            | dtype |
|------------------|------------------|-------|
| w13_weight       | [E, H/16, 8*Ip]  | int32 |
| w13_weight_scale | [E, H/32, 2*Ip]  | float8_e8m0fnu |
| w2_weight        | [E, Ip/16, 4*H]  | int32 |
| w2_weight_scale  | [E, Ip/32, H]    | float8_e8m0fnu |

The layer's sizes stay (H, I) (what the method allocates: the manifest's padded sizes); Ip is inside
the tensors. Limits, each a refusal (LayoutError) naming why: H % 64 (``gptq_marlin_repack`` needs
w2's N = H in 64-wide tiles), bf16 activations and the current scale layout only, no expert biases
(the MXFP8 path neither pads nor permutes them), and interleaved w13 rows only when I % 64 == 0
(the per-half padding would split gate/up pairs).

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.padding import check_fill
from mxconv.experts.stack import CanonicalExperts, LayoutSizes, round_up
from mxconv.experts.tensors import KernelTensors, TensorSpec, in_kernel_order
from mxconv.layouts.checks import check_block_sizes, check_kernel_tensors
from mxconv.layouts.forms import FormBase
from mxconv.layouts.gathers import gather_padded_rows, layout_kernels
from mxconv.layouts.marlin_description import MarlinDescription
from mxconv.layouts.marlin_bytemap import check_scale_mode, marlin_unscales
from mxconv.layouts.marlin_scales import ScaleJob, kernel_scales, row_table

if TYPE_CHECKING:
    import torch

__all__ = ["MXFP8", "MarlinMxfp8", "repack_bytes", "unrepack_bytes"]

WEIGHT_FORMAT = "mxfp8"
INTERMEDIATE_MULTIPLE = 64  # marlin_moe_padded_intermediate(I, 32): lcm(64, 32)
HIDDEN_MULTIPLE = 64  # gptq_marlin_repack's N tile (w2: N = H); vLLM pads H for nothing here
VLLM_COMPAT = "0.33"
BIAS_REFUSAL = ("marlin MXFP8 takes no expert biases: vLLM's prepare_mxfp8_moe_layer_for_marlin neither pads "
                "nor permutes them (the MXFP4 path does), so no verified layout holds them")

# Q[N, K] of one expert as digits (n: nt, j, blk, thc; k: kt, p0, thr, p1), most significant first:
#   n = 64 nt + 16 j + 8 blk + thc,  k = 16 kt + 8 p0 + 2 thr + p1
# and the stream order: word 32 thc + 8 thr + 2 j + blk of tile (kt, nt), byte p = 2 p1 + p0.
_DIGITS = ("nt", "j", "blk", "thc", "kt", "p0", "thr", "p1")
_STREAM = ("kt", "nt", "thc", "thr", "j", "blk", "p1", "p0")
_ORDER = tuple(_DIGITS.index(d) for d in _STREAM)
_ORDER_INV = tuple(_ORDER.index(i) for i in range(len(_ORDER)))


def _check_dims(N: int, K: int, name: str) -> None:
    if N % 64 or K % 16:
        raise LayoutError(f"{name}: Marlin's 8-bit repack needs N % 64 == 0 and K % 16 == 0, got N = {N}, K = {K}")


def repack_bytes(q: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """uint8 [E, N, K] (one E4M3 byte a value, padded) -> Marlin int32 [E, K/16, 4N]."""
    import torch

    E, N, K = (int(d) for d in q.shape)
    _check_dims(N, K, name)
    view = q.reshape(E, N // 64, 4, 2, 8, K // 16, 2, 4, 2)
    return view.permute(0, *(p + 1 for p in _ORDER)).reshape(E, K // 16, 16 * N).view(torch.int32)


def unrepack_bytes(words: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Inverse of :func:`repack_bytes`: int32 [E, K/16, 4N] -> uint8 [E, N, K]."""
    import torch

    E, k16, n4 = (int(d) for d in words.shape)
    N, K = n4 // 4, 16 * k16
    _check_dims(N, K, name)
    stream = words.contiguous().view(torch.uint8).view(E, K // 16, N // 64, 8, 4, 4, 2, 2, 2)
    return stream.permute(0, *(p + 1 for p in _ORDER_INV)).reshape(E, N, K).contiguous()


class MarlinMxfp8(FormBase):
    """The marlin layout's MXFP8 form (module docstring). ``options``: the layout's MarlinOptions."""

    weight_format = WEIGHT_FORMAT
    activations = ("bf16",)
    bias_refusal = BIAS_REFUSAL
    # Fp8MoeBackend.MARLIN (fused_moe/oracle/mxfp8.py; prepare_mxfp8_moe_layer_for_marlin)
    vllm_backends = {"bf16": ("MARLIN",)}

    def check(self, activation: str, options: Any) -> None:
        scale_layout = options.marlin_scale_layout
        check_scale_mode(activation, scale_layout)
        if activation != "bf16" or scale_layout != "current":
            raise LayoutError("marlin MXFP8: vLLM 0.33's prepare_mxfp8_moe_layer_for_marlin has one form, bf16 activations "
                              f"and the current scale layout (got activation {activation}, scale layout {scale_layout})")

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: Any) -> tuple[int, int]:  # fmt: skip
        """(H, I): the MXFP8 method pads nothing (the 64-padding of I is inside the tensors)."""
        self.check(activation, options)
        check_block_sizes("marlin MXFP8", hidden_size, intermediate_size, row_order, 32)
        if hidden_size % HIDDEN_MULTIPLE:
            raise LayoutError(f"marlin MXFP8: hidden size {hidden_size} is not a multiple of {HIDDEN_MULTIPLE}: vLLM pads "
                              "nothing and gptq_marlin_repack needs w2's N = H in 64-wide tiles")  # fmt: skip
        if row_order == "interleaved" and intermediate_size % INTERMEDIATE_MULTIPLE:
            raise LayoutError(f"marlin MXFP8: intermediate size {intermediate_size} per rank is not a multiple of "
                              f"{INTERMEDIATE_MULTIPLE} and w13 rows are interleaved: vLLM pads each half of w13 on its own "
                              "(_moe_pad_shard_rows), which splits gate/up pairs")  # fmt: skip
        return hidden_size, intermediate_size

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, TensorSpec]:
        H, I = self.padded_sizes(sizes.hidden_size, sizes.intermediate_size, sizes.row_order, activation, options)
        if (sizes.padded_hidden_size, sizes.padded_intermediate_size) != (H, I):
            raise LayoutError(f"marlin MXFP8: padded sizes must equal (H, I) = {(H, I)} (vLLM's MXFP8 methods pad nothing)")
        if sizes.has_bias:
            raise LayoutError(BIAS_REFUSAL)
        E, Ip = sizes.num_experts, round_up(I, INTERMEDIATE_MULTIPLE)
        return in_kernel_order({
            "w13_weight": TensorSpec((E, H // 16, 8 * Ip), "I32"),
            "w13_weight_scale": TensorSpec((E, H // 32, 2 * Ip), "F8_E8M0"),
            "w2_weight": TensorSpec((E, Ip // 16, 4 * H), "I32"),
            "w2_weight_scale": TensorSpec((E, Ip // 32, H), "F8_E8M0"),
        })  # fmt: skip

    def to_kernel(self, c: CanonicalExperts, activation: str, options: Any,
                  kernel_choice: KernelChoice) -> KernelTensors:  # fmt: skip
        """Canonical MXFP8 stack -> the tensors of the module table, on ``c``'s device; ``kernel_choice``
        picks the Triton layout kernels (CUDA) or torch ops (same bytes)."""
        c.validate()
        H, I = c.hidden_size, c.intermediate_size
        self.kernel_specs(c.sizes(H, I), activation, options)
        Ip = round_up(I, INTERMEDIATE_MULTIPLE)
        tab13 = row_table(2 * I, 2 * Ip, "halves", None, c.device)  # per half, whatever the order (vLLM's rule)
        tab2 = row_table(H, H, None, None, c.device)
        lt = layout_kernels(c.w13, kernel_choice)
        if lt is not None:
            weights = {"w13_weight": lt.byte_tile_stream(c.w13, tab13, H, lt.TileOrder.MARLIN),
                       "w2_weight": lt.byte_tile_stream(c.w2, tab2, Ip, lt.TileOrder.MARLIN)}  # fmt: skip
        else:
            weights = {"w13_weight": repack_bytes(gather_padded_rows(c.w13, tab13), "w13_weight"),
                       "w2_weight": repack_bytes(gather_padded_rows(c.w2, tab2, Ip), "w2_weight")}  # fmt: skip
        # the scales take MXFP4's bf16 byte map (module docstring, step 3)
        scale_jobs = (ScaleJob("w13_weight_scale", c.w13_scale, 2 * I, 2 * Ip, H // 32, "halves"),
                      ScaleJob("w2_weight_scale", c.w2_scale, H, H, Ip // 32, None))  # fmt: skip
        scales = {job.name: kernel_scales(lt, job, "bf16", "current") for job in scale_jobs}
        return in_kernel_order({**weights, **scales})

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: Any) -> CanonicalExperts:
        """Exact inverse of :meth:`to_kernel`; LayoutError for a wrong tensor set, shape or dtype, or a
        padding byte other than zero (tensor and index named)."""
        import torch

        check_kernel_tensors("marlin", k, self.kernel_specs(sizes, activation, options))
        H, I = sizes.hidden_size, sizes.intermediate_size
        Ip = round_up(I, INTERMEDIATE_MULTIPLE)
        parts: dict[str, Any] = {}
        for w, cols in (("w13", H), ("w2", Ip)):
            weight = unrepack_bytes(k[f"{w}_weight"], f"{w}_weight")
            scale = marlin_unscales(k[f"{w}_weight_scale"].view(torch.uint8), name=f"{w}_weight_scale")
            parts[w], parts[f"{w}_scale"] = weight, scale
        for name, t, keep in (("w13_weight", parts["w13"], None), ("w13_weight_scale", parts["w13_scale"], None),
                              ("w2_weight", parts["w2"], I), ("w2_weight_scale", parts["w2_scale"], I // 32)):  # fmt: skip
            if keep is None:  # w13: rows [I, Ip) and [Ip + I, 2Ip) are vLLM's per-half padding
                check_fill(name, t[:, I:Ip], 0, (0, I, 0))
                check_fill(name, t[:, Ip + I:], 0, (0, Ip + I, 0))
            else:
                check_fill(name, t[..., keep:], 0, (0, 0, keep))
        rows = torch.cat([torch.arange(I), torch.arange(Ip, Ip + I)]).to(parts["w13"].device)
        return CanonicalExperts(
            parts["w13"].index_select(1, rows).contiguous(), parts["w13_scale"].index_select(1, rows).contiguous(),
            parts["w2"][..., :I].contiguous(), parts["w2_scale"][..., : I // 32].contiguous(),
            row_order=sizes.row_order, weight_format=WEIGHT_FORMAT,
        )  # fmt: skip

    def describe(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, Any]:
        self.kernel_specs(sizes, activation, options)
        d = MarlinDescription(variant=WEIGHT_FORMAT, activation=activation, scale_layout=options.marlin_scale_layout)
        return {
            "name": "marlin",
            "version": 1,
            "variant": d.variant,
            "vllm_oracle": "Fp8MoeBackend",
            "engine_compat": {"vllm": VLLM_COMPAT},
            "activation": d.activation,
            "weight_tile": {"k": 16, "n": 64},
            "weight_bits": 8,
            "scale_layout": d.scale_layout,
            "scale_chunk": 64,
            "padding": {"hidden_multiple": 1, "intermediate_multiple": INTERMEDIATE_MULTIPLE,
                        "marlin_intermediate_size": round_up(sizes.intermediate_size, INTERMEDIATE_MULTIPLE)},
        }  # fmt: skip


MXFP8 = MarlinMxfp8()
