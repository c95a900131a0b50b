"""``mxconv inspect --engine E --gpu G``: the engine picks of :mod:`mxconv.layouts.engine_picks` joined with
the mxconv outputs that hold their bytes under the vLLM quantization method the picked form is loaded
with (:func:`mxconv.layouts.vllm_serving.vllm_serving`, the rule the manifest's ``served_vllm_backends``
comes from) and the padding that method allocates (``vllm_padded_sizes``; the compressed-tensors methods
pad nothing).

A backend registered later (``register_layout``) is joined as soon as it declares ``vllm_backends``.
Plain dicts in and out; no torch.
"""

from __future__ import annotations

from typing import Any

from mxconv.errors import BadInput, LayoutError
from mxconv.experts.stack import LayoutSizes
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.engine_picks import (
    ENGINES, MXFP4_BACKENDS, MXFP8_BACKENDS, PICKS, VLLM, WNA16_BACKENDS, Gpu, Pick, SourceKind, picks,
)
from mxconv.layouts.vllm_backends import platform_of, vllm_padded_sizes
from mxconv.layouts.vllm_serving import CANONICAL_LAYOUTS, OutputForm, VllmMethod, candidates, served_methods, vllm_serving

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


# The vLLM quantization method each kind of checkpoint is loaded with (None: none; mxconv's gpt-oss MXFP8
# says quant_method null).
METHOD = {SourceKind.GPT_OSS_MXFP4: VllmMethod.MXFP4, SourceKind.MXFP4: VllmMethod.MXFP4, SourceKind.CT_MXFP4: VllmMethod.CT_MXFP4,
          SourceKind.CT_INT4: VllmMethod.CT_WNA16, SourceKind.CT_MXFP8: VllmMethod.CT_MXFP8, SourceKind.MXCONV_MXFP8: None}
# Per method: the Layout member a layout declares the backends holding its bytes in, the vLLM enum they are
# values of and vLLM's notes on each (engine_picks).
DECLARED_IN = {VllmMethod.MXFP4: ("vllm_backends", "Mxfp4MoeBackend", MXFP4_BACKENDS),
               VllmMethod.CT_MXFP4: ("vllm_backends", "Mxfp4MoeBackend", MXFP4_BACKENDS),
               VllmMethod.CT_WNA16: ("vllm_int4_backends", "WNA16MoEBackend", WNA16_BACKENDS),
               VllmMethod.CT_MXFP8: ("vllm_mxfp8_backends", "Fp8MoeBackend", MXFP8_BACKENDS)}
# A holder's weight format -> what its repack command adds (a bf16 or MXFP4 source becomes MXFP8 only when asked)
FORMAT_FLAG = {"mxfp8": " --format mxfp8"}


def holders(backend: str, method: VllmMethod | None = None) -> list[dict[str, Any]]:
    """The mxconv outputs that may hold ``backend``'s bytes under ``method`` (any method when None): every
    registered layout/activation :func:`~mxconv.layouts.vllm_serving.candidates` names it for, then the
    canonical outputs. Whether a given model's output does is :func:`_check_holder`'s answer."""
    def names_it(layout: str, act: str | None, fmt: str) -> bool:
        return any(b == backend and method in (None, m) for m, b in candidates(layout, act, fmt))

    out: list[dict[str, Any]] = []
    for name in backend_names():
        for act in get_layout(name).activations:
            fmt = next((f for f in ("mxfp4", "int4", "mxfp8") if names_it(name, act, f)), None)
            if fmt is not None:
                out.append({"output": f"repack --backend {name} --activation {act}{FORMAT_FLAG.get(fmt, '')}", "backend": name,
                            "activation": act, "weight_format": fmt})
    out += [{"output": f"canonical ({lay})", "layout": lay, "weight_format": fmt}
            for fmt in ("mxfp4", "mxfp8") for lay in CANONICAL_LAYOUTS if names_it(lay, None, fmt)]
    return out


