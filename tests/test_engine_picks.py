"""``mxconv inspect --engine``: the engine picks data (one assertion per row), its join with the
registered layouts' ``vllm_backends`` (a toy backend registered here is picked up), every vLLM 0.33
``Mxfp4MoeBackend`` value accounted for, and the CLI's table and JSON."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest

from mxconv.examples import make_checkpoint
from mxconv.layouts import register_layout, unregister_layout
from mxconv.layouts.engine_picks import MXFP4_BACKENDS, PICKS, SGLANG, VLLM, Gpu, SourceKind, picks
from mxconv.layouts.engine_report import engine_padding, holders, not_held, pick_row, source_kind, undeclarable_backends
from mxconv.layouts.vllm_backends import CANONICAL_VLLM_BACKENDS, Platform, home_platform, vllm_alignment, vllm_padded_sizes
from mxconv.layouts.vllm_serving import VllmMethod
from support.cli import mx
from support.toy_backend import ToyLayout

K, G = SourceKind, Gpu
# (engine, kind, gpu) -> backend, read off vLLM 0.33.0 / SGLang 0.5.23 by hand (module docstring of engine_picks)
EXPECTED = {
    (VLLM, K.GPT_OSS_MXFP4, G.SM90): "TRITON", (VLLM, K.GPT_OSS_MXFP4, G.SM100): "FLASHINFER_TRTLLM_MXFP4_BF16",
    (VLLM, K.GPT_OSS_MXFP4, G.SM120): "MARLIN", (VLLM, K.GPT_OSS_MXFP4, G.GFX950): "TRITON",
    (VLLM, K.GPT_OSS_MXFP4, G.CPU): "CPU",
    (VLLM, K.MXFP4, G.SM90): "HUMMING", (VLLM, K.MXFP4, G.SM100): "FLASHINFER_TRTLLM_MXFP4_MXFP8",
    (VLLM, K.MXFP4, G.SM120): "MARLIN", (VLLM, K.MXFP4, G.GFX950): "EMULATION", (VLLM, K.MXFP4, G.CPU): "CPU",
    (VLLM, K.CT_MXFP4, G.SM90): "MARLIN", (VLLM, K.CT_MXFP4, G.SM100): "CUTLASS_MXFP4_MXFP4",
    (VLLM, K.CT_MXFP4, G.SM120): "CUTLASS_MXFP4_MXFP4", (VLLM, K.CT_MXFP4, G.GFX950): None, (VLLM, K.CT_MXFP4, G.CPU): None,
    (VLLM, K.CT_INT4, G.SM90): "HUMMING", (VLLM, K.CT_INT4, G.SM100): "FLASHINFER_TRTLLM", (VLLM, K.CT_INT4, G.SM120): "MARLIN",
    (VLLM, K.CT_INT4, G.GFX950): "TRITON",
    (VLLM, K.CT_MXFP8, G.SM90): "HUMMING", (VLLM, K.CT_MXFP8, G.SM100): "FLASHINFER_TRTLLM", (VLLM, K.CT_MXFP8, G.SM120): "MARLIN",
    (VLLM, K.CT_MXFP8, G.GFX950): "TRITON_MXFP8", (VLLM, K.CT_MXFP8, G.CPU): "EMULATION",
    **{(VLLM, K.MXCONV_MXFP8, g): None for g in G},
    (SGLANG, K.GPT_OSS_MXFP4, G.SM100): "flashinfer_mxfp4 (trtllm_sm100)",
    (SGLANG, K.GPT_OSS_MXFP4, G.SM120): "flashinfer_mxfp4 (cutlass_sm120)",
}
# Mxfp4MoeBackend values of vLLM 0.33.0 (fused_moe/oracle/mxfp4.py), checked in
VLLM_MXFP4_ENUM = (
    "None", "B12X_MXFP4_MXFP8", "B12X_MXFP4_BF16", "DEEPGEMM_MXFP4", "FLASHINFER_TRTLLM_MXFP4_MXFP8",
    "FLASHINFER_TRTLLM_MXFP4_BF16", "FLASHINFER_CUTLASS_MXFP4_MXFP8", "FLASHINFER_CUTLASS_MXFP4_BF16", "CUTLASS_MXFP4_MXFP4",
    "BATCHED_MARLIN", "MARLIN", "AITER_MXFP4_BF16", "AITER_TRITON_MXFP4_BF16", "AITER_MXFP4_FP8", "AITER_MXFP4_MXFP4",
    "AITER_TRITON_MXFP4_MXFP4", "TRITON", "TRITON_UNFUSED", "XPU", "CPU", "EMULATION", "HUMMING",
    "FLASHINFER_MOE_EP_CUTEDSL", "FLASHINFER_MOE_EP_DEEP_GEMM",
)
MODEL = {"hidden_size": 2880, "intermediate_size": 2880, "activation": "swigluoai", "has_expert_bias": True,
         "num_experts": 4, "row_order": "interleaved"}


def test_the_data_has_exactly_the_expected_rows() -> None:
    keys = [(p.engine, p.source, p.gpu) for p in PICKS]
    assert len(keys) == len(set(keys)), "one row per (engine, kind, gpu)"
    assert set(keys) == set(EXPECTED)


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: "-".join(map(str, k)))
def test_each_row_pick(key: tuple) -> None:
    p = picks(*key)
    assert p is not None and p.backend == EXPECTED[key]
    assert p.cite and p.why  # every row says where it comes from and why


def mxfp4_holders(name: str) -> list[dict]:
    """Holders of the Mxfp4MoeBackend value ``name``: under the two methods that load MXFP4 (the same names,
    EMULATION, MARLIN, HUMMING, XPU, are Fp8MoeBackend values too, held by MXFP8 outputs)."""
    return [h for m in (VllmMethod.MXFP4, VllmMethod.CT_MXFP4) for h in holders(name, m)]


def test_every_vllm_mxfp4_backend_is_listed_and_who_holds_it_comes_from_the_registry() -> None:
    assert set(MXFP4_BACKENDS) == set(VLLM_MXFP4_ENUM) - {"None"}  # the enum's unset value is no backend
    for name in MXFP4_BACKENDS:  # vLLM's notes only: never a claim about mxconv's outputs
        assert not re.search(r"mxconv|layout|manifest|output", MXFP4_BACKENDS[name]), (name, MXFP4_BACKENDS[name])
        why = not_held(name, VllmMethod.MXFP4)
        assert (why is None) == bool(holders(name, VllmMethod.MXFP4)), (name, why)
    # the canonical outputs hold XPU and EMULATION as is
    assert {h["output"] for h in mxfp4_holders("XPU")} == {f"canonical ({lay})" for lay in CANONICAL_VLLM_BACKENDS}
    assert [h["output"] for h in mxfp4_holders("EMULATION")] == ["canonical (canonical-gpt-oss)"]
    assert ("repack --backend triton --activation bf16") in {h["output"] for h in mxfp4_holders("TRITON")}


def test_why_no_output_holds_a_backend_follows_the_registry() -> None:
    """The reason is derived, so a layout registered later that declares the backend removes it: nothing to edit."""
    gfx1250 = "AITER_TRITON_MXFP4_MXFP4"
    assert not_held(gfx1250, VllmMethod.MXFP4) == (
        f"no mxconv output holds {gfx1250} bytes yet: no registered layout declares this Mxfp4MoeBackend value in its "
        f"vllm_backends (vLLM: {MXFP4_BACKENDS[gfx1250]})")

    class Gfx1250Toy(ToyLayout):
        name = "gfx1250toy"
        vllm_backends = {"bf16": (gfx1250,)}

    register_layout("gfx1250toy", Gfx1250Toy())
    try:
        assert not_held(gfx1250, VllmMethod.MXFP4) is None
        assert [h["output"] for h in holders(gfx1250, VllmMethod.MXFP4)] == ["repack --backend gfx1250toy --activation bf16"]
    finally:
        unregister_layout("gfx1250toy")
    assert not_held(gfx1250, VllmMethod.MXFP4) is not None


def test_vllm_padding_is_known_for_every_mxfp4_backend_so_no_layout_adds_to_it() -> None:
    """vllm_backends.py is vLLM's data over its whole enum, not per mxconv layout: a layout declaring any
    Mxfp4MoeBackend value finds vLLM's padding of it on every platform, with nothing to add there."""
    for name in MXFP4_BACKENDS:
        home = home_platform(name)
        for platform in Platform if home is None else [home]:  # where vLLM runs it
            assert vllm_alignment(name, "silu", platform) is not None, (name, platform)


