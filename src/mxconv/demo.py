"""``mxconv demo``: tiny checkpoints through quantize -> repack (every backend) -> verify."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from mxconv.layouts import backend_names, get_layout
from mxconv.run.conversion import Conversion, RunSettings
from mxconv.run.options import QuantOptions, RepackOptions, WeightFormat
from mxconv.verify import VerifyOptions, verify

# (label, generator kind): one gpt-oss-style source with expert biases (interleaved gate/up,
# SwiGLU-OAI) and one Qwen-style source (halves, SiLU, no biases). Sizes need backend padding.
DEMO_SOURCES = (("gpt-oss (bf16, biases)", "gpt-oss-bf16"), ("qwen3-moe (bf16)", "qwen3-moe"))
NOT_WRITTEN = "not written: "


def _convert(src: Path, out: Path, quant: QuantOptions, repack: RepackOptions | None, device: torch.device) -> dict[str, Any]:
    conversion = Conversion.open(src, quant, repack)
    argv = ("mxconv", conversion.plan.command, str(src), str(out))
    return conversion.run(out, device=device, settings=RunSettings(max_shard_size=2_000_000, overwrite=True, argv=argv))


def run_demo(workdir: Path | None, device: torch.device, progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Run the whole flow; returns {"passed": bool, "steps": [...]} (one row per step)."""
    from mxconv.examples import make_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="mxconv-demo-")) if workdir is None else Path(workdir)
    tmp.mkdir(parents=True, exist_ok=True)
    steps: list[dict[str, Any]] = []

    def record(source: str, step: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        progress(f"{source}: {step}")
        try:
            res = fn()
        except Exception as exc:  # noqa: BLE001 - the demo reports every failure in its table
            steps.append({"source": source, "step": step, "ok": False, "detail": f"{type(exc).__name__}: {exc}"})
            return None
        steps.append({"source": source, "step": step, **res})
        return res

    try:
        for label, kind in DEMO_SOURCES:
            src = tmp / kind
            record(label, "generate", lambda: (make_checkpoint(src, kind), {"ok": True, "detail": str(src)})[1])
            _quantize_steps(record, steps, label, src, tmp / kind, device)
            for backend in backend_names():
                layout = get_layout(backend)
                fmt = layout.weight_formats[0]  # the experts it takes (xpu: MXFP8 only)
                canon = tmp / f"{kind}-{fmt}"
                refusal = _declared_refusal(src, backend, fmt)
                # activations storing a source's FP8 input scales (W4A8) need a source that has them; these do not
                for act in (a for a in layout.format_activations(fmt) if a not in layout.input_scale_activations):
                    kdir = tmp / f"{kind}-{backend}-{act}"
                    step = f"repack {backend} ({act})"
                    if refusal is not None:  # shown as such, nothing written; any other planning error fails the step
                        steps.append({"source": label, "step": step, "ok": True, "detail": f"{NOT_WRITTEN}{refusal}"})
                        continue
                    if record(label, step, lambda: _repack_step(canon, kdir, backend, act, device)) is not None:
                        record(label, f"verify {backend} ({act}) vs {fmt}", lambda: _verify_step(kdir, canon))
            tp_backend = backend_names()[0]  # TP 2 through the first registered backend
            tp_act = get_layout(tp_backend).activations[0]
            tpdir, canon = tmp / f"{kind}-{tp_backend}-tp2", tmp / f"{kind}-{get_layout(tp_backend).weight_formats[0]}"
            if record(label, f"repack {tp_backend} --tp 2", lambda: _repack_step(canon, tpdir, tp_backend, tp_act, device, tp=2)):
                record(label, f"verify {tp_backend} tp2 vs bf16", lambda: _verify_step(tpdir, src))
    finally:
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"passed": all(s["ok"] for s in steps), "device": str(device), "steps": steps}


def _quantize_steps(record: Callable[..., Any], steps: list[dict[str, Any]], label: str, src: Path, base: Path,
                    device: torch.device) -> None:
    """quantize to each format and verify against the source; block FP8 also from the MXFP4 output
    (the exact re-encode, verified against it). A format the family does not write is shown as such."""
    from mxconv.families import detect_family
    from mxconv.source.checkpoint import open_checkpoint

    reader = detect_family(open_checkpoint(src))
    for fmt, origin in (("mxfp4", src), ("mxfp8", src), ("fp8-block", src), ("fp8-block", Path(f"{base}-mxfp4"))):
        what = f"quantize {fmt}" + (" from mxfp4" if origin != src else "")
        why = reader.format_refusal(fmt)
        if why:
            if origin == src:
                steps.append({"source": label, "step": what, "ok": True, "detail": f"not written: {why.split(', because ')[-1][:60]}..."})
            continue
        qdir = Path(f"{base}-{fmt}" + ("-from-mxfp4" if origin != src else ""))
        if record(label, what, lambda: _quant_step(origin, qdir, fmt, device)) is not None:
            record(label, f"verify {fmt} vs {'mxfp4' if origin != src else 'bf16'}", lambda: _verify_step(qdir, origin))


def _quant_step(src: Path, out: Path, fmt: str, device: torch.device) -> dict[str, Any]:
    s = _convert(src, out, QuantOptions(fmt=fmt), None, device)
    return {"ok": True, "rel_rms": s["relative_rms_error"], "detail": f"{s['tensors_out']} tensors, weight rel RMS"}


def _declared_refusal(src: Path, backend: str, fmt: str) -> str | None:
    """Why ``backend`` declares it refuses the experts of the source ``src`` in ``fmt`` (its bytes for that
    format hold no expert biases and the source has them), or None: the repack must then plan and run."""
    from mxconv.families import detect_family
    from mxconv.source.checkpoint import open_checkpoint

    has_bias = detect_family(open_checkpoint(src)).model_info().has_expert_bias
    return get_layout(backend).bias_refusal(fmt) if has_bias else None


def _repack_step(src: Path, out: Path, backend: str, act: str, device: torch.device, tp: int = 1) -> dict[str, Any]:
    """Repack ``src`` (planning errors propagate: the demo fails the step)."""
    s = _convert(src, out, QuantOptions(WeightFormat.MXFP4), RepackOptions(backend, act, tp), device)
    sizes = s.get("sizes", {})
    return {"ok": True, "detail": f"H {sizes.get('hidden_size')}->{sizes.get('padded_hidden_size')}, "
            f"I {sizes.get('intermediate_size_per_rank')}->{sizes.get('padded_intermediate_size')}"}


def _verify_step(path: Path, reference: Path) -> dict[str, Any]:
    rep = verify(path, VerifyOptions(reference=str(reference), tokens=32, seed=0))
    worst = max((r.comparison.rel_rms for r in rep.layers if r.comparison), default=None)
    problems = rep.problems + [p for r in rep.layers for p in r.problems]
    kinds = sorted({r.threshold for r in rep.layers if r.threshold})
    detail = "; ".join(problems[:2]) if problems else f"output rel RMS (threshold {'/'.join(kinds)})"
    return {"ok": rep.passed, "rel_rms": worst, "detail": detail}
