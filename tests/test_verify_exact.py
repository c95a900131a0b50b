"""``verify --reference`` is exact against any reference it accepts, and the manifest's model claims
are checked for every output kind (issue 29, reproductions 3 and 4).

* Damage with the manifest's sha256 recomputed (so that integrity cannot see it) fails against a
  bf16 reference: a copied tensor (norm, embedding, q_proj) byte for byte; the experts (rows, signs,
  a scale byte, a bias) against the reference quantized again with the recorded options, named by
  layer, tensor and first differing index. Canonical and kernel outputs, MXFP4, MXFP8, block FP8.
* Where the bytes cannot be re-derived, the verdict says so.
* A manifest whose model claims (top_k, sizes, routing, layers, weight format, scale rounding, row
  order) disagree with config.json, the tensors or the reference fails (exit 1), also with a
  ``--reference`` whose tensors have the output's shapes (the output's damage, not a different model).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from support.cli import mx
from support.tamper import patch_tensor
from support.workspace import MadeCheckpoints, copy_checkpoint

EXPERTS = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def ws(made: MadeCheckpoints) -> dict[str, Path]:
    """bf16 sources and what mxconv makes of them (CPU)."""
    gpt, qwen = made.source("gpt-oss-bf16").path, made.source("qwen3-moe").path
    qwen_q4 = made.quantize(qwen)
    return {
        "gpt": gpt, "qwen": qwen, "qwen-q4": qwen_q4,
        "gpt-q4": made.quantize(gpt),
        "gpt-q8": made.quantize(gpt, "--format", "mxfp8"),
        "qwen-fp8": made.quantize(qwen, "--format", "fp8-block"),
        "gpt-trt": made.repack(gpt, "trtllm"),  # quantized on the way: scale rounding recorded
        "gpt-marlin-tp2": made.repack(gpt, "marlin", "--tp", "2"),
        "qwen-trt-from-q4": made.repack(qwen_q4, "trtllm"),  # MXFP4 bytes carried: re-derived through numerics.upstream
    }


def _verify(out: Path, *args: object) -> tuple[int, dict[str, Any], str]:
    code, stdout, err = mx("verify", out, "--json", "--tokens", "8", "--device", "cpu", *args)
    return code, json.loads(stdout), err


def _edit_manifest(out: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    m = json.loads((out / "mxconv.json").read_text())
    edit(m)
    (out / "mxconv.json").write_text(json.dumps(m))


# ---- exact against a float reference ------------------------------------------------------------


@pytest.mark.parametrize("out, ref", [("gpt-q4", "gpt"), ("gpt-q8", "gpt"), ("qwen-q4", "qwen"), ("qwen-fp8", "qwen"),
                                      ("gpt-trt", "gpt"), ("gpt-marlin-tp2", "gpt"), ("qwen-trt-from-q4", "qwen-q4"),
                                      ("qwen-trt-from-q4", "qwen")])
def test_undamaged_outputs_are_the_reference_byte_for_byte(ws: dict[str, Path], out: str, ref: str) -> None:
    code, rep, err = _verify(ws[out], "--reference", ws[ref])
    assert code == 0, err
    assert rep["verdict"] == f"PASS (integrity, layout, bytes and numerics vs {ws[ref]})"
    assert rep["scope"]["checked"] == ["integrity", "layout", "bytes", "numerics"]
    assert rep["scope"]["bytes_against"] == str(ws[ref])
    assert all(layer["layout"] == "bit-exact" for layer in rep["layers"])


def _rows_zeroed(t: torch.Tensor) -> torch.Tensor:
    t[1, :8] = 0  # 8 of the 128 gate_up rows of expert 1
    return t


def _signs_flipped(t: torch.Tensor) -> torch.Tensor:
    t[1, 3] ^= 0x88  # both E2M1 codes of every byte of expert 1's row 3
    return t


def _byte_up(at: tuple[int, ...], by: int = 1) -> Callable[[torch.Tensor], torch.Tensor]:
    def up(t: torch.Tensor) -> torch.Tensor:
        t.view(torch.uint8)[at] += by
        return t

    return up


GPT_BLOCKS, GPT_SCALES, GPT_BIAS = (f"{EXPERTS}.gate_up_proj_blocks", f"{EXPERTS}.gate_up_proj_scales",
                                    f"{EXPERTS}.gate_up_proj_bias")
DAMAGE = [
    # (output, reference, tensor, damage, the FAIL line (regex))
    ("gpt-q4", "gpt", "model.norm.weight", torch.zeros_like,
     r"model\.norm\.weight: not the reference's bytes"),
    ("gpt-q4", "gpt", "model.embed_tokens.weight", torch.zeros_like,
     r"model\.embed_tokens\.weight: not the reference's bytes"),
    ("gpt-trt", "gpt", "model.layers.1.self_attn.q_proj.weight", torch.zeros_like,
     r"model\.layers\.1\.self_attn\.q_proj\.weight: not the reference's bytes"),
    ("gpt-q4", "gpt", GPT_BLOCKS, _rows_zeroed,
     r"layer 0: model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks \[1, [0-7], \d+, \d+\]: the output holds E2M1 code 0x0, "
     r"the reference converted again \(mxfp4, even scale rounding\) gives 0x[1-9a-f]"),
    ("gpt-q4", "gpt", GPT_BLOCKS, _signs_flipped,
     r"layer 0: model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks \[1, 3, \d+, \d+\]: the output holds E2M1 code"),
    ("gpt-q4", "gpt", GPT_SCALES, _byte_up((1, 3, 0)),
     r"layer 0: model\.layers\.0\.mlp\.experts\.gate_up_proj_scales \[1, 3, 0\]: the output holds byte 0x[0-9a-f]{2}, "
     r"the reference converted again \(mxfp4, even scale rounding\) gives 0x[0-9a-f]{2}"),
    ("gpt-q4", "gpt", GPT_BIAS, lambda t: t * 2,
     r"layer 0: model\.layers\.0\.mlp\.experts\.gate_up_proj_bias \[0, \d+\]: the output holds .+, the reference holds"),
    ("qwen-q4", "qwen", f"{EXPERTS}.1.gate_proj.weight_packed", lambda t: t.index_fill_(0, torch.arange(8), 0),
     r"layer 0: model\.layers\.0\.mlp\.experts\.1\.gate_proj\.weight_packed \[[0-7], \d+\]: the output holds E2M1 code 0x0"),
    ("gpt-q8", "gpt", GPT_BLOCKS, _byte_up((0, 5, 1, 7)),
     r"layer 0: model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks \[0, 5, 1, 7\]: the output holds byte .+, the reference "
     r"converted again \(mxfp8, rceil scale rounding\) gives"),
    ("qwen-fp8", "qwen", f"{EXPERTS}.2.up_proj.weight", _byte_up((4, 9)),
     r"layer 0: model\.layers\.0\.mlp\.experts\.2\.up_proj\.weight \[4, 9\]: the output holds .+, the reference "
     r"block-quantized again \(fp8-block\) gives"),
    ("gpt-trt", "gpt", f"{EXPERTS}.w13_weight_scale", _byte_up((2, 0, 0)),
     r"layer 0: model\.layers\.0\.mlp\.experts\.w13_weight_scale at canonical w13_scale \[2, \d+, \d+\] \(expert, row, block\)"),
    ("gpt-trt", "gpt", f"{EXPERTS}.w13_bias", lambda t: t * 2,
     r"layer 0: model\.layers\.0\.mlp\.experts\.w13_bias at canonical w13_bias \[0, \d+\] \(expert, row\)"),
]


@pytest.mark.parametrize("out, ref, tensor, damage, line", DAMAGE,
                         ids=[f"{d[0]}-{d[2].split('.', 3)[-1]}-{i}" for i, d in enumerate(DAMAGE)])
def test_rehashed_damage_fails_against_the_float_source(ws: dict[str, Path], tmp_path: Path, out: str, ref: str,
                                                        tensor: str, damage: Callable, line: str) -> None:
    k = copy_checkpoint(ws[out], tmp_path / "k")
    patch_tensor(k, tensor, damage, fix_manifest=True)
    code, rep, err = _verify(k)
    assert code == 0, err  # integrity and layout cannot see it: the hashes were recomputed
    code, rep, err = _verify(k, "--reference", ws[ref])
    assert code == 1, err
    assert any(re.match(line, p) for p in _problems(rep)), _problems(rep)
    assert rep["verdict"].startswith("FAIL (integrity, layout, bytes and numerics vs")


def _problems(rep: dict[str, Any]) -> list[str]:
    return rep["problems"] + [p for layer in rep["layers"] for p in layer["problems"]]


def test_bytes_that_cannot_be_re_derived_are_named_in_the_verdict(ws: dict[str, Path], tmp_path: Path) -> None:
    """A repack of an MXFP4 checkpoint against its bf16 origin, with a manifest from before
    ``numerics.upstream``: no recorded rule made its bytes from bf16. The copied tensors are still
    compared; the verdict says the experts' bytes were not."""
    k, src = copy_checkpoint(ws["qwen-trt-from-q4"], tmp_path / "old"), ws["qwen"]
    _edit_manifest(k, lambda m: m["numerics"].pop("upstream"))
    code, rep, err = _verify(k, "--reference", src)
    assert code == 0, err
    why = "the output was converted from mxfp4 experts (its manifest's model), the reference holds bf16"
    assert rep["verdict"] == f"PASS (integrity, layout, numerics vs {src}; expert bytes not re-derived: {why})"
    assert rep["scope"]["not_checked"] == {"bytes": why} and "bytes" not in rep["scope"]["checked"]
    d = copy_checkpoint(k, tmp_path / "k")
    patch_tensor(d, "model.layers.0.self_attn.q_proj.weight", torch.zeros_like, fix_manifest=True)
    code, rep, err = _verify(d, "--reference", src)
    assert code == 1 and "model.layers.0.self_attn.q_proj.weight: not the reference's bytes" in err


