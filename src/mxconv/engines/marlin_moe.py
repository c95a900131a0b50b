"""Run a MoE layer through vLLM's own Marlin MoE GEMM (``_moe_C::moe_wna16_marlin_gemm``) from
the tensors exactly as ``mxconv repack --backend marlin`` writes them (docs/layout-marlin.md). MXFP8
outputs (manifest layout ``variant: mxfp8``, §13) run the same calls with the float8_e4m3fn weight
type, Hp = H and Ip = roundup(I, 64) (w13 [E, H/16, 8*Ip], w2 [E, Ip/16, 4*H]).

Tensors per layer and rank (Hp = round_up(H, 256), Ip = round_up(I, 128)):

| tensor           | dtype           | shape             |
|------------------|-----------------|-------------------|
| w13_weight       | int32           | [E, Hp/16, 4*Ip]  |
| w13_weight_scale | float8_e8m0fnu  | [E, Hp/32, 2*Ip]  |
| w13_bias         | bf16 (optional) | [E, 2*Ip]         |
| w2_weight        | int32           | [E, Ip/16, 2*Hp]  |
| w2_weight_scale  | float8_e8m0fnu  | [E, Ip/32, Hp]    |
| w2_bias          | bf16 (optional) | [E, Hp]           |

The forward is the call sequence of vLLM's ``fused_marlin_moe`` (facts only, written here):
``moe_align_block_size`` -> GEMM 1 (``top_k``, no router weight, N = 2Ip) -> activation ->
GEMM 2 (``top_k = 1`` over T*k rows, router weight applied, bias before it) -> sum over the k.
w13 rows keep the source order: gpt-oss interleaved pairs (SwiGLU-OAI on columns 2j / 2j+1),
other families halves padded per half (SiLU on columns [0, Ip) and [Ip, 2Ip)).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mxconv.engines import discover
from mxconv.engines.runner import SWIGLU_ALPHA, SWIGLU_LIMIT, LayerSpec, gated_activation, softmax_topk
from mxconv.errors import BadInput
from mxconv.experts.kernel_settings import KernelLocations
from mxconv.layouts.marlin_description import MarlinDescription
from mxconv.source.manifest import LayoutPart

MARLIN_HIDDEN_MULTIPLE = 256
MARLIN_INTERMEDIATE_MULTIPLE = 128
BLOCKS_PER_SM = 4  # vLLM's Marlin workspace: 4 int32 per SM per block slot
NAN_REPR_NONE = 0  # vLLM ScalarType NanRepr.NONE


def scalar_type_id(exponent: int, mantissa: int, signed: bool, bias: int, finite_values_only: bool, nan_repr: int) -> int:
    """vLLM's ``ScalarType.id``: the fields packed little-end first into one integer, widths
    exponent 8, mantissa 8, signed 1, bias 32, finite-values-only 1, NaN representation 8 bits."""
    value, offset = 0, 0
    for field_value, width in ((exponent, 8), (mantissa, 8), (int(signed), 1), (bias, 32), (int(finite_values_only), 1), (nan_repr, 8)):
        value |= (int(field_value) & ((1 << width) - 1)) << offset
        offset += width
    return value


# float4_e2m1f: 2 exponent bits, 1 mantissa bit, signed, no bias, finite values only, no NaN.
FLOAT4_E2M1F_ID = scalar_type_id(2, 1, True, 0, True, NAN_REPR_NONE)
NAN_REPR_EXTD_RANGE_MAX_MIN = 2  # vLLM ScalarType NanRepr.EXTD_RANGE_MAX_MIN: NaN = all exponent and mantissa bits set
# float8_e4m3fn (vLLM scalar_types.float8_e4m3fn): the weight type of the MXFP8 form (layouts/marlin_mxfp8.py)
FLOAT8_E4M3FN_ID = scalar_type_id(4, 3, True, 0, True, NAN_REPR_EXTD_RANGE_MAX_MIN)


@dataclass(frozen=True)
class MarlinForm:
    """What the kernel call depends on per weight format: the weight's scalar type, int32 words a
    stored row holds per output row (16 K values of 4 or 8 bits), and the sizes vLLM lets through."""

    weight_format: str
    quant_type_id: int
    words_per_n: int
    hidden_multiple: int
    intermediate_multiple: int


FORMS = {"mxfp4": MarlinForm("mxfp4", FLOAT4_E2M1F_ID, 2, MARLIN_HIDDEN_MULTIPLE, MARLIN_INTERMEDIATE_MULTIPLE),
         "mxfp8": MarlinForm("mxfp8", FLOAT8_E4M3FN_ID, 4, 64, 64)}  # fmt: skip


def moe_block_size(tokens: int, top_k: int, num_experts: int) -> int:
    """vLLM's M-block choice for Marlin MoE: the first of 8, 16, 32, 48, 64 with fewer than ~0.9
    blocks of (token, expert) pairs per expert, else 64."""
    for block in (8, 16, 32, 48, 64):
        if tokens * top_k / num_experts / block < 0.9:
            return block
    return 64


def align_buffer_sizes(pairs: int, num_experts: int, block: int) -> tuple[int, int]:
    """(sorted-id slots, expert-block slots) ``moe_align_block_size`` may fill for ``pairs`` = T*k."""
    slots = pairs + num_experts * (block - 1)
    if pairs < num_experts:
        slots = min(pairs * block, slots)
    return slots, -(-slots // block)


def align_block_size(ids: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_moe_C::moe_align_block_size`` (8-argument form of vLLM 0.33): ``ids`` int32 [T, k] ->
    (sorted token ids int32, expert id per block int32, tokens after padding int32 [1])."""
    slots, blocks = align_buffer_sizes(ids.numel(), num_experts, block)
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    post_pad = torch.empty(1, dtype=torch.int32, device=ids.device)
    torch.ops._moe_C.moe_align_block_size(ids, num_experts, block, sorted_ids, expert_ids, post_pad, None, None)
    return sorted_ids, expert_ids, post_pad


