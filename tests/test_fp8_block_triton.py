"""The Triton block-FP8 kernels (kernels/fp8_block_triton.py) give the torch path's bytes: under the
Triton interpreter on the CPU (a subprocess), and CUDA against the CPU on the GPU (``-m gpu``). Inputs
are odd sizes with partial edge tiles, strided row slices (gate / up halves), exact and inexact tiles
at the spread boundary (17 / 18), NaN scale bytes, all-zero tiles, extreme scale bytes and -0."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.interpreter import print_report, report_fixture


def _mxfp4_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, MXFP4 data [E, N, K/2], E8M0 scales [E, N, K/32]) with known exact and inexact tiles."""
    g = torch.Generator().manual_seed(7)
    E, N, K = 3, 2 * 200, 352  # w13-like: two halves of 200 rows; K/32 = 11 groups, a partial column tile
    d = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
    s = torch.full((E, N, K // 32), 120, dtype=torch.uint8)
    s += torch.randint(0, 6, s.shape, dtype=torch.uint8, generator=g)  # spread <= 8: exact tiles
    d[0, :128, :128] = 0x11  # tiles [0, 0] and [0, 1]: only 0.5 (top = low = -1 + 120 - 127 = -8) ...
    s[0, :128, :8] = 120
    s[0, 7, 1] = 101  # ... one group of 6.0 (lowest set bit 2^1) at 2^(101 - 127): low -25, top - low = 17, exact
    d[0, 7, 16:32] = 0x77
    s[0, 9, 5] = 100  # tile [0, 1]: the same a binade lower, top - low = 18, inexact
    d[0, 9, 80:96] = 0x77
    s[0, 130, 0] = 60  # far below its tile: inexact
    s[1, 0, 0], s[1, 201, 5] = 255, 255  # NaN scale bytes
    s[2, 300, 10], s[2, 5, 9] = 254, 1  # the largest and the smallest scale byte
    d[1, 256:, :] = 0x88  # -0 everywhere in the last row tile of expert 1
    d[2, :128, 64:128] = 0  # an all-zero tile
    return [("whole", d, s), ("up half", d[:, 200:], s[:, 200:]), ("gate half", d[:, :200], s[:, :200])]


def _float_cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 300, 200, generator=g) * torch.logspace(-4, 4, 200)
    x[1, :128, :128] = 0  # a tile of zeros: scale 1
    x[0, 5, 7] = -0.0
    x[0, 140, 3] = 3e38  # one huge value sets its tile's scale
    y = torch.randn(1, 129, 33, generator=g).bfloat16()  # odd K (a linear), bf16
    ties = torch.zeros(1, 3, 64)  # amax 448: scale 1, so these are exact ties of the E4M3 grid
    ties[0, 0, 0] = 448.0
    ties[0, 1, :6] = torch.tensor([1.0625, 1.1875, -3.375, 3 * 2.0**-10, 2.0**-10, 5 * 2.0**-10])  # to even: 1, 1.25, -3.5, 2^-8, 0, 2^-8
    ties[0, 2, :3] = torch.tensor([440.0, 447.9, 0.01])
    return [("fp32", x), ("fp32 rows", x[:, 17:250]), ("bf16 odd K", y), ("ties", ties)]


def _compare(a: Any, b: Any, fields: tuple[str, ...]) -> list[str]:
    bad = []
    for f in fields:
        u, v = getattr(a, f).cpu(), getattr(b, f).cpu()
        if u.dtype.itemsize == 1 or u.dtype == torch.bool:
            same = torch.equal(u.view(torch.uint8), v.view(torch.uint8))
        else:
            same = torch.equal(u, v) or torch.equal(u.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8))
        if u.shape != v.shape or not same:
            bad.append(f)
    return bad


