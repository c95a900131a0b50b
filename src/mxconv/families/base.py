"""Model-family readers: map a checkpoint onto canonical MoE layers.

Every family module defines one ``FamilyReader`` subclass. A reader

* detects its family from ``config.json`` and tensor names (:meth:`FamilyReader.detect`);
* describes the model (:meth:`FamilyReader.model_info`), checked against the shard headers;
* lists the MoE layers from headers alone (:meth:`FamilyReader.layer_refs`), naming every source
  tensor the canonical experts consume (everything else is copied byte for byte by the writer);
* reads one layer at a time into a canonical :class:`MoELayer` (:meth:`FamilyReader.read_layer`);
* knows the family's published convention for quantized output (``quantize`` command):
  :meth:`FamilyReader.quantized_specs`, :meth:`FamilyReader.quantized_tensors`,
  :meth:`FamilyReader.quantization_config`.

Canonical layer (one MoE layer, all experts stacked):

| field     | shape        | dtype | meaning |
|-----------|--------------|-------|---------|
| w13       | [E, 2I, H]   | bf16/fp16/fp32 | gate+up, rows in `row_order` |
| w2        | [E, H, I]    | same  | down |
| w13_mx    | MXStack      | uint8 | instead of w13 for MX sources: data [E, 2I, H/2] (mxfp4) or [E, 2I, H] (mxfp8) + scales [E, 2I, H/32] |
| w2_mx     | MXStack      | uint8 | data [E, H, I/2] or [E, H, I] + scales [E, H, I/32] |
| w13_fp8   | FP8BlockStack | float8_e4m3fn + fp32 scale_inv | instead of w13 for block-FP8 sources |
| w13_int4  | Int4Stack    | uint8 + bf16 | instead of w13 for compressed-tensors INT4 sources: data [E, 2I, H/2] offset-binary + scales [E, 2I, H/32] (mxconv.mx.int4) |
| w13_bias  | [E, 2I]      | source dtype (bf16) | only gpt-oss |
| w2_bias   | [E, H]       | source dtype | only gpt-oss |

`row_order`: "interleaved" (gpt-oss: row 2j = gate j, 2j+1 = up j) or "halves" ([gate; up]).
Float stacks may be non-contiguous views (gpt-oss BF16 is stored transposed); consumers make them
contiguous where they compute.

Mixed checkpoints: ``quantize --include/--ignore`` converts some MoE layers and leaves the others in
their source format, so a reader decides the expert format **per layer** from that layer's tensor
names and dtypes (:meth:`FamilyReader.layer_format`); one layer holding two formats is refused. Such
a checkpoint holds at most one MX format (the one its ``quantization_config`` names) next to
unconverted layers that the config lists as not converted (``quantization_config(...,
skipped=...)``). ``ModelInfo.expert_format`` then reports that MX format (the converted layers').

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from mxconv.experts.stack import InputScales
from mxconv.experts.tensors import TensorSpec
from mxconv.source.checkpoint import Checkpoint
from mxconv.errors import BadInput
from mxconv.source.manifest import ModelPart

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelInfo:
    """What the runner, inspect and the manifest need to know about a MoE model."""

    family: str  # registry name, e.g. "gpt-oss"
    num_layers: int  # num_hidden_layers
    moe_layers: tuple[int, ...]  # indices of layers with routed experts
    num_experts: int  # routed experts per MoE layer
    top_k: int
    hidden_size: int  # H
    intermediate_size: int  # I, per expert
    # "bf16" | "fp16" | "fp32" | "mxfp4" | "mxfp8" | "fp8_block"; for a mixed checkpoint (some MoE layers
    # left unconverted by quantize --include/--ignore) the MX format of its converted layers, see
    # FamilyReader.layer_format for each layer's own
    expert_format: str
    row_order: str  # "interleaved" | "halves"
    has_expert_bias: bool
    # routing: "topk_softmax" (gpt-oss: top-k logits then softmax over k; Mixtral is equivalent),
    # "softmax_topk" (softmax over all, top-k, renormalise if norm_topk_prob),
    # "sigmoid_grouped" (DeepSeek-V3: sigmoid + correction bias, grouped top-k, routed scaling)
    routing: str
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # activation: "swigluoai" (gpt-oss: clamp + (up + 1) * gate * sigmoid(alpha * gate)) | "silu"
    activation: str = "silu"
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    source_scale_scheme: str | None = None  # e.g. "fp8_block_128x128", "fp8_block_128x128_ue8m0", "e8m0"

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["moe_layers"] = list(self.moe_layers)
        return d

    @classmethod
    def from_part(cls, part: ModelPart) -> "ModelInfo":
        """The manifest's ``model`` (validated): its fields, an absent optional one at its default
        here, keys a newer mxconv may add left out."""
        values = {f.name: getattr(part, f.name) for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if v is not None})


@dataclass(frozen=True)
class MoELayerRef:
    """Plan-time description of one MoE layer (from headers only, no data read)."""

    layer: int
    module_prefix: str  # e.g. "model.layers.3.mlp" (vLLM params: f"{module_prefix}.experts.w13_weight")
    source_names: tuple[str, ...]  # every tensor the canonical experts are built from
    router_weight: str  # [E, H]
    router_bias: str | None = None  # [E] (gpt-oss)
    correction_bias: str | None = None  # [E] e_score_correction_bias (DeepSeek/GLM)


@dataclass
class MXStack:
    """An MX-quantized expert stack: E2M1-packed (mxfp4) or E4M3 bytes (mxfp8) + E8M0 scales."""

    fmt: str  # "mxfp4" | "mxfp8"
    data: torch.Tensor  # uint8 [E, N, K/2] (mxfp4) or [E, N, K] (mxfp8, E4M3 bit patterns)
    scales: torch.Tensor  # uint8 [E, N, K/32]


@dataclass
class FP8BlockStack:
    """A block-FP8 expert stack kept as stored (DeepSeek ``weight`` + ``weight_scale_inv``), so it
    travels to the compute device at 1 byte per weight and is dequantized there, in fp32.

    ``parts`` are stacked along the rows (gate then up for w13): each is (data float8_e4m3fn
    [E, n_j, K], scale_inv fp32 [E, ceil(n_j/bn), ceil(K/bk)]) with its own tile grid, because a
    projection whose rows are not a multiple of the block has partial edge tiles of its own.
    """

    parts: list[tuple[torch.Tensor, torch.Tensor]]
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int, int]:
        E, _, K = self.parts[0][0].shape
        return (int(E), sum(int(d.shape[1]) for d, _ in self.parts), int(K))

    def dequantize(self, e0: int = 0, e1: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """fp32 [e1 - e0, N, K] on ``device``: W = fp32(W_fp8) * scale_inv of its 128x128 tile."""
        import torch

        from mxconv.mx.numerics import dequantize_fp8_block

        e1 = self.shape[0] if e1 is None else e1
        out = [
            dequantize_fp8_block(d[e0:e1].to(device, non_blocking=True), sc[e0:e1].to(device, non_blocking=True), self.block)
            for d, sc in self.parts
        ]
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)


@dataclass
class Int4Stack:
    """A compressed-tensors INT4 expert stack (symmetric, group 32, bf16 scales) in mxconv's
    canonical int4 form (:mod:`mxconv.mx.int4`): the checkpoint's bytes, viewed, not converted.

    ``data`` uint8 [E, N, K/2]: offset-binary nibbles (stored q + 8), low nibble = even k;
    ``scales`` bf16 [E, N, K/32]: w = q * scale.
    """

    data: torch.Tensor
    scales: torch.Tensor
    fmt: ClassVar[str] = "int4"

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K) of the unpacked weights."""
        E, N, kb = self.data.shape
        return (int(E), int(N), int(kb) * 2)

    def dequantize(self, e0: int = 0, e1: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """Exact fp32 [e1 - e0, N, K] on ``device``: q * scale (see mxconv.mx.int4.dequantize_int4)."""
        from mxconv.mx.int4 import dequantize_int4

        e1 = self.shape[0] if e1 is None else e1
        return dequantize_int4(self.data[e0:e1].to(device, non_blocking=True), self.scales[e0:e1].to(device, non_blocking=True))

    def to(self, device: torch.device | str) -> "Int4Stack":
        """Both tensors on ``device`` (non-blocking host -> device only: a copy to the host is complete on return)."""
        import torch

        nb = torch.device(device).type != "cpu"
        return Int4Stack(self.data.to(device, non_blocking=nb), self.scales.to(device, non_blocking=nb))


@dataclass
class MoELayer:
    """One canonical MoE layer (see module docstring). Exactly one of w13 / w13_mx is set (same for w2)."""

    ref: MoELayerRef
    row_order: str
    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    w13_mx: MXStack | None = None
    w2_mx: MXStack | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    w13_fp8: FP8BlockStack | None = None  # block-FP8 sources: instead of w13 (dequantized on the device)
    w2_fp8: FP8BlockStack | None = None
    w13_int4: Int4Stack | None = None  # compressed-tensors INT4 sources: instead of w13
    w2_int4: Int4Stack | None = None
    # Expert index (in the checkpoint's layer) of row 0 of every stack: a layer read as a group of
    # experts [first_expert, first_expert + E) under a memory budget (mxconv.run.memory); 0 for a whole layer.
    first_expert: int = 0
    # W4A8 sources (AMD Quark): per-expert static FP8 input scales of the whole layer, not cut by
    # select_experts (the engine reduces them over every expert; mxconv.experts.stack.InputScales)
    input_scales: InputScales | None = None

    @property
    def is_mx(self) -> bool:
        return self.w13_mx is not None

    def select_experts(self, e0: int, e1: int) -> "MoELayer":
        """Experts [e0, e1) of this layer (views along dim 0 of every stack), ``first_expert`` set."""
        cut = lambda t: None if t is None else t[e0:e1]  # noqa: E731

        def mx(s: MXStack | None) -> MXStack | None:
            return None if s is None else MXStack(s.fmt, s.data[e0:e1], s.scales[e0:e1])

        def fp8(s: FP8BlockStack | None) -> FP8BlockStack | None:
            return None if s is None else FP8BlockStack([(d[e0:e1], sc[e0:e1]) for d, sc in s.parts], s.block)

        def int4(s: Int4Stack | None) -> Int4Stack | None:
            return None if s is None else Int4Stack(s.data[e0:e1], s.scales[e0:e1])

        return MoELayer(
            self.ref, self.row_order, cut(self.w13), cut(self.w2), mx(self.w13_mx), mx(self.w2_mx),
            cut(self.w13_bias), cut(self.w2_bias), fp8(self.w13_fp8), fp8(self.w2_fp8),
            int4(self.w13_int4), int4(self.w2_int4), self.first_expert + e0, self.input_scales,
        )

    def float_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as float tensors on the CPU (block-FP8 dequantized in fp32). For tests and
        small layers: the conversion path dequantizes on the compute device, in expert chunks."""
        if self.w13_fp8 is not None and self.w2_fp8 is not None:
            return self.w13_fp8.dequantize(), self.w2_fp8.dequantize()
        if self.w13_int4 is not None and self.w2_int4 is not None:
            return self.w13_int4.dequantize(), self.w2_int4.dequantize()
        assert self.w13 is not None and self.w2 is not None
        return self.w13, self.w2


class FamilyReader(ABC):
    """Base class of every family reader (one module per family, registered in families/__init__)."""

    name: ClassVar[str]  # registry key, e.g. "gpt-oss"
    title: ClassVar[str]  # human name, e.g. "gpt-oss (MXFP4 / BF16)"
    # True when read_layer(ref, experts=(e0, e1)) reads only those experts' bytes; otherwise a
    # group is cut from the whole layer, so a memory budget cannot split the reader's layers.
    reads_expert_ranges: ClassVar[bool] = False
    # False when quantize writes another convention than the source's even in the source's format
    # (Quark W4A8 -> gpt-oss MXFP4), so the output's quantization_config is the reader's, not the source's
    quantize_keeps_config: ClassVar[bool] = True

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt

    @classmethod
    @abstractmethod
    def detect(cls, ckpt: Checkpoint) -> bool:
        """True when ``ckpt`` is of this family (config + tensor names)."""

    @abstractmethod
    def model_info(self) -> ModelInfo:
        """Model description, validated against the headers (BadInput naming tensor + reason)."""

    def config_claims(self) -> dict[str, Any]:
        """The :class:`ModelInfo` fields that config.json alone decides (sizes, top_k, routing and
        activation), read without a tensor: ``verify`` holds a kernel output's manifest to them (its
        experts no longer carry the family's tensor names). BadInput when config.json lacks one; the
        default claims nothing (a family that does not say)."""
        return {}

    @abstractmethod
    def layer_refs(self) -> list[MoELayerRef]:
        """Every MoE layer, in layer order, validated against the headers."""

    @abstractmethod
    def read_layer(self, ref: MoELayerRef, experts: tuple[int, int] | None = None) -> MoELayer:
        """Read one layer's expert tensors into a canonical CPU MoELayer; ``experts=(e0, e1)``: only
        experts [e0, e1) (stacks of e1 - e0, ``first_expert`` = e0), where ``reads_expert_ranges``."""

    # ---- quantized output convention (quantize command) -------------------------------------
    @abstractmethod
    def quantized_specs(self, ref: MoELayerRef, fmt: str) -> dict[str, TensorSpec]:
        """Names/shapes/dtypes of the tensors written for this layer's experts in format ``fmt``."""

    @abstractmethod
    def quantized_tensors(self, layer: MoELayer) -> dict[str, torch.Tensor]:
        """The tensors to write for an MX-quantized canonical layer (keys == quantized_specs)."""

    @abstractmethod
    def quantization_config(self, fmt: str, scale_rounding: str, skipped: Sequence[MoELayerRef] = ()) -> dict[str, Any]:
        """config.json ``quantization_config`` for the quantized output.

        ``skipped``: MoE layers of this checkpoint that the output keeps in a format other than
        ``fmt`` (left unconverted by ``--include``/``--ignore``); the config lists their experts as
        not converted, in the family's convention, so loaders (and mxconv's readers) do not take them
        for ``fmt`` weights.
        """

    def format_refusal(self, fmt: str) -> str | None:
        """Why ``quantize --format fmt`` is not written for this family (None: it is); the readers
        that refuse a format override it, and their ``quantized_specs`` raise the same message."""
        return None

    def input_scale_names(self, ref: MoELayerRef) -> tuple[str, ...]:
        """The source tensors holding ``ref``'s static FP8 input scales (every expert's, present or
        not); () for a family whose checkpoints have none (W4A8 readers override it)."""
        return ()

    def layer_format(self, ref: MoELayerRef) -> str:
        """Expert format of one MoE layer, in ``ModelInfo.expert_format``'s vocabulary.

        Readers of families that can hold mixed checkpoints override this; the default is the
        model-wide format.
        """
        return self.model_info().expert_format

    def source_location(self, ref: MoELayerRef, which: str, index: tuple[int, ...]) -> str:
        """Where element ``index`` of canonical ``which`` lives in the source checkpoint, as
        ``"tensor name [i, j, ...]"`` (used in error messages). ``which``: "w13" | "w2" (index
        (expert, row, column)), "w13_scale" | "w2_scale" (expert, row, block of 32), "w13_bias" |
        "w2_bias" (expert, row), "w13_scale_inv" | "w2_scale_inv" (expert, part of the
        :class:`FP8BlockStack`, tile row, tile column).

        The default names the layer's expert module; readers override it with exact tensor names.
        """
        return f"{ref.module_prefix}.experts ({which}) [{', '.join(map(str, index))}]"

    def nonfinite_problem(self, layer: MoELayer) -> str | None:
        """The first value of ``layer`` and its router tensors that is not a number, as "what in
        tensor [index]" (source names and coordinates); None when there is none.

        Checked here: the E8M0 scale bytes of MX experts (0xFF is NaN), the scales of block-FP8
        experts, expert biases, the router weight, bias and correction bias, which a conversion would
        otherwise carry over as they are (or turn into NaN weights named by their element only).
        Float and block-FP8 expert weights are checked where they are quantized (compute).
        """
        from mxconv.mx.numerics import first_nonnumber

        first = layer.first_expert  # dim 0 of every stack is the expert, counted from here
        hit = first_nonnumber(
            {
                "w13_scale": None if layer.w13_mx is None else layer.w13_mx.scales,
                "w2_scale": None if layer.w2_mx is None else layer.w2_mx.scales,
                "w13_bias": layer.w13_bias,
                "w2_bias": layer.w2_bias,
            }
        )
        if hit is not None:
            which, idx, what = hit
            return f"{what} in {self.source_location(layer.ref, which, (idx[0] + first, *idx[1:]))}"
        for which, fp8 in (("w13", layer.w13_fp8), ("w2", layer.w2_fp8)):
            for j, (_, scale_inv) in enumerate(fp8.parts if fp8 is not None else ()):
                hit = first_nonnumber({"scale_inv": scale_inv})
                if hit is not None:
                    e, r, c = hit[1]
                    return f"{hit[2]} in {self.source_location(layer.ref, which + '_scale_inv', (e + first, j, r, c))}"
        if first:  # the routers belong to the whole layer: checked with its first group of experts
            return None
        return nonfinite_tensors(self.ckpt, (layer.ref.router_weight, layer.ref.router_bias, layer.ref.correction_bias))

    def read_checked_layer(
        self, ref: MoELayerRef, allow_nonfinite: bool = False, experts: tuple[int, int] | None = None
    ) -> MoELayer:
        """:meth:`read_layer` (of experts [e0, e1) when ``experts`` is given), refusing (BadInput) what
        :meth:`nonfinite_problem` finds unless ``allow_nonfinite`` (then NaN/Inf biases and routers and
        0xFF scales are carried over as they are)."""
        if experts is None:
            layer = self.read_layer(ref)
        elif self.reads_expert_ranges:
            layer = self.read_layer(ref, experts)
        else:
            layer = self.read_layer(ref).select_experts(*experts)
        if not allow_nonfinite:
            problem = self.nonfinite_problem(layer)
            if problem:
                raise BadInput(f"{self.ckpt.root}: {problem}; set QuantOptions.allow_nonfinite to carry such values over")
        return layer


def nonfinite_tensors(ckpt: Checkpoint, names: Sequence[str | None]) -> str | None:
    """Read the named float tensors of ``ckpt`` (None entries skipped) and describe the first
    NaN/Inf, as "non-finite value nan in tensor [index]"; None when all are finite."""
    from mxconv.mx.numerics import first_nonnumber

    for name in names:
        if name:
            hit = first_nonnumber({name: ckpt.read(name)})
            if hit is not None:
                return f"{hit[2]} in {name} [{', '.join(map(str, hit[1]))}]"
    return None
