"""What an engine's fused-MoE quant config holds for an mxconv output, as a plain typed object.

:class:`EngineQuantConfig` is built from a manifest (:func:`from_manifest`), written into
``mxconv.json`` under ``quant_config`` (JSON schema: docs/quant-config.schema.json) and read back
with :meth:`EngineQuantConfig.from_json`. It says, for every MoE layer:

* weight dtype (``mxfp4`` / ``mxfp8`` / ``int4`` / ``fp8-block``), block shape (``[1, 32]``; ``[128, 128]``
  for fp8-block, whose fp32 ``weight_scale_inv`` vLLM's Fp8 MoE method reads with dynamic FP8 1x128
  activation groups) and scale format;
* activation quantization (``none`` for canonical outputs; per backend and ``--activation`` for
  kernel outputs: dynamic MXFP8 / MXFP4, dynamic FP8 per token or per 1x128 group);
* the name pattern (``{L}`` = layer, ``{e}`` = expert), safetensors dtype and shape of every weight,
  scale and bias tensor of gemm1 (gate/up, w13) and gemm2 (down, w2): kernel outputs from the
  layout's ``kernel_specs`` (shapes per TP rank), canonical outputs from the manifest's tensors;
* the activation function and its parameters, and the routing method (vLLM ``RoutingMethodType``);
* the vLLM 0.33 backend names that hold exactly these bytes after loading (``served_vllm_backends``:
  ``Mxfp4MoeBackend`` values for MXFP4, ``WNA16MoEBackend`` for INT4, ``Fp8MoeBackend`` for MXFP8), under
  which vLLM quantization method (``served_vllm_methods``; :func:`mxconv.layouts.vllm_serving.vllm_serving`,
  the one rule), and why the other candidates do not (``not_served``).

vLLM facts below are from vLLM 0.33.0: ``fused_moe/oracle/mxfp4.py``
(``mxfp4_round_up_hidden_size_and_intermediate_size``, ``_backend_activation_key``),
``fused_moe/experts/deep_gemm_moe.py`` (``DeepGemmFP4Experts``), ``fused_moe/config.py``
(``get_routing_method_type``) and ``quantization/utils/marlin_utils.py`` (``get__quant_fp8_method``).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from mxconv.errors import BadInput, LayoutError
from mxconv.families.base import ModelInfo
from mxconv.layouts.activation_quant import ActivationQuant, by_activation
from mxconv.layouts.description import ServingDescription
from mxconv.layouts.vllm_backends import VLLM_VERSION
from mxconv.layouts.vllm_serving import OutputForm, VllmMethod, not_served, served_backends, served_methods, vllm_serving
from mxconv.source.manifest import LayerEntry, LayoutPart, Manifest, ModelPart, plain_json

SCHEMA_VERSION = 2  # 2: served_vllm_methods
VLLM_QUANT_METHOD = "mxconv"  # config.json quant_method of a kernel-layout output (vLLM: "Unknown quantization method: mxconv")
VLLM_LOAD_FORMAT = "mxconv"  # the load format mxconv's vLLM plugin registers (mxconv.integrations.vllm)
BLOCK_SHAPE = (1, 32)
ACT_SCHEMES = ("none", "dynamic_mxfp8", "dynamic_mxfp4", "dynamic_fp8_per_token",
               "dynamic_fp8_per_token_group", "static_fp8_per_tensor", "unknown")


@dataclass(frozen=True)
class TensorRef:
    """One tensor of every MoE layer: ``name`` with ``{L}`` (layer) and ``{e}`` (expert, per-expert
    checkpoints), safetensors ``dtype`` (U8, I32, BF16, F32, F8_E4M3, ...) and ``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class GemmTensors:
    """What one grouped GEMM reads: gemm1 = gate/up (w13), gemm2 = down (w2)."""

    weights: tuple[TensorRef, ...]
    scales: tuple[TensorRef, ...]
    biases: tuple[TensorRef, ...]


