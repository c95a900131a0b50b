"""Triton MX kernels == torch reference path, bit for bit.

(a) CPU: the kernels under the Triton interpreter (run in a subprocess with TRITON_INTERPRET=1).
    MXFP4 is integer/fp32-add logic and must match exactly; for MXFP8 only the scales are compared
    (the interpreter's fp32->fp8 cast rounds ties away, mx-numerics §7).
(b) GPU (``-m gpu``): both formats, every scale mode, gpt-oss-20b expert stack sizes and adversarial
    inputs; skipped when CUDA is absent.
"""

from __future__ import annotations

import struct

import pytest
import torch

from mxconv.mx.formats import FORMAT_PARAMS, FORMATS, SCALE_MODES
from mxconv.mx.numerics import quantize_mx_torch
from support.interpreter import print_report, report_fixture


def _f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def adversarial_blocks(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[R, 64] tensor of hard cases, built in fp32 then cast to ``dtype``.

    Zeros and -0, E2M1 and E4M3 ties (and their fp32 neighbours) at many scales, block maxima at and
    one ulp around powers of two and the rceil boundaries, fp32 max, tiny blocks near the rceil
    byte-0 threshold, subnormal elements, random data over 80 binades.
    """
    g = torch.Generator().manual_seed(seed)
    rows: list[list[float]] = []
    rows.append([0.0] * 64)
    rows.append([-0.0] * 64)
    rows.append([0.0, -0.0] * 32)
    fp4_ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    fp8_ties = [1 + 1 / 16, 1 + 3 / 16, 1.5 * 2.0**-9, 2.0**-10, 272.0, 432.0, 2.0**-6 + 2.0**-10, 3.5 * 2.0**-9]
    for k in (-100, -40, -5, 0, 3, 30, 100):
        s = 2.0**k
        base = [6.0 * s] + [t * s for t in fp4_ties] + [-t * s for t in fp4_ties]
        near = [_f32_from_bits(_f32_bits(t * s) + d) for t in fp4_ties for d in (-1, 1)]
        rows.append((base + near + [0.0] * 64)[:64])
        base8 = [448.0 * s] + [t * s for t in fp8_ties] + [-t * s for t in fp8_ties]
        near8 = [_f32_from_bits(_f32_bits(t * s) + d) for t in fp8_ties for d in (-1, 1)]
        rows.append((base8 + near8 + [0.0] * 64)[:64])
    maxima: list[float] = []
    for k in (-126, -125, -119, -60, -1, 0, 1, 8, 60, 120, 126):
        for m in (1.0, 1.5, 1.75, 1.875, 1.9375, 2 - 2.0**-23):
            b = _f32_bits(m * 2.0**k)
            maxima += [_f32_from_bits(b + d) for d in (-1, 0, 1)]
    maxima.append(_f32_from_bits(0x7F7FFFFF))
    for fmt in FORMATS:
        thr = FORMAT_PARAMS[fmt].rceil_min_bits_byte1
        maxima += [_f32_from_bits(thr + d) for d in (-2, -1, 0, 1)]
    maxima += [_f32_from_bits(b) for b in (1, 0x3FFFFF, 0x400000, 0x7FFFFF, 0x800000, 0xC00000)]
    for i, a in enumerate(maxima):
        fill = ((torch.rand(64, generator=g) * 2 - 1) * abs(a)).tolist()
        fill[i % 64] = a if i % 3 else -a
        rows.append(fill)
    # blocks of fp32 subnormals, and normal maxima with subnormal elements
    for i in range(6):
        sub = torch.randint(1, 1 << 23, (64,), generator=g, dtype=torch.int32).view(torch.float32)
        sub = sub * torch.where(torch.rand(64, generator=g) < 0.5, -1.0, 1.0)
        if i % 2:
            sub[5] = [1e-38, 3e-38, 7e-38, 1e-37, 2e-36][i // 2 % 5]
        rows.append(sub.tolist())
    x = torch.tensor(rows, dtype=torch.float32)
    rand = torch.randn(24, 64, generator=g) * 2.0 ** torch.randint(-40, 40, (24, 1), generator=g).float()
    x = torch.cat([x, rand])
    if dtype == torch.float16:  # rescale every block into fp16's range (max 1000; small ones subnormal)
        amax = x.abs().amax(dim=1, keepdim=True)
        x = x / torch.where(amax > 0, amax, torch.ones_like(amax)) * 1000.0
    x = x.to(dtype)
    big = torch.full_like(x, torch.finfo(dtype).max)
    return torch.where(torch.isinf(x), torch.copysign(big, x), x)  # fp32 max rounds to inf in bf16


# ---------------------------------------------------------------------------------------------------
# (a) Triton interpreter on CPU
# ---------------------------------------------------------------------------------------------------


def _interpreter_main() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1): print a JSON report of every comparison."""
    from mxconv.kernels.mx_triton import quantize_mx_triton

    report = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        x = adversarial_blocks(dtype)
        x = x[: x.shape[0] - 1]  # an odd block count: the last program is partly masked
        for fmt in FORMATS:
            for mode in SCALE_MODES:
                d_ref, s_ref = quantize_mx_torch(x, fmt, mode)
                d_tri, s_tri = quantize_mx_triton(x, fmt, mode)  # 5 programs, the last one partial
                entry = {
                    "case": f"{dtype}-{fmt}-{mode}",
                    "scales_equal": bool(torch.equal(s_ref, s_tri)),
                    "data_equal": bool(torch.equal(d_ref, d_tri)),
                    "data_compared": fmt == "mxfp4",
                    "n_bad_data": int((d_ref != d_tri).sum()),
                }
                report.append(entry)
    print_report(report)


interpreter_report = report_fixture("test_triton_kernels")


def test_interpreter_mxfp4_bit_exact(interpreter_report):
    fp4 = [r for r in interpreter_report if r["data_compared"]]
    assert len(fp4) == 9  # 3 dtypes x 3 modes
    bad = [r for r in fp4 if not (r["scales_equal"] and r["data_equal"])]
    assert not bad, bad


def test_interpreter_mxfp8_scales_exact(interpreter_report):
    fp8 = [r for r in interpreter_report if not r["data_compared"]]
    assert len(fp8) == 9
    bad = [r for r in fp8 if not r["scales_equal"]]
    assert not bad, bad


def test_adversarial_set_is_adversarial():
    """The hard-case tensor really hits the edge cases (ties, zeros, byte 0, saturation)."""
    x = adversarial_blocks(torch.float32)
    d4, s4 = quantize_mx_torch(x, "mxfp4", "floor")
    assert (s4 == 0).sum() >= 5
    assert (s4 >= 250).any()
    codes = torch.stack((d4 & 0xF, d4 >> 4), dim=-1)
    assert ((codes & 7) == 7).sum() > 0 and (codes == 8).sum() > 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.isfinite(adversarial_blocks(dtype)).all()


# ---------------------------------------------------------------------------------------------------
# (b) GPU
# ---------------------------------------------------------------------------------------------------


def _assert_same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    a = tuple(t.cpu() for t in a)
    b = tuple(t.cpu() for t in b)
    assert a[0].shape == b[0].shape and a[1].shape == b[1].shape, what
    bad_s = int((a[1] != b[1]).sum())
    bad_d = int((a[0] != b[0]).sum())
    assert bad_s == 0 and bad_d == 0, f"{what}: {bad_s} scale bytes and {bad_d} data bytes differ"


@pytest.fixture(scope="module")
def gpt_oss_20b_stacks() -> dict[tuple[int, int, int], torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for shape in ((32, 5760, 2880), (32, 2880, 2880)):
        out[shape] = (torch.randn(shape, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(32, 5760, 2880), (32, 2880, 2880)])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", SCALE_MODES)
def test_gpu_triton_equals_torch_at_gpt_oss_20b_sizes(gpt_oss_20b_stacks, shape, fmt, mode):
    from mxconv.kernels.mx_triton import quantize_mx_triton

    x = gpt_oss_20b_stacks[shape]
    _assert_same(quantize_mx_triton(x, fmt, mode), quantize_mx_torch(x, fmt, mode), f"{shape} {fmt} {mode}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", SCALE_MODES)
def test_gpu_adversarial_triton_equals_torch_gpu_and_cpu(dtype, fmt, mode):
    from mxconv.kernels.mx_triton import quantize_mx_triton

    x = adversarial_blocks(dtype)
    cpu = quantize_mx_torch(x, fmt, mode)
    xg = x.cuda()
    gpu_torch = quantize_mx_torch(xg, fmt, mode)
    _assert_same(gpu_torch, cpu, f"torch cuda vs cpu {dtype} {fmt} {mode}")
    for bpp in (1, 128):
        tri = quantize_mx_triton(xg, fmt, mode, blocks_per_program=bpp)
        _assert_same(tri, cpu, f"triton (blocks/program {bpp}) {dtype} {fmt} {mode}")


@pytest.mark.gpu
def test_gpu_e4m3_saturates_and_rounds_like_the_spec():
    """floor: A = 500 -> e = 0 and 500, -479, 464 saturate to +-448; the cast alone must do it."""
    from mxconv.kernels.mx_triton import quantize_mx_triton

    x = torch.zeros(2, 32)
    x[0, :4] = torch.tensor([500.0, -479.0, 464.0, 272.0])  # 272: tie 256/288 -> 256 (0x78)
    x[1, :3] = torch.tensor([-0.0, 448.0, -3 * 2.0**-10])  # -0 -> 0x80; tie 1/2 x 2^-9 -> 0x82
    data, scales = quantize_mx_triton(x.cuda(), "mxfp8", "floor")
    assert scales.cpu().tolist() == [[127], [127]]
    assert data[0, :4].cpu().tolist() == [0x7E, 0xFE, 0x7E, 0x78]
    assert data[1, :3].cpu().tolist() == [0x80, 0x7E, 0x82]


@pytest.mark.gpu
def test_gpu_dispatch_uses_triton_and_handles_views():
    from mxconv.kernels.quantize import quantize_mx, select_impl

    x = torch.randn(2, 96, 320, device="cuda", dtype=torch.bfloat16)
    assert select_impl(x) == "triton"
    xt = x.transpose(1, 2)[..., :64]  # non-contiguous [2, 320, 64]
    for fmt in FORMATS:
        _assert_same(quantize_mx(xt, fmt), quantize_mx_torch(xt.cpu(), fmt), f"view {fmt}")
        _assert_same(quantize_mx(x, fmt, impl="torch"), quantize_mx(x, fmt, impl="triton"), f"impls {fmt}")
