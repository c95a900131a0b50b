"""What a checkpoint's ``quantization_config`` says about its expert weights.

Shared by every family reader: the gpt-oss MXFP4 convention, compressed-tensors MX configs (mxconv's own
output, possibly partial), and block-FP8 (DeepSeek-style ``quant_method: fp8`` with
``weight_block_size``). Also compressed-tensors' module matching (``re:`` patterns), which the
output writer and the readers both use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from mxconv.source.checkpoint import Checkpoint
from mxconv.errors import BadInput

FLOAT_DTYPES: dict[str, str] = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
MX_FORMATS = ("mxfp4", "mxfp8")
CT_FORMATS = {"mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized"}
# Extra key of a compressed-tensors config: the block-FP8 quantization_config (transformers' "fp8"
# convention) of the expert layers that a partial quantize left block-FP8 (listed in ``ignore``).
UNCONVERTED_KEY = "mxconv_unconverted_quantization_config"
SUPPORTED_HINT = (
    "mxconv reads unquantized (bf16/fp16/fp32), block-FP8 (quant_method 'fp8' with weight_block_size) "
    "and MXFP4/MXFP8 experts, and compressed-tensors INT4 'pack-quantized' experts (int, 4 bits, symmetric, "
    "group 32, bf16 scales) of per-expert families; dequantize the checkpoint first"
)
CT_INT4_FORMAT = "pack-quantized"


# ---------------------------------------------------------------------------------------------
# quantization_config
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantScheme:
    """What ``quantization_config`` says about the expert weights.

    ``method``: None (no config), "fp8" (block-FP8), "ct-mx" (compressed-tensors MX, ``mx_fmt`` set),
    "ct-int4" (compressed-tensors INT4 pack-quantized, group 32), "mxfp4" / "mxfp8" (gpt-oss convention).
    """

    method: str | None
    mx_fmt: str | None = None
    block: tuple[int, int] | None = None  # block-FP8 tile (fp8, or ct-mx with unconverted block-FP8 layers)
    ue8m0: bool = False
    ignore: tuple[str, ...] = ()  # ct-mx: the config's ignore list; fp8: the modules it leaves unconverted


def quantization_dict(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` (top level, else text_config), or None."""
    for src in (ckpt.config, ckpt.text_config):
        for key in ("quantization_config", "compression_config"):
            qc = src.get(key)
            if qc is not None:
                if not isinstance(qc, dict):
                    raise BadInput(f"{ckpt.root / 'config.json'}: malformed {key} (not a JSON object)")
                return qc
    return None


def unsupported_quantization(ckpt: Checkpoint, qc: dict[str, Any], family: str) -> BadInput:
    """The BadInput for a quantization_config mxconv cannot read."""
    what = f"quant_method {qc.get('quant_method')!r}"
    fmt = qc.get("format")
    if fmt:
        what += f", format {fmt!r}"
    return BadInput(f"{ckpt.root / 'config.json'}: unsupported quantization ({what}) for {family}: {SUPPORTED_HINT}")


def ct_mx_format(qc: dict[str, Any]) -> str | None:
    """"mxfp4" / "mxfp8" when a compressed-tensors config quantizes weights as MX only, else None.

    Every config group must be float weights, 4 or 8 bits, symmetric, group strategy, group size 32,
    stored as ``mxfp4-pack-quantized`` / ``mxfp8-quantized`` (group ``format`` or the top-level one).
    """
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return None
    found: set[str] = set()
    for group in groups.values():
        if not isinstance(group, dict):
            return None
        w = group.get("weights")
        if not isinstance(w, dict):
            return None
        bits = w.get("num_bits")
        fmt = group.get("format") or qc.get("format")
        ok = (
            w.get("type") == "float"
            and w.get("group_size") == 32
            and w.get("strategy", "group") == "group"
            and w.get("symmetric", True) is True
            and bits in (4, 8)
        )
        name = "mxfp4" if bits == 4 else "mxfp8"
        if not ok or fmt != CT_FORMATS[name]:
            return None
        found.add(name)
    return found.pop() if len(found) == 1 else None


