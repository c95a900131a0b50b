"""A whole backend in one test-side file: a layout (:class:`ToyLayout`) and its engine runner
(:class:`ToyRunner`), registered at run time with :func:`mxconv.layouts.register_layout`.

Nothing in the package names "toy"; ``repack --backend toy``, its help, ``inspect`` (the backend table and
``--engine``), ``verify``, ``verify --kernel`` and the architecture checks reach it through the registry
alone (tests/test_extension.py). The "engine" is a CPU
MoE on the padded, row-reversed bytes as stored, so ``verify --kernel`` runs without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.padding import pad_canonical, unpad_canonical
from mxconv.experts.stack import CanonicalExperts, LayoutSizes, round_up
from mxconv.experts.tensors import KernelTensors, TensorSpec
from mxconv.layouts.base import LayoutBase, LayoutOption
from mxconv.engines.runner import LayerSpec
from mxconv.source.manifest import LayoutPart
from mxconv.mx.numerics import dequantize_mx
from mxconv.verify.reference_moe import Routing, moe_forward

TOY_ALIGN = 64  # H and I are padded to multiples of this


def _flip(t: torch.Tensor | None, reverse: bool) -> torch.Tensor | None:
    """``t`` [E, rows, ...] with its rows reversed (``reverse``), else as is."""
    return None if t is None else (t.flip(1).contiguous() if reverse else t)


class ToyLayout(LayoutBase):
    """Pads H and I to multiples of 64 and (option ``reverse``) reverses every expert's rows."""

    name = "toy"
    version = 1
    activations = ("bf16",)
    options = (LayoutOption("reverse", bool, True, "reverse the rows of every tensor"),)
    engine_runner = "support.toy_backend:RUNNER"
    # A declaration for the tests (vLLM runs no toy bytes): the vLLM backend said to hold its bf16 output,
    # which puts it in ``inspect --engine``'s table beside the real layouts holding TRITON.
    vllm_backends = {"bf16": ("TRITON",)}

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: Any = None, *, weight_format: str = "mxfp4") -> tuple[int, int]:  # fmt: skip
        self.check_weight_format(weight_format)
        self.check_activation(activation)
        if hidden_size % 32 or intermediate_size % 32:
            raise LayoutError("toy: sizes must be multiples of 32")
        return round_up(hidden_size, TOY_ALIGN), round_up(intermediate_size, TOY_ALIGN)

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, TensorSpec]:
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

    def to_kernel(self, c: CanonicalExperts, activation: str, options: Any,
                  kernel_choice: KernelChoice = KernelChoice.AUTO) -> KernelTensors:
        Hp, Ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation)
        p = pad_canonical(c, Hp, Ip)
        out = {"w13_weight": p.w13, "w13_weight_scale": p.w13_scale, "w2_weight": p.w2, "w2_weight_scale": p.w2_scale,
               "w13_bias": p.w13_bias, "w2_bias": p.w2_bias}  # fmt: skip
        rev = options.reverse
        return {k: _flip(v if "bias" not in k else v.float(), rev) for k, v in out.items() if v is not None}

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: Any) -> CanonicalExperts:
        g = {name: _flip(t, options.reverse) for name, t in k.items()}
        padded = CanonicalExperts(g["w13_weight"], g["w13_weight_scale"], g["w2_weight"], g["w2_weight_scale"],
                                  g.get("w13_bias"), g.get("w2_bias"), sizes.row_order)  # fmt: skip
        return unpad_canonical(padded, sizes.hidden_size, sizes.intermediate_size)

    def describe(self, sizes: LayoutSizes, activation: str, options: Any) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "engine_compat": {"toy-engine": ">=1"},
                "activation": activation, "reverse": options.reverse}  # fmt: skip


class ToyRunner:
    """The toy engine: a CPU MoE straight on the stored (padded, maybe reversed) bytes."""

    device = "cpu"
    what = "the toy CPU MoE"

    def check_device(self, device: Any) -> None:
        pass

    def kernel_unavailable(self, layout: LayoutPart, device: Any, kernel_locations: Any = None) -> str | None:
        return None

    def wrap(self, tensors: dict[str, torch.Tensor], spec: LayerSpec, kernel_locations: Any = None) -> dict[str, Any]:
        """The stored tensors with rows back in canonical (padded) order: {name: tensor, "hidden_size": H}."""
        reverse = bool(spec.layout.option_values["reverse"])
        held: dict[str, Any] = {name: _flip(t, reverse) for name, t in tensors.items()}
        held["hidden_size"] = spec.hidden_size
        return held

    def forward(self, experts: dict[str, Any], x: torch.Tensor, topk_ids: torch.Tensor | None,
                topk_weights: torch.Tensor | None, logits: torch.Tensor | None, info: Any) -> torch.Tensor:  # fmt: skip
        """MoE output [T, H] bf16 of ``x`` [T, H] for the given top-k (this toy takes no logits)."""
        if topk_ids is None or topk_weights is None:
            raise LayoutError("the toy engine routes by top-k ids and weights only")
        w13 = dequantize_mx(experts["w13_weight"], experts["w13_weight_scale"], "mxfp4")
        w2 = dequantize_mx(experts["w2_weight"], experts["w2_weight_scale"], "mxfp4")
        b13, b2 = experts.get("w13_bias"), experts.get("w2_bias")
        hp = w2.shape[1]
        xp = torch.nn.functional.pad(x.float(), (0, hp - x.shape[1]))

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            return w13[e], w2[e], None if b13 is None else b13[e].float(), None if b2 is None else b2[e].float()

        routing = Routing(topk_ids.long(), topk_weights.float())
        out = moe_forward(xp, routing, expert, w13.shape[0], info, info.row_order)
        return out[:, : experts["hidden_size"]].to(torch.bfloat16)


RUNNER = ToyRunner()