def test_an_edited_expert_format_does_not_turn_off_the_exact_check(ws: dict[str, Path], tmp_path: Path) -> None:
    """Issue 29 item 6: a scale byte +5 (rehashed) and ``model.expert_format`` edited to the output's
    own format: against the output's own source (same fingerprint) the format disagreement is the
    output's damage (exit 1), also with ``numerics.source_format`` edited to match; without a
    reference ``numerics.source_format`` contradicts it."""
    q = copy_checkpoint(ws["gpt-q4"], tmp_path / "q")
    patch_tensor(q, GPT_SCALES, _byte_up((0, 0, 0), 5), fix_manifest=True)
    _edit_manifest(q, lambda m: m["model"].update(expert_format="mxfp4"))
    code, rep, err = _verify(q)
    assert code == 1, err
    assert ("manifest model.expert_format is 'mxfp4', but its numerics.source_format gives 'bf16'" in _problems(rep))
    code, rep, err = _verify(q, "--reference", ws["gpt"])
    assert code == 1, err
    _edit_manifest(q, lambda m: m["numerics"].update(source_format="mxfp4"))
    code, rep, err = _verify(q, "--reference", ws["gpt"])
    assert code == 1, err
    assert any(p.startswith(f"manifest model.expert_format is 'mxfp4', but the reference {ws['gpt']}, this output's "
                            "source (the fingerprint its manifest records), holds bf16 experts") for p in _problems(rep))