def test_every_declared_vllm_backend_is_a_value_of_its_enum() -> None:
    assert undeclarable_backends() == []

    class Typo(ToyLayout):
        name = "typo"
        vllm_backends = {"bf16": ("HUMMNG",)}
        vllm_mxfp8_backends = {"bf16": ("HUMMING",)}

    register_layout("typo", Typo())
    try:
        assert undeclarable_backends() == ["typo.vllm_backends[bf16]: HUMMNG"]
    finally:
        unregister_layout("typo")


def test_a_backend_registered_later_is_joined_by_its_vllm_backends() -> None:
    before = pick_row(VLLM, K.MXFP4, G.SM90, MODEL)
    assert before["backend"] == "HUMMING"
    assert [h["output"] for h in before["held_by"]] == ["repack --backend humming --activation bf16"]

    class HummingToy(ToyLayout):
        name = "humtoy"
        vllm_backends = {"bf16": ("HUMMING",)}

    register_layout("humtoy", HummingToy())
    try:
        after = pick_row(VLLM, K.MXFP4, G.SM90, MODEL)
    finally:
        unregister_layout("humtoy")
    assert [h["output"] for h in after["held_by"]] == [h["output"] for h in before["held_by"]] + [
        "repack --backend humtoy --activation bf16"]
    assert after["held_by"][-1]["padded"] == [2880, 2880] and after["held_by"][-1]["refusal"] is None and "note" not in after


