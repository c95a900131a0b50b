"""What the vLLM plugin does for each mxconv backend: one :class:`BackendMapping` a backend.

A mapping says which vLLM MXFP4 MoE backend holds the output's bytes, which parameters of vLLM's MoE
layer receive which stored tensors, and what vLLM's conversion to kernel format
(``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``) must return instead of converting, given the
tensors the loader put in place. A new backend (marlin, triton, ...) is one more object in
:data:`MAPPINGS`; nothing else in the plugin names a backend. torch- and vLLM-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mxconv.errors import BadInput

CONVERTED_ORDER = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_bias", "w2_bias")
"""The order of the six tensors vLLM's conversion to kernel format returns."""


@dataclass(frozen=True)
class BackendMapping:
    """One mxconv backend as vLLM holds it.

    ``vllm_backend``: the ``Mxfp4MoeBackend`` name whose parameters hold exactly the stored bytes.
    ``into_params``: stored tensors copied into vLLM's parameters of the same name, shape and dtype at
    load time. ``kept_aside``: stored tensors whose parameter vLLM replaces during its conversion (the
    CPU backend's biases become float32): held until the conversion step returns them.
    """

    backend: str
    vllm_backend: str
    into_params: tuple[str, ...]
    kept_aside: tuple[str, ...] = ()

    def converted(self, params: dict[str, Any], aside: dict[str, Any]) -> tuple[Any, ...]:
        """The six tensors vLLM's conversion returns (:data:`CONVERTED_ORDER`): the parameters the
        loader filled, and the tensors kept aside; None for a bias the output does not have."""
        out = []
        for name in CONVERTED_ORDER:
            if name in aside:
                out.append(aside[name])
            elif name in self.into_params:
                out.append(params[name])
            else:
                out.append(None)
        return tuple(out)


CPU = BackendMapping(
    backend="cpu",
    vllm_backend="CPU",
    into_params=("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"),
    kept_aside=("w13_bias", "w2_bias"),
)

MAPPINGS: dict[str, BackendMapping] = {m.backend: m for m in (CPU,)}


def mapping_for(backend: str | None, where: str = "") -> BackendMapping:
    """The mapping of mxconv backend ``backend``; BadInput naming the ones the plugin loads."""
    m = MAPPINGS.get(str(backend))
    if m is None:
        raise BadInput(f"{where}mxconv's vLLM plugin does not load {backend} outputs yet (it loads: "
                       f"{', '.join(f'{b} for vLLM {m.vllm_backend}' for b, m in MAPPINGS.items())}); "
                       f"repack the source with --backend {' / '.join(MAPPINGS)}")  # fmt: skip
    return m
