"""FlashInfer CUTLASS MXFP4 layout (docs/layout-flashinfer-cutlass.md): bytes equal to vLLM 0.33's
conversion re-enacted with FlashInfer 0.7.2.post1's own pure-torch helpers (scale fold, 128x4
swizzle reference) and a scalar replay of its CUDA weight interleave; round trips; refusals.
The same comparison against FlashInfer's CUDA helpers is tests/test_flashinfer_cutlass_gpu.py."""

from __future__ import annotations

import pytest
import torch
from support.fi_cutlass_reference import (
    fp4_interleave_scalar_stack,
    make_stack,
    vllm_convert,
    vllm_params,
)

from mxconv.errors import LayoutError
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.flashinfer_cutlass import LAYOUT, VLLM_BACKENDS
from mxconv.layouts.flashinfer_cutlass_bytemap import (
    sm90_scale_fold,
    sm90_scale_unfold,
    sm90_weight_deinterleave,
    sm90_weight_interleave,
)
from mxconv.layouts.vllm_backends import vllm_padded_sizes
from mxconv.source.manifest import load_manifest

fi_prepare = pytest.importorskip("flashinfer.fused_moe")
fi_trace = pytest.importorskip("flashinfer.trace.templates.gemm")


def fi_block_scale_interleave(s: torch.Tensor) -> torch.Tensor:
    """block_scale_interleave's bytes on CPU, for [E, R, C] with R % 128 == 0 and C % 4 == 0: the
    inverse of FlashInfer's own pure-torch reader of 128x4 buffers (``_unswizzle_batched_sf_128x4``)."""
    E, R, C = s.shape
    slot_of = fi_trace._unswizzle_batched_sf_128x4(torch.arange(E * R * C), E, R, C)  # [E, R, C] -> flat slot
    out = torch.empty(E * R * C, dtype=s.dtype)
    out[slot_of.flatten()] = s.flatten()
    return out


CPU_HELPERS = {
    "weight_interleave": fp4_interleave_scalar_stack,
    "scale_fold": fi_prepare.interleave_moe_scales_for_sm90_mixed_gemm,
    "block_scale_interleave": fi_block_scale_interleave,
}
OPTS = LAYOUT.resolve_options()


def test_registered() -> None:
    assert "flashinfer-cutlass" in backend_names()
    assert get_layout("flashinfer-cutlass") is LAYOUT
    assert LAYOUT.activations == ("bf16", "mxfp8")
    assert LAYOUT.vllm_backends == {"bf16": ("FLASHINFER_CUTLASS_MXFP4_BF16",), "mxfp8": ("FLASHINFER_CUTLASS_MXFP4_MXFP8",)}


