"""vLLM load format ``mxconv``: vLLM's default loader for every non-expert tensor of an mxconv
kernel-layout output, and the expert tensors read from the files the manifest names straight into the
MoE layers' parameters, after the checks of :mod:`.checks` (docs/vllm-plugin.md).

Imports vLLM: only :func:`mxconv.integrations.vllm.register` imports this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from mxconv.engines.loader import LayerSource, layer_infos, read_layer_tensors, resolve_layer, stored_info
from mxconv.errors import BadInput, OutputDamaged
from mxconv.experts.stack import LayoutSizes
from mxconv.layouts import get_layout
import mxconv.integrations.vllm.checks as checks
from mxconv.integrations.vllm.mappings import BackendMapping
from mxconv.integrations.vllm.quant import MxconvMoEMethod, output_manifest
from mxconv.source.file_names import MANIFEST_NAME, rank_dir_name
from mxconv.source.manifest import Manifest
from mxconv.source.st_format import TensorInfo, torch_dtype

EXTRA_KEYS = ("check_hashes",)  # model_loader_extra_config keys this loader takes (the rest go to vLLM's)


def expert_names(manifest: Manifest) -> set[str]:
    """Checkpoint names of the output's expert tensors (the loader reads them itself)."""
    out = set()
    for key, entry in manifest.tensors.items():
        if entry.role == "expert":
            out.add(key.split("/", 1)[1] if key.startswith("rank-") else key)
    return out


def check_stored(root: Path, manifest: Manifest, rank: int) -> None:
    """Every tensor the manifest lists for this rank (its non-expert tensors too) is in the file the
    manifest names, with its shape and dtype (:func:`~mxconv.engines.loader.stored_info`, the check
    ``mxconv verify`` runs; headers only). vLLM leaves a parameter no file gives at its initial value
    without a word for a quantized model (it does not check that every weight was loaded then), so a
    damaged output would otherwise load. OutputDamaged naming the file, the tensor and the rule."""
    prefix = f"{rank_dir_name(rank)}/" if manifest.tp_size > 1 else ""
    headers: dict[Path, dict[str, TensorInfo]] = {}
    try:
        for key in manifest.tensors:
            if key.startswith(prefix):
                stored_info(root, manifest, key, headers)
    except OutputDamaged as exc:
        raise OutputDamaged(f"{exc}; mxconv's vLLM plugin loads an output only while every tensor its "
                            f"{MANIFEST_NAME} lists is stored as listed (mxconv verify {root} checks them all): "
                            f"repack the source") from None  # fmt: skip


def moe_modules(model: torch.nn.Module, manifest: Manifest, root: Path) -> dict[int, torch.nn.Module]:
    """{manifest layer: vLLM MoE module with mxconv's method}; BadInput unless they pair one to one."""
    prefixes = {entry.layer: entry.module_prefix + ".experts" for entry in manifest.layers}
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "quant_method", None), MxconvMoEMethod):
            continue
        hits = [L for L, p in prefixes.items() if name == p or name.startswith(p + ".")]
        if len(hits) != 1 or hits[0] in found:
            raise BadInput(f"{root}: vLLM's MoE layer {name} matches no single MoE layer of {MANIFEST_NAME}")
        found[hits[0]] = module
    missing = sorted(set(prefixes) - set(found))
    if missing:
        raise BadInput(f"{root}: {MANIFEST_NAME} lists MoE layers {missing} that vLLM's model does not have")
    return found


def vllm_kernel_specs(src: LayerSource, module: torch.nn.Module) -> dict[str, Any]:
    """The output's backend's kernel tensor specs (``layout.kernel_specs``) for this rank at vLLM's
    padded sizes (vLLM's parameters: ``w2_weight`` is ``[E, Hp, Ip/2]``): what vLLM's conversion returns."""
    m = src.manifest
    e, hp, ip = (int(v) for v in module.w2_weight.shape)
    layout = get_layout(src.backend)
    sizes = LayoutSizes(e, m.layout.hidden_size, src.intermediate_size, hp, 2 * ip, m.model.row_order,
                        hasattr(module, "w13_bias"), m.weight_format)  # fmt: skip
    return dict(layout.kernel_specs(sizes, str(m.activation), layout.resolve_options(m.layout.option_values)))


def check_layer(src: LayerSource, module: torch.nn.Module, mapping: BackendMapping, root: Path) -> None:
    """Each stored tensor of the shape and dtype of vLLM's parameter (``into_params``) or of what
    vLLM's conversion returns at vLLM's padding (``kept_aside``: the layout's kernel tensor specs for
    vLLM's padded sizes). Its paths were checked when ``src`` was resolved (``resolve_layer`` takes
    every file through ``tensor_file``: plain names inside the output, no link)."""
    infos = layer_infos(src)
    specs = vllm_kernel_specs(src, module)
    for key, info in infos.items():
        param = getattr(module, key, None)
        if param is None or key not in specs:
            raise BadInput(f"{root}: layer {src.layer} stores {key}, which vLLM's MoE layer does not have")
        stored = (tuple(info.shape), str(torch_dtype(info.dtype)))
        if key in mapping.into_params:
            checks.check_param(root, src.layer, key, (tuple(param.shape), str(param.dtype)), stored, src.manifest)
        else:
            spec = specs[key]
            checks.check_param(root, src.layer, key, (tuple(spec.shape), str(spec.dtype)), stored, src.manifest,
                               f"vLLM's {mapping.vllm_backend} conversion returns")  # fmt: skip
    absent = [k for k in (*mapping.into_params, *mapping.kept_aside) if k not in infos and "bias" not in k]
    if absent:
        raise BadInput(f"{root}: layer {src.layer} stores no {', '.join(absent)}")


