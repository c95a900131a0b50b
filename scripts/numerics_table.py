"""Weight and layer-output error of every MX scale rule, for both formats, on several weight
distributions: the evidence behind mxconv's default ``--scale-rounding`` (docs/numerics.md).

For each distribution, format and rule it quantizes one expert's weights (w13 [2I, H], w2 [H, I],
bf16, scaled like real checkpoints) with mxconv's own quantizer, dequantizes, and reports

* weight error: relative RMS of W_q - W over the whole matrix;
* layer error: relative RMS of the SwiGLU expert output, y = W2 (silu(W1 x) * (W3 x)), computed in
  fp32 with the quantized vs the original weights on Gaussian inputs of RMS 1 (heavy channels
  included, as ``mxconv.verify.reference_moe.hidden_states`` makes them).

Ratios are given against the rceil rule measured in the same run. Distributions:

* gaussian: N(0, 0.02);
* student-t: Student-t with 3 degrees of freedom, scaled to the same RMS (heavy tails);
* outliers: Gaussian plus 4 entries per row multiplied by 20 (a few outliers per row);
* real: the weight matrices of real models, ``--real PATH [PATH ...]`` (safetensors files, or torch
  state dicts ``.pt``/``.pth`` loaded with ``weights_only``): every 2-D float tensor whose last axis
  is a multiple of 32, in bf16. Their layer error is that of the linear layer itself, y = x W^T, on
  the same kind of inputs (a real model's matrices are not one SwiGLU expert). Two small models
  ship their trained weights inside their PyPI wheels (``pip download --no-deps``):
  ``silero-vad`` (``silero_vad/data/silero_vad_16k.safetensors``: LSTM [512, 128] x 2) and
  ``Resemblyzer`` (``resemblyzer/pretrained.pt``: LSTM [1024, 256] x 5, linear [256, 256]).

Usage: python scripts/numerics_table.py [--hidden 1024 --intermediate 512 --seeds 3 --json out.json]
                                       [--real silero-vad=FILE.safetensors resemblyzer=FILE.pt]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _args import parser  # noqa: E402
from mxconv.mx.formats import FORMATS, SCALE_MODES  # noqa: E402
from mxconv.mx.numerics import dequantize_mx, quantize_mx_torch  # noqa: E402
from mxconv.verify.reference_moe import hidden_states  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm())


def qdq(w: torch.Tensor, fmt: str, rule: str) -> torch.Tensor:
    """Quantize then dequantize ``w`` [N, K] (bf16) to fp32."""
    d, s = quantize_mx_torch(w, fmt, rule)
    return dequantize_mx(d, s, fmt)


def make_weights(kind: str, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """bf16 [rows, cols] of distribution ``kind`` with RMS about 0.02."""
    if kind == "gaussian":
        w = torch.randn(rows, cols, generator=g)
    elif kind == "student-t":
        z = torch.randn(rows, cols, generator=g)
        chi = torch.randn(rows, cols, 3, generator=g).pow(2).sum(-1)
        w = z / (chi / 3).sqrt()
        w = w / w.pow(2).mean().sqrt()
    elif kind == "outliers":
        w = torch.randn(rows, cols, generator=g)
        idx = torch.randint(0, cols, (rows, 4), generator=g)
        w.scatter_(1, idx, w.gather(1, idx) * 20)
    else:
        raise ValueError(kind)
    return (w * 0.02).to(torch.bfloat16)


def expert_error(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, fmt: str, rule: str, x: torch.Tensor) -> tuple[float, float]:
    """(weight rel RMS over the three matrices, SwiGLU output rel RMS)."""
    ws = (w1, w3, w2)
    qs = tuple(qdq(w, fmt, rule) for w in ws)
    num = sum(float((q - w.float()).double().pow(2).sum()) for q, w in zip(qs, ws))
    den = sum(float(w.float().double().pow(2).sum()) for w in ws)

    def fwd(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ a.float().t()) * (x @ b.float().t())) @ c.float().t()

    return (num / den) ** 0.5, _rel(fwd(*qs), fwd(*ws))


def real_matrices(path: str) -> list[torch.Tensor]:
    """The usable weight matrices of one file (safetensors, or a torch state dict), in bf16."""
    if path.endswith((".pt", ".pth")):
        sd = torch.load(path, map_location="cpu", weights_only=True)
        for key in ("model_state", "state_dict", "model"):
            if isinstance(sd, dict) and isinstance(sd.get(key), dict):
                sd = sd[key]
    else:
        from safetensors.torch import load_file

        sd = load_file(path)
    return [t.to(torch.bfloat16) for t in sd.values()
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] % 32 == 0 and t.is_floating_point()]


def real_error(mats: list[torch.Tensor], fmt: str, rule: str, tokens: int, seeds: int) -> tuple[float, float]:
    """(weight rel RMS over all matrices, output rel RMS of y = x W^T over all of them)."""
    num = den = onum = oden = 0.0
    for i, w in enumerate(mats):
        q = qdq(w, fmt, rule)
        num += float((q - w.float()).double().pow(2).sum())
        den += float(w.float().double().pow(2).sum())
        for seed in range(seeds):
            x = hidden_states(tokens, w.shape[1], seed, i)
            y, yq = x @ w.float().t(), x @ q.t()
            onum += float((yq - y).double().pow(2).sum())
            oden += float(y.double().pow(2).sum())
    return (num / den) ** 0.5, (onum / oden) ** 0.5


def main() -> None:
    ap = parser(__doc__, hidden=1024, intermediate=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--real", nargs="+", default=[],
                    help="real models' weights, [LABEL=]PATH (safetensors, or .pt/.pth state dicts)")
    ap.add_argument("--json", help="write the table here too")
    args = ap.parse_args()
    H, I = args.hidden, args.intermediate
    rows = []
    for kind in ("gaussian", "student-t", "outliers"):
        for fmt in FORMATS:
            acc = {rule: [0.0, 0.0] for rule in SCALE_MODES}
            for seed in range(args.seeds):
                g = torch.Generator().manual_seed(seed)
                w1, w3 = make_weights(kind, I, H, g), make_weights(kind, I, H, g)
                w2 = make_weights(kind, H, I, g)
                x = hidden_states(args.tokens, H, seed, 0)
                for rule in SCALE_MODES:
                    we, le = expert_error(w1, w3, w2, fmt, rule, x)
                    acc[rule][0] += we / args.seeds
                    acc[rule][1] += le / args.seeds
            for rule, (we, le) in acc.items():
                rows.append({"weights": kind, "format": fmt, "rule": rule, "weight_rel_rms": we, "layer_rel_rms": le,
                             "weight_vs_rceil": we / acc["rceil"][0], "layer_vs_rceil": le / acc["rceil"][1]})
    for spec in args.real:
        label, _, path = spec.rpartition("=")
        mats = real_matrices(path)
        if not mats:
            sys.exit(f"{path}: no 2-D float tensor whose last axis is a multiple of 32")
        name = f"{label or Path(path).stem} ({len(mats)} matrices)"
        for fmt in FORMATS:
            errs = {rule: real_error(mats, fmt, rule, args.tokens, args.seeds) for rule in SCALE_MODES}
            for rule, (we, le) in errs.items():
                rows.append({"weights": name, "format": fmt, "rule": rule, "weight_rel_rms": we, "layer_rel_rms": le,
                             "weight_vs_rceil": we / errs["rceil"][0], "layer_vs_rceil": le / errs["rceil"][1]})
    print(f"{'weights':<32} {'fmt':<6} {'rule':<6} {'weight relRMS':>14} {'vs rceil':>9} {'layer relRMS':>13} {'vs rceil':>9}")
    for r in rows:
        layer = "-" if r["layer_rel_rms"] is None else f"{r['layer_rel_rms']:.5f}"
        lv = "-" if r["layer_vs_rceil"] is None else f"{r['layer_vs_rceil']:.3f}"
        print(f"{r['weights']:<32} {r['format']:<6} {r['rule']:<6} {r['weight_rel_rms']:>14.5f} {r['weight_vs_rceil']:>9.3f} {layer:>13} {lv:>9}")
    if args.json:
        Path(args.json).write_text(json.dumps({"hidden": H, "intermediate": I, "seeds": args.seeds, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
