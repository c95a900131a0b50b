"""Non-finite values (issue 10, item 2): NaN/Inf in biases, routers and scales and 0xFF E8M0 scale
bytes are refused by quantize/repack naming tensor and index (``--allow-nonfinite`` carries them
over); verify fails, never passes, on a non-finite reference, converted weight or output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import mxconv.mx.numerics as numerics
from mxconv.cli import app
from mxconv.mx.numerics import first_nan_scale, first_nonfinite, first_nonnumber
from mxconv.verify.reference_moe import compare
from mxconv.source.st_format import read_header, read_tensor
from mxconv.examples import ModelSizes
from support.tamper import patch_tensor
from support.workspace import copy_checkpoint, link_workspace, MadeCheckpoints

runner = CliRunner()
NAN, INF = float("nan"), float("inf")


def mx(*args: Any) -> tuple[int, str, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def patch(root: Path, name: str, fn: Callable[[torch.Tensor], None], *, fix_manifest: bool = False) -> None:
    """Change tensor ``name`` in place with ``fn``; ``fix_manifest`` keeps its sha256 right, so that
    only the value check can catch it."""

    def changed(t: torch.Tensor) -> torch.Tensor:
        fn(t)
        return t

    patch_tensor(root, name, changed, fix_manifest)


def setter(index: tuple[int, ...], value: float | int) -> Callable[[torch.Tensor], None]:
    """Set one element: an int is a raw byte (scales, whatever their dtype), a float a value."""

    def fn(t: torch.Tensor) -> None:
        if isinstance(value, int):
            t.view(torch.uint8)[index] = value
        else:
            t[index] = value

    return fn


@pytest.fixture(scope="module")
def ws(made: MadeCheckpoints, tmp_path_factory) -> Path:
    """gpt-oss bf16, qwen3 and two-layer DeepSeek FP8 sources, the MXFP4 quantizations of the first
    two and a trtllm repack of gpt-oss's."""
    gpt, qwen = made.source("gpt-oss-bf16").path, made.source("qwen3-moe").path
    gpt_q4 = made.quantize(gpt)
    return link_workspace(tmp_path_factory.mktemp("nonfinite"), {
        "gpt": gpt, "qwen": qwen, "ds": made.source("deepseek-v3-fp8", ModelSizes(num_layers=2, num_experts=4)).path,
        "gpt-q4": gpt_q4, "qwen-q4": made.quantize(qwen), "gpt-trt": made.repack(gpt_q4, "trtllm")})


# ---- quantize / repack refuse, naming tensor and index ------------------------------------------

SOURCE_CASES = [
    ("gpt", "model.layers.0.mlp.experts.gate_up_proj_bias", (1, 3), NAN, "non-finite value nan"),
    ("gpt", "model.layers.1.mlp.experts.down_proj_bias", (2, 5), -INF, "non-finite value -inf"),
    ("gpt", "model.layers.1.mlp.router.weight", (2, 5), INF, "non-finite value inf"),
    ("gpt", "model.layers.0.mlp.router.bias", (3,), NAN, "non-finite value nan"),
    ("qwen", "model.layers.1.mlp.gate.weight", (0, 7), NAN, "non-finite value nan"),
    ("gpt-q4", "model.layers.0.mlp.experts.down_proj_scales", (1, 2, 0), 0xFF, "E8M0 NaN scale byte 0xFF"),
    ("gpt-q4", "model.layers.1.mlp.experts.gate_up_proj_scales", (3, 9, 2), 0xFF, "E8M0 NaN scale byte 0xFF"),
    ("qwen-q4", "model.layers.0.mlp.experts.2.up_proj.weight_scale", (4, 1), 0xFF, "E8M0 NaN scale byte 0xFF"),
    ("ds", "model.layers.1.mlp.experts.1.up_proj.weight_scale_inv", (0, 1), NAN, "non-finite value nan"),
    ("ds", "model.layers.2.mlp.gate.e_score_correction_bias", (2,), INF, "non-finite value inf"),
]


@pytest.mark.parametrize("src, name, index, value, what", SOURCE_CASES, ids=[f"{c[0]}:{c[1].split('.', 3)[-1]}" for c in SOURCE_CASES])
def test_conversion_refuses_naming_tensor_and_index(ws: Path, tmp_path: Path, src: str, name: str, index, value, what: str) -> None:
    s = copy_checkpoint(ws / src, tmp_path / "src")
    patch(s, name, setter(index, value))
    where = f"{what} in {name} [{', '.join(map(str, index))}]"
    code, _, err = mx("quantize", s, tmp_path / "o", "--device", "cpu")
    assert code == 2 and where in err and "--allow-nonfinite" in err, err
    assert "Traceback" not in err and not (tmp_path / "o" / "mxconv.json").exists()
    if src != "ds":
        code, _, err = mx("repack", s, tmp_path / "k", "--backend", "marlin", "--device", "cpu")
        assert code == 2 and where in err, err
    code, _, err = mx("quantize", s, tmp_path / "o2", "--device", "cpu", "--allow-nonfinite", "--quiet")
    assert code == 0, err


