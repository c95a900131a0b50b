"""What the headers of a per-expert Linear checkpoint say (:mod:`mxconv.families.per_expert`): the
routed-expert tensors found by name, each MoE layer's source format checked against
``quantization_config``, the sizes from config.json, and every expert tensor's dtype and shape
validated before a byte is read. A mixin of :class:`~mxconv.families.per_expert.PerExpertReader`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

from mxconv.errors import BadInput
from mxconv.families.ct_int4 import int4_proj_specs
from mxconv.families.expert_scan import expert_names
from mxconv.families.quant_config import (
    FLOAT_DTYPES, MX_FORMATS, UNCONVERTED_KEY, QuantScheme, ct_matches, quantization_dict, read_quant_scheme, unsupported_quantization,
)
from mxconv.source.st_format import TensorInfo

_EXPERT_PARAMS = ("weight", "weight_packed", "weight_scale", "weight_scale_inv", "weight_shape")
_INT4_PARAMS = frozenset({"weight_packed", "weight_scale", "weight_shape"})


# ---------------------------------------------------------------------------------------------
# plan: what the headers say
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeaderPlan:
    """What a per-expert checkpoint's headers and config say, checked once: formats, sizes, layers."""

    root: str  # tensor-name prefix before "layers.", e.g. "model."
    layers: tuple[int, ...]
    fmt: str  # "float" | "fp8_block" | "mxfp4" | "mxfp8" | "int4": the MX format of a mixed checkpoint
    expert_format: str  # ModelInfo.expert_format
    float_dtype: str | None  # safetensors dtype of float sources
    layer_fmt: dict[int, tuple[str, str | None]]  # per MoE layer: (fmt, safetensors dtype of a float layer)
    block: tuple[int, int] | None
    scale_scheme: str | None
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int

    def expert_projections(self) -> Iterable[tuple[int, int, int, int]]:
        """(expert, projection 0/1/2 = gate/up/down, N, K) of every routed expert's Linear weight [N, K]:
        the outputs' per-expert tensor specs walk these."""
        H, I = self.hidden_size, self.intermediate_size
        for e in range(self.num_experts):
            for proj in range(3):
                yield (e, proj, *((I, H) if proj < 2 else (H, I)))


