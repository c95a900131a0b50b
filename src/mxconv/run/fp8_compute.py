"""The compute step of ``quantize --format fp8-block`` for one MoE layer's stacks: MXFP4 experts are
re-encoded with power-of-two tile scales (exact where the tile's binade spread allows it; the tiles
that are not are counted, and refused with ``--require-exact``), anything else goes through its fp32
values and the amax / 448 rule (:mod:`mxconv.mx.fp8_block`). Gate and up are tiled apart (each is a
Linear of its own in the output), in expert chunks on the compute device.

torch is imported lazily, in the functions that compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from mxconv.errors import BadInput
from mxconv.families.base import FP8BlockStack, Int4Stack, MoELayerRef, MXStack

if TYPE_CHECKING:
    import torch


class ErrorStats(Protocol):
    """What the error statistic of a run takes (:class:`mxconv.run.compute.ErrorStats`)."""

    def add(self, ref: torch.Tensor, approx: torch.Tensor, count: bool = True) -> None: ...

TILE = 128
PROJ_NAMES = {("w13", 0): "gate", ("w13", 1): "up", ("w2", 0): "down"}
CHUNK_ELEMENTS = 1 << 28  # elements of one projection re-encoded at once (fp32 temporaries on the device)


@dataclass
class LayerTiles:
    """One MoE layer's tiles: how many, how many inexact (MXFP4 sources), the largest error and where."""

    module: str
    tiles: int = 0
    inexact: int = 0
    max_abs_error: float = 0.0
    max_error_at: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class BlockStats:
    """Per converted MoE layer, its :class:`LayerTiles` (the summary, ``--json`` and the manifest)."""

    layers: dict[int, LayerTiles] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "tile": [TILE, TILE],
            "tiles": sum(t.tiles for t in self.layers.values()),
            "inexact_tiles": sum(t.inexact for t in self.layers.values()),
            "max_abs_error": max((t.max_abs_error for t in self.layers.values()), default=0.0),
            "layers": {str(L): t.to_json() for L, t in sorted(self.layers.items())},
        }


@dataclass(frozen=True)
class Where:
    """Names a tile for messages: the layer, the canonical stack and the source location of a
    (expert, row, column) element (the reader's ``source_location``)."""

    ref: MoELayerRef
    which: str  # "w13" | "w2"
    first_expert: int
    locate: Callable[[tuple[int, ...]], str]

    def tile(self, part: int, rows0: int, e: int, bi: int, bj: int) -> str:
        r, c = bi * TILE, bj * TILE
        at = self.locate((e + self.first_expert, rows0 + r, c))
        return (f"layer {self.ref.layer} ({self.ref.module_prefix}.experts) expert {e + self.first_expert} "
                f"{PROJ_NAMES[(self.which, part)]}: 128x128 block [{bi}, {bj}] (from {at})")


def _float_part(w: torch.Tensor | MXStack | Int4Stack, rows: slice, e0: int, e1: int, device: torch.device) -> torch.Tensor:
    """fp32 values of experts [e0, e1), rows ``rows`` of a float, MXFP8 or INT4 stack, on ``device``."""
    from mxconv.mx.numerics import dequantize_mx

    if isinstance(w, MXStack):
        return dequantize_mx(w.data[e0:e1, rows].to(device), w.scales[e0:e1, rows].to(device), w.fmt)
    if isinstance(w, Int4Stack):
        return Int4Stack(w.data[e0:e1, rows], w.scales[e0:e1, rows]).dequantize(device=device)
    return w[e0:e1, rows].to(device).float()


def _refuse_nonfinite(x: torch.Tensor, where: Where, e0: int, rows0: int) -> None:
    from mxconv.mx.numerics import first_nonfinite

    idx = first_nonfinite(x)
    if idx is not None:
        at = where.locate((idx[0] + e0 + where.first_expert, idx[1] + rows0, idx[2]))
        raise BadInput(f"non-finite value {x[idx].item()} in {at}; block-FP8 tile scales cannot carry it "
                       "(QuantOptions.allow_nonfinite applies to the MX formats)")


