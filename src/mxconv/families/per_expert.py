"""Shared reader for MoE families that store one Linear per routed expert.

Qwen2/Qwen3-MoE, Mixtral, DeepSeek-V3/R1/V3.1/Kimi-K2 and GLM-4.5 keep every routed expert as three
``nn.Linear`` weights ``[out, in]`` under ``{root}layers.{L}.{moe}.experts.{e}.{gate|up|down}``
(Mixtral: ``w1`` gate, ``w3`` up, ``w2`` down). A family module only supplies the names, the config
keys that pick the MoE layers and the routing fields; this module does the rest:

Source expert formats (decided from config ``quantization_config`` + tensor names + header dtypes):

| format      | tensors per projection (N = out, K = in)                                   | config |
|-------------|-----------------------------------------------------------------------------|--------|
| bf16/fp16/fp32 | ``weight`` BF16/F16/F32 ``[N, K]``                                       | no quantization_config |
| fp8_block   | ``weight`` F8_E4M3 ``[N, K]`` + ``weight_scale_inv`` F32 ``[ceil(N/bn), ceil(K/bk)]`` | ``quant_method: fp8``, ``weight_block_size: [bn, bk]`` (``scale_fmt: ue8m0`` = powers of two) |
| mxfp4       | ``weight_packed`` U8 ``[N, K/2]`` + ``weight_scale`` U8 ``[N, K/32]``       | compressed-tensors ``mxfp4-pack-quantized`` (mxconv's own output) |
| mxfp8       | ``weight`` F8_E4M3 ``[N, K]`` + ``weight_scale`` U8 ``[N, K/32]``           | compressed-tensors ``mxfp8-quantized`` (mxconv's own output) |
| int4        | ``weight_packed`` I32 ``[N, K/8]`` + ``weight_scale`` BF16 ``[N, K/32]`` + ``weight_shape`` I64 ``[2]`` | compressed-tensors ``pack-quantized``, int 4 bits, symmetric, group 32 (Kimi-K2-Thinking; :mod:`mxconv.families.ct_int4`) |

Canonical layer (see :mod:`mxconv.families.base`): ``w13[e] = cat(gate, up)`` ``[E, 2I, H]``,
``w2[e] = down`` ``[E, H, I]``, row order "halves", no biases. Float sources keep their dtype;
block-FP8 is dequantized **in fp32** (``W = fp32(W_fp8) * scale_inv[i // bn, j // bk]``, one
rounding-free product per element, never through bf16); MX sources become :class:`MXStack` (mxfp8 data
as uint8 E4M3 bit patterns); INT4 sources become :class:`Int4Stack` (the words' bytes, see :mod:`mxconv.mx.int4`).

Quantized output (``quantize`` command): compressed-tensors per-expert Linear tensors under the
source names (``...experts.{e}.gate_proj.weight_packed`` / ``.weight_scale`` for mxfp4,
``.weight`` F8_E4M3 / ``.weight_scale`` for mxfp8) and a ``quantization_config`` with one config
group matching the MXFP4A16 / MXFP8A16 presets of compressed-tensors (float, 4/8 bits, group 32,
symmetric, ``scale_dtype: torch.uint8``). Its targets are a regex on the per-expert Linear names
(compressed-tensors, model-free decompression) plus a regex on the fused-MoE module name
``...{moe}.experts`` (what vLLM's ``FusedMoE`` layer is called). The ``ignore`` list covers every other
Linear of the checkpoint with a few regexes (older vLLM raises on a Linear that matches no target).
``mxconv_scale_rounding`` is recorded as an extra top-level key: compressed-tensors'
``QuantizationConfig`` (pydantic, extra keys ignored), transformers and vLLM all tolerate it.

Known limitation: for block-FP8 sources (DeepSeek/Kimi/GLM-FP8) the non-expert FP8 tensors
(attention, shared experts, dense MLPs, each with ``weight_scale_inv``) are copied unchanged, but the
new ``quantization_config`` describes only the routed experts. compressed-tensors names a block-FP8
scale ``weight_scale`` (same semantics), so describing them would need a rename of the copied
tensors, which the output contract (every other tensor under its own name) forbids. Such an output
therefore loads in the compressed-tensors decompressor (experts) but not in vLLM as is; quantize a
bf16 copy of the model (DeepSeek's ``fp8_cast_bf16``) when a loadable checkpoint is needed.

Mixed output (``quantize --include/--ignore``): the format is decided per MoE layer from its tensors.
The layers left unconverted keep their source tensors (float, or block-FP8) and the config's
``ignore`` gets one ``re:`` pattern per such layer (:meth:`PerExpertReader.ct_layer_pattern`),
matching the layer's per-expert Linear modules and its fused-MoE module ``...layers.L.mlp.experts``:
compressed-tensors and vLLM check ``ignore`` before ``targets``, so they load those experts as
unquantized. Block-FP8 layers additionally need their tile size, which compressed-tensors cannot
express under the DeepSeek tensor names (see above): mxconv records the source's block-FP8
``quantization_config`` under the extra key ``mxconv_unconverted_quantization_config`` and reads the
layers back with it. Reading such a checkpoint, a float or block-FP8 layer next to a compressed-tensors
config must be matched by ``ignore`` (else the config would describe it wrongly), and all MX layers
must be in the config's one MX format.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from mxconv.source.checkpoint import Checkpoint
from mxconv.errors import BadInput
from mxconv.families.base import FamilyReader, FP8BlockStack, ModelInfo, MoELayer, MoELayerRef, MXStack
from mxconv.families.ct_int4 import read_int4_stack
from mxconv.families.ct_output import CompressedTensorsOutput
from mxconv.families.fp8_output import BlockFP8Output
from mxconv.families.per_expert_headers import HeaderPlan, PerExpertPlan
from mxconv.families.quant_config import FLOAT_DTYPES
from mxconv.source.st_format import torch_dtype

if TYPE_CHECKING:
    import torch


class PerExpertReader(PerExpertPlan, BlockFP8Output, CompressedTensorsOutput, FamilyReader):
    """Family reader for per-expert Linear checkpoints; subclasses set names and config rules."""

    moe_module: ClassVar[str] = "mlp"  # "{root}layers.{L}.{moe_module}" is the FusedMoE parent
    reads_expert_ranges: ClassVar[bool] = True
    proj_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    router_module: ClassVar[str] = "gate"
    model_types: ClassVar[frozenset[str]] = frozenset()
    architectures: ClassVar[frozenset[str]] = frozenset()
    # Linear modules that are not routed experts (for the compressed-tensors ignore list).
    ignore_patterns: ClassVar[tuple[str, ...]] = (
        "lm_head",
        r"re:.*embed_tokens$",
        r"re:.*self_attn\..*",
        r"re:.*\.mlp\.gate$",
        r"re:.*\.shared_experts?\..*",
        r"re:.*\.shared_expert_gate$",
        r"re:.*\.mlp\.(gate_proj|up_proj|down_proj)$",
        r"re:.*\.eh_proj$",
        r"re:.*\.shared_head\..*",
    )

    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__(ckpt)
        self._plan_cache: HeaderPlan | None = None
        self._refs_cache: list[MoELayerRef] | None = None

    # ---- family hooks -----------------------------------------------------------------------
    @classmethod
    def detect(cls, ckpt: Checkpoint) -> bool:
        model_type = ckpt.cfg("model_type")
        archs = set(ckpt.config.get("architectures") or []) | set(ckpt.text_config.get("architectures") or [])
        return model_type in cls.model_types or bool(archs & cls.architectures)

    def config_moe_layers(self, num_layers: int) -> tuple[dict[int, str], dict[int, str]]:
        """({layer: why it is MoE}, {optional MoE layer (MTP): why}) from config.json alone."""
        return {L: "every layer is MoE" for L in range(num_layers)}, {}

    def routing_fields(self) -> dict[str, Any]:
        """ModelInfo routing fields (routing, norm_topk_prob, n_group, topk_group, routed_scaling_factor)."""
        raise NotImplementedError

    # ---- config helpers ---------------------------------------------------------------------
    def cfg_int(self, *keys: str, default: int | None = None) -> int:
        v = self.ckpt.cfg(*keys, default=default)
        if v is None:
            raise BadInput(f"{self.ckpt.root / 'config.json'}: missing {' / '.join(repr(k) for k in keys)}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise BadInput(f"{self.ckpt.root / 'config.json'}: {keys[0]!r} must be a non-negative integer, got {v!r}")
        return v

    def _where(self) -> str:
        return str(self.ckpt.root)

    # ---- names --------------------------------------------------------------------------------
    def layer_prefix(self, root: str, layer: int) -> str:
        return f"{root}layers.{layer}.{self.moe_module}"

    def expert_name(self, prefix: str, e: int, proj: int, param: str) -> str:
        """``{prefix}.experts.{e}.{gate|up|down}.{param}`` (proj 0 = gate, 1 = up, 2 = down)."""
        return f"{prefix}.experts.{e}.{self.proj_names[proj]}.{param}"

    # ---- FamilyReader -------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        p = self._plan()
        return ModelInfo(family=self.name, moe_layers=p.layers, expert_format=p.expert_format,
                         source_scale_scheme=p.scale_scheme, **self.config_claims())

    def config_claims(self) -> dict[str, Any]:
        return {**self.config_sizes(), "row_order": "halves", "has_expert_bias": False, "activation": "silu",
                **self.routing_fields()}

    def layer_refs(self) -> list[MoELayerRef]:
        if self._refs_cache is not None:
            return list(self._refs_cache)
        p = self._plan()
        refs = []
        for L in p.layers:
            prefix = self.layer_prefix(p.root, L)
            names = [
                self.expert_name(prefix, e, proj, spec[0])
                for e in range(p.num_experts)
                for proj in range(3)
                for spec in self._proj_specs(p, L, proj)
            ]
            cb = f"{prefix}.{self.router_module}.e_score_correction_bias"
            refs.append(
                MoELayerRef(
                    layer=L,
                    module_prefix=prefix,
                    source_names=tuple(names),
                    router_weight=f"{prefix}.{self.router_module}.weight",
                    router_bias=None,
                    correction_bias=cb if cb in self.ckpt.tensors else None,
                )
            )
        self._refs_cache = refs
        return list(refs)

    def _read_stack(
        self, prefix: str, projs: tuple[int, ...], param: str, rows: int, cols: int, dtype: torch.dtype,
        experts: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Read ``param`` of the given projections of every expert (or of experts [e0, e1)) into one
        ``[E, rows, cols]`` tensor.

        The projections are stacked along dim 1 (gate then up for w13). One read per tensor, copied
        straight into its slice of the preallocated output.
        """
        import torch

        e0, e1 = experts or (0, self._plan().num_experts)
        out = torch.empty((e1 - e0, rows, cols), dtype=dtype)
        step = rows // len(projs)
        for e in range(e0, e1):
            for j, proj in enumerate(projs):
                t = self.ckpt.read(self.expert_name(prefix, e, proj, param))
                if t.dtype != dtype:
                    if t.is_floating_point() and out.is_floating_point():
                        t = t.to(dtype)  # bf16/fp16 weight_scale_inv -> fp32 (exact)
                    else:
                        t = t.view(dtype)  # E4M3 data / F8_E8M0 scales kept as uint8 bit patterns
                out[e - e0, j * step : (j + 1) * step] = t
        return out

    def read_layer(self, ref: MoELayerRef, experts: tuple[int, int] | None = None) -> MoELayer:
        import torch

        p = self._plan()
        H, I = p.hidden_size, p.intermediate_size
        prefix = ref.module_prefix
        shapes = {(0, 1): (2 * I, H), (2,): (H, I)}
        layer = MoELayer(ref=ref, row_order="halves", first_expert=experts[0] if experts else 0)
        fmt, float_dtype = p.layer_fmt[ref.layer]
        for key, (projs, (n, k)) in zip(("w13", "w2"), shapes.items()):
            if fmt == "float":
                assert float_dtype is not None
                w = self._read_stack(prefix, projs, "weight", n, k, torch_dtype(float_dtype), experts)
                setattr(layer, key, w)
            elif fmt == "fp8_block":
                # Kept as stored (1 byte per weight + a small scale grid per projection): the
                # compute device dequantizes in fp32, expert chunk by chunk (a DeepSeek-V3 layer
                # would be 45 GB of fp32 on the host).
                assert p.block is not None
                bn, bk = p.block
                step = n // len(projs)
                parts = []
                for proj in projs:
                    data = self._read_stack(prefix, (proj,), "weight", step, k, torch.float8_e4m3fn, experts)
                    sinv = self._read_stack(prefix, (proj,), "weight_scale_inv", -(-step // bn), -(-k // bk), torch.float32, experts)
                    parts.append((data, sinv))
                setattr(layer, key + "_fp8", FP8BlockStack(parts, p.block))
            elif fmt == "int4":
                setattr(layer, key + "_int4", read_int4_stack(
                    self.ckpt, lambda e, proj, param: self.expert_name(prefix, e, proj, param), self._plan().num_experts,
                    projs, n, k, experts))
            else:
                packed = fmt == "mxfp4"
                data = self._read_stack(prefix, projs, "weight_packed" if packed else "weight", n, k // 2 if packed else k, torch.uint8, experts)
                scales = self._read_stack(prefix, projs, "weight_scale", n, k // 32, torch.uint8, experts)
                setattr(layer, key + "_mx", MXStack(fmt, data, scales))
        return layer

    def source_location(self, ref: MoELayerRef, which: str, index: tuple[int, ...]) -> str:
        """Canonical (expert, row, column or scale block) -> the per-expert source tensor and its
        [row, column] (``weight_packed`` holds two MXFP4 columns per byte; ``weight_scale`` one
        E8M0 byte per block of 32; ``weight_scale_inv`` one per tile). There are no expert biases."""
        proj_key, _, part = which.partition("_")
        if part == "scale_inv":  # (expert, part, tile row, tile column): parts are gate, up | down
            e, j, r, c = index
            return f"{self.expert_name(ref.module_prefix, e, j if proj_key == 'w13' else 2, 'weight_scale_inv')} [{r}, {c}]"
        if part not in ("", "scale"):
            return super().source_location(ref, which, index)
        e, row, col = index
        if proj_key == "w13":
            I = self._plan().intermediate_size
            proj, row = (0, row) if row < I else (1, row - I)
        else:
            proj = 2
        param = "weight"
        if part == "scale":
            param = "weight_scale"
        elif self._plan().layer_fmt[ref.layer][0] == "mxfp4":
            param, col = "weight_packed", col // 2
        elif self._plan().layer_fmt[ref.layer][0] == "int4":
            param, col = "weight_packed", col // 8  # the int32 word
        return f"{self.expert_name(ref.module_prefix, e, proj, param)} [{row}, {col}]"

    def layer_format(self, ref: MoELayerRef) -> str:
        p = self._plan()
        if ref.layer not in p.layer_fmt:
            raise ValueError(f"{ref.module_prefix}: not a MoE layer of this checkpoint")
        fmt, float_dtype = p.layer_fmt[ref.layer]
        if fmt == "float":
            assert float_dtype is not None
            return FLOAT_DTYPES[float_dtype]
        return fmt