def test_allowed_nan_scale_is_carried_over_and_then_fails_verify(ws: Path, tmp_path: Path) -> None:
    s = copy_checkpoint(ws / "gpt-q4", tmp_path / "src")
    name = "model.layers.0.mlp.experts.down_proj_scales"
    patch(s, name, setter((1, 2, 0), 0xFF))
    code, _, err = mx("quantize", s, tmp_path / "o", "--format", "mxfp8", "--device", "cpu", "--allow-nonfinite", "--quiet")
    assert code == 0, err
    index = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())["weight_map"]
    assert int(read_tensor(read_header(tmp_path / "o" / index[name])[0][name]).view(torch.uint8)[1, 2, 0]) == 0xFF
    code, _, err = mx("verify", tmp_path / "o")
    assert code == 1 and f"E8M0 NaN scale byte 0xFF in {name} [1, 2, 0]" in err


# ---- verify: never PASS on values that are not numbers ------------------------------------------


def test_verify_fails_on_a_nan_scale_in_a_canonical_output(ws: Path, tmp_path: Path) -> None:
    q = copy_checkpoint(ws / "qwen-q4", tmp_path / "q")
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    patch(q, name, setter((5, 2), 0xFF), fix_manifest=True)
    code, stdout, _ = mx("verify", q, "--json")
    rep = json.loads(stdout)
    assert code == 1 and not rep["passed"]
    layer1 = rep["layers"][1]
    assert layer1["numerics"] == "FAIL"
    assert any(f"E8M0 NaN scale byte 0xFF in {name} [5, 2]" in p for p in layer1["problems"]), layer1


def test_verify_fails_on_a_nan_scale_in_a_kernel_output(ws: Path, tmp_path: Path) -> None:
    k = copy_checkpoint(ws / "gpt-trt", tmp_path / "k")
    name = "model.layers.0.mlp.experts.w13_weight_scale"
    patch(k, name, setter((0, 0, 0), 0xFF), fix_manifest=True)
    code, _, err = mx("verify", k, "--reference", ws / "gpt-q4")
    assert code == 1 and "0xFF" in err and name in err and "PASS" not in err.replace("FAIL", "")


def test_verify_fails_on_a_nan_bias_or_router_in_the_output(ws: Path, tmp_path: Path) -> None:
    for name, index in (("model.layers.1.mlp.experts.w2_bias", (0, 4)), ("model.layers.0.mlp.router.weight", (1, 1))):
        k = copy_checkpoint(ws / "gpt-trt", tmp_path / name)
        patch(k, name, setter(index, NAN), fix_manifest=True)
        code, _, err = mx("verify", k)
        assert code == 1 and "non-finite value nan" in err and name in err, err


def test_verify_fails_on_a_nan_reference_weight(ws: Path, tmp_path: Path) -> None:
    """The bug: a NaN reference gave relative RMS 0, cosine 1 and PASS."""
    ref = copy_checkpoint(ws / "gpt", tmp_path / "ref")
    patch(ref, "model.layers.0.mlp.experts.gate_up_proj", lambda t: t[:, 0, :].fill_(NAN))
    code, stdout, _ = mx("verify", ws / "gpt-q4", "--reference", ref, "--json")
    rep = json.loads(stdout)
    assert code == 1 and not rep["passed"]
    layer0 = rep["layers"][0]
    assert layer0["numerics"] == "FAIL" and layer0["comparison"]["rel_rms"] is None
    assert any("reference output holds nan" in p for p in layer0["problems"]), layer0["problems"]
    assert rep["layers"][1]["numerics"] == "ok"


@pytest.mark.parametrize("name, index", [("model.layers.1.mlp.experts.down_proj_bias", (1, 0)), ("model.layers.1.mlp.router.bias", (0,))])
def test_verify_fails_on_a_nan_reference_bias_or_router(ws: Path, tmp_path: Path, name: str, index) -> None:
    ref = copy_checkpoint(ws / "gpt", tmp_path / "ref")
    patch(ref, name, setter(index, NAN))
    code, _, err = mx("verify", ws / "gpt-q4", "--reference", ref)
    assert code == 1 and f"the reference {ref} holds a value that is not a number" in err
    assert f"non-finite value nan in {name} [{', '.join(map(str, index))}]" in err


