"""What the vLLM plugin does for each mxconv backend: one :class:`BackendMapping` a backend.

A mapping says which vLLM MXFP4 MoE backends (``Mxfp4MoeBackend`` values of vLLM 0.33's
``fused_moe/oracle/mxfp4.py``) hold the output's bytes under vLLM's gpt-oss method
(``GptOssMxfp4MoEMethod``), which parameters of vLLM's MoE layer receive which stored tensors, and what
vLLM's conversion to kernel format (``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``) returns for
that backend, so that :meth:`BackendMapping.converted` returns exactly that, built from the stored
bytes, instead of converting. vLLM's ``create_weights`` allocates the same parameters for every
backend (uint8 ``[E, 2Ip, Hp/2]`` / ``[E, Hp, Ip/2]`` weights, uint8 scales ``[.., K/32]``, bf16 biases;
Hp, Ip rounded up per backend by ``mxfp4_round_up_hidden_size_and_intermediate_size``); a stored
tensor of that very shape and dtype is copied into its parameter (``into_params``), any other is held
aside and handed back by the conversion step, which vLLM's ``_setup_kernel`` then puts in place of the
parameter (``replace_parameter``) exactly as it does with its own conversion's result.

Each mapping also records its level of proof (:data:`PROOF`). torch- and vLLM-free: the conversions
that return objects other than plain tensors name the function building them (:mod:`.builders`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mxconv.errors import BadInput

if TYPE_CHECKING:
    from mxconv.source.manifest import Manifest

CONVERTED_ORDER = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_bias", "w2_bias")
"""The order of the six tensors vLLM's conversion to kernel format returns."""

END_TO_END = "end to end with vLLM's CPU build (tokens and logprobs equal the source's, bit for bit)"
GPU_BYTES = ("bytes + the engine's kernel on an H200; mapping checked against vLLM's Python on CPU "
             "(parameter shapes and dtypes, and the plain-torch steps of vLLM's conversion)")  # fmt: skip
GPU_BYTES_NO_RUN = ("mapping checked against vLLM's Python on CPU (parameter shapes and dtypes); no engine kernel "
                    "and no vLLM conversion of this backend runs here or on an H200")  # fmt: skip
MAPPING_ONLY = "mapping only (read from vLLM 0.33's code; nothing of it runs here)"
PROOF = (END_TO_END, GPU_BYTES, GPU_BYTES_NO_RUN, MAPPING_ONLY)

_ALL = CONVERTED_ORDER


@dataclass(frozen=True)
class BackendMapping:
    """One mxconv backend as vLLM's gpt-oss MXFP4 MoE method holds it.

    ``vllm_backends``: the ``Mxfp4MoeBackend`` values whose kernels take exactly the stored bytes (the
    first is the one the plugin names). ``into_params``: stored tensors copied at load time into
    vLLM's parameter of the same name, shape and dtype. ``kept_aside``: stored tensors in the shape
    and dtype vLLM's conversion returns (not its parameter's): held until the conversion step returns
    them. ``build``: ``"module:function"`` that makes the six returned objects from the stored tensors
    where vLLM's conversion returns more than plain tensors (triton_kernels objects, flags, layer
    state); called as ``build(mapping, tensors, layer, manifest)``. ``returns``: what vLLM 0.33's
    conversion returns for these backends, in words. ``refusal``: why the plugin cannot serve the
    backend under vLLM's gpt-oss method (the load stops with it), or None. ``proof``: see :data:`PROOF`.
    """

    backend: str
    vllm_backends: tuple[str, ...]
    into_params: tuple[str, ...] = ()
    kept_aside: tuple[str, ...] = ()
    build: str | None = None
    returns: str = ""
    refusal: str | None = None
    proof: str = MAPPING_ONLY

    @property
    def vllm_backend(self) -> str:
        """The ``Mxfp4MoeBackend`` value the plugin names for this backend."""
        return self.vllm_backends[0]

    def converted(self, params: dict[str, Any], aside: dict[str, Any], layer: Any = None,
                  manifest: Manifest | None = None) -> tuple[Any, ...]:  # fmt: skip
        """The six objects vLLM's conversion returns (:data:`CONVERTED_ORDER`): the parameters the
        loader filled, the tensors kept aside, or what :attr:`build` makes of them; None for a bias the
        output does not have."""
        if self.refusal is not None:
            raise BadInput(f"mxconv's vLLM plugin cannot serve {self.backend} outputs: {self.refusal}")
        tensors = {k: aside[k] if k in aside else params[k] for k in _ALL if k in aside or k in params}
        if self.build is not None:
            module, _, name = self.build.partition(":")
            return tuple(getattr(importlib.import_module(module), name)(self, tensors, layer, manifest))
        return tuple(tensors.get(name) for name in CONVERTED_ORDER)


