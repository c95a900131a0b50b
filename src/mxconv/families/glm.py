"""GLM-4.5 / 4.6 / 4.7 MoE (``Glm4MoeForCausalLM``, model_type ``glm4_moe``).

DeepSeek-style names: routed experts ``model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight``
(I = ``moe_intermediate_size``), router ``mlp.gate.weight`` + ``mlp.gate.e_score_correction_bias``,
shared experts ``mlp.shared_experts.*`` and dense layers ``L < first_k_dense_replace`` left alone.
bf16, or block-FP8 for the "-FP8" releases. MoE layers: ``first_k_dense_replace <= L <
num_hidden_layers`` (no ``moe_layer_freq``) plus the ``num_nextn_predict_layers`` MTP layers.
Routing "sigmoid_grouped" like DeepSeek-V3; activation SiLU(gate)·up.
"""

from __future__ import annotations

from mxconv.families.deepseek import DeepseekStyleReader


class Glm4MoeReader(DeepseekStyleReader):
    """GLM-4.5-family MoE checkpoints."""

    name = "glm4-moe"
    title = "GLM-4.5 MoE"
    moe_layer_freq_key = None
    model_types = frozenset({"glm4_moe"})
    architectures = frozenset({"Glm4MoeForCausalLM"})
