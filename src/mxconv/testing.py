"""Tiny real-format MoE checkpoints for tests and ``mxconv demo``.

:func:`make_checkpoint` writes a small checkpoint with the exact tensor names, dtypes, orientations
and config.json keys of the real model family (see ../shared/docs/checkpoint-formats.md), sharded
with a ``model.safetensors.index.json`` like the Hub releases, plus dummy tokenizer and generation
files. It returns a :class:`GroundTruth` with the canonical expert tensors each MoE layer must read
back as (float for bf16/fp16/fp32, fp32 dequantization for block-FP8, the stored bytes for MXFP4).

Kinds: "gpt-oss-mxfp4", "gpt-oss-bf16", "qwen3-moe", "qwen2-moe", "mixtral", "deepseek-v3-fp8",
"deepseek-v3.1-fp8-ue8m0", "kimi-k2", "glm4-moe". Default sizes are multiples of 32 but not of
128 (backends must pad them). Values are realistic: Gaussian weights with std 1/sqrt(fan_in),
MXFP4 bytes random with scale bytes in 115..125, block-FP8 tiles scaled to amax/448 (or the next
power of two for ue8m0).

:data:`INT4_KINDS` (not in :data:`KINDS`: they go through ``repack --backend trtllm`` only):
"kimi-k2-int4", a Kimi-K2-Thinking-style DeepSeek-V3 checkpoint whose routed experts are
compressed-tensors INT4 ``pack-quantized`` (``weight_packed`` I32 [N, K/8], ``weight_scale`` BF16
[N, K/32], ``weight_shape`` I64 [2]; symmetric, group 32, scale = amax/7 in bf16) and everything else
bf16. Default sizes H = I = 256 (MxInt4 needs multiples of 256).

:func:`make_hub_cache` lays a generated checkpoint out as a Hugging Face hub cache entry so repo-id
sources can be tested offline (``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` pointing at it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

KINDS = (
    "gpt-oss-mxfp4",
    "gpt-oss-bf16",
    "qwen3-moe",
    "qwen2-moe",
    "mixtral",
    "deepseek-v3-fp8",
    "deepseek-v3.1-fp8-ue8m0",
    "kimi-k2",
    "glm4-moe",
)
INT4_KINDS = ("kimi-k2-int4",)
FAMILY_OF_KIND = {
    "gpt-oss-mxfp4": "gpt-oss",
    "gpt-oss-bf16": "gpt-oss",
    "qwen3-moe": "qwen-moe",
    "qwen2-moe": "qwen-moe",
    "mixtral": "mixtral",
    "deepseek-v3-fp8": "deepseek-v3",
    "deepseek-v3.1-fp8-ue8m0": "deepseek-v3",
    "kimi-k2": "deepseek-v3",
    "glm4-moe": "glm4-moe",
    "kimi-k2-int4": "deepseek-v3",
}
# (hidden, intermediate) defaults: multiples of 32, not of 128. DeepSeek-style FP8 kinds use sizes
# with several (partial) 128x128 tiles.
_DEFAULT_SIZES = {
    "gpt-oss": (96, 64),
    "qwen-moe": (160, 96),
    "mixtral": (160, 96),
    "deepseek-v3": (288, 160),
    "glm4-moe": (160, 96),
}
_KIND_SIZES = {"kimi-k2-int4": (256, 256)}  # MxInt4: multiples of 256
FP8_MAX = 448.0
INT4_GROUP = 32


@dataclass
class LayerTruth:
    """What one MoE layer must read back as (canonical, see mxconv.families.base)."""

    layer: int
    module_prefix: str
    row_order: str  # "interleaved" | "halves"
    expert_names: list[str]  # every source tensor the reader consumes for this layer
    router_weight: str
    router_bias: str | None = None
    correction_bias: str | None = None
    w13: torch.Tensor | None = None  # [E, 2I, H] float (source dtype; fp32 for block-FP8)
    w2: torch.Tensor | None = None  # [E, H, I]
    w13_mx: tuple[torch.Tensor, torch.Tensor] | None = None  # (data uint8 [E, 2I, H/2], scales uint8 [E, 2I, H/32])
    w2_mx: tuple[torch.Tensor, torch.Tensor] | None = None  # (data uint8 [E, H, I/2], scales uint8 [E, H, I/32])
    # INT4 kinds: (offset-binary bytes uint8 [E, 2I, H/2] = the int32 words' bytes, scales bf16 [E, 2I, H/32]);
    # w13 / w2 then hold the exact fp32 dequantization q * scale
    w13_int4: tuple[torch.Tensor, torch.Tensor] | None = None
    w2_int4: tuple[torch.Tensor, torch.Tensor] | None = None
    w13_bias: torch.Tensor | None = None  # [E, 2I] (gpt-oss)
    w2_bias: torch.Tensor | None = None  # [E, H]
    gate: torch.Tensor | None = None  # [E, I, H] float: the gate projection alone (float kinds)
    up: torch.Tensor | None = None  # [E, I, H]


@dataclass
class GroundTruth:
    """A generated checkpoint and what mxconv must find in it."""

    kind: str
    family: str
    path: Path
    config: dict[str, Any]
    tensor_names: list[str]
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    layers: dict[int, LayerTruth] = field(default_factory=dict)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.layers))


# ---------------------------------------------------------------------------------------------
# tensor builders
# ---------------------------------------------------------------------------------------------


class _Builder:
    """Accumulates named tensors (insertion order = file order) from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.t: dict[str, torch.Tensor] = {}

    def randn(self, shape: tuple[int, ...], std: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.randn(shape, generator=self.g) * std).to(dtype)

    def add(self, name: str, t: torch.Tensor) -> torch.Tensor:
        assert name not in self.t, name
        self.t[name] = t.contiguous()
        return self.t[name]

    def linear(self, name: str, out: int, inp: int, dtype: torch.dtype, bias: bool = False) -> torch.Tensor:
        w = self.add(f"{name}.weight", self.randn((out, inp), inp**-0.5, dtype))
        if bias:
            self.add(f"{name}.bias", self.randn((out,), 0.02, dtype))
        return w

    def norm(self, name: str, n: int, dtype: torch.dtype) -> None:
        self.add(f"{name}.weight", (1.0 + self.randn((n,), 0.05)).to(dtype))

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

    def fp8_linear(self, name: str, out: int, inp: int, ue8m0: bool) -> torch.Tensor:
        q, s, deq = self.fp8_weight((out, inp), inp**-0.5, ue8m0)
        self.add(f"{name}.weight", q)
        self.add(f"{name}.weight_scale_inv", s)
        return deq


