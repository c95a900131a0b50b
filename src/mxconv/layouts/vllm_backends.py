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
"""

from __future__ import annotations

import re
from typing import Any

VLLM_VERSION = (0, 33)

# Canonical outputs, by manifest layout name: backends whose load-time conversion is a no-op.
CANONICAL_VLLM_BACKENDS = {"canonical-gpt-oss": ("EMULATION", "XPU"), "canonical-compressed-tensors": ("XPU",)}
# Layouts only CompressedTensorsW4A4Mxfp4MoEMethod loads; it has no maybe_roundup_sizes: nothing is padded.
UNPADDED_LAYOUTS = {"canonical-compressed-tensors", "cutlass"}
# Backends that method reaches only for per-rank (H, I) multiples of this: its CUTLASS branch
# (process_weights_after_loading) reshapes the swizzled [roundup(N, 128), roundup(K/32, 4)] scales
# back to [N, K/32], which fails unless N and K/32 are already whole tiles.
UNPADDED_ALIGN = {"CUTLASS_MXFP4_MXFP4": 128}
# Expert classes that run only some activations (vLLM MoEActivation values): DeepGemmFP4Experts and
# OAITritonExperts / OAITritonMxfp4ExpertsMonolithic / CPUExpertsMxfp4 ``_supports_activation``.
# DeepGemmFP4Experts.apply and run_cutlass_moe_mxfp4 (fused_moe/experts/cutlass_moe.py) never read the
# expert biases.
EXPERT_ACTIVATIONS = {"DEEPGEMM_MXFP4": ("silu", "swiglustep", "situ"), "TRITON": ("swigluoai",),
                      "CPU": ("silu", "swigluoai", "gelu", "gelu_tanh")}
NO_BIAS = {"DEEPGEMM_MXFP4", "CUTLASS_MXFP4_MXFP4"}


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def vllm_padded_sizes(backend: str, hidden: int, intermediate: int, activation: str) -> tuple[int, int] | None:
    """(H, I) of one rank after ``mxfp4_round_up_hidden_size_and_intermediate_size`` (CUDA; ROCm for
    AITER_*), or None for a backend name this table does not know."""
    if backend.startswith(("B12X_", "FLASHINFER_MOE_EP_")):
        return hidden, intermediate
    if backend == "EMULATION":
        return _up(hidden, 32), _up(intermediate, 32)
    if backend in ("DEEPGEMM_MXFP4", "CUTLASS_MXFP4_MXFP4") or backend.startswith("FLASHINFER_CUTLASS_"):
        return _up(hidden, 128), _up(intermediate, 128)
    if backend in ("MARLIN", "BATCHED_MARLIN") or backend.startswith("FLASHINFER_TRTLLM_"):
        return _up(hidden, 256), _up(intermediate, 128)
    if backend == "AITER_MXFP4_MXFP4":
        return _up(hidden, 256), _up(intermediate, 128)
    if backend == "AITER_MXFP4_BF16":
        align = 128 if activation in ("silu", "situ") else 256
        return _up(hidden, align), _up(intermediate, align)
    if backend == "CPU":
        return _up(hidden, 32), _up(intermediate, 32)
    if backend in ("TRITON", "TRITON_UNFUSED", "XPU", "HUMMING"):  # HUMMING: the CUDA default branch
        return hidden, _up(intermediate, 64)
    return None


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
                 padded_by_engine: bool = True) -> str | None:
    """Why vLLM 0.33's ``backend`` does not hold an output of (H, I, Hp, Ip) per rank for ``model``
    (the manifest's ``model``) as is; None when it does."""
    H, I, Hp, Ip = sizes
    act = str(model.get("activation", "silu"))
    want = vllm_padded_sizes(backend, H, I, act) if padded_by_engine else (H, I)
    align = UNPADDED_ALIGN.get(backend, 1)
    if not padded_by_engine and (H % align or I % align):
        return (f"vLLM's compressed-tensors MXFP4 method pads nothing and loads {backend} only for H and I per rank "
                f"multiples of {align}; these are ({H}, {I})")
    if want is not None and want != (Hp, Ip):
        return f"vLLM pads (H, I) = ({H}, {I}) to {want} for {backend}; these tensors are padded to {(Hp, Ip)}"
    if act not in EXPERT_ACTIVATIONS.get(backend, (act,)):
        return f"{backend} runs {', '.join(EXPERT_ACTIVATIONS[backend])} only; the model uses {act}"
    if backend in NO_BIAS and model.get("has_expert_bias"):
        return f"{backend} ignores expert biases; the model has them"
    if compat is not None and admits_vllm(compat) is False:
        return f"the layout targets vLLM {compat}"
    return None