def _part(src: torch.Tensor | MXStack | Int4Stack, rows: slice, part: int, where: Where, require_exact: bool,
          tiles: LayerTiles, errors: ErrorStats | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection (rows ``rows`` of every expert, ``part`` of its stack) -> (E4M3 [E, n, K],
    scale_inv [E, nb, kb]) on ``device``."""
    import torch

    from mxconv.kernels.quantize import float_to_fp8_block, mxfp4_to_fp8_block
    from mxconv.mx.numerics import dequantize_fp8_block, dequantize_mx

    E = int(src.data.shape[0] if isinstance(src, (MXStack, Int4Stack)) else src.shape[0])
    rows0, n = rows.start, rows.stop - rows.start
    K = int(src.scales.shape[-1] * 32 if isinstance(src, (MXStack, Int4Stack)) else src.shape[-1])
    data = torch.empty((E, n, K), dtype=torch.float8_e4m3fn, device=device)
    sinv = torch.empty((E, -(-n // TILE), -(-K // TILE)), dtype=torch.float32, device=device)
    step = max(1, CHUNK_ELEMENTS // max(1, n * K))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        if isinstance(src, MXStack) and src.fmt == "mxfp4":
            d, s = src.data[e0:e1, rows].to(device), src.scales[e0:e1, rows].to(device)
            out = mxfp4_to_fp8_block(d, s)
            _count(out.exact, out.max_error, e0, rows0, part, where, require_exact, tiles)
            ref = dequantize_mx(d, s, "mxfp4") if errors is not None else None
        else:
            ref = _float_part(src, rows, e0, e1, device)
            _refuse_nonfinite(ref, where, e0, rows0)
            out = float_to_fp8_block(ref)
            tiles.tiles += out.scale_inv.numel()
        data[e0:e1], sinv[e0:e1] = out.data, out.scale_inv
        if errors is not None and ref is not None:
            errors.add(ref, dequantize_fp8_block(out.data, out.scale_inv, (TILE, TILE)), count=e0 == 0 and part == 0)
    return data, sinv


def _count(exact: torch.Tensor, max_error: torch.Tensor, e0: int, rows0: int, part: int, where: Where,
           require_exact: bool, tiles: LayerTiles) -> None:
    """Add a chunk's tiles to the layer's count; with ``require_exact`` an inexact one is BadInput."""
    tiles.tiles += exact.numel()
    bad = int((~exact).sum())
    if bad and require_exact:
        e, bi, bj = (int(i) for i in (~exact).nonzero()[0])
        raise BadInput(f"{where.tile(part, rows0, e0 + e, bi, bj)} has no power-of-two scale that keeps every MXFP4 "
                       f"value exact in E4M3 (its binade spread exceeds 17; largest error {float(max_error[e, bi, bj]):.3g}); "
                       f"{bad} such block(s) in this chunk. Unset QuantOptions.require_exact to write them with the least-loss scale")
    tiles.inexact += bad
    if bad:
        worst = float(max_error.max())
        if worst > tiles.max_abs_error:
            e, bi, bj = (int(i) for i in (max_error == max_error.max()).nonzero()[0])
            tiles.max_abs_error, tiles.max_error_at = worst, where.tile(part, rows0, e0 + e, bi, bj)


def to_fp8_block(src: torch.Tensor | MXStack | FP8BlockStack | Int4Stack, halves: int, where: Where, require_exact: bool,
                 tiles: LayerTiles, errors: ErrorStats | None, device: torch.device) -> FP8BlockStack:
    """One canonical stack (``halves`` 2: w13 as gate then up, tiled apart; 1: w2) -> FP8BlockStack on ``device``."""
    if isinstance(src, FP8BlockStack):
        raise BadInput(f"{where.ref.module_prefix}.experts: block-FP8 experts already")
    N = int(src.data.shape[1] if isinstance(src, (MXStack, Int4Stack)) else src.shape[1])
    n = N // halves
    parts = [_part(src, slice(j * n, (j + 1) * n), j, where, require_exact, tiles, errors, device) for j in range(halves)]
    return FP8BlockStack(parts, (TILE, TILE))
