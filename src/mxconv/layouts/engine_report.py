"""``mxconv inspect --engine E --gpu G``: the engine picks of :mod:`mxconv.layouts.engine_picks` joined with
the mxconv outputs that hold their bytes (each registered layout's ``vllm_backends``, the canonical
outputs' ``CANONICAL_VLLM_BACKENDS``) and the padding vLLM allocates (``vllm_padded_sizes``).

A backend registered later (``register_layout``) is joined as soon as it declares ``vllm_backends``.
Plain dicts in and out; no torch.
"""

from __future__ import annotations

from typing import Any

from mxconv.errors import BadInput, LayoutError
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.canonical import LayoutSizes
from mxconv.layouts.engine_picks import (
    CANONICAL_LAYOUT, ENGINES, FP8_ORACLE, HOLDER_ATTRIBUTE, MXFP4_BACKENDS, MXFP4_ORACLE, MXFP8_BACKENDS, ORACLE, VLLM,
    WNA16_ORACLE, Gpu, Pick, SourceKind, picks,
)
from mxconv.layouts.vllm_backends import (
    CANONICAL_MXFP8_VLLM_BACKENDS, CANONICAL_VLLM_BACKENDS, UNPADDED_LAYOUTS, platform_of, vllm_padded_sizes, vllm_refusal,
)

# The canonical outputs each holder attribute's oracle holds as they are (MXFP4: Mxfp4MoeBackend names,
# MXFP8: Fp8MoeBackend names); INT4 has no canonical output.
CANONICAL_HOLDERS = {"vllm_backends": CANONICAL_VLLM_BACKENDS, "vllm_mxfp8_backends": CANONICAL_MXFP8_VLLM_BACKENDS}

# compressed-tensors "format" -> kind (mxconv's own CT_FORMATS names and compressed-tensors' INT4 one)
_CT_KINDS = {"mxfp4-pack-quantized": SourceKind.CT_MXFP4, "mxfp8-quantized": SourceKind.CT_MXFP8,
             "pack-quantized": SourceKind.CT_INT4}