@pytest.mark.parametrize("H,I", [(2880, 2880), (2880, 1440), (160, 96), (128, 32)])
@pytest.mark.parametrize("activation", ["bf16", "mxfp8"])
def test_padding_is_vllms(H: int, I: int, activation: str) -> None:
    got = LAYOUT.padded_sizes(H, I, "interleaved", activation)
    assert got == (-(-H // 128) * 128, -(-I // 128) * 128)
    assert got == vllm_padded_sizes(VLLM_BACKENDS[activation], H, I, "swigluoai")


def test_padded_sizes_refused() -> None:
    with pytest.raises(LayoutError, match="multiple of 32"):
        LAYOUT.padded_sizes(100, 64, "halves", "bf16")
    with pytest.raises(LayoutError, match="activation 'fp8'"):
        LAYOUT.padded_sizes(128, 64, "halves", "fp8")


def test_weight_interleave_is_the_kernels_loop() -> None:
    w = torch.randint(0, 256, (3, 48, 96), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    out = sm90_weight_interleave(w)
    assert torch.equal(out, fp4_interleave_scalar_stack(w))
    assert not torch.equal(out, w)
    assert torch.equal(sm90_weight_deinterleave(out), w)


def test_weight_interleave_moves_one_code() -> None:
    """FP4 code 0xF (sign + magnitude 7) at row 0, K element 0 (low nibble of byte 0): its magnitude
    bits go to bits 6-8 of the word and its sign to bit 15, i.e. byte 0 = 0xC0, byte 1 = 0x81."""
    w = torch.zeros(1, 16, 32, dtype=torch.uint8)
    w[0, 0, 0] = 0x0F
    out = sm90_weight_interleave(w)
    assert out[0, 0, :2].tolist() == [0xC0, 0x81]
    assert int(out.count_nonzero()) == 2


def test_weight_interleave_refuses_shapes() -> None:
    with pytest.raises(LayoutError, match="N % 16 == 0"):
        sm90_weight_interleave(torch.zeros(1, 24, 32, dtype=torch.uint8))


def test_sm100_scales_read_back_by_flashinfer() -> None:
    """FlashInfer's reader of 128x4 buffers gets every scale of the stored matrix back."""
    c = make_stack(2, 256, 128, "halves")
    k = LAYOUT.to_kernel(c, "mxfp8", OPTS)
    w2_scale = k["w2_weight_scale"]
    assert not torch.equal(w2_scale, c.w2_scale)
    assert torch.equal(fi_trace._unswizzle_batched_sf_128x4(w2_scale, 2, 256, 4), c.w2_scale)


def test_scale_fold_is_flashinfers() -> None:
    s = torch.randint(0, 256, (2, 192, 12), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    folded = sm90_scale_fold(s)
    assert folded.shape == (2, 3, 3, 16, 16)
    assert torch.equal(folded, fi_prepare.interleave_moe_scales_for_sm90_mixed_gemm(s))
    assert torch.equal(sm90_scale_unfold(folded), s)
    with pytest.raises(LayoutError, match="R % 64 == 0"):
        sm90_scale_fold(s[:, :96])


@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
@pytest.mark.parametrize("activation", ["bf16", "mxfp8"])
@pytest.mark.parametrize("H,I", [(160, 96), (256, 128)])
def test_to_kernel_is_vllms_conversion(row_order: str, activation: str, H: int, I: int) -> None:
    c = make_stack(2, H, I, row_order)
    Hp, Ip = LAYOUT.padded_sizes(H, I, row_order, activation)
    want = vllm_convert(vllm_params(c, Hp, Ip), row_order, activation, **CPU_HELPERS)
    got = LAYOUT.to_kernel(c, activation, OPTS)
    specs = LAYOUT.kernel_specs(c.sizes(Hp, Ip), activation, OPTS)
    assert list(got) == list(specs) == ["w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias"]
    for name, spec in specs.items():
        assert (tuple(got[name].shape), got[name].dtype) == (spec.shape, spec.dtype), name
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name].contiguous().view(torch.uint8), want[name].contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
@pytest.mark.parametrize("activation", ["bf16", "mxfp8"])
@pytest.mark.parametrize("bias", [True, False])
def test_round_trip(row_order: str, activation: str, bias: bool) -> None:
    c = make_stack(3, 224, 160, row_order, bias=bias, seed=7)
    Hp, Ip = LAYOUT.padded_sizes(224, 160, row_order, activation)
    back = LAYOUT.from_kernel(LAYOUT.to_kernel(c, activation, OPTS), c.sizes(Hp, Ip), activation, OPTS)
    assert back.row_order == row_order
    for name in ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias"):
        a, b = getattr(c, name), getattr(back, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name


def test_from_kernel_refuses_padding_and_shapes() -> None:
    c = make_stack(1, 160, 96, "interleaved")
    sizes = c.sizes(256, 128)
    k = LAYOUT.to_kernel(c, "bf16", OPTS)
    w2 = sm90_weight_deinterleave(k["w2_weight"])
    w2[0, 200, 3] = 0x11  # row 200 >= H = 160: padding
    bad = dict(k, w2_weight=sm90_weight_interleave(w2))
    with pytest.raises(LayoutError, match=r"padding of w2_weight at index \[0, 200, 3\]"):
        LAYOUT.from_kernel(bad, sizes, "bf16", OPTS)
    with pytest.raises(LayoutError, match="w13_weight_scale is"):
        LAYOUT.from_kernel(dict(k, w13_weight_scale=k["w13_weight_scale"].reshape(1, 256, 8)), sizes, "bf16", OPTS)
    with pytest.raises(LayoutError, match=r"missing \['w2_bias'\]"):
        LAYOUT.from_kernel({n: t for n, t in k.items() if n != "w2_bias"}, sizes, "bf16", OPTS)
    with pytest.raises(LayoutError, match="do not match"):
        LAYOUT.kernel_specs(c.sizes(160, 128), "bf16", OPTS)


def test_swapped_halves_do_not_round_trip() -> None:
    """A w13 stored in [gate; up] order instead of [up; gate] comes back with gate and up exchanged."""
    c = make_stack(1, 128, 128, "halves", bias=False)
    k = LAYOUT.to_kernel(c, "mxfp8", OPTS)
    up, gate = k["w13_weight"].chunk(2, dim=1)
    back = LAYOUT.from_kernel(dict(k, w13_weight=torch.cat([gate, up], 1)), c.sizes(128, 128), "mxfp8", OPTS)
    assert torch.equal(back.w13[:, :128], c.w13[:, 128:])
    assert not torch.equal(back.w13, c.w13)


@pytest.mark.parametrize("activation,arch", [("bf16", "sm90"), ("mxfp8", "sm100")])
def test_gpt_oss_20b_specs_and_describe(activation: str, arch: str) -> None:
    sizes = make_stack(1, 32, 32, "interleaved").sizes(32, 32)
    from dataclasses import replace

    sizes = replace(sizes, num_experts=32, hidden_size=2880, intermediate_size=2880,
                    padded_hidden_size=2944, padded_intermediate_size=2944)  # fmt: skip
    specs = LAYOUT.kernel_specs(sizes, activation, OPTS)
    scale13 = (32, 92, 23, 16, 16) if activation == "bf16" else (32, 5888, 92)
    assert specs["w13_weight"].shape == (32, 5888, 1472)
    assert specs["w13_weight_scale"].shape == scale13
    assert specs["w2_bias"].shape == (32, 2944)
    d = LAYOUT.describe(sizes, activation, OPTS)
    assert (d["name"], d["arch"], d["vllm_moe_backend"]) == ("flashinfer-cutlass", arch, VLLM_BACKENDS[activation])
    assert d["padding"] == {"hidden_align": 128, "intermediate_align": 128, "fill": 0}
    assert d["w13_kernel_row_order"] == "up_gate_halves"


def test_kernel_unavailable_says_why_on_cpu(made) -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only message")
    q4 = made.quantize(made.source("gpt-oss-bf16").path)
    for activation, gpu in (("bf16", "SM90 GPU"), ("mxfp8", "SM100 GPU")):
        why = LAYOUT.kernel_unavailable(load_manifest(made.repack(q4, LAYOUT.name, "--activation", activation)))
        assert why is not None and gpu in why
