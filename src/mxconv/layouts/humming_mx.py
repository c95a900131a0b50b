"""The MX weight formats of ``--backend humming`` (spec: docs/layout-humming.md), one object each.

humming-kernels 0.1.19 lays out MXFP4 and MXFP8 experts the same way on SM90 with 16-bit activations
(padding, scale and bias maps, layer configs) except for what follows from the element width and the
vLLM 0.33 quant method that loads them; a :class:`HummingMX` holds exactly that difference:

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

torch-free (the maps import torch when they run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from mxconv.errors import LayoutError
from mxconv.layouts.canonical import values_per_byte
from mxconv.layouts.humming_bytemap import repack_bytes, repack_weights, unrepack_bytes, unrepack_weights

if TYPE_CHECKING:
    import torch

__all__ = ["MX_FORMATS", "MXFP4", "MXFP8", "HummingMX", "mx_format"]


@dataclass(frozen=True)
class HummingMX:
    """One MX weight format humming takes: its word map, vLLM's padding and the names it goes by."""

    weight_format: str  # the canonical format (CanonicalExperts.weight_format)
    b_dtype: str  # humming LayerConfig.b_dtype
    intermediate_align: int  # vLLM rounds the per-rank intermediate size up to this before humming pads
    repack: Callable[[torch.Tensor, str], torch.Tensor] = field(repr=False)
    unrepack: Callable[[torch.Tensor, str], torch.Tensor] = field(repr=False)
    weight_dtype: str = ""  # the manifest's description of the stored words
    manifest_extra: dict[str, Any] = field(default_factory=dict)  # manifest layout fields only this format has

    @property
    def values_per_byte(self) -> int:
        return values_per_byte(self.weight_format)

    def words_per_row(self, n: int) -> int:
        """int32 words in one stored row (16 K values of every one of ``n`` output rows)."""
        return 4 * n // self.values_per_byte


MXFP4 = HummingMX(
    "mxfp4", "float4e2m1", 64, repack_weights, unrepack_weights,
    "int32 words of eight E2M1 nibbles (humming weight_repack_nk, interleave_mode 3)",
)  # fmt: skip
MXFP8 = HummingMX(
    "mxfp8", "float8e4m3", 1, repack_bytes, unrepack_bytes,
    "int32 words of four E4M3 bytes (humming weight_repack_nk kNumBitsB 8, interleave_mode 3)",
    {"variant": "mxfp8", "vllm_oracle": "Fp8MoeBackend"},
)  # fmt: skip
MX_FORMATS = {f.weight_format: f for f in (MXFP4, MXFP8)}


def mx_format(weight_format: str) -> HummingMX:
    """The :class:`HummingMX` of ``weight_format``; LayoutError for a format humming has no MX map for."""
    try:
        return MX_FORMATS[weight_format]
    except KeyError:
        raise LayoutError(f"humming has no MX layout for {weight_format} experts "
                          f"(MX formats: {', '.join(MX_FORMATS)})") from None  # fmt: skip