class _ModelAt:
    """``model_config`` with ``model`` pointing at another directory (the weights vLLM's default loader
    reads), every other attribute the config's own."""

    def __init__(self, model_config: Any, path: Path) -> None:
        self._config, self.model = model_config, str(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class MxconvModelLoader(DefaultModelLoader):
    """``load_format="mxconv"``. ``model_loader_extra_config={"check_hashes": True}`` also compares each
    expert tensor's sha256 with the manifest's as it is read; sizes and dtypes are always checked."""

    def __init__(self, load_config: Any) -> None:
        extra = dict(load_config.model_loader_extra_config or {})
        self.check_hashes = extra.pop("check_hashes", False)
        if not isinstance(self.check_hashes, bool):
            raise BadInput(f"model_loader_extra_config check_hashes must be true or false, got {self.check_hashes!r}")
        # vLLM's default loader reads the non-expert tensors as the safetensors load format does
        super().__init__(dataclasses.replace(load_config, load_format="safetensors", model_loader_extra_config=extra))
        self._skip: set[str] = set()
        self._weights_dir: Path | None = None  # rank-N/ of a TP output: its non-expert tensors, whole

    def get_all_weights(self, model_config: Any, model: torch.nn.Module) -> Generator[tuple[str, torch.Tensor], None, None]:
        """vLLM's weights over the output's files (a TP output: this rank's ``rank-N/``, which holds every
        non-expert tensor whole, for vLLM's own sharding), less the expert tensors (read by this loader)."""
        cfg = model_config if self._weights_dir is None else _ModelAt(model_config, self._weights_dir)
        yield from super().get_all_weights(cfg, model)

    def _get_weights_iterator(self, source: Any) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The files vLLM's default loader picks (``_prepare_weights``), each tensor read unless it is an
        expert tensor: those are skipped by name before a byte of them is read (vLLM's own iterator
        reads every tensor of a file, so the experts would be read twice)."""
        from safetensors import safe_open

        _, files, use_safetensors, _ = self._prepare_weights(source.model_or_path, source.subfolder, source.revision,
                                                             source.fall_back_to_pt, source.allow_patterns_overrides)  # fmt: skip
        if not use_safetensors:
            raise BadInput(f"{source.model_or_path}: no safetensors files; an mxconv output always has them")
        for path in sorted(files):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if name not in self._skip:
                        yield source.prefix + name, f.get_tensor(name)

    def download_model(self, model_config: Any) -> None:
        """Nothing to download: an mxconv output is a local directory (checked in load_weights)."""

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        root = Path(str(model_config.model)).expanduser().resolve()
        manifest = output_manifest(root)  # read once for the MoE methods and this loader
        if manifest is None:
            raise BadInput(f"{root}: no {MANIFEST_NAME}, so not an mxconv kernel-layout output: load_format "
                           f"'mxconv' reads only those (mxconv repack); load this checkpoint without it")  # fmt: skip
        mapping = checks.check_model(manifest, getattr(model_config.hf_config, "model_type", None), root)
        checks.check_version(manifest, vllm.__version__, root)
        tp = get_tensor_model_parallel_world_size()
        checks.check_tp(manifest, tp, root)
        checks.check_dtype(manifest, str(model_config.dtype), root)
        rank = get_tensor_model_parallel_rank()
        check_stored(root, manifest, rank if tp > 1 else 0)
        modules = moe_modules(model, manifest, root)
        planned = {}
        for layer, module in sorted(modules.items()):
            checks.check_backend(manifest, module.quant_method.mxfp4_backend.value, root)
            src = resolve_layer(root, layer, rank=rank if tp > 1 else None, manifest=manifest, need_runner=False)
            check_layer(src, module, mapping, root)
            planned[layer] = (src, module)
        self._skip = expert_names(manifest)
        self._weights_dir = checks.inside(root, rank_dir_name(rank)) if tp > 1 else None
        super().load_weights(model, model_config)  # every other tensor, vLLM's way
        for layer, (src, module) in planned.items():
            self._fill(src, module, mapping)

    def _fill(self, src: LayerSource, module: torch.nn.Module, mapping: BackendMapping) -> None:
        """Read the layer's stored tensors and copy them into vLLM's parameters (kept-aside ones held
        for the conversion step, which returns them)."""
        method: MxconvMoEMethod = module.quant_method
        tensors = read_layer_tensors(src, module.w2_weight.device, check_hashes=self.check_hashes)
        with torch.no_grad():
            for key in mapping.into_params:
                if key in tensors:
                    getattr(module, key).data.copy_(tensors[key])
        method.mxconv_aside = {k: tensors[k] for k in mapping.kept_aside if k in tensors}
        method.mxconv_mapping = mapping
        method.mxconv_src = src  # where the layer came from (refit converts the same way)
