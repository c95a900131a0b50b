"""Run a MoE layer through triton_kernels' own ``matmul_ogs`` on Hopper, from the buffers
``mxconv repack --backend triton`` writes (docs/layout-triton.md §8: no re-swizzling).

Stored per layer and rank (E experts, Hp = padded hidden, Ip = padded intermediate):

| tensor           | stored                     | wrapped as (triton_kernels)                              |
|------------------|----------------------------|----------------------------------------------------------|
| w13_weight       | uint8 [E, Np/4, 4*Kbp]     | Tensor(Storage(buf.mT, HopperMXValueLayout), FP4, [E, Hp, 2Ip]) |
| w13_weight_scale | uint8 [E, Ns/32, 32*Cp]    | Tensor(Storage(buf.mT, HopperMXScaleLayout), uint8, [E, C', 2Ip]) |
| w13_bias         | float32 [E, 2Ip]           | passed as the kernel's bias                              |
| w2_*             | same with N = Hp, K = Ip   |                                                          |

w13 rows are gate/up pairs (gate 2j, up 2j+1) whatever the source order. gpt-oss (SwiGLU-OAI)
fuses the activation into the w13 ``matmul_ogs``; SiLU families run w13 without activation and
apply ``silu(gate) * up`` in torch on the interleaved columns. The forward follows the call
sequence of vLLM's triton_kernels MoE path for the 3.5.1 API (routing -> gather + w13 ->
scatter + gammas w2), written here from its facts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from mxconv.engines import discover
from mxconv.engines.discover import TritonKernels
from mxconv.engines.runner import SWIGLU_ALPHA, SWIGLU_LIMIT, LayerSpec
from mxconv.errors import BadInput
from mxconv.experts.kernel_settings import KernelLocations
from mxconv.layouts.triton_arch import TritonDescription
from mxconv.source.manifest import LayoutPart

VALUE_PADDING = {"3.5": (16, 32), "3.6": (64, 64)}  # (row multiple, row-byte multiple), layout-triton.md §3
MX_BLOCK = 32
KERNEL_K_MULTIPLE = 64  # matmul_ogs on SM90 is wrong for reduction sizes not a multiple of 64


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tk(tk: TritonKernels, sub: str) -> Any:
    return importlib.import_module(f"{tk.module.__name__}.{sub}")


@dataclass(frozen=True)
class MatrixGeometry:
    """One expert matrix with N output rows and K inputs, as the Hopper MX layouts store it."""

    experts: int
    rows: int  # N (logical, incl. the layout's own Ip/Hp padding)
    k: int  # K (logical)
    generation: str  # "3.5" | "3.6"
    num_warps: int
    scale_k_align: int  # vLLM 0.33 pads K/32 to a multiple of 4 before the swizzle

    @property
    def scale_cols(self) -> int:
        """C': K/32 after vLLM's pre-pad (the scale Tensor's logical width)."""
        return _round_up(self.k // MX_BLOCK, self.scale_k_align)

    @property
    def value_buffer_shape(self) -> tuple[int, int, int]:
        """uint8 [E, Np/4, 4*Kbp]."""
        rows, row_bytes = VALUE_PADDING[self.generation]
        return (self.experts, _round_up(self.rows, rows) // 4, 4 * _round_up(self.k // 2, row_bytes))

    @property
    def scale_buffer_shape(self) -> tuple[int, int, int]:
        """uint8 [E, Ns/32, 32*Cp]."""
        return (self.experts, _round_up(self.rows, 32 * self.num_warps) // 32, 32 * _round_up(self.scale_cols, 2))


def wrap_matrix(tk: TritonKernels, weight: torch.Tensor, scale: torch.Tensor, g: MatrixGeometry, name: str) -> tuple[Any, Any]:
    """Stored buffers -> (weight Tensor [E, K, N] FP4, PrecisionConfig holding the scale Tensor).

    ``weight`` uint8 ``g.value_buffer_shape`` and ``scale`` uint8 ``g.scale_buffer_shape``, both
    contiguous; they are wrapped as ``buf.mT`` views (strides kept, nothing copied).
    """
    tensor_mod, layout_mod = _tk(tk, "tensor"), _tk(tk, "tensor_details.layout")
    mm = _tk(tk, "matmul_ogs")
    numerics = _tk(tk, "numerics")
    for what, buf, want in (("weight", weight, g.value_buffer_shape), ("weight_scale", scale, g.scale_buffer_shape)):
        if tuple(buf.shape) != want or buf.dtype != torch.uint8:
            raise BadInput(
                f"{name}_{what}: stored {buf.dtype}{list(buf.shape)}, the triton layout {g.generation} "
                f"(num_warps {g.num_warps}, scale_k_align {g.scale_k_align}) needs torch.uint8{list(want)}"
            )
        if not buf.is_contiguous():
            raise BadInput(f"{name}_{what}: the stored buffer must be contiguous (it is wrapped as buf.mT)")
    E, N, K = g.experts, g.rows, g.k
    value_layout = layout_mod.HopperMXValueLayout([E, K // 2, N], mx_axis=1)
    w = tensor_mod.Tensor(
        tensor_mod.Storage(weight.mT, value_layout), dtype=tensor_mod.FP4, shape=[E, K, N], shape_max=[E, K, N]
    )
    c = g.scale_cols
    scale_layout = layout_mod.HopperMXScaleLayout([E, c, N], mx_axis=1, num_warps=g.num_warps)
    s = tensor_mod.Tensor(tensor_mod.Storage(scale.mT, scale_layout), dtype=torch.uint8, shape=[E, c, N], shape_max=[E, c, N])
    pc = mm.PrecisionConfig(weight_scale=s, flex_ctx=mm.FlexCtx(rhs_data=numerics.InFlexData()))
    return w, pc


def constrain_hopper(tk: TritonKernels) -> None:
    """The SM90 opt-flag constraint vLLM sets with its swizzle: no split-K (process-wide)."""
    _tk(tk, "matmul_ogs_details.opt_flags").update_opt_flags_constraints({"split_k": 1})


def routing_from_topk(tk: TritonKernels, ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> tuple[Any, Any, Any]:
    """(RoutingData, GatherIndx, ScatterIndx) from a top-k choice: ``ids`` [T, k] integer (expert
    per slot, distinct per token), ``weights`` [T, k] float. The bitmatrix (one bit per chosen
    expert, uint32 words [T, ceil(E/32)]) is packed in torch; the rest is triton_kernels'
    ``routing_from_bitmatrix``. Weights travel as bf16 and ids as int16, as vLLM passes them."""
    routing, tensor_mod = _tk(tk, "routing"), _tk(tk, "tensor")
    T, k = ids.shape
    ids64 = ids.long()
    words = torch.zeros(T, -(-num_experts // 32), dtype=torch.int64, device=ids.device)
    words.scatter_add_(1, ids64 // 32, torch.ones_like(ids64) << (ids64 % 32))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(torch.uint32)
    shape = [T, words.shape[1] * 32]
    bitmatrix = tensor_mod.Bitmatrix(words, shape=shape, shape_max=[T, None], scratchpad=None)
    return routing.routing_from_bitmatrix(bitmatrix, weights.to(torch.bfloat16).contiguous(), ids.to(torch.int16).contiguous(), num_experts, k)


def routing_from_logits(tk: TritonKernels, logits: torch.Tensor, k: int, renormalize: bool) -> tuple[Any, Any, Any]:
    """triton_kernels' fused ``routing``: top-k over ``logits`` [T, E] then softmax over the k
    (``renormalize``; gpt-oss, or softmax->top-k with renormalisation), else softmax first."""
    return _tk(tk, "routing").routing(logits, k, sm_first=not renormalize)


@dataclass
class TritonExperts:
    """One rank's experts as triton_kernels holds them after vLLM's load (what ``matmul_ogs`` takes).

    ``w13``/``w2``: triton_kernels Tensors ([E, Hp, 2Ip] and [E, Ip, Hp], FP4, Hopper layouts);
    ``pc13``/``pc2``: their PrecisionConfigs (scales); ``b13`` fp32 [E, 2Ip] / ``b2`` fp32 [E, Hp]
    or None; ``activation`` "swigluoai" | "silu".
    """

    tk: TritonKernels
    w13: Any
    w2: Any
    pc13: Any
    pc2: Any
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    num_experts: int
    hidden_size: int
    padded_hidden_size: int
    padded_intermediate_size: int
    activation: str
    swiglu_alpha: float = SWIGLU_ALPHA
    swiglu_limit: float = SWIGLU_LIMIT

    def routing(self, ids: torch.Tensor | None, weights: torch.Tensor | None, logits: torch.Tensor | None, k: int, renormalize: bool) -> tuple[Any, Any, Any]:
        """Routing data from a top-k choice (ids/weights) or, when only ``logits`` is given, the fused kernel."""
        if ids is not None:
            if weights is None:
                raise BadInput("triton routing: topk_ids given without topk_weights")
            _check_topk(ids.shape[1])
            return routing_from_topk(self.tk, ids, weights, self.num_experts)
        if logits is None:
            raise BadInput("triton routing: give topk ids/weights or router logits")
        _check_topk(k)
        return routing_from_logits(self.tk, logits, k, renormalize)

    def forward(self, x: torch.Tensor, route: tuple[Any, Any, Any]) -> torch.Tensor:
        """x [T, H] bf16 on the experts' device, ``route`` from :meth:`routing` -> [T, H] bf16."""
        mm = _tk(self.tk, "matmul_ogs")
        rdata, gather, scatter = route
        if x.shape[1] != self.padded_hidden_size:
            x = torch.nn.functional.pad(x, (0, self.padded_hidden_size - x.shape[1]))
        x = x.to(torch.bfloat16).contiguous()
        if self.activation == "swigluoai":
            swiglu = _tk(self.tk, "swiglu").swiglu_fn
            act = mm.FusedActivation(mm.FnSpecs("swiglu", swiglu, ("alpha", "limit")), (self.swiglu_alpha, self.swiglu_limit), 2)
            inter = mm.matmul_ogs(x, self.w13, self.b13, rdata, gather_indx=gather, precision_config=self.pc13, fused_activation=act)
        elif self.activation == "silu":
            h = mm.matmul_ogs(x, self.w13, self.b13, rdata, gather_indx=gather, precision_config=self.pc13)
            h = h.float()
            inter = (torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]).to(torch.bfloat16)
        else:
            raise BadInput(f"triton engine: no activation {self.activation!r} (swigluoai or silu)")
        y = mm.matmul_ogs(inter.contiguous(), self.w2, self.b2, rdata, scatter_indx=scatter, precision_config=self.pc2, gammas=rdata.gate_scal)
        return y[:, : self.hidden_size]


def _check_topk(k: int) -> None:
    if k < 1 or k & (k - 1):
        raise BadInput(f"triton_kernels' 3.5.1 routing needs a power-of-two top-k, got {k} (vLLM patches its kernels for this)")


def build_experts(tk: TritonKernels, tensors: dict[str, torch.Tensor], spec: LayerSpec,
                  padded_intermediate_size: int) -> TritonExperts:  # fmt: skip
    """Wrap one rank's stored tensors (names without prefix, on the GPU) per spec §8.

    ``spec.layout`` is the manifest's ``layout`` part (its :class:`TritonDescription`: triton_layout,
    num_warps, scale_k_align of an sm90 storage). BadInput when the hidden size the kernel reduces over is not a multiple of 64 (the kernel
    computes wrong results then; repack with ``--layout-option pad_hidden=true``).
    """
    name, padded_hidden_size = spec.name, spec.padded_hidden_size
    gen, warps, align = TritonDescription.from_layout(spec.layout).hopper_storage()
    if padded_hidden_size % KERNEL_K_MULTIPLE or padded_intermediate_size % KERNEL_K_MULTIPLE:
        raise BadInput(
            f"{name}: triton_kernels' matmul_ogs on Hopper computes wrong results when the reduction size is not a "
            f"multiple of {KERNEL_K_MULTIPLE} (hidden {padded_hidden_size}, intermediate {padded_intermediate_size}; "
            f"docs/real-kernels.md); repack with RepackOptions.layout_options pad_hidden=true"
        )
    E, Hp, Ip = spec.num_experts, padded_hidden_size, padded_intermediate_size
    if warps == 8 and min(Hp, 2 * Ip) <= 128:
        raise BadInput(
            f"{name}: triton_kernels' Hopper matmul with num_warps 8 tiles N by 256 and cannot compile for an output "
            f"width <= 128 (hidden {Hp}, 2 x intermediate {2 * Ip}); real models are far larger"
        )
    g13 = MatrixGeometry(E, 2 * Ip, Hp, gen, warps, align)
    g2 = MatrixGeometry(E, Hp, Ip, gen, warps, align)
    w13, pc13 = wrap_matrix(tk, tensors["w13_weight"], tensors["w13_weight_scale"], g13, f"{name}.w13")
    w2, pc2 = wrap_matrix(tk, tensors["w2_weight"], tensors["w2_weight_scale"], g2, f"{name}.w2")
    b13, b2 = tensors.get("w13_bias"), tensors.get("w2_bias")
    for label, b, n in (("w13_bias", b13, 2 * Ip), ("w2_bias", b2, Hp)):
        if b is not None and (tuple(b.shape) != (E, n) or b.dtype != torch.float32):
            raise BadInput(f"{name}.{label}: stored {b.dtype}{list(b.shape)}, expected torch.float32{[E, n]}")
    constrain_hopper(tk)
    return TritonExperts(tk, w13, w2, pc13, pc2, b13, b2, E, spec.hidden_size, Hp, Ip, spec.activation,
                         spec.swiglu_alpha, spec.swiglu_limit)  # fmt: skip


def _arch_refusal(d: TritonDescription) -> str | None:
    """Why the storage a manifest ``layout`` describes (``d``) cannot be wrapped for the Hopper matmul, or None (sm90)."""
    arch = d.arch
    if arch == "sm90":
        return None
    return (f"the output holds the {arch} storage (manifest layout.arch = {arch!r}); mxconv runs triton_kernels' "
            "Hopper matmul on sm90 storage only: repack with RepackOptions.layout_options arch=sm90 to run it here")  # fmt: skip


class TritonRunner:
    """The :class:`~mxconv.engines.runner.EngineRunner` of ``--backend triton``: triton_kernels'
    Hopper ``matmul_ogs`` on the stored buffers (the triton layout points here)."""

    device = "cuda"
    what = "triton_kernels' Hopper MX matmul"

    def check_device(self, device: Any) -> None:
        discover.check_gpu(device, exact=discover.HOPPER, what=self.what)

    def kernel_unavailable(self, layout: LayoutPart, device: Any,
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        d = TritonDescription.from_layout(layout)
        refusal = _arch_refusal(d)
        if refusal is not None:
            return refusal
        generation, num_warps, _ = d.hopper_storage()
        self.check_device(device)
        tk = discover.find_triton_kernels((kernel_locations or KernelLocations()).triton_kernels)
        discover.require_triton_generation(tk, generation)
        hp, ip = layout.padded_hidden_size, layout.padded_intermediate_size
        if hp % KERNEL_K_MULTIPLE:
            return (f"hidden size {hp} is not a multiple of {KERNEL_K_MULTIPLE}: triton_kernels' Hopper matmul "
                    "computes wrong results for it; repack with RepackOptions.layout_options pad_hidden=true")  # fmt: skip
        if num_warps == 8 and min(hp, 2 * ip) <= 128:
            return f"output width {min(hp, 2 * ip)} <= 128: triton_kernels' Hopper matmul (num_warps 8) cannot compile for it"
        return None

    def wrap(self, tensors: dict[str, torch.Tensor], spec: LayerSpec,
             kernel_locations: KernelLocations | None = None) -> TritonExperts:  # fmt: skip
        """One rank's buffers wrapped per spec §8; a TP rank's Ip is its share rounded up to the
        layout's ``intermediate_align``. BadInput for another GPU's storage (manifest ``layout.arch``)
        before anything else: its bytes are not what the Hopper layouts wrap."""
        d = TritonDescription.from_layout(spec.layout)
        refusal = _arch_refusal(d)
        if refusal is not None:
            raise BadInput(f"{spec.name}: {refusal}")
        generation, _, _ = d.hopper_storage()
        self.check_device(tensors["w13_weight"].device)
        tk = discover.find_triton_kernels((kernel_locations or KernelLocations()).triton_kernels)
        discover.require_triton_generation(tk, generation)
        ip = spec.layout.padded_intermediate_size if spec.tp_size == 1 else _round_up(spec.rank_intermediate_size, d.intermediate_align)
        return build_experts(tk, tensors, spec, ip)

    def forward(self, experts: TritonExperts, x: torch.Tensor, topk_ids: torch.Tensor | None,
                topk_weights: torch.Tensor | None, logits: torch.Tensor | None, info: Any) -> torch.Tensor:  # fmt: skip
        """triton_kernels' own routing (top-k given, or fused over ``logits``) then the two GEMMs."""
        renormalize = info.routing == "topk_softmax" or bool(info.norm_topk_prob)
        return experts.forward(x, experts.routing(topk_ids, topk_weights, logits, info.top_k, renormalize))


RUNNER = TritonRunner()
