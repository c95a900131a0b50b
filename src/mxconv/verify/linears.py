"""verify, linear layers (``quantize --targets linear``, :mod:`mxconv.run.linears`): every MXFP8 linear
outside the routed experts (every block-FP8 one in an ``fp8-block`` output: ``weight`` F8_E4M3 +
``weight_scale_inv`` F32 per 128x128 tile, finite, within the bound, and byte for byte the reference
quantized again with amax/448; the fp8 config must leave exactly them out of ``modules_to_not_convert``).

* Files: ``{module}.weight`` F8_E4M3 ``[N, K]`` with ``{module}.weight_scale`` U8 ``[N, K/32]``; no
  E8M0 NaN byte (0xFF), no E4M3 NaN element.
* Claims: the MXFP8 linears are exactly those the manifest lists, and ``quantization_config``
  describes exactly them as quantized and every other linear as not (:func:`mxconv.run.linear_config.config_quantizes`).
* With ``--reference``: each one against the reference's weight (float, block-FP8 dequantized in
  fp32, or MXFP8): relative RMS error within :data:`LINEAR_THRESHOLDS` (MXFP8 E4M3 weights: ≈ 0.027,
  mx-numerics.md §6; exactly 0 for a linear that was MXFP8 already), and the bytes equal the
  reference quantized again with the manifest's scale rounding (what mxconv writes, on any device).
  The tensors the output copied are compared with the reference's by :mod:`mxconv.verify.exact`.
"""

from __future__ import annotations

from typing import Any

import torch

from mxconv.source.checkpoint import layer_index
from mxconv.errors import BadInput
from mxconv.families.quant_config import quantization_dict
from mxconv.run.linear_config import config_quantizes
from mxconv.run.linears import FP8_BLOCK, LINEAR_FORMAT, is_fp8_block_linear, linear_modules, read_float, tensor_role
from mxconv.verify.reference_moe import apart
from mxconv.verify.report import LinearReport
from mxconv.verify.state import VerifyState

# Relative RMS error bound of one MXFP8 linear weight vs its float source (E4M3: ≈ 0.027 with rceil,
# 0.029-0.033 with floor on Gaussian and heavy-tailed weights; a wrong scale or row is ≈ 1).
# Block FP8 (E4M3, one amax/448 scale per 128x128 tile): ≈ 0.027 on Gaussian weights like MXFP8, more
# where one outlier sets a whole tile's scale; the same 0.05.
LINEAR_THRESHOLDS: dict[str, float] = {"rel_rms": 0.05, FP8_BLOCK: 0.05}


def check_linears(state: VerifyState, layers: set[int] | None) -> tuple[list[LinearReport], list[str]]:
    """Per-linear reports (only layers in ``layers`` when given) and problems of the whole output."""
    ckpt = state.plan.ckpts[0]
    claimed = state.plan.manifest.linears  # mxconv.run.linears.LinearSelection.to_json
    fp8 = state.plan.manifest.weight_format == FP8_BLOCK  # its linears are block FP8, not MXFP8
    kind = "block-FP8" if fp8 else "MXFP8"
    found = _found(state)
    mx = [m for m, quantized in found if quantized]
    if not mx and claimed is None:
        return [], []
    general: list[str] = []
    if claimed is not None:
        listed = set(claimed.quantized) | set(claimed.carried_mx)
        for m in sorted(listed - set(mx)):
            general.append(f"{m}: the manifest lists it as an {kind} linear, the checkpoint holds no {kind} weight for it")
        for m in sorted(set(mx) - listed):
            general.append(f"{m}: an {kind} linear the manifest does not list")
    qc = quantization_dict(ckpt)
    for m, quantized in found:
        if config_quantizes(qc, m) != quantized:
            general.append(f"{m}: config.json's quantization_config describes it as "
                           f"{'not quantized' if quantized else 'quantized'}, but its weight is {'' if quantized else 'not '}{kind}")
    rounding = (claimed.scale_rounding if claimed is not None else None) or state.plan.manifest.scale_rounding
    check = _check_fp8 if fp8 else _check_one
    reports = [check(state, m, rounding) for m in mx if layers is None or layer_index(m) in layers]
    return reports, general