CPU = BackendMapping(
    backend="cpu", vllm_backends=("CPU",),
    into_params=("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"),
    kept_aside=("w13_bias", "w2_bias"),
    returns="convert_weight_packed / convert_scale_packed bytes in the parameters' shapes (uint8); biases float32",
    proof=END_TO_END,
)  # fmt: skip

TRITON = BackendMapping(
    backend="triton", vllm_backends=("TRITON", "AITER_TRITON_MXFP4_BF16"), kept_aside=_ALL,
    build="mxconv.integrations.vllm.builders:triton_kernels_objects",
    returns=("triton_kernels Tensors (FP4 values in the arch's MX value layout) for the weights, PrecisionConfig "
             "(weight_scale Tensor in the arch's MX scale layout, FlexCtx(rhs_data=InFlexData())) for the scales, "
             "float32 biases; vLLM deletes the four weight/scale parameters and sets layer.w13_weight / "
             "layer.w2_weight and the method's w13/w2_precision_config (not replace_parameter)"),
    proof=GPU_BYTES,
)  # fmt: skip

MARLIN = BackendMapping(
    backend="marlin", vllm_backends=("MARLIN", "BATCHED_MARLIN"), kept_aside=_ALL,
    returns=("prepare_moe_mxfp4_layer_for_marlin: int32 Marlin tiles (gptq_marlin_repack per expert), "
             "float8_e8m0fnu scales (marlin_permute_scales + mxfp4_marlin_process_scales), bf16 biases "
             "(marlin_permute_bias); plain tensors"),
    proof=GPU_BYTES,
)  # fmt: skip

HUMMING = BackendMapping(
    backend="humming", vllm_backends=("HUMMING",), kept_aside=_ALL,
    returns=("convert_to_humming_moe_kernel_format rewrites the layer's parameters in place (int32 tiles, "
             "float8_e8m0fnu scales, bf16 biases) and sets layer.weight_schemas, layer.input_schemas and "
             "layer.humming_configs (humming LayerConfig per w13/w2), which vLLM's kernel set-up reads"),
    refusal=("vLLM's humming conversion also sets layer state (weight_schemas, input_schemas, humming_configs) "
             "from its humming schema code while it transforms the weights, and the plugin does not build that "
             "state yet; repack the source with --backend marlin or triton for vLLM, or run the humming output "
             "with mxconv.engines.loader"),
    proof=GPU_BYTES,
)  # fmt: skip

TRTLLM = BackendMapping(
    backend="trtllm", vllm_backends=("FLASHINFER_TRTLLM_MXFP4_BF16", "FLASHINFER_TRTLLM_MXFP4_MXFP8"),
    kept_aside=_ALL,
    returns=("gate/up rows swapped, FlashInfer's epilogue-tile row permutation per expert (uint8 weights), "
             "nvfp4_block_scale_interleave'd scales viewed float8_e4m3fn, float32 permuted biases; plain tensors"),
    proof=GPU_BYTES_NO_RUN,
)  # fmt: skip

FLASHINFER_CUTLASS = BackendMapping(
    backend="flashinfer-cutlass",
    vllm_backends=("FLASHINFER_CUTLASS_MXFP4_BF16", "FLASHINFER_CUTLASS_MXFP4_MXFP8"), kept_aside=_ALL,
    returns=("w13 rows de-interleaved and swapped to [up | gate] (weights, scales, bias to bf16); BF16 "
             "activations: interleave_moe_weights/scales_for_sm90_mixed_gemm; MXFP8: block_scale_interleave'd "
             "scales; w2 weight and bias as loaded; plain tensors"),
    proof=GPU_BYTES,  # BF16 activations: FlashInfer's SM90 CUTLASS MoE on an H200; MXFP8 (SM100): bytes only
)  # fmt: skip

