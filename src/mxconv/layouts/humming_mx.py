"""The MX weight formats of ``--backend humming`` (spec: docs/layout-humming.md), one object each.

humming-kernels 0.1.19 lays out MXFP4 and MXFP8 experts the same way on SM90 with 16-bit activations
(padding, scale and bias maps, layer configs) except for what follows from the element width and the
vLLM 0.33 quant method that loads them; a :class:`HummingMX` holds exactly that difference and
lays its format out (the part that one of :mod:`mxconv.layouts.humming`'s ``HummingForm`` objects composes, as
:class:`mxconv.layouts.humming_int4.HummingInt4` is the INT4 form's):

* the weight word map: ``weight_repack_nk`` with kNumBitsB 4 (eight E2M1 codes a word,
  :func:`~mxconv.layouts.humming_bytemap.repack_weights`) or 8 (four E4M3 bytes a word,
  :func:`~mxconv.layouts.humming_bytemap.repack_bytes`);
* the layer vLLM allocates before humming's own padding: the MXFP4 methods round the per-rank
  intermediate size up to 64 (``mxfp4_round_up_hidden_size_and_intermediate_size``, CUDA default
  branch); the MXFP8 ones (``CompressedTensorsW8A8Mxfp8MoEMethod``, the online ``Mxfp8OnlineMoEMethod``)
  pad nothing;
* the ``LayerConfig.b_dtype`` humming's schema gives them (``Mxfp4WeightSchema``: float4e2m1;
  ``ModeloptMxfp8WeightSchema``, which vLLM's ``_humming_fp8_weight_schema`` picks for E8M0 group
  scales: float8e4m3) and the vLLM oracle whose ``HUMMING`` value holds the bytes.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from mxconv.errors import LayoutError
from mxconv.experts.padding import check_fill, unpad_canonical
from mxconv.experts.kernel_settings import KernelChoice
from mxconv.experts.stack import CanonicalExperts, LayoutSizes, round_up, values_per_byte
from mxconv.experts.tensors import KernelTensors, TensorSpec, in_kernel_order
from mxconv.layouts.checks import check_block_sizes
from mxconv.layouts.forms import MXFP8_ORACLE
from mxconv.layouts.gathers import cached_index, extend_rows, gather_padded_rows, layout_kernels, pad_row_source
from mxconv.layouts.humming_bytemap import (
    SCALE_PAD_BYTE, gemm_shapes, lay_out_bias, lay_out_scales, pad_matrix, pad_vector, repack_bytes, repack_weights,
    scale_columns,
    unlay_bias, unlay_scales, unrepack_bytes, unrepack_weights,
)

if TYPE_CHECKING:
    import torch

__all__ = ["MX_FORMATS", "MXFP4", "MXFP8", "HummingMX", "mx_format"]

BACKEND_NAME = "humming"
MX_BLOCK = 32


@dataclass(frozen=True)
class HummingMX:
    """One MX weight format humming takes: its word map, vLLM's padding and the names it goes by."""

    weight_format: str  # the canonical format (CanonicalExperts.weight_format)
    b_dtype: str  # humming LayerConfig.b_dtype
    intermediate_align: int  # vLLM rounds the per-rank intermediate size up to this before humming pads
    repack: Callable[[torch.Tensor, str], torch.Tensor] = field(repr=False)
    unrepack: Callable[[torch.Tensor, str], torch.Tensor] = field(repr=False)
    # the Triton layout kernel's ``repack`` (lt, canonical weights, row table, K): padding fused in, same bytes
    kernel_repack: Callable[[Any, torch.Tensor, torch.Tensor, int], torch.Tensor] = field(repr=False)
    weight_dtype: str = ""  # the manifest's description of the stored words
    manifest_head: dict[str, Any] = field(default_factory=dict)  # manifest fields before engine_compat
    manifest_oracle: dict[str, Any] = field(default_factory=dict)  # after vllm_moe_backend (none for MX)
    bias_refusal: str | None = None  # humming's MX forms hold expert biases

    @property
    def values_per_byte(self) -> int:
        return values_per_byte(self.weight_format)

    def words_per_row(self, n: int) -> int:
        """int32 words in one stored row (16 K values of every one of ``n`` output rows)."""
        return 4 * n // self.values_per_byte

    def padded_sizes(self, hidden_size: int, intermediate_size: int, row_order: str) -> tuple[int, int]:
        """(H, roundup(I, intermediate_align)); LayoutError unless H, I are multiples of 32."""
        check_block_sizes(BACKEND_NAME, hidden_size, intermediate_size, row_order, MX_BLOCK)
        return hidden_size, round_up(intermediate_size, self.intermediate_align)

    def _shapes(self, sizes: LayoutSizes) -> dict[str, tuple[int, int, int, int]]:
        want = self.padded_sizes(sizes.hidden_size, sizes.intermediate_size, sizes.row_order)
        got = (sizes.padded_hidden_size, sizes.padded_intermediate_size)
        if got != want:
            raise LayoutError(f"humming: padded sizes (Hp, Ip) = {got} do not match the layout's {want} "
                              f"(Hp = H, Ip = roundup(I, {self.intermediate_align}) for {self.weight_format})")  # fmt: skip
        return gemm_shapes(sizes.hidden_size, sizes.padded_intermediate_size)

    def kernel_specs(self, sizes: LayoutSizes) -> dict[str, TensorSpec]:
        """Shapes/dtypes of the stored tensors (mxconv.layouts.humming's table)."""
        E, specs = sizes.num_experts, {}
        for w, (_n, _k, n_pad, k_pad) in self._shapes(sizes).items():
            specs[f"{w}_weight"] = TensorSpec((E, k_pad // 16, self.words_per_row(n_pad)), "I32")
            specs[f"{w}_weight_scale"] = TensorSpec((E, k_pad // MX_BLOCK, n_pad), "F8_E8M0")
            if sizes.has_bias:
                specs[f"{w}_bias"] = TensorSpec((E, n_pad), "BF16")
        return in_kernel_order(specs)

    def stack_choices(self, c: CanonicalExperts, codes: Any) -> dict[str, str]:
        """Nothing chosen from the data (INT4's code forms only)."""
        return {}

    def to_kernel(self, c: CanonicalExperts, codes: Any, kernel_choice: KernelChoice) -> KernelTensors:
        """Canonical stack -> stored tensors on ``c``'s device (``codes`` unused). ``kernel_choice``
        picks the Triton layout kernels for the weights and scales on CUDA (same bytes); biases take
        torch ops."""
        import torch

        c.validate()
        H, Ip = self.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order)
        vpb = self.values_per_byte
        rows = {"w13": (2 * c.intermediate_size, 2 * Ip, c.row_order), "w2": (H, H, None)}  # pad_row_source's arguments
        tabs = {w: cached_index(("humming-rows", *r), c.device, lambda r=r: pad_row_source(*r)) for w, r in rows.items()}
        lt = layout_kernels(c.w13, kernel_choice)
        out: KernelTensors = {}
        for w, (_n, k, n_pad, k_pad) in gemm_shapes(H, Ip).items():
            # vLLM's layer (zeros, w2's K axis padded to Ip too), then humming's own padding
            if lt is not None:  # the weights' two paddings are zeros: rows past the table, K up to k_pad
                full = cached_index(("humming-rows", *rows[w], n_pad), c.device, lambda w=w: extend_rows(pad_row_source(*rows[w]), n_pad))
                out[f"{w}_weight"] = self.kernel_repack(lt, getattr(c, w), full, k_pad)
                scale = _kernel_scales(lt, getattr(c, f"{w}_scale"), rows[w], n_pad, (k // MX_BLOCK, k_pad // MX_BLOCK))
            else:
                weight = pad_matrix(gather_padded_rows(getattr(c, w), tabs[w], k // vpb), n_pad, k_pad // vpb, 0)
                out[f"{w}_weight"] = self.repack(weight, f"{w}_weight")
                scale = gather_padded_rows(getattr(c, f"{w}_scale"), tabs[w], k // MX_BLOCK)
                scale = lay_out_scales(pad_matrix(scale, n_pad, k_pad // MX_BLOCK, SCALE_PAD_BYTE))
            out[f"{w}_weight_scale"] = scale.view(torch.float8_e8m0fnu)
            bias = getattr(c, f"{w}_bias")
            if bias is not None:
                out[f"{w}_bias"] = lay_out_bias(pad_vector(gather_padded_rows(bias.to(torch.bfloat16), tabs[w]), n_pad))
        return in_kernel_order(out)

    def from_kernel(self, k: KernelTensors, sizes: LayoutSizes, codes: Any) -> CanonicalExperts:
        """Exact inverse of :meth:`to_kernel` (biases as bf16), the tensor set already checked;
        LayoutError for a padding byte other than its fill (tensor and index named)."""
        import torch

        H, Ip = sizes.hidden_size, sizes.padded_intermediate_size
        parts: dict[str, Any] = {}
        for w, (n, kk, _n_pad, _k_pad) in self._shapes(sizes).items():
            weight = self.unrepack(k[f"{w}_weight"], f"{w}_weight")
            parts[w] = _crop(f"{w}_weight", weight, n, kk // self.values_per_byte, 0)
            scale = unlay_scales(k[f"{w}_weight_scale"].view(torch.uint8))
            parts[f"{w}_scale"] = _crop(f"{w}_weight_scale", scale, n, kk // MX_BLOCK, SCALE_PAD_BYTE)
            if sizes.has_bias:
                bias = unlay_bias(k[f"{w}_bias"])
                check_fill(f"{w}_bias", bias[:, n:], 0, (0, n))
                parts[f"{w}_bias"] = bias[:, :n].contiguous()
        padded = CanonicalExperts(row_order=sizes.row_order, weight_format=self.weight_format, **parts)
        if padded.intermediate_size != Ip or padded.hidden_size != H:
            raise LayoutError("humming: kernel tensors do not match the declared sizes")
        return unpad_canonical(padded, H, sizes.intermediate_size, scale_fill=0, check=True)

    def storage_fields(self, codes: Any) -> dict[str, Any]:
        """The manifest's fields on the stored words, scales and biases."""
        return {"scale_pad_byte": SCALE_PAD_BYTE, "weight_dtype": self.weight_dtype,
                "scale_dtype": "float8_e8m0fnu", "bias_dtype": "bfloat16"}  # fmt: skip

    def layer_config_fields(self, weight: str, codes: Any) -> dict[str, Any]:
        """The ``LayerConfig`` fields this format sets (over humming.py's MX defaults)."""
        return {"b_dtype": self.b_dtype}


def _kernel_scales(lt: Any, scales: torch.Tensor, rows: tuple[int, int, str | None], n_pad: int,
                   cols: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """The stored scales [E, K_pad/32, N_pad] of canonical ``scales`` [E, N_in, G_in] by the Triton
    transpose kernel: rows padded as vLLM pads them (``rows``: pad_row_source's arguments; zeros) and
    put in humming's column map, columns up to ``cols[0]`` = K/32 (zeros past G_in); then humming's own
    padding, rows past vLLM's and columns from K/32 to ``cols[1]`` = K_pad/32, set to SCALE_PAD_BYTE
    (lay_out_scales' bytes)."""
    import torch

    source, own_pad = scale_columns(rows[1], n_pad)

    def build() -> torch.Tensor:
        return extend_rows(pad_row_source(*rows), n_pad)[torch.tensor(source, dtype=torch.long)]

    stored = lt.transpose_rows(scales, cached_index(("humming-scales", *rows, n_pad), scales.device, build), cols[1])
    stored[:, cols[0]:, :] = SCALE_PAD_BYTE
    if own_pad:  # the columns as a cached device index (no host copy per call: update_layer runs this every step)
        fill = cached_index(("humming-scale-fill", rows[1], n_pad), scales.device, lambda: torch.tensor(own_pad))
        stored.index_fill_(2, fill.long(), SCALE_PAD_BYTE)
    return stored


def _crop(name: str, x: torch.Tensor, rows: int, cols: int, fill: int) -> torch.Tensor:
    """[E, R, C] -> [E, rows, cols] after checking humming's padding region holds ``fill``."""
    check_fill(name, x[:, rows:], fill, (0, rows, 0))
    check_fill(name, x[:, :rows, cols:], fill, (0, 0, cols))
    return x[:, :rows, :cols].contiguous()


def _nibble_tiles(lt: Any, weights: torch.Tensor, tab: torch.Tensor, K: int) -> torch.Tensor:
    return lt.humming_nibble_stream(weights, tab, K)


def _byte_tiles(lt: Any, weights: torch.Tensor, tab: torch.Tensor, K: int) -> torch.Tensor:
    return lt.byte_tile_stream(weights, tab, K, lt.TileOrder.HUMMING)


MXFP4 = HummingMX(
    "mxfp4", "float4e2m1", 64, repack_weights, unrepack_weights, _nibble_tiles,
    "int32 words of eight E2M1 nibbles (humming weight_repack_nk, interleave_mode 3)",
)  # fmt: skip
MXFP8 = HummingMX(
    "mxfp8", "float8e4m3", 1, repack_bytes, unrepack_bytes, _byte_tiles,
    "int32 words of four E4M3 bytes (humming weight_repack_nk kNumBitsB 8, interleave_mode 3)",
    dict(MXFP8_ORACLE),
)  # fmt: skip
MX_FORMATS = {f.weight_format: f for f in (MXFP4, MXFP8)}


def mx_format(weight_format: str) -> HummingMX:
    """The :class:`HummingMX` of ``weight_format``; LayoutError for a format humming has no MX map for."""
    try:
        return MX_FORMATS[weight_format]
    except KeyError:
        raise LayoutError(f"humming has no MX layout for {weight_format} experts "
                          f"(MX formats: {', '.join(MX_FORMATS)})") from None  # fmt: skip
