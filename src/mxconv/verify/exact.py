"""verify with ``--reference``: the output holds exactly the bytes that converting the reference gives.

* **Experts**, layer by layer, in expert chunks on verify's device. Where the reference holds the
  output's own format (MXFP4, MXFP8, INT4), its canonical bytes must be the output's. Otherwise the
  reference layer is converted again the way the conversion did it: :func:`mxconv.run.compute.to_format`
  (the quantize entry :mod:`mxconv.kernels.quantize`: Triton on a GPU, torch on the CPU, the same
  bytes) with the manifest's ``weight_format`` and ``scale_rounding``, or
  :func:`mxconv.run.fp8_compute.to_fp8_block` for block FP8. The result is compared byte for byte with
  the canonical experts the layout check recovered (a kernel output's inverse is exact: the layout
  check proved that laying them out again gives the stored bytes, padding included), and the biases
  with the reference's cast to the output's dtype. The first difference is named by layer, tensor
  and index.
* **Copied tensors** (roles ``copy`` and ``router``, every TP rank): the sha256 of the reference's
  tensor, read on the hash pool beside the layer checks, must be the one the manifest records, which
  the integrity check holds to the output's bytes.

* **Chains**: an output whose input was an mxconv output (``quantize src q``, then ``repack q k``) kept
  the input's MX bytes; its manifest's ``numerics.upstream`` records how the input made them (source
  format, weight format, scale rounding). Against the first source, the reference is quantized that
  way first, then converted as this conversion did.

Where a layer's bytes cannot be re-derived (a re-quantization the manifest records no scale rounding
for; an output converted from experts of another format than the reference's, with no upstream run
recorded that starts from it), it is said in the verdict's scope (:func:`refused_summary`); the
numerics check still runs.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from mxconv.errors import BadInput
from mxconv.experts.stack import WEIGHT_FORMATS, CanonicalExperts
from mxconv.families.base import MoELayer
from mxconv.run.compute import CHUNK_ELEMENTS, source_stack, to_format
from mxconv.run.options import QuantOptions
from mxconv.source.manifest import UpstreamPart
from mxconv.verify.claims import copied_tensors
from mxconv.verify.layout import canonical_from_layer, first_difference
from mxconv.verify.report import LayerReport
from mxconv.verify.state import VerifyState

_KERNEL_NAMES = {"w13": "w13_weight", "w13_scale": "w13_weight_scale", "w2": "w2_weight", "w2_scale": "w2_weight_scale",
                 "w13_bias": "w13_bias", "w2_bias": "w2_bias"}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
Stacks = dict[str, torch.Tensor]  # canonical name ("w13", "w13_scale", "w13_bias", "w13_scale_inv.0", ...) -> [E, ...]


def check_expert_bytes(state: VerifyState, L: int, prefix: str, canon: CanonicalExperts | None, conv_layer: MoELayer | None,
                       ref_layer: MoELayer, rep: LayerReport) -> None:
    """The exact check of layer ``L`` (module docstring): ``rep.layout`` becomes "bit-exact" or
    "FAIL"; a layer whose bytes cannot be re-derived is recorded in ``state.bytes_refused``."""
    rcanon = canonical_from_layer(ref_layer)
    same = rcanon is not None and state.plan.weight_format in WEIGHT_FORMATS and rcanon.weight_format == state.plan.weight_format
    if canon is not None and rcanon is not None and same:
        diff = first_difference(canon, rcanon)
        _verdict(rep, None if diff is None else f"{prefix}.experts: recovered canonical bytes differ from the reference: {diff}")
        return
    got = _output_stacks(state, canon, conv_layer)
    if got is None:  # the layout check recovered nothing: it failed, naming why
        return
    why = _refusal(state, ref_layer)
    if why is not None:
        state.bytes_refused.setdefault(why, []).append(L)
        return
    _verdict(rep, _first_rederived_difference(state, L, prefix, got, ref_layer))


def _verdict(rep: LayerReport, problem: str | None) -> None:
    rep.layout = "FAIL" if problem else "bit-exact"
    if problem:
        rep.problems.append(problem)


def _format_of(layer: MoELayer) -> str:
    """A layer's expert format in ModelInfo.expert_format's words (bf16, mxfp4, fp8_block, ...)."""
    if layer.w13_mx is not None:
        return layer.w13_mx.fmt
    if layer.w13_int4 is not None:
        return "int4"
    if layer.w13_fp8 is not None:
        return "fp8_block"
    assert layer.w13 is not None
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(layer.w13.dtype, str(layer.w13.dtype))


def _refusal(state: VerifyState, ref_layer: MoELayer) -> str | None:
    """Why the output's expert bytes cannot be re-derived from ``ref_layer`` (None: they can)."""
    fmt, ref_fmt = state.plan.weight_format, _format_of(ref_layer)
    if fmt in ("mxfp4", "mxfp8") and (ref_fmt == fmt or (ref_fmt, fmt) == ("mxfp4", "mxfp8")):
        return None  # MX bytes kept (MXFP4 -> MXFP8 is lossless): no option decides them
    if fmt not in ("mxfp4", "mxfp8", "fp8-block"):
        return f"{fmt} experts are carried from a source of that format as they are; the reference's are {ref_fmt}"
    assert state.ref_info is not None
    source_fmt, ref_model_fmt = state.plan.info.expert_format, state.ref_info.expert_format
    if _upstream(state) is not None:
        return None  # the MX bytes of the output's input re-derived first, with the rounding they were made with
    if source_fmt != ref_model_fmt:
        return f"the output was converted from {source_fmt} experts (its manifest's model), the reference holds {ref_model_fmt}"
    if fmt == "fp8-block":
        return "the reference's experts are block-FP8 already" if ref_fmt == "fp8_block" else None
    if not state.plan.manifest.scale_rounding:
        return f"the manifest records no scale rounding for quantizing {ref_fmt} experts to {fmt}"
    return None


