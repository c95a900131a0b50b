"""The ``quantization_config`` side of MXFP8 linear layers (:mod:`mxconv.run.linears`): the config
names exactly which linears are MXFP8 and which are left alone, so a loader never guesses.

* compressed-tensors (every family but gpt-oss): one more config group, the MXFP8A16 preset's
  weight arguments (``mxfp8-quantized``), whose ``targets`` are the exact module names of the MXFP8
  linears (``weight`` F8_E4M3 + ``weight_scale`` U8 E8M0, the names compressed-tensors' MXFP8
  compressor and vLLM load); ``ignore`` loses every entry that would match one of them (the family's
  ``re:.*self_attn\\..*`` and so on) and gains the exact name of every other 2-D weight module
  those left no longer cover (``lm_head``, routers, what ``--ignore`` named). compressed-tensors
  and vLLM check ``ignore`` before ``targets``.
* gpt-oss (its own ``{"quant_method": ..., "modules_to_not_convert": [...]}``): entries of
  ``modules_to_not_convert`` matching an MXFP8 linear go (``model.layers.*.self_attn``), exact names
  of the linears left alone come in, and ``mxconv_mxfp8_linears`` lists the MXFP8 ones (mxconv's own
  key, like its MXFP8 gpt-oss variant: no engine reads it yet).
* block FP8 (``quant_method: fp8``, ``quantize --format fp8-block``): ``modules_to_not_convert``
  names every unconverted Linear exactly already; the quantized linears leave it, and vLLM's
  Fp8LinearMethod / transformers' fine-grained FP8 take them as block FP8.

:func:`config_quantizes` answers, for either convention, whether the config describes a module
as quantized; verify checks the files against it.
"""

from __future__ import annotations

import copy
import re
from itertools import count
from typing import Any, Iterable

from mxconv.families.ct_output import ct_group
from mxconv.families.quant_config import ct_matches

GPT_OSS_KEY = "mxconv_mxfp8_linears"


def _tf_listed(module: str, patterns: Iterable[str]) -> bool:
    """transformers' ``modules_to_not_convert`` test: a pattern equal to, or matching (re.match), the module."""
    for p in patterns:
        try:
            if p == module or re.match(p, module):
                return True
        except re.error:
            continue
    return False


def with_linears(qc: dict[str, Any], mx: Iterable[str], others: Iterable[str]) -> dict[str, Any]:
    """``qc`` (the experts' config) describing the MXFP8 linear modules ``mx`` as quantized and the
    other linear modules ``others`` as not (see the module docstring). A new dict."""
    qc = copy.deepcopy(qc)
    mx, others = sorted(set(mx)), sorted(set(others))
    if not mx:
        return qc
    if qc.get("quant_method") == "compressed-tensors":
        groups = {}
        for key, g in qc.get("config_groups", {}).items():  # a copied config's exact names come again below
            g["targets"] = [t for t in g.get("targets", []) if t not in mx]
            if g["targets"]:
                groups[key] = g
        key = next(f"group_{i}" for i in count() if f"group_{i}" not in groups)
        groups[key] = {"targets": mx, **ct_group("mxfp8")}
        qc["config_groups"] = groups
        ignore = [p for p in qc.get("ignore") or [] if not any(ct_matches(m, [p]) for m in mx)]
        qc["ignore"] = ignore + [m for m in others if not ct_matches(m, ignore)]
        return qc
    if qc.get("quant_method") == "fp8":  # names every unconverted module exactly already: drop the quantized ones
        qc["modules_to_not_convert"] = [p for p in qc.get("modules_to_not_convert") or [] if p not in mx]
        return qc
    ntc = [p for p in qc.get("modules_to_not_convert") or [] if not any(_tf_listed(m, [p]) for m in mx)]
    qc["modules_to_not_convert"] = ntc + [m for m in others if not _tf_listed(m, ntc)]
    qc[GPT_OSS_KEY] = mx
    return qc


def config_quantizes(qc: dict[str, Any] | None, module: str) -> bool:
    """Whether ``qc`` describes linear ``module`` (not a routed expert) as quantized (MXFP8; block FP8
    under an fp8 config)."""
    def strings(v: Any) -> list[str]:  # a damaged config describes nothing, it does not crash
        return [p for p in v if isinstance(p, str)] if isinstance(v, list) else []

    if not isinstance(qc, dict):
        return False
    if qc.get("quant_method") == "compressed-tensors":
        if ct_matches(module, strings(qc.get("ignore"))):
            return False
        groups = qc.get("config_groups")
        groups = list(groups.values()) if isinstance(groups, dict) else []
        return any(ct_matches(module, strings(g.get("targets"))) for g in groups if isinstance(g, dict))
    if qc.get("quant_method") == "fp8":  # vLLM's Fp8Config: every Linear is FP8 unless listed (exact names)
        return module not in strings(qc.get("ignored_layers") or qc.get("modules_to_not_convert"))
    return module in strings(qc.get(GPT_OSS_KEY)) and not _tf_listed(module, strings(qc.get("modules_to_not_convert")))
