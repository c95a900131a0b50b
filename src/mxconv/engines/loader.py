"""Load one MoE layer of a kernel-layout mxconv output straight into the engine's kernel objects.

Public API::

    from mxconv.engines.loader import load_layer
    layer = load_layer("out/", 3)                      # a TP=1 output, or load_layer("out/rank-1", 3)
    y = layer.forward(hidden, topk_ids, topk_weights)  # hidden [T, H] bf16 on the GPU -> [T, H] bf16
    y = layer.forward(hidden, logits=router_logits)    # or route with the engine's own top-k

``load_layer`` reads ``mxconv.json`` (at ``path``, or in the parent of a ``rank-N/`` directory of a
TP output), reads only that layer's expert tensors straight from the files through bounded pinned
staging buffers onto the device (:mod:`mxconv.engines.staged_read`: reads overlap the host-to-device
copies; no re-layout, nothing built in pageable memory) and returns an :class:`EngineLayer` holding
exactly what the engine's kernel takes: the object the backend's
:class:`~mxconv.engines.runner.EngineRunner` (``Layout.engine_runner``) wraps the tensors in, e.g.
triton_kernels ``Tensor``s with their ``PrecisionConfig``s, or Marlin's int32 weights, e8m0 scales
and workspace. :func:`run_kernel_layer` runs every TP rank of one layer and sums them
(``mxconv verify --kernel``).

Needs the kernels and an SM90 GPU (see :mod:`mxconv.engines.discover`); reading alone
(:func:`resolve_layer`, :func:`read_layer_tensors`) works anywhere, CPU included.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxconv.engines.runner import SWIGLU_ALPHA, SWIGLU_LIMIT, EngineRunner, LayerSpec, require_runner
from mxconv.engines.staged_read import StagedReader, StagingOptions, read_tensors
from mxconv.errors import BadInput, OutputDamaged
from mxconv.experts.kernel_settings import KernelLocations
from mxconv.experts.tensors import KERNEL_TENSOR_NAMES
from mxconv.families.base import ModelInfo
from mxconv.source.file_names import MANIFEST_NAME, rank_dir_name
from mxconv.source.manifest import LayoutPart, Manifest, load_manifest, stored_problem, tensor_file
from mxconv.source.st_format import TensorInfo, read_header

EXPERT_TENSORS = KERNEL_TENSOR_NAMES  # biases and W4A8 input scales where the output has them
_RANK_DIR = re.compile(r"^rank-(\d+)$")


@dataclass(frozen=True)
class LayerSource:
    """Where one layer's expert tensors of one rank live. ``files[key]`` / ``names[key]`` for each
    stored kernel tensor ``key`` in :data:`EXPERT_TENSORS` (biases only when the model has them)."""

    root: Path  # the directory holding mxconv.json
    manifest: Manifest
    layer: int
    rank: int
    module_prefix: str
    files: dict[str, Path]
    names: dict[str, str]
    intermediate_size: int  # this rank's share I_r (unpadded)

    @property
    def backend(self) -> str:
        return str(self.manifest.backend)

    @property
    def tp_size(self) -> int:
        return self.manifest.tp_size


def _needs_input_scales(manifest: Manifest) -> bool:
    """Whether the output's activation reads static input scales (W4A8: ``w13_input_scale``, ...)."""
    from mxconv.layouts import get_layout

    return str(manifest.activation) in get_layout(str(manifest.backend)).input_scale_activations


def model_info(manifest: Manifest) -> ModelInfo:
    """The manifest's ``model`` object as a :class:`ModelInfo`."""
    return ModelInfo.from_part(manifest.model)


def _find_root(path: Path, rank: int | None) -> tuple[Path, int | None]:
    """(directory holding mxconv.json, rank) for an output root or one of its rank-N/ directories."""
    if (path / MANIFEST_NAME).is_file():
        return path, rank
    m = _RANK_DIR.match(path.name)
    if m and (path.parent / MANIFEST_NAME).is_file():
        dir_rank = int(m.group(1))
        if rank is not None and rank != dir_rank:
            raise BadInput(f"{path}: is the directory of rank {dir_rank}, but rank={rank} was asked for")
        return path.parent, dir_rank
    raise BadInput(f"{path}: no {MANIFEST_NAME} here or in its parent (not an mxconv kernel-layout output or one of its rank-N/ directories)")


def output_root(path: str | Path, rank: int | None = None) -> tuple[Path, int | None]:
    """(directory holding ``mxconv.json``, rank) for an output root or one of its ``rank-N/``
    directories (the rank of the directory; ``rank`` when given must agree with it)."""
    return _find_root(Path(path).expanduser().resolve(), rank)


