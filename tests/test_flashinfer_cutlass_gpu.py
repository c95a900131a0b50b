"""flashinfer-cutlass on an SM90 GPU: bytes equal to vLLM 0.33's conversion run with FlashInfer's CUDA
helpers, and FlashInfer's CUTLASS fused MoE (W4A16, ``use_w4_group_scaling``) run on the stored
tensors against a dequantized fp32 reference.

Needs flashinfer-python 0.7.2.post1 importable with the sources its SM90 fused-MoE JIT build reads:
``python scripts/fi_cutlass_kernel_pack.py`` here, then on the GPU machine (carry ``.fik``)
``bash scripts/fi_cutlass_kernel_run.sh`` (unpacks, builds into .fik/cache, runs this file).
"""

from __future__ import annotations

import pytest
import torch
from support.fi_cutlass_reference import make_stack, vllm_convert, vllm_params

from mxconv.experts.stack import CanonicalExperts
from mxconv.layouts.flashinfer_cutlass import LAYOUT
from mxconv.mx.numerics import dequantize_mx

pytestmark = pytest.mark.gpu

OPTS = LAYOUT.resolve_options()


def _sm90() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    pytest.importorskip("flashinfer")


@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
def test_sm90_bytes_equal_flashinfers_cuda_helpers(row_order: str) -> None:
    _sm90()
    from flashinfer.fused_moe import (
        interleave_moe_scales_for_sm90_mixed_gemm,
        interleave_moe_weights_for_sm90_mixed_gemm,
    )

    c = make_stack(4, 160, 224, row_order)
    Hp, Ip = LAYOUT.padded_sizes(160, 224, row_order, "bf16")
    params = {n: t.cuda() for n, t in vllm_params(c, Hp, Ip).items()}
    want = vllm_convert(params, row_order, "bf16", scale_fold=interleave_moe_scales_for_sm90_mixed_gemm,
                        weight_interleave=lambda w: interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4"),
                        block_scale_interleave=lambda s: s)  # fmt: skip
    got = LAYOUT.to_kernel(c.to("cuda"), "bf16", OPTS)
    for name, t in want.items():
        assert torch.equal(got[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name


def _sane_stack(E: int, H: int, I: int) -> CanonicalExperts:
    """Random FP4 codes with scales near 2^-3 so that the MoE output stays in bf16's range."""
    g = torch.Generator().manual_seed(11)
    c = make_stack(E, H, I, "interleaved", bias=True, seed=11)
    c.w13_scale = torch.randint(120, 125, tuple(c.w13_scale.shape), generator=g, dtype=torch.uint8)
    c.w2_scale = torch.randint(120, 125, tuple(c.w2_scale.shape), generator=g, dtype=torch.uint8)
    return c


def _reference(c: CanonicalExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 MoE: out = sum_k w_k (W2 (silu(gate) * up) + b2), gate/up from the interleaved rows."""
    w13 = dequantize_mx(c.w13, c.w13_scale, "mxfp4")
    w2 = dequantize_mx(c.w2, c.w2_scale, "mxfp4")
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e] @ x[t].float() + c.w13_bias[e].float()
            mid = torch.nn.functional.silu(h[0::2]) * h[1::2]
            out[t] += weights[t, k] * (w2[e] @ mid + c.w2_bias[e].float())
    return out


def test_cutlass_fused_moe_runs_on_stored_tensors() -> None:
    _sm90()
    from flashinfer.fused_moe import cutlass_fused_moe

    E, H, I, T, K = 8, 256, 256, 16, 2
    c = _sane_stack(E, H, I).to("cuda")
    k = LAYOUT.to_kernel(c, "bf16", OPTS)
    g = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(T, H, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:K] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, K, generator=g, device="cuda"), dim=-1)
    out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    cutlass_fused_moe(
        input=x, token_selected_experts=ids, token_final_scales=weights,
        fc1_expert_weights=k["w13_weight"], fc2_expert_weights=k["w2_weight"], output_dtype=torch.bfloat16,
        quant_scales=[k["w13_weight_scale"], k["w2_weight_scale"]],
        fc1_expert_biases=k["w13_bias"], fc2_expert_biases=k["w2_bias"], output=out, use_w4_group_scaling=True,
    )  # fmt: skip
    ref = _reference(c, x, ids, weights)
    rel = float((out.float() - ref).norm() / ref.norm())
    assert rel < 2e-2, f"relative error {rel:.3g}"
    # gate and up exchanged in the stored w13: the same kernel must then disagree with the reference
    up, gate = k["w13_weight"].chunk(2, dim=1)
    cutlass_fused_moe(
        input=x, token_selected_experts=ids, token_final_scales=weights,
        fc1_expert_weights=torch.cat([gate, up], 1).contiguous(), fc2_expert_weights=k["w2_weight"],
        output_dtype=torch.bfloat16, quant_scales=[k["w13_weight_scale"], k["w2_weight_scale"]],
        fc1_expert_biases=k["w13_bias"], fc2_expert_biases=k["w2_bias"], output=out, use_w4_group_scaling=True,
    )  # fmt: skip
    assert float((out.float() - ref).norm() / ref.norm()) > 0.1
