"""The typed options of a verify run (:class:`VerifyOptions`), checked where they are made (the CLI or
a Python caller) and read as they are by the plan and the checks.

Errors name the setting (``VerifyOptions.reference``); the CLI says them in its flags
(:mod:`mxconv.cli.verify`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mxconv.errors import BadInput
from mxconv.experts.kernel_settings import KernelLocations

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class VerifyOptions:
    """What a verify run checks, against what. Without ``reference`` or ``reference_outputs`` the
    numerics do not run (the report's scope says so; ``strict`` fails it then)."""

    reference: str | None = None  # the checkpoint the conversion came from: a directory or a hub repo id
    reference_outputs: str | None = None  # a file of reference outputs saved earlier (save_reference)
    save_reference: str | None = None  # save the reference's layer outputs here (safetensors)
    # MoE layers to check: numbers, or their text ("0,3", checked against the output's layers by the
    # plan: mxconv.verify.plan.chosen_layers); None (or "") for every converted layer
    layers: str | tuple[int, ...] | None = None
    tokens: int = 64  # synthetic tokens per layer
    seed: int = 0  # seed of the synthetic hidden states
    revision: str | None = None  # hub revision of a repo-id reference
    kernel: bool = False  # also run the engine's own kernel on the files
    kernel_locations: KernelLocations | None = None  # where that kernel is, when not installed
    strict: bool = False  # fail unless the numerics (and, with a reference, the expert bytes) were checked
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise BadInput("VerifyOptions.tokens must be >= 1")
        if self.reference and self.reference_outputs:
            raise BadInput("give either VerifyOptions.reference or VerifyOptions.reference_outputs, not both")
        if self.save_reference and not self.reference:
            raise BadInput("VerifyOptions.save_reference needs VerifyOptions.reference (the outputs saved are the reference's)")
        for name in ("reference", "reference_outputs", "save_reference"):  # a Path given: its text
            value = getattr(self, name)
            if isinstance(value, Path):
                object.__setattr__(self, name, str(value))
        if self.layers is not None and not isinstance(self.layers, str):
            try:
                object.__setattr__(self, "layers", tuple(int(n) for n in self.layers))
            except (TypeError, ValueError):
                raise BadInput(f"VerifyOptions.layers must be layer numbers (or a string such as '0,3-5'), "
                               f"got {self.layers!r}") from None