def marlin_workspace(device: torch.device) -> torch.Tensor:
    """Zeroed int32 lock buffer, ``BLOCKS_PER_SM`` per SM (vLLM's ``get_marlin_workspace``)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(sms * BLOCKS_PER_SM, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class _Dispatch:
    """What both GEMMs of one forward share: the tokens' routing aligned to the kernel's blocks
    (sorted ids, expert ids, padded count), the top-k weights, the block size, the kernel's workspace
    and the stored weights' scalar type."""

    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    topk_weights: torch.Tensor
    block: int
    workspace: torch.Tensor
    quant_type_id: int

    def gemm(self, a: torch.Tensor, out: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
             top_k: int, mul_topk_weights: bool, mnk: tuple[int, int, int]) -> torch.Tensor:  # fmt: skip
        """``a`` times one expert stack (``weights``: packed weights, scales, bias or None) into ``out``."""
        w, scale, bias = weights
        m, n, k = mnk
        sorted_ids, expert_ids, post_pad = self.align
        return torch.ops._moe_C.moe_wna16_marlin_gemm(
            a, out, w, bias, scale, None, None, None, self.workspace, sorted_ids, expert_ids, post_pad, self.topk_weights,
            self.block, top_k, mul_topk_weights, self.quant_type_id, m, n, k,
            False, True, False, -1, -1, -1,  # atomic add, fp32 reduce, float zero points, thread_k/n, blocks/SM
        )  # fmt: skip


