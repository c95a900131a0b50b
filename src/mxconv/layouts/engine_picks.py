"""What an engine picks by default for a checkpoint, per GPU: the data behind ``mxconv inspect --engine``.

One row (:class:`Pick`) per (engine, source kind, GPU): the MoE backend the engine's own selection
code settles on with default settings (``moe_backend`` auto, no environment overrides, tensor
parallel only, the engine's declared dependencies installed), named as the engine names it, with the
file and function it comes from (paths under ``vllm/model_executor/layers/`` for vLLM 0.33.0 and
``sglang/srt/`` for SGLang 0.5.23) and why the candidates before it do not run.

This module holds the engines' picks only. Which mxconv output holds a backend's bytes, under which
vLLM quantization method, is :func:`mxconv.layouts.vllm_serving.vllm_serving` (the rule the manifest
uses too); :mod:`mxconv.layouts.engine_report` joins them. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

VLLM = "vllm-0.33"
SGLANG = "sglang-0.5.23"
ENGINES = (VLLM, SGLANG)


class Gpu(StrEnum):
    """The devices vLLM 0.33's MoE selection tells apart: Hopper (capability 9.0: HUMMING ahead of
    Marlin, FlashInfer CUTLASS W4A16), the SM100 family (TRT-LLM-gen, CUTLASS MXFP4), the SM120
    family (TRITON after Marlin), MI355 (gfx950, AITER / ROCm triton_kernels) and the CPU (AMX)."""

    SM90 = "sm90"
    SM100 = "sm100"
    SM120 = "sm120"
    GFX950 = "gfx950"
    CPU = "cpu"


class SourceKind(StrEnum):
    """What an engine sees in a checkpoint's ``quantization_config`` (and the quant method it builds)."""

    GPT_OSS_MXFP4 = "gpt-oss-mxfp4"  # quant_method mxfp4, model_type gpt_oss: GptOssMxfp4MoEMethod
    MXFP4 = "mxfp4"  # quant_method mxfp4 on any other model: Mxfp4MoEMethod
    CT_MXFP4 = "ct-mxfp4"  # compressed-tensors mxfp4-pack-quantized: CompressedTensorsW4A4Mxfp4MoEMethod
    CT_MXFP8 = "ct-mxfp8"  # compressed-tensors mxfp8-quantized: CompressedTensorsW8A8Mxfp8MoEMethod
    CT_INT4 = "ct-int4"  # compressed-tensors pack-quantized int4 group 32: CompressedTensorsWNA16MoEMethod
    MXCONV_MXFP8 = "mxconv-gpt-oss-mxfp8"  # quant_method null + mxconv_quant_method mxfp8


@dataclass(frozen=True)
class Pick:
    """The backend ``engine`` picks by default for ``source`` on ``gpu``; ``backend`` None: it has no
    working default there (``why`` says what happens)."""

    engine: str
    source: SourceKind
    gpu: Gpu
    backend: str | None
    cite: str  # "file: function[, function]" in the engine's source
    why: str


_GPT_OSS = "fused_moe/oracle/mxfp4.py: _get_priority_backends_for_gpt_oss, select_mxfp4_moe_backend"
_GENERIC = "fused_moe/oracle/mxfp4.py: _get_priority_backends, select_deepseek_v4_mxfp4_moe_backend"
_CT_MX4 = ("quantization/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_w4a4_mxfp4.py: "
           "CompressedTensorsW4A4Mxfp4MoEMethod.__init__")
_CT_CUTLASS = _CT_MX4 + "; fused_moe/oracle/mxfp4.py: backend_to_kernel_cls"  # CUTLASS_MXFP4_MXFP4 -> CutlassExpertsMxfp4
_WNA16 = "fused_moe/oracle/int_wna16.py: _get_priority_backends, select_wna16_moe_backend"
_MXFP8 = "fused_moe/oracle/mxfp8.py: _SUPPORTED_BACKENDS, select_mxfp8_moe_backend"
_HUMMING_FIRST = "prioritize_humming (quantization/utils/humming/priority.py) moves HUMMING ahead of Marlin on capability 90"
_NO_AITER = "AITER needs VLLM_ROCM_USE_AITER=1 (off by default)"
_NATIVE_MXFP8 = "; fused_moe/experts/mxfp8_native_moe.py: Mxfp8NativeTritonExperts._supports_current_device"
# fused_moe/experts/deep_gemm_moe.py:178-188 (vLLM's wheel vendors deep_gemm: utils/import_utils.py has_deep_gemm)
_DG_MXFP8 = "DeepGemmExperts._supports_quant_scheme takes (kMxfp8Static, kMxfp8Dynamic) on capability family 100 only"
_FP8_AS_IS = "fused_moe/oracle/fp8.py: convert_to_fp8_moe_kernel_format changes nothing for it"