def not_held(backend: str, method: VllmMethod) -> str | None:
    """Why no mxconv output holds ``backend``'s bytes under ``method``, asked of the registry (:func:`holders`):
    no registered layout declares it and no canonical output is it; vLLM's note on the backend added. None
    when an output does."""
    if holders(backend, method):
        return None
    member, enum, notes = DECLARED_IN[method]
    note = notes.get(backend)
    return (f"no mxconv output holds {backend} bytes yet: no registered layout declares this {enum} value in its "
            f"{member}" + (f" (vLLM: {note})" if note else ""))


def undeclarable_backends() -> list[str]:
    """``"layout.member[activation]: NAME"`` for every name a registered layout declares that is no value of
    that member's vLLM enum (a typo would otherwise pass as served: vLLM's padding of it is unknown)."""
    out = []
    for name in backend_names():
        layout = get_layout(name)
        declared = {"vllm_backends": layout.vllm_backends, "vllm_int4_backends": layout.vllm_int4_backends,
                    "vllm_mxfp8_backends": layout.vllm_mxfp8_backends}
        for member, _, known in {d[0]: d for d in DECLARED_IN.values()}.values():
            out += [f"{name}.{member}[{act}]: {b}" for act, names in declared[member].items() for b in names if b not in known]
    return out


def engine_padding(pick: Pick, hidden: int, intermediate: int, activation: str) -> tuple[int, int] | None:
    """(H, I) per rank vLLM allocates for ``pick``; None where vllm_padded_sizes does not say (other
    oracles, other engines, unknown backends)."""
    method = METHOD[pick.source]
    if pick.engine != VLLM or pick.backend is None or method is None:
        return None
    if not method.pads:  # the compressed-tensors methods
        return hidden, intermediate
    return vllm_padded_sizes(pick.backend, hidden, intermediate, activation, platform_of(str(pick.gpu)))


def _arch_option(layout: Any, gpu: Gpu) -> dict[str, str]:
    """``{"arch": gpu}`` where ``layout`` declares an ``arch`` option that takes ``gpu`` and defaults to
    another GPU (the option an output for that GPU is written with), else nothing."""
    opt = next((o for o in layout.options if o.name == "arch"), None)
    takes = opt is not None and opt.choices is not None and str(gpu) in opt.choices and opt.default != str(gpu)
    return {"arch": str(gpu)} if takes else {}


def _form(h: dict[str, Any], gpu: Gpu, model: dict[str, Any]) -> tuple[dict[str, Any], OutputForm]:
    """The output ``h`` names, written for ``model`` on ``gpu`` (its default options, the GPU's ``arch``):
    ``h`` with the sizes it is padded to (and the option), and its :class:`OutputForm`; LayoutError when
    repack refuses these sizes."""
    H, I, order = int(model["hidden_size"]), int(model["intermediate_size"]), str(model.get("row_order", "halves"))
    if "layout" in h:  # a canonical output: its tensors are the checkpoint's
        return {**h, "padded": [H, I]}, OutputForm(h["layout"], None, h["weight_format"], (H, I, H, I), model)
    layout, wfmt = get_layout(h["backend"]), h["weight_format"]
    given = _arch_option(layout, gpu)
    if given:
        h = {**h, "output": f"{h['output']} --layout-option arch={given['arch']}", "options": given}
    opts = layout.resolve_options(given)
    Hp, Ip = layout.padded_sizes(H, I, order, h["activation"], opts, weight_format=wfmt)
    sizes = LayoutSizes(int(model.get("num_experts", 1)), H, I, Hp, Ip, order, bool(model.get("has_expert_bias")), wfmt)
    desc = layout.describe(sizes, h["activation"], opts)
    return {**h, "padded": [Hp, Ip]}, OutputForm(h["backend"], h["activation"], wfmt, (H, I, Hp, Ip), model,
                                                  desc.get("engine_compat", {}).get("vllm"), desc.get("arch"))


