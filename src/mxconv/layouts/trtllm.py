"""TRT-LLM-gen ("trtllm") MXFP4 MoE layout: what vLLM builds at load time for FlashInfer's
``trtllm_fp4_block_scale_moe`` kernels (spec: docs/layout-trtllm.md).

Only rows move; bytes inside a row are never touched. Per layer and TP rank:

1. pad (H, I) to (Hp, Ip) = (roundup(H, 256), roundup(I, intermediate_align)); weights 0x00,
   scales 0x00, biases 0.0 (``base.pad_canonical``'s rule; halves are padded each on its own);
2. step A (w13 only): gate/up pair order, kernel row 2i = up_i, row 2i+1 = gate_i;
3. step B: MMA row shuffle in blocks of 32 rows (epilogue_tile_m = 128), applied to weights,
   scales (before swizzling) and biases;
4. step C: 128x4 swizzle of each expert's scale matrix; the flat buffer is reshaped to the
   matrix shape and *viewed* (never value-cast) as float8_e4m3fn.

Steps 1-3 are one row map (:func:`w13_row_table` / :func:`w2_row_table`: kernel row -> source row
or -1), applied in a single gather with the column padding; on CUDA the Triton kernels of
``mxconv.kernels.trtllm_aiter`` do the gather (and step C) in one pass per tensor.

Output tensors (E experts, padded sizes):

| name             | shape            | dtype          |
|------------------|------------------|----------------|
| w13_weight       | [E, 2Ip, Hp/2]   | uint8          |
| w13_weight_scale | [E, 2Ip, Hp/32]  | float8_e4m3fn (view of swizzled E8M0 bytes) |
| w13_bias         | [E, 2Ip]         | float32        |
| w2_weight        | [E, Hp, Ip/2]    | uint8          |
| w2_weight_scale  | [E, Hp, Ip/32]   | float8_e4m3fn (view) |
| w2_bias          | [E, Hp]          | float32        |

Options (:class:`TrtllmOptions`):

* ``intermediate_align`` (int, default 128): multiple the per-rank intermediate size is
  padded to. Must be a positive multiple of 128. 128 is what vLLM 0.33's
  ``mxfp4_round_up_hidden_size_and_intermediate_size`` allocates for FLASHINFER_TRTLLM_MXFP4_*
  (so does every vLLM release from 0.27 on); 256 is what vLLM 0.10.2-0.26 and SGLang's FlashInfer
  MXFP4 MoE (SM100) allocate.

The weights are identical for both activations ("bf16", "mxfp8"); only the manifest differs.

Forms: the layout declares one :class:`~mxconv.layouts.forms.WeightForm` per expert weight format
(``weight_forms``; :class:`~mxconv.layouts.forms.FormsLayout` picks one per call from the stack's or
``LayoutSizes``' weight format): MXFP4 (:class:`TrtllmMxfp4`, above), MxInt4 (spec section 9, :data:`mxconv.layouts.trtllm_mxint4.MXINT4`:
compressed-tensors INT4 with bf16 scales; sign XOR, the same row tables, block-major K, flat bf16
swizzled scales; bf16 activations; H and I multiples of 256, no padding) and MXFP8
(:data:`mxconv.layouts.trtllm_mxfp8.MXFP8`, MXFP8 activations). They share the row tables and the
swizzle of :mod:`mxconv.layouts.trtllm_bytemap`.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mxconv.errors import LayoutError
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.padding import unpad_canonical
from mxconv.experts.stack import CanonicalExperts, LayoutSizes, round_up
from mxconv.experts.tensors import KernelTensors, TensorSpec, bias_specs
from mxconv.layouts.base import LayoutOption, LayoutOptions
from mxconv.layouts.checks import check_padded_sizes
from mxconv.layouts.forms import FormBase, FormsLayout
from mxconv.layouts.gathers import gather_padded_rows, layout_kernels
from mxconv.layouts.trtllm_bytemap import (
    BACKEND_NAME, EPILOGUE_TILE_M, LAYOUT_VERSION, SF_TILE_COLS, SF_TILE_ROWS, SHUFFLE_BLOCK_ROWS, check_kernel_tensors,
    check_row_order, swizzle_128x4, swizzled_scale_size, unswizzle_128x4, w13_row_dst, w13_row_table, w2_row_dst, w2_row_table,
)
from mxconv.source.st_format import torch_dtype
from mxconv.layouts.trtllm_mxfp8 import MXFP8
from mxconv.layouts.trtllm_mxint4 import MXINT4
from mxconv.source.manifest import Manifest

if TYPE_CHECKING:
    import torch

    from mxconv.experts.kernel_settings import KernelLocations

__all__ = ["ACTIVATIONS", "LAYOUT", "TrtllmLayout", "TrtllmMxfp4", "TrtllmOptions"]

ACTIVATIONS: tuple[str, ...] = ("bf16", "mxfp8")

HIDDEN_ALIGN = 256  # also what vLLM pads MXFP8 activations to, so it must stay 256
DEFAULT_INTERMEDIATE_ALIGN = 128  # vLLM 0.33 FLASHINFER_TRTLLM_MXFP4_*: Ip = roundup(I, 128)
INTERMEDIATE_ALIGN_QUANTUM = 128  # 2Ip % 128 and (Ip/32) % 4 must hold
MX_BLOCK = 32  # elements per E8M0 scale

NUM_ELTS_PER_SF = 16  # what vLLM passes to FlashInfer for MXFP4 (rows do not depend on it)
SCALE_FILL = 0x00  # never 0xFF (NaN * 0 = NaN)

KERNEL_SCALE_DTYPE = "F8_E4M3"  # safetensors names; mxconv.source.st_format.torch_dtype gives the torch ones
KERNEL_BIAS_DTYPE = "F32"
# vLLM releases whose FLASHINFER_TRTLLM_MXFP4_* allocation matches each intermediate_align (other
# multiples of 128 are held by no vLLM release: the entry names FlashInfer alone).
VLLM_RELEASES_BY_ALIGN = {128: ">=0.27", 256: "0.10.2-0.26"}
FLASHINFER_COMPAT = ">=0.3"
VLLM_BACKENDS = {"bf16": "FLASHINFER_TRTLLM_MXFP4_BF16", "mxfp8": "FLASHINFER_TRTLLM_MXFP4_MXFP8"}


# ---------------------------------------------------------------------------------------------
# The Layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrtllmOptions(LayoutOptions):
    """The trtllm layout's resolved options; ``intermediate_align`` is checked to be a positive
    multiple of 128 when made (LayoutError otherwise)."""

    intermediate_align: int = DEFAULT_INTERMEDIATE_ALIGN

    def __post_init__(self) -> None:
        align = self.intermediate_align
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align % INTERMEDIATE_ALIGN_QUANTUM:
            raise LayoutError(
                f"trtllm option intermediate_align={align!r} must be a positive multiple of "
                f"{INTERMEDIATE_ALIGN_QUANTUM} (the 128x4 scale swizzle needs Ip % 128 == 0)"
            )


def _align_problem(align: int) -> str | None:
    if align <= 0 or align % INTERMEDIATE_ALIGN_QUANTUM:
        return f"must be a positive multiple of {INTERMEDIATE_ALIGN_QUANTUM} (the 128x4 scale swizzle needs Ip % 128 == 0)"
    return None


class TrtllmMxfp4(FormBase):
    """The MXFP4 form (module docstring): padded, rows permuted, E8M0 scales 128x4-swizzled and
    viewed as float8_e4m3fn; the options' ``intermediate_align`` pads I."""

    weight_format = "mxfp4"
    activations = ACTIVATIONS
    vllm_backends = {act: (name,) for act, name in VLLM_BACKENDS.items()}

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str, activation: str,
                     options: TrtllmOptions) -> tuple[int, int]:  # fmt: skip
        """(Hp, Ip) = (roundup(H, 256), roundup(I, intermediate_align)); LayoutError unless H and I
        are positive multiples of 32 (MXFP4 blocks)."""
        check_row_order(row_order)
        if activation not in ACTIVATIONS:
            raise LayoutError(f"trtllm does not support activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
        for what, size in (("hidden", hidden_size), ("intermediate", intermediate_size)):
            if size <= 0 or size % MX_BLOCK:
                raise LayoutError(
                    f"trtllm: {what} size {size} must be a positive multiple of {MX_BLOCK} (MXFP4 block size)"
                )
        return round_up(hidden_size, HIDDEN_ALIGN), round_up(intermediate_size, options.intermediate_align)

    def _checked_padding(self, sizes: LayoutSizes, activation: str, options: TrtllmOptions) -> tuple[int, int]:
        """(Hp, Ip) for ``sizes``; LayoutError if sizes' padded values disagree with this layout."""
        want = self.padded_sizes(sizes.hidden_size, sizes.intermediate_size, sizes.row_order, activation, options)
        return check_padded_sizes(BACKEND_NAME, sizes, want, f"Hp = roundup(H, {HIDDEN_ALIGN}), Ip = roundup(I, "
                                  f"intermediate_align = {options.intermediate_align})")  # fmt: skip

    def kernel_specs(self, sizes: LayoutSizes, activation: str, options: TrtllmOptions) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the kernel tensors (biases only when ``sizes.has_bias``)."""
        Hp, Ip = self._checked_padding(sizes, activation, options)
        E = sizes.num_experts
        return {  # weights and scales, then biases (the manifest keeps this order)
            "w13_weight": TensorSpec((E, 2 * Ip, Hp // 2), "U8"),
            "w13_weight_scale": TensorSpec((E, 2 * Ip, Hp // MX_BLOCK), KERNEL_SCALE_DTYPE),
            "w2_weight": TensorSpec((E, Hp, Ip // 2), "U8"),
            "w2_weight_scale": TensorSpec((E, Hp, Ip // MX_BLOCK), KERNEL_SCALE_DTYPE),
            **bias_specs(sizes, Hp, Ip, KERNEL_BIAS_DTYPE),
        }

    def to_kernel(self, c: CanonicalExperts, activation: str, options: TrtllmOptions,
                  kernel_choice: KernelChoice) -> KernelTensors:  # fmt: skip
        """Canonical stack -> padded, permuted kernel tensors on ``c``'s device (table in module doc);
        ``kernel_choice`` picks the Triton layout kernels or torch ops (same bytes)."""
        c.validate()  # includes: both biases or neither
        Hp, Ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, activation, options)
        # Padding and steps A/B are one row gather: kernel row j <- source row tab[j] (-1 = padding).
        tabs = {"w13": w13_row_table(c.intermediate_size, Ip, c.row_order, c.device),
                "w2": w2_row_table(c.hidden_size, Hp, c.device)}  # fmt: skip
        cols = {"w13": Hp, "w2": Ip}  # K of each matrix
        lt = layout_kernels(c.w13, kernel_choice)
        out: KernelTensors = {}
        for w, tab in tabs.items():
            weight, scale, k = getattr(c, w), getattr(c, f"{w}_scale"), cols[w]
            if lt is not None:
                out[f"{w}_weight"] = lt.gather_rows(weight, tab, k // 2)
                swizzled = lt.swizzle_128x4(scale, tab, k // MX_BLOCK, SCALE_FILL).view(c.num_experts, len(tab), k // MX_BLOCK)
                out[f"{w}_weight_scale"] = swizzled.view(torch_dtype(KERNEL_SCALE_DTYPE))
            else:
                out[f"{w}_weight"] = gather_padded_rows(weight, tab, k // 2, 0)
                out[f"{w}_weight_scale"] = _swizzled_kernel_scales(gather_padded_rows(scale, tab, k // MX_BLOCK, SCALE_FILL))
        if c.w13_bias is not None and c.w2_bias is not None:
            for w, tab in tabs.items():
                out[f"{w}_bias"] = gather_padded_rows(getattr(c, f"{w}_bias").to(torch_dtype(KERNEL_BIAS_DTYPE)), tab)
        return out

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, activation: str,
                    options: TrtllmOptions) -> CanonicalExperts:  # fmt: skip
        """Kernel tensors -> canonical (unpadded) stack; biases come back as float32 (LayoutError as
        :meth:`TrtllmLayout.from_kernel` says)."""
        check_kernel_tensors(k, self.kernel_specs(sizes, activation, options))
        Hp, Ip = sizes.padded_hidden_size, sizes.padded_intermediate_size
        device = k["w13_weight"].device
        dst13 = w13_row_dst(Ip, sizes.row_order, device)
        dst2 = w2_row_dst(Hp, device)
        padded = CanonicalExperts(
            w13=k["w13_weight"].index_select(1, dst13),
            w13_scale=_unswizzled_kernel_scales(k["w13_weight_scale"]).index_select(1, dst13),
            w2=k["w2_weight"].index_select(1, dst2),
            w2_scale=_unswizzled_kernel_scales(k["w2_weight_scale"]).index_select(1, dst2),
            w13_bias=k["w13_bias"].index_select(1, dst13) if sizes.has_bias else None,
            w2_bias=k["w2_bias"].index_select(1, dst2) if sizes.has_bias else None,
            row_order=sizes.row_order,
        )
        return unpad_canonical(padded, sizes.hidden_size, sizes.intermediate_size, scale_fill=SCALE_FILL, check=True)

    def describe(self, sizes: LayoutSizes, activation: str, options: TrtllmOptions) -> dict[str, Any]:
        """Manifest ``layout`` fields of the MXFP4 form (kernel_params are added by the caller)."""
        self._checked_padding(sizes, activation, options)
        return {
            "name": BACKEND_NAME,
            "version": LAYOUT_VERSION,
            "engine_compat": _engine_compat(options.intermediate_align),
            "activation": activation,
            "vllm_moe_backend": VLLM_BACKENDS[activation],
            "epilogue_tile_m": EPILOGUE_TILE_M,
            "shuffle_block_rows": SHUFFLE_BLOCK_ROWS,
            "num_elts_per_sf": NUM_ELTS_PER_SF,
            "scale_swizzle": f"{SF_TILE_ROWS}x{SF_TILE_COLS}",
            "scale_dtype": "float8_e4m3fn view of E8M0 bytes",
            "scale_fill": SCALE_FILL,
            "bias_dtype": "float32",
            "w13_kernel_row_order": "up_gate_pairs",
            "hidden_align": HIDDEN_ALIGN,
            "intermediate_align": options.intermediate_align,
        }


MXFP4 = TrtllmMxfp4()


class TrtllmLayout(FormsLayout):
    """FlashInfer TRT-LLM-gen MXFP4 MoE layout (see module docstring); every step is its weight
    format's form's."""

    name = BACKEND_NAME
    version = LAYOUT_VERSION
    # int4: the MxInt4 form (trtllm_mxint4); mxfp8: trtllm_mxfp8 (Fp8MoeBackend.FLASHINFER_TRTLLM, MXFP8 activations)
    weight_forms = {"mxfp4": MXFP4, "int4": MXINT4, "mxfp8": MXFP8}
    options_type = TrtllmOptions
    options = (
        LayoutOption(
            "intermediate_align", int, DEFAULT_INTERMEDIATE_ALIGN,
            "per-rank intermediate size padded to this multiple: 128 is what vLLM >= 0.27 (0.33 included) "
            "allocates for FLASHINFER_TRTLLM_MXFP4_*; 256 is what vLLM 0.10.2-0.26 and SGLang's FlashInfer "
            "MXFP4 MoE allocate",
            check=_align_problem,
        ),
    )

    def kernel_unavailable(self, manifest: Manifest, device: Any = "cuda",
                           kernel_locations: KernelLocations | None = None) -> str | None:  # fmt: skip
        """FlashInfer's TRT-LLM-gen MoE kernels need an SM100 GPU; mxconv does not drive them yet."""
        import torch

        try:
            import flashinfer  # noqa: F401
        except ModuleNotFoundError as exc:
            if exc.name == "flashinfer":
                return "flashinfer is not installed (pip install 'mxconv[flashinfer]')"
            return f"flashinfer is installed but cannot be imported: {exc}"
        except Exception as exc:  # noqa: BLE001 - whatever its import raises is the reason
            return f"flashinfer is installed but cannot be imported: {type(exc).__name__}: {exc}"
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 10:
            kind = self.form(manifest.weight_format).kernel_label
            return f"FlashInfer TRT-LLM-gen {kind} MoE kernels need an SM100 (Blackwell) GPU"
        return "running the TRT-LLM-gen kernel is not wired up in this version"


def _engine_compat(intermediate_align: int) -> dict[str, str]:
    """The manifest's ``engine_compat`` for this padding: the vLLM releases that allocate it, FlashInfer."""
    vllm = VLLM_RELEASES_BY_ALIGN.get(intermediate_align)
    return {"vllm": vllm, "flashinfer": FLASHINFER_COMPAT} if vllm else {"flashinfer": FLASHINFER_COMPAT}


def _swizzled_kernel_scales(row_permuted: torch.Tensor) -> torch.Tensor:
    """[E, R, C] uint8 (rows already permuted) -> [E, R, C] float8_e4m3fn view of the swizzled bytes."""
    E, R, C = row_permuted.shape
    if swizzled_scale_size(R, C) != R * C:
        raise LayoutError(f"trtllm scale matrix [{R}, {C}] needs R % 128 == 0 and C % 4 == 0")
    return swizzle_128x4(row_permuted).reshape(E, R, C).view(torch_dtype(KERNEL_SCALE_DTYPE))


def _unswizzled_kernel_scales(kernel_scale: torch.Tensor) -> torch.Tensor:
    """[E, R, C] float8_e4m3fn kernel scales -> [E, R, C] uint8 matrix (rows still permuted)."""
    import torch

    E, R, C = kernel_scale.shape
    return unswizzle_128x4(kernel_scale.view(torch.uint8).reshape(E, R * C), R, C)


LAYOUT = TrtllmLayout()
