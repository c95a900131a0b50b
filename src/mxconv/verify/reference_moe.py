"""Reference MoE runner: routing + experts in float32, the way each family computes them.

Used by ``verify`` and ``demo`` to show that converted weights compute what their source computes.
Experts are fetched one at a time through an :data:`ExpertFn` (dequantized on demand), so a real
layer never has to sit in memory as float32; tokens are processed in chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from mxconv.families.base import ModelInfo

# expert index -> (w13 [2I, H] fp32, w2 [H, I] fp32, b13 [2I] fp32 | None, b2 [H] fp32 | None)
ExpertFn = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


@dataclass
class Routing:
    """Top-k choice per token: ids [T, k] int64, weights [T, k] fp32."""

    ids: torch.Tensor
    weights: torch.Tensor


@dataclass(frozen=True)
class LayerForward:
    """One layer run through the reference runner on the converted weights: the hidden states x
    [T, H], the converted router's routing, the output [T, H] and, when a reference was given, the
    reference's output, top-k ids and the numerics threshold of the pair (the engine kernel is held
    to them)."""

    x: torch.Tensor
    routing: Routing
    out: torch.Tensor
    reference: tuple[torch.Tensor, torch.Tensor, dict[str, float]] | None


def route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    info: ModelInfo,
    router_bias: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
) -> Routing:
    """Pick top-k experts per token.

    x [T, H] fp32; router_weight [E, H]; router_bias [E] (gpt-oss); correction_bias [E] (DeepSeek).
    """
    logits = x @ router_weight.float().t()
    if router_bias is not None:
        logits = logits + router_bias.float()
    k = info.top_k
    if info.routing == "topk_softmax":
        vals, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(vals, dim=-1)
    elif info.routing == "softmax_topk":
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)
        if info.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif info.routing == "sigmoid_grouped":
        scores = torch.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        T, E = choice.shape
        g = max(int(info.n_group), 1)
        if g > 1:
            grouped = choice.view(T, g, E // g)
            group_score = grouped.topk(min(2, E // g), dim=-1).values.sum(dim=-1)  # [T, g]
            keep = group_score.topk(int(info.topk_group), dim=-1).indices
            mask = torch.zeros(T, g, dtype=torch.bool, device=x.device)
            mask.scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(E // g, dim=1), float("-inf"))
        ids = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        if info.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * float(info.routed_scaling_factor)
    else:
        raise ValueError(f"unknown routing {info.routing!r}")
    return Routing(ids=ids, weights=weights.float())


def activation(h: torch.Tensor, info: ModelInfo, row_order: str) -> torch.Tensor:
    """h [T, 2I] (rows of w13 in ``row_order``) -> a [T, I]."""
    if row_order == "interleaved":
        gate, up = h[:, 0::2], h[:, 1::2]
    else:
        half = h.shape[1] // 2
        gate, up = h[:, :half], h[:, half:]
    if info.activation == "swigluoai":
        alpha = 1.702 if info.swiglu_alpha is None else float(info.swiglu_alpha)
        limit = 7.0 if info.swiglu_limit is None else float(info.swiglu_limit)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)
    return torch.nn.functional.silu(gate) * up


def moe_forward(
    x: torch.Tensor,
    routing: Routing,
    experts: ExpertFn,
    num_experts: int,
    info: ModelInfo,
    row_order: str,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Σ_k weight_k · expert_{id_k}(x), fp32, [T, H]. Experts with no tokens are never fetched."""
    x = x.float()
    out = torch.zeros_like(x)
    for e in range(num_experts):
        tok, slot = (routing.ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w13, w2, b13, b2 = experts(e)
        for s in range(0, tok.numel(), chunk_tokens):
            t, sl = tok[s : s + chunk_tokens], slot[s : s + chunk_tokens]
            h = x[t] @ w13.t()
            if b13 is not None:
                h = h + b13
            y = activation(h, info, row_order) @ w2.t()
            if b2 is not None:
                y = y + b2
            out.index_add_(0, t, y * routing.weights[t, sl].unsqueeze(1))
    return out


def hidden_states(tokens: int, hidden_size: int, seed: int, layer: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Deterministic synthetic layer inputs [T, H] fp32 with RMS ≈ 1 (what RMSNorm hands the MoE)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    x = torch.randn(tokens, hidden_size, generator=g, dtype=torch.float32)
    # a few large-magnitude channels, as real residual streams have
    heavy = torch.randint(0, hidden_size, (max(1, hidden_size // 64),), generator=g)
    x[:, heavy] *= 4.0
    x = x / x.pow(2).mean(dim=-1, keepdim=True).sqrt()
    return x.to(device)


@dataclass
class Comparison:
    rel_rms: float
    cosine: float
    max_abs: float
    topk_agreement: float

    def to_json(self) -> dict[str, float | None]:
        """The figures, NaN written as null (JSON has no NaN)."""
        return {k: (v if math.isfinite(v) else None) for k, v in self.__dict__.items()}


def apart(value: float, bound: float, digits: int = 4) -> tuple[str, str]:
    """``value`` and the ``bound`` it failed, printed alike with the fewest significant digits (at
    least ``digits``) that show the bound to 10 digits and tell the two apart, so a failure reads
    "cosine 0.9999985 < 0.999999", never "cosine 0.999999 < 0.999999". Rounding keeps order, so
    the printed pair compares as the true pair does."""
    d = digits
    while d < 17 and abs(float(f"{bound:.{d}g}") - bound) > 1e-10 * abs(bound):
        d += 1
    while d < 17 and f"{value:.{d}g}" == f"{bound:.{d}g}":
        d += 1
    return f"{value:.{d}g}", f"{bound:.{d}g}"


def compare(out: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor, ref_ids: torch.Tensor) -> Comparison:
    """Error of ``out`` against ``ref`` ([T, H]) and the fraction of top-k choices in common.

    A NaN/Inf on either side makes the error figures NaN (never 0 and cosine 1, which a zero or
    NaN norm would otherwise give), so no threshold test ``x <= limit`` can pass.
    """
    out, ref = out.double(), ref.double()
    k = ids.shape[1]
    same = (ids.unsqueeze(2) == ref_ids.unsqueeze(1)).any(dim=2).sum().item()
    agree = same / (ids.shape[0] * k)
    if not (bool(torch.isfinite(out).all()) and bool(torch.isfinite(ref).all())):
        nan = float("nan")
        return Comparison(nan, nan, nan, agree)
    diff = out - ref
    denom = ref.norm().item()
    rel = diff.norm().item() / denom if denom > 0 else float(diff.norm().item() > 0)
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item() if denom > 0 else 1.0
    return Comparison(rel, cos, diff.abs().max().item() if diff.numel() else 0.0, agree)