def _check_holder(h: dict[str, Any], pick: Pick, model: dict[str, Any]) -> dict[str, Any]:
    """``h`` with the sizes its output is padded to, why vLLM would not hold it as is under the pick's method
    (None: it does; :func:`~mxconv.layouts.vllm_serving.vllm_serving`, the rule the manifest uses) and, when
    it does not, the methods and backends that do hold it (``served_elsewhere``)."""
    method = METHOD[pick.source]
    try:
        h, form = _form(h, pick.gpu, model)
    except LayoutError as exc:
        return {**h, "padded": None, "refusal": f"repack refuses these sizes: {exc}"}
    servings = vllm_serving(form)
    mine = next((s for s in servings if (s.method, s.backend) == (method, pick.backend)), None)
    refusal = mine.refusal if mine is not None else f"{pick.backend} does not hold this output under {method.label if method else 'this method'}"
    out = {**h, "refusal": refusal}
    if refusal is not None:
        out["served_elsewhere"] = served_methods(servings)
    return out


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
    if METHOD[kind] is not None and p.engine == VLLM:
        row["method"] = str(METHOD[kind])
    if p.backend is None:
        return row
    H, I = int(model["hidden_size"]), int(model["intermediate_size"])
    padded = engine_padding(p, H, I, str(model.get("activation", "silu")))
    row["engine_padding"] = list(padded) if padded else None
    if p.engine != VLLM or METHOD[kind] is None:
        row["held_by"] = []
        row["note"] = (f"no mxconv output records holding {p.engine}'s {p.backend} bytes (layouts name vLLM "
                       "Mxfp4MoeBackend and, for INT4 and MXFP8, WNA16MoEBackend and Fp8MoeBackend names)")  # fmt: skip
        return row
    row["held_by"] = [_check_holder(h, p, model) for h in holders(p.backend, METHOD[kind])]
    if not row["held_by"]:
        row["note"] = not_held(p.backend, METHOD[kind])
    return row


def command(h: dict[str, Any], source: str, out_stem: str) -> str:
    """The command that writes holder ``h`` of :func:`holders` from ``source`` into ``OUT_STEM-<backend>``
    (paths as given; quoted for a shell where they need it)."""
    import shlex

    fmt = h.get("weight_format", "mxfp4")
    if "layout" in h:
        return f"mxconv quantize {shlex.quote(source)} {shlex.quote(f'{out_stem}-{fmt}')} --format {fmt}"
    opts = "".join(f" --layout-option {k}={v}" for k, v in (h.get("options") or {}).items())
    flag = FORMAT_FLAG.get(fmt, "")
    out = f"{out_stem}-{h['backend']}-{h['activation']}" + flag.replace(" --format ", "-")
    return (f"mxconv repack {shlex.quote(source)} {shlex.quote(out)} --backend {h['backend']} --activation {h['activation']}"
            f"{flag}{opts}")


def engine_report(engine: str, gpus: tuple[Gpu, ...], forms: list[tuple[str, SourceKind | None]],
                  model: dict[str, Any], source: tuple[str, str] | None = None) -> dict[str, Any]:
    """``inspect --engine``: for every GPU, one row per (form, kind) in ``forms`` (the source as it is,
    then each output it can become; kind None: the engine data has nothing for it). ``source``: (the
    checkpoint a repack starts from, the stem of the output paths) for each holder's ``command``.
    Another engine than vLLM keeps only the rows its data records a pick of its own for."""
    if engine not in ENGINES:
        raise BadInput(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    per_gpu, left_out = [], 0
    for gpu in gpus:
        rows = []
        for form, kind in forms:
            r = pick_row(engine, kind, gpu, model) if kind is not None else {"kind": None, "backend": None,
                                                                             "note": "not in the engine data (unquantized or block-FP8 experts)"}
            if engine != VLLM and r.get("engine") != engine:
                left_out += 1
                continue
            for h in r.get("held_by", []) if source else ():
                h["command"] = command(h, *source)
            rows.append({"form": form, **r})
        if rows:
            per_gpu.append({"gpu": str(gpu), "rows": rows})
    report: dict[str, Any] = {"engine": engine, "gpus": per_gpu}
    if left_out:
        recorded = sorted({f"{p.source} on {p.gpu}" for p in PICKS if p.engine == engine})
        report["note"] = (f"{left_out} row(s) left out: the {engine} data records picks only where {engine} picks otherwise "
                          f"than {VLLM} ({', '.join(recorded)}); elsewhere see --engine {VLLM}")
    return report
