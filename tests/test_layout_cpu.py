"""cpu layout (docs/layout-cpu.md): vLLM 0.33's CPU AMX MXFP4 MoE tensors against a scalar oracle
written from the spec (element by element index math, not the module's reshapes), on sizes that are
odd multiples of the 32-row pack block; round trips, padding and refusals; repack/verify through the
CLI for gpt-oss (interleaved) and halves-order sources at TP 1 and 2; verify --kernel's exit 2.

Where a vLLM CPU build is installed (``torch.ops._C.convert_weight_packed``), its own ops are the
oracle too.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.cli import mx
from support.tamper import patch_tensor

from mxconv.errors import LayoutError
from mxconv.experts.stack import CanonicalExperts, LayoutSizes
from mxconv.experts.tp import slice_tp, tp_ranges
from mxconv.families import detect_family
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.cpu import LAYOUT, pack_scale, pack_weight, unpack_scale, unpack_weight
from mxconv.layouts.vllm_backends import vllm_padded_sizes, vllm_refusal
from mxconv.source.checkpoint import open_checkpoint
from mxconv.examples import ModelSizes

BLOCK = 32  # rows per pack block (spec §4)


def stack(E: int, H: int, I: int, row_order: str, bias: bool, seed: int = 0) -> CanonicalExperts:
    """Random canonical stack; scale bytes cover 0 and 0xFF too."""
    g = torch.Generator().manual_seed(seed)

    def u8(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)

    s13 = u8(E, 2 * I, H // 32)
    s13[0, 0, 0], s13[0, 1, 0] = 0, 255
    return CanonicalExperts(
        u8(E, 2 * I, H // 2), s13, u8(E, H, I // 2), u8(E, H, I // 32),
        torch.randn(E, 2 * I, generator=g).to(torch.bfloat16) if bias else None,
        torch.randn(E, H, generator=g).to(torch.bfloat16) if bias else None,
        row_order,
    )


def sizes_of(c: CanonicalExperts) -> LayoutSizes:
    return c.sizes(*LAYOUT.padded_sizes(c.hidden_size, c.intermediate_size, c.row_order, "bf16"))


# ---- the oracle: spec formulas, one byte at a time ------------------------------------------------


def param_row(r: int, rows: int, padded_rows: int, halves: bool) -> int | None:
    """§2: source row held by row r of vLLM's zero-initialised padded parameter (None: padding)."""
    if halves:
        half, local = divmod(r, padded_rows // 2)
        return half * (rows // 2) + local if local < rows // 2 else None
    return r if r < rows else None


def nibble(w: torch.Tensor, row: int | None, k: int) -> int:
    """FP4 element k of ``row`` of canonical bytes w [rows, K/2] (low nibble = even k); 0 in padding."""
    if row is None or k // 2 >= w.shape[1]:
        return 0
    return (int(w[row, k // 2]) >> (4 * (k % 2))) & 0xF


def oracle_weight(w: torch.Tensor, padded_rows: int, padded_cols: int, halves: bool) -> list[int]:
    """§4: the packed bytes of one expert, in storage order. Byte o: block nb = o // (32*C), byte column
    c = (o // 32) % C, j = o % 32; low nibble = element 2c + j%2 of block row j//2, high nibble = the
    same element of block row 16 + j//2 (C = padded_cols bytes per row)."""
    out = []
    for o in range(padded_rows * padded_cols):
        nb, c, j = o // (BLOCK * padded_cols), (o // BLOCK) % padded_cols, o % BLOCK
        k = 2 * c + j % 2
        lo = nibble(w, param_row(BLOCK * nb + j // 2, w.shape[0], padded_rows, halves), k)
        hi = nibble(w, param_row(BLOCK * nb + 16 + j // 2, w.shape[0], padded_rows, halves), k)
        out.append(lo | hi << 4)
    return out


def oracle_scale(s: torch.Tensor, padded_rows: int, padded_groups: int, halves: bool) -> list[int]:
    """§5: byte o = scale (row 32*nb + n, group g) with nb = o // (32*G), g = (o // 32) % G, n = o % 32."""
    out = []
    for o in range(padded_rows * padded_groups):
        nb, g, n = o // (BLOCK * padded_groups), (o // BLOCK) % padded_groups, o % BLOCK
        row = param_row(BLOCK * nb + n, s.shape[0], padded_rows, halves)
        out.append(0 if row is None or g >= s.shape[1] else int(s[row, g]))
    return out


def check_against_oracle(k: dict[str, torch.Tensor], c: CanonicalExperts, Hp: int, Ip: int) -> None:
    halves = c.row_order == "halves"
    for e in range(c.num_experts):
        assert k["w13_weight"][e].flatten().tolist() == oracle_weight(c.w13[e], 2 * Ip, Hp // 2, halves), e
        assert k["w2_weight"][e].flatten().tolist() == oracle_weight(c.w2[e], Hp, Ip // 2, False), e
        assert k["w13_weight_scale"][e].flatten().tolist() == oracle_scale(c.w13_scale[e], 2 * Ip, Hp // 32, halves), e
        assert k["w2_weight_scale"][e].flatten().tolist() == oracle_scale(c.w2_scale[e], Hp, Ip // 32, False), e
        if c.w13_bias is not None:
            want13 = [0.0 if (r := param_row(i, 2 * c.intermediate_size, 2 * Ip, halves)) is None else float(c.w13_bias[e, r])
                      for i in range(2 * Ip)]
            assert k["w13_bias"][e].tolist() == want13
            want2 = [float(c.w2_bias[e, i]) if i < c.hidden_size else 0.0 for i in range(Hp)]
            assert k["w2_bias"][e].tolist() == want2


# ---- unit tests -----------------------------------------------------------------------------------


def test_registered() -> None:
    assert "cpu" in backend_names() and get_layout("cpu") is LAYOUT
    assert LAYOUT.activations == ("bf16",) and LAYOUT.vllm_backends == {"bf16": ("CPU",)}


@pytest.mark.parametrize("H, I", [(2880, 2880), (96, 160), (7168, 2048), (2880, 736)])
def test_padded_sizes_are_32_aligned_and_a_no_op_on_mx_sizes(H: int, I: int) -> None:
    assert LAYOUT.padded_sizes(H, I, "interleaved", "bf16") == (H, I)


def test_padded_sizes_refused() -> None:
    for args, msg in (((100, 128, "halves", "bf16"), "hidden size 100"), ((128, 48, "halves", "bf16"), "intermediate size 48"),
                      ((128, 128, "sideways", "bf16"), "unknown w13 row order"), ((128, 128, "halves", "fp8"), "activation 'fp8'")):
        with pytest.raises(LayoutError, match=msg):
            LAYOUT.padded_sizes(*args)


def test_worked_example() -> None:
    """§4's example: one 32-row block, K = 64. Row 0 bytes 0x21 0x65 (elements 1, 2, 5, 6), row 16
    byte 0x43 (elements 3, 4), row 1 byte 0x87 (elements 7, 8)."""
    w = torch.zeros(1, 32, 32, dtype=torch.uint8)
    w[0, 0, 0], w[0, 0, 1], w[0, 16, 0], w[0, 1, 0] = 0x21, 0x65, 0x43, 0x87
    p = pack_weight(w)
    assert p.shape == (1, 32, 32) and p.dtype == torch.uint8
    flat = p.flatten().tolist()
    # byte column 0: j = 0 -> (row 0, k 0) | (row 16, k 0) << 4; j = 1 -> k 1; j = 2, 3 -> row 1 (and 17)
    assert flat[:4] == [0x31, 0x42, 0x07, 0x08] and not any(flat[4:32])
    # byte column 1 (k 2, 3) starts at byte 32: row 0 only
    assert flat[32:34] == [0x05, 0x06] and not any(flat[34:])
    assert torch.equal(unpack_weight(p), w)
    s = torch.arange(64, dtype=torch.uint8).view(1, 32, 2)  # scale (n, g) = 2n + g
    assert pack_scale(s).flatten().tolist() == [2 * n for n in range(32)] + [2 * n + 1 for n in range(32)]
    assert torch.equal(unpack_scale(pack_scale(s)), s)


def test_pack_refuses_partial_blocks() -> None:
    with pytest.raises(LayoutError, match="48 rows, not a multiple of the 32-row pack block"):
        pack_weight(torch.zeros(1, 48, 16, dtype=torch.uint8))
    with pytest.raises(LayoutError, match=r"scale must be a uint8 \[E, rows, columns\] tensor"):
        pack_scale(torch.zeros(32, 2, dtype=torch.uint8))


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
@pytest.mark.parametrize("bias", [True, False])
def test_to_kernel_bytes_equal_the_oracle(row_order: str, bias: bool) -> None:
    c = stack(3, 96, 160, row_order, bias)  # 3 and 10 row blocks, 48 and 80 byte columns
    k = LAYOUT.to_kernel(c, "bf16", None)
    assert {n: (tuple(t.shape), t.dtype) for n, t in k.items()} == {
        n: (s.shape, s.dtype) for n, s in LAYOUT.kernel_specs(sizes_of(c), "bf16", None).items()}
    assert list(k) == [n for n in ("w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias") if n in k]
    assert ("w13_bias" in k) == bias and (not bias or k["w13_bias"].dtype == torch.float32)
    check_against_oracle(k, c, 96, 160)


def test_padded_stack_bytes_equal_the_oracle() -> None:
    """TP ranks narrower than the widest one are zero-padded first (experts/tp.slice_tp): the
    padding rows sit inside the pack blocks, where the oracle reads zeros."""
    for row_order in ("halves", "interleaved"):
        c = stack(2, 64, 64, row_order, True, seed=4)
        part = slice_tp(c, 32, 64, 1, pad_to=64)  # rank 1 of I = 96 split 64 | 32, padded to 64
        assert part.intermediate_size == 64
        k = LAYOUT.to_kernel(part, "bf16", None)
        narrow = slice_tp(c, 32, 64, 1)
        check_against_oracle(k, CanonicalExperts(narrow.w13, narrow.w13_scale, narrow.w2, narrow.w2_scale,
                                                 narrow.w13_bias, narrow.w2_bias, row_order), 64, 64)


def test_gpt_oss_20b_specs() -> None:
    sizes = LayoutSizes(32, 2880, 2880, 2880, 2880, "interleaved", True)
    got = {n: (s.shape, s.dtype) for n, s in LAYOUT.kernel_specs(sizes, "bf16", None).items()}
    assert got == {
        "w13_weight": ((32, 5760, 1440), torch.uint8), "w13_weight_scale": ((32, 5760, 90), torch.uint8),
        "w13_bias": ((32, 5760), torch.float32), "w2_weight": ((32, 2880, 1440), torch.uint8),
        "w2_weight_scale": ((32, 2880, 90), torch.uint8), "w2_bias": ((32, 2880), torch.float32),
    }
    with pytest.raises(LayoutError, match=r"do not match the layout's \(2880, 2880\)"):
        LAYOUT.kernel_specs(LayoutSizes(32, 2880, 2880, 2944, 2880, "interleaved", True), "bf16", None)


@pytest.mark.parametrize("row_order", ["halves", "interleaved"])
def test_round_trip(row_order: str) -> None:
    c = stack(4, 160, 96, row_order, True, seed=3)
    back = LAYOUT.from_kernel(LAYOUT.to_kernel(c, "bf16", None), sizes_of(c), "bf16", None)
    for f in ("w13", "w13_scale", "w2", "w2_scale", "w2_bias"):
        assert torch.equal(getattr(back, f), getattr(c, f)), f
    assert torch.equal(back.w13_bias, c.w13_bias.float()) and back.row_order == row_order


def test_from_kernel_refuses() -> None:
    c = stack(2, 96, 160, "halves", True)
    sizes = sizes_of(c)
    good = LAYOUT.to_kernel(c, "bf16", None)
    cases = [
        ({**good, "w13_weight_scale": good["w13_weight_scale"][:, :, :2]}, r"w13_weight_scale is \(2, 320, 2\) torch.uint8"),
        ({**good, "w2_bias": good["w2_bias"].bfloat16()}, r"w2_bias is \(2, 96\) torch.bfloat16, expected \(2, 96\) torch.float32"),
        ({n: t for n, t in good.items() if n != "w2_bias"}, r"missing \['w2_bias'\]"),
        ({**good, "extra": good["w2_bias"]}, r"unexpected \['extra'\]"),
    ]
    for k, msg in cases:
        with pytest.raises(LayoutError, match=msg):
            LAYOUT.from_kernel(k, sizes, "bf16", None)


def test_vllm_cpu_backend_sizes_and_activations() -> None:
    """vLLM pads CPU to 32/32 (mxfp4_round_up_hidden_size_and_intermediate_size); CPUExpertsMxfp4
    runs SILU, SWIGLUOAI, GELU and GELU_TANH (_supports_activation)."""
    assert vllm_padded_sizes("CPU", 2880, 1440, "swigluoai") == LAYOUT.padded_sizes(2880, 1440, "interleaved", "bf16")
    for act in ("silu", "swigluoai", "gelu", "gelu_tanh"):
        assert vllm_refusal("CPU", (96, 160, 96, 160), {"activation": act}, ">=0.33") is None, act
    assert vllm_refusal("CPU", (96, 160, 96, 160), {"activation": "situ"}, ">=0.33") == (
        "CPU runs silu, swigluoai, gelu, gelu_tanh only; the model uses situ")
    assert "pads (H, I) = (96, 160) to (96, 160)" in vllm_refusal("CPU", (96, 160, 128, 160), {"activation": "silu"}, ">=0.33")


def test_describe() -> None:
    d = LAYOUT.describe(sizes_of(stack(2, 96, 160, "interleaved", False)), "bf16", None)
    assert (d["name"], d["version"], d["vllm_moe_backend"], d["engine_compat"]["vllm"]) == ("cpu", 1, "CPU", ">=0.32")  # 0.32 and 0.33 share the CPU prepack
    assert d["padding"] == {"hidden_align": 32, "intermediate_align": 32, "fill": 0} and d["w13_kernel_row_order"] == "interleaved"


def _vllm_cpu_ops() -> object | None:
    try:
        import vllm._C  # noqa: F401  (registers torch.ops._C on a vLLM CPU build)
    except Exception:  # noqa: BLE001 - not installed, or a GPU build that cannot load here
        return None
    ops = torch.ops._C
    return ops if hasattr(ops, "convert_weight_packed") and hasattr(ops, "convert_scale_packed") else None


def test_vllm_cpu_ops_give_the_same_bytes() -> None:
    ops = _vllm_cpu_ops()
    if ops is None:
        pytest.skip("needs a vLLM CPU build (torch.ops._C.convert_weight_packed)")
    c = stack(3, 96, 160, "interleaved", False, seed=7)
    k = LAYOUT.to_kernel(c, "bf16", None)
    assert torch.equal(ops.convert_weight_packed(c.w13.contiguous()), k["w13_weight"])
    assert torch.equal(ops.convert_weight_packed(c.w2.contiguous()), k["w2_weight"])
    assert torch.equal(ops.convert_scale_packed(c.w13_scale.contiguous()), k["w13_weight_scale"])
    assert torch.equal(ops.convert_scale_packed(c.w2_scale.contiguous()), k["w2_weight_scale"])


# ---- through the CLI: real sources, TP 1 and 2 ----------------------------------------------------


def _canonical(q4: Path, layer: int) -> CanonicalExperts:
    reader = detect_family(open_checkpoint(q4))
    lay = reader.read_layer({r.layer: r for r in reader.layer_refs()}[layer])
    return CanonicalExperts(lay.w13_mx.data, lay.w13_mx.scales, lay.w2_mx.data, lay.w2_mx.scales,
                            lay.w13_bias, lay.w2_bias, lay.row_order)


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("kind, row_order", [("gpt-oss-mxfp4", "interleaved"), ("qwen3-moe", "halves")])
@pytest.mark.parametrize("tp", [1, 2])
def test_repack_bytes_verify_and_kernel_refusal(made, kind: str, row_order: str, tp: int) -> None:
    src = made.source(kind, ModelSizes(hidden_size=96, intermediate_size=160, num_experts=4)).path
    q4 = src if kind == "gpt-oss-mxfp4" else made.quantize(src)
    out = made.repack(q4, "cpu", "--tp", tp)
    m = json.loads((out / "mxconv.json").read_text())
    assert m["backend"] == "cpu" and m["layout"]["vllm_moe_backend"] == "CPU" and m["served_vllm_backends"] == ["CPU"]
    layer = m["layers"][0]["layer"]
    c = _canonical(q4, layer)
    assert c.row_order == row_order
    ranges = tp_ranges(c.intermediate_size, tp)
    width = max(e - s for s, e in ranges)  # 160 at TP 1; 96 | 64 at TP 2, the narrow rank padded to 96
    for rank, (s, e) in enumerate(ranges):
        part = slice_tp(c, s, e, rank)
        stored = _stored(out / f"rank-{rank}" if tp > 1 else out)
        prefix = next(n for n in stored if n.endswith(".experts.w13_weight") and f".{layer}." in n)[: -len("w13_weight")]
        k = {n: stored[prefix + n] for n in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "w13_bias", "w2_bias")
             if prefix + n in stored}
        check_against_oracle(k, part, 96, width)
    code, _, err = mx("verify", out, "--quiet")
    assert code == 0, err
    code, stdout, err = mx("verify", out, "--kernel")
    text = stdout + err
    assert code == 2 and "--kernel" in text and "AMX" in text and "vLLM CPU build" in text and "Traceback" not in text, text


def test_verify_catches_a_nonzero_padding_nibble(made, tmp_path: Path) -> None:
    """Rank 1 of TP 2 holds padding inside its pack blocks; one set nibble there fails verify (exit 1)
    even with the manifest's sha256 updated, named in the unpacked canonical view."""
    src = made.source("qwen3-moe", ModelSizes(hidden_size=96, intermediate_size=160, num_experts=4)).path
    out = shutil.copytree(made.repack(made.quantize(src), "cpu", "--tp", 2), tmp_path / "out")
    name = "model.layers.0.mlp.experts.w2_weight"
    before = hashlib.sha256(_stored(out / "rank-1")[name].numpy().tobytes()).hexdigest()

    def poke(t: torch.Tensor) -> torch.Tensor:
        # rank 1's w2: I = 64 of Ip = 96, so byte columns 32..47 are padding. Storage byte 40 * 32 is
        # block 0, byte column 40, j = 0: its low nibble is row 0, element k = 80 (canonical byte [0, 0, 40]).
        t.view(-1)[40 * BLOCK] = 0x01
        return t

    patch_tensor(out / "rank-1", name, poke, fix_manifest=False)
    m = json.loads((out / "mxconv.json").read_text())
    assert m["tensors"][f"rank-1/{name}"]["sha256"] == before
    m["tensors"][f"rank-1/{name}"]["sha256"] = hashlib.sha256(_stored(out / "rank-1")[name].numpy().tobytes()).hexdigest()
    (out / "mxconv.json").write_text(json.dumps(m))
    code, stdout, err = mx("verify", out)
    text = stdout + err
    assert code == 1 and "padding of w2_weight at index [0, 0, 40]" in text, text