def _upstream(state: VerifyState) -> UpstreamPart | None:
    """The manifest's ``numerics.upstream`` where it applies to the reference: the output's input was
    an mxconv output whose MX bytes this conversion kept (or re-encoded exactly), made from experts of
    the reference's format; None otherwise (also where the reference holds the input's format)."""
    numerics = state.plan.manifest.numerics
    up = numerics.upstream if numerics is not None else None
    assert state.ref_info is not None
    if up is None or state.plan.info.expert_format == state.ref_info.expert_format:
        return None
    return up if up.source_format == state.ref_info.expert_format else None


def _through_upstream(state: VerifyState, part: MoELayer, device: torch.device) -> MoELayer:
    """``part`` of the reference as the output's input held it (:func:`_upstream`): its experts
    quantized with the upstream run's format and scale rounding."""
    up = _upstream(state)
    if up is None or part.w13_mx is not None:
        return part
    fmt = up.weight_format
    quant = QuantOptions(fmt=fmt, scale_rounding=up.scale_rounding, allow_nonfinite=True)
    mx = {which: to_format(None, source_stack(part, which), fmt, quant, f"{part.ref.module_prefix}.experts ({which})",
                           None, device) for which in ("w13", "w2")}
    return replace(part, w13=None, w2=None, w13_fp8=None, w2_fp8=None, w13_int4=None, w2_int4=None,
                   w13_mx=mx["w13"], w2_mx=mx["w2"])


def _output_stacks(state: VerifyState, canon: CanonicalExperts | None, conv_layer: MoELayer | None) -> Stacks | None:
    """The output's experts as canonical stacks by name (see :data:`Stacks`), as the layout check
    recovered them; None when it recovered nothing."""
    if conv_layer is not None and conv_layer.w13_fp8 is not None and conv_layer.w2_fp8 is not None:
        out: Stacks = {}
        for which, stack in (("w13", conv_layer.w13_fp8), ("w2", conv_layer.w2_fp8)):
            for j, (data, sinv) in enumerate(stack.parts):
                out[f"{which}.{j}"], out[f"{which}_scale_inv.{j}"] = data, sinv
        return out
    if canon is not None:
        parts: dict[str, Any] = {"w13": canon.w13, "w13_scale": canon.w13_scale, "w2": canon.w2, "w2_scale": canon.w2_scale,
                                 "w13_bias": canon.w13_bias, "w2_bias": canon.w2_bias}
    elif conv_layer is not None and conv_layer.w13_mx is not None and conv_layer.w2_mx is not None:
        parts = {"w13": conv_layer.w13_mx.data, "w13_scale": conv_layer.w13_mx.scales, "w2": conv_layer.w2_mx.data,
                 "w2_scale": conv_layer.w2_mx.scales, "w13_bias": conv_layer.w13_bias, "w2_bias": conv_layer.w2_bias}
    else:
        return None
    return {k: t for k, t in parts.items() if t is not None}