@dataclass(frozen=True)
class Activation:
    """Gated activation over gemm1's output. ``w13_row_order``: which rows of the canonical w13 are
    gate and up; ``w13_kernel_row_order``: the order of the rows a kernel output stores (the layout's
    own, e.g. trtllm ``up_gate_pairs``), None for a canonical output (its rows are ``w13_row_order``)."""

    name: str  # vLLM MoEActivation value: "swigluoai" | "silu"
    w13_row_order: str  # "interleaved" (gate 2j, up 2j+1) | "halves" ([gate; up])
    formula: str
    alpha: float | None = None
    beta: float | None = None  # added to up ("up + 1")
    limit: float | None = None
    w13_kernel_row_order: str | None = None


@dataclass(frozen=True)
class Routing:
    """Router: mxconv ``method`` and vLLM ``RoutingMethodType`` name, with their parameters."""

    method: str  # "topk_softmax" | "softmax_topk" | "sigmoid_grouped"
    vllm_routing_method: str
    scoring_func: str  # "softmax" | "sigmoid"
    top_k: int
    num_experts: int
    renormalize: bool
    routed_scaling_factor: float = 1.0
    n_group: int | None = None
    topk_group: int | None = None
    router_bias: bool = False
    correction_bias: bool = False  # e_score_correction_bias added before the grouped top-k


