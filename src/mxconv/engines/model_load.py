"""Load every MoE layer of a kernel-layout output onto one device: the whole-model loader.

Public API::

    from mxconv.engines.model_load import load_model, stderr_progress
    model = load_model("out/", device="cuda", on_progress=stderr_progress())   # rank=1 for a TP output
    y = model.layers[3].forward(hidden, topk_ids, topk_weights)

One :class:`~mxconv.engines.staged_read.StagedReader` serves all layers, so the host memory of the
whole load is its staging buffers (``staging.host_bytes``, 256 MiB by default) and the GPU memory is
the resident expert tensors (staging is host memory). Where the backend's engine runner runs on the
device (an SM90 GPU with the kernels for triton / marlin) each layer is wrapped for the engine
(:class:`~mxconv.engines.loader.EngineLayer`); elsewhere (``device="cpu"``) the layers are the stored
tensors themselves, ``{name: tensor}``. ``check_hashes=True`` checks each tensor's sha256 against the
manifest as its bytes pass (off by default: the hash costs more than the read from page cache).

Progress goes to a callback (:class:`LoadProgress` after each layer); :func:`stderr_progress` makes
one that prints to stderr (a line rewritten in place on a terminal, one line a layer otherwise).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from mxconv.engines.loader import (
    EngineLayer,
    build_engine_layer,
    layer_hashes,
    layer_infos,
    output_root,
    resolve_layer,
)
from mxconv.engines.runner import require_runner
from mxconv.engines.staged_read import StagedReader, StagingOptions
from mxconv.errors import BadInput
from mxconv.experts.kernel_settings import KernelLocations
from mxconv.source.manifest import Manifest, load_manifest
from mxconv.source.st_format import TensorInfo


@dataclass(frozen=True)
class LoadProgress:
    """After layer ``layer`` (the ``done``-th of ``total``): bytes read so far of ``bytes_total``."""

    layer: int
    done: int
    total: int
    bytes_done: int
    bytes_total: int
    seconds: float


@dataclass
class LoadedModel:
    """What :func:`load_model` returns: ``layers[i]`` an :class:`EngineLayer` (engine objects) or,
    where the engine runner does not run on ``device``, the stored tensors ``{name: tensor}``."""

    root: Path
    backend: str
    rank: int
    tp_size: int
    device: torch.device
    layers: dict[int, EngineLayer | dict[str, torch.Tensor]] = field(repr=False)
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def wrapped(self) -> bool:
        """True when the layers are engine objects."""
        return any(isinstance(v, EngineLayer) for v in self.layers.values())


def _wraps_on(runner: Any, device: torch.device) -> bool:
    """Whether the engine runner runs on ``device`` (its kind: cuda for the Hopper kernels)."""
    return torch.device(runner.device).type == device.type


def _layer_list(manifest: Manifest, layers: Any, root: Path) -> list[int]:
    have = sorted(manifest.layer_numbers)
    if layers is None:
        return have
    wanted = [int(i) for i in layers]
    missing = sorted(set(wanted) - set(have))
    if missing:
        raise BadInput(f"{root}: no MoE layer {missing} in the manifest (layers: {have})")
    return wanted


def load_model(path: str | Path, *, device: str | torch.device = "cuda", layers: Any = None, rank: int | None = None,
               check_hashes: bool = False, staging: StagingOptions | None = None,
               on_progress: Callable[[LoadProgress], None] | None = None,
               kernel_locations: KernelLocations | None = None) -> LoadedModel:  # fmt: skip
    """Every MoE layer (or ``layers``, an iterable of layer indices) of the kernel-layout output at
    ``path`` (its root, or a ``rank-N/`` directory of a TP output; ``rank`` for the root of one) on
    ``device``. See the module docstring. BadInput for what :func:`~mxconv.engines.loader.resolve_layer`
    refuses, a layer the manifest lacks, a truncated shard or a hash mismatch (naming file and tensor)."""
    t0 = time.perf_counter()
    dev = torch.device(device)
    root, rank = output_root(path, rank)
    manifest = load_manifest(root)
    first = resolve_layer(root, manifest.layers[0].layer, rank=rank, manifest=manifest)  # validated: never empty
    runner = require_runner(first.backend, where=f"{root}: ")
    wrap = _wraps_on(runner, dev)
    if wrap:
        runner.check_device(dev)
    order = _layer_list(manifest, layers, root)
    headers: dict[Path, dict[str, TensorInfo]] = {}
    sources = [resolve_layer(root, i, rank=first.rank if first.tp_size > 1 else None, manifest=manifest) for i in order]
    infos = [layer_infos(src, headers) for src in sources]
    total = sum(i.nbytes for layer in infos for i in layer.values())
    model = LoadedModel(root, first.backend, first.rank, first.tp_size, dev, {})
    with StagedReader(dev, staging) as reader:
        for n, (src, info) in enumerate(zip(sources, infos), 1):
            tensors = reader.read(info, layer_hashes(src) if check_hashes else None)
            model.layers[src.layer] = build_engine_layer(src, tensors, kernel_locations) if wrap else tensors
            if on_progress is not None:
                on_progress(LoadProgress(src.layer, n, len(sources), reader.bytes_read, total, time.perf_counter() - t0))
        model.bytes_read = reader.bytes_read
    model.seconds = time.perf_counter() - t0
    return model


def stderr_progress(stream: TextIO | None = None) -> Callable[[LoadProgress], None]:
    """A progress callback for :func:`load_model`: on a terminal one line rewritten in place, else one
    plain line a layer (``loaded layer 3 (4/36): 6.80 of 61.3 GB, 1.2 s``)."""
    out = stream if stream is not None else sys.stderr
    tty = bool(getattr(out, "isatty", lambda: False)())

    def report(p: LoadProgress) -> None:
        line = (f"loaded layer {p.layer} ({p.done}/{p.total}): {p.bytes_done / 1e9:.2f} of "
                f"{p.bytes_total / 1e9:.2f} GB, {p.seconds:.1f} s")  # fmt: skip
        if tty:
            out.write("\r" + line + ("\n" if p.done == p.total else ""))
        else:
            out.write(line + "\n")
        out.flush()

    return report
