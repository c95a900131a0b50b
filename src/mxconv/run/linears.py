"""Every linear layer of a model as MXFP8 (``quantize --targets linear``), what vLLM's online MXFP8
method does at every start: attention projections (and fused qkv where a checkpoint has it), dense
MLPs, shared experts, next to the routed experts.

Linear layers are found from the headers alone: every 2-D ``{module}.weight`` that is not a routed
expert. Left as they are by default (listed in the config as not quantized): embeddings and
``lm_head`` (and DeepSeek's MTP ``shared_head.head``), routers (every MoE layer's router and
Qwen2-MoE's ``shared_expert_gate``), DeepSeek's MTP ``eh_proj`` (a plain ``nn.Linear`` in vLLM);
norms are 1-D and never candidates. ``--include`` / ``--ignore`` narrow the rest by module name
(:func:`mxconv.run.options.name_matches`). A linear whose input size K is not a multiple of 32 is refused, naming it,
or left alone and listed with ``--skip-unaligned``.

Sources: bf16/fp16/fp32 weights, and block-FP8 ones (``weight`` F8_E4M3 + ``weight_scale_inv``,
DeepSeek-style, tile from ``quantization_config.weight_block_size``), dequantized in fp32 first
(exact product) and then MXFP8-quantized (with power-of-two tile scales and rceil the values are
kept exactly, mx-numerics.md §5.3). A linear that is MXFP8 already (``weight`` F8_E4M3 +
``weight_scale`` U8 ``[N, K/32]``, an earlier mxconv output) is copied as it is and stays described
as MXFP8. MX blocks run along K within each row, so a fused projection (``qkv_proj``,
``gate_up_proj``) quantizes exactly as its parts would: no special case.

Output per quantized linear: ``{module}.weight`` F8_E4M3 ``[N, K]`` and ``{module}.weight_scale`` U8
``[N, K/32]`` (E8M0), biases copied; same scale rounding and kernels as the experts
(:func:`mxconv.run.compute.quantize_stack`). The config side is :mod:`mxconv.run.linear_config`.

With ``quantize --format fp8-block`` the linears are block FP8 instead (what vLLM's Fp8LinearMethod
and transformers' fine-grained FP8 read): ``{module}.weight`` F8_E4M3 ``[N, K]`` and
``{module}.weight_scale_inv`` F32 ``[ceil(N/128), ceil(K/128)]``, amax/448 per 128x128 tile
(:func:`mxconv.mx.fp8_block.float_to_fp8_block`); any K is taken (partial edge tiles), and an MXFP8
source linear is refused (an fp8 quantization_config cannot describe it).

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from mxconv.source.checkpoint import Checkpoint, layer_index
from mxconv.errors import BadInput
from mxconv.run.options import QuantOptions, Targets, WeightFormat, name_matches

if TYPE_CHECKING:
    import torch

    from mxconv.families.base import MoELayerRef
    from mxconv.run.pipeline import WorkItem
    from mxconv.output.shards import PlannedTensor

LINEAR_FORMAT = "mxfp8"
FP8_BLOCK = WeightFormat.FP8_BLOCK.value  # quantize --format fp8-block: the linears are block FP8 too
_TILE = 128
_FLOAT = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}

# ---------------------------------------------------------------------------------------------
# roles: what a tensor is part of, from its name
# ---------------------------------------------------------------------------------------------

ROLES = ("experts", "attention", "dense_mlp", "shared_experts", "routers", "embeddings", "norms", "other")
_ROLE_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("routers", re.compile(r"\.(?:gate|router)\.(?:weight|bias|e_score_correction_bias)$|shared_expert_gate\.")),
    ("experts", re.compile(r"(?:^|\.)experts\.")),
    ("shared_experts", re.compile(r"(?:^|\.)shared_experts?\.")),
    ("embeddings", re.compile(r"embed|(?:^|\.)(?:lm_head|wte|unembedding)\.|shared_head\.head\.")),
    ("norms", re.compile(r"norm[^.]*\.(?:weight|bias|scale)$")),
    ("attention", re.compile(r"(?:^|\.)(?:self_attn|attention|attn)\.")),
    ("dense_mlp", re.compile(r"(?:^|\.)(?:mlp|feed_forward)\.")),
)


def tensor_role(name: str, routers: Iterable[str] = ()) -> str:
    """The part of the model tensor ``name`` belongs to (one of :data:`ROLES`); ``routers`` are
    router tensor names known from the MoE layers (any name works without them)."""
    if name in set(routers):
        return "routers"
    for role, rule in _ROLE_RULES:
        if rule.search(name):
            return role
    return "other"


def bytes_by_role(sizes: Iterable[tuple[str, int]], routers: Iterable[str] = ()) -> dict[str, int]:
    """Sum of (name, bytes) per role, in :data:`ROLES` order, roles without bytes left out."""
    routers = set(routers)
    total = dict.fromkeys(ROLES, 0)
    for name, n in sizes:
        total[tensor_role(name, routers)] += n
    return {k: v for k, v in total.items() if v}


# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------


_DEFAULT_KEPT: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("embedding or lm_head (kept by default)", re.compile(r"embed|(?:^|\.)(?:lm_head|wte|unembedding)$|shared_head\.head$")),
    ("router (kept by default)", re.compile(r"(?:^|\.)(?:gate|router|shared_expert_gate)$")),
    ("MTP eh_proj, a plain nn.Linear in engines (kept by default)", re.compile(r"(?:^|\.)eh_proj$")),
)


@dataclass(frozen=True)
class LinearRef:
    """One linear layer to quantize: ``{module}.weight`` [N, K] of ``source_format``."""

    module: str
    shape: tuple[int, int]
    source_format: str  # "bf16" | "fp16" | "fp32" | "fp8_block"
    role: str
    block: tuple[int, int] | None = None  # fp8_block tile
    out_format: str = LINEAR_FORMAT  # or FP8_BLOCK

    @property
    def weight(self) -> str:
        return f"{self.module}.weight"

    @property
    def source_names(self) -> tuple[str, ...]:
        return (self.weight, f"{self.module}.weight_scale_inv") if self.source_format == "fp8_block" else (self.weight,)

    def out_specs(self) -> dict[str, Any]:
        from mxconv.experts.tensors import TensorSpec

        n, k = self.shape
        if self.out_format == FP8_BLOCK:
            return {self.weight: TensorSpec((n, k), "F8_E4M3"),
                    f"{self.module}.weight_scale_inv": TensorSpec((-(-n // _TILE), -(-k // _TILE)), "F32")}
        return {self.weight: TensorSpec((n, k), "F8_E4M3"), f"{self.module}.weight_scale": TensorSpec((n, k // 32), "U8")}


@dataclass
class LinearSelection:
    """What ``quantize`` does with the linear layers: quantizes ``quantized``, copies ``carried``
    (MXFP8 already) and leaves ``kept`` as they are (module -> why)."""

    targets: str
    scale_rounding: str | None  # None for fp8-block (amax/448 tile scales)
    quantized: list[LinearRef] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    unaligned: list[str] = field(default_factory=list)  # the kept ones --skip-unaligned left alone
    format: str = LINEAR_FORMAT  # of the quantized ones: mxfp8, or fp8-block (with quantize --format fp8-block)

    def mx_modules(self) -> list[str]:
        """Every linear that is quantized in the output (MXFP8, or block FP8 with ``format`` fp8-block)."""
        return sorted({r.module for r in self.quantized} | set(self.carried))

    def source_names(self) -> set[str]:
        return {n for r in self.quantized for n in r.source_names}

    def by_layer(self) -> dict[int, list[LinearRef]]:
        """Quantized linears per decoder layer (global ones under 1 << 30, as the plan orders them)."""
        out: dict[int, list[LinearRef]] = {}
        for r in self.quantized:
            L = layer_index(r.module)
            out.setdefault(1 << 30 if L is None else L, []).append(r)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "targets": self.targets,
            "format": self.format,
            "scale_rounding": self.scale_rounding,
            "quantized": sorted(r.module for r in self.quantized),
            "carried_mx": sorted(self.carried),
            "left_alone": dict(sorted(self.kept.items())),
        }


def is_fp8_block_linear(ckpt: Checkpoint, module: str) -> bool:
    """``{module}.weight`` F8_E4M3 [N, K] with ``weight_scale_inv`` F32 [ceil(N/128), ceil(K/128)]: a
    block-FP8 linear as ``quantize --format fp8-block --targets linear`` writes it."""
    w, s = ckpt.tensors.get(f"{module}.weight"), ckpt.tensors.get(f"{module}.weight_scale_inv")
    if w is None or s is None or w.dtype != "F8_E4M3" or len(w.shape) != 2 or s.dtype != "F32":
        return False
    return tuple(s.shape) == tuple(-(-int(d) // _TILE) for d in w.shape)


def _is_mx8(ckpt: Checkpoint, module: str, n: int, k: int) -> bool:
    s = ckpt.tensors.get(f"{module}.weight_scale")
    return s is not None and s.dtype in ("U8", "F8_E8M0") and tuple(s.shape) == (n, k // 32)


def linear_modules(ckpt: Checkpoint, routers: Iterable[str] = (), experts: Iterable[str] = ()) -> Iterator[tuple[str, str, bool]]:
    """(module, role, MXFP8 already) of every 2-D ``{module}.weight`` of ``ckpt`` that is not a
    routed expert (``experts``: source names known from the MoE layers; any ``.experts.`` name is one)."""
    routers, experts = set(routers), set(experts)
    for name in sorted(ckpt.tensors):
        info = ckpt.tensors[name]
        if not name.endswith(".weight") or name in experts or len(info.shape) != 2:
            continue
        module, role = name[: -len(".weight")], tensor_role(name, routers)
        if role != "experts":  # a MoE layer --include/--ignore left alone: the expert config says so
            n, k = (int(d) for d in info.shape)
            yield module, role, info.dtype == "F8_E4M3" and _is_mx8(ckpt, module, n, k)


def select_linears(ckpt: Checkpoint, all_refs: Sequence[MoELayerRef], quant: QuantOptions) -> LinearSelection:
    """The linear layers of ``ckpt`` and what ``quant`` does
    with each, from the headers alone. BadInput for a linear ``--targets linear`` cannot take."""
    fp8 = quant.fmt == WeightFormat.FP8_BLOCK
    sel = LinearSelection(quant.targets, None if fp8 else quant.scale_rounding, format=FP8_BLOCK if fp8 else LINEAR_FORMAT)
    experts = {n for r in all_refs for n in r.source_names}
    routers = {n for r in all_refs for n in (r.router_weight, r.router_bias, r.correction_bias) if n}
    block: tuple[int, int] | None = None
    for module, role, is_mx in linear_modules(ckpt, routers, experts):
        info = ckpt.tensors[f"{module}.weight"]
        n, k = (int(d) for d in info.shape)
        if is_mx and fp8:
            raise BadInput(f"{info.file}: linear {module} is MXFP8 (weight_scale U8), which a block-FP8 output's "
                           "quantization_config cannot describe; quantize the float checkpoint instead")
        if is_mx:
            sel.carried.append(module)
            continue
        why = "router (kept by default)" if role == "routers" else next((w for w, r in _DEFAULT_KEPT if r.search(module)), None)
        if why is None and quant.targets != Targets.LINEAR:
            why = "--targets experts"
        if why is None and ((quant.include and not name_matches(quant.include, module)) or name_matches(quant.ignore, module)):
            why = "--include/--ignore"
        src_fp8 = info.dtype == "F8_E4M3" and f"{module}.weight_scale_inv" in ckpt.tensors
        if why is None and info.dtype == "F8_E4M3" and not src_fp8 and f"{module}.weight_scale" not in ckpt.tensors:
            raise BadInput(
                f"{info.file}: tensor {info.name!r} is F8_E4M3 but neither {module}.weight_scale_inv (block FP8) nor "
                f"{module}.weight_scale (MXFP8, U8 [{n}, {k // 32}]) is in the checkpoint: its values cannot be read "
                f"without its scales (a damaged or partial checkpoint?); QuantOptions.ignore 're:{re.escape(module)}$' leaves it as it is"
            )
        if why is None and info.dtype not in _FLOAT and not src_fp8:
            why = f"{info.dtype} weight (neither float nor block-FP8)"
        if why is None and k % 32 and not fp8:  # block FP8 takes any K (partial edge tiles)
            if not quant.skip_unaligned:
                raise BadInput(
                    f"{ckpt.root}: linear {module} has input size {k} (weight {list(info.shape)}), not a multiple of 32: "
                    "MXFP8 needs 32-element blocks along the input; set QuantOptions.skip_unaligned to leave such linears "
                    f"unquantized (listed in the config), or set QuantOptions.ignore 're:{re.escape(module)}$'"
                )
            why = f"input size {k} is not a multiple of 32 (--skip-unaligned)"
            sel.unaligned.append(module)
        if why is not None:
            sel.kept[module] = why
            continue
        if src_fp8:
            block = block or _fp8_block(ckpt)
            _check_scale_inv(ckpt, module, n, k, block)
        sel.quantized.append(LinearRef(module, (n, k), "fp8_block" if src_fp8 else _FLOAT[info.dtype], role,
                                       block if src_fp8 else None, sel.format))
    return sel


def _fp8_block(ckpt: Checkpoint) -> tuple[int, int]:
    from mxconv.families.quant_config import read_quant_scheme

    block = read_quant_scheme(ckpt, "linear layers").block
    if block is None:
        raise BadInput(f"{ckpt.root / 'config.json'}: block-FP8 linear layers (weight_scale_inv) but no weight_block_size")
    return block


def _check_scale_inv(ckpt: Checkpoint, module: str, n: int, k: int, block: tuple[int, int]) -> None:
    s = ckpt.tensors[f"{module}.weight_scale_inv"]
    want = (-(-n // block[0]), -(-k // block[1]))
    if s.dtype not in _FLOAT or tuple(s.shape) != want:
        raise BadInput(
            f"{ckpt.root}: tensor {s.name!r} is {s.dtype}{list(s.shape)}, expected a float [{want[0]}, {want[1]}] "
            f"(one scale per {block[0]}x{block[1]} tile of [{n}, {k}])"
        )


def fused_part_warnings(sel: LinearSelection) -> list[str]:
    """Parts of a projection engines fuse (q/k/v, gate/up, Mixtral w1/w3) split between MXFP8 and
    not: vLLM loads a fused layer with one scheme for all its parts."""
    mx = set(sel.mx_modules())
    out = []
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3")):
        for m in sorted(mx):
            parent, _, leaf = m.rpartition(".")
            if leaf in group:
                kept = [f"{parent}.{g}" for g in group if f"{parent}.{g}" in sel.kept]
                if kept:
                    out.append(f"{m} is MXFP8 but {', '.join(kept)} is not: engines that fuse {'/'.join(group)} into one "
                               "layer need one scheme for all of its parts")
    if sel.format == FP8_BLOCK:
        out += _merged_fp8_warnings(sel)
    return sorted(set(out))


def _merged_fp8_warnings(sel: LinearSelection) -> list[str]:
    """Block-FP8 parts of a merged projection (all but its last part: q/k of qkv, gate of gate_up, w1)
    whose output size is not a multiple of 128: vLLM's validate_fp8_block_shape refuses them."""
    return [f"{r.module} is block FP8 with output size {r.shape[0]}, not a multiple of 128: vLLM merges it into one "
            "layer with the next projection and refuses a merged part whose 128-row blocks do not end at its edge"
            for r in sel.quantized if r.module.rpartition(".")[2] in ("q_proj", "k_proj", "gate_proj", "w1") and r.shape[0] % _TILE]