def test_bytes_not_re_derived_are_said_under_quiet_and_fail_strict(ws: dict[str, Path], tmp_path: Path) -> None:
    k, src = ws["qwen-trt-from-q4"], ws["qwen"]
    old = copy_checkpoint(k, tmp_path / "old")  # a manifest from before numerics.upstream
    _edit_manifest(old, lambda m: m["numerics"].pop("upstream"))
    code, stdout, err = mx("verify", old, "--reference", src, "--quiet", "--tokens", "8", "--device", "cpu")
    assert code == 0, err
    assert "expert bytes not re-derived: the output was converted from mxfp4 experts" in err
    code, stdout, err = mx("verify", old, "--reference", src, "--strict", "--quiet", "--tokens", "8", "--device", "cpu")
    assert code == 1, err
    assert "--strict: expert bytes not re-derived (the output was converted from mxfp4 experts" in err


def _head_zeroed(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).view(-1)[:64] = 0
    return t


@pytest.mark.parametrize("tensor, damage", [(f"{EXPERTS}.w13_weight_scale", _byte_up((0, 0, 0), 5)),
                                            (f"{EXPERTS}.w13_weight", _head_zeroed)], ids=["scale+5", "w13-head-zeroed"])
def test_a_repack_of_a_quantize_output_is_exact_against_the_first_source(ws: dict[str, Path], tmp_path: Path,
                                                                        tensor: str, damage: Callable) -> None:
    """Issue 29 item 7: ``quantize src q`` then ``repack q k``: k's manifest carries q's rounding and
    source format (``numerics.upstream``), so ``verify k --reference src`` re-derives bf16 -> MXFP4 with
    it and compares the canonical bytes the layout gives back; rehashed damage fails."""
    k = ws["qwen-trt-from-q4"]
    up = json.loads((k / "mxconv.json").read_text())["numerics"]["upstream"]
    q = json.loads((ws["qwen-q4"] / "mxconv.json").read_text())
    assert up == {"source_format": "bf16", "weight_format": "mxfp4", "scale_rounding": q["scale_rounding"],
                  "fingerprint": q["source"]["fingerprint"]}
    d = copy_checkpoint(k, tmp_path / "k")
    patch_tensor(d, tensor, damage, fix_manifest=True)
    code, rep, err = _verify(d, "--reference", ws["qwen"])
    assert code == 1, err
    assert any(re.match(rf"layer 0: {re.escape(tensor)} at canonical w13(_scale)? \[0, .+: the output holds .+, the "
                        r"reference converted again \(mxfp4, even scale rounding upstream\) gives", p)
               for p in _problems(rep)), _problems(rep)


