"""gpt-oss (``GptOssForCausalLM``, model_type ``gpt_oss``): openai/gpt-oss-20b and -120b.

Source formats (Hugging Face layout, per layer ``L``, prefix ``model.layers.L.mlp``):

| format | expert tensors | config |
|---|---|---|
| MXFP4 (published) | ``experts.gate_up_proj_blocks`` U8 ``[E, 2I, H/32, 16]`` + ``_scales`` U8 ``[E, 2I, H/32]``, ``experts.down_proj_blocks`` U8 ``[E, H, I/32, 16]`` + ``_scales`` U8 ``[E, H, I/32]`` | ``{"quant_method": "mxfp4", ...}`` |
| MXFP8 (mxconv) | ``experts.gate_up_proj_blocks`` F8_E4M3 ``[E, 2I, H/32, 32]`` + U8 ``_scales`` ``[E, 2I, H/32]``, same for ``down_proj`` | ``{"quant_method": null, "mxconv_quant_method": "mxfp8", ...}`` (older outputs: ``"quant_method": "mxfp8"``) |
| BF16 | ``experts.gate_up_proj`` ``[E, H, 2I]`` and ``experts.down_proj`` ``[E, I, H]`` (**in x out**) | none |

plus ``experts.gate_up_proj_bias`` ``[E, 2I]`` and ``experts.down_proj_bias`` ``[E, H]`` (BF16) in every
format, router ``mlp.router.weight`` ``[E, H]`` / ``.bias`` ``[E]``. Every layer is MoE.
Canonical form: MX sources keep their bytes (blocks reshaped to ``[E, N, K/2]`` or ``[E, N, K]``,
no data movement); BF16 is transposed to ``[E, 2I, H]`` / ``[E, H, I]``. Rows stay **interleaved**
(row 2j = gate j, 2j+1 = up j; the biases likewise). Routing "topk_softmax" (softmax over the top-k
logits), activation "swigluoai" with alpha = ``swiglu_alpha`` (default 1.702) and limit =
``swiglu_limit`` (default 7.0).

Quantized output (``quantize``): the published gpt-oss MXFP4 convention above (biases copied as they
are), config ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``. For MXFP8 mxconv uses
the same names with ``gate_up_proj_blocks`` / ``down_proj_blocks`` as F8_E4M3 ``[E, N, K/32, 32]``
(the E4M3 elements of each 32-block) plus the same U8 E8M0 ``_scales``, and ``"quant_method": null,
"mxconv_quant_method": "mxfp8"``. That MXFP8 variant is mxconv's own: no engine reads it yet, and the
null method makes transformers refuse it rather than load random experts (``gpt_oss_output``); mxconv
reads it back (and the ``"quant_method": "mxfp8"`` of its older outputs), e.g. as a ``repack`` source.
The scale rounding is left to mxconv.json (the published config has no such key).

Mixed output (``quantize --include/--ignore``): the layers left unconverted keep their BF16
``gate_up_proj`` / ``down_proj`` and ``{prefix}.experts`` (e.g. ``model.layers.1.mlp.experts``) is
appended to ``modules_to_not_convert``, so transformers keeps those experts unquantized. The reader
decides the format per layer from its tensors; a BF16 layer next to an MX ``quantization_config``
must be listed there (transformers' test: equal, or ``re.match``), and one layer holding both MX
blocks and BF16 weights is refused.

OpenAI's original layout (``original/``: ``block.N.mlp.mlp1_weight.blocks`` ...) carries the same
expert bytes; it is detected and refused with a pointer to the Hugging Face layout.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from mxconv.source.checkpoint import Checkpoint
from mxconv.errors import BadInput
from mxconv.families.base import FamilyReader, ModelInfo, MoELayer, MoELayerRef, MXStack
from mxconv.families.expert_scan import expert_names
from mxconv.families.gpt_oss_output import BLOCK_BYTES, MODULES_TO_NOT_CONVERT, GptOssOutput, config_format  # noqa: F401 (re-exported)
from mxconv.families.quant_config import FLOAT_DTYPES, MX_FORMATS, quantization_dict, unsupported_quantization
from mxconv.source.st_format import TensorInfo

if TYPE_CHECKING:
    import torch

_ORIGINAL = re.compile(r"^block\.\d+\.mlp\.mlp1_weight\.blocks$")
_EXPERT = re.compile(
    r"^(?P<root>(?:.*\.)?)layers\.(?P<layer>\d+)\.mlp\.experts\.(?:gate_up_proj|down_proj)(?P<suffix>_blocks|_scales|_bias)?$"
)
_BLOCK_DTYPE = {"mxfp4": "U8", "mxfp8": "F8_E4M3"}


class GptOssReader(GptOssOutput, FamilyReader):
    """gpt-oss MXFP4 / MXFP8 / BF16 checkpoints (Hugging Face layout)."""

    name = "gpt-oss"
    title = "gpt-oss (MXFP4 / BF16)"
    reads_expert_ranges = True

    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__(ckpt)
        self._plan_cache: dict[str, Any] | None = None

    @classmethod
    def detect(cls, ckpt: Checkpoint) -> bool:
        archs = set(ckpt.config.get("architectures") or [])
        if ckpt.cfg("model_type") == "gpt_oss" or "GptOssForCausalLM" in archs:
            return True
        return any(_ORIGINAL.match(n) for n in ckpt.tensors)

    # ---- plan ---------------------------------------------------------------------------------
    def _cfg_int(self, *keys: str, default: int | None = None) -> int:
        v = self.ckpt.cfg(*keys, default=default)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            what = "missing" if v is None else f"must be a positive integer, got {v!r}:"
            raise BadInput(f"{self.ckpt.root / 'config.json'}: {what} {' / '.join(repr(k) for k in keys)}")
        return v

    def _cfg_float(self, key: str, default: float) -> float:
        v = self.ckpt.cfg(key, default=default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadInput(f"{self.ckpt.root / 'config.json'}: {key!r} must be a number, got {v!r}")
        return float(v)

    def _config_sizes(self) -> tuple[int, int, int, int, int]:
        """(num_layers, experts, top_k, hidden, intermediate) as config.json gives them."""
        return (self._cfg_int("num_hidden_layers"), self._cfg_int("num_local_experts", "num_experts"),
                self._cfg_int("num_experts_per_tok", "experts_per_token"), self._cfg_int("hidden_size"),
                self._cfg_int("moe_intermediate_size", "intermediate_size"))

    def _expect(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...], why: str) -> TensorInfo:
        info = self.ckpt.tensors.get(name)
        if info is None:
            raise BadInput(f"{self.ckpt.root}: tensor {name!r} is missing ({why})")
        if info.dtype not in dtypes:
            raise BadInput(f"{self.ckpt.root}: tensor {name!r} has dtype {info.dtype}, expected {' or '.join(dtypes)}")
        if tuple(info.shape) != shape:
            raise BadInput(f"{self.ckpt.root}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)} ({why})")
        return info

    def _plan(self) -> dict[str, Any]:
        if self._plan_cache is not None:
            return self._plan_cache
        ck = self.ckpt
        if any(_ORIGINAL.match(n) for n in ck.tensors):
            raise BadInput(
                f"{ck.root}: this is OpenAI's original gpt-oss layout (block.N.mlp.mlp1_weight.*), which mxconv does "
                f"not read; use the Hugging Face layout at the repository root (same expert bytes)"
            )
        qc = quantization_dict(ck)
        method = None if qc is None else config_format(qc)
        if qc is not None and method not in MX_FORMATS:
            raise unsupported_quantization(ck, qc, self.title)
        num_layers, E, top_k, H, I = self._config_sizes()
        if top_k > E:
            raise BadInput(f"{ck.root / 'config.json'}: num_experts_per_tok={top_k} with {E} experts")
        roots, matches = expert_names(ck.tensors, _EXPERT)
        found = {L: {m["suffix"] or "" for m in ms} for L, ms in matches.items()}  # layer -> suffixes seen
        if not roots:
            raise BadInput(
                f"{ck.root}: no gpt-oss expert tensors found (expected 'model.layers.N.mlp.experts.gate_up_proj_blocks' "
                f"or 'model.layers.N.mlp.experts.gate_up_proj')"
            )
        if len(roots) > 1:
            raise BadInput(f"{ck.root}: expert tensors under several prefixes {sorted(roots)}")
        root = roots.pop()
        for L in range(num_layers):
            if L not in found:
                raise BadInput(
                    f"{ck.root}: tensor '{root}layers.{L}.mlp.experts.gate_up_proj{'_blocks' if method else ''}' is "
                    f"missing (every one of the num_hidden_layers={num_layers} gpt-oss layers is MoE)"
                )
        for L in found:
            if L >= num_layers:
                raise BadInput(
                    f"{ck.root}: layer {L} has expert tensors, but config.json has num_hidden_layers={num_layers}"
                )
        # The format is decided per layer: a partial quantize (--include/--ignore) leaves some layers BF16
        # next to MX ones, and lists those in modules_to_not_convert.
        not_convert = (qc or {}).get("modules_to_not_convert") or []
        if not isinstance(not_convert, list) or not all(isinstance(m, str) for m in not_convert):
            raise BadInput(f"{ck.root / 'config.json'}: quantization_config 'modules_to_not_convert' must be a list of names")
        formats: dict[int, tuple[str, str | None]] = {}
        for L in range(num_layers):
            formats[L] = self._layer_format(root, L, found[L], method, not_convert)
        mx = [f for f, _ in formats.values() if f in MX_FORMATS]
        fmt, float_dtype = (mx[0], None) if mx else formats[0]
        if mx and (H % 32 or I % 32):
            raise BadInput(f"{ck.root / 'config.json'}: hidden_size {H} / intermediate_size {I} not multiples of 32")
        plan = {
            "root": root,
            "fmt": fmt,  # model-wide: the MX format of the converted layers of a mixed checkpoint
            "float_dtype": float_dtype,
            "formats": formats,  # per layer: (fmt, safetensors dtype of a BF16/F16/F32 layer)
            "num_layers": num_layers,
            "E": E,
            "top_k": top_k,
            "H": H,
            "I": I,
        }
        for L in range(num_layers):
            self._check_layer(plan, L)
        self._plan_cache = plan
        return plan

    def _layer_format(
        self, root: str, layer: int, suffixes: set[str], method: str | None, not_convert: list[str]
    ) -> tuple[str, str | None]:
        """(format, float dtype) of one layer from its tensors, checked against quantization_config."""
        ck = self.ckpt
        p = f"{root}layers.{layer}.mlp.experts"
        has_mx = bool(suffixes & {"_blocks", "_scales"})
        if has_mx and "" in suffixes:
            raise BadInput(
                f"{ck.root}: layer {layer} holds both MX blocks and float expert weights "
                f"({p}.*_blocks and {p}.gate_up_proj/down_proj); one format per layer"
            )
        if has_mx:
            blocks = [f"{p}.{proj}_blocks" for proj in ("gate_up_proj", "down_proj") if f"{p}.{proj}_blocks" in ck.tensors]
            sample = blocks[0] if blocks else f"{p}.gate_up_proj_blocks"
            if blocks:
                fmt = "mxfp8" if ck.tensors[sample].dtype == "F8_E4M3" else "mxfp4"
            else:  # scales only: _check_layer names the missing blocks
                fmt = method or "mxfp4"
            if method is None:
                raise BadInput(
                    f"{ck.root}: tensor {sample!r} holds MX blocks, but config.json has no quantization_config "
                    f"(expected quant_method 'mxfp4')"
                )
            if fmt != method:
                raise BadInput(
                    f"{ck.root}: config.json says quant_method {method!r}, but tensor {sample!r} is "
                    f"{ck.tensors[sample].dtype if sample in ck.tensors else 'missing'} ({fmt})"
                )
            return fmt, None
        sample = f"{p}.gate_up_proj" if f"{p}.gate_up_proj" in ck.tensors else f"{p}.down_proj"
        info = ck.tensors.get(sample)
        if info is None:  # only biases: _check_layer names the missing weight
            return (method, None) if method else ("bf16", "BF16")
        if method is not None and not _listed(p, not_convert):
            raise BadInput(
                f"{ck.root}: config.json says quant_method {method!r}, but tensor {sample!r} is {info.dtype} "
                f"(unquantized) and {p!r} is not in quantization_config's modules_to_not_convert"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise BadInput(f"{ck.root}: tensor {sample!r} has dtype {info.dtype}, expected BF16, F16 or F32")
        return "bf16", info.dtype

    def _prefix(self, plan: dict[str, Any], layer: int) -> str:
        return f"{plan['root']}layers.{layer}.mlp"

    def _check_layer(self, plan: dict[str, Any], layer: int) -> None:
        E, H, I = plan["E"], plan["H"], plan["I"]
        fmt, float_dtype = plan["formats"][layer]
        p = self._prefix(plan, layer) + ".experts"
        cfg = f"num_local_experts={E}, hidden_size={H}, intermediate_size={I} from config.json"
        for proj, n, k in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            if fmt in MX_FORMATS:
                blocks, scales = f"{p}.{proj}_blocks", f"{p}.{proj}_scales"
                nb = BLOCK_BYTES[fmt]
                info = self._expect_present(blocks, cfg)
                if info.dtype != _BLOCK_DTYPE[fmt]:
                    raise BadInput(
                        f"{self.ckpt.root}: tensor {blocks!r} has dtype {info.dtype}, expected {_BLOCK_DTYPE[fmt]} ({fmt} blocks)"
                    )
                if len(info.shape) != 4 or info.shape[-1] != nb:
                    raise BadInput(
                        f"{self.ckpt.root}: tensor {blocks!r} has shape {list(info.shape)}, expected last dim {nb} "
                        f"({fmt}: {nb} bytes per block of 32), i.e. {[E, n, k // 32, nb]}"
                    )
                self._expect(blocks, (_BLOCK_DTYPE[fmt],), (E, n, k // 32, nb), cfg)
                sinfo = self._expect_present(scales, cfg)
                if tuple(sinfo.shape) != tuple(info.shape[:-1]):
                    raise BadInput(
                        f"{self.ckpt.root}: tensor {scales!r} has shape {list(sinfo.shape)}, expected "
                        f"{list(info.shape[:-1])} (the shape of {blocks!r} without its last dim)"
                    )
                self._expect(scales, ("U8", "F8_E8M0"), (E, n, k // 32), cfg)
            else:
                shape = (E, k, n)  # stored in x out
                self._expect(f"{p}.{proj}", (float_dtype,), shape, cfg + ", stored [in, out]")
            self._expect(f"{p}.{proj}_bias", tuple(FLOAT_DTYPES), (E, n), cfg)
        r = self._prefix(plan, layer) + ".router"
        self._expect(f"{r}.weight", tuple(FLOAT_DTYPES), (E, H), cfg)
        self._expect(f"{r}.bias", tuple(FLOAT_DTYPES), (E,), cfg)

    def _expect_present(self, name: str, why: str) -> TensorInfo:
        info = self.ckpt.tensors.get(name)
        if info is None:
            raise BadInput(f"{self.ckpt.root}: tensor {name!r} is missing ({why})")
        return info

    # ---- FamilyReader -------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        p = self._plan()
        fmt = p["fmt"]
        return ModelInfo(
            family=self.name,
            moe_layers=tuple(range(p["num_layers"])),
            expert_format=fmt if fmt in MX_FORMATS else FLOAT_DTYPES[p["float_dtype"]],
            source_scale_scheme="e8m0" if fmt in MX_FORMATS else None,
            **self.config_claims(),
        )

    def config_claims(self) -> dict[str, Any]:
        num_layers, E, top_k, H, I = self._config_sizes()
        return {
            "num_layers": num_layers, "num_experts": E, "top_k": top_k, "hidden_size": H, "intermediate_size": I,
            "row_order": "interleaved", "has_expert_bias": True, "routing": "topk_softmax", "norm_topk_prob": True,
            "activation": "swigluoai", "swiglu_alpha": self._cfg_float("swiglu_alpha", 1.702),
            "swiglu_limit": self._cfg_float("swiglu_limit", 7.0),
        }

    def _source_names(self, plan: dict[str, Any], layer: int) -> tuple[str, ...]:
        p = self._prefix(plan, layer) + ".experts"
        out = []
        for proj in ("gate_up_proj", "down_proj"):
            if plan["formats"][layer][0] in MX_FORMATS:
                out += [f"{p}.{proj}_blocks", f"{p}.{proj}_scales"]
            else:
                out.append(f"{p}.{proj}")
            out.append(f"{p}.{proj}_bias")
        return tuple(out)

    def layer_refs(self) -> list[MoELayerRef]:
        plan = self._plan()
        refs = []
        for L in range(plan["num_layers"]):
            prefix = self._prefix(plan, L)
            refs.append(
                MoELayerRef(
                    layer=L,
                    module_prefix=prefix,
                    source_names=self._source_names(plan, L),
                    router_weight=f"{prefix}.router.weight",
                    router_bias=f"{prefix}.router.bias",
                )
            )
        return refs

    def read_layer(self, ref: MoELayerRef, experts: tuple[int, int] | None = None) -> MoELayer:
        import torch

        plan = self._plan()
        H, I = plan["H"], plan["I"]
        E = plan["E"] if experts is None else experts[1] - experts[0]
        fmt = plan["formats"][ref.layer][0]
        p = ref.module_prefix + ".experts"

        def read(name: str) -> torch.Tensor:  # the fused [E, ...] tensors: experts' rows only
            return self.ckpt.read(name, experts)

        layer = MoELayer(
            ref=ref,
            row_order="interleaved",
            w13_bias=read(f"{p}.gate_up_proj_bias"),
            w2_bias=read(f"{p}.down_proj_bias"),
            first_expert=experts[0] if experts else 0,
        )
        if fmt in MX_FORMATS:
            for key, proj, n, k in (("w13_mx", "gate_up_proj", 2 * I, H), ("w2_mx", "down_proj", H, I)):
                data = read(f"{p}.{proj}_blocks").view(torch.uint8)
                data = data.reshape(E, n, k // 2 if fmt == "mxfp4" else k)
                scales = read(f"{p}.{proj}_scales").view(torch.uint8)
                setattr(layer, key, MXStack(fmt, data, scales))
        else:
            # Transposed *views* ([E, 2I, H] / [E, H, I] with K not contiguous): the consumer makes
            # them contiguous where it computes (on the GPU, that is nearly free; on the CPU the
            # quantizer walks them in row chunks), instead of a full CPU copy in the reader.
            layer.w13 = read(f"{p}.gate_up_proj").transpose(1, 2)
            layer.w2 = read(f"{p}.down_proj").transpose(1, 2)
        return layer

    def source_location(self, ref: MoELayerRef, which: str, index: tuple[int, ...]) -> str:
        """Canonical index -> the fused source tensor: BF16 weights are stored transposed, MX blocks
        as ``[E, N, K/32, bytes per block]``; scales and biases keep the canonical index."""
        proj, _, part = which.partition("_")
        name = f"{ref.module_prefix}.experts.{'gate_up_proj' if proj == 'w13' else 'down_proj'}"
        if part:  # "scale" | "bias"
            return f"{name}_{'scales' if part == 'scale' else 'bias'} [{', '.join(map(str, index))}]"
        e, row, col = index
        fmt = self._plan()["formats"][ref.layer][0]
        if fmt in MX_FORMATS:
            per_byte = 2 if fmt == "mxfp4" else 1
            return f"{name}_blocks [{e}, {row}, {col // 32}, {col % 32 // per_byte}]"
        return f"{name} [{e}, {col}, {row}]"

    def layer_format(self, ref: MoELayerRef) -> str:
        plan = self._plan()
        if ref.layer not in plan["formats"]:
            raise ValueError(f"{ref.module_prefix}: not a MoE layer of this checkpoint")
        fmt, float_dtype = plan["formats"][ref.layer]
        return fmt if fmt in MX_FORMATS else FLOAT_DTYPES[float_dtype]


def _listed(module: str, patterns: list[str]) -> bool:
    """transformers' modules_to_not_convert test: a pattern equal to, or matching (re.match) the module."""
    for p in patterns:
        if p == module:
            return True
        try:
            if re.match(p, module):
                return True
        except re.error:
            continue
    return False
