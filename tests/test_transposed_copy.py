"""``rows_contiguous`` of a transposed stack (mxconv.kernels.triton_common.transposed_copy): the
bytes of ``t.contiguous()``, by one Triton tile-transpose launch.

(a) CPU, Triton interpreter (a subprocess with TRITON_INTERPRET=1): several dtypes, sizes that are
    not multiples of the tile, an expert stride that is not R*C (a slice of a larger stack).
(b) CPU without the interpreter: torch's copy (no CUDA, no kernel).
(c) GPU (``-m gpu``): the same cases compiled, and ``convert_layer`` of gpt-oss-named experts
    ([E, H, 2I] / [E, I, H], seen transposed) gives the bytes of the same experts made contiguous
    first, for triton and marlin.
"""

from __future__ import annotations

import pytest
import torch
from support.interpreter import print_report, report_fixture

from mxconv.kernels.triton_common import rows_contiguous


def _cases(device: str) -> list[tuple[str, torch.Tensor]]:
    """Transposed views [E, R, C] (dim 1 contiguous) of several dtypes and odd sizes."""
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype, (E, R, C) in ((torch.bfloat16, (2, 70, 100)), (torch.uint8, (3, 33, 65)), (torch.float32, (1, 128, 64)),
                             (torch.float16, (2, 3, 7))):  # fmt: skip
        base = (torch.randn(E + 1, C, R, generator=g) * 100).to(dtype).to(device)
        out.append((f"{dtype}-{E}x{R}x{C}", base[1:].transpose(1, 2)))  # expert stride C*R, offset one expert
    return out


def _report(device: str) -> list[dict[str, object]]:
    rows = []
    for name, t in _cases(device):
        got = rows_contiguous(t)
        rows.append({"case": name, "strided": t.stride(-1) != 1, "contiguous": got.is_contiguous(),
                     "equal": torch.equal(got.cpu(), t.cpu().contiguous())})  # fmt: skip
    return rows


def _interpreter_main() -> None:
    print_report(_report("cpu"))


interpreter_report = report_fixture("test_transposed_copy")


def _check(report: list[dict[str, object]]) -> None:
    assert len(report) == 4
    assert all(r["strided"] and r["contiguous"] and r["equal"] for r in report), report


def test_interpreter_transposed_copy_equals_contiguous(interpreter_report) -> None:
    _check(interpreter_report)


def test_cpu_without_interpreter_is_torchs_copy() -> None:
    t = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4).transpose(1, 2)
    got = rows_contiguous(t)
    assert got.is_contiguous() and torch.equal(got, t.contiguous())
    c = torch.zeros(2, 3, 4)
    assert rows_contiguous(c) is c  # already row-contiguous: no copy


@pytest.mark.gpu
def test_gpu_transposed_copy_equals_contiguous() -> None:
    _check(_report("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "marlin"])
def test_gpu_gpt_oss_naming_equals_contiguous_input(backend: str) -> None:
    from support.interpreter import same_bytes

    from mxconv.engines.in_memory import ConvertOptions, convert_layer

    g = torch.Generator(device="cuda").manual_seed(3)
    E, H, I = 4, 192, 128
    raw = {"gate_up_proj": (torch.randn(E, H, 2 * I, device="cuda", generator=g) * 0.02).to(torch.bfloat16),
           "down_proj": (torch.randn(E, I, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16)}  # fmt: skip
    canon = {"w13": raw["gate_up_proj"].transpose(1, 2).contiguous(), "w2": raw["down_proj"].transpose(1, 2).contiguous()}
    opts = ConvertOptions(backend, activation="bf16")
    assert not same_bytes(convert_layer(raw, opts), convert_layer(canon, opts, row_order="interleaved"))