def test_an_upstream_whose_source_is_the_reference_must_name_its_format(ws: dict[str, Path], tmp_path: Path) -> None:
    k = copy_checkpoint(ws["qwen-trt-from-q4"], tmp_path / "k")
    _edit_manifest(k, lambda m: m["numerics"]["upstream"].update(source_format="fp16"))
    code, rep, err = _verify(k, "--reference", ws["qwen"])
    assert code == 1, err
    assert any(p.startswith(f"manifest numerics.upstream.source_format is 'fp16', but the reference {ws['qwen']}, "
                            "the source of this output's input") for p in _problems(rep)), _problems(rep)


# ---- manifest claims ------------------------------------------------------------------------------


def test_kernel_output_manifest_top_k_edit_fails_with_and_without_reference(ws: dict[str, Path], tmp_path: Path) -> None:
    k = copy_checkpoint(ws["qwen-trt-from-q4"], tmp_path / "k")
    _edit_manifest(k, lambda m: m["model"].update(top_k=3))
    code, rep, err = _verify(k)
    assert code == 1, err
    assert f"manifest model.top_k is 3, but {k / 'config.json'} gives 2" in _problems(rep)
    code, rep, err = _verify(k, "--reference", ws["qwen"])
    assert code == 1 and "a different model" not in err
    assert any(p.startswith(f"manifest model.top_k is 3, but the reference {ws['qwen']}") for p in _problems(rep))
    assert "numerics not checked: they would run on the manifest's model, which the output contradicts" in rep["verdict"]


@pytest.mark.parametrize("field, value", [("hidden_size", 128), ("num_experts", 8), ("num_layers", 3),
                                          ("norm_topk_prob", False), ("intermediate_size", 64)])