def _all_cases(device: str, impl: str) -> dict[str, Any]:
    """Per case the fields whose bytes differ between ``impl`` on ``device`` and torch on the CPU."""
    from mxconv.kernels.quantize import float_to_fp8_block, mxfp4_to_fp8_block

    out: dict[str, Any] = {"mismatch": {}, "exact": [], "inexact": []}
    for name, d, s in _mxfp4_cases():
        want = mxfp4_to_fp8_block(d, s, impl="torch")
        got = mxfp4_to_fp8_block(d.to(device), s.to(device), impl=impl)
        out["mismatch"][name] = _compare(got, want, ("data", "scale_inv", "exact", "max_error"))
        out["exact"].append(int(want.exact.sum()))
        out["inexact"].append(int((~want.exact).sum()))
    for name, x in _float_cases():
        want, got = float_to_fp8_block(x, impl="torch"), float_to_fp8_block(x.to(device), impl=impl)
        out["mismatch"][name] = _compare(got, want, ("data", "scale_inv"))
    return out


def _interpreter_main() -> None:
    print_report(_all_cases("cpu", "triton"))


interpreter_report = report_fixture("test_fp8_block_triton")


def test_interpreter_bytes_equal_the_torch_path(interpreter_report: dict[str, Any]) -> None:
    assert interpreter_report["mismatch"] == {name: [] for name, *_ in _mxfp4_cases() + _float_cases()}
    # the cases hold both kinds of tile (else the comparison of "exact" proves little)
    assert all(n > 0 for n in interpreter_report["exact"]) and interpreter_report["inexact"][0] >= 1


def test_boundary_tiles_are_what_the_cases_say() -> None:
    from mxconv.mx.fp8_block import float_to_fp8_block, mxfp4_to_fp8_block

    _, d, s = _mxfp4_cases()[0]
    out = mxfp4_to_fp8_block(d, s)
    assert bool(out.exact[0, 0, 0]) and not bool(out.exact[0, 0, 1])  # spread 17, 18
    assert not bool(out.exact[0, 1, 0])  # the group 60 binades down
    ties = _float_cases()[-1][1]
    got = float_to_fp8_block(ties).data[0, 1, :6].float()
    assert got.tolist() == [1.0, 1.25, -3.5, 2.0**-8, 0.0, 2.0**-8]
    assert float(out.scale_inv[2, 0, 1]) == 1.0 and torch.equal(out.data[2, :128, 128:256].view(torch.uint8), torch.zeros(128, 128, dtype=torch.uint8))


@pytest.mark.gpu
def test_cuda_triton_bytes_equal_cpu_bytes() -> None:
    from mxconv.kernels.quantize import select_impl

    assert select_impl(torch.empty(1, device="cuda")) == "triton"  # the default on CUDA
    report = _all_cases("cuda", "auto")
    assert report["mismatch"] == {name: [] for name, *_ in _mxfp4_cases() + _float_cases()}


@pytest.mark.gpu
def test_cuda_triton_on_a_gpt_oss_sized_expert_stack() -> None:
    """One gpt-oss-120b-like projection (32 experts of 2880 x 2880) from random MXFP4 with a realistic
    scale spread: CUDA Triton bytes equal the CPU's."""
    from mxconv.kernels.quantize import mxfp4_to_fp8_block

    g = torch.Generator().manual_seed(11)
    d = torch.randint(0, 256, (32, 2880, 1440), dtype=torch.uint8, generator=g)
    s = (118 + torch.randint(0, 8, (32, 2880, 90), generator=g)).to(torch.uint8)
    want, got = mxfp4_to_fp8_block(d, s, impl="torch"), mxfp4_to_fp8_block(d.cuda(), s.cuda())
    assert _compare(got, want, ("data", "scale_inv", "exact", "max_error")) == []
    # 16 binades of scale bytes: tiles with E4M3 subnormals and lost bits (the element-by-element launch)
    s = (110 + torch.randint(0, 16, (32, 2880, 90), generator=g)).to(torch.uint8)
    want, got = mxfp4_to_fp8_block(d, s, impl="torch"), mxfp4_to_fp8_block(d.cuda(), s.cuda())
    assert _compare(got, want, ("data", "scale_inv", "exact", "max_error")) == []
    assert int((~want.exact).sum()) > 0