@dataclass(frozen=True)
class EngineQuantConfig:
    """One output's fused-MoE quant config (module docstring; docs/quant-config.schema.json)."""

    kind: str  # "canonical" | "kernel"
    backend: str | None  # mxconv backend of a kernel output
    layout_activation: str | None  # its --activation
    weight_dtype: str  # "mxfp4" | "mxfp8" | "int4"
    block_shape: tuple[int, int]
    scale_format: str  # "e8m0" | "bf16"
    activation_quant: ActivationQuant
    gemm1: GemmTensors
    gemm2: GemmTensors
    tensors_per: str  # "tp_rank" (shapes of one rank's tensors) | "checkpoint"
    tp_size: int
    activation: Activation
    routing: Routing
    served_vllm_backends: tuple[str, ...]
    not_served: tuple[tuple[str, str], ...] = ()  # (vLLM backend, reason)
    # (vLLM quantization method class, backends holding the bytes under it): layouts.vllm_serving's rule
    served_vllm_methods: tuple[tuple[str, tuple[str, ...]], ...] = ()
    engine: str = "vllm"
    engine_version: str = ".".join(map(str, VLLM_VERSION))
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (tuples as lists, ``not_served`` as an object)."""
        d = _plain(self)
        d["not_served"] = {name: why for name, why in self.not_served}
        d["served_vllm_methods"] = {m: list(names) for m, names in self.served_vllm_methods}
        return d

    @classmethod
    def from_json(cls, d: Any) -> "EngineQuantConfig":
        """Inverse of :meth:`to_json`; BadInput naming the field when ``d`` is not one."""
        if not isinstance(d, dict) or not all(isinstance(d.get(k, {}), dict) for k in ("not_served", "served_vllm_methods")):
            raise BadInput("quant_config: not a JSON object with not_served and served_vllm_methods objects")
        d = dict(d, not_served=[[k, v] for k, v in d.get("not_served", {}).items()],
                 served_vllm_methods=[[k, v] for k, v in d.get("served_vllm_methods", {}).items()])
        return typing.cast(EngineQuantConfig, _build(cls, d, "quant_config"))

    def summary_rows(self) -> list[tuple[str, str]]:
        """(key, value) lines for a compact table (``mxconv inspect``)."""
        aq, act, r = self.activation_quant, self.activation, self.routing
        params = ", ".join(f"{k} {v}" for k, v in (("alpha", act.alpha), ("beta", act.beta), ("limit", act.limit)) if v is not None)
        route = f"{r.vllm_routing_method} ({r.scoring_func}, top-{r.top_k} of {r.num_experts}"
        if r.n_group is not None:
            route += f", {r.topk_group} of {r.n_group} groups, scale {r.routed_scaling_factor}"
        rows = [
            ("weights", f"{self.weight_dtype}, block {list(self.block_shape)}, {self.scale_format} scales"),
            ("activation quant", aq.scheme + (f" ({aq.dtype}, group {list(aq.group_shape or ())}, {aq.scale_format} scales)" if aq.dtype else "")),
            ("activation", act.name + (f" ({params})" if params else "") + f", w13 {act.w13_row_order}"
             + (f" (stored rows: {act.w13_kernel_row_order})" if act.w13_kernel_row_order else "")),
            ("routing", route + (", correction bias" if r.correction_bias else "") + (", router bias" if r.router_bias else "") + ")"),
        ]
        for gemm, g in (("gemm1", self.gemm1), ("gemm2", self.gemm2)):
            for kind, refs in (("weight", g.weights), ("scale", g.scales), ("bias", g.biases)):
                rows += [(f"{gemm} {kind}", f"{t.name} {t.dtype} {list(t.shape)}") for t in refs]
        rows += [(f"vLLM backends ({VllmMethod(m).tag})", ", ".join(names)) for m, names in self.served_vllm_methods]
        if not self.served_vllm_methods:
            rows.append(("vLLM backends", "none"))
        rows += [(f"not {name}", why) for name, why in self.not_served]
        return rows


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x


def _build(tp: Any, v: Any, where: str) -> Any:
    """``v`` (parsed JSON) as type ``tp`` (dataclass, tuple, optional, scalar); BadInput otherwise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(v, dict):
            raise BadInput(f"{where}: expected an object")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        if set(v) - names:
            raise BadInput(f"{where}: unknown field(s) {sorted(set(v) - names)}")
        try:
            return tp(**{n: _build(hints[n], v[n], f"{where}.{n}") for n in names if n in v})
        except TypeError as exc:  # a required field missing
            raise BadInput(f"{where}: {exc}") from None
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        return _build(next(a for a in args if a is not type(None)), v, where)
    if origin is tuple:
        item_types = [args[0]] * len(v) if isinstance(v, list) and args[-1] is Ellipsis else list(args)
        if not isinstance(v, list) or len(v) != len(item_types):
            raise BadInput(f"{where}: expected a list of {len(item_types)}" if args[-1] is not Ellipsis else f"{where}: expected a list")
        return tuple(_build(t, x, f"{where}[{i}]") for i, (t, x) in enumerate(zip(item_types, v)))
    if tp is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if not isinstance(v, tp) or (tp is int and isinstance(v, bool)):
        raise BadInput(f"{where}: expected {tp.__name__}, got {v!r}")
    return v


def activation_quant(manifest: Manifest) -> ActivationQuant:
    """How the engine quantizes the MoE inputs of a kernel or canonical MX / INT4 output: what its layout
    declares (``Layout.activation_quantization``, by the experts' weight format and ``--activation``);
    a canonical output, or a backend not registered here, by the activation's name (None: weight-only)."""
    if not manifest.is_kernel:
        return by_activation(manifest.activation)
    from mxconv.layouts import get_layout

    try:
        layout = get_layout(str(manifest.backend))
        return layout.activation_quantization(str(manifest.activation), weight_format=str(manifest.weight_format))
    except (BadInput, LayoutError):  # an unknown backend, or a form it no longer has: the name says what it can
        return by_activation(manifest.activation)


# ---------------------------------------------------------------------------------------------
# from a manifest
# ---------------------------------------------------------------------------------------------


def _layer_pattern(prefix: str, layer: int) -> str:
    return re.sub(rf"\.{layer}(?=\.|$)", ".{L}", prefix, count=1)


