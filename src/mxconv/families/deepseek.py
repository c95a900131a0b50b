"""DeepSeek-V3 / R1 / V3.1 / V3.2 and Kimi-K2 (``DeepseekV3ForCausalLM``, model_type ``deepseek_v3``,
``deepseek_v32`` or ``kimi_k2``; Kimi-K2.5 nests the same fields under ``text_config``).

Routed experts: ``model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight`` with I =
``moe_intermediate_size``, usually block-FP8 (F8_E4M3 + F32 ``weight_scale_inv`` per 128x128 tile;
V3.1+ ``scale_fmt: ue8m0`` = power-of-two scales), also read as bf16 (dequantized re-uploads) or as
mxconv's own compressed-tensors MX output. Block-FP8 experts are dequantized in fp32.
Router ``mlp.gate.weight`` ``[E, H]`` + ``mlp.gate.e_score_correction_bias`` ``[E]`` (F32).
Shared experts (``mlp.shared_experts.*``) and the dense layers ``L < first_k_dense_replace``
(``mlp.{gate,up,down}_proj``) are left alone.

MoE layers: ``first_k_dense_replace <= L < num_hidden_layers`` with ``L % moe_layer_freq == 0``,
plus the ``num_nextn_predict_layers`` multi-token-prediction layers ``L >= num_hidden_layers``
(``model.layers.61`` in V3: a full decoder layer with MoE plus ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head``). MTP layers present in the checkpoint are converted like any MoE layer, never
dropped; a checkpoint that ships without them is accepted.
Routing "sigmoid_grouped": sigmoid scores + correction bias, ``n_group`` / ``topk_group`` grouped
top-k, ``routed_scaling_factor``, ``norm_topk_prob``. Activation SiLU(gate)·up.
See :mod:`mxconv.families.per_expert` for the quantized-output convention and its block-FP8 limitation.
"""

from __future__ import annotations

from typing import Any

from mxconv.errors import BadInput
from mxconv.families.per_expert import PerExpertReader


class DeepseekStyleReader(PerExpertReader):
    """Shared by DeepSeek-V3 and GLM-4.5: dense prefix, MTP layers, sigmoid grouped routing."""

    moe_layer_freq_key: str | None = "moe_layer_freq"

    def _rule(self) -> tuple[int, int, int]:
        k = self.cfg_int("first_k_dense_replace", default=0)
        freq = self.cfg_int(self.moe_layer_freq_key, default=1) if self.moe_layer_freq_key else 1
        nextn = self.cfg_int("num_nextn_predict_layers", default=0)
        return k, max(freq, 1), nextn

    def config_moe_layers(self, num_layers: int) -> tuple[dict[int, str], dict[int, str]]:
        k, freq, nextn = self._rule()
        moe = {
            L: f"L >= first_k_dense_replace({k}) and L % moe_layer_freq({freq}) == 0"
            for L in range(num_layers)
            if L >= k and L % freq == 0
        }
        mtp = {L: f"multi-token-prediction layer {L - num_layers} of num_nextn_predict_layers={nextn}" for L in range(num_layers, num_layers + nextn)}
        return moe, mtp

    def dense_reason(self, layer: int) -> str:
        k, freq, nextn = self._rule()
        return f"first_k_dense_replace={k}, moe_layer_freq={freq}, num_nextn_predict_layers={nextn}"

    def routing_fields(self) -> dict[str, Any]:
        scoring = self.ckpt.cfg("scoring_func", default="sigmoid")
        if scoring != "sigmoid":
            raise BadInput(f"{self.ckpt.root / 'config.json'}: scoring_func {scoring!r} is not supported (expected 'sigmoid')")
        factor = self.ckpt.cfg("routed_scaling_factor", default=1.0)
        if not isinstance(factor, (int, float)) or isinstance(factor, bool):
            raise BadInput(f"{self.ckpt.root / 'config.json'}: routed_scaling_factor must be a number, got {factor!r}")
        return {
            "routing": "sigmoid_grouped",
            "norm_topk_prob": bool(self.ckpt.cfg("norm_topk_prob", default=True)),
            "n_group": self.cfg_int("n_group", default=1) or 1,
            "topk_group": self.cfg_int("topk_group", default=1) or 1,
            "routed_scaling_factor": float(factor),
        }


class DeepseekV3Reader(DeepseekStyleReader):
    """DeepSeek-V3/R1/V3.1/V3.2 and Kimi-K2."""

    name = "deepseek-v3"
    title = "DeepSeek-V3/R1/V3.1 and Kimi-K2"
    model_types = frozenset({"deepseek_v3", "deepseek_v32", "kimi_k2"})
    architectures = frozenset({"DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"})
