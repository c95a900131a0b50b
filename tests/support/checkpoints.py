"""Tiny real-format MoE checkpoints of every supported kind, and what each must read back as.

:func:`make_checkpoint` covers :data:`KINDS`: the float / MXFP4 kinds of :mod:`mxconv.examples`
("gpt-oss-mxfp4", "gpt-oss-bf16", "qwen3-moe", "qwen2-moe", "mixtral", also what ``mxconv demo``
uses) plus "deepseek-v3-fp8", "deepseek-v3.1-fp8-ue8m0", "kimi-k2", "glm4-moe", written here with
the same builder and writers. It returns a :class:`GroundTruth` with the canonical expert tensors
each MoE layer must read back as (float for bf16/fp16/fp32, fp32 dequantization for block-FP8, the
stored bytes for MXFP4). Block-FP8 tiles are scaled to amax/448 (or the next power of two for
ue8m0). DeepSeek/GLM kinds make layer 0 dense (``first_k_dense_replace = 1``).

:data:`INT4_KINDS` (not in :data:`KINDS`: they go through ``repack --backend trtllm`` only):
"kimi-k2-int4", a Kimi-K2-Thinking-style DeepSeek-V3 checkpoint whose routed experts are
compressed-tensors INT4 ``pack-quantized`` (``weight_packed`` I32 [N, K/8], ``weight_scale`` BF16
[N, K/32], ``weight_shape`` I64 [2]; symmetric, group 32, scale = amax/7 in bf16) and everything else
bf16. Default sizes H = I = 256 (MxInt4 needs multiples of 256).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mxconv import examples
from mxconv.examples.models import gpt_oss_config
from mxconv.examples import Builder, GroundTruth, KindSpec, LayerTruth, ModelSizes, mlp, per_expert_layer, write_shards

__all__ = ["KINDS", "INT4_KINDS", "W4A8_KINDS", "GroundTruth", "ModelSizes", "make_checkpoint", "pack_int4_words_reference", "write_shards"]

KINDS = examples.KINDS + ("deepseek-v3-fp8", "deepseek-v3.1-fp8-ue8m0", "kimi-k2", "glm4-moe")
INT4_KINDS = ("kimi-k2-int4",)
# AMD Quark gpt-oss W4A8 (per-expert MXFP4 weights + static FP8 input scales; see _quark_w4a8)
W4A8_KINDS = ("gpt-oss-quark-w4a8",)
FP8_MAX = 448.0
INT4_GROUP = 32


class FP8Builder(Builder):
    """Writes the dense Linears and routed experts as block-FP8 (``weight`` fp8 + ``weight_scale_inv``)."""

    def __init__(self, seed: int, ue8m0: bool) -> None:
        super().__init__(seed)
        self.ue8m0 = ue8m0

    def fp8_weight(self, shape: tuple[int, int], std: float, ue8m0: bool, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A block-FP8 weight: (fp8 [N, K], scale_inv fp32 [ceil(N/b), ceil(K/b)], fp32 dequantization)."""
        n, k = shape
        w = self.randn(shape, std)
        tn, tk = -(-n // block), -(-k // block)
        pad = torch.zeros(tn * block, tk * block)
        pad[:n, :k] = w.abs()
        amax = pad.reshape(tn, block, tk, block).amax(dim=(1, 3))
        scale = amax / FP8_MAX
        if ue8m0:
            mant, exp = torch.frexp(scale)
            exp = torch.where(mant == 0.5, exp - 1, exp)  # exact ceil(log2(scale))
            scale = torch.ldexp(torch.ones_like(scale), exp)
        full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q, scale.to(torch.float32), q.to(torch.float32) * full

    def fp8_linear(self, name: str, out: int, inp: int) -> torch.Tensor:
        q, s, deq = self.fp8_weight((out, inp), inp**-0.5, self.ue8m0)
        self.add(f"{name}.weight", q)
        self.add(f"{name}.weight_scale_inv", s)
        return deq

    def dense_linear(self, name: str, out: int, inp: int, dtype: torch.dtype, bias: bool = False) -> None:
        self.fp8_linear(name, out, inp)

    def expert_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def expert_linear(
        self, t: LayerTruth, which: str, e: int, rows: slice, name: str, out: int, inp: int, dtype: torch.dtype
    ) -> torch.Tensor:
        t.expert_names += [f"{name}.weight", f"{name}.weight_scale_inv"]
        return self.fp8_linear(name, out, inp)


class Int4Builder(Builder):
    """Writes the routed experts as compressed-tensors INT4 (everything else as the base builder)."""

    def int4_linear(self, name: str, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A compressed-tensors INT4 pack-quantized Linear (symmetric, group 32): adds ``weight_packed``
        int32 [out, inp/8], ``weight_scale`` bf16 [out, inp/32], ``weight_shape`` int64 [2]; returns
        (the words' little-endian bytes uint8 [out, inp/2], scales, fp32 dequantization q * scale)."""
        w = self.randn((out, inp), inp**-0.5).view(out, inp // INT4_GROUP, INT4_GROUP)
        scale = (w.abs().amax(dim=-1) / 7.0).clamp(min=2.0**-60).to(torch.bfloat16)
        q = torch.round(w / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int64).view(out, inp)
        words = pack_int4_words_reference(q)
        self.add(f"{name}.weight_packed", words)
        self.add(f"{name}.weight_scale", scale)
        self.add(f"{name}.weight_shape", torch.tensor([out, inp], dtype=torch.int64))
        deq = (q.view(out, inp // INT4_GROUP, INT4_GROUP).float() * scale.float().unsqueeze(-1)).view(out, inp)
        return words.view(torch.uint8), scale, deq

    def expert_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def begin_experts(self, t: LayerTruth, E: int, H: int, I: int) -> None:
        t.w13_int4 = (torch.empty((E, 2 * I, H // 2), dtype=torch.uint8), torch.empty((E, 2 * I, H // INT4_GROUP), dtype=torch.bfloat16))
        t.w2_int4 = (torch.empty((E, H, I // 2), dtype=torch.uint8), torch.empty((E, H, I // INT4_GROUP), dtype=torch.bfloat16))

    def expert_linear(
        self, t: LayerTruth, which: str, e: int, rows: slice, name: str, out: int, inp: int, dtype: torch.dtype
    ) -> torch.Tensor:
        data, scale, w = self.int4_linear(name, out, inp)
        t.expert_names += [f"{name}.weight_packed", f"{name}.weight_scale", f"{name}.weight_shape"]
        stack = getattr(t, f"{which}_int4")
        stack[0][e, rows], stack[1][e, rows] = data, scale
        return w



def pack_int4_words_reference(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` int4 words by integer arithmetic (independent of
    mxconv.mx.int4's byte views): values q [N, K] in [-8, 7] -> int32 [N, K/8], value j stored as
    q + 8 in bits 4*(j%8) of word j//8 (two's-complement wrap of the unsigned 32-bit word)."""
    n, k = q.shape
    nib = (q.to(torch.int64) + 8).view(n, k // 8, 8)
    word = (nib << (4 * torch.arange(8, dtype=torch.int64))).sum(dim=-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


INT4_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                "dynamic": False, "actorder": None, "observer": "minmax", "block_structure": None,
            },
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    },
    "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}


def _deepseek_glm(b: Builder, kind: str, sizes: ModelSizes, nextn: int) -> tuple[dict[str, Any], dict[int, LayerTruth]]:
    L, E, H, I, top_k, V = sizes.dims()
    glm = kind == "glm4-moe"
    int4 = kind in INT4_KINDS
    kimi = kind in ("kimi-k2", "kimi-k2-int4")
    ue8m0 = kind == "deepseek-v3.1-fp8-ue8m0"
    bf = torch.bfloat16
    dense_i = 2 * I
    n_group, topk_group = (2, 1) if E % 2 == 0 and not glm and not kimi else (1, 1)
    moe = {
        "hidden_size": H,
        "intermediate_size": dense_i,
        "moe_intermediate_size": I,
        "n_routed_experts": E,
        "n_shared_experts": 1,
        "num_experts_per_tok": top_k,
        "first_k_dense_replace": 1,
    }
    if glm:
        heads, kv_heads, head_dim = 4, 2, 32
        config: dict[str, Any] = {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            **moe,
            "num_hidden_layers": L,
            "num_nextn_predict_layers": nextn,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": False,
            "vocab_size": V,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "eos_token_id": [1, 2],
            "pad_token_id": 3,
            "transformers_version": "4.54.0",
        }
    else:
        heads, q_lora, kv_lora, nope, rope, v_dim = 2, 64, 32, 16, 8, 16
        config = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "kimi_k2" if kimi else "deepseek_v3",
            **moe,
            "moe_layer_freq": 1,
            "num_hidden_layers": L,
            "num_nextn_predict_layers": nextn,
            "n_group": n_group,
            "topk_group": topk_group,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "routed_scaling_factor": 2.827 if kimi else 2.5,
            "norm_topk_prob": True,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "q_lora_rank": q_lora,
            "kv_lora_rank": kv_lora,
            "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope,
            "v_head_dim": v_dim,
            "vocab_size": V,
            "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
            },
            "hidden_act": "silu",
            "aux_loss_alpha": 0.001,
            "ep_size": 1,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": 0,
            "eos_token_id": 1,
            "transformers_version": "4.33.1",
            "quantization_config": {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
            },
        }
        if ue8m0:
            config["quantization_config"]["scale_fmt"] = "ue8m0"
        if int4:
            config["quantization_config"] = json.loads(json.dumps(INT4_QUANTIZATION_CONFIG))

    def lin(name: str, out: int, inp: int, bias: bool = False) -> None:
        b.dense_linear(name, out, inp, bf, bias=bias)  # block-FP8 in the FP8 kinds (FP8Builder)

    truths: dict[int, LayerTruth] = {}
    b.add("model.embed_tokens.weight", b.randn((V, H), 1.0, bf))
    for li in range(L + nextn):
        p = f"model.layers.{li}"
        if li >= L:  # multi-token-prediction layer
            b.add(f"{p}.embed_tokens.weight", b.randn((V, H), 1.0, bf))
            b.norm(f"{p}.enorm", H, bf)
            b.norm(f"{p}.hnorm", H, bf)
            b.linear(f"{p}.eh_proj", H, 2 * H, bf)
            b.norm(f"{p}.shared_head.norm", H, bf)
            b.add(f"{p}.shared_head.head.weight", b.randn((V, H), H**-0.5, bf))
        b.norm(f"{p}.input_layernorm", H, bf)
        if glm:
            for proj, n in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)):
                lin(f"{p}.self_attn.{proj}", n, H, bias=True)
            lin(f"{p}.self_attn.o_proj", H, heads * head_dim)
        else:
            lin(f"{p}.self_attn.q_a_proj", q_lora, H)
            b.norm(f"{p}.self_attn.q_a_layernorm", q_lora, bf)
            lin(f"{p}.self_attn.q_b_proj", heads * (nope + rope), q_lora)
            lin(f"{p}.self_attn.kv_a_proj_with_mqa", kv_lora + rope, H)
            b.norm(f"{p}.self_attn.kv_a_layernorm", kv_lora, bf)
            lin(f"{p}.self_attn.kv_b_proj", heads * (nope + v_dim), kv_lora)
            lin(f"{p}.self_attn.o_proj", H, heads * v_dim)
        b.norm(f"{p}.post_attention_layernorm", H, bf)
        if li < 1:  # first_k_dense_replace = 1
            mlp(b, f"{p}.mlp", H, dense_i, bf)
            continue
        b.linear(f"{p}.mlp.gate", E, H, bf)
        b.add(f"{p}.mlp.gate.e_score_correction_bias", b.randn((E,), 0.1, torch.float32))
        t = per_expert_layer(b, f"{p}.mlp", E, H, I, ("gate_proj", "up_proj", "down_proj"), bf)
        t.layer = li
        t.router_weight = f"{p}.mlp.gate.weight"
        t.correction_bias = f"{p}.mlp.gate.e_score_correction_bias"
        truths[li] = t
        mlp(b, f"{p}.mlp.shared_experts", H, I, bf)
    b.norm("model.norm", H, bf)
    b.add("lm_head.weight", b.randn((V, H), H**-0.5, bf))
    return config, truths



def _generate(
    b: Builder, kind: str, sizes: ModelSizes, num_nextn_predict_layers: int | None = None,
) -> tuple[dict[str, Any], dict[int, LayerTruth]]:
    nextn = num_nextn_predict_layers if num_nextn_predict_layers is not None else (0 if kind in ("kimi-k2", "kimi-k2-int4") else 1)
    return _deepseek_glm(b, kind, sizes, nextn)


QUARK_W4A8_CONFIG = {
    "quant_method": "quark",
    "export": {"kv_cache_group": [], "pack_method": "reorder", "weight_format": "real_quantized"},
    "global_quant_config": {
        "weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "is_dynamic": False,
                   "scale_format": "e8m0", "scale_calculation_mode": "even", "round_method": "half_even"},
        "input_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True,
                          "round_method": "half_even"},
        "output_tensors": None, "bias": None,
    },
    "layer_quant_config": {},
    "exclude": ["lm_head", "*self_attn*", "*router*", "model.embed_tokens"],
}


def _quark_w4a8(b: Builder, kind: str, sizes: ModelSizes, input_scales: bool = True,
                equal_scales: bool = False) -> tuple[dict[str, Any], dict[int, LayerTruth]]:  # fmt: skip
    """gpt-oss as AMD Quark exports it W4A8: per expert ``experts.{e}.gate_up_proj.weight`` U8 [2I, H/2]
    (interleaved rows), ``.weight_scale`` U8 [2I, H/32], ``.bias`` BF16 [2I], ``.input_scale`` F32 []
    (likewise ``down_proj``), everything else bf16. ``input_scales=False`` leaves the input scales out;
    ``equal_scales`` gives every expert of a layer the same ones (else they differ)."""
    bf = torch.bfloat16
    L, E, H, I, _, V = sizes.dims()
    config = gpt_oss_config(sizes, mx=False)
    config["quantization_config"] = json.loads(json.dumps(QUARK_W4A8_CONFIG))
    b.add("model.embed_tokens.weight", b.randn((V, H), 1.0, bf))
    truths: dict[int, LayerTruth] = {}
    for li in range(L):
        p = f"model.layers.{li}"
        b.linear(f"{p}.mlp.router", E, H, bf, bias=True)
        t = LayerTruth(li, f"{p}.mlp", "interleaved", [], f"{p}.mlp.router.weight", f"{p}.mlp.router.bias")
        scales = []
        for key, proj, n, k in (("w13", "gate_up_proj", 2 * I, H), ("w2", "down_proj", H, I)):
            data = torch.randint(0, 256, (E, n, k // 2), generator=b.g, dtype=torch.uint8)
            sc = torch.randint(115, 126, (E, n, k // 32), generator=b.g, dtype=torch.uint8)
            bias = b.randn((E, n), 0.02, bf)
            amax = torch.rand((1,) if equal_scales else (E,), generator=b.g) * 4 + 1
            s = (amax / 448.0).expand(E).clone()
            for e in range(E):
                q = f"{p}.mlp.experts.{e}.{proj}"
                for name, v in (("weight", data[e]), ("weight_scale", sc[e]), ("bias", bias[e])):
                    b.add(f"{q}.{name}", v.clone())
                    t.expert_names.append(f"{q}.{name}")
                if input_scales:
                    b.add(f"{q}.input_scale", s[e].clone())
                    t.expert_names.append(f"{q}.input_scale")
            setattr(t, f"{key}_mx", (data, sc))
            setattr(t, f"{key}_bias", bias)
            scales.append(s)
        t.input_scales = (scales[0], scales[1]) if input_scales else None
        truths[li] = t
    b.norm("model.norm", H, bf)
    b.add("lm_head.weight", b.randn((V, H), H**-0.5, bf))
    return config, truths


# DeepSeek-style FP8 kinds use sizes with several (partial) 128x128 tiles; MxInt4 needs multiples of 256.
_SPECS = {
    "deepseek-v3-fp8": KindSpec("deepseek-v3", (288, 160), _generate, lambda seed: FP8Builder(seed, ue8m0=False)),
    "deepseek-v3.1-fp8-ue8m0": KindSpec("deepseek-v3", (288, 160), _generate, lambda seed: FP8Builder(seed, ue8m0=True)),
    "kimi-k2": KindSpec("deepseek-v3", (288, 160), _generate, lambda seed: FP8Builder(seed, ue8m0=False)),
    "glm4-moe": KindSpec("glm4-moe", (160, 96), _generate),
    "kimi-k2-int4": KindSpec("deepseek-v3", (256, 256), _generate, Int4Builder),
    "gpt-oss-quark-w4a8": KindSpec("gpt-oss-quark", (96, 64), _quark_w4a8),
}


def make_checkpoint(path: str | Path, kind: str, sizes: ModelSizes = ModelSizes(), **options: Any) -> GroundTruth:
    """Write a tiny checkpoint of ``kind`` (see :data:`KINDS`, :data:`INT4_KINDS`) into ``path`` and
    return its truth; ``options`` as :func:`mxconv.examples.make_checkpoint`'s.

    ``dtype`` applies to the per-expert bf16 kinds (qwen*, mixtral: bf16/fp16/fp32).
    ``input_scales`` / ``equal_scales`` (gpt-oss-quark-w4a8): write the FP8 input scales / make them
    equal across a layer's experts. ``num_nextn_predict_layers`` (DeepSeek/GLM; default 1, Kimi-K2 0) adds MTP layers after the
    ``num_layers`` decoder layers. ``mlp_only_layers`` (Qwen) makes those layers dense.
    """
    if kind not in KINDS + INT4_KINDS + W4A8_KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS + INT4_KINDS + W4A8_KINDS}")
    return examples.make_checkpoint(path, kind, sizes, spec=_SPECS.get(kind), **options)
