"""Mixtral (``MixtralForCausalLM``): 8x7B, 8x22B.

Routed experts: ``model.layers.L.block_sparse_moe.experts.e.w1.weight`` (gate ``[I, H]``), ``w3``
(up ``[I, H]``), ``w2`` (down ``[H, I]``), I = ``intermediate_size``; router
``block_sparse_moe.gate.weight`` ``[E, H]``. Every layer is MoE. vLLM's FusedMoE parent is
``model.layers.L.block_sparse_moe``. Routing: softmax over the top-2 logits ("topk_softmax").
"""

from __future__ import annotations

from typing import Any

from mxconv.families.per_expert import PerExpertReader


class MixtralReader(PerExpertReader):
    """Mixtral per-expert checkpoints (w1/w3/w2)."""

    name = "mixtral"
    title = "Mixtral"
    moe_module = "block_sparse_moe"
    proj_names = ("w1", "w3", "w2")
    model_types = frozenset({"mixtral"})
    architectures = frozenset({"MixtralForCausalLM"})
    ignore_patterns = (
        "lm_head",
        r"re:.*embed_tokens$",
        r"re:.*self_attn\..*",
        r"re:.*\.block_sparse_moe\.gate$",
    )

    def routing_fields(self) -> dict[str, Any]:
        return {"routing": "topk_softmax", "norm_topk_prob": True}
