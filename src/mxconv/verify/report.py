"""What ``verify`` reports (per layer, per linear and overall) and its pass/fail thresholds: the typed
result of a run (:class:`VerifyReport`), its ``to_json`` the document ``mxconv verify --json`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mxconv.verify.reference_moe import Comparison
from mxconv.verify.kernel import KernelResult

# Pass/fail thresholds of the numerics check, by (converted weight format, reference kind).
# MX error figures from mx-numerics.md §6: a weight's relative RMS error is ≈ 0.115 (MXFP4) and
# ≈ 0.027 (MXFP8 E4M3); through gate/up, the activation and down it compounds to ≈ 0.16 / 0.04
# on layer outputs (0.19-0.21 measured on the demo's Gaussian experts). The limits leave headroom
# for heavy-tailed weights (Student-t MXFP4 weight error ≈ 0.15) and are far below what a layout
# bug gives (≈ 1.0 or more: wrong rows or experts decorrelate the output).
THRESHOLDS: dict[str, dict[str, float]] = {
    "exact": {"rel_rms": 1e-6, "cosine": 0.999999, "topk_agreement": 1.0},
    "mxfp4": {"rel_rms": 0.30, "cosine": 0.95, "topk_agreement": 1.0},
    "mxfp8": {"rel_rms": 0.06, "cosine": 0.998, "topk_agreement": 1.0},
    # block FP8 (E4M3, one amax/448 scale per 128x128 tile) vs a float reference: weight error ≈ 0.027
    # like MXFP8 (measured 0.026 on Gaussian experts); from MXFP4 only the inexact tiles differ
    "fp8-block": {"rel_rms": 0.08, "cosine": 0.996, "topk_agreement": 1.0},  # 0.047 measured on layer outputs
    # INT4 (group 32, bf16 scales) outputs against a float reference: 16 levels per group, an error of
    # the MXFP4 order (an INT4 reference holds the same values: "exact")
    "int4": {"rel_rms": 0.30, "cosine": 0.95, "topk_agreement": 1.0},
}


@dataclass
class LayerReport:
    layer: int
    integrity: str = "ok"
    layout: str = "n/a"
    numerics: str = "skipped"
    comparison: Comparison | None = None
    threshold: str | None = None
    problems: list[str] = field(default_factory=list)
    kernel: KernelResult | None = None  # verify --kernel
    fp8_tiles: dict[str, int] | None = None  # fp8-block vs an MXFP4 reference: "tiles", "bit_equal", "inexact" counts

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "integrity": self.integrity,
            "layout": self.layout,
            "numerics": self.numerics,
            "threshold": self.threshold,
            "comparison": self.comparison.to_json() if self.comparison else None,
            "kernel": self.kernel.to_json() if self.kernel else None,
            "problems": self.problems,
            "passed": self.passed,
            **({"fp8_tiles": self.fp8_tiles} if self.fp8_tiles is not None else {}),
        }


@dataclass
class LinearReport:
    """One MXFP8 (or block-FP8) linear layer outside the experts (:mod:`mxconv.verify.linears`)."""

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


@dataclass
class Scope:
    """What one verify run covered, and what it did not and why: the verdict line states it, so a
    PASS never claims more than was checked."""

    checked: list[str]  # "integrity", "layout", "bytes", "numerics", "kernel"
    not_checked: dict[str, str] = field(default_factory=dict)  # check -> why it did not run
    numerics_against: str | None = None  # the --reference SOURCE, or the --reference-outputs FILE
    bytes_against: str | None = None  # --reference: the SOURCE the output's bytes were compared with
    kernel: str | None = None  # --kernel: the backend whose engine kernel ran
    layers: list[int] | None = None  # --layers: the layers layout, numerics and kernel covered (None: all)

    def summary(self) -> str:
        """e.g. "integrity, layout; numerics not checked: no --reference or --reference-outputs given",
        "integrity, layout, bytes and numerics vs /data/src"."""
        done = [c for c in self.checked if c not in ("kernel", "bytes")]
        bytes_vs = f"bytes vs {self.bytes_against}" if "bytes" in self.checked else None
        if "numerics" in done and self.numerics_against:
            both = bytes_vs is not None and self.bytes_against == self.numerics_against
            done[done.index("numerics")] = f"{'bytes and ' if both else ''}numerics vs {self.numerics_against}"
            bytes_vs = None if both else bytes_vs
        parts = [", ".join(done + ([bytes_vs] if bytes_vs else []))]
        if self.kernel is not None:
            parts.append(f"kernel: the {self.kernel} engine kernel")
        per_layer = [c for c in self.checked if c != "integrity"]  # integrity covers every tensor
        if self.layers is not None and per_layer:
            parts.append(f"{', '.join(per_layer)} of layers {','.join(map(str, self.layers))} only")
        by_reason: dict[str, list[str]] = {}
        for what, why in self.not_checked.items():
            if what != "bytes":
                by_reason.setdefault(why, []).append(what)
        parts += [f"{', '.join(whats)} not checked: {why}" for why, whats in by_reason.items()]
        if "bytes" in self.not_checked:  # with --reference: the copies were compared, the experts' bytes not
            parts.append(f"expert bytes not re-derived: {self.not_checked['bytes']}")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"checked": self.checked, "not_checked": self.not_checked, "numerics_against": self.numerics_against,
                "bytes_against": self.bytes_against,
                "kernel": self.kernel, "layers": self.layers, "summary": self.summary()}


@dataclass
class VerifyReport:
    path: str
    kind: str
    backend: str | None
    layers: list[LayerReport]
    problems: list[str]  # not tied to one layer
    notes: list[str]
    linears: list[LinearReport] = field(default_factory=list)  # MXFP8 (block-FP8) linear layers
    scope: Scope = field(default_factory=lambda: Scope([]))

    @property
    def verdict(self) -> str:
        """The last line of ``mxconv verify``: PASS or FAIL and what it covers."""
        return f"{'PASS' if self.passed else 'FAIL'} ({self.scope.summary()})"

    @property
    def passed(self) -> bool:
        return not self.problems and all(r.passed for r in self.layers) and all(r.passed for r in self.linears)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "backend": self.backend,
            "passed": self.passed,
            "verdict": self.verdict,
            "scope": self.scope.to_json(),
            "problems": self.problems,
            "notes": self.notes,
            "layers": [r.to_json() for r in self.layers],
            "thresholds": THRESHOLDS,
            "linears": [r.to_json() for r in self.linears],
        }