def test_kernel_output_model_edit_is_the_outputs_damage_not_a_different_reference(ws: dict[str, Path], tmp_path: Path,
                                                                                  field: str, value: Any) -> None:
    k = copy_checkpoint(ws["qwen-trt-from-q4"], tmp_path / "k")
    _edit_manifest(k, lambda m: m["model"].update({field: value}))
    code, rep, err = _verify(k)
    assert code == 1, err
    code, rep, err = _verify(k, "--reference", ws["qwen-q4"])
    assert code == 1, err
    assert "a different model" not in err
    assert any(p.startswith(f"manifest model.{field} is {value!r}, but the reference") for p in _problems(rep))


def test_kernel_output_config_json_edit_fails(ws: dict[str, Path], tmp_path: Path) -> None:
    k = copy_checkpoint(ws["gpt-trt"], tmp_path / "k")
    cfg = json.loads((k / "config.json").read_text())
    cfg["num_experts_per_tok"] = 3
    (k / "config.json").write_text(json.dumps(cfg))
    code, rep, err = _verify(k)
    assert code == 1 and f"manifest model.top_k is 2, but {k / 'config.json'} gives 3" in _problems(rep), err


def test_kernel_output_quant_config_and_layers_table_edits_fail(ws: dict[str, Path], tmp_path: Path) -> None:
    k = copy_checkpoint(ws["gpt-trt"], tmp_path / "k")
    _edit_manifest(k, lambda m: m["quant_config"]["routing"].update(top_k=4))
    code, rep, err = _verify(k)
    assert code == 1 and "manifest quant_config.routing.top_k is 4, but the manifest's model gives 2" in _problems(rep), err
    k = copy_checkpoint(ws["gpt-trt"], tmp_path / "k2")
    _edit_manifest(k, lambda m: m.update(layers=m["layers"][:1]))
    code, rep, err = _verify(k)
    assert code == 1, err
    assert ("model.layers.1.mlp.experts: kernel expert tensors of a layer the manifest's layers do not list"
            in _problems(rep))


@pytest.mark.parametrize("edit, without_reference", [
    (lambda m: m.update(weight_format="mxfp8"), True),
    (lambda m: m["layout"].update(w13_row_order="halves"), True),
    (lambda m: m.update(scale_rounding=None), True),
    (lambda m: m.update(scale_rounding="floor"), False),  # no file but the manifest records the rule
    (lambda m: m.update(scale_rounding="rceil"), False),
], ids=["weight_format", "w13_row_order", "scale_rounding-null", "scale_rounding-floor", "scale_rounding-rceil"])
def test_quantize_output_option_edits_fail_with_the_reference(ws: dict[str, Path], tmp_path: Path, edit: Callable,
                                                              without_reference: bool) -> None:
    q = copy_checkpoint(ws["gpt-q4"], tmp_path / "q")
    _edit_manifest(q, edit)
    code, rep, err = _verify(q)
    assert code == (1 if without_reference else 0), err
    code, rep, err = _verify(q, "--reference", ws["gpt"])
    assert code == 1, err


SERVED_EDITS = [
    (lambda m: m.update(served_vllm_backends=[*m["served_vllm_backends"], "MARLIN"]), "manifest served_vllm_backends"),
    (lambda m: m["served_vllm_methods"].update(Mxfp4MoEMethod=["MARLIN"]), "manifest served_vllm_methods"),
    (lambda m: m["quant_config"].update(served_vllm_backends=[]), "manifest quant_config.served_vllm_backends"),
    (lambda m: m["quant_config"].update(served_vllm_methods={}), "manifest quant_config.served_vllm_methods"),
]


@pytest.mark.parametrize("edit, field", SERVED_EDITS, ids=[f for _, f in SERVED_EDITS])
def test_edited_served_lists_fail(ws: dict[str, Path], tmp_path: Path, edit: Callable, field: str) -> None:
    """Issue 29 item 7: the served lists are derived again by the one rule (vllm_serving) and compared."""
    k = copy_checkpoint(ws["gpt-trt"], tmp_path / "k")
    assert json.loads((k / "mxconv.json").read_text())["served_vllm_backends"]  # trtllm bf16: vLLM serves it
    _edit_manifest(k, edit)
    code, rep, err = _verify(k)
    assert code == 1, err
    assert any(p.startswith(f"{field} is ") and "but the vLLM serving rule (mxconv.layouts.vllm_serving) gives" in p
               for p in _problems(rep)), _problems(rep)


