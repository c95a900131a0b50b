"""What one verify run opens and what its checks record as they go, beside the frozen plan it follows."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from mxconv.families.base import FamilyReader, ModelInfo, MoELayerRef
from mxconv.source.checkpoint import Checkpoint
from mxconv.verify.hashing import TensorHashes
from mxconv.verify.plan import VerifyPlan


@dataclass
class VerifyState:
    """One verify run in progress: its :class:`~mxconv.verify.plan.VerifyPlan`, the reference and the
    output's own reader as opened, and what the checks found that later ones (and the report) read."""

    plan: VerifyPlan
    hashes: TensorHashes | None = None  # the sha256 checks (the layer reads record their digests)
    # VerifyOptions.reference, opened
    ref_ckpt: Checkpoint | None = None
    ref_reader: FamilyReader | None = None
    ref_info: ModelInfo | None = None  # the reference's model
    saved: dict[str, torch.Tensor] | None = None  # VerifyOptions.reference_outputs, loaded
    to_save: dict[str, torch.Tensor] = field(default_factory=dict)  # for VerifyOptions.save_reference
    # canonical outputs: the output read back by its family reader (or why it does not read back)
    own_reader: FamilyReader | None = None
    own_refs: dict[int, MoELayerRef] = field(default_factory=dict)
    own_error: str | None = None
    model_broken: bool = False  # the manifest's model claims do not hold: the numerics do not run on them
    bytes_refused: dict[str, list[int]] = field(default_factory=dict)  # why expert bytes were not re-derived -> layers
    ref_copies: dict[str, Future[str]] | None = None  # sha256 futures of the reference tensors the output copied
    ref_missing: list[str] = field(default_factory=list)  # tensors the output copied that the reference lacks
