"""Qwen2-MoE / Qwen1.5-MoE and Qwen3-MoE (``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``).

Routed experts: ``model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight`` (``[I, H]``, ``[I, H]``,
``[H, I]``, I = ``moe_intermediate_size``), router ``mlp.gate.weight`` ``[E, H]``. Qwen2-MoE's
``mlp.shared_expert.*`` and ``mlp.shared_expert_gate`` are left alone (copied by the writer).
MoE layers: ``L not in mlp_only_layers and (L + 1) % decoder_sparse_step == 0``; the others hold a
dense ``mlp.{gate,up,down}_proj``. Routing: softmax over all experts, top-k, renormalised when
``norm_topk_prob`` (default false, as in transformers' Qwen2-MoE config). Activation SiLU(gate)·up.
The "-FP8" releases (block-FP8, ``weight_scale_inv``) are read like DeepSeek's.
"""

from __future__ import annotations

from typing import Any

from mxconv.errors import BadInput
from mxconv.families.per_expert import PerExpertReader


class QwenMoeReader(PerExpertReader):
    """Qwen2-MoE / Qwen3-MoE per-expert checkpoints."""

    name = "qwen-moe"
    title = "Qwen2/Qwen3-MoE"
    model_types = frozenset({"qwen3_moe", "qwen2_moe"})
    architectures = frozenset({"Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"})

    def _sparse_rule(self) -> tuple[list[int], int]:
        only = self.ckpt.cfg("mlp_only_layers", default=[]) or []
        if not isinstance(only, list) or not all(isinstance(x, int) for x in only):
            raise BadInput(f"{self.ckpt.root / 'config.json'}: mlp_only_layers must be a list of layer indices, got {only!r}")
        return only, self.cfg_int("decoder_sparse_step", default=1) or 1

    def config_moe_layers(self, num_layers: int) -> tuple[dict[int, str], dict[int, str]]:
        only, step = self._sparse_rule()
        return {
            L: f"not in mlp_only_layers and (L + 1) % decoder_sparse_step({step}) == 0"
            for L in range(num_layers)
            if L not in only and (L + 1) % step == 0
        }, {}

    def dense_reason(self, layer: int) -> str:
        only, step = self._sparse_rule()
        return f"mlp_only_layers={only}, decoder_sparse_step={step}"

    def routing_fields(self) -> dict[str, Any]:
        return {"routing": "softmax_topk", "norm_topk_prob": bool(self.ckpt.cfg("norm_topk_prob", default=False))}
