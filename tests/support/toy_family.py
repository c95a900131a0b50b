"""A whole model family in one test-side file: :class:`ToyReader`, registered at run time with
:func:`mxconv.families.register_family`, and :func:`rename_to_toy`, which writes a checkpoint of it.

The family keeps its experts under ``layers.L.ffn.experts.e.{wg,wu,wd}.weight`` and its router at
``layers.L.ffn.router``; nothing in the package names it (tests/test_extension.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from mxconv.families.per_expert import PerExpertReader


class ToyReader(PerExpertReader):
    """A family that keeps its experts under ``layers.L.ffn.experts.e.{wg,wu,wd}.weight``."""

    name = "toy-moe"
    title = "Toy-MoE"
    moe_module = "ffn"
    proj_names = ("wg", "wu", "wd")
    router_module = "router"
    model_types = frozenset({"toy_moe"})
    ignore_patterns = ("lm_head", r"re:.*embed_tokens$", r"re:.*self_attn\..*", r"re:.*\.ffn\.router$")

    def routing_fields(self) -> dict[str, Any]:
        return {"routing": "softmax_topk", "norm_topk_prob": True}


def rename_to_toy(src: Path, dst: Path) -> None:
    """The Qwen3-MoE checkpoint at ``src`` rewritten at ``dst`` under the toy family's config and
    tensor names (same tensors, same bytes)."""
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type="toy_moe", architectures=["ToyMoeForCausalLM"])
    (dst / "config.json").write_text(json.dumps(cfg))

    def rename(n: str) -> str:
        n = n.replace(".mlp.gate.", ".ffn.router.").replace(".mlp.experts.", ".ffn.experts.")
        return n.replace(".gate_proj.", ".wg.").replace(".up_proj.", ".wu.").replace(".down_proj.", ".wd.")

    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    for shard in sorted(set(index["weight_map"].values())):
        save_file({rename(k): v for k, v in load_file(src / shard).items()}, dst / shard)