def test_verify_fails_on_nan_saved_reference_outputs(ws: Path, tmp_path: Path) -> None:
    saved = tmp_path / "ref.safetensors"
    code, _, err = mx("verify", ws / "qwen-q4", "--reference", ws / "qwen", "--save-reference", saved, "--quiet", "--tokens", "8")
    assert code == 0, err
    tensors = {n: read_tensor(i) for n, i in read_header(saved)[0].items()}
    meta = read_header(saved)[1]
    tensors["layer.0.output"] = tensors["layer.0.output"].clone()
    tensors["layer.0.output"][3, 2] = INF
    save_file(tensors, str(saved), metadata=meta)
    code, _, err = mx("verify", ws / "qwen-q4", "--reference-outputs", saved, "--tokens", "8")
    assert code == 1 and "reference output holds inf (token 3, channel 2)" in err


# ---- units -------------------------------------------------------------------------------------


def test_compare_never_passes_nan() -> None:
    ids = torch.tensor([[0, 1], [1, 2]])
    ref = torch.ones(2, 4)
    for out, r in ((torch.full((2, 4), NAN), ref), (ref, torch.full((2, 4), NAN)), (ref.clone().index_fill_(1, torch.tensor([2]), INF), ref)):
        c = compare(out, r, ids, ids)
        assert not c.rel_rms <= 1.0 and not c.cosine >= -1.0
        assert c.to_json()["rel_rms"] is None and c.to_json()["topk_agreement"] == 1.0
    c = compare(ref, ref, ids, ids)
    assert c.rel_rms == 0 and c.cosine == pytest.approx(1.0)


def test_scans_find_the_first_bad_element_across_chunks(monkeypatch) -> None:
    monkeypatch.setattr(numerics, "_SCAN_CHUNK", 7)
    x = torch.zeros(3, 5, 4, dtype=torch.bfloat16)
    assert first_nonfinite(x) is None
    x[2, 1, 3] = NAN
    x[2, 4, 0] = INF
    assert first_nonfinite(x) == (2, 1, 3)
    assert first_nonfinite(torch.zeros(4, dtype=torch.int32)) is None
    s = torch.full((4, 9), 127, dtype=torch.uint8)
    assert first_nan_scale(s) is None
    s[3, 8] = 0xFF
    assert first_nan_scale(s) == (3, 8)
    assert first_nan_scale(s.view(torch.float8_e8m0fnu)) == (3, 8)
    hit = first_nonnumber({"w13_scale": s, "w13_bias": x})
    assert hit == ("w13_scale", (3, 8), "E8M0 NaN scale byte 0xFF")
    assert first_nonnumber({"w13_scale": None, "w2_bias": x}) == ("w2_bias", (2, 1, 3), "non-finite value nan")


@pytest.mark.parametrize(
    "src, name, index, value, command",
    [
        ("gpt", "model.layers.1.self_attn.q_proj.weight", (3, 7), float("nan"), ("quantize",)),
        ("gpt", "model.embed_tokens.weight", (10, 2), float("-inf"), ("quantize",)),
        ("qwen", "model.norm.weight", (5,), float("inf"), ("quantize", "--format", "mxfp8")),
        ("gpt-q4", "model.layers.0.self_attn.o_proj.weight", (1, 1), float("nan"), ("repack", "--backend", "marlin", "--tp", "2")),
        ("ds", "model.layers.0.self_attn.q_a_proj.weight", (0, 3), 0x7F, ("quantize",)),  # E4M3 NaN byte
    ],
)
def test_nonfinite_in_a_copied_tensor_is_refused(ws: Path, tmp_path: Path, src: str, name: str, index: tuple[int, ...],
                                                 value: float | int, command: tuple[str, ...]) -> None:
    """Tensors copied byte for byte (attention, embeddings, norms) are scanned too: NaN/Inf never
    reaches an output that says it converted successfully."""
    d = copy_checkpoint(ws / src, tmp_path / src)
    patch(d, name, setter(index, value), fix_manifest=(d / "mxconv.json").exists())
    out = tmp_path / "out"
    code, _, err = mx(command[0], d, out, *command[1:], "--device", "cpu", "--quiet")
    assert code == 2, err
    what = "nan" if value != value or value == 0x7F else ("-inf" if value < 0 else "inf")
    assert f"non-finite value {what} in {name} {list(index)}" in err and "--allow-nonfinite" in err, err
    assert not out.exists()  # nothing left, the byte copies' finished shards included
    code, _, err = mx(command[0], d, out, *command[1:], "--device", "cpu", "--quiet", "--allow-nonfinite", "--overwrite")
    assert code == 0, err