@pytest.mark.parametrize("edit, line", [
    (lambda m: m["numerics"].update(rounding="rtz"),
     "manifest numerics.rounding is 'rtz', but the manifest's weight_format and model give 'rne'"),
    (lambda m: m["numerics"].update(element_format="e4m3"),
     "manifest numerics.element_format is 'e4m3', but the manifest's weight_format and model give 'e2m1'"),
], ids=["rounding", "element_format"])
def test_edited_numerics_fail(ws: dict[str, Path], tmp_path: Path, edit: Callable, line: str) -> None:
    q = copy_checkpoint(ws["gpt-q4"], tmp_path / "q")
    _edit_manifest(q, edit)
    code, rep, err = _verify(q)
    assert code == 1 and line in _problems(rep), err


def test_edited_requantized_fails_against_the_source(ws: dict[str, Path], tmp_path: Path) -> None:
    """numerics.requantized depends on the source layers' formats: derived where the reference is the source."""
    q = copy_checkpoint(ws["gpt-q4"], tmp_path / "q")
    _edit_manifest(q, lambda m: m["numerics"].update(requantized=True))
    code, rep, err = _verify(q, "--reference", ws["gpt"])
    assert code == 1, err
    assert (f"manifest numerics.requantized is True, but converting the reference {ws['gpt']} (this output's source) "
            "gives False") in _problems(rep)


def test_an_unknown_scale_rounding_is_the_outputs_damage(ws: dict[str, Path], tmp_path: Path) -> None:
    """Not a CLI flag's message blaming the reference: the output's manifest breaks its schema (exit 1)."""
    q = copy_checkpoint(ws["gpt-q4"], tmp_path / "q")
    _edit_manifest(q, lambda m: m.update(scale_rounding="up"))
    for args in ((), ("--reference", ws["gpt"])):
        code, rep, err = _verify(q, *args)
        assert code == 1, err
        assert f"{q / 'mxconv.json'}: malformed manifest: field 'scale_rounding' must be" in err and '"up"' in err
        assert "--scale-rounding" not in err and "reference" not in " ".join(_problems(rep))


def test_a_reference_of_other_shapes_is_still_a_different_model(ws: dict[str, Path]) -> None:
    code, _, err = mx("verify", ws["gpt-trt"], "--reference", ws["qwen"], "--device", "cpu")
    assert code == 2 and "a different model" in err and "pass the checkpoint this one was converted from" in err


# ---- the exact check on the GPU (the coordinator runs -m gpu on the device) -------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("out", ["gpt-q4", "gpt-q8", "qwen-fp8", "gpt-trt", "gpt-marlin-tp2", "qwen-trt-from-q4"])
def test_cpu_made_outputs_are_exact_when_verify_re_derives_on_cuda(ws: dict[str, Path], tmp_path: Path, out: str) -> None:
    """Conversion on the CPU (torch quantizer), verify on the GPU (Triton quantizer): the same bytes."""
    ref = ws["qwen" if out.startswith("qwen") else "gpt"]
    code, stdout, err = mx("verify", ws[out], "--reference", ref, "--json", "--tokens", "8", "--device", "cuda")
    assert code == 0, err
    assert json.loads(stdout)["verdict"] == f"PASS (integrity, layout, bytes and numerics vs {ref})"
    if out == "gpt-q4":
        k = copy_checkpoint(ws[out], tmp_path / "k")
        patch_tensor(k, GPT_SCALES, _byte_up((1, 3, 0)), fix_manifest=True)
        code, stdout, err = mx("verify", k, "--reference", ref, "--json", "--tokens", "8", "--device", "cuda")
        assert code == 1 and f"{GPT_SCALES} [1, 3, 0]: the output holds byte" in err
