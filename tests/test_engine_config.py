"""Engine quant config (mxconv.output.engine_quant_config) and served vLLM backends: exact values per output,
every generated config valid against docs/quant-config.schema.json, stored == recomputed, inspect."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from mxconv.source.checkpoint import open_checkpoint
from mxconv.cli import app
from mxconv.run.conversion import Conversion, RunSettings
from mxconv.run.options import QuantOptions, RepackOptions
from mxconv.run.plan import build_plan
from mxconv.output.engine_quant_config import EngineQuantConfig, from_manifest, quant_config_of
from mxconv.source.manifest import Manifest
from mxconv.errors import BadInput
from mxconv.families import detect_family
from support.checkpoints import ModelSizes, make_checkpoint
from support.registry_cases import activation_cases, takes_biases
from mxconv.layouts import backend_names, get_layout
from mxconv.layouts.activation_quant import by_activation
from mxconv.layouts.vllm_backends import admits_vllm, vllm_padded_sizes

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "docs" / "quant-config.schema.json").read_text())
KINDS = ("gpt-oss-bf16", "qwen3-moe", "deepseek-v3-fp8")


def validate(value: Any, schema: dict[str, Any], root: dict[str, Any] = SCHEMA, at: str = "$") -> list[str]:
    """The errors of ``value`` against the JSON-schema subset the schema file uses (empty = valid)."""
    if "$ref" in schema:
        return validate(value, root["$defs"][schema["$ref"].split("/")[-1]], root, at)
    if "oneOf" in schema:
        ok = [s for s in schema["oneOf"] if not validate(value, s, root, at)]
        return [] if len(ok) == 1 else [f"{at}: matches {len(ok)} of oneOf"]
    errs: list[str] = []
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if "type" in schema:
        allowed = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]

        def is_type(t: str) -> bool:
            if t in ("integer", "number"):
                return isinstance(value, int if t == "integer" else (int, float)) and not isinstance(value, bool)
            return isinstance(value, types[t])

        if not any(is_type(t) for t in allowed):
            return [f"{at}: {value!r} is not {allowed}"]
    if "const" in schema and value != schema["const"]:
        errs.append(f"{at}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{at}: {value!r} not in {schema['enum']}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        errs.append(f"{at}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < schema.get("minimum", value):
        errs.append(f"{at}: {value} < {schema['minimum']}")
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            errs.append(f"{at}: {len(value)} items")
        for i, v in enumerate(value):
            errs += validate(v, schema.get("items", {}), root, f"{at}[{i}]")
    if isinstance(value, dict):
        errs += [f"{at}: missing {k}" for k in schema.get("required", []) if k not in value]
        props = schema.get("properties", {})
        for k, v in value.items():
            if k in props:
                errs += validate(v, props[k], root, f"{at}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{at}: unexpected {k}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errs += validate(v, schema["additionalProperties"], root, f"{at}.{k}")
    return errs


def _convert(src: Path, out: Path, q: QuantOptions, r: RepackOptions | None = None) -> dict[str, Any]:
    ckpt = open_checkpoint(src)
    plan = build_plan(ckpt, detect_family(ckpt), q, r)
    Conversion(plan).run(out, device=torch.device("cpu"), settings=RunSettings(10**9, True, argv=("test",)))
    return json.loads((out / "mxconv.json").read_text())


def _format_source(root: Path, fmt: str, biases: bool) -> Path:
    """A source whose experts are ``fmt`` (made once under ``root``): gpt-oss (expert biases) or Qwen3-MoE
    quantized to MXFP8 at sizes every MXFP8 form takes, or the Kimi-K2 INT4 checkpoint."""
    if fmt == "int4":
        folder = root / "src-int4"
        return folder if folder.exists() else make_checkpoint(folder, "kimi-k2-int4").path
    kind = "gpt-oss-bf16" if biases else "qwen3-moe"
    q8 = root / f"src-{kind}-mxfp8"
    if not q8.exists():
        src = make_checkpoint(root / f"src-{kind}-128", kind, ModelSizes(hidden_size=128, intermediate_size=128)).path
        _convert(src, q8, QuantOptions("mxfp8"))
    return q8


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Manifests: per family canonical mxfp4/mxfp8, every backend x activation, and a few options/TP."""
    root = tmp_path_factory.mktemp("qc")
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        src = make_checkpoint(root / kind, kind).path
        for fmt in ("mxfp4", "mxfp8"):
            out[f"{kind}/{fmt}"] = _convert(src, root / f"{kind}-{fmt}", QuantOptions(fmt))
        q4 = root / f"{kind}-mxfp4"
        # q4's experts; W4A8 activations need input scales: the Quark source below has them
        for backend, _, act in activation_cases(("mxfp4",)):
            out[f"{kind}/{backend}/{act}"] = _convert(q4, root / f"{kind}-{backend}-{act}", QuantOptions(), RepackOptions(backend, act))
    for backend, fmt, act in activation_cases(("mxfp8", "int4")):  # every other form, from a source of its format
        src = _format_source(root, fmt, takes_biases(backend, fmt))
        out[f"{fmt}/{backend}/{act}"] = _convert(src, root / f"{fmt}-{backend}-{act}", QuantOptions(), RepackOptions(backend, act))
    quark = make_checkpoint(root / "quark", "gpt-oss-quark-w4a8").path
    out["quark/triton-gfx950/fp8"] = _convert(quark, root / "w4a8", QuantOptions(), RepackOptions("triton", "fp8", 1, {"arch": "gfx950"}))
    gpt_q4 = root / "gpt-oss-bf16-mxfp4"
    out["gpt/trtllm-256"] = _convert(gpt_q4, root / "t256", QuantOptions(), RepackOptions("trtllm", "mxfp8", 1, {"intermediate_align": 256}))
    out["gpt/marlin-legacy"] = _convert(gpt_q4, root / "ml", QuantOptions(), RepackOptions("marlin", "bf16", 1, {"marlin_scale_layout": "legacy"}))
    out["qwen/deepgemm-tp2"] = _convert(root / "qwen3-moe-mxfp4", root / "dg2", QuantOptions(), RepackOptions("deepgemm", "fp8", 2))
    return out