AITER = BackendMapping(
    backend="aiter", vllm_backends=("AITER_MXFP4_BF16", "AITER_MXFP4_MXFP4"), kept_aside=_ALL,
    build="mxconv.integrations.vllm.builders:aiter_shuffled",
    returns=("AITER_MXFP4_BF16: w13 de-interleaved, weights shuffle_weight_a16w4'd and viewed "
             "float4_e2m1fn_x2 with is_shuffled=True, 2-D shuffle_scale_a16w4'd scales, float32 permuted biases; "
             "AITER_MXFP4_MXFP4: shuffle_weights'd float4_e2m1fn_x2 weights with is_shuffled=True, "
             "e8m0_shuffle'd uint8 scales, float32 biases"),
    proof=GPU_BYTES_NO_RUN,
)  # fmt: skip

DEEPGEMM = BackendMapping(
    backend="deepgemm", vllm_backends=("DEEPGEMM_MXFP4",),
    into_params=("w13_weight", "w2_weight", "w13_bias", "w2_bias"),
    kept_aside=("w13_weight_scale", "w2_weight_scale"),
    returns=("weights and bf16 biases as loaded; scales packed by deepgemm_post_process_weight_scale_block "
             "(int32, four E8M0 bytes a word, DeepGEMM's TMA-aligned layout); plain tensors. For gpt-oss vLLM "
             "selects it only when asked (moe_backend='deep_gemm'), and the 'served by' rule refuses it there "
             "(DeepGEMM's MXFP4 MoE has no SwiGLU-OAI): the plugin's check stops such an output"),
    proof=GPU_BYTES_NO_RUN,
)  # fmt: skip

CUTLASS = BackendMapping(
    backend="cutlass", vllm_backends=("CUTLASS_MXFP4_MXFP4",), kept_aside=_ALL,
    returns=("under Mxfp4MoEMethod (convert_weight_to_mxfp4_moe_kernel_format): weights and biases as loaded, "
             "scales swizzled by swizzle_mxfp4_scales; plain tensors"),
    refusal=("vLLM 0.33's gpt-oss conversion (convert_gpt_oss_weight_to_mxfp4_moe_kernel_format) has no "
             "CUTLASS_MXFP4_MXFP4 branch: vLLM itself stops there with 'Unsupported mxfp4_backend' on gpt-oss; "
             "repack the source with --backend trtllm, flashinfer-cutlass, marlin or triton"),
    proof=MAPPING_ONLY,
)  # fmt: skip

MAPPINGS: dict[str, BackendMapping] = {
    m.backend: m for m in (CPU, TRITON, MARLIN, HUMMING, TRTLLM, FLASHINFER_CUTLASS, AITER, DEEPGEMM, CUTLASS)
}


def mapping_for(backend: str | None, where: str = "") -> BackendMapping:
    """The mapping of mxconv backend ``backend``; BadInput naming the ones the plugin loads."""
    m = MAPPINGS.get(str(backend))
    if m is None:
        raise BadInput(f"{where}mxconv's vLLM plugin does not load {backend} outputs (it loads: "
                       f"{', '.join(f'{b} for vLLM {m.vllm_backend}' for b, m in MAPPINGS.items() if m.refusal is None)})"
                       f"; repack the source with one of those backends")  # fmt: skip
    if m.refusal is not None:
        raise BadInput(f"{where}mxconv's vLLM plugin cannot serve {backend} outputs: {m.refusal}")
    return m


def proof_table() -> list[tuple[str, str, str]]:
    """(mxconv backend, vLLM backends, level of proof) per mapping: the table the docs show."""
    return [(m.backend, " / ".join(m.vllm_backends), m.proof if m.refusal is None else f"refused: {m.refusal}")
            for m in MAPPINGS.values()]  # fmt: skip
