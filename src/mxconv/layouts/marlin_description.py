"""The keys of a marlin output's manifest ``layout`` that vLLM's Marlin kernel runner
(:mod:`mxconv.engines.marlin_moe`) reads, typed: written by the MXFP4 (:mod:`mxconv.layouts.marlin`) and
MXFP8 (:mod:`mxconv.layouts.marlin_mxfp8`) forms' ``describe()`` from this class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mxconv.layouts.description import LayoutDescription


@dataclass(frozen=True, kw_only=True)
class MarlinDescription(LayoutDescription):
    """``variant``, ``activation`` and ``scale_layout`` of a marlin manifest. An MXFP4 output records no
    variant; an output written before a key existed lacks it. The defaults are what those hold: MXFP4
    weights, bf16 activations and the scale layout of vLLM >= 0.12 ("current")."""

    variant: str = "mxfp4"  # the experts' weight format (written by the MXFP8 form only)
    activation: str = "bf16"  # "bf16" | "fp8" (W4A8-FP8)
    scale_layout: str = "current"  # "current" (vLLM >= 0.12) | "legacy" (vLLM <= 0.11.2)

    reader: ClassVar[str] = "the marlin engine runner"
