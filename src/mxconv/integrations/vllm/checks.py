"""Checks the vLLM plugin runs before any expert byte is read: the output's manifest against what vLLM
decided on this machine. Each mismatch is a :class:`~mxconv.errors.BadInput` that says what to repack
to (or how to start vLLM instead). Plain values in, no vLLM import: ``version`` is vLLM's version
string, ``selected`` the ``Mxfp4MoeBackend`` name vLLM picked, shapes are tuples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mxconv.errors import BadInput
from mxconv.integrations.vllm.mappings import MAPPINGS, BackendMapping, mapping_for
from mxconv.layouts.description import ServingDescription
from mxconv.output.engine_quant_config import recorded_not_served
from mxconv.source.file_names import MANIFEST_NAME, output_path
from mxconv.source.manifest import Manifest

SUPPORTED_FAMILIES = ("gpt_oss",)  # vLLM model types whose MoE method the plugin wraps
WEIGHT_FORMATS = ("mxfp4",)  # manifest weight_format values that method (GptOssMxfp4MoEMethod) loads


def _repack_hint(vllm_backend: str) -> str:
    """The repack command that writes what vLLM backend ``vllm_backend`` holds, if mxconv has one."""
    names = [b for b, m in MAPPINGS.items() if m.vllm_backend == vllm_backend]
    return f"repack the source (mxconv repack SOURCE OUTPUT --backend {names[0]})" if names else (
        f"mxconv's vLLM plugin loads no output for vLLM's {vllm_backend} backend yet")


def check_version(manifest: Manifest, version: str, root: Path) -> None:
    """vLLM ``version`` must satisfy the layout's ``engine_compat.vllm`` (a PEP 440 specifier set)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    spec = str(manifest.layout.engine_compat.get("vllm") or "")
    try:
        ok = not spec or SpecifierSet(spec).contains(Version(Version(version).base_version), prereleases=True)
    except (InvalidSpecifier, InvalidVersion) as exc:
        raise BadInput(f"{root}/mxconv.json: layout.engine_compat.vllm {spec!r} or vLLM version {version!r} "
                       f"is not a version rule ({exc})") from None  # fmt: skip
    if not ok:
        raise BadInput(f"{root}: written for vLLM {spec} (layout.engine_compat.vllm in mxconv.json), and this is "
                       f"vLLM {version}: install a vLLM that matches, or repack the source with an mxconv "
                       f"release whose {manifest.backend} layout supports vLLM {version}")  # fmt: skip


def check_weight_format(manifest: Manifest, root: Path) -> None:
    """Experts in a format the plugin's vLLM method loads: it wraps vLLM's gpt-oss MXFP4 method
    (``GptOssMxfp4MoEMethod``), whose parameters hold MXFP4 only."""
    if manifest.weight_format not in WEIGHT_FORMATS:
        raise BadInput(f"{root}: holds {manifest.weight_format} experts (weight_format in mxconv.json); mxconv's vLLM "
                       f"plugin loads them through vLLM's gpt-oss MXFP4 MoE method, which takes "
                       f"{', '.join(WEIGHT_FORMATS)} only: repack an MXFP4 checkpoint (mxconv quantize --format mxfp4, "
                       f"then mxconv repack)")  # fmt: skip


def check_model(manifest: Manifest, model_type: str | None, root: Path) -> BackendMapping:
    """A kernel-layout output of a family, weight format and backend the plugin loads; returns the
    backend's mapping."""
    if not manifest.is_kernel:
        raise BadInput(f"{root}: a {manifest.kind} checkpoint, not a kernel-layout output (mxconv repack); "
                       "load it with vLLM's default load format")  # fmt: skip
    check_weight_format(manifest, root)
    if model_type not in SUPPORTED_FAMILIES:
        raise BadInput(f"{root}: a {model_type} model; mxconv's vLLM plugin loads {', '.join(SUPPORTED_FAMILIES)} "
                       "outputs so far (use mxconv.engines.loader for the others)")  # fmt: skip
    return mapping_for(manifest.backend, f"{root}: ")