def _found(state: VerifyState) -> list[tuple[str, bool]]:
    """(module, quantized) of every linear of the output: MXFP8, or block FP8 in an fp8-block output."""
    ckpt = state.plan.ckpts[0]
    fp8 = state.plan.manifest.weight_format == FP8_BLOCK
    return [(m, is_fp8_block_linear(ckpt, m) if fp8 else is_mx) for m, _, is_mx in linear_modules(ckpt)]


def quantized_linear_tensors(state: VerifyState) -> set[str]:
    """The weight and scale tensors of the output's quantized linears, which :func:`check_linears`
    checks against the reference (not as copies: an MXFP8 linear carried from an MXFP8 source is
    held to that source's bytes, or to the reference quantized again)."""
    scale = "weight_scale_inv" if state.plan.manifest.weight_format == FP8_BLOCK else "weight_scale"
    return {f"{m}.{p}" for m, quantized in _found(state) if quantized for p in ("weight", scale)}


def _bad_value(rep: LinearReport, tensors: dict[str, torch.Tensor]) -> bool:
    """A NaN/Inf in the output's tensors (name -> fp32 values) fails the linear, naming where."""
    from mxconv.mx.numerics import first_nonfinite

    for name, t in tensors.items():
        at = first_nonfinite(t)
        if at is not None:
            rep.files = rep.numerics = "FAIL"
            rep.problems.append(f"{rep.module}: a non-finite value in {name} [{', '.join(map(str, at))}]: "
                                "a value that is not a number never passes")
            return True
    return False


