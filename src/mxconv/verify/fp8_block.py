"""verify, block-FP8 outputs against an MXFP4 reference (``quantize --format fp8-block`` of MXFP4
experts): every 128x128 tile whose binade spread allows an exact re-encode (docs/numerics.md, "Block
FP8": top - low <= 17, from the reference's own codes and scales) must dequantize to exactly the
reference's fp32 values, bit for bit; the tiles that cannot be exact are counted and must be the
number the manifest's ``fp8_tiles`` gives for the layer. The numerics check then holds an all-exact
layer to the "exact" threshold."""

from __future__ import annotations


import torch

from mxconv.families.base import MoELayer
from mxconv.mx.fp8_block import MAX_EXACT_SPREAD, TILE, tile_exponents
from mxconv.mx.numerics import dequantize_fp8_block, dequantize_mx
from mxconv.verify.report import LayerReport
from mxconv.source.manifest import Manifest

_PROJ = ("gate", "up", "down")


def _tile_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per 128x128 tile of [E, N, K] fp32 tensors: all bits equal (NaN compares by being NaN)."""
    same = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
    E, N, K = same.shape
    nb, kb = -(-N // TILE), -(-K // TILE)
    padded = torch.ones((E, nb * TILE, kb * TILE), dtype=torch.bool)
    padded[:, :N, :K] = same
    return padded.view(E, nb, TILE, kb, TILE).all(dim=4).all(dim=2)


def check_fp8_tiles(manifest: Manifest, L: int, ref_layer: MoELayer, conv_layer: MoELayer, rep: LayerReport) -> None:
    """The tile check of layer ``L`` (module docstring) when the output is block-FP8 and the reference
    MXFP4; ``rep`` gets ``fp8_tiles`` and a problem per rule broken. Anything else: nothing."""
    if manifest.weight_format != "fp8-block" or ref_layer.w13_mx is None or ref_layer.w13_mx.fmt != "mxfp4":
        return
    if conv_layer.w13_fp8 is None or conv_layer.w2_fp8 is None or ref_layer.w2_mx is None:
        return
    tiles = inexact = equal = 0
    ref13, ref2 = ref_layer.w13_mx, ref_layer.w2_mx
    n = ref13.data.shape[1] // 2
    pieces = [(ref13, slice(0, n)), (ref13, slice(n, 2 * n)), (ref2, slice(None))]
    for j, ((stack, rows), (data, sinv)) in enumerate(zip(pieces, [*conv_layer.w13_fp8.parts, *conv_layer.w2_fp8.parts])):
        d, s = stack.data[:, rows], stack.scales[:, rows]
        top, low = tile_exponents(d, s)
        can_be_exact = top - low <= MAX_EXACT_SPREAD  # a tile of zeros: sentinels make this true
        same = _tile_equal(dequantize_fp8_block(data, sinv, (TILE, TILE)), dequantize_mx(d, s, "mxfp4"))
        broken = (can_be_exact & ~same).nonzero()
        if len(broken):
            e, bi, bj = (int(i) for i in broken[0])
            rep.problems.append(f"layer {L} fp8-block: expert {e} {_PROJ[j]} block [{bi}, {bj}] can be re-encoded exactly "
                                f"from the MXFP4 reference but does not dequantize to its values bit for bit "
                                f"({len(broken)} such block(s) in this projection)")
        tiles += can_be_exact.numel()
        inexact += int((~can_be_exact).sum())
        equal += int(same.sum())
    rep.fp8_tiles = {"tiles": tiles, "bit_equal": equal, "inexact": inexact}
    claimed = manifest.fp8_tiles.inexact(L) if manifest.fp8_tiles is not None else None
    if claimed is not None and claimed != inexact:
        rep.problems.append(f"layer {L} fp8-block: the manifest's fp8_tiles says {claimed} inexact block(s), "
                            f"the reference's spreads give {inexact}")
