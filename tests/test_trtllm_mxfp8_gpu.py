"""trtllm's MXFP8 form on a CUDA GPU: the scales equal vLLM 0.33's sequence run with FlashInfer's real
``block_scale_interleave`` (a CUDA op; the CPU tests use its pure-torch reader), the weights and the row
maps with FlashInfer's helpers, and the layout built on the GPU equals the one built on the CPU.
FlashInfer's TRT-LLM-gen MoE kernel itself needs an SM100 GPU: not run here."""

from __future__ import annotations

import pytest
import torch
from test_layout_trtllm_mxfp8 import LAYOUT, OPTS, _stack, vllm_trtllm_mxfp8

pytestmark = pytest.mark.gpu


def _cuda_interleave():  # noqa: ANN202 - FlashInfer's op
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    block_scale_interleave = pytest.importorskip("flashinfer.quantization.fp4_quantization").block_scale_interleave

    try:
        block_scale_interleave(torch.zeros(1, 128, 4, dtype=torch.uint8, device="cuda"))
    except Exception as exc:  # noqa: BLE001 - a FlashInfer build that cannot load its op here
        pytest.skip(f"flashinfer's block_scale_interleave does not run on this GPU: {type(exc).__name__}: {exc}")
    return lambda s: block_scale_interleave(s.cuda()).cpu()


@pytest.mark.parametrize("order", ["halves", "interleaved"])
@pytest.mark.parametrize("H,I", [(192, 96), (256, 128), (320, 160)])
def test_bytes_equal_vllms_sequence_with_flashinfers_cuda_interleave(order: str, H: int, I: int) -> None:
    interleave = _cuda_interleave()
    c = _stack(order, H, I)
    want = vllm_trtllm_mxfp8(c, interleave)
    on_gpu = LAYOUT.to_kernel(c.to("cuda"), "mxfp8", OPTS)
    for name, t in want.items():
        got = on_gpu[name]
        assert got.device.type == "cuda" and got.dtype == t.dtype, name
        assert torch.equal(got.cpu().view(torch.uint8), t.view(torch.uint8)), name
    back = LAYOUT.from_kernel(on_gpu, c.sizes(H, I), "mxfp8", OPTS)
    assert torch.equal(back.w13_scale.cpu(), c.w13_scale) and torch.equal(back.w2.cpu(), c.w2)


@pytest.mark.parametrize("order", ["halves", "interleaved"])
def test_the_layout_built_on_the_gpu_is_the_cpu_one(order: str) -> None:
    """Needs no FlashInfer: the CUDA build of the form gives the CPU build's bytes and inverts."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    c = _stack(order, 320, 160)
    on_cpu = LAYOUT.to_kernel(c, "mxfp8", OPTS)
    on_gpu = LAYOUT.to_kernel(c.to("cuda"), "mxfp8", OPTS)
    assert on_cpu.keys() == on_gpu.keys()
    for name, t in on_cpu.items():
        assert torch.equal(on_gpu[name].cpu().view(torch.uint8), t.view(torch.uint8)), name
    back = LAYOUT.from_kernel(on_gpu, c.sizes(320, 160), "mxfp8", OPTS)
    assert torch.equal(back.w13.cpu(), c.w13) and torch.equal(back.w2_scale.cpu(), c.w2_scale)
