"""Reference MoE runner vs a straightforward per-token loop, for every routing and activation variant."""

from __future__ import annotations

import math

import pytest
import torch

from mxconv.families.base import ModelInfo
from mxconv.verify.reference_moe import compare, hidden_states, moe_forward, route


def _info(routing: str, activation: str = "silu", **kw) -> ModelInfo:
    base = dict(family="t", num_layers=1, moe_layers=(0,), num_experts=8, top_k=2, hidden_size=16,
                intermediate_size=12, expert_format="bf16", row_order="halves", has_expert_bias=False,
                routing=routing, activation=activation)
    base.update(kw)
    return ModelInfo(**base)


def _loop_reference(x, rw, rb, cb, w13, w2, b13, b2, info: ModelInfo, row_order: str) -> torch.Tensor:
    """Token by token, expert by expert, in float64 with plain Python control flow."""
    x, rw, w13, w2 = x.double(), rw.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    E, k = rw.shape[0], info.top_k
    for t in range(x.shape[0]):
        logits = [float(x[t] @ rw[e]) + (float(rb[e]) if rb is not None else 0.0) for e in range(E)]
        if info.routing == "topk_softmax":
            ids = sorted(range(E), key=lambda e: -logits[e])[:k]
            m = max(logits[e] for e in ids)
            ws = [math.exp(logits[e] - m) for e in ids]
            ws = [w / sum(ws) for w in ws]
        elif info.routing == "softmax_topk":
            m = max(logits)
            p = [math.exp(v - m) for v in logits]
            p = [v / sum(p) for v in p]
            ids = sorted(range(E), key=lambda e: -p[e])[:k]
            ws = [p[e] for e in ids]
            if info.norm_topk_prob:
                ws = [w / sum(ws) for w in ws]
        else:
            s = [1 / (1 + math.exp(-v)) for v in logits]
            c = [s[e] + float(cb[e]) for e in range(E)]
            g = info.n_group
            per = E // g
            gscore = [sum(sorted(c[i * per:(i + 1) * per], reverse=True)[:2]) for i in range(g)]
            keep = sorted(range(g), key=lambda i: -gscore[i])[: info.topk_group]
            allowed = [e for e in range(E) if e // per in keep]
            ids = sorted(allowed, key=lambda e: -c[e])[:k]
            ws = [s[e] for e in ids]
            if info.norm_topk_prob:
                ws = [w / sum(ws) for w in ws]
            ws = [w * info.routed_scaling_factor for w in ws]
        for e, wgt in zip(ids, ws):
            h = w13[e] @ x[t] + (b13[e].double() if b13 is not None else 0)
            I = h.shape[0] // 2
            if row_order == "interleaved":
                gate, up = h[0::2], h[1::2]
            else:
                gate, up = h[:I], h[I:]
            if info.activation == "swigluoai":
                gate = gate.clamp(max=info.swiglu_limit)
                up = up.clamp(-info.swiglu_limit, info.swiglu_limit)
                a = (up + 1) * gate * torch.sigmoid(info.swiglu_alpha * gate)
            else:
                a = gate * torch.sigmoid(gate) * up
            y = w2[e] @ a + (b2[e].double() if b2 is not None else 0)
            out[t] += wgt * y
    return out.float()


CASES = [
    ("topk_softmax", "swigluoai", "interleaved", True, {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}),
    ("topk_softmax", "silu", "halves", False, {}),
    ("softmax_topk", "silu", "halves", False, {"norm_topk_prob": True}),
    ("softmax_topk", "silu", "halves", False, {"norm_topk_prob": False}),
    ("sigmoid_grouped", "silu", "halves", False, {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}),
    ("sigmoid_grouped", "silu", "halves", False, {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}),
]


@pytest.mark.parametrize("routing, act, order, bias, kw", CASES)
def test_runner_matches_per_token_loop(routing, act, order, bias, kw) -> None:
    g = torch.Generator().manual_seed(7)
    info = _info(routing, act, row_order=order, has_expert_bias=bias, **kw)
    E, H, I, T = 8, 16, 12, 24
    x = hidden_states(T, H, seed=3, layer=0)
    rw = torch.randn(E, H, generator=g)
    rb = torch.randn(E, generator=g) if bias else None
    cb = torch.randn(E, generator=g) * 0.1 if routing == "sigmoid_grouped" else None
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.7
    w2 = torch.randn(E, H, I, generator=g) * 0.3
    b13 = torch.randn(E, 2 * I, generator=g) if bias else None
    b2 = torch.randn(E, H, generator=g) if bias else None
    r = route(x, rw, info, rb, cb)
    got = moe_forward(x, r, lambda e: (w13[e], w2[e], None if b13 is None else b13[e], None if b2 is None else b2[e]),
                      E, info, order, chunk_tokens=5)
    want = _loop_reference(x, rw, rb, cb, w13, w2, b13, b2, info, order)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if act == "swigluoai":  # the clamp must actually bite in this case for the test to mean something
        assert (w13.abs().max() * 4) > 7


def test_hidden_states_deterministic_and_unit_rms() -> None:
    a = hidden_states(32, 64, seed=1, layer=2)
    b = hidden_states(32, 64, seed=1, layer=2)
    c = hidden_states(32, 64, seed=1, layer=3)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.testing.assert_close(a.pow(2).mean(dim=-1).sqrt(), torch.ones(32))


def test_compare_metrics() -> None:
    ref = torch.randn(10, 8)
    ids = torch.tensor([[0, 1]] * 10)
    c = compare(ref.clone(), ref, ids, ids)
    assert c.rel_rms == 0 and c.max_abs == 0 and c.topk_agreement == 1.0 and c.cosine == pytest.approx(1.0)
    c = compare(ref * 1.1, ref, ids, torch.tensor([[0, 2]] * 10))
    assert c.rel_rms == pytest.approx(0.1, rel=1e-6) and c.topk_agreement == 0.5