PICKS: tuple[Pick, ...] = (
    # gpt-oss MXFP4: no activation key declared, so _filter_by_activation keeps the BF16-activation variants
    Pick(VLLM, SourceKind.GPT_OSS_MXFP4, Gpu.SM90, "TRITON", _GPT_OSS,
         "FLASHINFER_TRTLLM runs on the SM100 family only, AITER on ROCm only; the OAI Triton experts run SM90 to SM12x"),
    Pick(VLLM, SourceKind.GPT_OSS_MXFP4, Gpu.SM100, "FLASHINFER_TRTLLM_MXFP4_BF16", _GPT_OSS,
         "first in the list; TrtLlmMxfp4Experts run on the SM100 family"),
    Pick(VLLM, SourceKind.GPT_OSS_MXFP4, Gpu.SM120, "MARLIN", _GPT_OSS,
         "on the SM120 family TRITON moves after BATCHED_MARLIN; FLASHINFER_CUTLASS_MXFP4_BF16 takes BF16 "
         "activations on capability 9.0 only (FlashInferExperts._supports_quant_scheme)"),
    Pick(VLLM, SourceKind.GPT_OSS_MXFP4, Gpu.GFX950, "TRITON", _GPT_OSS,
         f"{_NO_AITER}; with it AITER_MXFP4_BF16; the OAI Triton experts run on gfx9"),
    Pick(VLLM, SourceKind.GPT_OSS_MXFP4, Gpu.CPU, "CPU", _GPT_OSS + "; fused_moe/experts/cpu_moe.py: CPUExpertsMxfp4",
         "CPUExpertsMxfp4 needs x86 with AMX tiles"),
    # generic quant_method mxfp4 (Mxfp4MoEMethod.__init__ in quantization/mxfp4.py): no activation filter
    Pick(VLLM, SourceKind.MXFP4, Gpu.SM90, "HUMMING", _GENERIC,
         f"FLASHINFER_TRTLLM needs the SM100 family, DEEPGEMM_MXFP4 SM100/SM120; {_HUMMING_FIRST}"),
    Pick(VLLM, SourceKind.MXFP4, Gpu.SM100, "FLASHINFER_TRTLLM_MXFP4_MXFP8", _GENERIC,
         "first in the list (MXFP8 activations)"),
    Pick(VLLM, SourceKind.MXFP4, Gpu.SM120, "MARLIN", _GENERIC,
         "DEEPGEMM_MXFP4 when deep_gemm is installed (not a vLLM dependency); HUMMING stays after Marlin off capability 90"),
    Pick(VLLM, SourceKind.MXFP4, Gpu.GFX950, "EMULATION", _GENERIC,
         f"ROCm lists AITER_MXFP4_BF16 then EMULATION; {_NO_AITER}; EMULATION needs amd-quark"),
    Pick(VLLM, SourceKind.MXFP4, Gpu.CPU, "CPU", _GENERIC, "the CPU platform lists CPU only (x86 with AMX)"),
    # compressed-tensors MXFP4 (what quantize --format mxfp4 writes outside gpt-oss): chosen in the method itself
    Pick(VLLM, SourceKind.CT_MXFP4, Gpu.SM90, "MARLIN", _CT_MX4,
         "CutlassExpertsMxfp4 needs ops.mxfp4_experts_quant_supported (SM100/SM110/SM120), not XPU: MarlinExperts"),
    Pick(VLLM, SourceKind.CT_MXFP4, Gpu.SM100, "CUTLASS_MXFP4_MXFP4", _CT_CUTLASS,
         "CutlassExpertsMxfp4 runs here (MXFP4 activations; the method's mxfp4_backend attribute still reads "
         "MARLIN); its only load-time work is swizzle_mxfp4_scales"),
    Pick(VLLM, SourceKind.CT_MXFP4, Gpu.SM120, "CUTLASS_MXFP4_MXFP4", _CT_CUTLASS, "as on SM100"),
    Pick(VLLM, SourceKind.CT_MXFP4, Gpu.GFX950, None, _CT_MX4,
         "falls to MarlinExperts, which run on CUDA only (MarlinExpertsBase._supports_current_device): no working default"),
    Pick(VLLM, SourceKind.CT_MXFP4, Gpu.CPU, None, _CT_MX4, "falls to MarlinExperts (CUDA only): no working default"),
    # compressed-tensors INT4 (Kimi-K2-Thinking style)
    Pick(VLLM, SourceKind.CT_INT4, Gpu.SM90, "HUMMING", _WNA16,
         f"RDNA3 needs gfx1100, FLASHINFER_TRTLLM the SM100 family; {_HUMMING_FIRST}"),
    Pick(VLLM, SourceKind.CT_INT4, Gpu.SM100, "FLASHINFER_TRTLLM", _WNA16,
         "TrtLlmMxint4ExpertsMonolithic on the SM100 family (no zero points, no expert bias)"),
    Pick(VLLM, SourceKind.CT_INT4, Gpu.SM120, "MARLIN", _WNA16, "HUMMING stays after Marlin off capability 90"),
    Pick(VLLM, SourceKind.CT_INT4, Gpu.GFX950, "TRITON", _WNA16,
         "RDNA3 needs gfx1100, FLASHINFER_TRTLLM and Marlin CUDA; TritonWNA16Experts run on ROCm (no expert bias)"),
    # compressed-tensors MXFP8 (quantize --format mxfp8 outside gpt-oss)
    Pick(VLLM, SourceKind.CT_MXFP8, Gpu.SM90, "HUMMING", _MXFP8,
         f"FLASHINFER_TRTLLM needs the SM100 family, DEEPGEMM too ({_DG_MXFP8}); {_HUMMING_FIRST}"),
    Pick(VLLM, SourceKind.CT_MXFP8, Gpu.SM100, "FLASHINFER_TRTLLM", _MXFP8,
         "first in the list; the TRT-LLM FP8 experts take (MXFP8, MXFP8 dynamic) on the SM100 family"),
    Pick(VLLM, SourceKind.CT_MXFP8, Gpu.SM120, "MARLIN", _MXFP8,
         f"DEEPGEMM needs the SM100 family ({_DG_MXFP8}); Marlin takes MXFP8 weights (MarlinExpertsBase._supports_quant_scheme)"),
    Pick(VLLM, SourceKind.CT_MXFP8, Gpu.GFX950, "TRITON_MXFP8", _MXFP8 + _NATIVE_MXFP8,
         f"FLASHINFER_TRTLLM, DEEPGEMM, MARLIN and HUMMING run on CUDA only, XPU on XPU; AITER_MXFP8 needs "
         f"VLLM_ROCM_USE_AITER=1 (off by default); TRITON_MXFP8 runs where ROCm supports_mx (gfx95x), on the checkpoint's "
         f"bytes as loaded ({_FP8_AS_IS})"),
    Pick(VLLM, SourceKind.CT_MXFP8, Gpu.CPU, "EMULATION", _MXFP8 + "; fused_moe/experts/mxfp8_emulation_moe.py: "
         "Mxfp8EmulationTritonExperts._supports_current_device",
         "every other MXFP8 backend needs a GPU; EMULATION's experts accept any device and dequantize to bf16 for "
         f"vLLM's Triton MoE kernel (on x86 vLLM's CPU build expects triton-cpu; not run here) ({_FP8_AS_IS})"),
    *(Pick(VLLM, SourceKind.MXCONV_MXFP8, gpu, None, "quantization/mxfp4.py: GptOssMxfp4Config.override_quantization_method",
           "quant_method null: vLLM stops at start-up (mxconv's own gpt-oss MXFP8 variant)") for gpu in Gpu),
    # SGLang 0.5.23, gpt-oss MXFP4, where it picks otherwise than vLLM 0.33
    Pick(SGLANG, SourceKind.GPT_OSS_MXFP4, Gpu.SM100, "flashinfer_mxfp4 (trtllm_sm100)",
         "arg_groups/model_overrides/gpt_oss.py; layers/quantization/mxfp4.py: Mxfp4MoEMethod.__init__, create_weights",
         "vLLM: FLASHINFER_TRTLLM_MXFP4_BF16; SGLang runs MXFP8 activations and pads hidden and intermediate to 128 "
         "(vLLM: 256 and 128)"),
    Pick(SGLANG, SourceKind.GPT_OSS_MXFP4, Gpu.SM120, "flashinfer_mxfp4 (cutlass_sm120)",
         "arg_groups/model_overrides/gpt_oss.py; layers/quantization/mxfp4.py: Mxfp4MoEMethod.__init__",
         "vLLM: MARLIN; SGLang runs FlashInfer's CUTLASS MXFP4 MoE"),
)

