"""Which vLLM 0.33 MoE backend serves an mxconv output, and under which vLLM quantization method: the one rule.

An output is served by backend B only under a vLLM quantization method M that holds exactly its bytes:
M reaches B, M allocates for B exactly the per-rank sizes the output's tensors have (M's padding), M
creates the tensors the output holds (expert biases) with the activation quantization the output was
laid out for, and B runs the model (:func:`mxconv.layouts.vllm_backends.vllm_refusal`). The methods
differ in padding: ``Mxfp4MoEMethod`` (``quant_method: mxfp4``; ``GptOssMxfp4MoEMethod`` on gpt-oss)
rounds sizes up per backend (``maybe_roundup_sizes``), the compressed-tensors methods (MXFP4, INT4, MXFP8)
pad nothing. So a
Qwen output repacked for ``marlin`` (padded like ``Mxfp4MoEMethod`` pads it) is MARLIN-served under
``Mxfp4MoEMethod`` and not under ``CompressedTensorsW4A4Mxfp4MoEMethod``.

Every screen asks :func:`vllm_serving`: the manifest's ``served_vllm_backends`` and
``served_vllm_methods`` (:mod:`mxconv.output.engine_quant_config`), ``inspect``'s per-backend table
and ``inspect --engine`` (:mod:`mxconv.layouts.engine_report`); an engine integration reads the
manifest fields. No torch.

vLLM facts (0.33.0): ``quantization/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_w4a4_mxfp4.py``
(``CompressedTensorsW4A4Mxfp4MoEMethod``: ``create_weights`` registers no expert bias; ``__init__``
reaches CUTLASS, XPU, b12x, the MoE-EP megakernels and otherwise ``MarlinExperts``;
``process_weights_after_loading`` repacks Marlin with ``prepare_moe_fp4_layer_for_marlin(layer)``,
no input dtype, so BF16 activations only), ``fused_moe/oracle/mxfp4.py`` (the ``Mxfp4MoeBackend``
values ``Mxfp4MoEMethod`` selects among) and, for MXFP8 checkpoints,
``compressed_tensors_moe/compressed_tensors_moe_w8a8_mxfp8.py`` (``CompressedTensorsW8A8Mxfp8MoEMethod``:
``create_weights`` allocates float8_e4m3fn [E, 2I, H] / [E, H, I] and uint8 E8M0 group-32 scales at the
checkpoint's sizes, no expert bias; ``__init__`` picks an ``Fp8MoeBackend`` with ``select_mxfp8_moe_backend``
(``fused_moe/oracle/mxfp8.py``); ``process_weights_after_loading`` hands the tensors to
``convert_to_fp8_moe_kernel_format`` (``fused_moe/oracle/fp8.py``), which runs humming's transform for
HUMMING, ``prepare_mxfp8_moe_layer_for_marlin`` for MARLIN and leaves TRITON_MXFP8's and EMULATION's as
loaded). The online ``Mxfp8OnlineMoEMethod`` quantizes bf16 weights at load time: it loads no MXFP8 bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from mxconv.layouts.vllm_backends import CANONICAL_MXFP8_VLLM_BACKENDS, CANONICAL_VLLM_BACKENDS, vllm_refusal


class VllmMethod(StrEnum):
    """The vLLM 0.33 fused-MoE quantization methods that load MX or INT4 experts (their class names)."""

    MXFP4 = "Mxfp4MoEMethod"  # quant_method mxfp4 (GptOssMxfp4MoEMethod on gpt-oss): pads per backend
    CT_MXFP4 = "CompressedTensorsW4A4Mxfp4MoEMethod"  # compressed-tensors mxfp4-pack-quantized: pads nothing
    CT_WNA16 = "CompressedTensorsWNA16MoEMethod"  # compressed-tensors INT4 (pack-quantized): pads nothing
    CT_MXFP8 = "CompressedTensorsW8A8Mxfp8MoEMethod"  # compressed-tensors mxfp8-quantized (Fp8MoeBackend names): pads nothing

    @property
    def pads(self) -> bool:
        """Whether the method rounds the per-rank sizes up for its backend (``vllm_padded_sizes``)."""
        return self is VllmMethod.MXFP4

    @property
    def tag(self) -> str:
        """Short name for table cells (the legend is :data:`METHOD_LEGEND`)."""
        return {VllmMethod.MXFP4: "mxfp4", VllmMethod.CT_MXFP4: "ct", VllmMethod.CT_WNA16: "ct-int4",
                VllmMethod.CT_MXFP8: "ct-mxfp8"}[self]

    @property
    def label(self) -> str:
        """What a user writes in config.json to get this method, and the class."""
        return {
            VllmMethod.MXFP4: "quant_method mxfp4 (Mxfp4MoEMethod; GptOssMxfp4MoEMethod on gpt-oss)",
            VllmMethod.CT_MXFP4: "compressed-tensors MXFP4 (CompressedTensorsW4A4Mxfp4MoEMethod)",
            VllmMethod.CT_WNA16: "compressed-tensors INT4 (CompressedTensorsWNA16MoEMethod)",
            VllmMethod.CT_MXFP8: "compressed-tensors MXFP8 (CompressedTensorsW8A8Mxfp8MoEMethod)",
        }[self]


METHOD_LEGEND = "; ".join(f"{m.tag}: {m.label}" for m in VllmMethod)
# The canonical outputs' method and the backends holding them as loaded, per (manifest layout name, weight
# format): their config.json names the method. mxconv's gpt-oss MXFP8 (quant_method null) has none.
CANONICAL_SERVING = {
    ("canonical-gpt-oss", "mxfp4"): (VllmMethod.MXFP4, CANONICAL_VLLM_BACKENDS["canonical-gpt-oss"]),
    ("canonical-compressed-tensors", "mxfp4"): (VllmMethod.CT_MXFP4, CANONICAL_VLLM_BACKENDS["canonical-compressed-tensors"]),
    ("canonical-compressed-tensors", "mxfp8"): (VllmMethod.CT_MXFP8, CANONICAL_MXFP8_VLLM_BACKENDS["canonical-compressed-tensors"]),
}
CANONICAL_LAYOUTS = tuple(dict.fromkeys(lay for lay, _ in CANONICAL_SERVING))
# The methods whose create_weights registers no expert bias.
NO_BIAS_METHODS = (VllmMethod.CT_MXFP4, VllmMethod.CT_MXFP8)
# Backends CompressedTensorsW4A4Mxfp4MoEMethod reaches (its __init__); MARLIN with BF16 activations only.
CT_MXFP4_BACKENDS = ("XPU", "MARLIN", "CUTLASS_MXFP4_MXFP4", "B12X_MXFP4_MXFP8", "B12X_MXFP4_BF16",
                     "FLASHINFER_MOE_EP_CUTEDSL", "FLASHINFER_MOE_EP_DEEP_GEMM")
CT_MARLIN_ACTIVATIONS = ("bf16",)


@dataclass(frozen=True)
class OutputForm:
    """What decides who serves an output. ``layout``: the registered backend of a kernel output
    (``repack --backend``) or a canonical layout name (``canonical-gpt-oss``, ...); ``activation``: its
    ``--activation`` (None for canonical); ``sizes``: (H, I, padded H, padded I) per rank; ``model``:
    the manifest's ``model`` (``activation``, ``has_expert_bias``); ``compat``: the layout's
    ``engine_compat["vllm"]``; ``arch``: the GPU its bytes are for; ``tp``: its tensor-parallel size."""

    layout: str
    activation: str | None
    weight_format: str
    sizes: tuple[int, int, int, int]
    model: Mapping[str, Any]
    compat: str | None = None
    arch: str | None = None
    tp: int = 1


@dataclass(frozen=True)
class Serving:
    """One candidate: ``backend`` under ``method``; ``refusal`` None when it holds the output's bytes."""

    method: VllmMethod
    backend: str
    refusal: str | None

    @property
    def served(self) -> bool:
        return self.refusal is None


