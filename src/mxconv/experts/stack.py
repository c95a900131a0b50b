"""The canonical expert stack every layer speaks: what a family reader reads a MoE layer into, what
a conversion quantizes, slices by rank and hands a backend layout, and what a layout gives back
(:class:`CanonicalExperts`), with its sizes before and after a layout's padding
(:class:`LayoutSizes`).

A backend layout (:mod:`mxconv.layouts`) is a pair of pure functions over a whole expert stack:

    to_kernel(canonical, activation, options)   -> KernelTensors   (padding included)
    from_kernel(kernel, sizes, activation, options) -> CanonicalExperts (padding checked and removed)

Canonical (unpadded) MXFP4 expert stack, one MoE layer, one TP rank:

| field      | shape            | dtype  | meaning |
|------------|------------------|--------|---------|
| w13        | [E, 2I, H/2]     | uint8  | E2M1 pairs, low nibble = even k; rows in `row_order` |
| w13_scale  | [E, 2I, H/32]    | uint8  | E8M0 exponents |
| w2         | [E, H, I/2]      | uint8  | |
| w2_scale   | [E, H, I/32]     | uint8  | |
| w13_bias   | [E, 2I] or None  | any float (bf16 in checkpoints) | rows in `row_order` |
| w2_bias    | [E, H] or None   | any float | |

`row_order` is "interleaved" (gpt-oss: row 2j = gate j, row 2j+1 = up j) or "halves"
(rows [0, I) = gate/w1, rows [I, 2I) = up/w3).

`input_scales` (optional, :class:`InputScales`): the static FP8 activation scales of a W4A8 source
(AMD Quark), one float32 per expert of the **whole layer** for w13's and w2's input, kept whole by
expert groups and TP slices because the engine reduces them over every expert of the layer.

`weight_format` is "mxfp4" (above), "mxfp8" (one E4M3 byte per value: w13 [E, 2I, H] and w2
[E, H, I] uint8, the same E8M0 scales) or "int4": compressed-tensors INT4, the MXFP4 shapes, w13/w2
bytes offset-binary int4 pairs (low nibble = even k) and w13_scale/w2_scale **bf16** group-32 scales
(see mxconv.mx.int4). :func:`values_per_byte` says how many values a weight byte holds. A layout
lists the formats it takes in ``LayoutBase.weight_formats``.

torch is imported lazily, in the functions that compute, so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mxconv.errors import LayoutError

if TYPE_CHECKING:
    import torch

ROW_ORDERS = ("interleaved", "halves")
WEIGHT_FORMATS = ("mxfp4", "mxfp8", "int4")


def values_per_byte(weight_format: str) -> int:
    """Weight values one byte of a canonical ``weight_format`` stack holds: 1 for MXFP8 (E4M3), 2
    for the 4-bit formats (MXFP4, INT4)."""
    return 1 if weight_format == "mxfp8" else 2


def round_up(x: int, m: int) -> int:
    """Smallest multiple of ``m`` that is >= ``x``."""
    return ((x + m - 1) // m) * m


@dataclass(frozen=True)
class InputScales:
    """Static per-tensor FP8 input scales of one MoE layer, per expert (float32 ``[E]`` each, every
    expert of the layer): ``w13`` scales the hidden states entering gate/up, ``w2`` the activations
    entering down. ``names`` are the source tensors they came from (for messages), w13's then w2's."""

    w13: torch.Tensor
    w2: torch.Tensor
    names: tuple[str, ...] = ()

    def reduced(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) reduced as vLLM 0.33 does for W4A8: the maximum over experts, a 0-dim float32."""
        import torch

        return self.w13.max().to(torch.float32), self.w2.max().to(torch.float32)

    def to(self, device: torch.device | str) -> "InputScales":
        return InputScales(self.w13.to(device), self.w2.to(device), self.names)


