"""verify, linear layers (``quantize --targets linear``, :mod:`mxconv.run.linears`): every MXFP8 linear
outside the routed experts.

* Files: ``{module}.weight`` F8_E4M3 ``[N, K]`` with ``{module}.weight_scale`` U8 ``[N, K/32]``; no
  E8M0 NaN byte (0xFF), no E4M3 NaN element.
* Claims: the MXFP8 linears are exactly those the manifest lists, and ``quantization_config``
  describes exactly them as quantized and every other linear as not (:func:`mxconv.run.linear_config.config_quantizes`).
* With ``--reference``: each one against the reference's weight (float, block-FP8 dequantized in
  fp32, or MXFP8): relative RMS error within :data:`LINEAR_THRESHOLDS` (MXFP8 E4M3 weights: ≈ 0.027,
  mx-numerics.md §6; exactly 0 for a linear that was MXFP8 already), and the bytes equal the
  reference quantized again with the manifest's scale rounding (what mxconv writes, on any device);
  every tensor the output copied is the reference's, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mxconv.source.checkpoint import layer_index
from mxconv.errors import BadInput
from mxconv.families.quant_config import quantization_dict
from mxconv.run.linear_config import config_quantizes
from mxconv.run.linears import LINEAR_FORMAT, linear_modules, read_float, tensor_role
from mxconv.verify.reference_moe import apart
from mxconv.verify.report import Run

# Relative RMS error bound of one MXFP8 linear weight vs its float source (E4M3: ≈ 0.027 with rceil,
# 0.029-0.033 with floor on Gaussian and heavy-tailed weights; a wrong scale or row is ≈ 1).
LINEAR_THRESHOLDS: dict[str, float] = {"rel_rms": 0.05}


@dataclass
class LinearReport:
    module: str
    role: str
    files: str = "ok"
    numerics: str = "skipped"
    rel_rms: float | None = None
    bytes: str = "n/a"  # "bit-exact" | "FAIL" (vs the reference quantized again) | "n/a"
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"module": self.module, "role": self.role, "files": self.files, "numerics": self.numerics,
                "rel_rms": self.rel_rms, "bytes": self.bytes, "problems": self.problems, "passed": self.passed}


def check_linears(run: Run, layers: set[int] | None) -> tuple[list[LinearReport], list[str]]:
    """Per-linear reports (only layers in ``layers`` when given) and problems of the whole output."""
    ckpt = run.ckpts[0]
    claimed = run.manifest.get("linears")
    found = list(linear_modules(ckpt))
    mx = [m for m, _, is_mx in found if is_mx]
    if not mx and claimed is None:
        return [], []
    general: list[str] = []
    if claimed is not None:
        listed = set(claimed.get("quantized") or []) | set(claimed.get("carried_mx") or [])
        for m in sorted(listed - set(mx)):
            general.append(f"{m}: the manifest lists it as an MXFP8 linear, the checkpoint holds no MXFP8 weight for it")
        for m in sorted(set(mx) - listed):
            general.append(f"{m}: an MXFP8 linear the manifest does not list")
    qc = quantization_dict(ckpt)
    for m, _, is_mx in found:
        if config_quantizes(qc, m) != is_mx:
            general.append(f"{m}: config.json's quantization_config describes it as "
                           f"{'not quantized' if is_mx else 'quantized'}, but its weight is {'' if is_mx else 'not '}MXFP8")
    if claimed is not None and run.ref_ckpt is not None:
        general += _copies_differ(run, {f"{m}.{p}" for m in mx for p in ("weight", "weight_scale")})
    rounding = (claimed or {}).get("scale_rounding") or run.manifest.get("scale_rounding")
    reports = [_check_one(run, m, rounding) for m in mx if layers is None or layer_index(m) in layers]
    return reports, general


def _check_one(run: Run, module: str, rounding: str | None) -> LinearReport:
    from mxconv.mx.numerics import first_nan_scale, first_nonfinite

    ckpt = run.ckpts[0]
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
    if run.ref_ckpt is None:
        return rep
    try:
        ref = read_float(run.ref_ckpt, module, run.device)
    except BadInput as exc:
        rep.numerics = "FAIL"
        rep.problems.append(f"{module}: no reference weight to compare with ({exc})")
        return rep
    from mxconv.mx.numerics import dequantize_mx

    got = dequantize_mx(data.to(run.device), scales.to(run.device), LINEAR_FORMAT)
    if got.shape != ref.shape:
        rep.numerics = "FAIL"
        rep.problems.append(f"{module}: shape {list(got.shape)}, the reference has {list(ref.shape)}")
        return rep
    ref_is_mx = run.ref_ckpt.tensors[f"{module}.weight"].dtype == "F8_E4M3" and f"{module}.weight_scale" in run.ref_ckpt.tensors
    norm = float(ref.square().sum().sqrt())
    err = float((got - ref).square().sum().sqrt())
    rep.rel_rms = err / norm if norm > 0 else (0.0 if err == 0 else float("inf"))
    bound = 0.0 if ref_is_mx else LINEAR_THRESHOLDS["rel_rms"]
    rep.numerics = "ok" if rep.rel_rms <= bound else "FAIL"
    if rep.numerics == "FAIL":
        rep.problems.append("{} numerics: relative RMS error {} vs the reference > {}".format(module, *apart(rep.rel_rms, bound)))
    if ref_is_mx or rounding:
        if ref_is_mx:
            want_d = run.ref_ckpt.read(f"{module}.weight").view(torch.uint8)
            want_s = run.ref_ckpt.read(f"{module}.weight_scale").view(torch.uint8)
        else:
            from mxconv.kernels.quantize import quantize_mx

            want_d, want_s = (t.cpu() for t in quantize_mx(ref, LINEAR_FORMAT, rounding))
        same = torch.equal(want_d, data) and torch.equal(want_s, scales)
        rep.bytes = "bit-exact" if same else "FAIL"
        if not same:
            how = "the reference's MXFP8 bytes" if ref_is_mx else f"the reference quantized with {rounding} scales"
            rep.problems.append(f"{module}: bytes differ from {how}")
    return rep


def _copies_differ(run: Run, mx_names: set[str]) -> list[str]:
    """Tensors the output copied (not quantized; MXFP8 linears carried over are checked as linears)
    whose bytes are not the reference's."""
    from mxconv.verify.hashing import sha256_of

    assert run.ref_ckpt is not None
    out = []
    for name, entry in run.manifest["tensors"].items():
        if entry.get("role") not in ("copy", "router") or name in mx_names:
            continue
        if name not in run.ref_ckpt.tensors:
            out.append(f"{name}: copied into the output but not in the reference {run.reference}")
        elif sha256_of(run.ref_ckpt, name) != entry["sha256"]:
            out.append(f"{name}: not the reference's bytes (tensors left alone are copied byte for byte)")
    return out


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
