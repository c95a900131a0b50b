"""fp8-block on the GPU (issue 22 item 4): an expert GEMM computed by torch's blockwise-scaled FP8 GEMM
from the ``weight`` / ``weight_scale_inv`` files as stored (128x128 weight blocks, 1x128 activation
groups, the DeepSeek-V3 recipe, SM90), against the fp32 reference; and the CUDA re-encode gives the
same bytes as the CPU one. Each call that fails says which API and scale layout it tried."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from support.cli import mx

from mxconv.mx.fp8_block import float_to_fp8_block, mxfp4_to_fp8_block
from mxconv.mx.numerics import dequantize_fp8_block

pytestmark = pytest.mark.gpu

NAME = "model.layers.0.mlp.experts.1.down_proj"


def _act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [M, K] -> E4M3 [M, K] + fp32 scales [M, K/128] (amax/448 per 1x128 group)."""
    M, K = x.shape
    g = x.float().view(M, K // 128, 128)
    s = (g.abs().amax(-1) / 448).clamp_min(1e-12)
    return (g / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(M, K), s


def _attempts(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> list[tuple[str, Any]]:
    """The blockwise FP8 GEMMs torch 2.11 may run, each on the stored weight bytes and scales: the
    128x128 weight scales as they are (padded as the API asks), or repeated per output column (1x128
    blocks: the same products, since a 128x128 block's columns share its scale)."""
    N = w.shape[0]
    a_scale = xs.t().contiguous().t()  # [M, K/128], M-major
    per_column = ws.repeat_interleave(128, dim=0)[:N]  # [N, K/128]: column n takes its block row's scales
    padded = torch.zeros(-(-ws.shape[0] // 4) * 4, ws.shape[1], device=ws.device)
    padded[: ws.shape[0]] = ws
    aligned = torch.zeros(ws.shape[0], -(-ws.shape[1] // 4) * 4, device=ws.device)[:, : ws.shape[1]]
    aligned.copy_(ws)  # [N/128, K/128] with 16-byte row strides
    out = []
    if hasattr(torch.nn.functional, "scaled_mm"):
        from torch.nn.functional import ScalingType

        def fn(sb: torch.Tensor, kind: Any) -> Any:
            return lambda: torch.nn.functional.scaled_mm(xq, w.t(), a_scale, ScalingType.BlockWise1x128, sb, kind,
                                                         output_dtype=torch.bfloat16)

        out += [("F.scaled_mm(1x128, 128x128 scales [N/128 padded to 4, K/128])", fn(padded, ScalingType.BlockWise128x128)),
                ("F.scaled_mm(1x128, 128x128 scales transposed)", fn(aligned.t(), ScalingType.BlockWise128x128)),
                ("F.scaled_mm(1x128, 1x128 per-column scales [K/128, N] N-major)", fn(per_column.t(), ScalingType.BlockWise1x128)),
                ("F.scaled_mm(1x128, 1x128 per-column scales [K/128, N] contiguous)",
                 fn(per_column.t().contiguous(), ScalingType.BlockWise1x128))]

    def legacy(sb: torch.Tensor) -> Any:
        return lambda: torch._scaled_mm(xq, w.t(), scale_a=a_scale, scale_b=sb, out_dtype=torch.bfloat16)

    out += [("torch._scaled_mm(1x128, per-column scales [K/128, N] N-major)", legacy(per_column.t())),
            ("torch._scaled_mm(1x128, per-column scales [K/128, N] contiguous)", legacy(per_column.t().contiguous()))]
    return out


def _block_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                ref: torch.Tensor) -> tuple[str, float, list[str]]:
    """The first blockwise GEMM that runs and matches ``ref`` (relative error < 1e-2): its name, its
    error, and what the earlier attempts raised or computed."""
    tried: list[str] = []
    for what, call in _attempts(xq, xs, w, ws):
        try:
            got = call()
        except Exception as exc:  # noqa: BLE001 - each failure is reported with its API
            tried.append(f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        rel = float((got.float() - ref).norm() / ref.norm())
        if rel < 1e-2:
            return what, rel, tried
        tried.append(f"{what}: ran, relative error {rel:.3g}")
    pytest.fail("no blockwise FP8 GEMM matched the reference on this GPU:\n" + "\n".join(tried))


def test_scaled_mm_expert_gemm_from_the_stored_files(tmp_path: Path) -> None:
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, moe_intermediate_size=256, intermediate_size=96,
                                      num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "src")
    code, _, err = mx("quantize", tmp_path / "src", tmp_path / "fp8", "--format", "fp8-block", "--device", "cuda", "--quiet")
    assert code == 0, err
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(tmp_path / "fp8" / index[f"{NAME}.weight"]), "pt", device="cuda") as f:
        w, ws = f.get_tensor(f"{NAME}.weight"), f.get_tensor(f"{NAME}.weight_scale_inv")
    x = torch.randn(64, w.shape[1], device="cuda", dtype=torch.bfloat16)
    xq, xs = _act_quant(x)
    ref = (xq.float() * xs.repeat_interleave(128, -1)) @ dequantize_fp8_block(w, ws, (128, 128)).t()
    what, rel, failed = _block_gemm(xq, xs, w, ws, ref)
    print(f"blockwise FP8 GEMM: {what}, relative error {rel:.2e}; before it: {failed}")
    assert rel < 1e-2


def test_cuda_reencode_bytes_equal_cpu() -> None:
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (4, 384, 320), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 130, (4, 384, 20), dtype=torch.uint8, generator=g)
    cpu, gpu = mxfp4_to_fp8_block(data, scales), mxfp4_to_fp8_block(data.cuda(), scales.cuda())
    assert torch.equal(cpu.data.view(torch.uint8), gpu.data.cpu().view(torch.uint8))
    assert torch.equal(cpu.scale_inv, gpu.scale_inv.cpu()) and torch.equal(cpu.exact, gpu.exact.cpu())
    x = torch.randn(2, 300, 260, generator=g).to(torch.bfloat16)
    a, b = float_to_fp8_block(x), float_to_fp8_block(x.cuda())
    assert torch.equal(a.data.view(torch.uint8), b.data.cpu().view(torch.uint8)) and torch.equal(a.scale_inv, b.scale_inv.cpu())