@dataclass
class CanonicalExperts:
    """One MoE layer's experts in canonical form (MXFP4, MXFP8 or INT4; module docstring for shapes)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    row_order: str = "halves"
    weight_format: str = "mxfp4"  # "mxfp4" | "mxfp8" | "int4" (bf16 scales)
    input_scales: InputScales | None = None  # W4A8 sources: static FP8 input scales (module docstring)

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def values_per_byte(self) -> int:
        """Weight values per byte of w13 / w2 (:func:`values_per_byte` of the weight format)."""
        return values_per_byte(self.weight_format)

    @property
    def hidden_size(self) -> int:
        """H: input width of w13 (= output rows of w2)."""
        return int(self.w13.shape[2]) * self.values_per_byte

    @property
    def intermediate_size(self) -> int:
        """I: per-expert intermediate width (w13 has 2I rows)."""
        return int(self.w13.shape[1]) // 2

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def sizes(self, padded_hidden_size: int, padded_intermediate_size: int) -> "LayoutSizes":
        """This stack's :class:`LayoutSizes` once padded to (Hp, Ip)."""
        return LayoutSizes(
            num_experts=self.num_experts,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            padded_hidden_size=padded_hidden_size,
            padded_intermediate_size=padded_intermediate_size,
            row_order=self.row_order,
            has_bias=self.w13_bias is not None or self.w2_bias is not None,
            weight_format=self.weight_format,
        )

    def to(self, device: torch.device | str) -> "CanonicalExperts":
        """Copy every tensor to ``device`` (non-blocking where possible)."""
        import torch


        # non_blocking only host -> device: a device -> host copy must be complete before use.
        non_blocking = torch.device(device).type != "cpu"

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            w13=mv(self.w13),
            w13_scale=mv(self.w13_scale),
            w2=mv(self.w2),
            w2_scale=mv(self.w2_scale),
            w13_bias=mv(self.w13_bias),
            w2_bias=mv(self.w2_bias),
            input_scales=None if self.input_scales is None else self.input_scales.to(device),
        )

    def validate(self) -> None:
        """Raise LayoutError unless shapes/dtypes are a consistent canonical stack."""
        import torch

        if self.row_order not in ROW_ORDERS:
            raise LayoutError(f"unknown w13 row order {self.row_order!r} (expected one of {ROW_ORDERS})")
        if self.weight_format not in WEIGHT_FORMATS:
            raise LayoutError(f"unknown expert weight format {self.weight_format!r} (expected one of {WEIGHT_FORMATS})")
        scale_dtype = torch.bfloat16 if self.weight_format == "int4" else torch.uint8
        E, n13, hb = self.w13.shape
        vpb = self.values_per_byte
        H, I = hb * vpb, n13 // 2
        want = {
            "w13": (self.w13, (E, 2 * I, H // vpb)),
            "w13_scale": (self.w13_scale, (E, 2 * I, H // 32)),
            "w2": (self.w2, (E, H, I // vpb)),
            "w2_scale": (self.w2_scale, (E, H, I // 32)),
        }
        if n13 % 2:
            raise LayoutError(f"w13 has an odd number of rows ({n13}); expected 2*I")
        if H % 32 or I % 32:
            raise LayoutError(f"hidden ({H}) and intermediate ({I}) sizes must be multiples of 32 for {self.weight_format}")
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape:
                raise LayoutError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
            want_dtype = scale_dtype if name.endswith("_scale") else torch.uint8
            if t.dtype != want_dtype:
                raise LayoutError(f"{name} has dtype {t.dtype}, expected {want_dtype}")
        if (self.w13_bias is None) != (self.w2_bias is None):
            raise LayoutError("w13_bias and w2_bias must both be present or both absent (give both w13_bias and w2_bias, or neither)")
        if self.w13_bias is not None and tuple(self.w13_bias.shape) != (E, 2 * I):
            raise LayoutError(f"w13_bias has shape {tuple(self.w13_bias.shape)}, expected {(E, 2 * I)}")
        if self.w2_bias is not None and tuple(self.w2_bias.shape) != (E, H):
            raise LayoutError(f"w2_bias has shape {tuple(self.w2_bias.shape)}, expected {(E, H)}")


@dataclass(frozen=True)
class LayoutSizes:
    """Unpadded and padded sizes of one rank's expert stack."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    padded_hidden_size: int
    padded_intermediate_size: int
    row_order: str
    has_bias: bool
    weight_format: str = "mxfp4"  # canonical expert format the kernel tensors hold ("mxfp4" | "mxfp8" | "int4")