def _reference(state: VerifyState, rep: LinearReport, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The reference's fp32 weight of the linear, or None (and a problem) when there is none of that shape."""
    assert state.ref_ckpt is not None
    try:
        ref = read_float(state.ref_ckpt, rep.module, state.plan.device)
    except BadInput as exc:
        rep.numerics = "FAIL"
        rep.problems.append(f"{rep.module}: no reference weight to compare with ({exc})")
        return None
    if tuple(ref.shape) != tuple(shape):
        rep.numerics = "FAIL"
        rep.problems.append(f"{rep.module}: shape {list(shape)}, the reference has {list(ref.shape)}")
        return None
    return ref


def _rel_rms(rep: LinearReport, got: torch.Tensor, ref: torch.Tensor, bound: float) -> None:
    norm = float(ref.square().sum().sqrt())
    err = float((got - ref).square().sum().sqrt())
    rep.rel_rms = err / norm if norm > 0 else (0.0 if err == 0 else float("inf"))
    rep.numerics = "ok" if rep.rel_rms <= bound else "FAIL"
    if rep.numerics == "FAIL":
        rep.problems.append("{} numerics: relative RMS error {} vs the reference > {}".format(rep.module, *apart(rep.rel_rms, bound)))


def _check_fp8(state: VerifyState, module: str, rounding: str | None) -> LinearReport:
    """A block-FP8 linear: finite, within :data:`LINEAR_THRESHOLDS` ``fp8-block`` of the reference, and
    byte for byte the reference quantized again (amax/448 per 128x128 tile)."""
    from mxconv.mx.fp8_block import float_to_fp8_block
    from mxconv.mx.numerics import dequantize_fp8_block

    ckpt = state.plan.ckpts[0]
    rep = LinearReport(module, tensor_role(f"{module}.weight"))
    data, sinv = ckpt.read(f"{module}.weight"), ckpt.read(f"{module}.weight_scale_inv")
    if _bad_value(rep, {f"{module}.weight": data.float(), f"{module}.weight_scale_inv": sinv}) or state.ref_ckpt is None:
        return rep
    ref = _reference(state, rep, tuple(data.shape))
    if ref is None:
        return rep
    got = dequantize_fp8_block(data[None].to(state.plan.device), sinv[None].to(state.plan.device), (128, 128))[0]
    _rel_rms(rep, got, ref, LINEAR_THRESHOLDS[FP8_BLOCK])
    want = float_to_fp8_block(ref[None])
    same = torch.equal(want.data[0].cpu().view(torch.uint8), data.view(torch.uint8)) and torch.equal(
        want.scale_inv[0].cpu().view(torch.int32), sinv.view(torch.int32))
    rep.bytes = "bit-exact" if same else "FAIL"
    if not same:
        rep.problems.append(f"{module}: bytes differ from the reference block-quantized again (amax/448 per 128x128 block)")
    return rep


def _check_one(state: VerifyState, module: str, rounding: str | None) -> LinearReport:
    from mxconv.mx.numerics import first_nan_scale, first_nonfinite

    ckpt = state.plan.ckpts[0]
    rep = LinearReport(module, tensor_role(f"{module}.weight"))
    data = ckpt.read(f"{module}.weight").view(torch.uint8)
    scales = ckpt.read(f"{module}.weight_scale").view(torch.uint8)
    at = first_nan_scale(scales)
    if at is None:
        at = first_nonfinite(data.view(torch.float8_e4m3fn).float())
        what = "an E4M3 NaN element" if at is not None else None
    else:
        what = "an E8M0 NaN scale byte 0xFF"
    if what:
        rep.files = rep.numerics = "FAIL"
        rep.problems.append(f"{module}: {what} in {module}.{'weight_scale' if 'scale' in what else 'weight'} "
                            f"[{', '.join(map(str, at))}]: a value that is not a number never passes")
        return rep
    if state.ref_ckpt is None:
        return rep
    from mxconv.mx.numerics import dequantize_mx

    got = dequantize_mx(data.to(state.plan.device), scales.to(state.plan.device), LINEAR_FORMAT)
    ref = _reference(state, rep, tuple(got.shape))
    if ref is None:
        return rep
    ref_is_mx = state.ref_ckpt.tensors[f"{module}.weight"].dtype == "F8_E4M3" and f"{module}.weight_scale" in state.ref_ckpt.tensors
    _rel_rms(rep, got, ref, 0.0 if ref_is_mx else LINEAR_THRESHOLDS["rel_rms"])
    if ref_is_mx or rounding:
        if ref_is_mx:
            want_d = state.ref_ckpt.read(f"{module}.weight").view(torch.uint8)
            want_s = state.ref_ckpt.read(f"{module}.weight_scale").view(torch.uint8)
        else:
            from mxconv.kernels.quantize import quantize_mx

            want_d, want_s = (t.cpu() for t in quantize_mx(ref, LINEAR_FORMAT, rounding))
        same = torch.equal(want_d, data) and torch.equal(want_s, scales)
        rep.bytes = "bit-exact" if same else "FAIL"
        if not same:
            how = "the reference's MXFP8 bytes" if ref_is_mx else f"the reference quantized with {rounding} scales"
            rep.problems.append(f"{module}: bytes differ from {how}")
    return rep


def role_summary(reports: list[LinearReport]) -> list[dict[str, Any]]:
    """Per role: how many linears, their verdicts and the largest relative RMS error (the CLI table)."""
    rows: dict[str, dict[str, Any]] = {}
    for r in reports:
        row = rows.setdefault(r.role, {"role": r.role, "linears": 0, "failed": 0, "max_rel_rms": None, "bit_exact": 0})
        row["linears"] += 1
        row["failed"] += not r.passed
        row["bit_exact"] += r.bytes == "bit-exact"
        if r.rel_rms is not None:
            row["max_rel_rms"] = max(row["max_rel_rms"] or 0.0, r.rel_rms)
    return list(rows.values())