def held_backends(backend: str | None, vllm_backend: str | None, served: Sequence[str] | None = None,
                   not_served: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The vLLM MoE backends that hold an output's bytes and that its backend's mapping covers:
    ``served`` (the manifest's ``served_vllm_backends``, the one 'served by' rule,
    :mod:`mxconv.layouts.vllm_serving`), else ``vllm_backend`` (the layout's ``vllm_moe_backend``), else
    the mapping's own. BadInput when none is left (``not_served``: the manifest's reasons)."""
    m = mapping_for(backend)
    if served is not None:
        names = [str(b) for b in served]
    else:
        names = [str(vllm_backend)] if vllm_backend else list(m.vllm_backends)
    held = tuple(b for b in names if b in m.vllm_backends)
    if not held:
        why = "; ".join(f"{b}: {r}" for b, r in (not_served or {}).items())
        raise BadInput(f"{backend} output: no vLLM MoE backend holds these bytes"
                       f"{' (' + why + ')' if why else ''}; repack the source for the vLLM that serves it")  # fmt: skip
    return held


def served_by(manifest: Manifest) -> tuple[str, ...]:
    """:func:`held_backends` of an output's manifest."""
    vllm_backend = ServingDescription.from_layout(manifest.layout).vllm_moe_backend
    return held_backends(manifest.backend, vllm_backend,
                         manifest.served_vllm_backends, recorded_not_served(manifest))  # fmt: skip


def check_backend(manifest: Manifest, selected: str, root: Path) -> None:
    """The MoE backend vLLM selected here must be one the output's bytes are for."""
    check_selected_backend(manifest.backend, served_by(manifest), selected, root)


def check_selected_backend(backend: str | None, held: tuple[str, ...], selected: str, root: Path) -> None:
    """vLLM's selected MoE backend must be one of ``held``."""
    if selected not in held:
        raise BadInput(f"{root}: holds {backend} kernel bytes for vLLM's {' / '.join(held)} MXFP4 MoE "
                       f"backend, but vLLM selected its {selected} backend on this machine (and its moe_backend "
                       f"setting): {_repack_hint(selected)}, or run where vLLM selects {held[0]}")  # fmt: skip


def check_tp(manifest: Manifest, tp_size: int, root: Path) -> None:
    """vLLM's tensor-parallel size must be the output's (rank-N/ directory = TP rank N)."""
    have = manifest.tp_size
    if have != tp_size:
        raise BadInput(f"{root}: written for tensor_parallel_size {have} (tp_size in mxconv.json), and vLLM runs "
                       f"with {tp_size}: start vLLM with tensor_parallel_size={have}, or repack the source for "
                       f"{tp_size} ranks (mxconv repack SOURCE OUTPUT --tp {tp_size})")  # fmt: skip


def check_dtype(manifest: Manifest, dtype: str, root: Path) -> None:
    """vLLM's model dtype must be the activation dtype the layout was written for."""
    act = str(manifest.activation or "bf16")
    want = {"bf16": "bfloat16"}.get(act, act)
    if dtype.replace("torch.", "") != want:
        raise BadInput(f"{root}: written for {want} activations (activation {act} in mxconv.json), and vLLM runs "
                       f"with dtype {dtype.replace('torch.', '')}: start vLLM with dtype='{want}'")  # fmt: skip


def check_param(root: Path, layer: int, name: str, param: tuple[tuple[int, ...], str],
                stored: tuple[tuple[int, ...], str], manifest: Manifest, held_as: str = "vLLM holds") -> None:  # fmt: skip
    """vLLM's parameter ``name`` (its padded shape and dtype), or what vLLM's conversion returns for it
    (``held_as``), must be the stored tensor's."""
    if tuple(param[0]) == tuple(stored[0]) and param[1] == stored[1]:
        return
    lay = manifest.layout
    raise BadInput(f"{root}: layer {layer} {name}: {held_as} {param[1]}{list(param[0])}, the output stores "
                   f"{stored[1]}{list(stored[0])} (padded hidden {lay.padded_hidden_size}, intermediate "
                   f"{lay.padded_intermediate_size} in mxconv.json): vLLM pads differently here or the output "
                   f"is damaged; repack the source for this vLLM and TP size")  # fmt: skip


def inside(root: Path, name: str) -> Path:
    """``root / name`` when it is one of the output's own paths: plain names, none a link (the rule
    verify and the loader apply, :func:`~mxconv.source.file_names.output_path`); OutputDamaged (a
    BadInput) otherwise."""
    return output_path(root, name, f"{root / MANIFEST_NAME}")