def test_every_generated_config_is_valid_and_stored(outputs: dict[str, dict[str, Any]]) -> None:
    for key, m in outputs.items():
        assert validate(m["quant_config"], SCHEMA) == [], key
        qc = EngineQuantConfig.from_json(m["quant_config"])
        older = {k: v for k, v in m.items() if k != "quant_config"}  # a manifest written before the quant config
        assert qc == from_manifest(Manifest.parse(m, key)) == quant_config_of(Manifest.parse(older, key)), key
        assert qc.to_json() == m["quant_config"] and m["served_vllm_backends"] == list(qc.served_vllm_backends), key


def test_schema_agrees_with_jsonschema(outputs: dict[str, dict[str, Any]]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    for m in outputs.values():
        jsonschema.validate(m["quant_config"], SCHEMA)
    bad = dict(outputs["qwen3-moe/mxfp4"]["quant_config"], weight_dtype="nvfp4")
    assert validate(bad, SCHEMA) == ["$.weight_dtype: 'nvfp4' not in ['mxfp4', 'mxfp8', 'int4', 'fp8-block']"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)


def test_gpt_oss_canonical(outputs: dict[str, dict[str, Any]]) -> None:
    qc = outputs["gpt-oss-bf16/mxfp4"]["quant_config"]  # E=4, H=96, I=64
    assert (qc["kind"], qc["weight_dtype"], qc["block_shape"], qc["scale_format"]) == ("canonical", "mxfp4", [1, 32], "e8m0")
    assert qc["activation_quant"] == {"scheme": "none", "dtype": None, "group_shape": None, "scale_format": None}
    p = "model.layers.{L}.mlp.experts."
    assert qc["gemm1"] == {
        "weights": [{"name": p + "gate_up_proj_blocks", "dtype": "U8", "shape": [4, 128, 3, 16]}],
        "scales": [{"name": p + "gate_up_proj_scales", "dtype": "U8", "shape": [4, 128, 3]}],
        "biases": [{"name": p + "gate_up_proj_bias", "dtype": "BF16", "shape": [4, 128]}],
    }
    assert qc["gemm2"]["scales"] == [{"name": p + "down_proj_scales", "dtype": "U8", "shape": [4, 96, 2]}]
    assert qc["activation"] == {
        "name": "swigluoai", "w13_row_order": "interleaved", "alpha": 1.702, "beta": 1.0, "limit": 7.0,
        "formula": "g = min(gate, limit); u = clamp(up, -limit, limit); out = (u + beta) * g * sigmoid(alpha * g)",
        "w13_kernel_row_order": None,
    }
    assert qc["routing"] == {
        "method": "topk_softmax", "vllm_routing_method": "RenormalizeNaive", "scoring_func": "softmax", "top_k": 2,
        "num_experts": 4, "renormalize": True, "routed_scaling_factor": 1.0, "n_group": None, "topk_group": None,
        "router_bias": True, "correction_bias": False,
    }
    assert (qc["served_vllm_backends"], qc["not_served"], qc["tensors_per"]) == (["EMULATION", "XPU"], {}, "checkpoint")
    q8 = outputs["gpt-oss-bf16/mxfp8"]["quant_config"]
    assert q8["weight_dtype"] == "mxfp8" and q8["served_vllm_backends"] == []
    assert q8["gemm1"]["weights"] == [{"name": p + "gate_up_proj_blocks", "dtype": "F8_E4M3", "shape": [4, 128, 3, 32]}]


def test_per_expert_and_grouped_routing(outputs: dict[str, dict[str, Any]]) -> None:
    qc = outputs["qwen3-moe/mxfp4"]["quant_config"]  # E=4, H=160, I=96
    p = "model.layers.{L}.mlp.experts.{e}."
    assert [t["name"] for t in qc["gemm1"]["weights"]] == [p + "gate_proj.weight_packed", p + "up_proj.weight_packed"]
    assert qc["gemm1"]["scales"][1] == {"name": p + "up_proj.weight_scale", "dtype": "U8", "shape": [96, 5]}
    assert qc["gemm2"] == {"weights": [{"name": p + "down_proj.weight_packed", "dtype": "U8", "shape": [160, 48]}],
                           "scales": [{"name": p + "down_proj.weight_scale", "dtype": "U8", "shape": [160, 3]}], "biases": []}
    assert qc["activation"]["name"] == "silu" and qc["activation"]["w13_row_order"] == "halves"
    assert qc["served_vllm_backends"] == ["XPU"]  # compressed-tensors: EMULATION is not reachable
    ds = outputs["deepseek-v3-fp8/mxfp4"]["quant_config"]["routing"]
    assert ds == {
        "method": "sigmoid_grouped", "vllm_routing_method": "DeepSeekV3", "scoring_func": "sigmoid", "top_k": 2,
        "num_experts": 4, "renormalize": True, "routed_scaling_factor": 2.5, "n_group": 2, "topk_group": 1,
        "router_bias": False, "correction_bias": True,
    }


def test_activation_quant_per_backend(outputs: dict[str, dict[str, Any]]) -> None:
    def aq(key: str) -> dict[str, Any]:
        return outputs[key]["quant_config"]["activation_quant"]

    none = {"scheme": "none", "dtype": None, "group_shape": None, "scale_format": None}
    assert aq("qwen3-moe/trtllm/bf16") == aq("qwen3-moe/marlin/bf16") == aq("qwen3-moe/aiter/bf16") == none
    assert aq("qwen3-moe/trtllm/mxfp8") == {"scheme": "dynamic_mxfp8", "dtype": "float8_e4m3fn", "group_shape": [1, 32], "scale_format": "e8m0"}
    assert aq("qwen3-moe/aiter/mxfp4") == {"scheme": "dynamic_mxfp4", "dtype": "float4_e2m1fn", "group_shape": [1, 32], "scale_format": "e8m0"}
    assert aq("qwen3-moe/marlin/fp8") == {"scheme": "dynamic_fp8_per_token", "dtype": "float8_e4m3fn", "group_shape": [1, -1], "scale_format": "float32"}
    assert aq("qwen3-moe/deepgemm/fp8") == {"scheme": "dynamic_fp8_per_token_group", "dtype": "float8_e4m3fn", "group_shape": [1, 128], "scale_format": "ue8m0"}
    assert aq("quark/triton-gfx950/fp8") == {"scheme": "static_fp8_per_tensor", "dtype": "float8_e4m3fn", "group_shape": [-1, -1], "scale_format": "float32"}
    assert outputs["quark/triton-gfx950/fp8"]["quant_config"]["served_vllm_backends"] == ["AITER_MXFP4_FP8"]
    assert by_activation("int8").scheme == "unknown" and by_activation(None).scheme == "none"


def test_activation_quant_is_the_layouts_declaration(outputs: dict[str, dict[str, Any]]) -> None:
    """A kernel output's activation_quant is what its layout (its form of the weight format) declares, so
    output/ names no vLLM backend and compares no weight format to decide it."""
    for key, m in outputs.items():
        if m["kind"] != "kernel":
            assert m["quant_config"]["activation_quant"]["scheme"] in ("none", "dynamic_fp8_per_token_group"), key
            continue
        want = get_layout(m["backend"]).activation_quantization(m["activation"], weight_format=m["weight_format"])
        assert EngineQuantConfig.from_json(m["quant_config"]).activation_quant == want, key
    assert get_layout("xpu").activation_quantization("bf16", weight_format="mxfp8").scheme == "dynamic_mxfp8"
    assert get_layout("marlin").activation_quantization("bf16", weight_format="mxfp8").scheme == "none"
    source = (Path(__file__).resolve().parents[1] / "src" / "mxconv" / "output").rglob("*.py")
    declared = {b for name in backend_names() for lay in [get_layout(name)]
                for table in (lay.vllm_backends, lay.vllm_int4_backends, lay.vllm_mxfp8_backends)
                for names in table.values() for b in names}
    assert "XPU" in declared
    spelled = {(p.name, b) for p in source for b in declared if re.search(rf"[\"']{b}[\"']", p.read_text())}
    assert not spelled, spelled


def test_kernel_tensors_and_served(outputs: dict[str, dict[str, Any]]) -> None:
    p = "model.layers.{L}.mlp.experts."
    dg = outputs["qwen3-moe/deepgemm/fp8"]["quant_config"]  # Hp = 256, Ip = 128
    assert dg["gemm1"] == {"weights": [{"name": p + "w13_weight", "dtype": "U8", "shape": [4, 256, 128]}],
                           "scales": [{"name": p + "w13_weight_scale", "dtype": "I32", "shape": [4, 2, 256]}], "biases": []}
    assert dg["gemm2"]["scales"] == [{"name": p + "w2_weight_scale", "dtype": "I32", "shape": [4, 1, 256]}]
    assert (dg["served_vllm_backends"], dg["not_served"], dg["tensors_per"]) == (["DEEPGEMM_MXFP4"], {}, "tp_rank")
    tp2 = outputs["qwen/deepgemm-tp2"]["quant_config"]  # I = 48 per rank -> Ip = 128
    assert tp2["tp_size"] == 2 and tp2["gemm1"]["weights"][0]["shape"] == [4, 256, 128] and tp2["served_vllm_backends"] == ["DEEPGEMM_MXFP4"]
    gdg = outputs["gpt-oss-bf16/deepgemm/fp8"]["quant_config"]
    assert gdg["served_vllm_backends"] == [] and gdg["not_served"] == {
        "DEEPGEMM_MXFP4": "DEEPGEMM_MXFP4 runs silu, swiglustep, situ only; the model uses swigluoai"}
    assert gdg["gemm1"]["biases"] == [{"name": p + "w13_bias", "dtype": "BF16", "shape": [4, 256]}]
    trt = outputs["gpt-oss-bf16/trtllm/mxfp8"]["quant_config"]  # default intermediate_align 128: I 64 -> 128, as vLLM 0.33
    assert trt["served_vllm_backends"] == ["FLASHINFER_TRTLLM_MXFP4_MXFP8"] and trt["not_served"] == {}
    assert trt["gemm1"]["scales"] == [{"name": p + "w13_weight_scale", "dtype": "F8_E4M3", "shape": [4, 256, 8]}]
    assert trt["gemm1"]["biases"] == [{"name": p + "w13_bias", "dtype": "F32", "shape": [4, 256]}]
    assert outputs["gpt-oss-bf16/trtllm/bf16"]["served_vllm_backends"] == ["FLASHINFER_TRTLLM_MXFP4_BF16"]
    t256 = outputs["gpt/trtllm-256"]["quant_config"]  # intermediate_align 256: I 64 -> 256, vLLM 0.33 128
    assert t256["served_vllm_backends"] == [] and t256["not_served"] == {"FLASHINFER_TRTLLM_MXFP4_MXFP8": (
        "vLLM pads (H, I) = (96, 64) to (256, 128) for FLASHINFER_TRTLLM_MXFP4_MXFP8; these tensors are padded to (256, 256)")}
    assert t256["gemm1"]["scales"] == [{"name": p + "w13_weight_scale", "dtype": "F8_E4M3", "shape": [4, 512, 8]}]
    assert outputs["gpt-oss-bf16/marlin/fp8"]["served_vllm_backends"] == ["MARLIN", "BATCHED_MARLIN"]
    legacy = outputs["gpt/marlin-legacy"]["quant_config"]
    assert legacy["served_vllm_backends"] == [] and legacy["not_served"]["MARLIN"] == "the layout targets vLLM >=0.10.2,<=0.11.2"
    assert outputs["gpt-oss-bf16/aiter/bf16"]["served_vllm_backends"] == ["AITER_MXFP4_BF16"]  # 256/256 for swigluoai
    assert outputs["qwen3-moe/aiter/mxfp4"]["served_vllm_backends"] == ["AITER_MXFP4_MXFP4"]
    assert outputs["gpt-oss-bf16/triton/bf16"]["served_vllm_backends"] == ["TRITON"]
    # the stored gate/up rows of a kernel output are the layout's, the canonical order stays beside them
    for key, stored in (("qwen3-moe/trtllm/bf16", "up_gate_pairs"), ("qwen3-moe/aiter/bf16", "gate_up_16row_blocks"),
                        ("qwen3-moe/marlin/bf16", None), ("qwen3-moe/mxfp4", None)):
        act = outputs[key]["quant_config"]["activation"]
        assert (act["w13_row_order"], act["w13_kernel_row_order"]) == ("halves", stored), key
    assert outputs["qwen3-moe/triton/bf16"]["quant_config"]["not_served"] == {
        "TRITON": "TRITON runs swigluoai only; the model uses silu",
        "AITER_TRITON_MXFP4_BF16": "AITER_TRITON_MXFP4_BF16 runs on ROCm only; these bytes are for sm90"}


def test_vllm_padding_table_and_compat() -> None:
    """mxfp4_round_up_hidden_size_and_intermediate_size at gpt-oss-20b sizes (H = I = 2880)."""
    want = {
        "FLASHINFER_TRTLLM_MXFP4_BF16": (3072, 2944), "MARLIN": (3072, 2944), "DEEPGEMM_MXFP4": (2944, 2944),
        "EMULATION": (2880, 2880), "TRITON": (2880, 2880), "XPU": (2880, 2880), "AITER_MXFP4_MXFP4": (3072, 2944),
        "B12X_MXFP4_BF16": (2880, 2880), "CPU": (2880, 2880), "FLASHINFER_CUTLASS_MXFP4_MXFP8": (2944, 2944),
    }
    assert {b: vllm_padded_sizes(b, 2880, 2880, "swigluoai") for b in want} == want
    assert vllm_padded_sizes("AITER_MXFP4_BF16", 2880, 2880, "swigluoai") == (3072, 3072)
    assert vllm_padded_sizes("AITER_MXFP4_BF16", 2880, 2880, "silu") == (2944, 2944)
    assert vllm_padded_sizes("TRITON", 2880, 1440, "swigluoai") == (2880, 1472) and vllm_padded_sizes("NEW_ONE", 32, 32, "silu") is None
    cases = {">=0.12": True, ">=0.10.2,<=0.11.2": False, ">=0.33": True, "0.33 (vendored triton_kernels)": True,
             "0.12-0.14 (vendored)": False, "0.20": False, "==0.33": True, "<0.33": False, "any recent": None}
    assert {spec: admits_vllm(spec) for spec in cases} == cases


def test_inspect_table_at_gpt_oss_20b_sizes_serves_trtllm_by_default() -> None:
    """``mxconv inspect``'s per-backend rows for gpt-oss-20b (E 32, H = I = 2880, 24 layers, biases):
    the default trtllm output pads I to 2944, as vLLM 0.33 does, so both TRTLLM backends hold it."""
    from mxconv.inspect import backend_table

    rows = {(r["backend"], r["activation"]): r for r in backend_table(32, 2880, 2880, "interleaved", True, 24, "swigluoai")}
    for act, vllm_backend in (("bf16", "FLASHINFER_TRTLLM_MXFP4_BF16"), ("mxfp8", "FLASHINFER_TRTLLM_MXFP4_MXFP8")):
        row = rows[("trtllm", act)]
        assert (row["padded_hidden_size"], row["padded_intermediate_size"], row["vllm_backends"]) == (3072, 2944, [vllm_backend])
        # w13 [32, 5888, 1536] + scales [32, 5888, 96] + bias f32 [32, 5888]; w2 [32, 3072, 1472] + [32, 3072, 92] + [32, 3072]
        per_layer = 32 * (5888 * (1536 + 96 + 4) + 3072 * (1472 + 92 + 4))
        assert row["expert_bytes"] == 24 * per_layer


def test_from_json_refuses_malformed(outputs: dict[str, dict[str, Any]]) -> None:
    good = outputs["qwen3-moe/deepgemm/fp8"]["quant_config"]
    for bad, msg in (
        (dict(good, tp_size="2"), "quant_config.tp_size: expected int"),
        (dict(good, block_shape=[1, 32, 1]), "quant_config.block_shape: expected a list of 2"),
        (dict(good, extra=1), "unknown field(s) ['extra']"),
        ({k: v for k, v in good.items() if k != "routing"}, "missing 1 required"),
        ([good], "not a JSON object"),
    ):
        with pytest.raises(BadInput, match=re.escape(msg)):
            EngineQuantConfig.from_json(bad)
    with pytest.raises(BadInput, match="manifest lacks required keys"):  # from_manifest takes parsed manifests only
        Manifest.parse({"kind": "kernel"}, "mxconv.json")


def test_only_mxfp4_outputs_serve_mxfp4_backends(outputs: dict[str, dict[str, Any]]) -> None:
    assert outputs["gpt-oss-bf16/trtllm/bf16"]["served_vllm_backends"] == ["FLASHINFER_TRTLLM_MXFP4_BF16"]
    m = dict(outputs["gpt-oss-bf16/trtllm/bf16"], weight_format="int4")  # e.g. a future MxInt4 trtllm output
    qc = from_manifest(Manifest.parse(m, "mxconv.json"))
    assert (qc.served_vllm_backends, qc.not_served, qc.scale_format, qc.weight_dtype) == ((), (), "bf16", "int4")


def test_inspect_prints_quant_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mxconv.cli import common as cli

    monkeypatch.setattr(cli.out, "width", 200)  # rows unwrapped
    runner = CliRunner()
    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    k = tmp_path / "k"
    m = _convert(src, k, QuantOptions(), RepackOptions("deepgemm", "fp8"))
    r = runner.invoke(app, ["inspect", str(k), "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["quant_config"] == m["quant_config"] and doc["served_vllm_backends"] == ["DEEPGEMM_MXFP4"]
    del m["quant_config"], m["served_vllm_backends"]  # a manifest written before the quant config existed
    (k / "mxconv.json").write_text(json.dumps(m))
    r = runner.invoke(app, ["inspect", str(k), "--json"])
    assert json.loads(r.stdout)["quant_config"] == doc["quant_config"]
    r = runner.invoke(app, ["inspect", str(k)])
    assert r.exit_code == 0 and "engine quant config" in r.stdout
    assert "dynamic_fp8_per_token_group (float8_e4m3fn, group [1, 128], ue8m0 scales)" in r.stdout
    assert "model.layers.{L}.mlp.experts.w13_weight_scale I32 [4, 2, 256]" in r.stdout
    r = runner.invoke(app, ["inspect", str(src), "--json"])
    rows = {(b["backend"], b["activation"]): b.get("vllm_backends") for b in json.loads(r.stdout)["backends"]}
    assert rows[("deepgemm", "fp8")] == ["DEEPGEMM_MXFP4"] and rows[("marlin", "bf16")] == ["MARLIN", "BATCHED_MARLIN"]
    # I = 96 -> 128 by default, as vLLM 0.33 pads it
    assert rows[("trtllm", "bf16")] == ["FLASHINFER_TRTLLM_MXFP4_BF16"]
    assert rows[("trtllm", "mxfp8")] == ["FLASHINFER_TRTLLM_MXFP4_MXFP8"]


def test_unpadded_cutlass_needs_whole_scale_tiles() -> None:
    """The compressed-tensors method pads nothing; its CUTLASS branch needs H and I multiples of 128."""
    from mxconv.layouts.vllm_backends import vllm_refusal

    model = {"activation": "silu", "has_expert_bias": False}
    assert vllm_refusal("CUTLASS_MXFP4_MXFP4", (256, 128, 256, 128), model, None, False) is None
    why = vllm_refusal("CUTLASS_MXFP4_MXFP4", (256, 96, 256, 96), model, None, False)
    assert why is not None and "multiples of 128; these are (256, 96)" in why
    assert vllm_refusal("MARLIN", (256, 96, 256, 96), model, None, False) is None
