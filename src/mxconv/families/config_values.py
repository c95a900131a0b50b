"""The ranges of the config.json values a conversion carries into its output.

Planning a conversion reads the model's description (:class:`~mxconv.families.base.ModelInfo`: sizes,
top-k, routing and activation constants) from config.json; those values go into ``mxconv.json``, the
output's config.json and the numerics (the SwiGLU clamp and alpha of the fused kernels, the routed
scaling of the reference runner), and the output's config.json hands the others (norm epsilon, RoPE
parameters) to the engines. The JSON reader already refuses what is not a finite number
(:mod:`mxconv.source.json_files`); :func:`check_config_values` refuses the finite values no model
has (a clamp limit of -1, top-k 0, an epsilon of 0), naming config.json, the field and the rule,
before anything is written.
"""

from __future__ import annotations

from typing import Any, Callable

from mxconv.errors import BadInput
from mxconv.families.base import ModelInfo
from mxconv.source.checkpoint import Checkpoint
from mxconv.source.file_names import CONFIG_NAME

# ModelInfo field -> the config.json keys the family readers take it from (the first one present is named)
_CONFIG_KEYS = {
    "num_layers": ("num_hidden_layers",),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "top_k": ("num_experts_per_tok", "experts_per_token"),
    "hidden_size": ("hidden_size",),
    "intermediate_size": ("moe_intermediate_size", "intermediate_size"),
    "n_group": ("n_group",),
    "topk_group": ("topk_group",),
    "routed_scaling_factor": ("routed_scaling_factor",),
    "swiglu_alpha": ("swiglu_alpha",),
    "swiglu_limit": ("swiglu_limit",),
}
_EPSILONS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps")
_ROPE_TABLES = ("rope_scaling", "rope_parameters")
_ROPE_POSITIVE = ("rope_theta", "factor")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


Rule = tuple[Callable[[Any], bool], str]
_POSITIVE_INT: Rule = (lambda v: _integer(v) and v >= 1, "must be a positive integer")
_POSITIVE: Rule = (lambda v: _number(v) and v > 0, "must be a number greater than 0")
_EPSILON: Rule = (lambda v: _number(v) and 0 < v < 1, "must be a number between 0 and 1 (exclusive)")


def _model_rules(info: ModelInfo) -> list[tuple[str, Any, Rule]]:
    """(ModelInfo field, value, rule) for every field a plan carries into the output."""
    rules = [(f, getattr(info, f), _POSITIVE_INT) for f in ("num_layers", "num_experts", "hidden_size", "intermediate_size",
                                                          "n_group", "topk_group")]
    rules.append(("top_k", info.top_k, (lambda v: _integer(v) and 1 <= v <= info.num_experts,
                                         f"must be an integer from 1 to the number of experts ({info.num_experts})")))
    if info.routing == "sigmoid_grouped":
        rules.append(("topk_group", info.topk_group, (lambda v: v <= info.n_group,
                                                      f"must be at most n_group ({info.n_group})")))
        rules.append(("n_group", info.n_group, (lambda v: info.num_experts % v == 0,
                                                f"must divide the number of experts ({info.num_experts})")))
    rules.append(("routed_scaling_factor", info.routed_scaling_factor, _POSITIVE))
    for f in ("swiglu_alpha", "swiglu_limit"):
        if getattr(info, f) is not None:
            rules.append((f, getattr(info, f), _POSITIVE))
    return rules


def _config_rules(ckpt: Checkpoint) -> list[tuple[str, Any, Rule]]:
    """(config key, value, rule) for the engine-side values present in config.json (or its text_config)."""
    rules: list[tuple[str, Any, Rule]] = []
    for key in _EPSILONS:
        if ckpt.cfg(key) is not None:
            rules.append((key, ckpt.cfg(key), _EPSILON))
    if ckpt.cfg("rope_theta") is not None:
        rules.append(("rope_theta", ckpt.cfg("rope_theta"), _POSITIVE))
    for table in _ROPE_TABLES:
        rope = ckpt.cfg(table)
        if isinstance(rope, dict):
            rules += [(f"{table}.{k}", rope[k], _POSITIVE) for k in _ROPE_POSITIVE if rope.get(k) is not None]
    return rules


def _from_config(ckpt: Checkpoint, field: str, value: Any) -> tuple[str, Any]:
    """(the config.json key ModelInfo's ``field`` came from, its value there), or (``field``,
    ``value``) where config.json holds none of its keys (a default, or a size read from the tensors)."""
    key = next((k for k in _CONFIG_KEYS.get(field, ()) if ckpt.cfg(k) is not None), None)
    return (field, value) if key is None else (key, ckpt.cfg(key))


def check_config_values(ckpt: Checkpoint, info: ModelInfo) -> None:
    """BadInput ``"<SOURCE>/config.json: swiglu_limit -1.0 must be a number greater than 0"`` for the
    first value of ``info`` (the model as the family reader found it) or of config.json that is out of
    its range (see the module docstring)."""
    for field, value, (ok, rule) in _model_rules(info):
        if not ok(value):
            key, given = _from_config(ckpt, field, value)
            raise BadInput(f"{ckpt.root / CONFIG_NAME}: {key} {given!r} {rule}")
    for key, value, (ok, rule) in _config_rules(ckpt):
        if not ok(value):
            raise BadInput(f"{ckpt.root / CONFIG_NAME}: {key} {value!r} {rule}")