def _gemm_tensors(named: list[TensorRef], prefix: str) -> tuple[GemmTensors, GemmTensors]:
    """Sort per-layer tensors (names after ``prefix``) into gemm1/gemm2 weights, scales, biases."""
    groups: dict[tuple[int, str], list[TensorRef]] = {}
    for t in named:
        tokens = re.split(r"[._]", t.name[len(prefix):])
        gemm = 2 if ("w2" in tokens or "down" in tokens) else 1
        kind = "biases" if tokens[-1] == "bias" else "scales" if {"scale", "scales"} & set(tokens) else "weights"
        groups.setdefault((gemm, kind), []).append(t)
    g = [GemmTensors(*(tuple(groups.get((i, k), ())) for k in ("weights", "scales", "biases"))) for i in (1, 2)]
    return g[0], g[1]


def _kernel_refs(m: Manifest, pattern: str) -> list[TensorRef] | None:
    """A kernel output's tensors from its layout's kernel_specs; None if the layout cannot say."""
    from mxconv.layouts import get_layout
    from mxconv.experts.stack import LayoutSizes

    lay = m.layout
    try:
        layout = get_layout(str(m.backend))
        sizes = LayoutSizes(m.model.num_experts, *lay.sizes, lay.w13_row_order, m.model.has_expert_bias,
                            m.weight_format if m.weight_format in ("int4", "mxfp8") else "mxfp4")
        specs = layout.kernel_specs(sizes, m.activation, layout.resolve_options(lay.option_values))
    except Exception:  # noqa: BLE001 - an unknown or changed layout: fall back to the tensors table
        return None
    return [TensorRef(f"{pattern}.experts.{k}", s.st_dtype, tuple(s.shape)) for k, s in specs.items()]


def _table_refs(m: Manifest, prefix: str, pattern: str) -> list[TensorRef]:
    """The expert tensors of the layer at ``prefix`` in the manifest's tensors table (rank 0), as patterns."""
    seen: dict[str, TensorRef] = {}
    for key, entry in m.tensors.items():
        name = re.sub(r"^rank-0/", "", key)
        if name.startswith("rank-") or entry.role != "expert" or not name.startswith(prefix + "."):
            continue
        pat = re.sub(r"\.experts\.\d+\.", ".experts.{e}.", pattern + name[len(prefix):])
        seen.setdefault(pat, TensorRef(pat, entry.dtype, entry.shape))
    return list(seen.values())


def _activation(model: ModelPart, layout: LayoutPart) -> Activation:
    order = layout.w13_row_order
    stored = ServingDescription.from_layout(layout).w13_kernel_row_order
    if model.activation == "swigluoai":
        kp = layout.kernel_params or {}
        alpha = float(kp.get("gemm1_alpha", model.swiglu_alpha or 1.702))
        limit = float(kp.get("gemm1_clamp_limit", model.swiglu_limit or 7.0))
        beta = float(kp.get("gemm1_beta", 1.0))
        formula = "g = min(gate, limit); u = clamp(up, -limit, limit); out = (u + beta) * g * sigmoid(alpha * g)"
        return Activation("swigluoai", order, formula, alpha, beta, limit, stored)
    return Activation(model.activation or "silu", order, "out = silu(gate) * up", w13_kernel_row_order=stored)


def _routing(model: ModelPart, first_layer: LayerEntry) -> Routing:
    method = model.routing
    sigmoid = method == "sigmoid_grouped"
    renorm = True if method == "topk_softmax" else model.norm_topk_prob is not False
    bias = first_layer.correction_bias is not None
    groups = (model.n_group or 0) if sigmoid else 0
    if not sigmoid:  # vLLM get_routing_method_type
        vllm = "RenormalizeNaive" if renorm else "Default"
    elif bias:
        vllm = ("DeepSeekV3" if groups > 0 else "MiniMax2") if renorm else "Unspecified"
    else:
        vllm = "SigmoidRenorm" if renorm else "Sigmoid"
    return Routing(
        method=method, vllm_routing_method=vllm, scoring_func="sigmoid" if sigmoid else "softmax",
        top_k=model.top_k, num_experts=model.num_experts, renormalize=renorm,
        routed_scaling_factor=float(model.routed_scaling_factor or 1.0), n_group=groups or None,
        topk_group=(model.topk_group or 1) if groups else None,
        router_bias=first_layer.router_bias is not None, correction_bias=bias,
    )


