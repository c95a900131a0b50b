"""mxconv.source.copy_check finds NaN/Inf from raw bytes (numpy, torch-free): every bit pattern of every
8- and 16-bit float type agrees with torch.isfinite, wider types on planted values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxconv.source.copy_check import NONFINITE_BITS, first_nonfinite_bytes, nonfinite_name

SMALL = {"BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@pytest.mark.parametrize("st_dtype", sorted(SMALL))
def test_every_bit_pattern_agrees_with_torch(st_dtype: str) -> None:
    dt = SMALL[st_dtype]
    width = torch.tensor([], dtype=dt).element_size()
    ints = torch.arange(1 << (8 * width), dtype=torch.int32)
    patterns = ints.to(torch.int16) if width == 2 else ints.to(torch.uint8)  # int16 wraps: every 16-bit pattern
    values = patterns.view(dt).float()
    raw = patterns.numpy().tobytes()
    for i in range(0, len(ints)):
        chunk = raw[i * width:(i + 1) * width]
        want = None if torch.isfinite(values[i]) else 0
        assert first_nonfinite_bytes(chunk, st_dtype) == want, (st_dtype, hex(i))


def test_e8m0_only_0xff_is_not_a_number() -> None:
    for b in range(256):
        assert first_nonfinite_bytes(bytes([7, b]), "F8_E8M0") == (1 if b == 0xFF else None)


@pytest.mark.parametrize("st_dtype, dt", [("F32", torch.float32), ("F64", torch.float64), ("BF16", torch.bfloat16)])
def test_first_position_in_a_long_run(st_dtype: str, dt: torch.dtype) -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)).to(dt)
    raw = x.view(torch.uint8).numpy().tobytes()
    assert first_nonfinite_bytes(raw, st_dtype) is None
    for pos, bad in ((99_999, float("nan")), (31_337, float("-inf")), (0, float("inf"))):
        y = x.clone()
        y[pos] = bad
        y[min(pos + 5, 99_999)] = float("nan")
        assert first_nonfinite_bytes(y.view(torch.uint8).numpy().tobytes(), st_dtype) == pos


def test_short_and_non_float_data() -> None:
    assert first_nonfinite_bytes(b"", "BF16") is None
    assert first_nonfinite_bytes(b"\xff", "BF16") is None  # a trailing partial element is the reader's to report
    assert first_nonfinite_bytes(b"\xff\xff", "I16") is None and first_nonfinite_bytes(b"\xff", "U8") is None
    assert set(NONFINITE_BITS) == {"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0"}
    assert first_nonfinite_bytes(memoryview(np.array([1.0, np.inf], dtype="<f4").tobytes()), "F32") == 1


def test_the_scan_in_small_steps_finds_the_same_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan walks a chunk SCAN_BYTES at a time (one small temporary): positions across step
    boundaries come out the same."""
    import mxconv.source.copy_check as cc

    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    monkeypatch.setattr(cc, "SCAN_BYTES", 64)  # 32 bf16 elements per step
    for pos in (0, 31, 32, 33, 9_999):
        y = x.clone()
        y[pos] = float("nan")
        assert cc.first_nonfinite_bytes(y.view(torch.uint8).numpy().tobytes(), "BF16") == pos
    assert cc.first_nonfinite_bytes(x.view(torch.uint8).numpy().tobytes(), "BF16") is None


@pytest.mark.parametrize("st_dtype, value, want", [
    ("BF16", float("nan"), "nan"), ("BF16", float("inf"), "inf"), ("BF16", float("-inf"), "-inf"),
    ("F16", float("-inf"), "-inf"), ("F32", float("inf"), "inf"), ("F32", float("nan"), "nan"),
])
def test_nonfinite_name_says_which_value(st_dtype: str, value: float, want: str) -> None:
    """The copy check names the value as the layer readers do (nan / inf / -inf)."""
    dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[st_dtype]
    raw = torch.tensor([1.0, value, 2.0], dtype=dtype).view(torch.uint8).numpy().tobytes()
    assert first_nonfinite_bytes(raw, st_dtype) == 1
    assert nonfinite_name(raw, st_dtype, 1) == want


def test_nonfinite_name_of_fp8_bytes() -> None:
    assert nonfinite_name(bytes([0x10, 0xFF]), "F8_E4M3", 1) == "nan"  # E4M3 has NaN only (0x7F / 0xFF)
    assert nonfinite_name(bytes([0x7F, 0xFF]), "F8_E8M0", 1) == "E8M0 NaN scale byte 0xFF"
    assert nonfinite_name(bytes([0x7C]), "F8_E5M2", 0) == "inf" and nonfinite_name(bytes([0xFC]), "F8_E5M2", 0) == "-inf"
