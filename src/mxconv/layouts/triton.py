"""triton_kernels ("triton") MXFP4 MoE layout on Hopper: the bytes vLLM's ``TRITON`` backend builds
with ``_swizzle_mxfp4`` (``HopperMXValueLayout`` / ``HopperMXScaleLayout``, mx_axis 1) for
``matmul_ogs`` on SM90 (spec: docs/layout-triton.md).

Per layer and TP rank (E experts, H hidden, I intermediate): (1) Ip = roundup(I, 64), Hp = H (or
roundup(H, 64) with ``pad_hidden``); (2) w13 rows as the fused SwiGLU reads them, gate/up pairs
``g0, u0, g1, u1, ...``: gpt-oss keeps its rows, "halves" sources are interleaved (spec §5), padding
pairs follow the real ones; one row map for weights, scales and biases (:func:`w13_row_table`);
(3) weights: value padding ("3.5": rows to 16, bytes to 32; "3.6": both to 64), the value
permutation (§3) and the bit twiddle of every 32-bit word (:func:`twiddle_words`); (4) scales: K/32
zero-padded to a multiple of ``scale_k_align`` (vLLM 0.33: 4), rows to 32 * num_warps, columns to
2, and the scale permutation (§4).

Stored tensors (the contiguous buffers; an engine wraps ``buf.mT``, spec §8):

| name             | shape                  | dtype   |
|------------------|------------------------|---------|
| w13_weight       | [E, Np13/4, 4*Kbp13]   | uint8, Np13/Kbp13 = padded 2Ip / Hp/2 |
| w13_weight_scale | [E, Ns13/32, 32*Cp13]  | uint8 (E8M0), Ns13 = roundup(2Ip, 32W), Cp13 = roundup(C'13, 2) |
| w13_bias         | [E, 2Ip]               | float32 (kernel row order) |
| w2_weight        | [E, Np2/4, 4*Kbp2]     | uint8, Np2/Kbp2 = padded Hp / Ip/2 |
| w2_weight_scale  | [E, Ns2/32, 32*Cp2]    | uint8 |
| w2_bias          | [E, Hp]                | float32 |

Every padding byte/value is zero. The torch path is views, permutes, one row gather and integer
bit operations over the whole stack (identical bytes on CPU and CUDA); on CUDA the Triton kernels
of ``mxconv.kernels.triton_swizzle`` do gather + permutation + twiddle in one pass per tensor.

torch is named in type annotations only (imported under TYPE_CHECKING), so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.padding import check_fill
from mxconv.experts.stack import CanonicalExperts, LayoutSizes, round_up
from mxconv.experts.tensors import KernelTensors, TensorSpec, in_kernel_order
from mxconv.layouts.activation_quant import STATIC_FP8_PER_TENSOR
from mxconv.layouts.base import LayoutBase, LayoutOption, LayoutOptions
from mxconv.layouts.checks import check_block_sizes, check_kernel_tensors, check_padded_sizes
from mxconv.layouts.gathers import gather_padded_rows, layout_kernels
from mxconv.layouts.triton_arch import VALUE_PADDING, Arch, ArchSpec, spec_of
from mxconv.layouts.triton_float import float_to_kernel as fused_float_to_kernel
from mxconv.layouts.triton_w4a8 import (
    check_w4a8, describe_w4a8, input_scale_specs, input_scale_tensors, stored_input_scales,
)
from mxconv.layouts.triton_bytemap import (
    inverse_rows,
    need,
    w2_row_table,
    w13_row_table,
)
from mxconv.source.st_format import torch_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["BACKEND_NAME", "LAYOUT", "LAYOUT_VERSION", "MatrixGeometry", "TritonLayout", "TritonOptions"]

BACKEND_NAME = "triton"
LAYOUT_VERSION = 1
MX_BLOCK = 32
HIDDEN_ALIGN = 64  # matmul_ogs on SM90 needs K % 64 == 0; only applied with pad_hidden
BIAS_DTYPE = "F32"  # safetensors name; mxconv.source.st_format.torch_dtype gives the torch one



# ---------------------------------------------------------------------------------------------
# The Layout
# ---------------------------------------------------------------------------------------------


HOPPER_ONLY_OPTIONS = ("triton_layout", "num_warps", "scale_k_align")  # only the sm90 storage depends on them


@dataclass(frozen=True)
class TritonOptions(LayoutOptions):
    """The triton layout's resolved options (declared in :attr:`TritonLayout.options`, same order)."""

    triton_layout: str = "3.5"  # triton_kernels value-layout generation, a key of VALUE_PADDING
    num_warps: int = 8
    scale_k_align: int = 4
    pad_hidden: bool = False
    arch: Arch = Arch.SM90  # the GPU whose _swizzle_mxfp4 storage is written (given as its string)

    def __post_init__(self) -> None:
        """``arch`` as an :class:`Arch`; LayoutError for a Hopper-only option changed from its
        default with another arch (its storage does not depend on it: the value would be recorded
        in the manifest without shaping a byte)."""
        need(self.arch in tuple(Arch), f"triton: layout option arch={self.arch!r}: choose one of {', '.join(Arch)}")
        object.__setattr__(self, "arch", Arch(self.arch))
        if self.spec.options_shape_bytes:
            return
        defaults = {f.name: f.default for f in fields(self)}
        for name in HOPPER_ONLY_OPTIONS:
            value, default = getattr(self, name), defaults[name]
            need(value == default, f"triton: layout option {name}={value} applies to arch sm90 only; arch "
                 f"{self.arch} storage does not depend on it (leave it at its default {default})")  # fmt: skip

    @property
    def spec(self) -> ArchSpec:
        """The variant object of :attr:`arch`: its storage, padding and byte maps (triton_arch)."""
        return spec_of(self.arch)

    def to_json(self) -> dict[str, Any]:
        """The manifest's layout ``options`` (``arch`` as its string)."""
        return {**super().to_json(), "arch": self.arch.value}