def from_manifest(manifest: Manifest) -> EngineQuantConfig:
    """The quant config of the output ``manifest`` describes (its layout, model and first layer;
    canonical outputs also its tensors table)."""
    lay, model, first = manifest.layout, manifest.model, manifest.layers[0]
    backend, act, fmt, kernel = manifest.backend, manifest.activation, manifest.weight_format, manifest.is_kernel
    routing = _routing(model, first)
    pattern = _layer_pattern(first.module_prefix, first.layer)
    refs = (_kernel_refs(manifest, pattern) if kernel else None) or _table_refs(manifest, first.module_prefix, pattern)
    form = OutputForm(str(backend) if kernel else lay.name, act, fmt, lay.sizes, ModelInfo.from_part(model).to_json(),
                      lay.engine_compat.get("vllm"), ServingDescription.from_layout(lay).arch, manifest.tp_size)
    try:
        servings = vllm_serving(form)
    except BadInput:  # a backend not registered here: nothing is known about who serves it
        servings = ()
    gemm1, gemm2 = _gemm_tensors(refs, pattern)
    fp8 = fmt == "fp8-block"
    return EngineQuantConfig(
        kind=manifest.kind, backend=backend, layout_activation=act, weight_dtype=fmt, block_shape=(128, 128) if fp8 else BLOCK_SHAPE,
        scale_format="float32" if fp8 else "bf16" if fmt == "int4" else "e8m0",
        activation_quant=ActivationQuant("dynamic_fp8_per_token_group", "float8_e4m3fn", (1, 128), "float32") if fp8
        else activation_quant(manifest),
        gemm1=gemm1, gemm2=gemm2, tensors_per="tp_rank" if kernel else "checkpoint",
        tp_size=manifest.tp_size, activation=_activation(model, lay), routing=routing,
        served_vllm_backends=served_backends(servings),
        served_vllm_methods=tuple((m, tuple(b)) for m, b in served_methods(servings).items()),
        not_served=tuple(not_served(servings).items()),
    )


def quant_config_of(manifest: Manifest) -> EngineQuantConfig:
    """The manifest's stored ``quant_config`` when it has one of this schema version, else recomputed."""
    stored = manifest.quant_config
    if stored is not None and stored.get("schema_version") == SCHEMA_VERSION:
        return EngineQuantConfig.from_json(plain_json(stored))
    return from_manifest(manifest)


def recorded_not_served(manifest: Manifest) -> dict[str, str] | None:
    """The vLLM backends the manifest's stored ``quant_config`` records as not holding its bytes, with why
    (None: no quant config stored). Read as written, whatever the config's schema version: only a message
    quotes it (mxconv.integrations.vllm.checks)."""
    # the one reader of the quant_config JSON outside EngineQuantConfig.from_json, its owner's module
    not_served = None if manifest.quant_config is None else manifest.quant_config.get("not_served")
    return None if not_served is None else {str(k): str(v) for k, v in not_served.items()}


def quant_config_keys(manifest: Manifest) -> dict[str, Any]:
    """The manifest keys that say how engines serve ``manifest``'s output: ``quant_config``,
    ``served_vllm_backends`` and ``served_vllm_methods`` (the writer adds them, run.finalize)."""
    qc = from_manifest(manifest)
    return {"quant_config": qc.to_json(), "served_vllm_backends": list(qc.served_vllm_backends),
            "served_vllm_methods": {m: list(names) for m, names in qc.served_vllm_methods}}