def candidates(layout: str, activation: str | None, weight_format: str) -> list[tuple[VllmMethod, str]]:
    """(method, backend) pairs that could hold an output of ``layout`` (a registered backend or a canonical
    layout name), ``activation`` and ``weight_format``: a kernel layout's declared vLLM backends under every
    method reaching them, a canonical output's backends under its own method."""
    if layout in CANONICAL_LAYOUTS:
        serving = CANONICAL_SERVING.get((layout, weight_format))
        return [] if serving is None else [(serving[0], b) for b in serving[1]]
    from mxconv.layouts import get_layout

    lay = get_layout(layout)
    act = str(activation)
    if weight_format == "int4":
        return [(VllmMethod.CT_WNA16, b) for b in lay.vllm_int4_backends.get(act, ())]
    if weight_format == "mxfp8":  # Fp8MoeBackend names, reached by the MXFP8 checkpoint's method
        return [(VllmMethod.CT_MXFP8, b) for b in lay.vllm_mxfp8_backends.get(act, ())]
    if weight_format != "mxfp4":  # block-FP8 outputs: no layout names a backend for them
        return []
    names = lay.vllm_backends.get(act, ())
    return [(VllmMethod.MXFP4, b) for b in names] + [(VllmMethod.CT_MXFP4, b) for b in names if b in CT_MXFP4_BACKENDS]


def _refusal(method: VllmMethod, backend: str, form: OutputForm) -> str | None:
    if method in NO_BIAS_METHODS and form.model.get("has_expert_bias"):
        return f"{method.label} creates no expert biases; the model has them"
    if (method is VllmMethod.CT_MXFP4 and backend == "MARLIN" and form.activation is not None
            and form.activation not in CT_MARLIN_ACTIVATIONS):
        return f"{method.label} runs Marlin with BF16 activations only; this output is laid out for {form.activation}"
    return vllm_refusal(backend, form.sizes, dict(form.model), form.compat, method.pads, form.arch, form.tp)


def vllm_serving(form: OutputForm) -> tuple[Serving, ...]:
    """Every candidate (method, backend) of ``form`` with why it does not hold the bytes (None: it does)."""
    return tuple(Serving(m, b, _refusal(m, b, form)) for m, b in candidates(form.layout, form.activation, form.weight_format))


def served_backends(servings: tuple[Serving, ...], method: VllmMethod | None = None) -> tuple[str, ...]:
    """The backends that hold the bytes (under ``method``, or under any), in candidate order, once each."""
    return tuple(dict.fromkeys(s.backend for s in servings if s.served and method in (None, s.method)))


def served_methods(servings: tuple[Serving, ...]) -> dict[str, list[str]]:
    """``{method class name: [backends holding the bytes under it]}``, methods holding none left out."""
    out: dict[str, list[str]] = {}
    for s in servings:
        if s.served:
            out.setdefault(str(s.method), []).append(s.backend)
    return out


def not_served(servings: tuple[Serving, ...]) -> dict[str, str]:
    """``{backend: why}`` for the candidates no method serves: the first method's reason."""
    held = set(served_backends(servings))
    out: dict[str, str] = {}
    for s in servings:
        if s.backend not in held and s.refusal is not None:
            out.setdefault(s.backend, s.refusal)
    return out
