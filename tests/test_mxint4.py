"""MxInt4 for TRT-LLM-gen: compressed-tensors INT4 experts (Kimi-K2-Thinking style) read as the
canonical ``int4`` format, repacked to layout-trtllm.md section 9, inverted bit-exactly by verify.

Oracles: compressed-tensors' own ``pack_to_int32`` / ``unpack_from_int32`` for the packing; the
spec's formulas re-derived here in plain Python (row gathers s(j), P(k); the 128x4 offset off(r, c);
block-major K; XOR 0x88); FlashInfer's own row helpers and ``convert_to_block_layout`` (pure torch,
skipped when flashinfer does not import) re-enacting the vLLM MxInt4 load sequence per expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.source.checkpoint import open_checkpoint
from mxconv.run.conversion import Conversion, RunSettings
from mxconv.run.options import QuantOptions, RepackOptions
from mxconv.run.plan import build_plan
from mxconv.errors import BadInput, LayoutError
from mxconv.families import detect_family
from mxconv.mx.int4 import dequantize_int4, pack_int4, pack_int4_words, to_twos_complement, unpack_int4, words_as_bytes
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.trtllm import LAYOUT
from mxconv.source.st_format import read_header, read_tensor
from mxconv.verify import VerifyOptions, verify
from support.checkpoints import GroundTruth, ModelSizes, make_checkpoint, pack_int4_words_reference, write_shards
from support.cli import mx
from support.tamper import patch_tensor
from support.workspace import copy_checkpoint


# ---------------------------------------------------------------------------------------------
# Scalar spec formulas (layout-trtllm.md §3, §4, §6, §9), independent of mxconv.layouts
# ---------------------------------------------------------------------------------------------


def s_scalar(j: int) -> int:
    """§4 MMA row shuffle gather."""
    return 32 * (j // 32) + 4 * (j % 8) + (j % 32) // 8


def p_halves(k: int, I: int) -> int:
    """§3 step A for halves: kernel row 2i = up_i (canonical row I + i), 2i+1 = gate_i."""
    return I + k // 2 if k % 2 == 0 else (k - 1) // 2


def off_scalar(r: int, c: int, C: int) -> int:
    """§6 128x4 swizzle offset of element (r, c) of an [R, C] matrix (C % 4 == 0 here)."""
    Cp = C
    return ((r // 128) * (Cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def spec_kernel(c: CanonicalExperts) -> dict[str, torch.Tensor]:
    """Section 9 by the letter, row by row: XOR 0x88, rows by src13 / s, block-major K in 128-byte
    chunks, scales rows permuted then element (r, c) to off(r, c), flat per expert."""
    E, n13, kb13 = c.w13.shape
    H, I = kb13 * 2, n13 // 2
    out: dict[str, torch.Tensor] = {}
    for name, w, s, src in (
        ("w13", c.w13, c.w13_scale, [p_halves(s_scalar(j), I) for j in range(2 * I)]),
        ("w2", c.w2, c.w2_scale, [s_scalar(j) for j in range(H)]),
    ):
        N, kbytes = w.shape[1], w.shape[2]
        weight = torch.empty((E, kbytes // 128, N, 128), dtype=torch.uint8)
        C = s.shape[2]
        scale = torch.empty((E, N * C), dtype=torch.bfloat16)
        for j in range(N):
            row = w[:, src[j]] ^ 0x88
            for kb in range(kbytes // 128):
                weight[:, kb, j] = row[:, 128 * kb : 128 * (kb + 1)]
            for col in range(C):
                scale[:, off_scalar(j, col, C)] = s[:, src[j], col]
        out[f"{name}_weight"], out[f"{name}_weight_scale"] = weight, scale
    return out


def int4_stack(E: int, H: int, I: int, seed: int) -> CanonicalExperts:
    """Random canonical int4 stack (offset-binary bytes, bf16 scales incl. -0.0 and a subnormal)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8)
    s13 = (torch.rand((E, 2 * I, H // 32), generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    s2 = (torch.rand((E, H, I // 32), generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    s13[0, 3, 1] = -0.0
    s2[-1, 7, 2] = torch.tensor(1e-40).to(torch.bfloat16)  # a bf16 subnormal
    return CanonicalExperts(w13, s13, w2, s2, row_order="halves", weight_format="int4")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def int4_sizes(E: int, H: int, I: int) -> LayoutSizes:
    return LayoutSizes(E, H, I, H, I, "halves", False, "int4")


# ---------------------------------------------------------------------------------------------
# Packing: mxconv.mx.int4 and the generator against compressed-tensors
# ---------------------------------------------------------------------------------------------


def test_packing_matches_compressed_tensors() -> None:
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (24, 64), generator=g, dtype=torch.int8)
    q[0, :16] = torch.arange(-8, 8, dtype=torch.int8)  # every value once
    theirs = ct.pack_to_int32(q, 4)
    assert theirs.dtype == torch.int32 and tuple(theirs.shape) == (24, 8)
    assert torch.equal(pack_int4_words(q), theirs)  # mxconv's byte-view packer
    assert torch.equal(pack_int4_words_reference(q), theirs)  # the generator's word arithmetic
    assert torch.equal(ct.unpack_from_int32(theirs, 4, torch.Size((24, 64))), q)
    assert torch.equal(unpack_int4(words_as_bytes(theirs)), q)
    # canonical bytes: low nibble = even column, offset binary (q + 8)
    b = words_as_bytes(theirs)
    assert torch.equal((b & 0xF).to(torch.int8) - 8, q[:, 0::2]) and torch.equal((b >> 4).to(torch.int8) - 8, q[:, 1::2])
    # XOR 0x88 gives two's-complement nibbles, and is its own inverse
    tc = to_twos_complement(b)
    assert torch.equal(tc & 0xF, (q[:, 0::2].to(torch.int16) & 0xF).to(torch.uint8))
    assert torch.equal(tc >> 4, (q[:, 1::2].to(torch.int16) & 0xF).to(torch.uint8))
    assert torch.equal(to_twos_complement(tc), b)
    assert torch.equal(pack_int4(q), b)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.full((1, 2), 8))


def test_dequantize_is_exact() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-8, 8, (3, 8, 64), generator=g, dtype=torch.int8)
    scales = (torch.randn((3, 8, 2), generator=g) * 3).to(torch.bfloat16)
    want = q.double() * scales.double().repeat_interleave(32, dim=-1)  # float64, exact
    got = dequantize_int4(pack_int4(q), scales)
    assert got.dtype == torch.float32 and torch.equal(got.double(), want)


