"""The fused float -> ``triton`` Hopper kernel (mxconv.kernels.triton_fused) and the in-memory
hand-off's use of it (TritonLayout.float_to_kernel).

(a) CPU, Triton interpreter (a subprocess with TRITON_INTERPRET=1): the fused value and scale buffers
    equal the torch quantizer's bytes laid out by ``hopper_values`` / ``hopper_scales`` (1 or 4
    layout warps, zero scale rows and columns beyond the real ones) with the same row table, on
    sizes that pad (I not a multiple of 64: padding rows; H not a multiple of 64: padding bytes), both
    w13 row orders and w2, both value generations, every scale rule, bf16/fp16/fp32, two launch shapes
    (one whose grid overhangs the rows and columns), the quantizer's hard cases (ties, tiny and
    subnormal blocks); a NaN or an Inf sets the flag, finite input does not.
(b) CPU: when the fused path stands aside (the general path then runs), and when bf16 takes the
    bf16x2 path (sm_90 and later; tests/test_bf16x2_codes.py runs its PTX on the CPU).
(c) GPU (``-m gpu``): (a)'s cases compiled (bf16 then takes the bf16x2 inline-PTX path), a bf16 sweep
    of every exponent and code against the torch quantizer; ``convert_layer`` (fused) == quantize +
    ``to_kernel`` (unfused) at gpt-oss sizes;
    a NaN still gets the general path's message, or its 0xFF scales under allow_nonfinite.
"""

from __future__ import annotations

import pytest
import torch
from support.interpreter import print_report, report_fixture, same_bytes
from test_triton_kernels import adversarial_blocks

from mxconv.engines.in_memory import ConvertOptions, canonical_experts, convert_layer
from mxconv.errors import BadInput
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.layouts import get_layout
from mxconv.layouts.triton_arch import Arch
from mxconv.layouts.triton_float import fused_applies
from mxconv.mx.formats import SCALE_MODES
from mxconv.mx.numerics import quantize_mx_torch
from mxconv.run.options import QuantOptions

E, H, I = 2, 160, 96  # Ip = 128 (rows pad), H/2 = 80 bytes (pads to 96 or 128)
# Launch shapes: the default, and programs of several 16-row and column blocks (the grid then
# overhangs: w2's 10 row blocks, 96-byte rows)
_SHAPES = {"default": {}, "wide": {"BR0": 4, "BR1": 2, "num_warps": 4}}