def resolve_layer(path: str | Path, layer: int, *, rank: int | None = None, manifest: Manifest | None = None,
                  need_runner: bool = True) -> LayerSource:  # fmt: skip
    """Find layer ``layer``'s expert tensors (of ``rank`` for a TP output) from the manifest.

    ``path`` is an output root (``mxconv.json`` there) or a ``rank-N/`` directory of a TP output.
    BadInput for a canonical checkpoint, a backend without an engine runner (unless ``need_runner``
    is False: an engine integration that runs the engine's own kernel), a TP output without a
    rank, a rank or layer that does not exist, or tensors the manifest does not list.
    """
    root, rank = _find_root(Path(path).expanduser().resolve(), rank)
    m = manifest if manifest is not None else load_manifest(root)
    if not m.is_kernel:
        raise BadInput(f"{root}: a {m.kind} checkpoint; load_layer reads kernel-layout outputs (mxconv repack)")
    if need_runner:
        require_runner(m.backend, where=f"{root}: ")
    tp = m.tp_size
    if tp > 1 and rank is None:
        raise BadInput(f"{root}: a TP output with {tp} ranks; pass rank=0..{tp - 1} or the rank-N/ directory")
    rank = 0 if rank is None else int(rank)
    if not 0 <= rank < tp:
        raise BadInput(f"{root}: rank {rank} does not exist (tp_size {tp}: ranks 0..{tp - 1})")
    entry = m.layer(int(layer))
    if entry is None:
        raise BadInput(f"{root}: no MoE layer {layer} in the manifest (layers: {sorted(m.layer_numbers)})")
    prefix = entry.module_prefix
    key_prefix = f"{rank_dir_name(rank)}/" if tp > 1 else ""
    table = m.tensors
    files: dict[str, Path] = {}
    names: dict[str, str] = {}
    for key in EXPERT_TENSORS:
        name = f"{prefix}.experts.{key}"
        info = table.get(key_prefix + name)
        if info is None:
            if key.endswith("bias") or (key.endswith("input_scale") and not _needs_input_scales(m)):
                continue
            raise BadInput(f"{root}: the manifest lists no {key_prefix}{name}")
        files[key], names[key] = tensor_file(root, m, key_prefix + name), name
    if ("w13_bias" in files) != ("w2_bias" in files):
        raise BadInput(f"{root}: layer {layer} has only one of w13_bias / w2_bias")
    ranges = m.layout.tp_ranges or ((0, m.layout.intermediate_size),)
    if len(ranges) != tp:
        raise BadInput(f"{root}: manifest layout.tp_ranges has {len(ranges)} entries for tp_size {tp}")
    start, end = ranges[rank]
    return LayerSource(root, m, int(layer), rank, prefix, files, names, end - start)


def stored_info(root: Path, manifest: Manifest, key: str, headers: dict[Path, dict[str, TensorInfo]]) -> TensorInfo:
    """Where manifest entry ``key`` of the output at ``root`` lives, from the validated header of the file
    the manifest names (``headers``: a cache of them, filled as files are read), checked as ``mxconv verify``
    checks it (:func:`~mxconv.source.manifest.stored_problem`): OutputDamaged naming the file and the
    tensor where the file is missing or damaged, or does not hold the tensor with the manifest's shape
    and dtype. Headers only: no tensor byte is read."""
    f = tensor_file(root, manifest, key)
    if f not in headers:
        if not f.exists():
            raise OutputDamaged(f"{f}: missing (named by {root / MANIFEST_NAME})")
        try:
            headers[f] = read_header(f)[0]
        except BadInput as exc:
            raise OutputDamaged(str(exc)) from None
    info = headers[f].get(key.split("/", 1)[1] if manifest.tp_size > 1 else key)
    problem = stored_problem(root, manifest, key, info)
    if problem:
        raise OutputDamaged(f"{f}: {problem} (named by {root / MANIFEST_NAME})")
    assert info is not None
    return info


def layer_infos(src: LayerSource, headers: dict[Path, dict[str, TensorInfo]] | None = None) -> dict[str, TensorInfo]:
    """Where each stored expert tensor of ``src`` lives (file, dtype, shape, byte range), from the
    validated headers of its files (``headers``: a cache of them), each checked by :func:`stored_info`."""
    headers = {} if headers is None else headers
    prefix = f"{rank_dir_name(src.rank)}/" if src.tp_size > 1 else ""
    return {key: stored_info(src.root, src.manifest, prefix + src.names[key], headers) for key in src.files}


