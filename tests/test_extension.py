"""A new backend and a new family are each one definition plus one registry call.

The toy backend and the toy family below live only in this file: nothing else in the package is
edited for them, yet repack, inspect, verify and quantize handle them end to end (the checklists in
docs/architecture.md rely on this).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxconv.errors import LayoutError
from mxconv.families import register_family, unregister_family
from mxconv.families.per_expert import PerExpertReader
from mxconv.layouts import backend_names, get_layout, register_layout, unregister_layout
from mxconv.layouts.base import (
    CanonicalExperts,
    KernelTensors,
    LayoutBase,
    LayoutOption,
    LayoutSizes,
    TensorSpec,
    pad_canonical,
    round_up,
    unpad_canonical,
)
import support.cli
from support.checkpoints import make_checkpoint


class ToyLayout(LayoutBase):
    """Pads H and I to multiples of 64 and (option ``reverse``) reverses every expert's rows."""

    name = "toy"
    version = 1
    activations = ("bf16",)
    options = (LayoutOption("reverse", bool, True, "reverse the rows of every tensor"),)

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: dict[str, Any] | None = None) -> tuple[int, int]:
        self.check_activation(activation)
        if hidden_size % 32 or intermediate_size % 32:
            raise LayoutError("toy: sizes must be multiples of 32")
        return round_up(hidden_size, 64), round_up(intermediate_size, 64)

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: dict[str, Any]) -> dict[str, TensorSpec]:
        E, Hp, Ip = sizes.num_experts, sizes.padded_hidden_size, sizes.padded_intermediate_size
        specs = {
            "w13_weight": TensorSpec((E, 2 * Ip, Hp // 2), torch.uint8),
            "w13_weight_scale": TensorSpec((E, 2 * Ip, Hp // 32), torch.uint8),
            "w2_weight": TensorSpec((E, Hp, Ip // 2), torch.uint8),
            "w2_weight_scale": TensorSpec((E, Hp, Ip // 32), torch.uint8),
        }
        if sizes.has_bias:
            specs["w13_bias"] = TensorSpec((E, 2 * Ip), torch.float32)
            specs["w2_bias"] = TensorSpec((E, Hp), torch.float32)
        return specs

    @staticmethod
    def _flip(t: torch.Tensor | None, reverse: bool) -> torch.Tensor | None:
        return None if t is None else (t.flip(1).contiguous() if reverse else t)

    def to_kernel(self, c: CanonicalExperts, activation: str, options: dict[str, Any]) -> KernelTensors:
        Hp, Ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation)
        p = pad_canonical(c, Hp, Ip)
        rev = options["reverse"]
        out = {"w13_weight": p.w13, "w13_weight_scale": p.w13_scale, "w2_weight": p.w2, "w2_weight_scale": p.w2_scale,
               "w13_bias": p.w13_bias, "w2_bias": p.w2_bias}
        return {k: self._flip(v if "bias" not in k else v.float(), rev) for k, v in out.items() if v is not None}

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: dict[str, Any]) -> CanonicalExperts:
        rev = options["reverse"]
        g = {name: self._flip(t, rev) for name, t in k.items()}
        padded = CanonicalExperts(g["w13_weight"], g["w13_weight_scale"], g["w2_weight"], g["w2_weight_scale"],
                                  g.get("w13_bias"), g.get("w2_bias"), sizes.row_order)
        return unpad_canonical(padded, sizes.hidden_size, sizes.intermediate_size)

    def describe(self, sizes: LayoutSizes, activation: str, options: dict[str, Any]) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "engine_compat": {"toy-engine": ">=1"},
                "activation": activation, "reverse": options["reverse"]}


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


def mx(*args: Any) -> tuple[int, str, str]:
    return support.cli.mx(*args, env={"COLUMNS": "200"})


@pytest.fixture
def toy_backend():
    register_layout("toy", ToyLayout())
    yield
    unregister_layout("toy")


@pytest.fixture
def toy_family():
    register_family("toy-moe", ToyReader)
    yield
    unregister_family("toy-moe")


def test_a_backend_defined_here_round_trips_through_repack_and_verify(toy_backend, tmp_path: Path) -> None:
    assert "toy" in backend_names() and isinstance(get_layout("toy"), ToyLayout)
    src = make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4", hidden_size=96, intermediate_size=96).path
    out = tmp_path / "k"
    # the --backend choice list of the CLI was built when the CLI was imported; the API sees "toy"
    from mxconv.run.conversion import Conversion, RunSettings
    from mxconv.run.options import QuantOptions, RepackOptions
    from mxconv.verify import verify

    conversion = Conversion.open(src, QuantOptions(), RepackOptions("toy", "bf16", 2, {"reverse": "false"}))
    conversion.run(out, device=torch.device("cpu"), settings=RunSettings(1 << 30, False))
    m = json.loads((out / "mxconv.json").read_text())
    assert m["backend"] == "toy" and m["layout"]["options"] == {"reverse": False} and m["layout"]["reverse"] is False
    rep = verify(out, reference=str(src), tokens=8)
    assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
    assert all(r.layout == "bit-exact" for r in rep.layers)
    code, stdout, _ = mx("inspect", src, "--json")
    assert code == 0 and any(b["backend"] == "toy" for b in json.loads(stdout)["backends"])


def test_layout_options_are_typed_and_validated(toy_backend) -> None:
    toy = get_layout("toy")
    assert toy.resolve_options() == {"reverse": True}
    assert toy.resolve_options({"reverse": "no"}) == {"reverse": False}
    with pytest.raises(LayoutError, match="expected true or false"):
        toy.resolve_options({"reverse": "maybe"})
    with pytest.raises(LayoutError, match="has no option colour"):
        toy.resolve_options({"colour": "red"})
    trt = get_layout("trtllm")
    assert trt.resolve_options({"intermediate_align": "128"}) == {"intermediate_align": 128}
    with pytest.raises(LayoutError, match="positive multiple of 128"):
        trt.resolve_options({"intermediate_align": "96"})
    with pytest.raises(LayoutError, match="expected a whole number"):
        trt.resolve_options({"intermediate_align": "lots"})


def test_layout_option_flag_on_the_cli(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4", hidden_size=96, intermediate_size=96).path
    code, _, err = mx("repack", src, tmp_path / "a", "--backend", "trtllm", "--layout-option", "intermediate_align=96")
    assert code == 2 and "intermediate_align=96" in err and "multiple of 128" in err
    code, _, err = mx("repack", src, tmp_path / "b", "--backend", "trtllm", "--layout-option", "colour")
    assert code == 2 and "expected NAME=VALUE" in err
    code, _, err = mx("repack", src, tmp_path / "c", "--backend", "marlin", "--layout-option", "intermediate_align=128")
    assert code == 2 and "has no option intermediate_align" in err and "marlin_scale_layout" in err
    code, _, err = mx("repack", src, tmp_path / "d", "--backend", "trtllm", "--layout-option", "intermediate_align=256", "--quiet")
    assert code == 0, err
    m = json.loads((tmp_path / "d" / "mxconv.json").read_text())  # I = 96: 256 here, 128 by default
    assert m["layout"]["options"] == {"intermediate_align": 256} and m["layout"]["padded_intermediate_size"] == 256
    code, stdout, _ = mx("repack", "--help")
    assert code == 0 and "intermediate_align" in stdout and "marlin_scale_layout" in stdout


def _rename_to_toy(src: Path, dst: Path) -> None:
    """A Qwen3-MoE checkpoint rewritten under the toy family's config and tensor names."""
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


def test_a_family_defined_here_is_detected_quantized_and_verified(toy_family, tmp_path: Path) -> None:
    qwen = make_checkpoint(tmp_path / "qwen", "qwen3-moe").path
    toy = tmp_path / "toy"
    _rename_to_toy(qwen, toy)
    code, stdout, err = mx("inspect", toy, "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["family"] == "toy-moe" and doc["model"]["num_experts"] == 4 and doc["model"]["routing"] == "softmax_topk"
    code, _, err = mx("quantize", toy, tmp_path / "q4", "--quiet", "--device", "cpu")
    assert code == 0, err
    code, _, err = mx("verify", tmp_path / "q4", "--reference", toy, "--tokens", "16")
    assert code == 0, err
    code, _, err = mx("repack", tmp_path / "q4", tmp_path / "k", "--backend", "marlin", "--quiet", "--device", "cpu")
    assert code == 0, err
    code, _, err = mx("verify", tmp_path / "k", "--reference", tmp_path / "q4", "--tokens", "16")
    assert code == 0, err


def test_without_its_registry_line_the_toy_family_is_unknown(tmp_path: Path) -> None:
    qwen = make_checkpoint(tmp_path / "qwen", "qwen3-moe").path
    _rename_to_toy(qwen, tmp_path / "toy")
    code, _, err = mx("inspect", tmp_path / "toy")
    assert code == 2 and "unknown model family" in err and "toy_moe" in err