def _stack(shape: tuple[int, int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random experts of ``shape`` whose first elements are the quantizer's hard cases."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    hard = adversarial_blocks(dtype, seed).flatten()
    x.view(-1)[: hard.numel()] = hard
    return x


def _case(name: str, dtype: torch.dtype, mode: str, gen: str, order: str, shape: str = "default",
          device: str = "cpu") -> dict[str, object]:  # fmt: skip
    from mxconv.kernels.triton_fused import KERNEL_CONFIG, HopperScales, fused_hopper_values
    from mxconv.kernels.triton_swizzle import hopper_scales, hopper_values
    from mxconv.layouts.triton_bytemap import w2_row_table, w13_row_table

    rows_mult, bytes_mult = (16, 32) if gen == "3.5" else (64, 64)
    warps = 4 if shape == "wide" else 1  # the scale layout's
    if name == "w13":
        x = _stack((E, 2 * I, H), dtype, 1)
        tab, tab_s = (w13_row_table(I, order, rows) for rows in (2 * 128, 2 * 128))
    else:
        x = _stack((E, H, I), dtype, 2)
        tab = w2_row_table(H, -(-H // rows_mult) * rows_mult)
        tab_s = w2_row_table(H, -(-H // (32 * warps)) * 32 * warps)
    row_bytes = -(-x.shape[-1] // 2 // bytes_mult) * bytes_mult
    geo = HopperScales(len(tab_s), x.shape[-1] // 32 + x.shape[-1] // 32 % 2 + 2, warps)  # two zero columns more
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    default = dict(KERNEL_CONFIG)
    KERNEL_CONFIG.update(_SHAPES[shape])
    try:
        values, scales = fused_hopper_values(x.to(device), tab.to(device), row_bytes, mode, flag, geo)
    finally:
        KERNEL_CONFIG.update(default)
    d_ref, s_ref = quantize_mx_torch(x, "mxfp4", mode)
    want = hopper_values(d_ref.to(device), tab.to(device), row_bytes)
    want_s = hopper_scales(s_ref.to(device), tab_s.to(device), geo.cols, warps)
    return {"case": f"{name}-{order}-{dtype}-{mode}-{gen}-{shape}", "values_equal": torch.equal(values, want),
            "scales_equal": torch.equal(scales, want_s), "flag": int(flag), "padded": [len(tab), row_bytes, len(tab_s)]}  # fmt: skip


def _flag_of(value: float, device: str = "cpu") -> int:
    from mxconv.kernels.triton_fused import HopperScales, fused_hopper_values
    from mxconv.layouts.triton_bytemap import w2_row_table

    x = _stack((E, H, I), torch.bfloat16, 3)
    x[1, 150, 70] = value  # a late program, a late block
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    fused_hopper_values(x.to(device), w2_row_table(H, H).to(device), 64, "rceil", flag, HopperScales(192, 4, 1))
    return int(flag)


def _report(device: str = "cpu") -> list[dict[str, object]]:
    """Every comparison of the fused kernel with the torch quantizer + ``hopper_values``: 18 cases and
    the NaN/Inf flags (on the interpreter, or compiled on a GPU, where bf16 takes its bf16x2 path)."""
    shapes = [("w13", "halves", "3.5"), ("w13", "interleaved", "3.6"), ("w2", "-", "3.5")]
    report = [_case(n, torch.bfloat16, mode, gen, order, device=device) for mode in SCALE_MODES for n, order, gen in shapes]
    report += [_case(n, dt, "rceil", gen, order, device=device) for dt in (torch.float16, torch.float32)
               for n, order, gen in shapes]  # fmt: skip
    report += [_case(n, torch.bfloat16, "rceil", gen, order, "wide", device) for n, order, gen in shapes]
    report.append({"case": "flags", "nan": _flag_of(float("nan"), device), "inf": _flag_of(float("-inf"), device)})
    return report


def _interpreter_main() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1): print a JSON report of every comparison."""
    print_report(_report())


interpreter_report = report_fixture("test_triton_fused")


def _check_report(report: list[dict[str, object]]) -> None:
    cases = [r for r in report if r["case"] != "flags"]
    assert len(cases) == 18
    assert {tuple(r["padded"]) for r in cases} == {(256, 96, 256), (256, 128, 256), (160, 64, 160), (160, 64, 256)}  # every pad
    bad = [r for r in cases if not (r["values_equal"] and r["scales_equal"] and r["flag"] == 0)]
    assert not bad, bad
    assert [r for r in report if r["case"] == "flags"] == [{"case": "flags", "nan": 1, "inf": 1}]


def test_interpreter_fused_equals_quantize_then_gather(interpreter_report) -> None:
    _check_report(interpreter_report)


def test_bf16x2_path_only_for_bf16_on_sm90_and_later(monkeypatch: pytest.MonkeyPatch) -> None:
    from mxconv.kernels.bf16x2 import bf16x2_path

    cuda = torch.device("cuda", 0)
    assert not bf16x2_path(torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, want in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert bf16x2_path(torch.bfloat16, cuda) is want, capability
        assert not bf16x2_path(torch.float16, cuda) and not bf16x2_path(torch.float32, cuda)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not bf16x2_path(torch.bfloat16, cuda)  # a ROCm build: no PTX


def test_fused_path_stands_aside() -> None:
    """CPU tensors, MXFP8, the W4A8 activation, other archs and KernelChoice.TORCH all take the general path."""
    x = torch.zeros(1, 64, 32, dtype=torch.bfloat16)
    assert not fused_applies(x, "bf16", Arch.SM90, "mxfp4", KernelChoice.AUTO)  # CPU
    layout = get_layout("triton")
    t = {"w13": x, "w2": torch.zeros(1, 32, 32, dtype=torch.bfloat16)}
    assert layout.float_to_kernel(t, "halves", "bf16", layout.resolve_options(), "mxfp4", "rceil") is None
    if torch.cuda.is_available():
        xg = x.cuda()
        assert fused_applies(xg, "bf16", Arch.SM90, "mxfp4", KernelChoice.AUTO)
        for args in (("bf16", Arch.SM90, "mxfp8", KernelChoice.AUTO), ("fp8", Arch.SM90, "mxfp4", KernelChoice.AUTO),
                     ("bf16", Arch.SM100, "mxfp4", KernelChoice.AUTO), ("bf16", Arch.SM90, "mxfp4", KernelChoice.TORCH)):  # fmt: skip
            assert not fused_applies(xg, *args), args


# ---------------------------------------------------------------------------------------------------
# (c) GPU
# ---------------------------------------------------------------------------------------------------


def _unfused(t: dict[str, torch.Tensor], opts: ConvertOptions, row_order: str) -> dict[str, torch.Tensor]:
    """What convert_layer gave before the fused path: quantize (Triton), then to_kernel (Triton gathers)."""
    layout = get_layout(opts.backend)
    canon = canonical_experts(t, row_order=row_order, quant=opts.quant)
    return dict(layout.to_kernel(canon, "bf16", layout.resolve_options(opts.layout_options), KernelChoice.AUTO))


def _layer(E: int, H: int, I: int, dtype: torch.dtype, bias: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(E + H + I)
    t = {"w13": (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).to(dtype),
         "w2": (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).to(dtype)}  # fmt: skip
    if bias:
        t["w13_bias"] = torch.randn(E, 2 * I, device="cuda", generator=g).to(torch.bfloat16)
        t["w2_bias"] = torch.randn(E, H, device="cuda", generator=g).to(torch.bfloat16)
    return t


@pytest.mark.gpu
def test_gpu_fused_equals_quantize_then_gather() -> None:
    """The interpreter's 18 cases and flags, compiled: bf16 runs the bf16x2 (inline PTX) path there."""
    _check_report(_report("cuda"))


def _bf16_sweep(mode: str) -> torch.Tensor:
    """bf16 [1, R, 1024]: blocks whose first element is a maximum (mantissas 1, 1.5, 1.75 and the
    largest, at exponents over the whole bf16 range, subnormals included) and whose other 31 are
    random bf16 bit patterns in the five binades below it (every code, ties included), random signs."""
    g = torch.Generator().manual_seed(SCALE_MODES.index(mode))
    maxima = torch.tensor([(ex << 7) | m for ex in range(255) for m in (0, 64, 96, 127)], dtype=torch.int32)
    per_max = 8  # blocks a maximum
    top = maxima.repeat_interleave(per_max)
    n = top.numel()
    ex = (top >> 7)[:, None] - torch.randint(0, 5, (n, 31), generator=g)
    bits = (ex.clamp(min=0) << 7) | torch.randint(0, 128, (n, 31), generator=g)
    bits = torch.minimum(bits, top[:, None])
    blocks = torch.cat([top[:, None], bits], 1) | (torch.randint(0, 2, (n, 32), generator=g) << 15)
    blocks = blocks[: n - n % 32]
    return blocks.to(torch.int16).view(torch.bfloat16).reshape(1, -1, 1024)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SCALE_MODES)
def test_gpu_fused_bf16_sweep_equals_torch(mode: str) -> None:
    """Every bf16 exponent as a block maximum, with elements in every E2M1 code below it: the bf16x2
    path gives the torch quantizer's bytes (values and scales)."""
    from mxconv.kernels.triton_fused import HopperScales, fused_hopper_values
    from mxconv.kernels.triton_swizzle import hopper_scales, hopper_values
    from mxconv.layouts.triton_bytemap import w2_row_table

    x = _bf16_sweep(mode)
    rows = x.shape[1]  # 255: one zero value row, 257 zero scale rows, 2 zero scale columns
    tab, tab_s = w2_row_table(rows, 256).cuda(), w2_row_table(rows, 512).cuda()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    values, scales = fused_hopper_values(x.cuda(), tab, 512, mode, flag, HopperScales(512, 34, 2))
    d_ref, s_ref = quantize_mx_torch(x, "mxfp4", mode)
    assert int(flag) == 0
    assert torch.equal(scales, hopper_scales(s_ref.cuda(), tab_s, 34, 2))
    assert torch.equal(values, hopper_values(d_ref.cuda(), tab, 512))


@pytest.mark.gpu
@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
@pytest.mark.parametrize("mode", SCALE_MODES)
def test_gpu_fused_equals_unfused_at_gpt_oss_20b_sizes(row_order: str, mode: str) -> None:
    t = _layer(32, 2880, 2880, torch.bfloat16)
    opts = ConvertOptions("triton", activation="bf16", quant=QuantOptions("mxfp4", mode))
    layout = get_layout("triton")
    fused = layout.float_to_kernel(t, row_order, "bf16", layout.resolve_options(), "mxfp4", mode)
    assert fused is not None  # the fused path ran
    assert not same_bytes(dict(fused), _unfused(t, opts, row_order))
    assert not same_bytes(convert_layer(t, opts, row_order=row_order), dict(fused))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout_options", [{}, {"triton_layout": "3.6", "num_warps": 4, "scale_k_align": 1}])
def test_gpu_fused_equals_unfused_on_padded_sizes(dtype: torch.dtype, layout_options: dict[str, object]) -> None:
    t = _layer(3, 160, 96, dtype)
    t["w13"] = t["w13"].transpose(1, 2).contiguous().transpose(1, 2)  # a strided view: rows copied first
    opts = ConvertOptions("triton", activation="bf16", layout_options=layout_options)
    assert not same_bytes(convert_layer(t, opts, row_order="halves"), _unfused(t, opts, "halves"))


@pytest.mark.gpu
def test_gpu_nonfinite_takes_the_general_path() -> None:
    t = _layer(4, 256, 128, torch.bfloat16, bias=False)
    t["w2"][2, 17, 33] = float("nan")
    with pytest.raises(BadInput, match=r"non-finite value nan in in-memory w2 at index \[2, 17, 33\]"):
        convert_layer(t, ConvertOptions("triton", activation="bf16"))
    opts = ConvertOptions("triton", activation="bf16", quant=QuantOptions(allow_nonfinite=True))
    got = convert_layer(t, opts)
    assert not same_bytes(got, _unfused(t, opts, "halves"))
    assert (got["w2_weight_scale"] == 0xFF).sum() == 1