def layer_hashes(src: LayerSource) -> dict[str, str]:
    """The manifest's sha256 of each stored expert tensor of ``src`` (what ``mxconv verify`` checks)."""
    prefix = f"{rank_dir_name(src.rank)}/" if src.tp_size > 1 else ""
    table = src.manifest.tensors
    return {key: table[prefix + name].sha256 for key, name in src.names.items() if prefix + name in table}


def read_layer_tensors(src: LayerSource, device: str | torch.device = "cuda", *,
                       staging: StagingOptions | None = None, reader: StagedReader | None = None,
                       check_hashes: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """The stored expert tensors of ``src`` (keys of :data:`EXPERT_TENSORS`) on ``device``, dtypes
    and shapes as written, read straight from the files through bounded pinned staging buffers
    (:mod:`mxconv.engines.staged_read`; ``reader``: one kept across layers, else a fresh one with
    ``staging``). ``check_hashes``: each tensor's sha256 against the manifest's."""
    infos = layer_infos(src)
    hashes = layer_hashes(src) if check_hashes else None
    if reader is not None:
        return reader.read(infos, hashes)
    return read_tensors(infos, device, staging, hashes)


@dataclass
class EngineLayer:
    """One rank of one MoE layer, held as the engine's kernel takes it (``experts``), and its forward.

    ``experts`` is what ``runner`` (the backend's engine runner) wrapped ``tensors`` (the stored
    tensors) in.
    """

    backend: str
    layer: int
    rank: int
    tp_size: int
    info: ModelInfo
    experts: Any
    tensors: dict[str, torch.Tensor] = field(repr=False)
    runner: EngineRunner = field(repr=False)
    layout: LayoutPart | None = field(default=None, repr=False)  # the manifest's ``layout``
    rewrap: Callable[[dict[str, torch.Tensor]], Any] | None = field(default=None, repr=False)  # tensors -> experts
    weight_format: str = "mxfp4"  # the manifest's: how the output's experts were quantized ...
    scale_rounding: str | None = None  # ... and by which scale rule (None: MX bytes moved untouched)

    @property
    def device(self) -> torch.device:
        return self.tensors["w13_weight"].device

    def forward(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        *,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's MoE output for ``hidden`` [T, H] (bf16; other floats are cast) on the layer's
        device -> [T, H] bf16 (a TP rank's partial sum: add the ranks' outputs).

        Routing: ``topk_ids`` [T, k] integer + ``topk_weights`` [T, k] float (any family), or router
        ``logits`` [T, E] for the softmax routings (top-k of the logits then softmax, or softmax,
        top-k and renormalisation per the model's ``norm_topk_prob``).
        """
        if hidden.dim() != 2 or hidden.shape[1] != self.info.hidden_size:
            raise BadInput(f"hidden must be [T, {self.info.hidden_size}], got {list(hidden.shape)}")
        x = hidden.to(self.device, torch.bfloat16)
        if topk_ids is None and logits is None:
            raise BadInput("forward: give topk_ids and topk_weights, or logits")
        if topk_ids is not None and topk_weights is None:
            raise BadInput("forward: topk_ids given without topk_weights")
        if topk_ids is not None:
            topk_ids, topk_weights = topk_ids.to(self.device), topk_weights.to(self.device)  # type: ignore[union-attr]
        elif logits is not None:
            logits = logits.to(self.device)
        if logits is not None and topk_ids is None and self.info.routing not in ("topk_softmax", "softmax_topk"):
            raise BadInput(f"forward(logits=...) supports the softmax routings; {self.info.routing!r} needs topk_ids/topk_weights")
        return self.runner.forward(self.experts, x, topk_ids, topk_weights, logits, self.info)


def build_engine_layer(src: LayerSource, tensors: dict[str, torch.Tensor],
                       kernel_locations: KernelLocations | None = None) -> EngineLayer:  # fmt: skip
    """Wrap ``tensors`` (from :func:`read_layer_tensors`, on a CUDA device) for the engine kernel
    of ``src.backend`` through its runner, which finds the kernels (``kernel_locations`` first, then
    the environment and installed copies) and checks the GPU (BadInput otherwise)."""
    m, lay = src.manifest, src.manifest.layout
    info = model_info(m)
    runner = require_runner(src.backend, where=f"{src.root}: ")
    where = f"{src.root} layer {src.layer}" + (f" rank {src.rank}" if src.tp_size > 1 else "")
    spec = LayerSpec(
        where, lay, int(info.num_experts), lay.hidden_size, lay.padded_hidden_size, src.intermediate_size, src.tp_size,
        info.activation, SWIGLU_ALPHA if info.swiglu_alpha is None else float(info.swiglu_alpha),
        SWIGLU_LIMIT if info.swiglu_limit is None else float(info.swiglu_limit), lay.choices_of(src.layer, src.rank),
    )  # fmt: skip

    def rewrap(held: dict[str, torch.Tensor]) -> Any:
        return runner.wrap(held, spec, kernel_locations)

    return EngineLayer(src.backend, src.layer, src.rank, src.tp_size, info, rewrap(tensors), tensors, runner,
                       lay, rewrap, m.weight_format, m.scale_rounding)  # fmt: skip


def load_layer(path: str | Path, layer: int, *, device: str | torch.device = "cuda", rank: int | None = None,
               kernel_locations: KernelLocations | None = None) -> EngineLayer:  # fmt: skip
    """Read layer ``layer`` of the kernel-layout output at ``path`` (root or ``rank-N/``) onto
    ``device`` and wrap it for the engine kernel, found at ``kernel_locations`` where given. See the
    module docstring."""
    src = resolve_layer(path, layer, rank=rank)
    require_runner(src.backend).check_device(device)
    return build_engine_layer(src, read_layer_tensors(src, device), kernel_locations)


def load_layer_from_manifest(root: str | Path, manifest: Manifest, layer: int, *, rank: int | None = None,
                             device: str | torch.device = "cuda", kernel_locations: KernelLocations | None = None,
                             held: dict[str, HeldTensor] | None = None) -> EngineLayer:  # fmt: skip
    """:func:`load_layer` with the manifest already read (``root`` is the directory holding it);
    ``held``: the layer's tensors already read, wrapped instead of read again where they are the
    ones the manifest names (:func:`held_layer_tensors`)."""
    src = resolve_layer(root, layer, rank=rank, manifest=manifest)
    require_runner(src.backend).check_device(device)
    tensors = held_layer_tensors(src, held, device) if held is not None else None
    return build_engine_layer(src, read_layer_tensors(src, device) if tensors is None else tensors, kernel_locations)


@dataclass(frozen=True)
class HeldTensor:
    """A stored expert tensor its caller has read already (``mxconv verify`` reads every layer
    once): the file and tensor name it was read from, and its bytes as stored (any device)."""

    file: Path
    name: str
    tensor: torch.Tensor


def held_layer_tensors(src: LayerSource, held: dict[str, HeldTensor],
                       device: str | torch.device) -> dict[str, torch.Tensor] | None:  # fmt: skip
    """``held`` as :func:`read_layer_tensors` would read ``src`` onto ``device`` (the same keys, from
    the same files and tensor names: the same bytes), or None where they differ and the layer must
    be read from its files."""
    if set(held) != set(src.files) or any(h.file != src.files[k] or h.name != src.names[k] for k, h in held.items()):
        return None
    return {k: h.tensor.to(device) for k, h in held.items()}


def run_kernel_layer(root: Path, manifest: Manifest, layer: int, hidden: torch.Tensor, routing: Any,
                     info: ModelInfo | None = None, kernel_locations: KernelLocations | None = None,
                     held: list[dict[str, HeldTensor]] | None = None) -> torch.Tensor:  # fmt: skip
    """The engine kernel's MoE output for one layer of the kernel-layout output at ``root``.

    ``hidden`` [T, H] fp32 (any device; run as bf16 on the runner's device); ``routing`` has ``ids`` [T, k]
    and ``weights`` [T, k] (e.g. :class:`mxconv.verify.reference_moe.Routing`) or is router logits [T, E];
    ``info`` (default: the manifest's model) gives activation and routing kind. TP outputs: every
    rank is loaded and run in turn and the partial outputs are summed. ``held`` (one dict per rank):
    the layer's tensors already read, wrapped instead of reading them again where they are the
    ones the manifest names (:func:`held_layer_tensors`). Returns [T, H] fp32 on ``hidden``'s
    device. BadInput when the kernel cannot run (see :func:`mxconv.engines.runner.kernel_unavailable`).
    """
    device = require_runner(manifest.backend).device
    tp = manifest.tp_size
    total: torch.Tensor | None = None
    for rank in range(tp):
        eng = load_layer_from_manifest(root, manifest, layer, rank=rank if tp > 1 else None, device=device,
                                       kernel_locations=kernel_locations,
                                       held=held[rank] if held is not None and len(held) == tp else None)  # fmt: skip
        if info is not None:
            eng.info = info
        if isinstance(routing, torch.Tensor):
            y = eng.forward(hidden, logits=routing)
        else:
            y = eng.forward(hidden, routing.ids, routing.weights)
        total = y.float() if total is None else total + y.float()
        del eng
    assert total is not None
    return total.to(hidden.device)
