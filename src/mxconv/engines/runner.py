"""Which engine kernel runs a backend's bytes: the :class:`EngineRunner` a layout points to.

A backend layout names its runner in ``engine_runner`` (a ``"module:attribute"`` string, imported
on first use, or the object itself for plug-ins and tests); ``None`` means mxconv cannot run that
engine's kernel. This module resolves the pointer — the layouts never import the engines, which sit
above them — so ``verify --kernel`` and the loader ask :func:`engine_runner` and never name a backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from mxconv.errors import BadInput
from mxconv.experts.kernel_settings import KernelLocations
from mxconv.layouts import backend_names, get_layout
from mxconv.registry import resolve_entry
from mxconv.source.manifest import LayoutPart, Manifest

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mxconv.families.base import ModelInfo

# gpt-oss's SwiGLU-OAI constants where the manifest records none (vLLM's defaults)
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0

# Engine kernel (bf16 activations, bf16 GEMM outputs) vs the fp32 reference MoE on the same MXFP4
# weights. bf16 rounding of the input, the intermediate and each GEMM output gives ~2e-3 each.
# Measured on an H100 (tests/test_engines_gpu.py): triton_kernels 3.9e-3 - 5.1e-3, vLLM's Marlin
# 5.2e-3 - 5.7e-3 relative RMS; planted layout bugs 0.17 - 0.82.
KERNEL_THRESHOLDS: dict[str, float] = {"rel_rms": 0.02, "cosine": 0.9995, "topk_agreement": 1.0}


@dataclass(frozen=True)
class LayerSpec:
    """One rank of one MoE layer of an output as its manifest describes it: what an
    :class:`EngineRunner` needs besides the stored tensors to wrap them for its kernel."""

    name: str  # for messages, e.g. "<root> layer 3 rank 1"
    layout: LayoutPart = field(repr=False)  # the manifest's ``layout`` part (a backend's own keys: its layout's description class)
    num_experts: int
    hidden_size: int
    padded_hidden_size: int
    rank_intermediate_size: int  # this rank's share of the intermediate size (all of it at TP 1)
    tp_size: int
    activation: str  # the model's: "swigluoai" | "silu"
    swiglu_alpha: float = SWIGLU_ALPHA
    swiglu_limit: float = SWIGLU_LIMIT
    stack_choices: Mapping[str, str] = field(default_factory=dict)  # this layer's and rank's ``layout.stack_choices`` ({}: none)


class EngineRunner(Protocol):
    """How one engine's own MoE kernel takes a layer of a backend's output and runs it."""

    device: str  # where the kernel runs and the loader reads the layer to, e.g. "cuda"
    what: str  # the kernel, in words, for messages

    def check_device(self, device: Any) -> None:
        """BadInput unless ``device`` is a GPU this kernel runs on (checked before any byte is read)."""
        ...

    def kernel_unavailable(self, layout: LayoutPart, device: Any,
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        """None when the kernel can run here on an output whose manifest ``layout`` part is ``layout``
        (kernels looked for at ``kernel_locations`` first, then the environment and installed copies);
        else one line naming what is missing (GPU, kernels, layout variant). May raise BadInput instead
        of returning the line (a backend's own keys are read through its layout's description class,
        e.g. ``TritonDescription.from_layout``, which names a missing or mistyped key)."""
        ...

    def wrap(self, tensors: dict[str, torch.Tensor], spec: LayerSpec, kernel_locations: KernelLocations | None = None) -> Any:
        """The engine's expert object holding one rank's stored tensors (names without prefix, on
        the GPU), described by ``spec``, as the kernel takes them (kernels found as for
        :meth:`kernel_unavailable`)."""
        ...

    def forward(self, experts: Any, x: torch.Tensor, topk_ids: torch.Tensor | None, topk_weights: torch.Tensor | None,
                logits: torch.Tensor | None, info: ModelInfo) -> torch.Tensor:  # fmt: skip
        """The kernel's MoE output [T, H] bf16 for ``x`` [T, H] bf16 routed by top-k ids/weights
        [T, k] or by router ``logits`` [T, E] (one of the two is None)."""
        ...


def engine_runner(backend: Any) -> EngineRunner | None:
    """The engine runner of backend ``backend``, or None when it has none or is not registered."""
    if backend not in backend_names():
        return None
    entry = get_layout(backend).engine_runner
    return None if entry is None else resolve_entry(entry)


def runner_backends() -> tuple[str, ...]:
    """The registered backends whose engine kernel mxconv can run, in registration order."""
    return tuple(name for name in backend_names() if get_layout(name).engine_runner is not None)


def require_runner(backend: Any, where: str = "") -> EngineRunner:
    """:func:`engine_runner` of ``backend``; BadInput naming the backends that have one otherwise."""
    runner = engine_runner(backend)
    if runner is None:
        raise BadInput(f"{where}backend {backend!r} has no engine runner in mxconv (runners: {', '.join(runner_backends())})")
    return runner


def kernel_unavailable(manifest: Manifest, device: Any = "cuda", kernel_locations: KernelLocations | None = None) -> str | None:
    """None when the engine kernel for ``manifest``'s backend can run here (kernels looked for at
    ``kernel_locations`` first), else one line naming what is missing (backend without a runner,
    GPU, kernels, layout variant)."""
    backend = manifest.backend
    runner = engine_runner(backend)
    if runner is None:
        return f"no engine kernel runner in mxconv for backend {backend!r} (runners: {', '.join(runner_backends())})"
    try:
        return runner.kernel_unavailable(manifest.layout, device, kernel_locations)
    except BadInput as exc:
        return str(exc)


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, routing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids int32 [T, k] / weights fp32 [T, k] from router logits [T, E] for the softmax routings,
    in torch (the runners whose engine has no fused router): ``"topk_softmax"`` = top-k of the logits
    then softmax over the k (``renormalize`` ignored); else softmax over all experts, top-k,
    renormalised if asked."""
    import torch

    logits = logits.float()
    if routing == "topk_softmax":
        vals, ids = torch.topk(logits, k, dim=-1)
        return ids.to(torch.int32), torch.softmax(vals, dim=-1)
    w, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), w


def gated_activation(h: torch.Tensor, row_order: str, activation: str, intermediate: int, engine: str,
                     swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:  # fmt: skip
    """GEMM-1 output [M, 2*intermediate] -> [M, intermediate] bf16, fp32 math: gate/up as columns
    2j / 2j+1 (``row_order`` "interleaved") or the two halves; "swigluoai" = clamped gate * sigmoid(alpha
    gate) * (up + 1) (vLLM's formula and order), "silu" = silu(gate) * up. BadInput naming ``engine``
    for another activation."""
    import torch

    h = h.float()
    if row_order == "interleaved":
        gate, up = h[:, 0::2], h[:, 1::2]
    else:
        gate, up = h[:, :intermediate], h[:, intermediate:]
    if activation == "swigluoai":
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        out = gate * torch.sigmoid(swiglu_alpha * gate) * (up + 1)
    elif activation == "silu":
        out = torch.nn.functional.silu(gate) * up
    else:
        raise BadInput(f"{engine} engine: no activation {activation!r} (swigluoai or silu)")
    return out.to(torch.bfloat16).contiguous()