# ---------------------------------------------------------------------------------------------
# run: work items, load, quantize
# ---------------------------------------------------------------------------------------------


def linear_item(ckpt: Checkpoint, refs: list[LinearRef], dests: list[list[PlannedTensor]]) -> WorkItem:
    """The work item of one layer's linears (kind "linear"); its output tensors join ``dests``."""
    from mxconv.run.pipeline import WorkItem
    from mxconv.output.shards import PlannedTensor

    item = WorkItem("linear", ckpt.total_bytes([n for r in refs for n in r.source_names]), payload=refs)
    for d in dests:
        names = []
        for r in refs:
            for n, spec in r.out_specs().items():
                d.append(PlannedTensor(n, spec, "linear"))
                names.append(n)
        item.out_names.append(names)
    return item


def read_float(ckpt: Checkpoint, module: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """Linear ``module`` of ``ckpt`` as fp32 values on ``device``, whatever its format: float,
    block-FP8 (dequantized with the config's tile) or MXFP8 (dequantized). BadInput when it is
    missing or none of these."""
    import torch

    from mxconv.mx.numerics import dequantize_mx

    info = ckpt.info(f"{module}.weight")
    n, k = (int(d) for d in info.shape) if len(info.shape) == 2 else (0, 0)
    w = ckpt.read(info.name)
    if info.dtype in _FLOAT and len(info.shape) == 2:
        return w.to(device).float()
    if info.dtype == "F8_E4M3" and _is_mx8(ckpt, module, n, k):
        return dequantize_mx(w.view(torch.uint8).to(device), ckpt.read(f"{module}.weight_scale").view(torch.uint8).to(device), "mxfp8")
    if info.dtype == "F8_E4M3" and f"{module}.weight_scale_inv" in ckpt.tensors:
        block = _fp8_block(ckpt)
        _check_scale_inv(ckpt, module, n, k, block)
        return source_float(w, ckpt.read(f"{module}.weight_scale_inv").float(), block, device)
    raise BadInput(f"{ckpt.root}: {info.name} is {info.dtype}{list(info.shape)}: not a float, block-FP8 or MXFP8 linear weight")


def source_float(weight: torch.Tensor, scale_inv: torch.Tensor | None, block: tuple[int, int] | None,
                 device: torch.device | str) -> torch.Tensor:
    """A linear's source weight as floats on ``device``: as stored, or block-FP8 dequantized in fp32."""
    from mxconv.mx.numerics import dequantize_fp8_block

    if scale_inv is None:
        return weight.to(device)
    assert block is not None
    return dequantize_fp8_block(weight.to(device), scale_inv.to(device), block)


def manifest_extras(plan: Any) -> dict[str, Any]:
    """What the manifest records about the linear layers and the source's bytes by role (inspect
    shows them next to the output's)."""
    routers = [n for r in plan.reader.layer_refs() for n in (r.router_weight, r.router_bias, r.correction_bias) if n]
    out: dict[str, Any] = {"source_bytes_by_role": bytes_by_role(((n, i.nbytes) for n, i in plan.ckpt.tensors.items()), routers)}
    if plan.linears is not None and plan.linears.mx_modules():
        out["linears"] = plan.linears.to_json()
    return out