def pack_int4_words_reference(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` int4 words by integer arithmetic (independent of
    mxconv.int4's byte views): values q [N, K] in [-8, 7] -> int32 [N, K/8], value j stored as
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


# ---------------------------------------------------------------------------------------------
# families
# ---------------------------------------------------------------------------------------------


def _gpt_oss(b: _Builder, kind: str, L: int, E: int, H: int, I: int, top_k: int, V: int) -> tuple[dict[str, Any], dict[int, LayerTruth]]:
    mx = kind == "gpt-oss-mxfp4"
    heads, kv_heads, head_dim = 4, 2, 16
    bf = torch.bfloat16
    config: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "num_hidden_layers": L,
        "num_local_experts": E,
        "num_experts_per_tok": top_k,
        "experts_per_token": top_k,
        "hidden_size": H,
        "intermediate_size": I,
        "swiglu_limit": 7.0,
        "head_dim": head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)],
        "vocab_size": V,
        "tie_word_embeddings": False,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 131072,
        "initial_context_length": 4096,
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "eos_token_id": 1,
        "pad_token_id": 2,
        "transformers_version": "4.55.0",
    }
    if mx:
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
        }
    truths: dict[int, LayerTruth] = {}
    b.add("model.embed_tokens.weight", b.randn((V, H), 1.0, bf))
    for li in range(L):
        p = f"model.layers.{li}"
        b.norm(f"{p}.input_layernorm", H, bf)
        b.linear(f"{p}.self_attn.q_proj", heads * head_dim, H, bf, bias=True)
        b.linear(f"{p}.self_attn.k_proj", kv_heads * head_dim, H, bf, bias=True)
        b.linear(f"{p}.self_attn.v_proj", kv_heads * head_dim, H, bf, bias=True)
        b.linear(f"{p}.self_attn.o_proj", H, heads * head_dim, bf, bias=True)
        b.add(f"{p}.self_attn.sinks", b.randn((heads,), 1.0, bf))
        b.norm(f"{p}.post_attention_layernorm", H, bf)
        rw = b.linear(f"{p}.mlp.router", E, H, bf, bias=True)
        x = f"{p}.mlp.experts"
        t = LayerTruth(
            layer=li,
            module_prefix=f"{p}.mlp",
            row_order="interleaved",
            expert_names=[],
            router_weight=f"{p}.mlp.router.weight",
            router_bias=f"{p}.mlp.router.bias",
        )
        del rw
        if mx:
            for key, proj, n, k in (("w13_mx", "gate_up_proj", 2 * I, H), ("w2_mx", "down_proj", H, I)):
                blocks = torch.randint(0, 256, (E, n, k // 32, 16), generator=b.g, dtype=torch.uint8)
                scales = torch.randint(115, 126, (E, n, k // 32), generator=b.g, dtype=torch.uint8)
                b.add(f"{x}.{proj}_blocks", blocks)
                b.add(f"{x}.{proj}_scales", scales)
                bias = b.add(f"{x}.{proj}_bias", b.randn((E, n), 0.02, bf))
                setattr(t, key, (blocks.reshape(E, n, k // 2).clone(), scales.clone()))
                setattr(t, "w13_bias" if proj == "gate_up_proj" else "w2_bias", bias)
                t.expert_names += [f"{x}.{proj}_blocks", f"{x}.{proj}_scales", f"{x}.{proj}_bias"]
        else:
            gate = b.randn((E, I, H), H**-0.5, bf)
            up = b.randn((E, I, H), H**-0.5, bf)
            w13 = torch.stack([gate, up], dim=2).reshape(E, 2 * I, H)  # row 2j = gate j, 2j+1 = up j
            w2 = b.randn((E, H, I), I**-0.5, bf)
            b.add(f"{x}.gate_up_proj", w13.transpose(1, 2))  # stored [E, H, 2I] (in x out)
            t.w13_bias = b.add(f"{x}.gate_up_proj_bias", b.randn((E, 2 * I), 0.02, bf))
            b.add(f"{x}.down_proj", w2.transpose(1, 2))  # [E, I, H]
            t.w2_bias = b.add(f"{x}.down_proj_bias", b.randn((E, H), 0.02, bf))
            t.w13, t.w2, t.gate, t.up = w13, w2, gate, up
            t.expert_names += [f"{x}.gate_up_proj", f"{x}.gate_up_proj_bias", f"{x}.down_proj", f"{x}.down_proj_bias"]
        truths[li] = t
    b.norm("model.norm", H, bf)
    b.add("lm_head.weight", b.randn((V, H), H**-0.5, bf))
    return config, truths


def _per_expert_layer(
    b: _Builder,
    prefix: str,
    E: int,
    H: int,
    I: int,
    projs: tuple[str, str, str],
    dtype: torch.dtype,
    fp8: bool,
    ue8m0: bool,
    int4: bool = False,
) -> LayerTruth:
    """Routed experts of one layer under ``{prefix}.experts.{e}.{proj}``; returns the truth."""
    t = LayerTruth(layer=-1, module_prefix=prefix, row_order="halves", expert_names=[], router_weight="")
    out_dtype = torch.float32 if fp8 or int4 else dtype
    w13 = torch.empty((E, 2 * I, H), dtype=out_dtype)
    w2 = torch.empty((E, H, I), dtype=out_dtype)
    if int4:
        t.w13_int4 = (torch.empty((E, 2 * I, H // 2), dtype=torch.uint8), torch.empty((E, 2 * I, H // INT4_GROUP), dtype=torch.bfloat16))
        t.w2_int4 = (torch.empty((E, H, I // 2), dtype=torch.uint8), torch.empty((E, H, I // INT4_GROUP), dtype=torch.bfloat16))
    for e in range(E):
        for j, (proj, n, k) in enumerate(((projs[0], I, H), (projs[1], I, H), (projs[2], H, I))):
            name = f"{prefix}.experts.{e}.{proj}"
            if int4:
                data, scale, w = b.int4_linear(name, n, k)
                t.expert_names += [f"{name}.weight_packed", f"{name}.weight_scale", f"{name}.weight_shape"]
                stack, rows = (t.w13_int4, slice(j * I, (j + 1) * I)) if j < 2 else (t.w2_int4, slice(None))
                assert stack is not None
                stack[0][e, rows], stack[1][e, rows] = data, scale
            elif fp8:
                w = b.fp8_linear(name, n, k, ue8m0)
                t.expert_names += [f"{name}.weight", f"{name}.weight_scale_inv"]
            else:
                w = b.linear(name, n, k, dtype)
                t.expert_names.append(f"{name}.weight")
            if j < 2:
                w13[e, j * I : (j + 1) * I] = w
            else:
                w2[e] = w
    t.w13, t.w2 = w13, w2
    t.gate, t.up = w13[:, :I].clone(), w13[:, I:].clone()
    return t


def _mlp(b: _Builder, prefix: str, H: int, I: int, dtype: torch.dtype, fp8: bool, ue8m0: bool) -> None:
    """A dense SwiGLU MLP ``{prefix}.{gate,up,down}_proj``."""
    for proj, n, k in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
        if fp8:
            b.fp8_linear(f"{prefix}.{proj}", n, k, ue8m0)
        else:
            b.linear(f"{prefix}.{proj}", n, k, dtype)


def _qwen_mixtral(
    b: _Builder, kind: str, L: int, E: int, H: int, I: int, top_k: int, V: int, dtype: torch.dtype, mlp_only: tuple[int, ...]
) -> tuple[dict[str, Any], dict[int, LayerTruth]]:
    heads, kv_heads, head_dim = 4, 2, 32
    dense_i = 2 * I
    dt_name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    common = {
        "num_hidden_layers": L,
        "hidden_size": H,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": V,
        "num_experts_per_tok": top_k,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": dt_name,
        "use_cache": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "transformers_version": "4.51.0",
    }
    if kind == "mixtral":
        config = {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            **common,
            "num_local_experts": E,
            "intermediate_size": I,
            "head_dim": head_dim,
            "sliding_window": None,
            "router_aux_loss_coef": 0.02,
            "output_router_logits": False,
        }
        moe, projs = "block_sparse_moe", ("w1", "w3", "w2")
    elif kind == "qwen3-moe":
        config = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **common,
            "num_experts": E,
            "moe_intermediate_size": I,
            "intermediate_size": dense_i,
            "head_dim": head_dim,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(mlp_only),
            "norm_topk_prob": True,
            "attention_bias": False,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
        }
        moe, projs = "mlp", ("gate_proj", "up_proj", "down_proj")
    else:  # qwen2-moe
        config = {
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            **common,
            "num_experts": E,
            "moe_intermediate_size": I,
            "shared_expert_intermediate_size": 2 * I,
            "intermediate_size": dense_i,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(mlp_only),
            "norm_topk_prob": False,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
        }
        moe, projs = "mlp", ("gate_proj", "up_proj", "down_proj")
    hd = head_dim if kind != "qwen2-moe" else H // heads
    qkv_bias = kind == "qwen2-moe"
    truths: dict[int, LayerTruth] = {}
    b.add("model.embed_tokens.weight", b.randn((V, H), 1.0, dtype))
    for li in range(L):
        p = f"model.layers.{li}"
        b.norm(f"{p}.input_layernorm", H, dtype)
        b.linear(f"{p}.self_attn.q_proj", heads * hd, H, dtype, bias=qkv_bias)
        b.linear(f"{p}.self_attn.k_proj", kv_heads * hd, H, dtype, bias=qkv_bias)
        b.linear(f"{p}.self_attn.v_proj", kv_heads * hd, H, dtype, bias=qkv_bias)
        b.linear(f"{p}.self_attn.o_proj", H, heads * hd, dtype)
        if kind == "qwen3-moe":
            b.norm(f"{p}.self_attn.q_norm", hd, dtype)
            b.norm(f"{p}.self_attn.k_norm", hd, dtype)
        b.norm(f"{p}.post_attention_layernorm", H, dtype)
        if li in mlp_only:
            _mlp(b, f"{p}.mlp", H, dense_i, dtype, False, False)
            continue
        b.linear(f"{p}.{moe}.gate", E, H, dtype)
        t = _per_expert_layer(b, f"{p}.{moe}", E, H, I, projs, dtype, False, False)
        t.layer, t.router_weight = li, f"{p}.{moe}.gate.weight"
        truths[li] = t
        if kind == "qwen2-moe":
            _mlp(b, f"{p}.mlp.shared_expert", H, 2 * I, dtype, False, False)
            b.linear(f"{p}.mlp.shared_expert_gate", 1, H, dtype)
    b.norm("model.norm", H, dtype)
    b.add("lm_head.weight", b.randn((V, H), H**-0.5, dtype))
    return config, truths


def _deepseek_glm(
    b: _Builder, kind: str, L: int, E: int, H: int, I: int, top_k: int, V: int, nextn: int
) -> tuple[dict[str, Any], dict[int, LayerTruth]]:
    glm = kind == "glm4-moe"
    int4 = kind in INT4_KINDS
    kimi = kind in ("kimi-k2", "kimi-k2-int4")
    fp8 = not glm and not int4
    ue8m0 = kind == "deepseek-v3.1-fp8-ue8m0"
    bf = torch.bfloat16
    dense_i = 2 * I
    n_group, topk_group = (2, 1) if E % 2 == 0 and not glm and not kimi else (1, 1)
    if glm:
        heads, kv_heads, head_dim = 4, 2, 32
        config: dict[str, Any] = {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "hidden_size": H,
            "intermediate_size": dense_i,
            "moe_intermediate_size": I,
            "n_routed_experts": E,
            "n_shared_experts": 1,
            "num_experts_per_tok": top_k,
            "first_k_dense_replace": 1,
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
            "hidden_size": H,
            "intermediate_size": dense_i,
            "moe_intermediate_size": I,
            "n_routed_experts": E,
            "n_shared_experts": 1,
            "num_experts_per_tok": top_k,
            "first_k_dense_replace": 1,
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
        if fp8:
            b.fp8_linear(name, out, inp, ue8m0)
        else:
            b.linear(name, out, inp, bf, bias=bias)

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
            _mlp(b, f"{p}.mlp", H, dense_i, bf, fp8, ue8m0)
            continue
        b.linear(f"{p}.mlp.gate", E, H, bf)
        b.add(f"{p}.mlp.gate.e_score_correction_bias", b.randn((E,), 0.1, torch.float32))
        t = _per_expert_layer(b, f"{p}.mlp", E, H, I, ("gate_proj", "up_proj", "down_proj"), bf, fp8, ue8m0, int4)
        t.layer = li
        t.router_weight = f"{p}.mlp.gate.weight"
        t.correction_bias = f"{p}.mlp.gate.e_score_correction_bias"
        truths[li] = t
        _mlp(b, f"{p}.mlp.shared_experts", H, I, bf, fp8, ue8m0)
    b.norm("model.norm", H, bf)
    b.add("lm_head.weight", b.randn((V, H), H**-0.5, bf))
    return config, truths


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_shards(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """Write ``tensors`` (in order) as ``shards`` files + index, or one ``model.safetensors`` if 1."""
    names = list(tensors)
    if shards <= 1:
        save_file({n: tensors[n] for n in names}, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    shards = min(shards, len(names))
    total = sum(_nbytes(t) for t in tensors.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc, g = 0, 0
    for i, n in enumerate(names):
        target = min(shards - 1, acc * shards // max(total, 1))  # balanced by bytes
        g = min(target, g + 1) if groups[g] else g  # never leave a shard empty ...
        g = max(g, shards - (len(names) - i))  # ... including the last ones
        groups[g].append(n)
        acc += _nbytes(tensors[n])
    groups = [grp for grp in groups if grp]
    k = len(groups)
    weight_map: dict[str, str] = {}
    for i, grp in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{k:05d}.safetensors"
        save_file({n: tensors[n] for n in grp}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in grp})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_side_files(path: Path, config: dict[str, Any]) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    vocab = {f"<t{i}>": i for i in range(8)}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<t0>"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer, indent=2) + "\n")
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "bos_token": "<t0>", "eos_token": "<t1>"}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "transformers_version": "4.55.0"}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def make_checkpoint(
    path: str | Path,
    kind: str,
    *,
    num_layers: int = 2,
    num_experts: int = 4,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    top_k: int = 2,
    vocab_size: int = 64,
    seed: int = 0,
    shards: int = 2,
    dtype: torch.dtype = torch.bfloat16,
    num_nextn_predict_layers: int | None = None,
    mlp_only_layers: tuple[int, ...] = (),
) -> GroundTruth:
    """Write a tiny checkpoint of ``kind`` (see :data:`KINDS`) into ``path`` and return its truth.

    ``dtype`` applies to the per-expert bf16 kinds (qwen*, mixtral: bf16/fp16/fp32).
    ``num_nextn_predict_layers`` (DeepSeek/GLM; default 1, Kimi-K2 0) adds MTP layers after the
    ``num_layers`` decoder layers. ``mlp_only_layers`` (Qwen) makes those layers dense.
    DeepSeek/GLM kinds make layer 0 dense (``first_k_dense_replace = 1``).
    """
    if kind not in KINDS + INT4_KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS + INT4_KINDS}")
    family = FAMILY_OF_KIND[kind]
    dh, di = _KIND_SIZES.get(kind, _DEFAULT_SIZES[family])
    H = hidden_size or dh
    I = intermediate_size or di
    if H % 32 or I % 32:
        raise ValueError(f"hidden_size {H} and intermediate_size {I} must be multiples of 32")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    b = _Builder(seed)
    if family == "gpt-oss":
        config, truths = _gpt_oss(b, kind, num_layers, num_experts, H, I, top_k, vocab_size)
    elif family in ("qwen-moe", "mixtral"):
        config, truths = _qwen_mixtral(b, kind, num_layers, num_experts, H, I, top_k, vocab_size, dtype, tuple(mlp_only_layers))
    else:
        nextn = num_nextn_predict_layers if num_nextn_predict_layers is not None else (0 if kind in ("kimi-k2", "kimi-k2-int4") else 1)
        config, truths = _deepseek_glm(b, kind, num_layers, num_experts, H, I, top_k, vocab_size, nextn)
    write_shards(path, b.t, shards)
    _write_side_files(path, config)
    return GroundTruth(
        kind=kind,
        family=family,
        path=path,
        config=config,
        tensor_names=list(b.t),
        num_experts=num_experts,
        hidden_size=H,
        intermediate_size=I,
        top_k=top_k,
        layers=truths,
    )


# ---------------------------------------------------------------------------------------------
# Hugging Face hub cache
# ---------------------------------------------------------------------------------------------


def make_hub_cache(cache_dir: str | Path, repo_id: str, src_dir: str | Path, revision: str = "main") -> Path:
    """Lay ``src_dir``'s files out as a hub cache entry; return the snapshot directory.

    ``{cache_dir}/models--{org}--{name}/blobs/<sha256>``, ``snapshots/<commit>/<file>`` (relative
    symlinks to the blobs, copies where symlinks are not available) and ``refs/{revision}``
    holding the 40-hex commit id (a sha1 over the file names and contents). Point
    ``HF_HUB_CACHE`` at ``cache_dir`` and set ``HF_HUB_OFFLINE=1`` to resolve ``repo_id`` from it.
    """
    cache_dir, src_dir = Path(cache_dir), Path(src_dir)
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    files = sorted(f for f in src_dir.rglob("*") if f.is_file())
    commit = hashlib.sha1()
    digests = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        digests[f] = h.hexdigest()
        commit.update(f"{f.relative_to(src_dir).as_posix()}\0{digests[f]}\n".encode())
    commit_id = commit.hexdigest()
    snap = repo / "snapshots" / commit_id
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for f in files:
        blob = repo / "blobs" / digests[f]
        if not blob.exists():
            shutil.copyfile(f, blob)
        dst = snap / f.relative_to(src_dir)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists() or dst.is_symlink():
            dst.unlink()
        try:
            os.symlink(os.path.relpath(blob, dst.parent), dst)
        except OSError:
            shutil.copyfile(blob, dst)
    ref = repo / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit_id)
    return snap
