"""``--backend humming`` on CPU: the weight byte map against a scalar transcription of humming's
``weight_repack_nk`` loops, the scale/bias maps against humming's permutation lists, round trips
on odd sizes in both row orders, padding checks (tests/test_humming_gpu.py compares with humming)."""

from __future__ import annotations

import pytest
import torch

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts
from mxconv.layouts import get_layout
from mxconv.layouts.humming_bytemap import (
    lay_out_bias,
    lay_out_scales,
    repack_weights,
    unlay_bias,
    unlay_scales,
    unrepack_weights,
)


def _kernel_oracle(packed: torch.Tensor) -> torch.Tensor:
    """weight_repack_nk<4, 16, packed> with interleave_mode 3, one thread lane at a time."""
    E, N, kb = packed.shape
    K = 2 * kb
    nib = torch.stack((packed & 0xF, packed >> 4), -1).view(E, N, K).tolist()
    out = torch.zeros(E, K // 16, 2 * N, dtype=torch.int64)
    new_k = lambda k: (k % 4) * 2 + k // 4  # noqa: E731  (get_interleaved_index, N=8, stride=2)
    for z in range(E):
        for bx in range(N // 64):
            for by in range(K // 64):
                for lane in range(32):
                    tmp = [0] * 128
                    for i in range(8):
                        for j in range(8):
                            for k in range(2):
                                v = nib[z][bx * 64 + i * 8 + lane // 4][by * 64 + j * 8 + (lane % 4) * 2 + k]
                                tmp[(((j // 2) * 4 + i // 2) * 2 + i % 2) * 4 + (j % 2) * 2 + k] = v
                    for i in range(4):
                        for q in range(4):
                            word = sum(tmp[i * 32 + q * 8 + new_k(p)] << (4 * p) for p in range(8))
                            out[z, by * 4 + i, 128 * bx + lane * 4 + q] = word
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def test_weight_map_matches_the_kernel_loops() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (2, 128, 64), dtype=torch.uint8, generator=g)
    got = repack_weights(x, "w")
    assert torch.equal(got, _kernel_oracle(x))
    assert torch.equal(unrepack_weights(got, "w"), x)


def test_scale_and_bias_maps_follow_hummings_permutations() -> None:
    s = torch.arange(2 * 128 * 3, dtype=torch.int64).view(2, 128, 3)
    t = s.transpose(1, 2)  # [E, K/32, N]
    perm = [8 * q + i for i in range(8) for q in range(8)]  # out[8i + q] = in[8q + i]
    want = t.reshape(2, 3, 2, 64)[..., perm].reshape(2, 3, 128)
    assert torch.equal(lay_out_scales(s), want)
    b = torch.arange(2 * 64, dtype=torch.int64).view(2, 64)
    bperm = [8 * a + c + 2 * i for i in range(4) for a in range(4) for c in range(2)]
    assert torch.equal(lay_out_bias(b), b.view(2, 2, 32)[..., bperm].reshape(2, 64))


def _stack(order: str, H: int, I: int, bias: bool) -> CanonicalExperts:
    g = torch.Generator().manual_seed(H * 7 + I)
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g)  # noqa: E731
    return CanonicalExperts(u8(3, 2 * I, H // 2), u8(3, 2 * I, H // 32), u8(3, H, I // 2), u8(3, H, I // 32),
                            torch.randn(3, 2 * I, generator=g) if bias else None,
                            torch.randn(3, H, generator=g) if bias else None, order)  # fmt: skip


@pytest.mark.parametrize("order,H,I,bias", [("halves", 160, 96, False), ("interleaved", 416, 224, True)])
def test_round_trip_and_padding(order: str, H: int, I: int, bias: bool) -> None:
    layout = get_layout("humming")
    opts = layout.resolve_options()
    c = _stack(order, H, I, bias)
    Hp, Ip = layout.padded_sizes(H, I, order, "bf16")
    assert (Hp, Ip) == (H, -(-I // 64) * 64)
    sizes = c.sizes(Hp, Ip)
    k = layout.to_kernel(c, "bf16", opts)
    specs = layout.kernel_specs(sizes, "bf16", opts)
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {n: (s.shape, s.dtype) for n, s in specs.items()}
    back = layout.from_kernel(k, sizes, "bf16", opts)
    for f in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(back, f), getattr(c, f)), f
    if bias:
        assert torch.equal(back.w2_bias, c.w2_bias.to(torch.bfloat16))
    # humming's padding: scale byte 127 in rows past N; change one and from_kernel names it
    sc = k["w2_weight_scale"].view(torch.uint8)
    assert int(sc[0, 0, -1]) == 127 or H % 256 == 0
    bad = dict(k, w2_weight_scale=sc.clone())
    bad["w2_weight_scale"][0, -1, -1] = 3
    with pytest.raises(LayoutError, match="w2_weight_scale"):
        layout.from_kernel({n: t.view(torch.float8_e8m0fnu) if n == "w2_weight_scale" else t for n, t in bad.items()},
                           sizes, "bf16", opts)  # fmt: skip


def test_describe_records_the_layer_configs() -> None:
    layout = get_layout("humming")
    c = _stack("halves", 192, 96, False)
    d = layout.describe(c.sizes(192, 128), "bf16", layout.resolve_options())
    assert d["sm_version"] == 90 and d["activation_type"] == "binary_split"
    w13, w2 = d["layer_configs"]["w13"], d["layer_configs"]["w2"]
    assert (w13["shape_n"], w13["pad_shape_n"], w13["shape_k"], w13["pad_shape_k"]) == (256, 0, 256, 64)
    assert (w2["shape_n"], w2["pad_shape_n"], w2["shape_k"], w2["pad_shape_k"]) == (256, 64, 128, 0)
    with pytest.raises(LayoutError, match="multiple of 32"):
        layout.padded_sizes(200, 96, "halves", "bf16")


def _corrupt(k: dict[str, torch.Tensor], name: str, index: tuple[int, ...], value: float) -> dict[str, torch.Tensor]:
    """``k`` with one element of ``name`` changed, ``index`` taken in the plain (un-repacked) view:
    weights [E, N, K/2] bytes, scales [E, N, K/32] bytes, bias [E, N]."""
    t = k[name]
    if name.endswith("_weight"):
        plain = unrepack_weights(t, name).clone()
        plain[index] = int(value)
        return dict(k, **{name: repack_weights(plain, name)})
    if name.endswith("_scale"):
        plain = unlay_scales(t.view(torch.uint8)).clone()
        plain[index] = int(value)
        return dict(k, **{name: lay_out_scales(plain).view(torch.float8_e8m0fnu)})
    plain = unlay_bias(t).clone()
    plain[index] = value
    return dict(k, **{name: lay_out_bias(plain)})


# H = 416, I = 224 (interleaved rows): Ip = 256; w13 GEMM N = 512 (no N padding), K = 416 -> 512;
# w2 GEMM N = 416 -> 512, K = Ip = 256 (no K padding)
@pytest.mark.parametrize(
    "name,index,value,fill",
    [
        ("w13_weight_scale", (1, 5, 13), 126, 127),  # humming's K padding of the scales (byte 127)
        ("w13_weight_scale", (0, 450, 2), 127, 0),  # vLLM's Ip padding: gate/up rows 2I.. are zero
        ("w13_weight", (2, 449, 7), 0x10, 0),  # vLLM's Ip padding of the weights
        ("w2_weight", (0, 3, 120), 0x01, 0),  # vLLM's Ip padding: w2's K columns I.. are zero
        ("w2_weight_scale", (1, 7, 7), 1, 0),  # vLLM's Ip padding of w2's scales (zero, not 127)
        ("w2_weight", (1, 500, 3), 0x80, 0),  # humming's N padding of the weights
        ("w13_weight", (0, 3, 250), 0x02, 0),  # humming's K padding of the weights
        ("w13_bias", (2, 470), 1.0, 0),  # vLLM's Ip padding of the bias
        ("w2_bias", (0, 430), -2.0, 0),  # humming's N padding of the bias
    ],
)
def test_from_kernel_names_each_corrupted_padding_region(
    name: str, index: tuple[int, ...], value: float, fill: int
) -> None:
    layout = get_layout("humming")
    opts = layout.resolve_options()
    c = _stack("interleaved", 416, 224, True)
    sizes = c.sizes(416, 256)
    k = layout.to_kernel(c, "bf16", opts)
    before = _corrupt(k, name, index, fill)  # writing the fill back changes nothing
    assert all(torch.equal(before[n].view(torch.uint8), k[n].view(torch.uint8)) for n in k)
    with pytest.raises(LayoutError, match=rf"padding of {name} at index \[{', '.join(map(str, index))}\]"):
        layout.from_kernel(_corrupt(k, name, index, value), sizes, "bf16", opts)


def test_from_kernel_names_a_wrong_tensor_set() -> None:
    layout = get_layout("humming")
    opts = layout.resolve_options()
    c = _stack("halves", 160, 96, True)
    sizes = c.sizes(160, 128)
    k = layout.to_kernel(c, "bf16", opts)
    with pytest.raises(LayoutError, match=r"humming kernel tensors: missing \['w2_bias'\]"):
        layout.from_kernel({n: t for n, t in k.items() if n != "w2_bias"}, sizes, "bf16", opts)
    with pytest.raises(LayoutError, match=r"humming kernel tensors: missing \[\], unexpected \['extra'\]"):
        layout.from_kernel(dict(k, extra=k["w2_bias"]), sizes, "bf16", opts)
    with pytest.raises(LayoutError, match="humming kernel tensor w13_weight is"):
        layout.from_kernel(dict(k, w13_weight=k["w13_weight"][:, :-1]), sizes, "bf16", opts)