def source_kind(quant: dict[str, Any] | None, model_type: str | None) -> SourceKind | None:
    """What the engine sees in a ``quantization_config`` (None: unquantized or a kind the data lacks)."""
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == "mxfp4":
        return SourceKind.GPT_OSS_MXFP4 if model_type == "gpt_oss" else SourceKind.MXFP4
    if method is None and quant.get("mxconv_quant_method") == "mxfp8":
        return SourceKind.MXCONV_MXFP8
    if method == "compressed-tensors":
        groups = quant.get("config_groups") or {}
        formats = {quant.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
        kinds = {_CT_KINDS[f] for f in formats if f in _CT_KINDS}
        return kinds.pop() if len(kinds) == 1 else None
    return None


def holders(backend: str, attribute: str = "vllm_backends") -> list[dict[str, Any]]:
    """The mxconv outputs whose bytes ``backend`` (a vLLM backend name of the oracle whose layout
    ``attribute`` is given, HOLDER_ATTRIBUTE) holds as is: every registered layout/activation whose
    ``attribute`` names it, then the canonical outputs (:data:`CANONICAL_HOLDERS`)."""
    out: list[dict[str, Any]] = []
    fmt = " --format mxfp8" if attribute == "vllm_mxfp8_backends" else ""  # what repack of a bf16 source needs
    for name in backend_names():
        for act, names in getattr(get_layout(name), attribute, {}).items():
            if backend in names:
                out.append({"output": f"repack --backend {name} --activation {act}{fmt}", "backend": name, "activation": act})
    canonical = CANONICAL_HOLDERS.get(attribute, {})
    out += [{"output": f"canonical ({lay})", "layout": lay} for lay, names in canonical.items() if backend in names]
    return out


def engine_padding(pick: Pick, hidden: int, intermediate: int, activation: str) -> tuple[int, int] | None:
    """(H, I) per rank vLLM allocates for ``pick``; None where vllm_padded_sizes does not say (other
    oracles, other engines, unknown backends)."""
    if pick.engine != VLLM or pick.backend is None:
        return None
    if ORACLE[pick.source] == WNA16_ORACLE and pick.backend == "HUMMING":  # CompressedTensorsWNA16MoEMethod pads nothing
        return hidden, intermediate
    if ORACLE[pick.source] == FP8_ORACLE:  # the MXFP8 methods allocate the checkpoint's sizes (no maybe_roundup_sizes)
        return hidden, intermediate
    if ORACLE[pick.source] != MXFP4_ORACLE:
        return None
    if CANONICAL_LAYOUT[pick.source] in UNPADDED_LAYOUTS:  # CompressedTensorsW4A4Mxfp4MoEMethod pads nothing
        return hidden, intermediate
    return vllm_padded_sizes(pick.backend, hidden, intermediate, activation, platform_of(str(pick.gpu)))


def _arch_option(layout: Any, gpu: Gpu) -> dict[str, str]:
    """``{"arch": gpu}`` where ``layout`` declares an ``arch`` option that takes ``gpu`` and defaults to
    another GPU (the option an output for that GPU is written with), else nothing."""
    opt = next((o for o in layout.options if o.name == "arch"), None)
    takes = opt is not None and opt.choices is not None and str(gpu) in opt.choices and opt.default != str(gpu)
    return {"arch": str(gpu)} if takes else {}


def _check_holder(h: dict[str, Any], pick: Pick, model: dict[str, Any]) -> dict[str, Any]:
    """``h`` with the sizes its output is padded to and why vLLM would not hold it as is (None: it does)."""
    H, I, act = int(model["hidden_size"]), int(model["intermediate_size"]), str(model.get("activation", "silu"))
    wfmt = HOLDER_ATTRIBUTE[ORACLE[pick.source]][1]
    padded_by_engine = CANONICAL_LAYOUT[pick.source] not in UNPADDED_LAYOUTS and wfmt == "mxfp4"
    fmt_kw: dict[str, Any] = {} if wfmt == "mxfp4" else {"weight_format": wfmt}
    if "layout" in h:  # a canonical output: its tensors are the checkpoint's
        return {**h, "padded": [H, I], "refusal": vllm_refusal(str(pick.backend), (H, I, H, I), model, None, False)}
    layout = get_layout(h["backend"])
    given = _arch_option(layout, pick.gpu)
    if given:
        h = {**h, "output": f"{h['output']} --layout-option arch={given['arch']}"}
    try:
        opts = layout.resolve_options(given)
        Hp, Ip = layout.padded_sizes(H, I, str(model.get("row_order", "halves")), h["activation"], opts, **fmt_kw)
        sizes = LayoutSizes(int(model.get("num_experts", 1)), H, I, Hp, Ip, str(model.get("row_order", "halves")),
                            bool(model.get("has_expert_bias")), wfmt)
        desc = layout.describe(sizes, h["activation"], opts)
    except LayoutError as exc:
        return {**h, "padded": None, "refusal": f"repack refuses these sizes: {exc}"}
    compat, arch = desc.get("engine_compat", {}).get("vllm"), desc.get("arch")
    return {**h, "padded": [Hp, Ip],
            "refusal": vllm_refusal(str(pick.backend), (H, I, Hp, Ip), model, compat, padded_by_engine, arch)}


def pick_row(engine: str, kind: SourceKind, gpu: Gpu, model: dict[str, Any]) -> dict[str, Any]:
    """One line of the report: what ``engine`` picks for a ``kind`` checkpoint of ``model`` (its
    ``hidden_size``, ``intermediate_size``, ``activation``, ...) on ``gpu``, which outputs hold it."""
    p = picks(engine, kind, gpu)
    row: dict[str, Any] = {"kind": str(kind), "gpu": str(gpu)}
    if p is None:
        fallback = picks(VLLM, kind, gpu) if engine != VLLM else None
        row.update(backend=None, note=f"not in the {engine} data" + (f"; no different pick from {VLLM} recorded" if fallback else ""))
        if fallback is not None:
            p = fallback
        else:
            return row
    row.update(engine=p.engine, backend=p.backend, cite=p.cite, why=p.why)
    if p.backend is None:
        return row
    H, I = int(model["hidden_size"]), int(model["intermediate_size"])
    padded = engine_padding(p, H, I, str(model.get("activation", "silu")))
    row["engine_padding"] = list(padded) if padded else None
    if p.engine != VLLM or ORACLE[kind] not in HOLDER_ATTRIBUTE:
        row["held_by"] = []
        row["note"] = (f"no mxconv output records holding {p.engine}'s {p.backend} bytes (layouts name vLLM "
                       "Mxfp4MoeBackend and, for INT4, WNA16MoEBackend names)")  # fmt: skip
        return row
    row["held_by"] = [_check_holder(h, p, model) for h in holders(p.backend, HOLDER_ATTRIBUTE[ORACLE[kind]][0])]
    if not row["held_by"]:
        reasons = MXFP8_BACKENDS if ORACLE[kind] == FP8_ORACLE else MXFP4_BACKENDS
        row["note"] = f"no mxconv output holds {p.backend} bytes yet" + (
            f": {reasons[p.backend]}" if reasons.get(p.backend) else "")
    return row


def engine_report(engine: str, gpus: tuple[Gpu, ...], forms: list[tuple[str, SourceKind | None]],
                  model: dict[str, Any]) -> dict[str, Any]:
    """``inspect --engine``: for every GPU, one row per (form, kind) in ``forms`` (the source as it is,
    then each output it can become; kind None: the engine data has nothing for it)."""
    if engine not in ENGINES:
        raise BadInput(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    per_gpu = []
    for gpu in gpus:
        rows = []
        for form, kind in forms:
            r = pick_row(engine, kind, gpu, model) if kind is not None else {"kind": None, "backend": None,
                                                                             "note": "not in the engine data (unquantized or block-FP8 experts)"}
            rows.append({"form": form, **r})
        per_gpu.append({"gpu": str(gpu), "rows": rows})
    return {"engine": engine, "gpus": per_gpu}