def test_generated_checkpoint_is_compressed_tensors_int4(tmp_path: Path) -> None:
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    gt = make_checkpoint(tmp_path, "kimi-k2-int4", shards=1)
    qc = gt.config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    infos, _ = read_header(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.up_proj"
    packed, scale, shape = (read_tensor(infos[f"{name}.{p}"]) for p in ("weight_packed", "weight_scale", "weight_shape"))
    I, H = gt.intermediate_size, gt.hidden_size
    assert (packed.dtype, tuple(packed.shape)) == (torch.int32, (I, H // 8))
    assert (scale.dtype, tuple(scale.shape)) == (torch.bfloat16, (I, H // 32))
    assert (shape.dtype, shape.tolist()) == (torch.int64, [I, H])
    q = ct.unpack_from_int32(packed, 4, torch.Size(shape.tolist()))
    deq = (q.float().view(I, H // 32, 32) * scale.float().unsqueeze(-1)).view(I, H)
    assert torch.equal(deq, gt.layers[1].up[2])  # the generator's truth is compressed-tensors' decoding


# ---------------------------------------------------------------------------------------------
# Reading: canonical int4 stacks, validation of damaged input
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> GroundTruth:
    return make_checkpoint(tmp_path_factory.mktemp("kimi") / "src", "kimi-k2-int4")


def test_reader_gives_canonical_int4(kimi: GroundTruth) -> None:
    r = detect_family(open_checkpoint(kimi.path))
    info = r.model_info()
    assert (info.family, info.expert_format, info.source_scale_scheme, info.row_order) == ("deepseek-v3", "int4", "bf16_group32", "halves")
    refs = r.layer_refs()
    assert [ref.layer for ref in refs] == [1]
    assert set(refs[0].source_names) == set(kimi.layers[1].expert_names)  # weight_shape consumed too
    layer = r.read_layer(refs[0])
    t = kimi.layers[1]
    assert layer.w13 is None and layer.w13_mx is None and layer.w13_int4 is not None and layer.w2_int4 is not None
    assert torch.equal(layer.w13_int4.data, t.w13_int4[0]) and bits_equal(layer.w13_int4.scales, t.w13_int4[1])
    assert torch.equal(layer.w2_int4.data, t.w2_int4[0]) and bits_equal(layer.w2_int4.scales, t.w2_int4[1])
    w13, w2 = layer.float_weights()
    assert torch.equal(w13, t.w13) and torch.equal(w2, t.w2)


def _damaged(tmp_path: Path, mutate) -> Path:  # noqa: ANN001 - mutate(dict of tensors) -> None
    src = tmp_path / "src"
    make_checkpoint(src, "kimi-k2-int4", shards=1)
    infos, _ = read_header(src / "model.safetensors")
    tensors = {n: read_tensor(i).clone() for n, i in infos.items()}
    mutate(tensors)
    write_shards(src, tensors, 1)
    return src


X = "model.layers.1.mlp.experts.3.down_proj"


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda t: t.__setitem__(f"{X}.weight_shape", torch.tensor([256, 512])),
         r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight_shape' says the weight is \[256, 512\], "
         r"but .* give \[256, 256\] \(weight_shape must equal"),
        (lambda t: t[f"{X}.weight_scale"].__setitem__((5, 2), float("nan")),
         r"model\.safetensors: tensor '.*experts\.3\.down_proj\.weight_scale' holds nan at \[5, 2\] \(INT4 group scales must be finite"),
        (lambda t: t[f"{X}.weight_scale"].__setitem__((0, 7), float("-inf")), r"weight_scale' holds -inf at \[0, 7\]"),
    ],
    ids=["weight_shape", "scale-nan", "scale-inf"],
)
def test_damaged_values_are_bad_input(tmp_path: Path, mutate, message: str) -> None:  # noqa: ANN001
    src = _damaged(tmp_path, mutate)
    r = detect_family(open_checkpoint(src))
    with pytest.raises(BadInput, match=message):
        r.read_layer(r.layer_refs()[0])
    code, _, err = mx("repack", src, tmp_path / "out", "--backend", "trtllm", "--device", "cpu", "--quiet")
    assert code == 2 and "down_proj.weight" in err


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda t: t.__setitem__(f"{X}.weight_packed", t[f"{X}.weight_packed"].view(torch.uint8)),
         r"tensor '.*experts\.3\.down_proj\.weight_packed' has dtype U8, expected I32"),
        (lambda t: t.__setitem__(f"{X}.weight_scale", t[f"{X}.weight_scale"].float()),
         r"tensor '.*experts\.3\.down_proj\.weight_scale' has dtype F32, expected BF16"),
        (lambda t: t.__setitem__(f"{X}.weight_scale", t[f"{X}.weight_scale"][:, :4].clone()),
         r"weight_scale' has shape \[256, 4\], expected \[256, 8\] \(one bf16 scale per 32 inputs of \[256, 256\]\)"),
        (lambda t: t.__setitem__(f"{X}.weight_shape", torch.tensor([256, 256, 1])),
         r"weight_shape' has shape \[3\], expected \[2\]"),
        (lambda t: t.pop(f"{X}.weight_shape"), r"tensor '.*experts\.3\.down_proj\.weight_shape' is missing"),
        (lambda t: t.pop(f"{X}.weight_scale"), r"tensor '.*experts\.3\.down_proj\.weight_scale' is missing"),
    ],
    ids=["packed-dtype", "scale-dtype", "scale-shape", "shape-shape", "no-weight_shape", "no-scale"],
)
def test_damaged_headers_are_bad_input(tmp_path: Path, mutate, message: str) -> None:  # noqa: ANN001
    src = _damaged(tmp_path, mutate)
    with pytest.raises(BadInput, match=message):
        detect_family(open_checkpoint(src)).model_info()


# ---------------------------------------------------------------------------------------------
# Section 9 bytes
# ---------------------------------------------------------------------------------------------


def test_hand_built_example() -> None:
    """One nonzero value per tensor, tracked by hand through §3/§4/§6/§9.

    H = 512 (two 128-byte K chunks for w13), I = 256. q = 0 everywhere (offset-binary 0x88 bytes,
    two's-complement 0x00), except:
    * w13 gate channel 0 (canonical row 0), column 301 = -3: byte 150, high nibble. Kernel row
      dst13(0) = d(P^-1(0)) = d(1) = 8; chunk 150 // 128 = 1 at 22: kernel byte [e, 1, 8, 22] = 0xD0.
    * w2 row 33, column 7 = 5: byte 3, high nibble; kernel row d(33) = 40: [e, 0, 40, 3] = 0x50.
    * w13 scale of row 0, block 5: flat off(8, 5) = (5 // 4) * 512 + 8 * 16 + 1 = 641.
    * w13 scale of up channel 0 (row 256), block 0: kernel row d(P^-1(256)) = d(0) = 0 -> flat 0.
    """
    E, H, I = 2, 512, 256
    q13 = torch.zeros((E, 2 * I, H), dtype=torch.int8)
    q2 = torch.zeros((E, H, I), dtype=torch.int8)
    q13[1, 0, 301] = -3
    q2[0, 33, 7] = 5
    s13 = torch.zeros((E, 2 * I, H // 32), dtype=torch.bfloat16)
    s2 = torch.zeros((E, H, I // 32), dtype=torch.bfloat16)
    s13[1, 0, 5] = 0.375
    s13[0, 256, 0] = -2.5
    c = CanonicalExperts(pack_int4(q13), s13, pack_int4(q2), s2, row_order="halves", weight_format="int4")
    assert int(c.w13[1, 0, 150]) == 0x58  # offset-binary: low nibble 0 + 8, high nibble -3 + 8
    k = LAYOUT.to_kernel(c, "bf16", None)
    assert tuple(k["w13_weight"].shape) == (E, 2, 2 * I, 128) and k["w13_weight"].dtype == torch.uint8
    assert tuple(k["w2_weight"].shape) == (E, 1, H, 128)
    assert tuple(k["w13_weight_scale"].shape) == (E, 2 * I * H // 32) and k["w13_weight_scale"].dtype == torch.bfloat16
    assert tuple(k["w2_weight_scale"].shape) == (E, H * I // 32)
    w13 = k["w13_weight"]
    assert int(w13[1, 1, 8, 22]) == 0xD0
    assert int(torch.count_nonzero(w13)) == 1  # q = 0 is 0x00 in two's complement
    assert int(k["w2_weight"][0, 0, 40, 3]) == 0x50 and int(torch.count_nonzero(k["w2_weight"])) == 1
    flat = k["w13_weight_scale"]
    assert float(flat[1, 641]) == 0.375 and float(flat[0, 0]) == -2.5
    assert int(torch.count_nonzero(flat)) == 2


@pytest.mark.parametrize("E,H,I", [(2, 256, 256), (3, 512, 256), (1, 256, 768)])
def test_bytes_equal_the_spec_formulas(E: int, H: int, I: int) -> None:
    c = int4_stack(E, H, I, seed=E + H + I)
    k = LAYOUT.to_kernel(c, "bf16", None)
    want = spec_kernel(c)
    assert set(k) == set(want)
    for name in want:
        assert bits_equal(k[name], want[name]), name
    specs = LAYOUT.kernel_specs(int4_sizes(E, H, I), "bf16", None)
    assert {n: (s.shape, s.dtype) for n, s in specs.items()} == {n: (tuple(t.shape), t.dtype) for n, t in k.items()}


def test_oracle_flashinfer_mxint4_sequence() -> None:
    """vLLM's MxInt4 preparation re-enacted per expert with FlashInfer's own helpers: [w3; w1], the
    w3_w1 permutation (bf16 scales with num_elts_per_sf 32), w2 permutation, convert_to_block_layout."""
    try:
        import flashinfer.fused_moe.core as fi_core
        from flashinfer.fused_moe import convert_to_block_layout
    except Exception as exc:  # noqa: BLE001 - any import failure means "oracle unavailable"
        pytest.skip(f"flashinfer not importable on this machine: {exc}")
    from mxconv.layouts.trtllm_bytemap import unswizzle_128x4

    E, H, I = 2, 512, 256
    c = int4_stack(E, H, I, seed=9)
    k = LAYOUT.to_kernel(c, "bf16", None)
    rows13 = unswizzle_128x4(k["w13_weight_scale"], 2 * I, H // 32)
    rows2 = unswizzle_128x4(k["w2_weight_scale"], H, I // 32)
    for e in range(E):
        w = to_twos_complement(torch.cat([c.w13[e, I:], c.w13[e, :I]]))  # [w3; w1], signed
        perm = fi_core._maybe_get_cached_w3_w1_permute_indices({}, w, 128)
        assert torch.equal(k["w13_weight"][e], convert_to_block_layout(w[perm].contiguous(), 128))
        s = torch.cat([c.w13_scale[e, I:], c.w13_scale[e, :I]])
        perm_sf = fi_core._maybe_get_cached_w3_w1_permute_indices({}, s, 128, num_elts_per_sf=32)
        assert bits_equal(rows13[e], s[perm_sf])
        w2 = to_twos_complement(c.w2[e])
        p2 = fi_core.get_w2_permute_indices_with_cache({}, w2, 128)
        assert torch.equal(k["w2_weight"][e], convert_to_block_layout(w2[p2].contiguous(), 128))
        p2sf = fi_core.get_w2_permute_indices_with_cache({}, c.w2_scale[e], 128, num_elts_per_sf=32)
        assert bits_equal(rows2[e], c.w2_scale[e][p2sf])


@pytest.mark.parametrize("E,H,I", [(2, 256, 256), (3, 512, 768)])
def test_inverse_round_trip_is_bit_exact(E: int, H: int, I: int) -> None:
    c = int4_stack(E, H, I, seed=H * I)
    back = LAYOUT.from_kernel(LAYOUT.to_kernel(c, "bf16", None), int4_sizes(E, H, I), "bf16", None)
    assert back.weight_format == "int4" and back.row_order == "halves" and back.w13_bias is None
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert bits_equal(getattr(back, name), getattr(c, name)), name


def test_sizes_not_multiples_of_256_are_refused() -> None:
    with pytest.raises(LayoutError, match=r"trtllm MxInt4: hidden size 288 is not a positive multiple of 256"):
        LAYOUT.padded_sizes(288, 256, "halves", "bf16", None, weight_format="int4")
    with pytest.raises(LayoutError, match=r"intermediate \(per TP rank\) size 384 is not a positive multiple of 256"):
        LAYOUT.padded_sizes(256, 384, "halves", "bf16", None, weight_format="int4")
    assert LAYOUT.padded_sizes(512, 768, "halves", "bf16", None, weight_format="int4") == (512, 768)
    c = int4_stack(1, 256, 256, seed=3)
    odd = CanonicalExperts(c.w13[:, :192], c.w13_scale[:, :192], c.w2[:, :, :48], c.w2_scale[:, :, :3],
                           row_order="halves", weight_format="int4")  # I = 96
    with pytest.raises(LayoutError, match="size 96 is not a positive multiple of 256"):
        LAYOUT.to_kernel(odd, "bf16", None)
    with pytest.raises(LayoutError, match="takes bf16 activations only, not RepackOptions.activation 'mxfp8'"):
        LAYOUT.to_kernel(c, "mxfp8", None)
    with pytest.raises(LayoutError, match="takes no expert biases"):
        LAYOUT.kernel_specs(LayoutSizes(1, 256, 256, 256, 256, "halves", True, "int4"), "bf16", None)
    with pytest.raises(LayoutError, match="w13_scale has dtype torch.uint8, expected torch.bfloat16"):
        CanonicalExperts(c.w13, c.w13_scale.view(torch.uint8)[..., ::2].contiguous(), c.w2, c.w2_scale,
                         weight_format="int4").validate()


def test_from_kernel_checks_shapes_and_dtypes() -> None:
    c = int4_stack(2, 256, 256, seed=4)
    k = LAYOUT.to_kernel(c, "bf16", None)
    sizes = int4_sizes(2, 256, 256)
    with pytest.raises(LayoutError, match=r"w13_weight_scale has dtype torch.float32, expected torch.bfloat16"):
        LAYOUT.from_kernel(dict(k, w13_weight_scale=k["w13_weight_scale"].float()), sizes, "bf16", None)
    with pytest.raises(LayoutError, match=r"w2_weight has shape \(2, 256, 128\), expected \(2, 1, 256, 128\)"):
        LAYOUT.from_kernel(dict(k, w2_weight=k["w2_weight"][:, 0]), sizes, "bf16", None)
    with pytest.raises(LayoutError, match="missing: w2_weight_scale"):
        LAYOUT.from_kernel({n: t for n, t in k.items() if n != "w2_weight_scale"}, sizes, "bf16", None)
    # an MXFP4 reading of the same sizes wants other tensors: the format is part of the sizes
    with pytest.raises(LayoutError):
        LAYOUT.from_kernel(k, LayoutSizes(2, 256, 256, 256, 256, "halves", False), "bf16", None)


def test_mxfp4_paths_unchanged_by_the_format_field() -> None:
    """The default weight format stays mxfp4: an MXFP4 stack round-trips and keeps E8M0 scale dtypes."""
    g = torch.Generator().manual_seed(5)
    E, H, I = 1, 256, 256
    c = CanonicalExperts(
        torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8),
        torch.randint(100, 130, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8),
        torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8),
        torch.randint(100, 130, (E, H, I // 32), generator=g, dtype=torch.uint8),
    )
    assert c.weight_format == "mxfp4"
    k = LAYOUT.to_kernel(c, "bf16", None)
    assert k["w13_weight"].shape == (E, 2 * I, H // 2) and k["w13_weight_scale"].dtype == torch.float8_e4m3fn
    back = LAYOUT.from_kernel(k, LayoutSizes(E, H, I, H, I, "halves", False), "bf16", None)
    assert back.weight_format == "mxfp4" and torch.equal(back.w13, c.w13) and torch.equal(back.w2_scale, c.w2_scale)


# ---------------------------------------------------------------------------------------------
# End to end: repack, manifest, verify, planted bugs, refusals, quantize
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repacked(kimi: GroundTruth, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("k") / "trt"
    code, _, err = mx("repack", kimi.path, out, "--backend", "trtllm", "--device", "cpu", "--quiet")
    assert code == 0, err
    return out


def _stored(out: Path, name: str) -> torch.Tensor:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    return read_tensor(read_header(out / index["weight_map"][name])[0][name])


def test_repack_writes_section_9_bytes_and_manifest(kimi: GroundTruth, repacked: Path) -> None:
    t = kimi.layers[1]
    canon = CanonicalExperts(t.w13_int4[0], t.w13_int4[1], t.w2_int4[0], t.w2_int4[1], row_order="halves", weight_format="int4")
    want = spec_kernel(canon)
    prefix = "model.layers.1.mlp.experts."
    for name, tensor in want.items():
        assert bits_equal(_stored(repacked, prefix + name), tensor), name
    m = json.loads((repacked / "mxconv.json").read_text())
    assert (m["kind"], m["backend"], m["weight_format"], m["activation"], m["scale_rounding"]) == ("kernel", "trtllm", "int4", "bf16", None)
    lay = m["layout"]
    assert (lay["name"], lay["variant"], lay["scale_dtype"], lay["kernel_params"]) == ("trtllm", "mxint4", "bfloat16", None)
    assert (lay["padded_hidden_size"], lay["padded_intermediate_size"], lay["w13_row_order"]) == (256, 256, "halves")
    assert (m["numerics"]["element_format"], m["numerics"]["scale_format"], m["numerics"]["requantized"]) == ("int4", "bf16", False)
    E, H, I = kimi.num_experts, kimi.hidden_size, kimi.intermediate_size
    tensors = m["tensors"]
    assert (tensors[prefix + "w13_weight"]["dtype"], tensors[prefix + "w13_weight"]["shape"]) == ("U8", [E, H // 256, 2 * I, 128])
    assert (tensors[prefix + "w2_weight"]["dtype"], tensors[prefix + "w2_weight"]["shape"]) == ("U8", [E, I // 256, H, 128])
    assert (tensors[prefix + "w13_weight_scale"]["dtype"], tensors[prefix + "w13_weight_scale"]["shape"]) == ("BF16", [E, 2 * I * H // 32])
    assert (tensors[prefix + "w2_weight_scale"]["dtype"], tensors[prefix + "w2_weight_scale"]["shape"]) == ("BF16", [E, H * I // 32])
    assert not any(n.endswith(("weight_packed", "weight_shape")) for n in tensors)  # every routed expert consumed
    qc = m["quant_config"]
    assert (qc["weight_dtype"], qc["scale_format"], m["served_vllm_backends"]) == ("int4", "bf16", [])
    assert qc["gemm1"]["scales"][0]["shape"] == [E, 2 * I * H // 32]
    # the source's compressed-tensors config travels with the output (plus the layout marker), under a
    # quant_method only mxconv's vLLM plugin takes: kernel-layout experts are not from_pretrained material
    cfg = json.loads((repacked / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["mxconv_quant_method"]) == ("mxconv", "kernel-layout")
    assert q["mxconv_expert_quantization_config"] == kimi.config["quantization_config"] and cfg["mxconv_layout"]["backend"] == "trtllm"


def test_verify_passes_bit_exact_and_exact_numerics(kimi: GroundTruth, repacked: Path) -> None:
    code, out, err = mx("verify", repacked, "--reference", kimi.path, "--json")
    assert code == 0, out + err
    report = json.loads(out)
    assert report["passed"]
    (layer,) = report["layers"]
    assert (layer["layout"], layer["numerics"], layer["threshold"]) == ("bit-exact", "ok", "exact")
    assert layer["comparison"]["rel_rms"] == 0.0 and layer["comparison"]["max_abs"] == 0.0


def test_reference_runner_dequantizes_int4_exactly(kimi: GroundTruth, repacked: Path) -> None:
    """verify's reference output of the INT4 source equals a float64 MoE over the truth's q * scale."""
    from mxconv.verify.numerics import expert_fn

    r = detect_family(open_checkpoint(kimi.path))
    layer = r.read_layer(r.layer_refs()[0])
    fn = expert_fn(layer.w13_int4, layer.w2_int4, None, None)
    for e in range(kimi.num_experts):
        w13, w2, _, _ = fn(e)
        assert w13.dtype == torch.float32 and torch.equal(w13, kimi.layers[1].w13[e]) and torch.equal(w2, kimi.layers[1].w2[e])


def _flip_byte(t: torch.Tensor) -> torch.Tensor:
    t.view(-1)[1000] ^= 0x10
    return t


def _swap_experts(t: torch.Tensor) -> torch.Tensor:
    return t[[1, 0, *range(2, t.shape[0])]]


@pytest.mark.parametrize(
    "tensor,bug,where",
    [
        ("w13_weight", _flip_byte, "w13: first difference at expert 0"),
        ("w2_weight", _swap_experts, "w2: first difference at expert 0"),
        ("w13_weight_scale", _swap_experts, "w13_scale: first difference at expert 0"),
    ],
    ids=["flipped-byte", "swapped-experts", "swapped-scales"],
)
def test_planted_bug_fails_verify(kimi: GroundTruth, repacked: Path, tmp_path: Path, tensor: str, bug, where: str) -> None:  # noqa: ANN001
    out = copy_checkpoint(repacked, tmp_path / "bugged")
    patch_tensor(out, f"model.layers.1.mlp.experts.{tensor}", bug, fix_manifest=True)
    rep = verify(out, VerifyOptions(reference=str(kimi.path), tokens=32))
    assert not rep.passed
    (layer,) = rep.layers
    assert layer.integrity == "ok" and layer.layout == "FAIL"
    assert any(where in p for p in layer.problems), layer.problems
    assert layer.numerics == "FAIL"  # the outputs are not the reference's either
    code, _, err = mx("verify", out, "--reference", kimi.path, "--quiet")
    assert code == 1 and "recovered canonical bytes differ from the reference" in err


def test_flipped_byte_without_manifest_fix_fails_integrity(kimi: GroundTruth, repacked: Path, tmp_path: Path) -> None:
    out = copy_checkpoint(repacked, tmp_path / "corrupt")
    name = "model.layers.1.mlp.experts.w2_weight_scale"
    sha = json.loads((out / "mxconv.json").read_text())["tensors"][name]["sha256"]
    patch_tensor(out, name, lambda t: _flip_byte(t.view(torch.uint8)).view(torch.bfloat16), fix_manifest=True)
    m = json.loads((out / "mxconv.json").read_text())
    m["tensors"][name]["sha256"] = sha
    (out / "mxconv.json").write_text(json.dumps(m))
    code, _, err = mx("verify", out, "--quiet")
    assert code == 1 and "sha256 mismatch" in err


INT4_BACKENDS = [b for b in backend_names() if "int4" in get_layout(b).weight_formats]


def test_the_int4_backends_are_trtllm_and_humming() -> None:
    assert INT4_BACKENDS == ["trtllm", "humming"]


@pytest.mark.parametrize("backend", [b for b in backend_names() if b not in INT4_BACKENDS])
def test_other_backends_refuse_int4(kimi: GroundTruth, tmp_path: Path, backend: str) -> None:
    act = get_layout(backend).activations[0]
    code, _, err = mx("repack", kimi.path, tmp_path / "out", "--backend", backend, "--activation", act, "--device", "cpu")
    assert code == 2
    takes = ", ".join(get_layout(backend).weight_formats)  # mxfp4 (and mxfp8 for marlin)
    assert f"experts are int4 (compressed-tensors INT4, bf16 group scales); backend {backend} takes {takes} experts only" in err
    assert "backends that take int4: trtllm, humming" in err
    assert not (tmp_path / "out" / "mxconv.json").exists()


def test_repack_refuses_sizes_not_multiples_of_256(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "src", "kimi-k2-int4", ModelSizes(hidden_size=256, intermediate_size=384))
    code, _, err = mx("repack", tmp_path / "src", tmp_path / "out", "--backend", "trtllm", "--device", "cpu")
    assert code == 2 and "trtllm MxInt4: intermediate (per TP rank) size 384 is not a positive multiple of 256" in err
    make_checkpoint(tmp_path / "src2", "kimi-k2-int4", ModelSizes(hidden_size=160, intermediate_size=256))
    code, _, err = mx("repack", tmp_path / "src2", tmp_path / "out2", "--backend", "trtllm", "--device", "cpu")
    assert code == 2 and "trtllm MxInt4: hidden size 160 is not a positive multiple of 256" in err
    code, _, err = mx("repack", tmp_path / "src2", tmp_path / "out3", "--backend", "trtllm", "--activation", "mxfp8")
    assert code == 2 and "takes bf16 activations only" in err


def test_tensor_parallel_ranks(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "kimi-k2-int4", ModelSizes(hidden_size=256, intermediate_size=512)).path
    code, _, err = mx("repack", src, tmp_path / "tp2", "--backend", "trtllm", "--tp", "2", "--device", "cpu", "--quiet")
    assert code == 0, err
    rep = verify(tmp_path / "tp2", VerifyOptions(reference=str(src), tokens=16))
    assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
    assert [r.layout for r in rep.layers] == ["bit-exact"]
    w13 = _stored(tmp_path / "tp2" / "rank-1", "model.layers.1.mlp.experts.w13_weight")
    assert tuple(w13.shape) == (4, 1, 512, 128)
    code, _, err = mx("repack", src, tmp_path / "tp4", "--backend", "trtllm", "--tp", "4", "--device", "cpu")
    assert code == 2 and "size 128 is not a positive multiple of 256" in err


def test_quantize_dequantizes_exactly_then_quantizes(kimi: GroundTruth, tmp_path: Path) -> None:
    """quantize of an INT4 source: fp32 q * scale (exact), then the usual MX quantizer."""
    from mxconv.mx.formats import resolve_scale_mode
    from mxconv.kernels.quantize import quantize_mx

    ckpt = open_checkpoint(kimi.path)
    plan = build_plan(ckpt, detect_family(ckpt), QuantOptions("mxfp4"))
    s = Conversion(plan).run(tmp_path / "q4", device=torch.device("cpu"), settings=RunSettings(10**9, True, argv=("test",)))
    assert 0.05 < s["relative_rms_error"] < 0.2
    data, scales = quantize_mx(kimi.layers[1].w13[:, :kimi.intermediate_size], "mxfp4", resolve_scale_mode("mxfp4", "auto"))
    name = "model.layers.1.mlp.experts.2.gate_proj"
    assert torch.equal(_stored(tmp_path / "q4", f"{name}.weight_packed"), data[2])
    assert torch.equal(_stored(tmp_path / "q4", f"{name}.weight_scale").view(torch.uint8), scales[2])
    m = json.loads((tmp_path / "q4" / "mxconv.json").read_text())
    assert (m["weight_format"], m["numerics"]["source_format"]) == ("mxfp4", "int4")
    rep = verify(tmp_path / "q4", VerifyOptions(reference=str(kimi.path), tokens=16))
    assert rep.passed and rep.layers[0].threshold == "mxfp4"
    # and the MXFP4 result repacks for every backend as usual
    Conversion.open(tmp_path / "q4", QuantOptions(), RepackOptions("marlin", "bf16")).run(
        tmp_path / "marlin", device=torch.device("cpu"), settings=RunSettings(10**9, True, argv=("test",)))
    assert verify(tmp_path / "marlin", VerifyOptions(reference=str(tmp_path / "q4"), tokens=16)).passed


def test_partial_quantize_of_int4_is_refused(kimi: GroundTruth) -> None:
    ckpt = open_checkpoint(kimi.path)
    make = lambda: build_plan(ckpt, detect_family(ckpt), QuantOptions("mxfp4", ignore=r"layers\.1\."))  # noqa: E731
    with pytest.raises(BadInput, match="no MoE layer selected"):
        make()
    # a two-MoE-layer INT4 checkpoint, one layer ignored
    two = make_checkpoint(Path(str(kimi.path) + "-3"), "kimi-k2-int4", ModelSizes(num_layers=3))
    ckpt = open_checkpoint(two.path)
    with pytest.raises(BadInput, match=r"layers\.2\.mlp\.experts: QuantOptions.include/QuantOptions.ignore would leave this INT4 layer"):
        build_plan(ckpt, detect_family(ckpt), QuantOptions("mxfp4", ignore=r"layers\.2\."))


def test_inspect_of_an_int4_source_shows_what_repack_does(kimi: GroundTruth) -> None:
    """The per-backend table of an INT4 source is the MxInt4 one: trtllm (bf16) padded by the MxInt4
    rule and served by no MXFP4 backend; every other backend says it needs an MXFP4 source."""
    code, out, err = mx("inspect", kimi.path, "--json")
    assert code == 0, err
    rows = {(r["backend"], r["activation"]): r for r in json.loads(out)["backends"]}
    trt = rows["trtllm", "bf16"]
    assert "error" not in trt and trt["vllm_backends"] == []
    assert trt["padded_hidden_size"] % 256 == 0 and trt["padded_intermediate_size"] % 256 == 0
    assert "bf16 activations only" in rows["trtllm", "mxfp8"]["error"]
    for (backend, _), r in rows.items():
        if backend not in INT4_BACKENDS:
            assert r["error"].startswith(f"takes {', '.join(get_layout(backend).weight_formats)} experts, not int4"), r