class MatrixGeometry:
    """Kernel geometry of one expert matrix [N, K] (w13: N = 2Ip, K = Hp; w2: N = Hp, K = Ip)
    under resolved options: the padded sizes and the shapes spec §8 needs to rebuild the
    triton_kernels tensors. Value buffer rows/bytes (Np, Kbp) pad N and K/2 per generation; the
    scale's logical width C' = roundup(K/32, scale_k_align), its buffer pads N to 32 W, C' to 2."""

    def __init__(self, experts: int, rows: int, k: int, options: TritonOptions) -> None:
        spec = options.spec
        row_mult, byte_mult = spec.value_padding(options.triton_layout)
        self.experts, self.rows, self.k, self.num_warps = experts, rows, k, options.num_warps
        self.value_rows, self.value_row_bytes = round_up(rows, row_mult), round_up(k // 2, byte_mult)
        self.value_group, self.scale_group = spec.value_group, spec.scale_group
        self.value_layout, self.scale_layout = spec.value_layout, spec.scale_layout
        self.layout_num_warps = spec.layout_num_warps(options.num_warps)  # None where the storage ignores it
        self.scale_cols = round_up(k // MX_BLOCK, spec.scale_k_align(options.scale_k_align))
        row_multiple = spec.scale_rows_multiple(self.num_warps)
        self.scale_rows, self.scale_padded_cols = round_up(rows, row_multiple), round_up(self.scale_cols, spec.scale_col_multiple)

    @property
    def value_shape(self) -> tuple[int, int, int]:
        """Stored weight buffer (uint8): [E, Np/4, 4*Kbp] on SM90, [E, N, Kbp] elsewhere."""
        g = self.value_group
        return (self.experts, self.value_rows // g, g * self.value_row_bytes)

    @property
    def scale_shape(self) -> tuple[int, int, int]:
        """Stored scale buffer (uint8): [E, Ns/g, g*Cp], g = 32 (SM90, gfx950) or 128 (Blackwell)."""
        g = self.scale_group
        return (self.experts, self.scale_rows // g, g * self.scale_padded_cols)

    def describe(self) -> dict[str, Any]:
        """Manifest entry: layout objects, logical shapes, buffers and the ``buf.mT`` views."""
        E, N, K = self.experts, self.rows, self.k

        def buffer(shape: tuple[int, int, int]) -> dict[str, list[int]]:
            _, r, c = shape
            return {"buffer_shape": [E, r, c], "data_shape": [E, c, r], "data_strides": [r * c, 1, c]}

        return {
            "rows": N,
            "k": K,
            "value": {"layout": self.value_layout, "mx_axis": 1, "mma_version": 3, "initial_shape": [E, K // 2, N],
                      "shape": [E, K, N], "dtype": "FP4", **buffer(self.value_shape)},
            "scale": {"layout": self.scale_layout, "mx_axis": 1,
                      "num_warps": self.layout_num_warps,
                      "initial_shape": [E, self.scale_cols, N], "shape": [E, self.scale_cols, N], "dtype": "uint8",
                      **buffer(self.scale_shape)},
            "bias_shape": [E, N],
        }  # fmt: skip


def _kernels(t: torch.Tensor, kernel_choice: KernelChoice) -> Any:
    """``mxconv.kernels.triton_swizzle`` when the layout kernels run on ``t`` (:func:`layout_kernels`), else None."""
    if layout_kernels(t, kernel_choice) is None:
        return None
    from mxconv.kernels import triton_swizzle

    return triton_swizzle


class TritonLayout(LayoutBase):
    """triton_kernels Hopper MXFP4 layout (vLLM ``TRITON`` MoE backend on SM90; module docstring)."""

    name = BACKEND_NAME
    version = LAYOUT_VERSION
    activations: tuple[str, ...] = ("bf16", "fp8")  # fp8: W4A8, arch=gfx950 only (triton_w4a8)
    input_scale_activations: tuple[str, ...] = ("fp8",)
    advisory_keys = frozenset({"hidden_warning"})  # what a loader that pads activations may do, in words
    activation_quant = {"fp8": STATIC_FP8_PER_TENSOR}  # AITER_MXFP4_FP8: kFp8StaticTensorSym, the stored input scales
    # vLLM 0.33 holds these bytes for gpt-oss (interleaved) sources; for halves sources its TRITON
    # branch interleaves the K axis instead of the rows (spec §5) and its OAI experts run swigluoai only.
    # AITER_TRITON_MXFP4_BF16 (ROCm) runs _swizzle_mxfp4 on gate/up rows it interleaves as mxconv does;
    # vllm_refusal keeps each to the platform of the recorded arch (and its padding there).
    vllm_backends = {"bf16": ("TRITON", "AITER_TRITON_MXFP4_BF16"), "fp8": ("AITER_MXFP4_FP8",)}
    engine_runner = "mxconv.engines.triton_moe:RUNNER"  # the engine's own kernel on these bytes (verify --kernel)
    float_to_kernel = fused_float_to_kernel  # float experts -> these buffers in one fused pass (in-memory hand-off)
    options_type = TritonOptions
    options = (
        LayoutOption("triton_layout", str, "3.5", "triton_kernels Hopper value-layout generation: 3.5 (vendored by "
                     "vLLM 0.12-0.33; rows to 16, K/2 to 32), 3.6 (vLLM 0.20; both to 64) or 3.8 (matmul API; "
                     "the 3.6 bytes)",
                     choices=tuple(VALUE_PADDING)),
        LayoutOption("num_warps", int, 8, "HopperMXScaleLayout num_warps, also matmul_ogs' launch (vLLM 0.20/0.33: "
                     "8; 0.10-0.14 used 4 with expert parallelism)", choices=(8, 4)),
        LayoutOption("scale_k_align", int, 4, "scale K/32 axis zero-padded to this multiple before the swizzle "
                     "(4: vLLM 0.33 on SM90; 1: vLLM 0.12-0.20, no pad)", choices=(4, 1)),
        LayoutOption("pad_hidden", bool, False, "pad the hidden size to a multiple of 64 with zeros (vLLM does not; "
                     "for loaders that pad activations)"),
        LayoutOption("arch", str, Arch.SM90.value, "GPU whose _swizzle_mxfp4 storage is written: sm90 (Hopper), "
                     "sm100/sm120 (Blackwell value/scale layouts), gfx950 (strided values, CDNA4 scales; H and I "
                     "padded to 256), gfx1250 (strided values, aiter's gfx1250 scale tile; 256/256)", choices=tuple(a.value for a in Arch)),
    )  # fmt: skip

    def padded_sizes(
        self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
        options: TritonOptions | None = None, *, weight_format: str = "mxfp4",
    ) -> tuple[int, int]:
        """(Hp, Ip) = (H, or roundup(H, 64) with pad_hidden; roundup(I, 64)) for one rank.
        LayoutError unless H and I are positive multiples of 32."""
        opts = self.options_of(options)
        self.check_activation(activation)
        spec = opts.spec
        check_w4a8(activation, spec)
        check_block_sizes(BACKEND_NAME, hidden_size, intermediate_size, row_order, MX_BLOCK)
        hp = round_up(hidden_size, max(HIDDEN_ALIGN if opts.pad_hidden else 1, spec.hidden_align))
        return hp, round_up(intermediate_size, spec.intermediate_align)

    def size_warnings(self, hidden_size: int, intermediate_size: int, options: TritonOptions | None = None) -> list[str]:
        """The hidden-size warning (:meth:`hidden_warning`) when it applies."""
        warning = self.hidden_warning(hidden_size, options)
        return [warning] if warning else []

    def hidden_warning(self, hidden_size: int, options: TritonOptions | None = None) -> str | None:
        """A plain warning when the kernel would reduce over a hidden size that is not a multiple
        of 64 (Hopper matmul_ogs computes wrong results then); None when it will not."""
        opts = self.options_of(options)
        if hidden_size % HIDDEN_ALIGN == 0 or opts.pad_hidden or not opts.spec.warns_unaligned_hidden:
            return None
        return (
            f"hidden size {hidden_size} is not a multiple of {HIDDEN_ALIGN}: vLLM's TRITON MoE path on Hopper "
            f"(triton_kernels matmul_ogs) computes wrong results for it (docs/real-kernels.md). The bytes "
            f"written are what vLLM builds; for a loader that pads activations set RepackOptions.layout_options "
            f"pad_hidden=true (hidden padded to {round_up(hidden_size, HIDDEN_ALIGN)} with zeros)"
        )

    def tp_refusal(self, tp: int, options: TritonOptions | None = None) -> str | None:
        """gfx950 above TP 2: vLLM keeps the scales strided there, not the CDNA4 swizzle written here."""
        spec = self.options_of(options).spec
        if spec.max_tp is None or tp <= spec.max_tp:
            return None
        return (f"arch={spec.arch} writes {spec.scale_layout} scales, which vLLM 0.33 builds at TP <= {spec.max_tp} "
                f"only (should_use_cdna4_mx_scale_swizzle; above it keeps them strided, a storage mxconv does not "
                f"write), so no vLLM would hold TP {tp} bytes as they are: repack with RepackOptions.tp {spec.max_tp} or "
                "less, or serve the quantize output (vLLM lays it out at load)")  # fmt: skip

    def geometry(self, sizes: LayoutSizes, options: TritonOptions | None = None) -> dict[str, MatrixGeometry]:
        """{"w13": ..., "w2": ...} kernel geometry for ``sizes`` (its padded sizes checked against the rule)."""
        opts = self.options_of(options)
        hp, ip = self.padded_sizes(sizes.hidden_size, sizes.intermediate_size, sizes.row_order, self.activations[0], opts)
        check_padded_sizes(BACKEND_NAME, sizes, (hp, ip), f"arch {opts.arch}: Ip = roundup(I, "
                           f"{opts.spec.intermediate_align}); Hp = H unless pad_hidden or gfx950")  # fmt: skip
        return _geometry(sizes.num_experts, hp, ip, opts)

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: TritonOptions) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the stored tensors (biases only when ``sizes.has_bias``)."""
        self.check_activation(activation)
        specs: dict[str, TensorSpec] = {}
        for w, g in self.geometry(sizes, options).items():
            specs[f"{w}_weight"] = TensorSpec(g.value_shape, "U8")
            specs[f"{w}_weight_scale"] = TensorSpec(g.scale_shape, "U8")
            if sizes.has_bias:
                specs[f"{w}_bias"] = TensorSpec((g.experts, g.rows), BIAS_DTYPE)
        return in_kernel_order({**specs, **input_scale_specs(activation)})

    def to_kernel(self, c: CanonicalExperts, activation: str, options: TritonOptions,
                  kernel_choice: KernelChoice = KernelChoice.AUTO) -> KernelTensors:  # fmt: skip
        """Canonical stack -> stored kernel buffers on ``c``'s device (table in the module doc);
        ``kernel_choice`` picks the Triton layout kernels or torch ops (same bytes)."""
        c.validate()
        opts = self.options_of(options)
        hp, ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation, opts)
        kern = _kernels(c.w13, kernel_choice) if opts.spec.layout_kernels else None
        out: KernelTensors = {}
        for w, g in _geometry(c.num_experts, hp, ip, opts).items():
            weight, scale, bias = getattr(c, w), getattr(c, f"{w}_scale"), getattr(c, f"{w}_bias")
            tab_v = _row_table(w, c.intermediate_size, c.hidden_size, c.row_order, g.value_rows, c.device)
            tab_s = _row_table(w, c.intermediate_size, c.hidden_size, c.row_order, g.scale_rows, c.device)
            if kern is not None:
                out[f"{w}_weight"] = kern.hopper_values(weight, tab_v, g.value_row_bytes)
                out[f"{w}_weight_scale"] = kern.hopper_scales(scale, tab_s, g.scale_padded_cols, g.num_warps)
            else:
                out[f"{w}_weight"], out[f"{w}_weight_scale"] = opts.spec.encode(
                    gather_padded_rows(weight, tab_v, g.value_row_bytes),
                    gather_padded_rows(scale, tab_s, g.scale_padded_cols), g.num_warps)
            if bias is not None:
                out[f"{w}_bias"] = gather_padded_rows(bias.to(torch_dtype(BIAS_DTYPE)), tab_v[: g.rows])
        return in_kernel_order({**out, **input_scale_tensors(c, activation)})

    def from_kernel(
        self, k: KernelTensors, sizes: LayoutSizes, activation: str, options: TritonOptions
    ) -> CanonicalExperts:
        """Stored buffers -> canonical (unpadded) stack in the source's row order; biases float32.

        LayoutError for a missing/unexpected tensor, a wrong shape or dtype, tensors on different
        devices, or a non-zero padding byte/value (tensor and index named; the index is in the
        un-swizzled [E, rows, K/2 bytes or K/32] view with w13 rows as gate/up pairs).
        """
        opts = self.options_of(options)
        check_kernel_tensors(BACKEND_NAME, k, self.kernel_specs(sizes, activation, opts))
        H, I, dev = sizes.hidden_size, sizes.intermediate_size, k["w13_weight"].device
        parts: dict[str, torch.Tensor | None] = {}
        for w, g in self.geometry(sizes, opts).items():
            rows, kk = (2 * I, H) if w == "w13" else (H, I)  # the unpadded matrix [N, K]
            inv = inverse_rows(_row_table(w, I, H, sizes.row_order, g.rows, dev), rows)
            values, scales = opts.spec.decode(k[f"{w}_weight"], k[f"{w}_weight_scale"], g.num_warps)
            parts[w] = _crop(f"{w}_weight", values, rows, kk // 2, inv)
            parts[f"{w}_scale"] = _crop(f"{w}_weight_scale", scales, rows, kk // MX_BLOCK, inv)
            parts[f"{w}_bias"] = _crop(f"{w}_bias", k[f"{w}_bias"], rows, None, inv) if sizes.has_bias else None
        return CanonicalExperts(row_order=sizes.row_order, input_scales=stored_input_scales(k, sizes.num_experts, activation),
                                **parts)  # type: ignore[arg-type]

    def describe(self, sizes: LayoutSizes, activation: str, options: TritonOptions) -> dict[str, Any]:
        """Manifest ``layout`` fields owned by this backend (kernel_params are added by the caller):
        options, kernel/source w13 row order, hidden padding and warning, and per matrix (w13, w2)
        the triton_kernels layout objects' shapes and the stored buffers (spec §8)."""
        self.check_activation(activation)
        opts = self.options_of(options)
        geo = self.geometry(sizes, opts)
        spec = opts.spec
        d = spec.description(opts.triton_layout, opts.num_warps, opts.scale_k_align)
        return {
            "name": self.name,
            "version": self.version,
            "engine_compat": {**spec.engine_compat(opts.triton_layout, opts.scale_k_align),
                              "torch": ">=2.8.1 (older: vLLM does not swizzle on SM90)"},
            "arch": d.arch,
            "vllm_moe_backends_on_arch": list(spec.vllm_backends),
            "activation": activation,
            "vllm_moe_backend": "TRITON",
            # triton_layout, value_padding, bit_twiddle, num_warps, scale_k_align, split_k: None where
            # the arch's storage does not depend on the option
            **spec.storage_fields(d, opts.triton_layout),
            "pad_hidden": opts.pad_hidden,
            "hidden_padded": sizes.padded_hidden_size != sizes.hidden_size,
            "hidden_warning": self.hidden_warning(sizes.hidden_size, opts),
            "intermediate_align": d.intermediate_align,
            "hidden_align": spec.hidden_align,
            "w13_kernel_row_order": "interleaved",
            "w13_source_row_order": sizes.row_order,
            "gate_up_transform": "none" if sizes.row_order == "interleaved" else "row interleave 2m <- m, 2m+1 <- I+m",
            "padding_fill": 0,
            "scale_dtype": "uint8 (E8M0)",
            "bias_dtype": "float32",
            "storage": "contiguous buffers; triton_kernels Storage.data is buf.mT (keep it a view)",
            "w13": geo["w13"].describe(),
            "w2": geo["w2"].describe(),
            **describe_w4a8(activation),
        }  # fmt: skip


def _geometry(experts: int, hp: int, ip: int, opts: TritonOptions) -> dict[str, MatrixGeometry]:
    return {"w13": MatrixGeometry(experts, 2 * ip, hp, opts), "w2": MatrixGeometry(experts, hp, ip, opts)}


def _row_table(w: str, intermediate: int, hidden: int, row_order: str, rows: int, device: torch.device) -> torch.Tensor:
    """The row table of matrix ``w`` ("w13" or "w2") with ``rows`` kernel rows."""
    if w == "w13":
        return w13_row_table(intermediate, row_order, rows, device)
    return w2_row_table(hidden, rows, device)


def _crop(name: str, x: torch.Tensor, rows: int, cols: int | None, inv: torch.Tensor) -> torch.Tensor:
    """[E, R, (C)] kernel-order tensor -> [E, rows, (cols)] in source row order, after checking that
    rows >= ``rows`` and columns >= ``cols`` hold zeros (LayoutError naming ``name`` and the index)."""
    try:
        check_fill(name, x[:, rows:], 0, (0, rows, 0))
        if cols is not None:
            check_fill(name, x[:, :rows, cols:], 0, (0, 0, cols))
    except LayoutError as err:
        raise LayoutError(f"triton: {err} (index in the un-swizzled [E, rows, K/2 bytes or K/32] view, "
                          "w13 rows as gate/up pairs)") from err  # fmt: skip
    return (x[:, :rows] if cols is None else x[:, :rows, :cols]).index_select(1, inv)


LAYOUT = TritonLayout()
