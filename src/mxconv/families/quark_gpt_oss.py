"""AMD Quark gpt-oss exports with MXFP4 experts and static FP8 activations (W4A8, e.g.
amd/gpt-oss-20b-MoE-Quant-W-MXFP4-A-FP8-KV-FP8), ``quant_method: "quark"``.

Source format (vLLM 0.33 ``models/gpt_oss.py``: ``_load_weights_quark`` and the ``hf_to_vllm_mapper``
suffixes; ``quantization/quark/quark_moe.py``: ``QuarkOCP_MX_MoEMethod.create_weights``), per layer
``L`` and expert ``e`` (one tensor per expert, unlike the fused gpt-oss release):

| tensor (prefix ``model.layers.L.mlp.experts.e``) | dtype | shape |
|---|---|---|
| ``gate_up_proj.weight`` | U8 (E2M1 pairs, low nibble = even k) | ``[2I, H/2]`` |
| ``gate_up_proj.weight_scale`` | U8 (E8M0) | ``[2I, H/32]`` |
| ``gate_up_proj.bias`` | BF16 / F16 / F32 | ``[2I]`` |
| ``gate_up_proj.input_scale`` | F32 (BF16 / F16 read) | one value (``[]`` or ``[1]``) |
| ``down_proj.weight`` / ``.weight_scale`` / ``.bias`` / ``.input_scale`` | same | ``[H, I/2]`` / ``[H, I/32]`` / ``[H]`` / one |

plus the router ``model.layers.L.mlp.router.weight`` ``[E, H]`` / ``.bias`` ``[E]``. gate_up rows are
**interleaved** as in gpt-oss (vLLM slices a TP rank's rows as one run ``[2 r0, 2 r1)``). The config's
``quantization_config.global_quant_config`` (or a ``layer_quant_config`` entry) names ``weight``
``{"dtype": "fp4", "qscheme": "per_group", "group_size": 32}`` and ``input_tensors``
``{"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": false}``; vLLM then picks
``QuarkOCP_MX_MoEMethod`` with static FP8 input scales (``AITER_MXFP4_FP8`` on MI355).

The reader gives the canonical MXFP4 layer of :mod:`mxconv.families.gpt_oss` plus
``MoELayer.input_scales`` (every expert's two scalars). ``quantize`` writes the published gpt-oss
MXFP4 convention (the experts' bytes are kept; the input scales have no place there and are dropped:
that output runs with BF16 activations).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from mxconv.errors import BadInput
from mxconv.experts.stack import InputScales
from mxconv.experts.tensors import TensorSpec
from mxconv.families.base import MoELayer, MoELayerRef, MXStack
from mxconv.families.expert_scan import expert_names
from mxconv.families.gpt_oss import BLOCK_BYTES, GptOssReader
from mxconv.families.quant_config import FLOAT_DTYPES, quantization_dict
from mxconv.source.checkpoint import Checkpoint

if TYPE_CHECKING:
    import torch

_EXPERT = re.compile(r"^(?P<root>(?:.*\.)?)layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<e>\d+)\.(?:gate_up_proj|down_proj)\.")
_PROJS = (("gate_up_proj", "w13"), ("down_proj", "w2"))
_SCALE_DTYPES = ("F32", "BF16", "F16")


def quark_config(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The ``quantization_config`` of a Quark checkpoint (quant_method "quark"), else None."""
    qc = quantization_dict(ckpt)
    return qc if qc is not None and qc.get("quant_method") == "quark" else None