def _rederived(state: VerifyState, part: MoELayer, device: torch.device) -> Stacks:
    """Experts ``part`` of the reference converted as the conversion did (module docstring), through
    the upstream run first where the manifest records one (:func:`_upstream`)."""
    fmt = state.plan.weight_format
    part = _through_upstream(state, part, device)
    out: Stacks = {}
    if fmt == "fp8-block":
        from mxconv.run.fp8_compute import LayerTiles, Where, to_fp8_block

        for which, halves in (("w13", 2), ("w2", 1)):
            where = Where(part.ref, which, part.first_expert, lambda idx: f"{part.ref.module_prefix}.experts {list(idx)}")
            src = getattr(part, f"{which}_mx") or source_stack(part, which)
            stack = to_fp8_block(src, halves, where, False, LayerTiles(part.ref.module_prefix), None, device)
            for j, (data, sinv) in enumerate(stack.parts):
                out[f"{which}.{j}"], out[f"{which}_scale_inv.{j}"] = data, sinv
        return out
    quant = QuantOptions(fmt=fmt, scale_rounding=state.plan.manifest.scale_rounding or "auto", allow_nonfinite=True)
    for which in ("w13", "w2"):
        stack = to_format(getattr(part, f"{which}_mx"), source_stack(part, which), fmt, quant,
                          f"{part.ref.module_prefix}.experts ({which})", None, device)
        out[which], out[f"{which}_scale"] = stack.data, stack.scales
        bias = getattr(part, f"{which}_bias")
        if bias is not None:
            out[f"{which}_bias"] = bias
    return out


def _how(state: VerifyState) -> str:
    fmt, up = state.plan.weight_format, _upstream(state)
    if up is not None:
        then = "" if fmt == up.weight_format else f", then {fmt}"
        return f"the reference converted again ({up.weight_format}, {up.scale_rounding} scale rounding upstream{then})"
    if fmt == "fp8-block":
        return "the reference block-quantized again (fp8-block)"
    return f"the reference converted again ({fmt}, {state.plan.manifest.scale_rounding or 'no'} scale rounding)"


