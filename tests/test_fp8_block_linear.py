"""``quantize --format fp8-block --targets linear``: every linear layer block FP8 beside the experts
(``weight`` E4M3 + ``weight_scale_inv`` fp32 per 128x128 tile, amax/448), ``--ignore`` as for MXFP8
linears, ``modules_to_not_convert`` naming exactly the linears left alone (vLLM's Fp8Config matches
exact names), and verify checking the linears' bytes, numerics and config claims."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.cli import mx
from support.tamper import patch_tensor
from support.workspace import MadeCheckpoints, copy_checkpoint

Q = "model.layers.0.self_attn.q_proj"
O = "model.layers.1.self_attn.o_proj"


def _tensor(ckpt: Path, name: str) -> torch.Tensor:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(ckpt / index[name]), "pt") as f:
        return f.get_tensor(name)


@pytest.fixture(scope="module")
def linear(made: MadeCheckpoints) -> tuple[Path, Path]:
    src = made.source("qwen3-moe").path
    return src, made.quantize(src, "--format", "fp8-block", "--targets", "linear", "--ignore", "o_proj")


def _tile_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This test's own block quantizer, one tile at a time: (E4M3 [N, K], scale_inv [nb, kb])."""
    w = w.float()
    N, K = w.shape
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty((-(-N // 128), -(-K // 128)))
    for i in range(0, N, 128):
        for j in range(0, K, 128):
            t = w[i : i + 128, j : j + 128]
            amax = t.abs().max()
            s[i // 128, j // 128] = amax / 448 if amax > 0 else 1.0
            q[i : i + 128, j : j + 128] = (t / s[i // 128, j // 128]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def test_linears_are_block_fp8_and_the_config_names_the_rest(linear: tuple[Path, Path]) -> None:
    src, out = linear
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    ntc = qc["modules_to_not_convert"]
    assert O in ntc and "model.layers.0.mlp.gate" in ntc and "lm_head" in ntc  # --ignore, router, lm_head
    assert not any(m.endswith(("q_proj", "k_proj", "v_proj")) for m in ntc)
    q, s = _tile_reference(_tensor(src, f"{Q}.weight"))
    got_q, got_s = _tensor(out, f"{Q}.weight"), _tensor(out, f"{Q}.weight_scale_inv")
    assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_s, s)
    assert _tensor(out, f"{O}.weight").dtype == torch.bfloat16 and torch.equal(_tensor(out, f"{O}.weight"), _tensor(src, f"{O}.weight"))
    lin = json.loads((out / "mxconv.json").read_text())["linears"]
    assert lin["format"] == "fp8-block" and lin["scale_rounding"] is None
    assert Q in lin["quantized"] and lin["left_alone"][O] == "--include/--ignore"


def test_inspect_names_the_block_rule(linear: tuple[Path, Path]) -> None:
    code, stdout, err = mx("inspect", linear[1])
    assert code == 0, err
    assert "fp8-block linears" in stdout and "6 (amax/448 per 128x128 block)" in stdout


def test_verify_checks_the_block_fp8_linears(linear: tuple[Path, Path]) -> None:
    src, out = linear
    code, stdout, err = mx("verify", out, "--reference", src, "--json")
    assert code == 0, err
    reports = {r["module"]: r for r in json.loads(stdout)["linears"]}
    assert len(reports) == 6 and all(r["bytes"] == "bit-exact" and r["numerics"] == "ok" for r in reports.values())
    assert 0.01 < reports[Q]["rel_rms"] < 0.05


def test_verify_catches_a_changed_byte(linear: tuple[Path, Path], tmp_path: Path) -> None:
    src, out = linear
    bad = copy_checkpoint(out, tmp_path / "bad")

    def bump(t: torch.Tensor) -> torch.Tensor:
        b = t.view(torch.uint8).clone()
        b[3, 5] ^= 1
        return b.view(torch.float8_e4m3fn)

    patch_tensor(bad, f"{Q}.weight", bump, fix_manifest=True)
    code, _, err = mx("verify", bad, "--reference", src)
    assert code == 1 and f"{Q}: bytes differ from the reference block-quantized again" in err


def test_verify_catches_a_config_that_leaves_a_quantized_linear_out(linear: tuple[Path, Path], tmp_path: Path) -> None:
    _, out = linear
    bad = copy_checkpoint(out, tmp_path / "cfg")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"].append(Q)
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = mx("verify", bad)
    assert code == 1
    assert f"{Q}: config.json's quantization_config describes it as not quantized, but its weight is block-FP8" in err


def test_an_mxfp8_linear_is_refused(made: MadeCheckpoints, tmp_path: Path) -> None:
    mx8 = made.quantize(made.source("qwen3-moe").path, "--format", "mxfp8", "--targets", "linear")
    code, _, err = mx("quantize", mx8, tmp_path / "o", "--format", "fp8-block", "--device", "cpu", "--quiet")
    assert code == 2 and "is MXFP8 (weight_scale U8), which a block-FP8 output's quantization_config cannot describe" in err


def test_a_merged_part_vllm_refuses_is_warned(made: MadeCheckpoints, tmp_path: Path) -> None:
    code, _, err = mx("quantize", made.source("qwen3-moe").path, tmp_path / "o", "--format", "fp8-block",
                      "--targets", "linear", "--device", "cpu", "--quiet")
    assert code == 0, err
    k = json.loads((tmp_path / "o" / "mxconv.json").read_text())
    assert "model.layers.0.self_attn.k_proj" in k["linears"]["quantized"]
    assert "model.layers.0.self_attn.k_proj is block FP8 with output size 64, not a multiple of 128" in err
    assert "self_attn.v_proj is block FP8" not in err  # the last part of a merged layer may end in a partial block
