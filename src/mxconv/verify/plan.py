"""Planning a verify run from the manifest, the headers and the options, before any tensor is read.

A :class:`VerifyPlan` holds the output (its directory, manifest, one checkpoint per TP rank, the
model), the options, the layers to check and, for ``VerifyOptions.kernel``, the engine kernel that
runs on them; it does not change afterwards. What the checks find as they go is the
:class:`~mxconv.verify.state.VerifyState`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mxconv.errors import BadInput, Unsupported
from mxconv.families.base import ModelInfo
from mxconv.layouts import backend_names
from mxconv.layouts.base import Layout
from mxconv.source.checkpoint import Checkpoint, open_checkpoint
from mxconv.source.file_names import rank_dirs
from mxconv.source.manifest import LayerEntry, Manifest, check_own_paths
from mxconv.verify.kernel import kernel_preflight
from mxconv.verify.options import VerifyOptions

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KernelCheck:
    """``VerifyOptions.kernel``: the layout whose engine kernel runs, and the sizes that make the
    kernel compute wrongly (then every layer's kernel check fails, naming them, and nothing runs)."""

    layout: Layout
    size_problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class VerifyPlan:
    """Everything a verify run checks, from headers and options only (:meth:`build`)."""

    root: Path
    manifest: Manifest
    ckpts: tuple[Checkpoint, ...]  # one per TP rank
    info: ModelInfo  # the manifest's model
    options: VerifyOptions
    layers: tuple[int, ...]  # the MoE layers checked, ascending
    kernel: KernelCheck | None = None

    @classmethod
    def build(cls, root: Path, manifest: Manifest, ckpts: tuple[Checkpoint, ...], options: VerifyOptions) -> VerifyPlan:
        """The plan of verifying the output at ``root`` (its manifest and rank checkpoints opened by
        :func:`open_output`) with ``options``. BadInput for layers the output has not, or an engine
        kernel that cannot run here."""
        entries = {entry.layer: entry for entry in manifest.layers}
        layers = tuple(sorted(set(chosen_layers(options.layers, sorted(entries)))))
        kernel = None
        if options.kernel:
            layout, size_problems = kernel_preflight(manifest, options.kernel_locations)
            kernel = KernelCheck(layout, tuple(size_problems))
        return cls(root, manifest, ckpts, ModelInfo.from_part(manifest.model), options, layers, kernel)

    @property
    def kind(self) -> str:
        return self.manifest.kind

    @property
    def weight_format(self) -> str:
        return self.manifest.weight_format

    @property
    def device(self) -> torch.device | str:
        return self.options.device

    @property
    def tokens(self) -> int:
        return self.options.tokens

    @property
    def seed(self) -> int:
        return self.options.seed

    @property
    def entries(self) -> dict[int, LayerEntry]:
        """The manifest's entry of each checked layer."""
        by_layer = {entry.layer: entry for entry in self.manifest.layers}
        return {L: by_layer[L] for L in self.layers}

    @property
    def limited(self) -> list[int] | None:
        """The checked layers where ``VerifyOptions.layers`` chose them; None: every layer."""
        return list(self.layers) if self.options.layers else None


def chosen_layers(spec: str | tuple[int, ...] | None, available: list[int]) -> list[int]:
    """``VerifyOptions.layers`` as layer numbers, each a converted MoE layer of the output."""
    if not spec:
        return available
    if isinstance(spec, str):
        try:
            want = [int(s) for s in spec.split(",") if s.strip()]
        except ValueError:
            raise BadInput(f"VerifyOptions.layers {spec!r}: expected comma-separated layer numbers, e.g. 0,3") from None
    else:
        want = list(spec)
    if not want:
        raise BadInput(f"VerifyOptions.layers {spec!r}: names no layer (available: {available})")
    missing = [w for w in want if w not in available]
    if missing:
        raise BadInput(f"VerifyOptions.layers: {missing} are not converted MoE layers (available: {available})")
    return want


def open_output(root: Path, manifest: Manifest) -> tuple[Checkpoint, ...]:
    """The output's checkpoints (one per TP rank), its files checked against its manifest: BadInput
    (the output's damage) for a linked or missing rank directory or shard; Unsupported for a backend
    this process does not know."""
    if manifest.is_kernel and manifest.backend not in backend_names():  # a plug-in not registered here
        raise Unsupported(f"{root / 'mxconv.json'}: backend {manifest.backend!r} is not one this mxconv knows "
                          f"({', '.join(backend_names())}); a newer mxconv, or a plug-in backend not registered in this process?")
    tp = manifest.tp_size
    check_own_paths(root, manifest)  # a linked rank directory or shard: damage, before anything is read through it
    dirs = rank_dirs(root, tp)
    for d in dirs:
        if not d.is_dir():
            raise BadInput(f"{d}: missing (manifest says tp_size {tp})")
    ckpts = tuple(open_checkpoint(d) for d in dirs)
    ModelInfo.from_part(manifest.model)  # the manifest's model table reads as a model: damage otherwise
    return ckpts