def _first_rederived_difference(state: VerifyState, L: int, prefix: str, got: Stacks, ref_layer: MoELayer) -> str | None:
    """The first byte of the output's experts that differs from the reference converted again, in
    expert chunks on verify's device; None when every byte is equal."""
    device = torch.device(state.plan.device)
    E = int(next(iter(got.values())).shape[0])
    step = max(1, CHUNK_ELEMENTS // max(1, 2 * state.plan.info.intermediate_size * state.plan.info.hidden_size))  # w13 elements
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        try:
            want = _rederived(state, ref_layer.select_experts(e0, e1), device)
        except BadInput as exc:
            return f"layer {L}: {prefix}.experts: the reference's experts {e0}..{e1 - 1} cannot be converted again: {exc}"
        for key in sorted(set(got) | set(want), key=_canonical_order):
            if key not in got or key not in want:
                side = "the reference" if key in want else "the output"
                return f"layer {L}: {prefix}.experts {key.split('.')[0]}: present in {side} only"
            have = got[key][e0:e1]
            if tuple(have.shape) != tuple(want[key].shape):
                return (f"layer {L}: {prefix}.experts {key}: {list(have.shape)} in the output, {list(want[key].shape)} from "
                        f"{_how(state)}")
            diff = _first_diff(have.to(device), want[key], packed=key in ("w13", "w2") and state.plan.weight_format == "mxfp4")
            if diff is not None:
                idx, value, should = diff
                where = _locate(state, L, prefix, key, (idx[0] + e0, *idx[1:]))
                how = "the reference holds" if key.endswith("_bias") else f"{_how(state)} gives"
                return f"layer {L}: {where}: the output holds {value}, {how} {should}"
        del want
    return None


def _canonical_order(key: str) -> tuple[str, bool, bool, str]:
    """w13 before w2; in each, the data, then its scales, then the bias."""
    return key.split(".")[0].split("_")[0], "scale" in key, "bias" in key, key


def _first_diff(got: torch.Tensor, want: torch.Tensor, packed: bool) -> tuple[tuple[int, ...], str, str] | None:
    """(index, output's value, expected value) of the first bit pattern that differs, or None.
    ``packed`` MXFP4 data is indexed by element (two E2M1 codes a byte, the low nibble first), other
    tensors by their own elements."""
    want = want.to(got.device, got.dtype)  # a bias: the reference's, cast as the conversion casts it
    as_int = _INT_OF_SIZE[got.element_size()]
    a, b = got.contiguous().view(as_int), want.contiguous().view(as_int)
    if torch.equal(a, b):
        return None
    idx = tuple(int(i) for i in (a != b).nonzero()[0])
    x, y = got[idx], want[idx]
    if packed:
        high = bool(((int(x) ^ int(y)) & 0x0F) == 0)
        code = lambda v: (int(v) >> 4) if high else (int(v) & 0x0F)  # noqa: E731
        return (*idx[:-1], 2 * idx[-1] + int(high)), f"E2M1 code 0x{code(x):x}", f"0x{code(y):x}"
    if got.dtype == torch.uint8:
        return idx, f"byte 0x{int(x):02x}", f"0x{int(y):02x}"
    return idx, repr(float(x)), repr(float(y))


def _locate(state: VerifyState, L: int, prefix: str, key: str, idx: tuple[int, ...]) -> str:
    """The output tensor and index of canonical element ``idx`` of stack ``key``."""
    which, _, part = key.partition(".")
    if part:  # block-FP8: part j of w13 (gate, up) or w2, data rows or tile scales
        j = int(part)
        if which.endswith("_scale_inv"):
            idx = (idx[0], j, *idx[1:])
        else:  # gate and up have I rows each, down H
            idx = (idx[0], idx[1] + j * state.plan.info.intermediate_size, idx[2])
    ref = state.own_refs.get(L)
    if state.plan.kind == "kernel" or state.own_reader is None or ref is None:
        coords = "expert, row" + (", block" if which.endswith("_scale") else "" if which.endswith("_bias") else ", column")
        return f"{prefix}.experts.{_KERNEL_NAMES.get(which, which)} at canonical {which} [{', '.join(map(str, idx))}] ({coords})"
    try:
        return state.own_reader.source_location(ref, which, idx)
    except (ValueError, IndexError, KeyError):  # a reader that cannot place it: the canonical index
        return f"{prefix}.experts ({which}) at canonical [{', '.join(map(str, idx))}]"


# ---- copied tensors --------------------------------------------------------------------------


def start_copies(state: VerifyState, skip: set[str]) -> None:
    """Start hashing, on the hash pool, every reference tensor the output copied (roles copy and
    router, named once whatever the TP size), except ``skip``."""
    assert state.ref_ckpt is not None
    names = set(copied_tensors(state.plan.manifest)) - skip
    present = {n for n in names if n in state.ref_ckpt.tensors}
    state.ref_copies = state.hashes.start_other(state.ref_ckpt, sorted(present))
    state.ref_missing = sorted(names - present)


def copies_differ(state: VerifyState) -> list[str]:
    """Copied tensors whose bytes are not the reference's (after :func:`start_copies`). BadInput when
    the reference's tensor cannot be read (a reference that cannot be read is bad input)."""
    if state.ref_copies is None:
        return []
    out = [f"{name}: copied into the output but not in the reference {state.plan.options.reference}" for name in state.ref_missing]
    keys_of = copied_tensors(state.plan.manifest)
    for name, job in sorted(state.ref_copies.items()):
        digest = _digest(state, name, job)
        out += [f"{key}: not the reference's bytes (tensors left alone are copied byte for byte)"
                for key in keys_of[name] if digest != state.plan.manifest.tensors[key].sha256]
    return out


def _digest(state: VerifyState, name: str, job: Future[str]) -> str:
    try:
        return job.result()
    except BadInput:
        raise
    except Exception as exc:  # noqa: BLE001 - an OSError, a short read: the reference is bad input
        raise BadInput(f"VerifyOptions.reference {state.plan.options.reference}: tensor {name} cannot be read: {exc}") from exc


def refused_summary(state: VerifyState, layers: list[int]) -> str | None:
    """Why some checked layers' expert bytes were not re-derived (the scope's words), or None."""
    if not state.bytes_refused:
        return None
    parts = []
    for why, where in state.bytes_refused.items():
        parts.append(why if sorted(where) == sorted(layers) else f"{why} (layers {','.join(map(str, sorted(where)))})")
    return "; ".join(parts)


__all__ = ["check_expert_bytes", "copies_differ", "refused_summary", "start_copies"]
