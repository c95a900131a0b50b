"""Backend layouts on CUDA (Triton kernels) == the torch path on CPU, byte for byte.

(a) CPU: the layout kernels under the Triton interpreter (a subprocess with TRITON_INTERPRET=1),
    each kernel against the torch functions it replaces, and whole ``to_kernel`` calls with the
    kernels forced on for CPU tensors against the torch path.
(b) GPU (``-m gpu``, skipped without CUDA): every backend, activation and row order, padded and
    aligned sizes including gpt-oss-20b (E=32, H=I=2880): CUDA ``to_kernel`` bytes == CPU bytes,
    and ``from_kernel`` round-trips on CUDA.
"""

from __future__ import annotations


import pytest
import torch

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.experts.tp import slice_tp, tp_ranges
from mxconv.layouts import get_layout
from mxconv.layouts.base import LayoutOptions
from mxconv.layouts.gathers import layout_kernels
from support.interpreter import kernels_match_torch, print_report, report_fixture, same_bytes
from support.registry_cases import case_id, format_cases, takes_biases
from support.registry_cases import make_stack as make_stack_of



def make_stack(E: int, H: int, I: int, row_order: str, bias: bool = True, seed: int = 0) -> CanonicalExperts:
    """Random canonical stack (CPU). Scale bytes in [1, 249] so Marlin's fp8 variant accepts them."""
    g = torch.Generator().manual_seed(seed)

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    return CanonicalExperts(
        w13=u8(E, 2 * I, H // 2),
        w13_scale=u8(E, 2 * I, H // 32, lo=1, hi=250),
        w2=u8(E, H, I // 2),
        w2_scale=u8(E, H, I // 32, lo=1, hi=250),
        w13_bias=torch.randn(E, 2 * I, generator=g).to(torch.bfloat16) if bias else None,
        w2_bias=torch.randn(E, H, generator=g).to(torch.bfloat16) if bias else None,
        row_order=row_order,
    )


def make_mxfp8_stack(E: int, H: int, I: int, row_order: str, seed: int = 0) -> CanonicalExperts:
    """Random canonical MXFP8 stack (CPU, no biases: Marlin's MXFP8 form takes none): one byte a value."""
    g = torch.Generator().manual_seed(seed)

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    return CanonicalExperts(u8(E, 2 * I, H), u8(E, 2 * I, H // 32, lo=1, hi=250), u8(E, H, I), u8(E, H, I // 32, lo=1, hi=250),
                            row_order=row_order, weight_format="mxfp8")  # fmt: skip


def sizes_for(backend: str, c: CanonicalExperts, activation: str, options: LayoutOptions) -> LayoutSizes:
    layout = get_layout(backend)
    return c.sizes(*layout.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation, options,
                                        weight_format=c.weight_format))


# (backend, activation, options) for every activation plus the options that change bytes
CASES = [
    ("trtllm", "bf16", {}),
    ("trtllm", "mxfp8", {}),
    ("trtllm", "bf16", {"intermediate_align": 128}),
    ("marlin", "bf16", {}),
    ("marlin", "fp8", {}),
    ("marlin", "bf16", {"marlin_scale_layout": "legacy"}),
    ("aiter", "bf16", {}),
    ("aiter", "mxfp4", {}),
]
# (E, H, I): padded in every backend, aligned (no padding anywhere), gpt-oss-20b
SHAPES = [(4, 288, 320), (4, 512, 512), (32, 2880, 2880)]
# The tile kernels (kernels/byte_tiles.py): (backend, weight format, (E, H, I), row order); Marlin's MXFP8
# form needs H % 64 and, with interleaved rows, I % 64; I = 96 pads every axis either backend pads
TILE_CASES = [(b, fmt, shape, order) for b, fmt in (("marlin", "mxfp8"), ("humming", "mxfp8"), ("humming", "mxfp4"))
              for shape, orders in (((4, 256, 96), ("halves",)), ((4, 512, 512), ("interleaved", "halves")),
                                    ((32, 2880, 2880), ("interleaved", "halves")))
              for order in orders]  # fmt: skip


def _case_id(case: tuple[str, str, dict]) -> str:
    backend, act, opts = case
    return "-".join([backend, act, *(f"{k}={v}" for k, v in opts.items())])


# ---------------------------------------------------------------------------------------------
# (a) Triton interpreter on CPU
# ---------------------------------------------------------------------------------------------


def _interpreter_main() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1): print a JSON report of every comparison."""
    from mxconv.kernels import trtllm_aiter as lt
    from mxconv.layouts import aiter, humming_mx, marlin, marlin_mxfp8, trtllm
    from mxconv.layouts import humming_bytemap
    from mxconv.layouts import aiter_bytemap
    from mxconv.layouts import marlin_bytemap
    from mxconv.layouts import trtllm_bytemap
    from mxconv.experts.padding import pad_last
    from mxconv.layouts.gathers import gather_padded_rows

    g = torch.Generator().manual_seed(0)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.int32, generator=g).to(torch.uint8)

    def table(rows_in: int, rows_out: int) -> torch.Tensor:
        """Random row map with -1 (padding) entries: every kernel takes arbitrary tables."""
        t = torch.full((rows_out,), -1, dtype=torch.long)
        t[torch.randperm(rows_out, generator=g)[:rows_in]] = torch.randperm(rows_in, generator=g)
        return t

    report: dict[str, bool] = {}
    E = 2
    src, tab = u8(E, 40, 48), table(40, 48)
    report["gather_rows"] = torch.equal(lt.gather_rows(src, tab, 64), gather_padded_rows(src, tab, 64))
    src, tab = u8(E, 200, 9), table(200, 256)
    for cols, fill in ((12, 0), (40, 5)):
        ref = trtllm_bytemap.swizzle_128x4(gather_padded_rows(src, tab, cols, fill))
        report[f"swizzle_128x4-{cols}-{fill}"] = torch.equal(lt.swizzle_128x4(src, tab, cols, fill), ref)
    for act, n_in, n, k_in, k in (("bf16", 100, 128, 32, 96), ("bf16", 64, 64, 512, 512), ("fp8", 50, 64, 64, 128), ("fp8", 96, 128, 96, 96)):
        src, tab = u8(E, n_in, k_in // 2), table(n_in, n)
        ref = marlin_bytemap.marlin_weight_repack(gather_padded_rows(src, tab, k // 2), act)
        report[f"marlin_weights-{act}-{n}x{k}"] = torch.equal(lt.marlin_weights(src, tab, k, act), ref)
    src, tab = u8(E, 70, 5), table(70, 192)
    for rows, off in ((7, 6), (40, 0)):
        ref = (gather_padded_rows(src, tab, rows, 0).transpose(1, 2) + off).contiguous()
        report[f"transpose_rows-{rows}-{off}"] = torch.equal(lt.transpose_rows(src, tab, rows, off), ref)
    src, tab = u8(E, 50, 48), table(50, 64)
    report["w16_tiles"] = torch.equal(lt.w16_tiles(src, tab, 80), aiter_bytemap.w16(gather_padded_rows(src, tab, 80)))
    for r_in, r_out, c_in, zero, cols in ((60, 96, 5, 6, 16), (64, 64, 90, 96, 96)):
        src, tab = u8(E, r_in, c_in), table(r_in, r_out)
        ref = aiter_bytemap.s32x8(pad_last(gather_padded_rows(src, tab, zero, 0), cols, 0x7F))
        report[f"s32x8_tiles-{c_in}-{cols}"] = torch.equal(lt.s32x8_tiles(src, tab, zero, cols, 0x7F), ref)

    for order, repack, (n_in, n, k_in, k) in ((lt.TileOrder.MARLIN, marlin_mxfp8.repack_bytes, (100, 128, 48, 64)),
                                              (lt.TileOrder.MARLIN, marlin_mxfp8.repack_bytes, (64, 64, 160, 160)),
                                              (lt.TileOrder.HUMMING, humming_bytemap.repack_bytes, (100, 128, 40, 64)),
                                              (lt.TileOrder.HUMMING, humming_bytemap.repack_bytes, (64, 192, 128, 128))):  # fmt: skip
        src, tab = u8(E, n_in, k_in), table(n_in, n)
        ref = repack(gather_padded_rows(src, tab, k), "weight")
        report[f"byte_tile_stream-{order.name}-{n}x{k}"] = torch.equal(lt.byte_tile_stream(src, tab, k, order), ref)
    for n_in, n, k_in, k in ((100, 128, 40, 64), (64, 64, 288, 384)):
        src, tab = u8(E, n_in, k_in // 2), table(n_in, n)
        ref = humming_bytemap.repack_weights(gather_padded_rows(src, tab, k // 2), "weight")
        report[f"humming_nibble_stream-{n}x{k}"] = torch.equal(lt.humming_nibble_stream(src, tab, k), ref)

    # whole to_kernel calls with the kernels forced on for CPU tensors vs the torch path
    modules = {"trtllm": trtllm, "marlin": marlin, "aiter": aiter}
    for backend, act, opts in CASES:
        mod, layout = modules[backend], get_layout(backend)
        key_opts, opts = opts, layout.resolve_options(opts)
        for row_order in ("interleaved", "halves"):
            c = make_stack(2, 96, 160, row_order, seed=len(report))
            key = f"to_kernel-{_case_id((backend, act, key_opts))}-{row_order}"
            report[key] = kernels_match_torch(mod, lt, lambda: layout.to_kernel(c, act, opts))
    for backend, mod in (("marlin", marlin_mxfp8), ("humming", humming_mx)):
        for row_order in ("interleaved", "halves"):
            c8 = make_mxfp8_stack(2, 128, 64 if row_order == "interleaved" else 96, row_order, seed=len(report))
            layout = get_layout(backend)
            report[f"to_kernel-mxfp8-{backend}-{row_order}"] = kernels_match_torch(mod, lt, lambda: layout.to_kernel(c8, "bf16", None))
    for row_order in ("interleaved", "halves"):  # humming MXFP4 (biases too: they stay torch ops)
        c4 = make_stack(2, 96, 160, row_order, seed=len(report))
        report[f"to_kernel-mxfp4-humming-{row_order}"] = kernels_match_torch(
            humming_mx, lt, lambda: get_layout("humming").to_kernel(c4, "bf16", None))
    print_report(report)


interpreter_report = report_fixture("test_layout_gpu")


def test_interpreter_kernels_equal_torch(interpreter_report: dict[str, bool]) -> None:
    kernels = {k: v for k, v in interpreter_report.items() if not k.startswith("to_kernel")}
    assert len(kernels) == 18
    assert all(kernels.values()), [k for k, v in kernels.items() if not v]


def test_interpreter_to_kernel_equal_torch_path(interpreter_report: dict[str, bool]) -> None:
    whole = {k: v for k, v in interpreter_report.items() if k.startswith("to_kernel")}
    assert len(whole) == 2 * len(CASES) + 6
    assert all(whole.values()), [k for k, v in whole.items() if not v]


def test_cpu_tensors_take_the_torch_path() -> None:
    assert layout_kernels(torch.zeros(1, dtype=torch.uint8), KernelChoice.AUTO) is None


# ---------------------------------------------------------------------------------------------
# (b) CUDA
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stacks() -> dict[tuple[int, int, int, str], CanonicalExperts]:
    return {
        (E, H, I, order): make_stack(E, H, I, order, seed=E + H + I + len(order))
        for E, H, I in SHAPES
        for order in ("interleaved", "halves")
    }


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.gpu
def test_cuda_equals_cpu_and_round_trips(stacks, case, row_order: str, shape: tuple[int, int, int]) -> None:
    backend, act, opts = case
    layout = get_layout(backend)
    opts = layout.resolve_options(opts)
    c = stacks[(*shape, row_order)]
    cuda = c.to("cuda")
    assert layout_kernels(cuda.w13, KernelChoice.AUTO) is not None  # the CUDA run goes through the Triton kernels
    k_gpu = layout.to_kernel(cuda, act, opts)
    assert all(t.is_cuda for t in k_gpu.values())
    k_cpu = layout.to_kernel(c, act, opts)
    assert not same_bytes(k_gpu, k_cpu), same_bytes(k_gpu, k_cpu)
    back = layout.from_kernel(k_gpu, sizes_for(backend, c, act, opts), act, opts)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, name).cpu(), getattr(c, name)), name
    assert torch.equal(back.w13_bias.cpu(), c.w13_bias.float())
    assert torch.equal(back.w2_bias.cpu(), c.w2_bias.float())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.gpu
def test_cuda_without_bias_and_torch_path_on_cuda(case) -> None:
    backend, act, opts = case
    layout = get_layout(backend)
    opts = layout.resolve_options(opts)
    c = make_stack(4, 288, 320, "halves", bias=False, seed=5)
    k_cpu = layout.to_kernel(c, act, opts)
    assert "w13_bias" not in k_cpu
    assert not same_bytes(layout.to_kernel(c.to("cuda"), act, opts), k_cpu)
    assert layout_kernels(torch.zeros(1, device="cuda"), KernelChoice.TORCH) is None
    assert not same_bytes(layout.to_kernel(c.to("cuda"), act, opts, KernelChoice.TORCH), k_cpu)


# (E, H, I, row order) per weight format for the misaligned/strided inputs: every form of the format takes the
# whole stack and a TP 2 rank of it (MXFP4: padded everywhere; MXFP8: I % 64 per rank, marlin's and aiter's
# rule; INT4: trtllm's MxInt4, multiples of 256 in halves)
MISALIGNED_SHAPES = {"mxfp4": (4, 288, 320, "interleaved"), "mxfp8": (4, 256, 256, "interleaved"),
                     "int4": (4, 256, 512, "halves")}  # fmt: skip


def check_misaligned_and_strided_inputs(backend: str, fmt: str, device: str) -> None:
    """``backend``'s bytes for a ``fmt`` stack, and for one TP rank of it, handed over on ``device`` at odd
    storage offsets (no 8-byte word view) and with padded row strides, and for the rank sliced on ``device``
    == the bytes of the same experts contiguous on CPU."""
    layout = get_layout(backend)
    act = layout.default_activation(fmt)
    c = make_stack_of(fmt, *MISALIGNED_SHAPES[fmt], bias=takes_biases(backend, fmt), seed=9)

    def odd_offset(t: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(t.numel() + 3, dtype=t.dtype, device=device)
        view = buf[3:].view(t.shape)
        view.copy_(t)
        return view

    def wide_rows(t: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(*t.shape[:-1], t.shape[-1] + 16, dtype=t.dtype, device=device)
        buf[..., : t.shape[-1]] = t
        return buf[..., : t.shape[-1]]

    start, end = tp_ranges(c.intermediate_size, 2)[1]
    for stack in (c, slice_tp(c, start, end, 1)):  # the whole stack, one TP rank of it (mxconv's slicing)
        want = layout.to_kernel(stack, act, None)
        biases = [None if b is None else b.to(device) for b in (stack.w13_bias, stack.w2_bias)]
        for f in (odd_offset, wide_rows):
            g = CanonicalExperts(f(stack.w13), f(stack.w13_scale), f(stack.w2), f(stack.w2_scale), *biases, stack.row_order,
                                 weight_format=fmt)  # fmt: skip
            assert not same_bytes(layout.to_kernel(g, act, None), want), (f.__name__, stack.intermediate_size)
    assert not same_bytes(layout.to_kernel(slice_tp(c.to(device), start, end, 1), act, None), want)  # sliced there


@pytest.mark.parametrize("case", format_cases(), ids=case_id)
@pytest.mark.gpu
def test_cuda_misaligned_and_strided_inputs(case: tuple[str, str]) -> None:
    """Every backend with every weight format it takes (the 8-bit tile kernels of Marlin's and humming's
    MXFP8 forms included), through the Triton layout kernels on CUDA."""
    assert layout_kernels(torch.zeros(1, device="cuda"), KernelChoice.AUTO) is not None
    check_misaligned_and_strided_inputs(*case, "cuda")


@pytest.mark.parametrize("case", format_cases(), ids=case_id)
def test_misaligned_and_strided_inputs_on_cpu(case: tuple[str, str]) -> None:
    """The same inputs through the torch path (and the GPU test's helpers, checked where no GPU is)."""
    check_misaligned_and_strided_inputs(*case, "cpu")


@pytest.mark.parametrize("case", TILE_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'x'.join(map(str, c[2]))}-{c[3]}")
@pytest.mark.gpu
def test_cuda_tile_kernels_equal_cpu_and_round_trip(case) -> None:
    """The 64 x 16 tile kernels (Marlin's and humming's MXFP8 weights, humming's MXFP4 weights) and the
    scale kernels on CUDA == the CPU torch path, and from_kernel gives the stack back."""
    backend, fmt, (E, H, I), row_order = case
    layout = get_layout(backend)
    make = make_mxfp8_stack if fmt == "mxfp8" else (lambda *a, seed: make_stack(*a, bias=False, seed=seed))
    c = make(E, H, I, row_order, seed=E + H + I)
    cuda = c.to("cuda")
    assert layout_kernels(cuda.w13, KernelChoice.AUTO) is not None
    k_gpu = layout.to_kernel(cuda, "bf16", None)
    k_cpu = layout.to_kernel(c, "bf16", None)
    assert not same_bytes(k_gpu, k_cpu), same_bytes(k_gpu, k_cpu)
    assert not same_bytes(layout.to_kernel(cuda, "bf16", None, KernelChoice.TORCH), k_cpu)
    back = layout.from_kernel(k_gpu, sizes_for(backend, c, "bf16", layout.resolve_options({})), "bf16", None)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, name).cpu(), getattr(c, name)), name


@pytest.mark.gpu
def test_cuda_marlin_fp8_scale_range_error_matches_cpu() -> None:
    layout = get_layout("marlin")
    c = make_stack(2, 256, 128, "halves", bias=False, seed=19)
    c.w2_scale[1, 7, 2] = 250
    msg = r"w2_weight_scale at index \[1, 7, 2\] holds E8M0 byte 250"
    with pytest.raises(LayoutError, match=msg):
        layout.to_kernel(c, "fp8", None)
    with pytest.raises(LayoutError, match=msg):
        layout.to_kernel(c.to("cuda"), "fp8", None)