# Every Mxfp4MoeBackend value of vLLM 0.33 (fused_moe/oracle/mxfp4.py, class Mxfp4MoeBackend; AITER is an
# alias of AITER_MXFP4_BF16; the enum's "None" is its unset value, not a backend), with what vLLM does with it
# where that says why a default selection passes it by ("" where nothing does). Which mxconv output holds a
# backend's bytes, or why none does, is never written here: engine_report.not_held asks the layout registry
# (each layout's vllm_backends), so a layout added later is joined with no edit here.
MXFP4_BACKENDS: dict[str, str] = {
    "B12X_MXFP4_MXFP8": "opt-in only (moe_backend b12x); b12x plans on the compressed-tensors tensors",
    "B12X_MXFP4_BF16": "opt-in only (moe_backend b12x); b12x plans on the compressed-tensors tensors",
    "DEEPGEMM_MXFP4": "",
    "FLASHINFER_TRTLLM_MXFP4_MXFP8": "",
    "FLASHINFER_TRTLLM_MXFP4_BF16": "",
    "FLASHINFER_CUTLASS_MXFP4_MXFP8": "",
    "FLASHINFER_CUTLASS_MXFP4_BF16": "",
    "CUTLASS_MXFP4_MXFP4": "",
    "BATCHED_MARLIN": "",
    "MARLIN": "",
    "AITER_MXFP4_BF16": "",
    "AITER_TRITON_MXFP4_BF16": "",
    "AITER_MXFP4_FP8": "",
    "AITER_MXFP4_MXFP4": "",
    "AITER_TRITON_MXFP4_MXFP4": "aiter's a4w4 experts for gfx1250 (AiterW4A4ExpertsMonolithic)",
    "TRITON": "",
    "TRITON_UNFUSED": "not in vLLM 0.33's default lists (left out for an MTP bug)",
    "XPU": "",
    "CPU": "",
    "EMULATION": "",
    "HUMMING": "",
    "FLASHINFER_MOE_EP_CUTEDSL": "opt-in MoE-EP megakernel on the checkpoint tensors",
    "FLASHINFER_MOE_EP_DEEP_GEMM": "opt-in MoE-EP megakernel on the checkpoint tensors",
}