def test_a_pick_no_output_holds_says_so() -> None:
    """Compressed-tensors MXFP8 on SM100 goes to FLASHINFER_TRTLLM through the FP8 oracle, held by trtllm's
    MXFP8 form; compressed-tensors INT4 on SM100 goes to a WNA16 backend no layout names."""
    row = pick_row(VLLM, K.CT_MXFP8, G.SM100, MODEL)
    assert row["backend"] == "FLASHINFER_TRTLLM" and "note" not in row
    [held] = row["held_by"]  # MODEL has expert biases, which the compressed-tensors MXFP8 method never creates
    assert held["output"] == "repack --backend trtllm --activation mxfp8 --format mxfp8"
    assert "trtllm MXFP8 takes no expert biases" in held["refusal"]
    sm100 = pick_row(VLLM, K.CT_INT4, G.SM100, MODEL)  # a WNA16 pick no layout's vllm_int4_backends names
    assert sm100["held_by"] == [] and sm100["note"] == ("no mxconv output holds FLASHINFER_TRTLLM bytes yet: no registered "
                                                        "layout declares this WNA16MoEBackend value in its vllm_int4_backends")


def test_ct_int4_on_sm90_is_held_by_repack_backend_humming() -> None:
    """WNA16 -> HUMMING on SM90: held by the humming layout's INT4 variant (vllm_int4_backends), unpadded."""
    model = dict(MODEL, hidden_size=7168, intermediate_size=2048, activation="silu", row_order="halves", has_expert_bias=False)
    row = pick_row(VLLM, K.CT_INT4, G.SM90, model)
    assert row["backend"] == "HUMMING" and row["engine_padding"] == [7168, 2048] and "note" not in row
    assert [(h["output"], h["padded"], h["refusal"]) for h in row["held_by"]] == [
        ("repack --backend humming --activation bf16", [7168, 2048], None)]
    odd = pick_row(VLLM, K.CT_INT4, G.SM90, dict(model, intermediate_size=48))
    assert "repack refuses these sizes" in odd["held_by"][0]["refusal"] and "multiple of 32" in odd["held_by"][0]["refusal"]
    assert holders("HUMMING", VllmMethod.CT_WNA16) == [
        {"output": "repack --backend humming --activation bf16", "backend": "humming", "activation": "bf16", "weight_format": "int4"}]