@dataclass
class MarlinExperts:
    """One rank's experts as vLLM's Marlin MoE kernel takes them (table in the module docstring),
    plus the kernel's int32 workspace. ``row_order`` is the w13 row order ("interleaved" |
    "halves"), ``activation`` "swigluoai" | "silu"."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    workspace: torch.Tensor
    num_experts: int
    hidden_size: int
    padded_hidden_size: int
    padded_intermediate_size: int
    row_order: str
    activation: str
    swiglu_alpha: float = SWIGLU_ALPHA
    swiglu_limit: float = SWIGLU_LIMIT
    quant_type_id: int = FLOAT4_E2M1F_ID  # the stored weights' scalar type (MarlinForm)
    last_block: int = field(default=0, repr=False)

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """GEMM-1 output [T*k, 2Ip] bf16 -> [T*k, Ip] bf16 (fp32 math)."""
        return gated_activation(h, self.row_order, self.activation, self.padded_intermediate_size, "marlin",
                                self.swiglu_alpha, self.swiglu_limit)  # fmt: skip

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] (any float; run as bf16), ``ids`` [T, k] integer, ``weights`` [T, k] float, all on
        the experts' device -> [T, H] bf16."""
        T, k = ids.shape
        E, Hp, Ip = self.num_experts, self.padded_hidden_size, self.padded_intermediate_size
        a = torch.nn.functional.pad(x.to(torch.bfloat16), (0, Hp - x.shape[1])).contiguous()
        ids32 = ids.to(torch.int32).contiguous()
        topk_weights = weights.to(torch.float32).contiguous()
        block = moe_block_size(T, k, E)
        self.last_block = block
        dispatch = _Dispatch(align_block_size(ids32, E, block), topk_weights, block, self.workspace, self.quant_type_id)
        h = torch.empty(T * k, 2 * Ip, dtype=torch.bfloat16, device=a.device)
        h = dispatch.gemm(a, h, (self.w13, self.w13_scale, self.b13), k, False, (T, 2 * Ip, Hp))
        inter = self.activate(h)
        y = torch.empty(T * k, Hp, dtype=torch.bfloat16, device=a.device)
        y = dispatch.gemm(inter, y, (self.w2, self.w2_scale, self.b2), 1, True, (T * k, Hp, Ip))
        return y.view(T, k, Hp).sum(dim=1)[:, : self.hidden_size]


