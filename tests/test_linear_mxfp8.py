"""``quantize --format mxfp8 --targets linear``: every linear layer MXFP8 (issue 12 item 1).

The bytes of every quantized linear are checked against an independent OCP MX quantizer written
here in plain torch (rceil scale from the exact fp32 exponent, E4M3 round-to-nearest-even on a grid
built from the code table; mx-numerics.md §1.2, §2, §3), everything left alone against the source
byte for byte, the config against compressed-tensors' own classes (parsing, matching, decoding),
and verify against planted bugs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mxconv.source.checkpoint import open_checkpoint
from mxconv.run.conversion import Conversion, RunSettings
from mxconv.run.options import QuantOptions, RepackOptions
from mxconv.run.plan import build_plan
from mxconv.errors import BadInput
from mxconv.families import detect_family
from support.checkpoints import ModelSizes, make_checkpoint, write_shards
from support.tamper import patch_tensor
from support.workspace import copy_checkpoint
from mxconv.verify import VerifyOptions, verify

LINEAR = QuantOptions("mxfp8", targets="linear")


# ---- independent OCP MX (MXFP8 E4M3, rceil) quantizer -------------------------------------------


def _e4m3_grid() -> torch.Tensor:
    """The 127 non-negative finite E4M3 values, index = code (0x00 .. 0x7E), ascending."""
    vals = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


def ocp_mxfp8_rceil(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float) -> (E4M3 bytes uint8 [N, K], E8M0 bytes uint8 [N, K/32])."""
    x = w.to(torch.float32)
    n, k = x.shape
    blocks = x.reshape(n, k // 32, 32)
    amax = blocks.abs().amax(dim=-1)
    d = amax / 448.0  # fp32 division, as the rule says
    mant, exp = torch.frexp(d)  # d = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)  # exact ceil(log2(d)) for normal d
    e = torch.where(amax == 0, torch.full_like(e, -127), e).clamp(-127, 127)
    scale_bytes = (e + 127).to(torch.uint8)
    y = (blocks.double() / torch.pow(2.0, e.double()).unsqueeze(-1)).reshape(n, k)
    grid = _e4m3_grid()
    mag = y.abs().clamp(max=448.0)
    hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    code = torch.where(mag == grid[hi], hi, code)
    byte = code.to(torch.int32) | torch.where(torch.signbit(y), 0x80, 0)
    return byte.to(torch.uint8), scale_bytes


def test_oracle_on_hand_cases() -> None:
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 1], w[0, 2] = 448.0, -1.0, 0.0
    w[0, 32] = 1.0  # block max 1.0: d = 1/448, ceil(log2) = -8 -> byte 119; 1.0 * 2^8 = 256 = code 0x78
    d, s = ocp_mxfp8_rceil(w)
    assert s.tolist() == [[127, 119]]
    assert d[0, 0] == 0x7E and d[0, 1] == 0xB8 and d[0, 2] == 0 and d[0, 32] == 0x78
    r = torch.randn(8, 64)
    dd, ss = ocp_mxfp8_rceil(r)  # against torch's own (saturating, RNE) cast on the same scales
    y = r.reshape(8, 2, 32) / torch.pow(2.0, ss.float() - 127).unsqueeze(-1)
    assert torch.equal(dd, y.reshape(8, 64).to(torch.float8_e4m3fn).view(torch.uint8))


# ---- helpers ----------------------------------------------------------------------------------------


def _convert(src: Path, out: Path, q: QuantOptions, r: RepackOptions | None = None) -> dict:
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), q, r)
    return Conversion(plan).run(out, device=torch.device("cpu"), settings=RunSettings(10**9, True, argv=("test",)))


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return {n: t for f in sorted(d.glob("*.safetensors")) for n, t in load_file(str(f)).items()}


def _qc(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())["quantization_config"]


def _source_float(src: dict[str, torch.Tensor], module: str, block: int = 128) -> torch.Tensor:
    w = src[f"{module}.weight"]
    if w.dtype != torch.float8_e4m3fn:
        return w.float()
    s = src[f"{module}.weight_scale_inv"].float()
    n, k = w.shape
    full = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.float() * full


