"""vLLM 0.33 MXFP4 MoE backends (``Mxfp4MoeBackend`` names): which of them hold an output's bytes as is.

Facts from the vLLM 0.33.0 sources, by function:

* ``fused_moe/oracle/mxfp4.py``: ``mxfp4_round_up_hidden_size_and_intermediate_size`` (the per-rank
  padding each backend allocates: :func:`vllm_padded_sizes`), ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``
  and ``convert_weight_to_mxfp4_moe_kernel_format`` (XPU and EMULATION keep the checkpoint tensors);
* ``quantization/compressed_tensors/.../compressed_tensors_moe_w4a4_mxfp4.py``: compressed-tensors MXFP4
  experts reach XPU (as is), B12X, the MoE-EP megakernels, CUTLASS or Marlin, and are never padded;
* ``fused_moe/experts/deep_gemm_moe.py``: ``DeepGemmFP4Experts`` runs SILU, SWIGLUSTEP and SITU and
  never reads expert biases; ``fused_moe/experts/gpt_oss_triton_kernels_moe.py``: the ``TRITON``
  experts run SWIGLUOAI only.

Kernel outputs are checked against the padding of the MXFP4 quant methods that pad
(``GptOssMxfp4MoEMethod`` / ``Mxfp4MoEMethod`` ``maybe_roundup_sizes``), per TP rank.

These tables are vLLM's, over its whole enums (tests/test_engine_picks.py checks every Mxfp4MoeBackend value
has its padding here), never mxconv's: which layout holds which backend is each layout's declaration
(``vllm_backends``), so a new layout adds nothing here.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any

VLLM_VERSION = (0, 33)

# Canonical outputs, by manifest layout name: backends whose load-time conversion is a no-op.
CANONICAL_VLLM_BACKENDS = {"canonical-gpt-oss": ("EMULATION", "XPU"), "canonical-compressed-tensors": ("XPU",)}
# The same for canonical MXFP8 outputs (Fp8MoeBackend names). CompressedTensorsW8A8Mxfp8MoEMethod.create_weights
# allocates the checkpoint's tensors unpadded (float8_e4m3fn [E, 2I, H], uint8 E8M0 [E, 2I, H/32], no expert
# biases) and convert_to_fp8_moe_kernel_format (fused_moe/oracle/fp8.py) leaves EMULATION's and TRITON_MXFP8's
# tensors as loaded. mxconv's gpt-oss MXFP8 (quant_method null) is not loaded by vLLM at all.
CANONICAL_MXFP8_VLLM_BACKENDS = {"canonical-compressed-tensors": ("TRITON_MXFP8", "EMULATION")}
# Backends CompressedTensorsW4A4Mxfp4MoEMethod (no maybe_roundup_sizes: nothing padded) reaches only for per-rank (H, I) multiples of this: its CUTLASS branch
# (process_weights_after_loading) reshapes the swizzled [roundup(N, 128), roundup(K/32, 4)] scales
# back to [N, K/32], which fails unless N and K/32 are already whole tiles.
UNPADDED_ALIGN = {"CUTLASS_MXFP4_MXFP4": 128}
# Expert classes that run only some activations (vLLM MoEActivation values): DeepGemmFP4Experts and
# OAITritonExperts / OAITritonMxfp4ExpertsMonolithic / CPUExpertsMxfp4 / AiterW4A8ExpertsMonolithic /
# AiterW4A16ExpertsMonolithic ``_supports_activation``.
# DeepGemmFP4Experts.apply and run_cutlass_moe_mxfp4 (fused_moe/experts/cutlass_moe.py) never read the
# expert biases.
EXPERT_ACTIVATIONS = {"DEEPGEMM_MXFP4": ("silu", "swiglustep", "situ"), "TRITON": ("swigluoai",),
                      "CPU": ("silu", "swigluoai", "gelu", "gelu_tanh"), "AITER_MXFP4_FP8": ("swigluoai",),
                      "AITER_TRITON_MXFP4_BF16": ("swigluoai", "silu")}
NO_BIAS = {"DEEPGEMM_MXFP4", "CUTLASS_MXFP4_MXFP4"}
# Backends whose load runs _swizzle_mxfp4 (quantization/utils/mxfp4_utils.py): on gfx950 it writes
# CDNA4MXScaleLayout scales only while should_use_cdna4_mx_scale_swizzle() (TP <= 2), plain ones above.
CDNA4_SCALE_BACKENDS = ("TRITON", "TRITON_UNFUSED", "AITER_TRITON_MXFP4_BF16", "AITER_MXFP4_FP8")
CDNA4_SCALE_MAX_TP = 2


class Platform(str, Enum):
    """Where vLLM runs a backend: ``mxfp4_round_up_hidden_size_and_intermediate_size`` has a branch for
    ROCm (CDNA4 = gfx950 told apart for TRITON_UNFUSED) that every backend it does not name earlier
    takes there."""

    CUDA = "cuda"
    ROCM = "rocm"  # ROCm GPUs other than CDNA4 (gfx942, gfx1250, ...)
    ROCM_CDNA4 = "rocm-cdna4"  # gfx950 (MI350/MI355)

    @property
    def is_rocm(self) -> bool:
        return self is not Platform.CUDA


def platform_of(arch: str | None) -> Platform | None:
    """The platform of a GPU a layout records (manifest ``layout.arch``: "sm90", "gfx950", ...); None
    when none is recorded."""
    if not arch:
        return None
    if not arch.startswith("gfx"):
        return Platform.CUDA
    return Platform.ROCM_CDNA4 if arch.startswith("gfx95") else Platform.ROCM


def home_platform(backend: str) -> Platform | None:
    """The platform vLLM 0.33 runs ``backend`` on when it runs on one only (AITER, TRITON_MXFP8: ROCm; the FlashInfer,
    DeepGEMM, CUTLASS, Marlin, HUMMING and b12x kernels: CUDA); None for the others."""
    if backend.startswith("AITER_") or backend == "TRITON_MXFP8":  # Mxfp8NativeTritonExperts: ROCm with supports_mx
        return Platform.ROCM_CDNA4
    cuda = ("B12X_", "FLASHINFER_", "DEEPGEMM", "CUTLASS_", "MARLIN", "BATCHED_MARLIN", "HUMMING")  # DEEPGEMM: Fp8MoeBackend too
    return Platform.CUDA if backend.startswith(cuda) else None


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def vllm_alignment(backend: str, activation: str, platform: Platform | None = None) -> tuple[int, int] | None:
    """(hidden, intermediate) multiples ``mxfp4_round_up_hidden_size_and_intermediate_size`` rounds one
    rank up to for ``backend`` on ``platform`` (None: the backend's :func:`home_platform`, else CUDA);
    1 keeps a size as is. None for a backend name this table does not know."""
    if backend.startswith(("B12X_", "FLASHINFER_MOE_EP_")):
        return 1, 1
    if backend == "EMULATION":
        return 32, 32
    if backend in ("DEEPGEMM_MXFP4", "CUTLASS_MXFP4_MXFP4") or backend.startswith("FLASHINFER_CUTLASS_"):
        return 128, 128
    if backend in ("MARLIN", "BATCHED_MARLIN") or backend.startswith("FLASHINFER_TRTLLM_"):
        return 256, 128
    platform = platform or home_platform(backend) or Platform.CUDA
    if platform.is_rocm and (backend.startswith("AITER_") or backend in ("TRITON", "TRITON_UNFUSED")):
        narrow = activation in ("silu", "situ") and (
            backend == "AITER_MXFP4_BF16" or (backend == "TRITON_UNFUSED" and platform is not Platform.ROCM_CDNA4))
        inter = 128 if backend == "AITER_MXFP4_MXFP4" or narrow else 256
        return (256 if backend == "AITER_MXFP4_MXFP4" else inter), inter
    if backend == "CPU":
        return 32, 32
    if backend in ("TRITON", "TRITON_UNFUSED", "XPU", "HUMMING"):  # HUMMING: the CUDA default branch
        return 1, 64
    return None


def vllm_padded_sizes(backend: str, hidden: int, intermediate: int, activation: str,
                      platform: Platform | None = None) -> tuple[int, int] | None:
    """(H, I) of one rank after ``mxfp4_round_up_hidden_size_and_intermediate_size`` (:func:`vllm_alignment`),
    or None for a backend name this table does not know."""
    align = vllm_alignment(backend, activation, platform)
    return None if align is None else (_up(hidden, align[0]), _up(intermediate, align[1]))


def admits_vllm(spec: str) -> bool | None:
    """Whether a layout's ``engine_compat["vllm"]`` text admits vLLM 0.33 (">=0.12", "<=0.11.2",
    "0.12-0.14", "0.33 (...)", comma-joined); None when it cannot be read."""
    head = spec.strip().split()[0] if spec.strip() else ""
    ok = True
    for clause in head.split(","):
        m = re.fullmatch(r"(>=|<=|==|>|<)?(\d+(?:\.\d+)*)(?:-(\d+(?:\.\d+)*))?", clause.strip())
        if not m:
            return None
        op, lo = m.group(1), tuple(int(x) for x in m.group(2).split("."))
        v = (*VLLM_VERSION, 0)[: max(len(lo), 2)]
        if m.group(3):
            hi = tuple(int(x) for x in m.group(3).split("."))
            ok &= lo <= v[: len(lo)] and v[: len(hi)] <= hi
        else:
            ok &= {None: v[: len(lo)] == lo, "==": v == lo, ">=": v >= lo, "<=": v <= lo, ">": v > lo, "<": v < lo}[op]
    return ok


def vllm_refusal(backend: str, sizes: tuple[int, int, int, int], model: dict[str, Any], compat: str | None,
                 padded_by_engine: bool = True, arch: str | None = None, tp: int = 1) -> str | None:
    """Why vLLM 0.33's ``backend`` does not hold an output of (H, I, Hp, Ip) per rank for ``model``
    (the manifest's ``model``) as is; None when it does. ``arch``: the GPU the layout's bytes are for
    (manifest ``layout.arch``), which picks the platform's padding and refuses another platform's backends;
    ``tp``: the output's tensor-parallel size."""
    H, I, Hp, Ip = sizes
    act, platform, home = str(model.get("activation", "silu")), platform_of(arch), home_platform(backend)
    if platform is not None and home is not None and platform.is_rocm != home.is_rocm:
        return f"{backend} runs on {'ROCm' if home.is_rocm else 'CUDA'} only; these bytes are for {arch}"
    if platform is Platform.ROCM_CDNA4 and backend in CDNA4_SCALE_BACKENDS and tp > CDNA4_SCALE_MAX_TP:
        return (f"vLLM swizzles {backend} scales for CDNA4 at TP <= {CDNA4_SCALE_MAX_TP} only "
                f"(should_use_cdna4_mx_scale_swizzle); this output is for TP {tp}")
    want = vllm_padded_sizes(backend, H, I, act, platform) if padded_by_engine else (H, I)
    align = UNPADDED_ALIGN.get(backend, 1)
    if not padded_by_engine and (H % align or I % align):
        return (f"vLLM's compressed-tensors MXFP4 method pads nothing and loads {backend} only for H and I per rank "
                f"multiples of {align}; these are ({H}, {I})")
    if not padded_by_engine and (H, I) != (Hp, Ip):
        return f"vLLM's compressed-tensors methods pad nothing; these tensors are padded from {(H, I)} to {(Hp, Ip)}"
    if want is not None and want != (Hp, Ip):
        return f"vLLM pads (H, I) = ({H}, {I}) to {want} for {backend}; these tensors are padded to {(Hp, Ip)}"
    if act not in EXPERT_ACTIVATIONS.get(backend, (act,)):
        return f"{backend} runs {', '.join(EXPERT_ACTIVATIONS[backend])} only; the model uses {act}"
    if backend in NO_BIAS and model.get("has_expert_bias"):
        return f"{backend} ignores expert biases; the model has them"
    if compat is not None and admits_vllm(compat) is False:
        return f"the layout targets vLLM {compat}"
    return None