class PerExpertPlan:
    """The plan (cached) and header checks of :class:`PerExpertReader`, which supplies the names
    (``moe_module``, ``proj_names``, ``router_module``), ``ckpt``, the config hooks and helpers."""

    # ---- plan ---------------------------------------------------------------------------------
    def config_sizes(self) -> dict[str, int]:
        """The model's sizes as config.json gives them (ModelInfo field names), before any header."""
        return {
            "num_layers": self.cfg_int("num_hidden_layers"),
            "num_experts": self.cfg_int("num_local_experts", "num_experts", "n_routed_experts"),
            "top_k": self.cfg_int("num_experts_per_tok", "experts_per_token"),
            "hidden_size": self.cfg_int("hidden_size"),
            "intermediate_size": self.cfg_int("moe_intermediate_size", "intermediate_size"),
        }

    def _scan(self) -> tuple[str, dict[int, set[int]], dict[int, dict[str, str]]]:
        """(root, {layer: expert indices seen}, {layer: {param seen: first tensor name}}) from the names."""
        pat = re.compile(
            rf"^(?P<root>(?:.*\.)?)layers\.(?P<layer>\d+)\.{re.escape(self.moe_module)}\.experts\.(?P<e>\d+)\."
            rf"(?:{'|'.join(map(re.escape, self.proj_names))})\.(?P<param>{'|'.join(_EXPERT_PARAMS)})$"
        )
        roots, matches = expert_names(sorted(self.ckpt.tensors), pat)
        layers = {L: {int(m["e"]) for m in ms} for L, ms in matches.items()}
        params: dict[int, dict[str, str]] = {L: {} for L in matches}
        for L, ms in matches.items():
            for m in ms:
                params[L].setdefault(m["param"], m.string)
        if not roots:
            fused = sorted(n for n in self.ckpt.tensors if n.endswith(".experts.gate_up_proj"))
            hint = (
                f" (found fused expert tensors such as {fused[0]!r}, the transformers>=5 layout, "
                f"which mxconv does not read yet)"
                if fused
                else ""
            )
            example = f"model.layers.N.{self.moe_module}.experts.E.{self.proj_names[0]}.weight"
            raise BadInput(f"{self._where()}: no routed-expert tensors found (expected names like {example!r}){hint}")
        if len(roots) > 1:
            raise BadInput(f"{self._where()}: routed-expert tensors under several prefixes {sorted(roots)}")
        return roots.pop(), layers, params

    def _layer_format(self, scheme: QuantScheme, root: str, layer: int, params: dict[str, str]) -> tuple[str, str | None]:
        """(format, float dtype) of one MoE layer from its parameters and dtypes, checked against
        quantization_config. ``params``: {param present in the layer: first tensor name}."""
        names = set(params)
        if scheme.method != "ct-int4":
            names.discard("weight_shape")  # only INT4 consumes it; elsewhere it is copied like any tensor
        if scheme.method == "ct-int4" and "weight_packed" in names and names <= _INT4_PARAMS:
            fmt = "int4"  # a missing weight_scale / weight_shape is named by _check_layer
        elif scheme.method == "ct-int4":  # e.g. FP8 tensors under an INT4 config
            raise unsupported_quantization(self.ckpt, quantization_dict(self.ckpt) or {}, self.title)
        elif names == {"weight"}:
            fmt = "float"
        elif names == {"weight", "weight_scale_inv"}:
            fmt = "fp8_block"
        elif names == {"weight_packed", "weight_scale"}:
            fmt = "mxfp4"
        elif names == {"weight", "weight_scale"}:
            fmt = "mxfp8"
        else:
            raise BadInput(
                f"{self._where()}: unrecognised routed-expert tensor set in layer {layer} (parameters "
                f"{sorted(names)}); expected weight, weight+weight_scale_inv (block-FP8), weight_packed+weight_scale "
                f"(MXFP4) or weight+weight_scale (MXFP8), one of them for every expert of a layer"
            )
        first = params.get("weight_packed") or params["weight"]
        sample = self.ckpt.info(first)
        want = {None: "float", "fp8": "fp8_block", "ct-int4": "int4"}.get(scheme.method, scheme.mx_fmt)
        fused_moe = f"{self.layer_prefix(root, layer)}.experts"
        if fmt != want and scheme.method == "fp8" and fmt == "float" and fused_moe in scheme.ignore:
            pass  # a float MoE layer a partial fp8-block quantize left alone, listed exactly as vLLM matches it
        elif fmt != want:
            if scheme.method != "ct-mx" or fmt in MX_FORMATS:
                qc = "no quantization_config" if scheme.method is None else f"quantization_config says {want}"
                raise BadInput(
                    f"{self._where()}: routed-expert tensors such as {sample.name!r} ({sample.dtype}) are {fmt}, "
                    f"but config.json has {qc}"
                )
            # A layer a partial quantize left unconverted: the config must say so.
            module = self.expert_name(self.layer_prefix(root, layer), 0, 0, "").rstrip(".")
            if not ct_matches(module, scheme.ignore):
                raise BadInput(
                    f"{self._where()}: routed-expert tensors such as {sample.name!r} ({sample.dtype}) are {fmt}, but "
                    f"config.json's compressed-tensors quantization_config (MX {want}) does not list layer {layer}'s "
                    f"experts (e.g. {module!r}) in 'ignore'"
                )
            if fmt == "fp8_block" and scheme.block is None:
                raise BadInput(
                    f"{self._where()}: layer {layer}'s routed experts are block-FP8 (e.g. {sample.name!r}), but "
                    f"config.json has no {UNCONVERTED_KEY} giving their weight_block_size"
                )
        float_dtype = None
        if fmt == "float":
            float_dtype = sample.dtype
            if float_dtype not in FLOAT_DTYPES:
                why = "config.json has no quantization_config" if scheme.method is None else "an unconverted layer"
                raise BadInput(
                    f"{self._where()}: tensor {first!r} has dtype {float_dtype}, expected BF16, F16 or F32 ({why})"
                )
        return fmt, float_dtype

    def _plan(self) -> HeaderPlan:
        if self._plan_cache is not None:
            return self._plan_cache
        ck = self.ckpt
        scheme = read_quant_scheme(ck, self.title)
        sizes = self.config_sizes()
        num_layers, E, top_k = sizes["num_layers"], sizes["num_experts"], sizes["top_k"]
        H, I = sizes["hidden_size"], sizes["intermediate_size"]
        if E == 0 or top_k == 0 or top_k > E:
            raise BadInput(f"{ck.root / 'config.json'}: num_experts_per_tok={top_k} with {E} routed experts")
        root, found, params = self._scan()
        moe, optional = self.config_moe_layers(num_layers)
        for L in sorted(moe):
            if L not in found:
                name = self.expert_name(self.layer_prefix(root, L), 0, 0, "weight")
                raise BadInput(
                    f"{self._where()}: config.json makes layer {L} a MoE layer ({moe[L]}), but the checkpoint has "
                    f"no routed-expert tensors for it (e.g. {name!r} is missing)"
                )
        for L in sorted(found):
            if L not in moe and L not in optional:
                name = self.expert_name(self.layer_prefix(root, L), min(found[L]), 0, "")
                raise BadInput(
                    f"{self._where()}: layer {L} has routed-expert tensors ({name.rstrip('.')}...), but config.json "
                    f"makes it a dense layer (num_hidden_layers={num_layers}; {self.dense_reason(L)})"
                )
        for L in sorted(optional):
            lp = f"{root}layers.{L}."
            if L not in found and any(n.startswith(lp) for n in ck.tensors):
                raise BadInput(
                    f"{self._where()}: layer {L} ({optional[L]}) is in the checkpoint but has no routed-expert tensors"
                )
        layers = tuple(sorted(found))
        layer_fmt = {L: self._layer_format(scheme, root, L, params[L]) for L in layers}
        # Model-wide format: the MX format of a mixed checkpoint's converted layers, else the
        # (uniform) source format of the first layer.
        mx = [f for f, _ in layer_fmt.values() if f in MX_FORMATS]
        fmt, float_dtype = (mx[0], None) if mx else layer_fmt[layers[0]]
        if (mx or fmt == "int4") and (H % 32 or I % 32):
            raise BadInput(f"{ck.root / 'config.json'}: hidden_size {H} / intermediate size {I} not multiples of 32")
        scale_scheme = None
        if fmt == "fp8_block":
            assert scheme.block is not None
            scale_scheme = f"fp8_block_{scheme.block[0]}x{scheme.block[1]}" + ("_ue8m0" if scheme.ue8m0 else "")
        elif fmt in MX_FORMATS:
            scale_scheme = "e8m0"
        elif fmt == "int4":
            scale_scheme = "bf16_group32"
        plan = HeaderPlan(
            root=root,
            layers=layers,
            fmt=fmt,
            expert_format={"float": FLOAT_DTYPES.get(float_dtype or "", ""), "fp8_block": "fp8_block"}.get(fmt, fmt),
            float_dtype=float_dtype,
            layer_fmt=layer_fmt,
            block=scheme.block,
            scale_scheme=scale_scheme,
            num_layers=num_layers,
            num_experts=E,
            top_k=top_k,
            hidden_size=H,
            intermediate_size=I,
        )
        for L in layers:
            self._check_layer(plan, L, found[L])
        self._plan_cache = plan
        return plan

    def dense_reason(self, layer: int) -> str:
        """Why config.json makes ``layer`` dense (for error messages)."""
        return "the family's MoE-layer rule excludes it"

    # ---- header validation ------------------------------------------------------------------
    def _expect(
        self, name: str, dtypes: Iterable[str], shape: tuple[int, ...], why: str, missing_why: str | None = None
    ) -> TensorInfo:
        info = self.ckpt.tensors.get(name)
        if info is None:
            raise BadInput(f"{self._where()}: tensor {name!r} is missing ({missing_why or why})")
        dtypes = tuple(dtypes)
        if info.dtype not in dtypes:
            raise BadInput(f"{self._where()}: tensor {name!r} has dtype {info.dtype}, expected {' or '.join(dtypes)}")
        if tuple(info.shape) != tuple(shape):
            raise BadInput(f"{self._where()}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)} ({why})")
        return info

    def _proj_specs(self, plan: HeaderPlan, layer: int, proj: int) -> list[tuple[str, tuple[str, ...], tuple[int, ...], str]]:
        """(param, allowed dtypes, shape, why) of one projection's source tensors in ``layer``."""
        H, I = plan.hidden_size, plan.intermediate_size
        n, k = (I, H) if proj < 2 else (H, I)
        dims = "[intermediate, hidden]" if proj < 2 else "[hidden, intermediate]"
        why = f"{dims} = [{n}, {k}] from config.json"
        fmt, float_dtype = plan.layer_fmt[layer]
        if fmt == "float":
            assert float_dtype is not None
            return [("weight", (float_dtype,), (n, k), why)]
        if fmt == "fp8_block":
            assert plan.block is not None
            bn, bk = plan.block
            sshape = (math.ceil(n / bn), math.ceil(k / bk))
            swhy = f"one scale per {bn}x{bk} tile of [{n}, {k}]"
            return [("weight", ("F8_E4M3",), (n, k), why), ("weight_scale_inv", ("F32", "BF16", "F16"), sshape, swhy)]
        if fmt == "int4":
            return int4_proj_specs(n, k, why)
        swhy = f"one E8M0 scale per 32 inputs of [{n}, {k}]"
        if fmt == "mxfp4":
            return [("weight_packed", ("U8",), (n, k // 2), why + ", two E2M1 codes per byte"), ("weight_scale", ("U8", "F8_E8M0"), (n, k // 32), swhy)]
        return [("weight", ("F8_E4M3",), (n, k), why), ("weight_scale", ("U8", "F8_E8M0"), (n, k // 32), swhy)]

    def _check_layer(self, plan: HeaderPlan, layer: int, experts: set[int]) -> None:
        E = plan.num_experts
        prefix = self.layer_prefix(plan.root, layer)
        extra = sorted(e for e in experts if e >= E)
        if extra:
            name = self.expert_name(prefix, extra[0], 0, "weight")
            raise BadInput(
                f"{self._where()}: tensor {name!r} has expert index {extra[0]}, but config.json has {E} routed experts"
            )
        missing = f"layer {layer} is a MoE layer and config.json has {E} routed experts, each with three projections"
        for e in range(E):
            for proj in range(3):
                for param, dtypes, shape, why in self._proj_specs(plan, layer, proj):
                    self._expect(self.expert_name(prefix, e, proj, param), dtypes, shape, why, missing)
        router = f"{prefix}.{self.router_module}.weight"
        self._expect(router, tuple(FLOAT_DTYPES), (E, plan.hidden_size), "router [num_experts, hidden] from config.json")
        bias = f"{prefix}.{self.router_module}.e_score_correction_bias"
        if bias in self.ckpt.tensors:
            self._expect(bias, tuple(FLOAT_DTYPES), (E,), "[num_experts] from config.json")
