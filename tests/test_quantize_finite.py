"""``quantize_mx_finite_into``: quantize into given buffers and say whether the input was finite.

The Triton kernel answers from the bits it reads (its ``nonfinite`` flag), the torch path from a scan;
both must agree with ``first_nonfinite`` for every float dtype, a NaN or an Inf anywhere (the first
and the last, partly masked, program), and write ``quantize_mx``'s bytes into ``out`` when finite.
(a) the kernel under the Triton interpreter on CPU; (b) the torch path on CPU; (c) the GPU.
"""

from __future__ import annotations

import pytest
import torch

from mxconv.errors import BadInput
from mxconv.kernels.quantize import quantize_mx_finite_into
from mxconv.mx.numerics import quantize_mx_torch
from support.interpreter import print_report, report_fixture

DTYPES = (torch.bfloat16, torch.float32, torch.float16)
POISON = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    """[3, 5, 96] random floats: 45 blocks of 32, so 128-block programs end partly masked."""
    g = torch.Generator().manual_seed(7)
    return (torch.randn(3, 5, 96, generator=g) * 3).to(dtype)


def _poisoned(dtype: torch.dtype, where: tuple[int, int, int], value: float) -> torch.Tensor:
    x = _inputs(dtype)
    x[where] = value
    return x


SPOTS = ((0, 0, 0), (2, 4, 95), (1, 2, 33))


def _interpreter_main() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1): the kernel's flag and out= bytes per case."""
    from mxconv.kernels.mx_triton import quantize_mx_triton

    report = []
    for dtype in DTYPES:
        cases = [("finite", None, 0.0)] + [(name, spot, v) for name, v in POISON.items() for spot in SPOTS]
        for name, spot, value in cases:
            x = _inputs(dtype) if spot is None else _poisoned(dtype, spot, value)
            data = torch.full((3, 5, 48), 0xAB, dtype=torch.uint8)
            scales = torch.full((3, 5, 3), 0xAB, dtype=torch.uint8)
            flag = torch.zeros(1, dtype=torch.int32)
            got_d, got_s = quantize_mx_triton(x, "mxfp4", "rceil", blocks_per_program=16, out=(data, scales), nonfinite=flag)
            want_d, want_s = quantize_mx_torch(x, "mxfp4", "rceil")
            report.append({
                "case": f"{dtype}-{name}-{spot}", "finite": spot is None, "flag": int(flag.item()),
                "wrote_out": got_d.data_ptr() == data.data_ptr() and got_s.data_ptr() == scales.data_ptr(),
                "bytes_equal": bool(torch.equal(data, want_d) and torch.equal(scales, want_s)),
            })  # fmt: skip
    print_report(report)


interpreter_report = report_fixture("test_quantize_finite")


def test_interpreter_flag_marks_exactly_the_nonfinite_inputs(interpreter_report):
    assert len(interpreter_report) == len(DTYPES) * (1 + len(POISON) * len(SPOTS))
    wrong = [r["case"] for r in interpreter_report if r["flag"] != (0 if r["finite"] else 1)]
    assert not wrong, wrong


def test_interpreter_out_buffers_get_the_torch_bytes(interpreter_report):
    assert all(r["wrote_out"] for r in interpreter_report)
    wrong = [r["case"] for r in interpreter_report if r["finite"] and not r["bytes_equal"]]
    assert not wrong, wrong


def _buffers(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((3, 5, 48), 0xAB, dtype=torch.uint8, device=device),
            torch.full((3, 5, 3), 0xAB, dtype=torch.uint8, device=device))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path_writes_finite_and_refuses_nonfinite(dtype):
    data, scales = _buffers()
    assert quantize_mx_finite_into(_inputs(dtype), "mxfp4", "rceil", data, scales) is True
    want_d, want_s = quantize_mx_torch(_inputs(dtype), "mxfp4", "rceil")
    assert torch.equal(data, want_d) and torch.equal(scales, want_s)
    for value in POISON.values():
        assert quantize_mx_finite_into(_poisoned(dtype, (2, 4, 95), value), "mxfp4", "rceil", *_buffers()) is False


def test_triton_out_buffers_are_checked():
    pytest.importorskip("triton")
    from mxconv.kernels.mx_triton import _outputs

    x = _inputs(torch.bfloat16)
    data, scales = _buffers()
    with pytest.raises(BadInput, match=r"out scales must be contiguous uint8 \[3, 5, 3\]"):
        _outputs(x, (3, 5, 48), (3, 5, 3), (data, scales[..., :2]))
    with pytest.raises(BadInput, match=r"out data must be contiguous uint8 \[3, 5, 48\]"):
        _outputs(x, (3, 5, 48), (3, 5, 3), (data.view(torch.int8), scales))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_kernel_flag_and_bytes(dtype, fmt):
    from mxconv.kernels.quantize import select_impl

    x = _inputs(dtype).cuda()
    assert select_impl(x) == "triton"
    k = 96 // 2 if fmt == "mxfp4" else 96
    data = torch.empty((3, 5, k), dtype=torch.uint8, device="cuda")
    scales = torch.empty((3, 5, 3), dtype=torch.uint8, device="cuda")
    assert quantize_mx_finite_into(x, fmt, "rceil", data, scales) is True
    want_d, want_s = quantize_mx_torch(x.cpu(), fmt, "rceil")
    assert torch.equal(data.cpu(), want_d) and torch.equal(scales.cpu(), want_s)
    for value in POISON.values():
        for spot in SPOTS:
            assert quantize_mx_finite_into(_poisoned(dtype, spot, value).cuda(), fmt, "rceil", data, scales) is False