def build_experts(tensors: dict[str, torch.Tensor], spec: LayerSpec, padded_intermediate_size: int,
                  row_order: str) -> MarlinExperts:  # fmt: skip
    """Check one rank's stored tensors (names without prefix, on the GPU) against the Marlin layout
    the manifest declares (``spec.layout``: its :class:`MarlinDescription`) and hold them for the kernel.
    BadInput for variants vLLM 0.33's kernel does not run here: FP8 activations (SM89/SM120 only) and the
    legacy (vLLM <= 0.11.2) scales."""
    d, name = MarlinDescription.from_layout(spec.layout), spec.name
    if d.activation != "bf16":
        raise BadInput(f"{name}: Marlin with {d.activation} activations (W4A8-FP8) runs on SM89/SM120 only; repack with RepackOptions.activation bf16")
    if d.scale_layout != "current":
        raise BadInput(f"{name}: legacy Marlin scales (vLLM <= 0.11.2) are not what vLLM 0.33's kernel reads; repack with RepackOptions.layout_options marlin_scale_layout=current")
    E, Hp, Ip = spec.num_experts, spec.padded_hidden_size, padded_intermediate_size
    form = FORMS.get(d.variant)
    if form is None:
        raise BadInput(f"{name}: the Marlin layout's variant {d.variant!r} is not one this runner knows ({', '.join(FORMS)})")
    if Hp % form.hidden_multiple or Ip % form.intermediate_multiple:
        raise BadInput(f"{name}: Marlin {form.weight_format} sizes must be multiples of {form.hidden_multiple} / "
                       f"{form.intermediate_multiple}, got hidden {Hp}, intermediate {Ip}")  # fmt: skip
    want = {
        "w13_weight": ((E, Hp // 16, form.words_per_n * 2 * Ip), (torch.int32,)),
        "w13_weight_scale": ((E, Hp // 32, 2 * Ip), (torch.float8_e8m0fnu, torch.uint8)),
        "w2_weight": ((E, Ip // 16, form.words_per_n * Hp), (torch.int32,)),
        "w2_weight_scale": ((E, Ip // 32, Hp), (torch.float8_e8m0fnu, torch.uint8)),
        "w13_bias": ((E, 2 * Ip), (torch.bfloat16,)),
        "w2_bias": ((E, Hp), (torch.bfloat16,)),
    }
    held: dict[str, torch.Tensor | None] = {}
    for key, (shape, dtypes) in want.items():
        t = tensors.get(key)
        if t is None:
            if not key.endswith("bias"):
                raise BadInput(f"{name}.{key}: missing")
            held[key] = None
            continue
        if tuple(t.shape) != shape or t.dtype not in dtypes:
            raise BadInput(f"{name}.{key}: stored {t.dtype}{list(t.shape)}, the Marlin layout needs {dtypes[0]}{list(shape)}")
        if t.dtype == torch.uint8:
            t = t.view(torch.float8_e8m0fnu)
        held[key] = t.contiguous()
    if (held["w13_bias"] is None) != (held["w2_bias"] is None):
        raise BadInput(f"{name}: w13_bias and w2_bias must both be present or both absent")
    return MarlinExperts(
        held["w13_weight"], held["w13_weight_scale"], held["w2_weight"], held["w2_weight_scale"],  # type: ignore[arg-type]
        held["w13_bias"], held["w2_bias"], marlin_workspace(held["w13_weight"].device),  # type: ignore[union-attr]
        E, spec.hidden_size, Hp, Ip, row_order, spec.activation, spec.swiglu_alpha, spec.swiglu_limit, form.quant_type_id,
    )  # fmt: skip


class MarlinRunner:
    """The :class:`~mxconv.engines.runner.EngineRunner` of ``--backend marlin``: vLLM's compiled
    ``moe_wna16_marlin_gemm`` on the tensors as written (the marlin layout points here)."""

    device = "cuda"
    what = "vLLM's Marlin MoE kernel"

    def check_device(self, device: Any) -> None:
        discover.check_gpu(device, exact=None, minimum=discover.MARLIN_MIN_CAPABILITY, what=self.what)

    def kernel_unavailable(self, layout: LayoutPart, device: Any,
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        self.check_device(device)
        discover.find_marlin_ops((kernel_locations or KernelLocations()).marlin_ops)
        d = MarlinDescription.from_layout(layout)
        if d.activation != "bf16":
            return "Marlin with FP8 activations runs on SM89/SM120 only (this output was repacked with RepackOptions.activation fp8)"
        if d.scale_layout != "current":
            return "legacy Marlin scales (vLLM <= 0.11.2) are not read by vLLM 0.33's kernel"
        return None

    def wrap(self, tensors: dict[str, torch.Tensor], spec: LayerSpec,
             kernel_locations: KernelLocations | None = None) -> MarlinExperts:  # fmt: skip
        """One rank's tensors checked and held; Ip is read as vLLM reads it (w2.shape[1] * 16)."""
        self.check_device(tensors["w13_weight"].device)
        discover.find_marlin_ops((kernel_locations or KernelLocations()).marlin_ops)
        ip = int(tensors["w2_weight"].shape[1]) * 16
        return build_experts(tensors, spec, ip, spec.layout.w13_row_order)

    def forward(self, experts: MarlinExperts, x: torch.Tensor, topk_ids: torch.Tensor | None,
                topk_weights: torch.Tensor | None, logits: torch.Tensor | None, info: Any) -> torch.Tensor:  # fmt: skip
        """Top-k from ``logits`` in torch when no ids are given, then the two Marlin GEMMs."""
        if topk_ids is None:
            renormalize = info.routing == "topk_softmax" or bool(info.norm_topk_prob)
            topk_ids, topk_weights = softmax_topk(logits, info.top_k, renormalize, info.routing)  # type: ignore[arg-type]
        return experts.forward(x, topk_ids, topk_weights)  # type: ignore[arg-type]


RUNNER = MarlinRunner()