class QuarkGptOssReader(GptOssReader):
    """gpt-oss MXFP4 experts with static FP8 input scales, as AMD Quark exports them."""

    name = "gpt-oss-quark"
    title = "gpt-oss Quark W4A8 (MXFP4 + FP8 input scales)"
    reads_expert_ranges = True
    quantize_keeps_config = False  # quantize writes gpt-oss's published MXFP4 names and config

    @classmethod
    def detect(cls, ckpt: Checkpoint) -> bool:
        archs = set(ckpt.config.get("architectures") or [])
        gpt_oss = ckpt.cfg("model_type") == "gpt_oss" or "GptOssForCausalLM" in archs
        return gpt_oss and quark_config(ckpt) is not None

    def _scheme(self) -> None:
        """BadInput unless the experts' Quark scheme is MXFP4 weights (+ static per-tensor FP8 inputs)."""
        qc = quark_config(self.ckpt) or {}
        cfg = qc.get("global_quant_config") or {}
        for pattern, entry in (qc.get("layer_quant_config") or {}).items():
            if "experts" in pattern and isinstance(entry, dict):
                cfg = entry
        w, a = cfg.get("weight") or {}, cfg.get("input_tensors")
        where = f"{self.ckpt.root / 'config.json'}: quantization_config (quark)"
        if w.get("dtype") != "fp4" or w.get("group_size") != 32:
            raise BadInput(f"{where}: expert weights are {w.get('dtype')!r} group {w.get('group_size')!r}; "
                           f"mxconv reads Quark MXFP4 experts (dtype 'fp4', per_group, group_size 32)")  # fmt: skip
        if a is not None and (a.get("dtype") != "fp8_e4m3" or a.get("qscheme") != "per_tensor" or a.get("is_dynamic")):
            raise BadInput(f"{where}: input_tensors {a!r} are not static per-tensor FP8 (fp8_e4m3, per_tensor, "
                           f"is_dynamic false), the only activation scheme mxconv carries")  # fmt: skip

    def _plan(self) -> dict[str, Any]:
        if self._plan_cache is not None:
            return self._plan_cache
        ck = self.ckpt
        self._scheme()
        num_layers, E, top_k, H, I = self._config_sizes()
        if H % 32 or I % 32:
            raise BadInput(f"{ck.root / 'config.json'}: hidden_size {H} / intermediate_size {I} not multiples of 32")
        roots, matches = expert_names(ck.tensors, _EXPERT)
        layers = {L: {int(m["e"]) for m in ms} for L, ms in matches.items()}  # layer -> experts seen
        if len(roots) != 1:
            raise BadInput(f"{ck.root}: expected per-expert tensors 'model.layers.N.mlp.experts.E.gate_up_proj.weight' "
                           f"under one prefix, found prefixes {sorted(roots)}")  # fmt: skip
        extra = sorted((L, e) for L, es in layers.items() for e in es if L >= num_layers or e >= E)
        if extra or top_k > E:
            where = (f"tensors of layer {extra[0][0]} expert {extra[0][1]}" if extra else f"num_experts_per_tok {top_k}")
            raise BadInput(f"{ck.root}: {where} beyond config.json's num_hidden_layers={num_layers}, "
                           f"num_local_experts={E} (a checkpoint and a config that disagree)")
        plan = {"root": roots.pop(), "fmt": "mxfp4", "float_dtype": None, "num_layers": num_layers, "E": E,
                "top_k": top_k, "H": H, "I": I, "formats": {L: ("mxfp4", None) for L in range(num_layers)}}  # fmt: skip
        for L in range(num_layers):
            self._check_quark_layer(plan, L)
        self._plan_cache = plan
        return plan

    def _check_quark_layer(self, plan: dict[str, Any], layer: int) -> None:
        E, H, I = plan["E"], plan["H"], plan["I"]
        cfg = f"num_local_experts={E}, hidden_size={H}, intermediate_size={I} from config.json"
        p = self._prefix(plan, layer) + ".experts"
        for e in range(E):
            for proj, _ in _PROJS:
                n, k = (2 * I, H) if proj == "gate_up_proj" else (H, I)
                q = f"{p}.{e}.{proj}"
                self._expect(f"{q}.weight", ("U8",), (n, k // 2), cfg + "; MXFP4 pairs")
                self._expect(f"{q}.weight_scale", ("U8", "F8_E8M0"), (n, k // 32), cfg + "; E8M0 per 32")
                self._expect(f"{q}.bias", tuple(FLOAT_DTYPES), (n,), cfg)
                info = self.ckpt.tensors.get(f"{q}.input_scale")
                if info is not None and (info.dtype not in _SCALE_DTYPES or tuple(info.shape) not in ((), (1,))):
                    raise BadInput(f"{self.ckpt.root}: tensor '{q}.input_scale' is {info.dtype}{list(info.shape)}, "
                                   f"expected one F32 value (static per-tensor FP8 input scale)")  # fmt: skip
        r = self._prefix(plan, layer) + ".router"
        self._expect(f"{r}.weight", tuple(FLOAT_DTYPES), (E, H), cfg)
        self._expect(f"{r}.bias", tuple(FLOAT_DTYPES), (E,), cfg)

    def input_scale_names(self, ref: MoELayerRef) -> tuple[str, ...]:
        """Every expert's two input-scale tensors of ``ref``'s layer (w13's then w2's), present or not."""
        p = ref.module_prefix + ".experts"
        return tuple(f"{p}.{e}.{proj}.input_scale" for proj, _ in _PROJS for e in range(self._plan()["E"]))

    def _source_names(self, plan: dict[str, Any], layer: int) -> tuple[str, ...]:
        p = self._prefix(plan, layer) + ".experts"
        names = [f"{p}.{e}.{proj}.{t}" for e in range(plan["E"]) for proj, _ in _PROJS
                 for t in ("weight", "weight_scale", "bias", "input_scale")]  # fmt: skip
        return tuple(n for n in names if n in self.ckpt.tensors)

    def read_layer(self, ref: MoELayerRef, experts: tuple[int, int] | None = None) -> MoELayer:
        import torch

        E = self._plan()["E"]
        e0, e1 = experts or (0, E)
        p = ref.module_prefix + ".experts"

        def stack(proj: str, t: str) -> torch.Tensor:
            return torch.stack([self.ckpt.read(f"{p}.{e}.{proj}.{t}") for e in range(e0, e1)])

        layer = MoELayer(ref=ref, row_order="interleaved", first_expert=e0)
        for proj, w in _PROJS:
            setattr(layer, f"{w}_mx", MXStack("mxfp4", stack(proj, "weight").view(torch.uint8),
                                                stack(proj, "weight_scale").view(torch.uint8)))  # fmt: skip
            setattr(layer, f"{w}_bias", stack(proj, "bias"))
        names = self.input_scale_names(ref)
        if all(n in self.ckpt.tensors for n in names):
            values = torch.stack([self.ckpt.read(n).reshape(()).to(torch.float32) for n in names])
            bad = (~torch.isfinite(values) | (values <= 0)).nonzero()
            if len(bad):
                i = int(bad[0])
                raise BadInput(f"{self.ckpt.root}: tensor '{names[i]}' is {values[i].item()!r}: a static FP8 input "
                               "scale must be finite and positive (vLLM divides the activations by it)")
            layer.input_scales = InputScales(values[:E], values[E:], names)
        return layer

    def source_location(self, ref: MoELayerRef, which: str, index: tuple[int, ...]) -> str:
        """Canonical index -> the per-expert tensor (expert dropped from the index)."""
        proj, _, part = which.partition("_")
        e, *rest = index
        t = {"": "weight", "scale": "weight_scale", "bias": "bias"}.get(part, part)
        q = f"{ref.module_prefix}.experts.{e}.{'gate_up_proj' if proj == 'w13' else 'down_proj'}.{t}"
        if not part and len(rest) == 2:  # a packed element: its byte
            rest = [rest[0], rest[1] // 2]
        return f"{q} [{', '.join(map(str, rest))}]"

    def layer_format(self, ref: MoELayerRef) -> str:
        return "mxfp4"

    def quantized_specs(self, ref: MoELayerRef, fmt: str) -> dict[str, TensorSpec]:
        """The published gpt-oss tensors (:class:`GptOssOutput`), biases stacked from the per-expert ones."""
        if fmt not in BLOCK_BYTES:
            raise BadInput(f"{self.ckpt.root}: quantize writes the gpt-oss MXFP4/MXFP8 convention from a Quark "
                           f"source, not {fmt!r}")  # fmt: skip
        plan, p = self._plan(), ref.module_prefix + ".experts"
        specs: dict[str, TensorSpec] = {}
        for proj, n, k in (("gate_up_proj", 2 * plan["I"], plan["H"]), ("down_proj", plan["H"], plan["I"])):
            nb = BLOCK_BYTES[fmt]
            specs[f"{p}.{proj}_blocks"] = TensorSpec((plan["E"], n, k // 32, nb), "U8" if fmt == "mxfp4" else "F8_E4M3")
            specs[f"{p}.{proj}_scales"] = TensorSpec((plan["E"], n, k // 32), "U8")
            specs[f"{p}.{proj}_bias"] = TensorSpec((plan["E"], n), self.ckpt.info(f"{p}.0.{proj}.bias").dtype)
        return specs