def _mx_modules(tensors: dict[str, torch.Tensor]) -> set[str]:
    return {n[: -len(".weight")] for n, t in tensors.items()
            if n.endswith(".weight") and t.dtype == torch.float8_e4m3fn and ".experts." not in n
            and f"{n[: -len('.weight')]}.weight_scale" in tensors}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """A bf16 Qwen3-MoE checkpoint (layer 0 a dense MLP) and its --targets linear output."""
    d = tmp_path_factory.mktemp("qwen")
    src = make_checkpoint(d / "src", "qwen3-moe", ModelSizes(num_layers=3), mlp_only_layers=(0,)).path
    summary = _convert(src, d / "out", LINEAR)
    return src, d / "out", summary


# ---- the "done when" ------------------------------------------------------------------------------


def test_qwen3_every_attention_and_dense_linear_is_mxfp8_with_oracle_bytes(qwen) -> None:
    src_dir, out, summary = qwen
    src, got = _tensors(src_dir), _tensors(out)
    want = {m for n in src if (m := n.removesuffix(".weight")) != n and src[n].dim() == 2
            and re.search(r"self_attn\.[qkvo]_proj$|layers\.0\.mlp\.(gate|up|down)_proj$", m)}
    assert len(want) == 3 * 4 + 3
    assert _mx_modules(got) == want
    assert summary["linears_quantized"] == len(want)
    for m in sorted(want):
        w, s = got[f"{m}.weight"], got[f"{m}.weight_scale"]
        n, k = src[f"{m}.weight"].shape
        assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (n, k), m
        assert s.dtype == torch.uint8 and tuple(s.shape) == (n, k // 32), m
        od, os_ = ocp_mxfp8_rceil(src[f"{m}.weight"])
        assert torch.equal(w.view(torch.uint8), od), m
        assert torch.equal(s, os_), m
    # everything left alone is the source's, byte for byte, under its own name
    for n, t in got.items():
        if ".experts." in n or n.removesuffix(".weight_scale").removesuffix(".weight") in want:
            continue
        assert torch.equal(t.view(torch.uint8), src[n].view(torch.uint8)), n
    kept = {n for n in src if ".experts." not in n and n.removesuffix(".weight") not in want}
    assert kept <= set(got)
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.1.self_attn.q_norm.weight", "model.norm.weight"} <= kept


def test_config_names_both_and_compressed_tensors_reads_it(qwen) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.utils.match import match_name

    src_dir, out, _ = qwen
    qc, got = _qc(out), _tensors(out)
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.format == "mxfp8-quantized" and set(parsed.config_groups) == {"group_0", "group_1"}
    preset = preset_name_to_scheme("MXFP8A16", ["x"]).model_dump(mode="json")["weights"]
    assert all(g["weights"] == preset for g in qc["config_groups"].values())
    mx = _mx_modules(got)
    assert sorted(qc["config_groups"]["group_1"]["targets"]) == sorted(mx)

    def described(module: str) -> bool:  # what a loader does: ignore first, then any group's targets
        if any(match_name(module, p) for p in qc["ignore"]):
            return False
        return any(match_name(module, t) for g in qc["config_groups"].values() for t in g["targets"])

    for n, t in got.items():
        if n.endswith(".weight") and t.dim() == 2:
            module = n.removesuffix(".weight")
            assert described(module) is (module in mx or ".experts." in n), module
    # the compressor's own naming: weight + weight_scale, decoded to the oracle's values
    decoded = CompressedTensorsDequantizer(out, dtype=torch.float32).validate(dict(got))
    src = _tensors(src_dir)
    for m in mx:
        assert f"{m}.weight_scale" not in decoded
        d, s = ocp_mxfp8_rceil(src[f"{m}.weight"])
        want = d.view(torch.float8_e4m3fn).float().reshape(*d.shape[:-1], -1, 32) * torch.pow(2.0, s.float() - 127).unsqueeze(-1)
        assert torch.equal(decoded[f"{m}.weight"], want.reshape(d.shape)), m
    assert decoded["lm_head.weight"].dtype == torch.bfloat16


def test_verify_passes_and_checks_every_linear(qwen) -> None:
    src, out, _ = qwen
    rep = verify(out, VerifyOptions(reference=str(src)))
    assert rep.passed, rep.problems + [p for r in rep.linears for p in r.problems]
    assert {r.module for r in rep.linears} == _mx_modules(_tensors(out))
    assert all(r.numerics == "ok" and r.bytes == "bit-exact" and r.rel_rms < 0.035 for r in rep.linears)
    assert {r.role for r in rep.linears} == {"attention", "dense_mlp"}
    alone = verify(out)
    assert alone.passed and all(r.numerics == "skipped" for r in alone.linears)
    m = json.loads((out / "mxconv.json").read_text())
    assert sorted(m["linears"]["quantized"]) == sorted(r.module for r in rep.linears)
    assert m["linears"]["left_alone"]["lm_head"].startswith("embedding or lm_head")
    assert {t["role"] for n, t in m["tensors"].items() if n.endswith("self_attn.q_proj.weight")} == {"linear"}


# ---- other families ------------------------------------------------------------------------------


def test_qwen2_shared_experts_quantized_gate_kept(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "qwen2-moe").path
    _convert(src, tmp_path / "out", LINEAR)
    got = _tensors(tmp_path / "out")
    mx = _mx_modules(got)
    assert {f"model.layers.1.mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")} <= mx
    assert got["model.layers.1.mlp.shared_expert_gate.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.shared_expert_gate" in _qc(tmp_path / "out")["ignore"] or any(
        re.match(p[3:], "model.layers.1.mlp.shared_expert_gate") for p in _qc(tmp_path / "out")["ignore"] if p.startswith("re:"))
    assert got["model.layers.0.self_attn.q_proj.bias"].dtype == torch.bfloat16  # biases copied
    assert verify(tmp_path / "out", VerifyOptions(reference=str(src))).passed


@pytest.mark.parametrize("kind", ["deepseek-v3-fp8", "deepseek-v3.1-fp8-ue8m0"])
def test_block_fp8_linears_are_dequantized_then_mxfp8(kind: str, tmp_path: Path) -> None:
    src_dir = make_checkpoint(tmp_path / "src", kind).path
    _convert(src_dir, tmp_path / "out", LINEAR)
    src, got = _tensors(src_dir), _tensors(tmp_path / "out")
    mx = _mx_modules(got)
    assert "model.layers.0.mlp.gate_proj" in mx and "model.layers.1.mlp.shared_experts.down_proj" in mx
    assert "model.layers.1.self_attn.kv_b_proj" in mx
    assert not any(n.endswith("weight_scale_inv") for n in got)  # every FP8 linear became MXFP8
    assert got["model.layers.2.eh_proj.weight"].dtype == torch.bfloat16  # MTP eh_proj kept
    for m in mx:
        ref = _source_float(src, m)
        d, s = ocp_mxfp8_rceil(ref)
        assert torch.equal(got[f"{m}.weight"].view(torch.uint8), d) and torch.equal(got[f"{m}.weight_scale"], s), m
        if kind.endswith("ue8m0"):  # power-of-two tiles -> MXFP8 rceil keeps every value
            back = got[f"{m}.weight"].float().reshape(*d.shape[:-1], -1, 32) * torch.pow(2.0, s.float() - 127).unsqueeze(-1)
            assert torch.equal(back.reshape(d.shape), ref), m
    rep = verify(tmp_path / "out", VerifyOptions(reference=str(src_dir)))
    assert rep.passed, rep.problems
    assert any(r.role == "shared_experts" for r in rep.linears)


def test_gpt_oss_attention(tmp_path: Path) -> None:
    src_dir = make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4").path
    _convert(src_dir, tmp_path / "out", LINEAR)
    src, got, qc = _tensors(src_dir), _tensors(tmp_path / "out"), _qc(tmp_path / "out")
    mx = _mx_modules(got)
    assert mx == {f"model.layers.{L}.self_attn.{p}" for L in (0, 1) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert qc["quant_method"] is None and qc["mxconv_quant_method"] == "mxfp8"  # transformers refuses it
    assert sorted(qc["mxconv_mxfp8_linears"]) == sorted(mx)
    assert "model.layers.*.self_attn" not in qc["modules_to_not_convert"]
    assert {"model.layers.*.mlp.router", "model.embed_tokens", "lm_head"} <= set(qc["modules_to_not_convert"])
    for m in mx:
        d, s = ocp_mxfp8_rceil(src[f"{m}.weight"])
        assert torch.equal(got[f"{m}.weight"].view(torch.uint8), d) and torch.equal(got[f"{m}.weight_scale"], s)
    for n in ("model.layers.0.self_attn.sinks", "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.router.weight"):
        assert torch.equal(got[n], src[n])
    assert verify(tmp_path / "out", VerifyOptions(reference=str(src_dir))).passed


# ---- selection: --ignore, unaligned inputs, refusals --------------------------------------------------


def test_ignore_leaves_named_linears_and_the_config_says_so(tmp_path: Path) -> None:
    src_dir = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    q = QuantOptions("mxfp8", ignore=[r"re:.*layers\.1\.self_attn\.o_proj$", "layers.0.self_attn.q_proj"], targets="linear")
    ckpt = open_checkpoint(src_dir)
    plan = build_plan(ckpt, detect_family(ckpt), q)
    assert any("model.layers.0.self_attn.q_proj" in w and "k_proj" in w for w in plan.warnings)  # fused q/k/v split
    _convert(src_dir, tmp_path / "out", q)
    src, got, qc = _tensors(src_dir), _tensors(tmp_path / "out"), _qc(tmp_path / "out")
    for m in ("model.layers.1.self_attn.o_proj", "model.layers.0.self_attn.q_proj"):
        assert torch.equal(got[f"{m}.weight"], src[f"{m}.weight"]) and f"{m}.weight_scale" not in got
        assert m in qc["ignore"] and m not in qc["config_groups"]["group_1"]["targets"]
    assert "model.layers.0.self_attn.k_proj" in _mx_modules(got)
    assert not any(p.startswith("re:") and "self_attn" in p for p in qc["ignore"])  # the family regex went
    assert verify(tmp_path / "out", VerifyOptions(reference=str(src_dir))).passed


def _add_tensor(path: Path, name: str, t: torch.Tensor) -> None:
    tensors = _tensors(path)
    tensors[name] = t
    for f in path.glob("*.safetensors"):
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    write_shards(path, tensors, 2)


def test_unaligned_linear_is_refused_or_skipped(tmp_path: Path) -> None:
    src_dir = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    _add_tensor(src_dir, "model.layers.0.self_attn.extra_proj.weight", torch.randn(16, 40).to(torch.bfloat16))
    ckpt = open_checkpoint(src_dir)
    with pytest.raises(BadInput, match=r"linear model\.layers\.0\.self_attn\.extra_proj has input size 40 .*QuantOptions.skip_unaligned"):
        build_plan(ckpt, detect_family(ckpt), LINEAR)
    _convert(src_dir, tmp_path / "q8", QuantOptions("mxfp8"))  # --targets experts: not a linear target, fine
    summary = _convert(src_dir, tmp_path / "out", QuantOptions("mxfp8", targets="linear", skip_unaligned=True))
    assert any("left unquantized" in n and "model.layers.0.self_attn.extra_proj" in n for n in summary["notes"]), summary["notes"]
    got, qc = _tensors(tmp_path / "out"), _qc(tmp_path / "out")
    assert got["model.layers.0.self_attn.extra_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.self_attn.extra_proj" in qc["ignore"]
    m = json.loads((tmp_path / "out" / "mxconv.json").read_text())
    assert "not a multiple of 32" in m["linears"]["left_alone"]["model.layers.0.self_attn.extra_proj"]
    assert verify(tmp_path / "out", VerifyOptions(reference=str(src_dir))).passed


def test_refusals(tmp_path: Path) -> None:
    src_dir = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    ckpt = open_checkpoint(src_dir)
    with pytest.raises(BadInput, match="set QuantOptions.fmt mxfp8"):
        build_plan(ckpt, detect_family(ckpt), QuantOptions("mxfp4", targets="linear"))
    with pytest.raises(BadInput, match="QuantOptions.targets 'all'"):
        build_plan(ckpt, detect_family(ckpt), QuantOptions("mxfp8", targets="all"))
    with pytest.raises(BadInput, match="applies to quantize only"):
        build_plan(ckpt, detect_family(ckpt), QuantOptions("mxfp8", targets="linear"), RepackOptions("trtllm", "bf16"))
    with pytest.raises(BadInput, match=r"QuantOptions.ignore: invalid regular expression"):
        build_plan(ckpt, detect_family(ckpt), QuantOptions("mxfp8", ignore=["ok", "re:("], targets="linear"))


def test_nonfinite_linear_weight_is_refused_by_name(tmp_path: Path) -> None:
    src_dir = make_checkpoint(tmp_path / "src", "qwen3-moe").path

    def nan(t: torch.Tensor) -> torch.Tensor:
        t[5, 70] = float("nan")
        return t

    patch_tensor(src_dir, "model.layers.1.self_attn.v_proj.weight", nan, fix_manifest=False)
    with pytest.raises(BadInput, match=r"non-finite value nan in model\.layers\.1\.self_attn\.v_proj\.weight \[5, 70\]"):
        _convert(src_dir, tmp_path / "out", LINEAR)
    _convert(src_dir, tmp_path / "out", QuantOptions("mxfp8", targets="linear", allow_nonfinite=True))
    assert _tensors(tmp_path / "out")["model.layers.1.self_attn.v_proj.weight_scale"][5, 2] == 0xFF


def test_requantizing_an_output_carries_its_mxfp8_linears(qwen, tmp_path: Path) -> None:
    src, out, _ = qwen
    again = tmp_path / "again"
    _convert(out, again, QuantOptions("mxfp8"))  # --targets experts: the MXFP8 linears stay described as such
    assert _mx_modules(_tensors(again)) == _mx_modules(_tensors(out))
    assert sorted(_qc(again)["config_groups"]["group_1"]["targets"]) == sorted(_mx_modules(_tensors(out)))
    assert verify(again, VerifyOptions(reference=str(out))).passed
    ckpt = open_checkpoint(out)
    with pytest.raises(BadInput, match="MXFP8 already; an output holds one MX format"):
        build_plan(ckpt, detect_family(ckpt), QuantOptions("mxfp4"))


# ---- verify catches what is wrong --------------------------------------------------------------------


def _copy(qwen, tmp_path: Path) -> tuple[Path, Path]:
    src, out, _ = qwen
    return src, copy_checkpoint(out, tmp_path / "out")


def test_verify_catches_a_changed_byte(qwen, tmp_path: Path) -> None:
    src, out = _copy(qwen, tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"

    def flip(t: torch.Tensor) -> torch.Tensor:
        b = t.view(torch.uint8)
        b[3, 5] ^= 0x01
        return t

    patch_tensor(out, name, flip, fix_manifest=True)
    rep = verify(out, VerifyOptions(reference=str(src)))
    assert not rep.passed
    bad = [r for r in rep.linears if not r.passed]
    assert [r.module for r in bad] == ["model.layers.1.self_attn.o_proj"] and bad[0].bytes == "FAIL"


def test_verify_catches_wrong_scales_and_nan(qwen, tmp_path: Path) -> None:
    src, out = _copy(qwen, tmp_path)
    patch_tensor(out, "model.layers.0.mlp.down_proj.weight_scale", lambda t: t + 1, fix_manifest=True)  # every block twice as large
    patch_tensor(out, "model.layers.2.self_attn.k_proj.weight_scale", lambda t: t.index_fill_(0, torch.tensor([0]), 0xFF), fix_manifest=True)
    rep = verify(out, VerifyOptions(reference=str(src)))
    by = {r.module: r for r in rep.linears}
    assert by["model.layers.0.mlp.down_proj"].numerics == "FAIL" and by["model.layers.0.mlp.down_proj"].rel_rms > 0.5
    assert "NaN scale byte" in by["model.layers.2.self_attn.k_proj"].problems[0]
    assert not verify(out).passed  # the NaN fails without a reference too


def test_verify_catches_a_config_that_does_not_say_what_is_quantized(qwen, tmp_path: Path) -> None:
    src, out = _copy(qwen, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_1"]["targets"].remove("model.layers.1.self_attn.q_proj")
    cfg["quantization_config"]["ignore"].append("model.layers.0.self_attn.q_proj")
    (out / "config.json").write_text(json.dumps(cfg))
    m = json.loads((out / "mxconv.json").read_text())
    rep = verify(out, VerifyOptions(reference=str(src)))
    assert not rep.passed
    assert sum("describes it as not quantized" in p for p in rep.problems) == 2
    del m  # the manifest is untouched: only the config lies


def test_verify_catches_a_copied_tensor_that_changed(qwen, tmp_path: Path) -> None:
    src, out = _copy(qwen, tmp_path)
    patch_tensor(out, "model.norm.weight", lambda t: t * 2, fix_manifest=True)
    rep = verify(out, VerifyOptions(reference=str(src)))
    assert any(p.startswith("model.norm.weight: not the reference's bytes") for p in rep.problems)


# ---- CLI -------------------------------------------------------------------------------------------


def test_cli_quantize_verify_inspect(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mxconv.cli import app

    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    runner = CliRunner()
    r = runner.invoke(app, ["quantize", str(src), str(tmp_path / "out"), "--format", "mxfp8", "--targets", "linear",
                            "--ignore", "re:.*o_proj$", "--ignore", r"layers\.1\.self_attn\.q_proj", "--json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["linears_quantized"] == 2 * 4 - 2 - 1
    r = runner.invoke(app, ["verify", str(tmp_path / "out"), "--reference", str(src), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "MXFP8 linear layers" in r.stdout and "attention" in r.stdout
    r = runner.invoke(app, ["inspect", str(tmp_path / "out"), "--json"])
    doc = json.loads(r.stdout)
    roles = doc["bytes_by_role"]
    assert roles["before"]["attention"] > roles["after"]["attention"] and roles["before"]["embeddings"] == roles["after"]["embeddings"]
    # which linears are MXFP8 and which were left alone, and why (the table groups them by reason)
    assert len(doc["linears"]["quantized"]) == 2 * 4 - 2 - 1
    assert doc["linears"]["left_alone"]["model.layers.1.self_attn.q_proj"] == "--include/--ignore"
    r = runner.invoke(app, ["inspect", str(tmp_path / "out")])
    assert "mxfp8 linears" in r.stdout and "--include/--ignore: model.layers.0.self_attn.o_proj" in r.stdout.replace("\n", " ")
    r = runner.invoke(app, ["inspect", str(src), "--json"])
    roles = json.loads(r.stdout)["bytes_by_role"]
    assert roles["after_label"] == "quantize --format mxfp8 --targets linear" and roles["after"]["attention"] < roles["before"]["attention"]
    r = runner.invoke(app, ["quantize", str(src), str(tmp_path / "o4"), "--targets", "linear"])
    assert r.exit_code == 2 and "pass --format mxfp8" in r.output


def test_block_fp8_linear_without_its_scales_is_refused(tmp_path: Path) -> None:
    """An F8_E4M3 linear whose weight_scale_inv is gone cannot be read: never kept silently as 'not float'."""
    from safetensors.torch import save_file

    src_dir = make_checkpoint(tmp_path / "src", "deepseek-v3-fp8").path
    gone = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"
    index_path = src_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = src_dir / index["weight_map"].pop(gone)
    tensors = load_file(shard)
    del tensors[gone]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    with pytest.raises(BadInput, match=r"kv_b_proj\.weight' is F8_E4M3 but neither .*weight_scale_inv"):
        _convert(src_dir, tmp_path / "out", LINEAR)
    assert not (tmp_path / "out" / "mxconv.json").exists()
    # leaving it alone by name is the user's explicit choice
    _convert(src_dir, tmp_path / "out2", QuantOptions("mxfp8", targets="linear", ignore=[r"re:.*kv_b_proj$"]))
    assert json.loads((tmp_path / "out2" / "mxconv.json").read_text())
    # with a scale of another kind (per-tensor FP8) it is a format mxconv does not convert: left alone, said why
    tensors = load_file(shard)
    tensors["model.layers.1.self_attn.kv_b_proj.weight_scale"] = torch.ones(1)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"]["model.layers.1.self_attn.kv_b_proj.weight_scale"] = shard.name
    index_path.write_text(json.dumps(index))
    _convert(src_dir, tmp_path / "out3", LINEAR)
    left = json.loads((tmp_path / "out3" / "mxconv.json").read_text())["linears"]["left_alone"]
    assert left["model.layers.1.self_attn.kv_b_proj"] == "F8_E4M3 weight (neither float nor block-FP8)"
