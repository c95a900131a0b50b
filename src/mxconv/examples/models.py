"""Generators of the float / MXFP4 example families: gpt-oss (fused ``gate_up_proj``, biases,
interleaved rows; bf16 or the release's MXFP4 blocks) and the per-expert Linear families
(Qwen3-MoE, Qwen2-MoE with a shared expert, Mixtral). Each adds its tensors to a
:class:`~mxconv.examples.builder.Builder` in file order and returns (config.json, truth per MoE layer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mxconv.examples.builder import Builder, LayerTruth, ModelSizes


@dataclass(frozen=True)
class Attention:
    """A family's attention projections: heads, key/value heads, head size, which have biases."""

    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool


def attention(b: Builder, p: str, H: int, a: Attention, dtype: torch.dtype) -> None:
    """Decoder layer ``p``'s input norm and q/k/v/o projections."""
    hd = a.head_dim
    b.norm(f"{p}.input_layernorm", H, dtype)
    b.linear(f"{p}.self_attn.q_proj", a.heads * hd, H, dtype, bias=a.qkv_bias)
    b.linear(f"{p}.self_attn.k_proj", a.kv_heads * hd, H, dtype, bias=a.qkv_bias)
    b.linear(f"{p}.self_attn.v_proj", a.kv_heads * hd, H, dtype, bias=a.qkv_bias)
    b.linear(f"{p}.self_attn.o_proj", H, a.heads * hd, dtype, bias=a.o_bias)


GPT_OSS_HEADS, GPT_OSS_KV_HEADS, GPT_OSS_HEAD_DIM = 4, 2, 16


def gpt_oss_config(sizes: ModelSizes, mx: bool, head_dim: int = GPT_OSS_HEAD_DIM) -> dict[str, Any]:
    """config.json of a gpt-oss checkpoint with these sizes (``mx``: the MXFP4 release's quantization_config)."""
    L, E, H, I, top_k, V = sizes.dims()
    heads, kv_heads = GPT_OSS_HEADS, GPT_OSS_KV_HEADS
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
    return config


def gpt_oss(b: Builder, kind: str, sizes: ModelSizes,
            head_dim: int = GPT_OSS_HEAD_DIM) -> tuple[dict[str, Any], dict[int, LayerTruth]]:  # fmt: skip
    mx = kind == "gpt-oss-mxfp4"
    L, E, H, I, _, V = sizes.dims()
    heads = GPT_OSS_HEADS
    attn = Attention(heads, GPT_OSS_KV_HEADS, head_dim, qkv_bias=True, o_bias=True)
    bf = torch.bfloat16
    config = gpt_oss_config(sizes, mx, head_dim)
    truths: dict[int, LayerTruth] = {}
    b.add("model.embed_tokens.weight", b.randn((V, H), 1.0, bf))
    for li in range(L):
        p = f"model.layers.{li}"
        attention(b, p, H, attn, bf)
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


def per_expert_layer(b: Builder, prefix: str, E: int, H: int, I: int, projs: tuple[str, str, str], dtype: torch.dtype) -> LayerTruth:
    """Routed experts of one layer under ``{prefix}.experts.{e}.{proj}`` (through
    :meth:`Builder.expert_linear`); returns the truth."""
    t = LayerTruth(layer=-1, module_prefix=prefix, row_order="halves", expert_names=[], router_weight="")
    out_dtype = b.expert_dtype(dtype)
    w13 = torch.empty((E, 2 * I, H), dtype=out_dtype)
    w2 = torch.empty((E, H, I), dtype=out_dtype)
    b.begin_experts(t, E, H, I)
    for e in range(E):
        for j, (proj, n, k) in enumerate(((projs[0], I, H), (projs[1], I, H), (projs[2], H, I))):
            which, rows = ("w13", slice(j * I, (j + 1) * I)) if j < 2 else ("w2", slice(None))
            w = b.expert_linear(t, which, e, rows, f"{prefix}.experts.{e}.{proj}", n, k, dtype)
            (w13 if j < 2 else w2)[e, rows] = w
    t.w13, t.w2 = w13, w2
    t.gate, t.up = w13[:, :I].clone(), w13[:, I:].clone()
    return t


def mlp(b: Builder, prefix: str, H: int, I: int, dtype: torch.dtype) -> None:
    """A dense SwiGLU MLP ``{prefix}.{gate,up,down}_proj`` (through :meth:`Builder.dense_linear`)."""
    for proj, n, k in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
        b.dense_linear(f"{prefix}.{proj}", n, k, dtype)


QWEN_HEADS, QWEN_KV_HEADS, QWEN_HEAD_DIM = 4, 2, 32


def qwen_mixtral_config(kind: str, sizes: ModelSizes, dtype: torch.dtype,
                        mlp_only: tuple[int, ...]) -> tuple[dict[str, Any], str, tuple[str, str, str]]:  # fmt: skip
    """(config.json, the MoE module's name, the (gate, up, down) projection names) of ``kind``."""
    L, E, H, I, top_k, V = sizes.dims()
    heads, kv_heads, head_dim = QWEN_HEADS, QWEN_KV_HEADS, QWEN_HEAD_DIM
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
    return config, moe, projs


def qwen_mixtral(
    b: Builder, kind: str, sizes: ModelSizes, dtype: torch.dtype, mlp_only: tuple[int, ...]
) -> tuple[dict[str, Any], dict[int, LayerTruth]]:
    L, E, H, I, _, V = sizes.dims()
    dense_i = 2 * I
    config, moe, projs = qwen_mixtral_config(kind, sizes, dtype, mlp_only)
    hd = QWEN_HEAD_DIM if kind != "qwen2-moe" else H // QWEN_HEADS
    attn = Attention(QWEN_HEADS, QWEN_KV_HEADS, hd, qkv_bias=kind == "qwen2-moe", o_bias=False)
    truths: dict[int, LayerTruth] = {}
    b.add("model.embed_tokens.weight", b.randn((V, H), 1.0, dtype))
    for li in range(L):
        p = f"model.layers.{li}"
        attention(b, p, H, attn, dtype)
        if kind == "qwen3-moe":
            b.norm(f"{p}.self_attn.q_norm", hd, dtype)
            b.norm(f"{p}.self_attn.k_norm", hd, dtype)
        b.norm(f"{p}.post_attention_layernorm", H, dtype)
        if li in mlp_only:
            mlp(b, f"{p}.mlp", H, dense_i, dtype)
            continue
        b.linear(f"{p}.{moe}.gate", E, H, dtype)
        t = per_expert_layer(b, f"{p}.{moe}", E, H, I, projs, dtype)
        t.layer, t.router_weight = li, f"{p}.{moe}.gate.weight"
        truths[li] = t
        if kind == "qwen2-moe":
            mlp(b, f"{p}.mlp.shared_expert", H, 2 * I, dtype)
            b.linear(f"{p}.mlp.shared_expert_gate", 1, H, dtype)
    b.norm("model.norm", H, dtype)
    b.add("lm_head.weight", b.randn((V, H), H**-0.5, dtype))
    return config, truths