def test_ct_mxfp8_on_sm90_is_held_by_repack_backend_humming() -> None:
    """MXFP8 -> Fp8MoeBackend.HUMMING on SM90 under CompressedTensorsW8A8Mxfp8MoEMethod: held by the humming
    layout's MXFP8 form (vllm_mxfp8_backends), unpadded; the Fp8MoeBackend holders are not the Mxfp4MoeBackend
    ones of the same name."""
    model = dict(MODEL, hidden_size=7168, intermediate_size=2048, activation="silu", row_order="halves", has_expert_bias=False)
    row = pick_row(VLLM, K.CT_MXFP8, G.SM90, model)
    assert row["backend"] == "HUMMING" and row["engine_padding"] == [7168, 2048] and "note" not in row
    assert [(h["output"], h["padded"], h["refusal"]) for h in row["held_by"]] == [
        ("repack --backend humming --activation bf16 --format mxfp8", [7168, 2048], None)]
    assert holders("HUMMING", VllmMethod.CT_MXFP8) == [
        {"output": "repack --backend humming --activation bf16 --format mxfp8", "backend": "humming", "activation": "bf16",
         "weight_format": "mxfp8"}]
    assert row["method"] == "CompressedTensorsW8A8Mxfp8MoEMethod"


def test_padding_is_vllm_padded_sizes_and_compressed_tensors_pads_nothing() -> None:
    trt = picks(VLLM, K.GPT_OSS_MXFP4, G.SM100)
    assert engine_padding(trt, 2880, 1440, "swigluoai") == vllm_padded_sizes(trt.backend, 2880, 1440, "swigluoai") == (3072, 1536)
    ct = picks(VLLM, K.CT_MXFP4, G.SM90)
    assert engine_padding(ct, 2880, 1440, "silu") == (2880, 1440)
    assert engine_padding(picks(VLLM, K.CT_INT4, G.SM90), 7168, 2048, "silu") == (7168, 2048)  # WNA16 pads nothing
    assert engine_padding(picks(VLLM, K.CT_MXFP8, G.SM90), 7168, 2048, "silu") == (7168, 2048)  # MXFP8 pads nothing


def test_a_holder_padded_otherwise_says_why() -> None:
    row = pick_row(VLLM, K.GPT_OSS_MXFP4, G.SM100, dict(MODEL, hidden_size=96, intermediate_size=64))
    trt = {h["output"]: h for h in row["held_by"]}["repack --backend trtllm --activation bf16"]
    assert row["engine_padding"] == [256, 128] and trt["padded"] == [256, 128] and trt["refusal"] is None


def test_source_kind_from_quantization_config() -> None:
    assert source_kind({"quant_method": "mxfp4"}, "gpt_oss") is K.GPT_OSS_MXFP4
    assert source_kind({"quant_method": "mxfp4"}, "qwen3_moe") is K.MXFP4
    assert source_kind({"quant_method": None, "mxconv_quant_method": "mxfp8"}, "gpt_oss") is K.MXCONV_MXFP8
    ct = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"format": "pack-quantized"}}}
    assert source_kind(ct, "kimi_k2") is K.CT_INT4
    assert source_kind({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}, "qwen3_moe") is K.CT_MXFP4
    assert source_kind(None, "qwen3_moe") is None and source_kind({"quant_method": "fp8"}, "deepseek_v3") is None