def ct_int4_format(qc: dict[str, Any]) -> bool:
    """True when a compressed-tensors config quantizes weights as INT4 ``pack-quantized`` only, the
    Kimi-K2-Thinking convention: every config group int weights, 4 bits, symmetric, group strategy,
    group size 32, no activation ordering, no input-activation quantization (W4A16), stored as
    ``pack-quantized`` (group ``format`` or the top-level one)."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return False
    for group in groups.values():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            return False
        w = group["weights"]
        ok = (
            w.get("type") == "int"
            and w.get("num_bits") == 4
            and w.get("group_size") == 32
            and w.get("strategy", "group") == "group"
            and w.get("symmetric", True) is True
            and w.get("actorder") is None
            and group.get("input_activations") is None
            and (group.get("format") or qc.get("format")) == CT_INT4_FORMAT
        )
        if not ok:
            return False
    return True


def _block_fp8(qc: dict[str, Any], where: str, family: str) -> QuantScheme:
    """The QuantScheme of a transformers/DeepSeek ``quant_method: fp8`` config (block-FP8 only)."""
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise BadInput(
            f"{where}: unsupported quantization (quant_method 'fp8' without a [rows, cols] weight_block_size, "
            f"i.e. not block-FP8) for {family}: {SUPPORTED_HINT}"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise BadInput(f"{where}: unsupported quantization (fp8 fmt {qc.get('fmt')!r}; only e4m3) for {family}")
    # vLLM's Fp8Config reads ignored_layers, else modules_to_not_convert (exact module names)
    skip = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    skip = tuple(p for p in skip if isinstance(p, str)) if isinstance(skip, list) else ()
    return QuantScheme("fp8", block=(block[0], block[1]), ue8m0=qc.get("scale_fmt") == "ue8m0", ignore=skip)


def read_quant_scheme(ckpt: Checkpoint, family: str) -> QuantScheme:
    """Parse ``quantization_config`` for a per-expert family; BadInput for anything unsupported."""
    qc = quantization_dict(ckpt)
    if qc is None:
        return QuantScheme(None)
    method = qc.get("quant_method")
    where = ckpt.root / "config.json"
    if method == "fp8":
        return _block_fp8(qc, str(where), family)
    if method == "compressed-tensors":
        fmt = ct_mx_format(qc)
        if fmt is not None:
            ignore = qc.get("ignore") or []
            if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
                raise BadInput(f"{where}: quantization_config 'ignore' must be a list of module names / 're:' patterns")
            unconverted = qc.get(UNCONVERTED_KEY)
            block, ue8m0 = None, False
            if unconverted is not None:
                if not isinstance(unconverted, dict) or unconverted.get("quant_method") != "fp8":
                    raise BadInput(f"{where}: {UNCONVERTED_KEY} must be a block-FP8 quantization_config (quant_method 'fp8')")
                fp8 = _block_fp8(unconverted, f"{where} ({UNCONVERTED_KEY})", family)
                block, ue8m0 = fp8.block, fp8.ue8m0
            return QuantScheme("ct-mx", mx_fmt=fmt, block=block, ue8m0=ue8m0, ignore=tuple(ignore))
        if ct_int4_format(qc):
            return QuantScheme("ct-int4", ignore=tuple(p for p in qc.get("ignore") or [] if isinstance(p, str)))
    raise unsupported_quantization(ckpt, qc, family)


def ct_matches(module: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors' (and vLLM's) target/ignore matching: ``re:`` = re.match, else equality."""
    for p in patterns:
        if p.startswith("re:"):
            try:
                if re.match(p[3:], module):
                    return True
            except re.error:
                continue
        elif p == module:
            return True
    return False