# The Fp8MoeBackend values vLLM 0.33 runs MXFP8 experts on (fused_moe/oracle/mxfp8.py, _SUPPORTED_BACKENDS),
# the same way: what vLLM does with each where that matters; whether an output holds one under
# CompressedTensorsW8A8Mxfp8MoEMethod is asked of the layout registry (each layout's vllm_mxfp8_backends).
MXFP8_BACKENDS: dict[str, str] = {
    "FLASHINFER_TRTLLM": "",
    "DEEPGEMM": "SM100 only",
    "MARLIN": "",
    "XPU": "Intel XPU only; its load runs prepare_fp8_moe_layer_for_xpu",
    "AITER_MXFP8": "gfx950 with VLLM_ROCM_USE_AITER=1; its load runs rocm_aiter_ops.shuffle_mxfp8_moe_weights",
    "HUMMING": "",
    "TRITON_MXFP8": "",
    "EMULATION": "",
}


# The WNA16MoEBackend values of vLLM 0.33 (fused_moe/oracle/int_wna16.py, class WNA16MoEBackend): the names a
# layout's INT4 form declares in vllm_int4_backends. No notes recorded.
WNA16_BACKENDS: dict[str, str] = {name: "" for name in (
    "MARLIN", "BATCHED_MARLIN", "HUMMING", "CPU", "ZEN_CPU", "FLASHINFER_TRTLLM", "TRITON", "XPU", "EMULATION", "RDNA3")}

def picks(engine: str, source: SourceKind, gpu: Gpu) -> Pick | None:
    """The row for (engine, source, gpu); None where the data has none."""
    return next((p for p in PICKS if (p.engine, p.source, p.gpu) == (engine, source, gpu)), None)
