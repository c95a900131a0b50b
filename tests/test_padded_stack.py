"""layouts/padded_stack.py: a backend declared by constants and byte maps alone (issue 31 item 4).

A toy declaration (weights XOR 0x5A, scales transposed, w13 rows reversed; bf16) and a second form
that stores the canonical bytes as they are (fp8), against bytes built by hand: zero padding of
each half (halves) or appended pairs (interleaved), then the maps; the inverse, its padding checks
and the manifest fields the base writes."""

from __future__ import annotations

import pytest
import torch

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts
from mxconv.layouts.padded_stack import AS_STORED, PaddedStackLayout, RowMap, StackForm, Transform

E, H, I, ALIGN = 2, 96, 160, 64  # padded to (128, 192)


def _xor(t: torch.Tensor) -> torch.Tensor:
    return (t ^ 0x5A).contiguous()


def _transposed(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous()


def _reversed(t: torch.Tensor, row_order: str) -> torch.Tensor:
    return t.flip(1).contiguous()


TOY = StackForm(
    "TOY_BF16",
    weight=Transform.pair(_xor, _xor),
    scale=Transform.pair(_transposed, _transposed, lambda rows, cols: (cols, rows)),
    w13_rows=RowMap(_reversed, _reversed, "reversed"),
    notes={"weight_packing": "xor 0x5a"},
)


class ToyStack(PaddedStackLayout):
    name = "toy-stack"
    version = 3
    hidden_align = intermediate_align = ALIGN
    padding_rule = f"both rounded up to {ALIGN}"
    bias_dtype = "F32"
    engine_compat = {"toy": ">=1"}
    forms = {"bf16": TOY, "fp8": StackForm("TOY_FP8", weight=AS_STORED)}


LAYOUT = ToyStack()


def stack(row_order: str, bias: bool) -> CanonicalExperts:
    g = torch.Generator().manual_seed(7)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(1, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    return CanonicalExperts(
        u8(E, 2 * I, H // 2), u8(E, 2 * I, H // 32), u8(E, H, I // 2), u8(E, H, I // 32),
        torch.randn(E, 2 * I, generator=g).to(torch.bfloat16) if bias else None,
        torch.randn(E, H, generator=g).to(torch.bfloat16) if bias else None,
        row_order,
    )


def padded_w13(t: torch.Tensor, row_order: str, Ip: int, cols: int) -> torch.Tensor:
    """A w13-like [E, 2I, c] zero-padded by hand to [E, 2Ip, cols]."""
    out = torch.zeros((t.shape[0], 2 * Ip, cols), dtype=t.dtype)
    if row_order == "halves":
        out[:, :I, : t.shape[2]], out[:, Ip : Ip + I, : t.shape[2]] = t[:, :I], t[:, I:]
    else:
        out[:, : 2 * I, : t.shape[2]] = t
    return out


def test_declaration_gives_the_protocol_members() -> None:
    assert LAYOUT.activations == ("bf16", "fp8")
    assert LAYOUT.vllm_backends == {"bf16": ("TOY_BF16",), "fp8": ("TOY_FP8",)}
    assert LAYOUT.padded_sizes(H, I, "halves", "bf16") == (128, 192)
    with pytest.raises(LayoutError, match="toy-stack: hidden size 100 must be a positive multiple of 32"):
        LAYOUT.padded_sizes(100, I, "halves", "bf16")
    with pytest.raises(LayoutError, match="does not support activation 'mxfp4'"):
        LAYOUT.padded_sizes(H, I, "halves", "mxfp4")


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
@pytest.mark.parametrize("bias", [True, False])
def test_bytes_against_hand_padding_and_maps(row_order: str, bias: bool) -> None:
    c = stack(row_order, bias)
    Hp, Ip = 128, 192
    k = LAYOUT.to_kernel(c, "bf16", LAYOUT.resolve_options())
    assert list(k) == ["w13_weight", "w13_weight_scale", *(["w13_bias"] if bias else []),
                       "w2_weight", "w2_weight_scale", *(["w2_bias"] if bias else [])]  # fmt: skip
    assert torch.equal(k["w13_weight"], padded_w13(c.w13, row_order, Ip, Hp // 2).flip(1) ^ 0x5A)
    assert torch.equal(k["w13_weight_scale"], padded_w13(c.w13_scale, row_order, Ip, Hp // 32).flip(1).transpose(1, 2))
    w2 = torch.zeros((E, Hp, Ip // 2), dtype=torch.uint8)
    w2[:, :H, : I // 2] = c.w2
    assert torch.equal(k["w2_weight"], w2 ^ 0x5A)
    if bias:
        b13 = padded_w13(c.w13_bias.float().unsqueeze(-1), row_order, Ip, 1).squeeze(-1)
        assert k["w13_bias"].dtype == torch.float32 and torch.equal(k["w13_bias"], b13.flip(1))
    sizes = c.sizes(Hp, Ip)
    specs = LAYOUT.kernel_specs(sizes, "bf16", LAYOUT.resolve_options())
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {n: (s.shape, s.dtype) for n, s in specs.items()}
    back = LAYOUT.from_kernel(k, sizes, "bf16", LAYOUT.resolve_options())
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, name), getattr(c, name)), name
    if bias:
        assert torch.equal(back.w13_bias, c.w13_bias.float()) and torch.equal(back.w2_bias, c.w2_bias.float())


def test_as_stored_form_keeps_the_canonical_bytes() -> None:
    c = stack("halves", False)
    k = LAYOUT.to_kernel(c, "fp8", LAYOUT.resolve_options())
    assert torch.equal(k["w13_weight"], padded_w13(c.w13, "halves", 192, 64))
    assert torch.equal(k["w13_weight_scale"], padded_w13(c.w13_scale, "halves", 192, 4))


def test_padding_that_is_not_zero_is_named() -> None:
    c = stack("interleaved", False)
    sizes = c.sizes(128, 192)
    k = LAYOUT.to_kernel(c, "bf16", LAYOUT.resolve_options())
    k["w2_weight"][1, 100, 3] ^= 0x01  # row 100 >= H: padding, 0x5A once mapped
    with pytest.raises(LayoutError, match=r"padding of w2_weight at index \[1, 100, 3\]"):
        LAYOUT.from_kernel(k, sizes, "bf16", LAYOUT.resolve_options())
    with pytest.raises(LayoutError, match=r"do not match the layout's \(128, 192\) .*both rounded up to 64"):
        LAYOUT.kernel_specs(c.sizes(128, 256), "bf16", LAYOUT.resolve_options())


def test_describe_writes_the_common_fields_then_the_notes() -> None:
    sizes = stack("halves", True).sizes(128, 192)
    assert LAYOUT.describe(sizes, "bf16", LAYOUT.resolve_options()) == {
        "name": "toy-stack", "version": 3, "engine_compat": {"toy": ">=1"}, "activation": "bf16",
        "vllm_moe_backend": "TOY_BF16", "padding": {"hidden_align": 64, "intermediate_align": 64, "fill": 0},
        "w13_kernel_row_order": "reversed", "weight_packing": "xor 0x5a", "bias_dtype": "float32",
    }
    assert LAYOUT.describe(sizes, "fp8", LAYOUT.resolve_options())["w13_kernel_row_order"] == "halves"