def test_cli_gpt_oss_source_on_sm90_json(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4")
    code, out, err = mx("inspect", str(tmp_path / "src"), "--gpu", "sm90", "--json")
    assert code == 0, err
    eng = json.loads(out)["engine"]
    assert eng["engine"] == VLLM and [g["gpu"] for g in eng["gpus"]] == ["sm90"]
    rows = {r["form"]: r for r in eng["gpus"][0]["rows"]}
    assert rows["as is"]["backend"] == "TRITON" and rows["as is"]["engine_padding"] == [96, 64]
    assert rows["as is"]["held_by"][0]["output"] == "repack --backend triton --activation bf16"
    assert rows["quantize --format mxfp8"]["backend"] is None


def test_cli_qwen_source_table_and_a_repacked_output(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "src", "qwen3-moe")
    code, out, err = mx("inspect", str(tmp_path / "src"), "--engine", "vllm-0.33", "--gpu", "sm100")
    assert code == 0, err
    assert "vllm-0.33 on sm100" in out and "CUTLASS_MXFP4_MXFP4" in out
    # the toy qwen has H=160, I=96: vLLM's compressed-tensors CUTLASS branch cannot load them
    assert "repack --backend cutlass" in out and "multiples of 128; these are (160, 96)" in " ".join(out.split())
    code, _, err = mx("quantize", str(tmp_path / "src"), str(tmp_path / "q"), "--format", "mxfp4", "--quiet")
    assert code == 0, err
    code, _, err = mx("repack", str(tmp_path / "q"), str(tmp_path / "m"), "--backend", "marlin", "--quiet")
    assert code == 0, err
    code, out, err = mx("inspect", str(tmp_path / "m"), "--gpu", "sm90", "--json")
    assert code == 0, err
    row = json.loads(out)["engine"]["gpus"][0]["rows"][0]
    assert row["kind"] == "ct-mxfp4" and row["backend"] == "MARLIN" and row["form"].startswith("its canonical mxfp4 form")
    assert isinstance(row["this_output_holds_it"], bool)


def test_one_served_by_answer_for_a_qwen_marlin_output(tmp_path: Path) -> None:
    """A Qwen compressed-tensors MXFP4 output repacked for marlin is padded as Mxfp4MoEMethod pads it
    (H 160 -> 256, I 96 -> 128); the compressed-tensors method pads nothing. The manifest, inspect's
    backend table and inspect --engine (source and output) all say: MARLIN under Mxfp4MoEMethod only."""
    make_checkpoint(tmp_path / "src", "qwen3-moe")
    for args in (("quantize", tmp_path / "src", tmp_path / "q"), ("repack", tmp_path / "q", tmp_path / "m", "--backend", "marlin")):
        code, _, err = mx(*args, "--quiet")
        assert code == 0, err
    m = json.loads((tmp_path / "m" / "mxconv.json").read_text())
    held = {"Mxfp4MoEMethod": ["MARLIN", "BATCHED_MARLIN"]}
    assert m["served_vllm_methods"] == held and m["served_vllm_backends"] == ["MARLIN", "BATCHED_MARLIN"]
    assert m["quant_config"]["served_vllm_methods"] == held

    code, out, err = mx("inspect", tmp_path / "q", "--gpu", "sm90", "--json")
    assert code == 0, err
    doc = json.loads(out)
    (marlin,) = [b for b in doc["backends"] if (b["backend"], b["activation"]) == ("marlin", "bf16")]
    assert marlin["vllm_methods"] == held
    (ct,) = [r for r in doc["engine"]["gpus"][0]["rows"] if r["kind"] == "ct-mxfp4"]
    (h,) = [h for h in ct["held_by"] if h["output"] == "repack --backend marlin --activation bf16"]
    assert ct["method"] == "CompressedTensorsW4A4Mxfp4MoEMethod" and ct["engine_padding"] == [160, 96]
    assert h["refusal"] == "vLLM's compressed-tensors methods pad nothing; these tensors are padded from (160, 96) to (256, 128)"
    assert h["served_elsewhere"] == held

    for gpu, kind, holds in (("sm90", "ct-mxfp4", False), ("sm120", "mxfp4", True)):  # sm120: Mxfp4MoEMethod picks MARLIN
        code, out, err = mx("inspect", tmp_path / "m", "--gpu", gpu, "--json")
        assert code == 0, err
        (row,) = [r for r in json.loads(out)["engine"]["gpus"][0]["rows"] if r["kind"] == kind]
        assert row["backend"] == "MARLIN" and row["this_output_holds_it"] is holds, row
    code, out, err = mx("inspect", tmp_path / "m", "--gpu", "sm90")
    text = " ".join(out.split())
    assert code == 0 and "this output: yes" not in text and "to (160, 96)" not in text
    assert "MARLIN, BATCHED_MARLIN under quant_method mxfp4 (Mxfp4MoEMethod" in text


def test_engine_table_gives_whole_commands_with_paths(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "src", "qwen3-moe")
    code, out, err = mx("inspect", tmp_path / "src", "--gpu", "sm90")
    assert code == 0, err
    want = f"mxconv repack {tmp_path / 'src'} {tmp_path / 'src'}-humming-bf16 --backend humming --activation bf16"
    assert any(line.endswith(want) for line in out.splitlines()), out


def test_sglang_shows_only_its_own_rows(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "qwen", "qwen3-moe")
    code, out, err = mx("inspect", tmp_path / "qwen", "--engine", "sglang-0.5.23", "--json")
    assert code == 0, err
    eng = json.loads(out)["engine"]
    assert eng["gpus"] == [] and "records picks only where sglang-0.5.23 picks otherwise" in eng["note"]
    make_checkpoint(tmp_path / "gpt", "gpt-oss-mxfp4")
    code, out, err = mx("inspect", tmp_path / "gpt", "--engine", "sglang-0.5.23", "--json")
    assert code == 0, err
    eng = json.loads(out)["engine"]
    assert [g["gpu"] for g in eng["gpus"]] == ["sm100", "sm120"]
    assert all(r["engine"] == SGLANG for g in eng["gpus"] for r in g["rows"])


def test_cli_refuses_an_unknown_gpu_or_engine_before_reading_the_source(tmp_path: Path) -> None:
    code, _, err = mx("inspect", str(tmp_path / "no-such-dir"), "--gpu", "sm80")
    assert code == 2 and "unknown GPU sm80" in err
    make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4")
    code, _, err = mx("inspect", str(tmp_path / "src"), "--gpu", "sm80")
    assert code == 2 and "sm90, sm100, sm120, gfx950, cpu" in err
    code, _, err = mx("inspect", str(tmp_path / "src"), "--engine", "trt-llm")
    assert code == 2 and "vllm-0.33, sglang-0.5.23" in err


def test_sglang_entry_differs_where_recorded_and_falls_back_elsewhere() -> None:
    row = pick_row(SGLANG, K.GPT_OSS_MXFP4, G.SM100, MODEL)
    assert row["backend"] == "flashinfer_mxfp4 (trtllm_sm100)" and row["held_by"] == []
    same = pick_row(SGLANG, K.GPT_OSS_MXFP4, G.SM90, MODEL)
    assert same["backend"] == "TRITON" and same["engine"] == VLLM and "no different pick" in same["note"]


def _vllm_wheel() -> Path | None:
    found = sorted((Path(__file__).resolve().parents[1] / ".whl").glob("vllm-0.33.0-*.whl"))
    return found[0] if found else None


@pytest.mark.skipif(_vllm_wheel() is None, reason="the vLLM 0.33.0 wheel is not in .whl/")
def test_cites_name_functions_of_the_vllm_wheel() -> None:
    z = zipfile.ZipFile(_vllm_wheel())  # type: ignore[arg-type]
    for p in (p for p in PICKS if p.engine == VLLM):
        for part in p.cite.split("; "):
            path, funcs = part.split(": ")
            src = z.read(f"vllm/model_executor/layers/{path}").decode()
            for fn in funcs.split(", "):
                assert re.search(rf"(def|class) {fn.split('.')[-1]}\b|^{fn}\s*=", src, re.M), (p, fn)
    body = z.read("vllm/model_executor/layers/fused_moe/oracle/mxfp4.py").decode().split("class Mxfp4MoeBackend(Enum):")[1]
    assert set(re.findall(r'^\s+\w+ = "(\w+)"', body.split("\n\n\n")[0], re.M)) == set(VLLM_MXFP4_ENUM)
