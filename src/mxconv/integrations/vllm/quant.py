"""vLLM quantization method ``mxconv``: vLLM's own gpt-oss MXFP4 config and MoE method, with one step
replaced — the conversion of the loaded expert tensors to the backend's kernel format, which an mxconv
output has already done (docs/vllm-plugin.md).

Imports vLLM: only :func:`mxconv.integrations.vllm.register` (vLLM's plugin hook) imports this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.quantization import mxfp4 as vllm_mxfp4
from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config, GptOssMxfp4MoEMethod

from mxconv.errors import BadInput
from mxconv.integrations.vllm.checks import check_backend, check_selected_backend, check_weight_format, held_backends
from mxconv.integrations.vllm.mappings import BackendMapping
from mxconv.output.engine_quant_config import VLLM_LOAD_FORMAT, VLLM_QUANT_METHOD
from mxconv.source.file_names import MANIFEST_NAME
from mxconv.source.manifest import Manifest, load_manifest

_CONVERT = "convert_gpt_oss_weight_to_mxfp4_moe_kernel_format"  # the vLLM function the plugin steps in for
_LAYER_HOOK = "_mxconv_converted"  # set on a layer only while vLLM converts it


_MANIFESTS: dict[Path, tuple[tuple[int, int], Manifest]] = {}  # root -> ((mtime_ns, size), its manifest)


def _model_root() -> Path:
    return Path(str(get_current_vllm_config().model_config.model))


def output_manifest(root: Path) -> Manifest | None:
    """The manifest of the output at ``root`` (None: it has none), read and validated once per version
    of the file (its mtime and size): vLLM builds one MoE method a layer, and the loader reads it again."""
    root = root.expanduser().resolve()
    try:
        st = (root / MANIFEST_NAME).stat()
    except FileNotFoundError:
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    held = _MANIFESTS.get(root)
    if held is None or held[0] != stamp:
        _MANIFESTS.clear()  # one engine's output at a time
        held = _MANIFESTS[root] = (stamp, load_manifest(root))
    return held[1]


class MxconvConfig(GptOssMxfp4Config):
    """``quant_method: mxconv`` (a repack output's config.json): vLLM's gpt-oss MXFP4 config whose MoE
    layers take their kernel tensors from mxconv's loader."""

    def __init__(self, backend: str | None = None, vllm_backend: str | None = None) -> None:
        super().__init__()
        self.mxconv_backend, self.vllm_backend = backend, vllm_backend

    @classmethod
    def get_name(cls) -> Any:
        return VLLM_QUANT_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MxconvConfig":
        return cls(config.get("mxconv_backend"), config.get("mxconv_vllm_moe_backend"))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: Any, hf_config: Any = None) -> Any:
        if isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == VLLM_QUANT_METHOD:
            return VLLM_QUANT_METHOD
        return None

    def _make_moe_method(self, moe: Any) -> "MxconvMoEMethod":
        return MxconvMoEMethod(moe, self)


class MxconvMoEMethod(GptOssMxfp4MoEMethod):
    """vLLM's gpt-oss MXFP4 MoE method (backend selection, parameters, kernel set-up, forward), whose
    conversion to kernel format returns the tensors mxconv's loader put in place."""

    def __init__(self, moe: Any, config: MxconvConfig) -> None:
        root = _model_root()
        load_format = str(get_current_vllm_config().load_config.load_format)
        if load_format != VLLM_LOAD_FORMAT:
            raise BadInput(f"{root}: an mxconv kernel-layout output (quant_method {VLLM_QUANT_METHOD}); load it with "
                           f"load_format='{VLLM_LOAD_FORMAT}' (vllm serve --load-format {VLLM_LOAD_FORMAT}), "
                           f"not {load_format!r}")  # fmt: skip
        manifest = output_manifest(root)
        if manifest is not None:
            check_weight_format(manifest, root)
        super().__init__(moe)  # vLLM selects its MXFP4 MoE backend here (moe_backend honoured)
        if config.vllm_backend is not None:
            if manifest is not None:  # its served_vllm_backends: every backend holding the bytes
                check_backend(manifest, self.mxfp4_backend.value, root)
            else:
                held = held_backends(config.mxconv_backend, config.vllm_backend)
                check_selected_backend(config.mxconv_backend, held, self.mxfp4_backend.value, root)
        self.mxconv_mapping: BackendMapping | None = None  # set by the loader with the tensors below
        self.mxconv_aside: dict[str, Any] = {}
        self.mxconv_src: Any = None  # the LayerSource the loader read (mxconv.engines.loader)

    def process_weights_after_loading(self, layer: Any) -> None:
        """vLLM's own post-load set-up, with the conversion answered from what the loader placed."""
        mapping = self.mxconv_mapping
        if mapping is None:
            raise BadInput(f"{_model_root()}: an MoE layer that mxconv's loader did not fill; load the output "
                           f"with load_format='{VLLM_LOAD_FORMAT}'")  # fmt: skip
        install_conversion_hook()

        def converted(kwargs: dict[str, Any]) -> tuple[Any, ...]:
            selected = kwargs["mxfp4_backend"].value
            if selected not in mapping.vllm_backends:
                raise BadInput(f"{_model_root()}: vLLM converts for {selected}, the output holds {mapping.vllm_backend} bytes")
            params = {k: kwargs[k].data for k in mapping.into_params}
            return mapping.converted(params, self.mxconv_aside, layer, self.mxconv_src.manifest)

        setattr(layer, _LAYER_HOOK, converted)
        try:
            super().process_weights_after_loading(layer)
        finally:
            delattr(layer, _LAYER_HOOK)
        self.mxconv_aside = {}


def install_conversion_hook() -> None:
    """Put, once, a stand-in for vLLM's conversion to kernel format in its mxfp4 module: for a layer
    that mxconv's MoE method is setting up it returns that layer's tensors; for every other layer it
    calls vLLM's own function with the same arguments."""
    current = getattr(vllm_mxfp4, _CONVERT)
    if getattr(current, "mxconv_hook", False):
        return
    original = current

    def convert(*args: Any, **kwargs: Any) -> Any:
        hook = getattr(kwargs.get("layer"), _LAYER_HOOK, None)
        return original(*args, **kwargs) if hook is None else hook(kwargs)

    convert.mxconv_hook = True  # type: ignore[attr-defined]
    setattr(vllm_mxfp4, _CONVERT, convert)
