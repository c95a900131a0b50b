"""A canonical expert stack (:mod:`mxconv.experts.stack`) zero-padded to a layout's (Hp, Ip) and cut
back, every padding region checked: the padding vLLM allocates, which every backend layout, TP's
narrower last rank and the refit of a served model share.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------------------------
# Padding shared by all backends: vLLM allocates zeroed params at padded sizes and copies the
# checkpoint into the leading corner; for the halves order each half is padded on its own.
# ---------------------------------------------------------------------------------------------


def _pad_rows(t: torch.Tensor, rows: int, row_order: str, fill: int | float) -> torch.Tensor:
    """Pad dim 1 of a w13-like tensor [E, 2I, ...] to [E, 2*Ip, ...] following ``row_order``."""
    import torch

    E, n = t.shape[0], t.shape[1]
    I, Ip = n // 2, rows // 2
    if n == rows:
        return t
    out = torch.full((E, rows, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    if row_order == "halves":
        out[:, :I] = t[:, :I]
        out[:, Ip : Ip + I] = t[:, I:]
    else:
        out[:, :n] = t
    return out


def pad_last(t: torch.Tensor, cols: int, fill: int | float) -> torch.Tensor:
    """Pad the last axis of ``t`` to ``cols`` with ``fill`` (``t`` itself when already that wide)."""
    import torch

    if t.shape[-1] == cols:
        return t
    out = torch.full((*t.shape[:-1], cols), fill, dtype=t.dtype, device=t.device)
    out[..., : t.shape[-1]] = t
    return out


def _pad_dim1(t: torch.Tensor, rows: int, fill: int | float) -> torch.Tensor:
    import torch

    if t.shape[1] == rows:
        return t
    out = torch.full((t.shape[0], rows, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    out[:, : t.shape[1]] = t
    return out


def pad_canonical(c: CanonicalExperts, Hp: int, Ip: int, scale_fill: int = 0) -> CanonicalExperts:
    """Pad a canonical stack to (Hp, Ip): zero weights, ``scale_fill`` scales, zero biases.

    w13 rows follow the row order (interleaved: new pairs appended; halves: each half padded),
    columns (the K axis) are padded at the end; w2 rows padded at the end.
    """
    H, I, vpb = c.hidden_size, c.intermediate_size, c.values_per_byte
    if Hp < H or Ip < I:
        raise LayoutError(f"padded sizes ({Hp}, {Ip}) smaller than ({H}, {I})")
    w13 = pad_last(_pad_rows(c.w13, 2 * Ip, c.row_order, 0), Hp // vpb, 0)
    s13 = pad_last(_pad_rows(c.w13_scale, 2 * Ip, c.row_order, scale_fill), Hp // 32, scale_fill)
    w2 = pad_last(_pad_dim1(c.w2, Hp, 0), Ip // vpb, 0)
    s2 = pad_last(_pad_dim1(c.w2_scale, Hp, scale_fill), Ip // 32, scale_fill)
    b13 = None if c.w13_bias is None else _pad_rows(c.w13_bias, 2 * Ip, c.row_order, 0)
    b2 = None if c.w2_bias is None else _pad_dim1(c.w2_bias, Hp, 0)
    return CanonicalExperts(w13, s13, w2, s2, b13, b2, c.row_order, c.weight_format, c.input_scales)


def check_fill(name: str, region: torch.Tensor, fill: int | float, offset: tuple[int, ...]) -> None:
    """Raise LayoutError naming the first element of ``region`` that is not ``fill``."""
    if region.numel() == 0:
        return
    bad = region != fill
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0].tolist()]
        where = tuple(o + i for o, i in zip(offset, idx))
        raise LayoutError(
            f"padding of {name} at index {list(where)} holds {region[tuple(idx)].item()!r}, expected {fill!r}"
        )


def unpad_canonical(
    c: CanonicalExperts, H: int, I: int, scale_fill: int | None = 0, check: bool = True
) -> CanonicalExperts:
    """Inverse of :func:`pad_canonical`: crop to (H, I), checking every padding region holds its fill.

    ``scale_fill=None`` skips the scale-padding check (bytes the engine leaves undefined).
    """
    import torch

    Ip, vpb = c.intermediate_size, c.values_per_byte
    halves = c.row_order == "halves"

    def rows13(t: torch.Tensor) -> torch.Tensor:
        if halves:
            return torch.cat([t[:, :I], t[:, Ip : Ip + I]], dim=1)
        return t[:, : 2 * I]

    if check:
        pads13 = [(I, Ip), (Ip + I, 2 * Ip)] if halves else [(2 * I, 2 * Ip)]
        checks: list[tuple[str, torch.Tensor, int | float | None, int]] = [
            ("w13_weight", c.w13, 0, H // vpb),
            ("w13_weight_scale", c.w13_scale, scale_fill, H // 32),
        ]
        for name, t, fill, kcols in checks:
            if fill is None:
                continue
            for lo, hi in pads13:
                check_fill(name, t[:, lo:hi], fill, (0, lo, 0))
            check_fill(name, t[..., kcols:], fill, (0, 0, kcols))
        for name, t, fill, kcols in (("w2_weight", c.w2, 0, I // vpb), ("w2_weight_scale", c.w2_scale, scale_fill, I // 32)):
            if fill is None:
                continue
            check_fill(name, t[:, H:], fill, (0, H, 0))
            check_fill(name, t[..., kcols:], fill, (0, 0, kcols))
        if c.w13_bias is not None:
            for lo, hi in pads13:
                check_fill("w13_bias", c.w13_bias[:, lo:hi], 0, (0, lo))
        if c.w2_bias is not None:
            check_fill("w2_bias", c.w2_bias[:, H:], 0, (0, H))
    return CanonicalExperts(
        w13=rows13(c.w13)[..., : H // vpb].contiguous(),
        w13_scale=rows13(c.w13_scale)[..., : H // 32].contiguous(),
        w2=c.w2[:, :H, : I // vpb].contiguous(),
        w2_scale=c.w2_scale[:, :H, : I // 32].contiguous(),
        w13_bias=None if c.w13_bias is None else rows13(c.w13_bias).contiguous(),
        w2_bias=None if c.w2_bias is None else c.w2_bias[:, :H].contiguous(),
        row_order=c.row_order,
        weight_format=c.weight_format,
        input_scales=c.input_scales,
    )
