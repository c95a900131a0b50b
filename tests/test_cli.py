"""End-to-end through the CLI: exit codes, outputs, bad inputs, and verify catching real corruption."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mxconv.layouts import backend_names
import torch

from mxconv.source.st_format import read_header, read_tensor
from support.checkpoints import make_checkpoint
from support.cli import mx
from support.tamper import patch_tensor
from support.workspace import copy_checkpoint, link_workspace, MadeCheckpoints


@pytest.fixture(scope="module")
def ws(made: MadeCheckpoints, tmp_path_factory) -> Path:
    """gpt-oss bf16 + qwen3 sources, their MXFP4 quantizations and a trtllm repack of each."""
    checkpoints = {}
    for name, kind in (("gpt", "gpt-oss-bf16"), ("qwen", "qwen3-moe")):
        src = made.source(kind).path
        q4 = made.quantize(src)
        checkpoints |= {name: src, f"{name}-q4": q4, f"{name}-trt": made.repack(q4, "trtllm")}
    return link_workspace(tmp_path_factory.mktemp("cli"), checkpoints)


# ---- happy paths --------------------------------------------------------------------------------


def test_help_teaches() -> None:
    code, out, _ = mx("--help")
    assert code == 0
    for cmd in ("quantize", "repack", "verify", "inspect", "demo"):
        assert cmd in out
    code, out, _ = mx("repack", "--help")
    assert code == 0 and "--backend" in out and "--tp" in out and "Example" in out


def test_repack_help_names_the_engines_of_each_trtllm_alignment() -> None:
    code, out, _ = mx("repack", "--help")
    text = " ".join(out.split()).replace("- ", "-")  # rich wraps the help text, at hyphens too
    assert code == 0 and "trtllm: intermediate_align=int (default 128)" in text
    assert "128 is what vLLM >= 0.27 (0.33 included) allocates for FLASHINFER_TRTLLM_MXFP4_*" in text
    assert "256 is what vLLM 0.10.2-0.26 and SGLang's FlashInfer MXFP4 MoE allocate" in text
    assert "later snapshot" not in text


def test_inspect_json(ws: Path) -> None:
    code, out, _ = mx("inspect", ws / "gpt", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["family"] == "gpt-oss" and doc["kind"] == "canonical"
    assert doc["model"]["row_order"] == "interleaved" and doc["model"]["expert_format"] == "bf16"
    trt = [b for b in doc["backends"] if b["backend"] == "trtllm"][0]
    assert (trt["padded_hidden_size"], trt["padded_intermediate_size"]) == (256, 128)  # I = 64 -> 128, as vLLM 0.33
    assert trt["vllm_backends"] == ["FLASHINFER_TRTLLM_MXFP4_BF16"]
    code, out, _ = mx("inspect", ws / "gpt-trt", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["kind"] == "kernel" and doc["manifest"]["backend"] == "trtllm"


def test_quantize_output_contract(ws: Path) -> None:
    q = ws / "gpt-q4"
    m = json.loads((q / "mxconv.json").read_text())
    for key in ("format_version", "tool_version", "command", "created", "source", "family", "kind", "weight_format",
                "scale_rounding", "backend", "activation", "tp_size", "layout", "tensors"):
        assert key in m
    assert m["kind"] == "canonical" and m["weight_format"] == "mxfp4" and m["scale_rounding"] == "even"  # the MXFP4 default (docs/numerics.md)
    assert m["layout"]["w13_row_order"] == "interleaved"
    assert m["layout"]["kernel_params"] == {"gemm1_alpha": 1.702, "gemm1_beta": 1.0, "gemm1_clamp_limit": 7.0}
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert (q / "tokenizer.json").read_bytes() == (ws / "gpt" / "tokenizer.json").read_bytes()
    names = json.loads((q / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    assert set(names) == set(m["tensors"])
    # non-expert tensors copied byte for byte
    src_index = json.loads((ws / "gpt" / "model.safetensors.index.json").read_text())["weight_map"]
    for n in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.router.weight"):
        a = read_tensor(read_header(ws / "gpt" / src_index[n])[0][n])
        b = read_tensor(read_header(q / names[n])[0][n])
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not (q / ".mxconv-in-progress").exists()


def test_repack_output_contract(ws: Path) -> None:
    k = ws / "qwen-trt"
    m = json.loads((k / "mxconv.json").read_text())
    assert m["kind"] == "kernel" and m["backend"] == "trtllm" and m["activation"] == "bf16"
    assert m["scale_rounding"] is None  # MXFP4 source: bytes moved, not re-quantized
    assert m["layout"]["padded_hidden_size"] == 256 and m["layout"]["hidden_size"] == 160
    assert m["layout"]["kernel_params"] is None
    t = m["tensors"]["model.layers.0.mlp.experts.w13_weight"]
    assert t["dtype"] == "U8" and t["shape"] == [4, 256, 128] and t["role"] == "expert"  # 2Ip, Ip = roundup(96, 128)
    assert m["tensors"]["model.layers.0.mlp.experts.w13_weight_scale"]["dtype"] == "F8_E4M3"
    assert "model.layers.0.mlp.experts.w13_bias" not in m["tensors"]


@pytest.mark.parametrize("backend, act", [("trtllm", "mxfp8"), ("marlin", "bf16"), ("marlin", "fp8"), ("aiter", "bf16"), ("aiter", "mxfp4")])
@pytest.mark.parametrize("src", ["gpt", "qwen"])
def test_every_backend_verifies_bit_exact(ws: Path, tmp_path: Path, src: str, backend: str, act: str) -> None:
    out = tmp_path / "k"
    code, _, err = mx("repack", ws / f"{src}-q4", out, "--backend", backend, "--activation", act, "--quiet")
    assert code == 0, err
    code, out_json, err = mx("verify", out, "--reference", ws / f"{src}-q4", "--json", "--tokens", "16")
    rep = json.loads(out_json)
    assert code == 0, rep
    assert all(layer["layout"] == "bit-exact" for layer in rep["layers"])
    assert all(layer["comparison"]["rel_rms"] == 0 for layer in rep["layers"])


def test_repack_from_bf16_tp2_and_verify_against_bf16(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp2"
    code, _, err = mx("repack", ws / "gpt", out, "--backend", "marlin", "--tp", "2", "--quiet")
    assert code == 0, err
    assert (out / "rank-0" / "model.safetensors.index.json").exists() and (out / "rank-1" / "config.json").exists()
    m = json.loads((out / "mxconv.json").read_text())
    assert m["tp_size"] == 2 and m["scale_rounding"] == "even"
    assert any(k.startswith("rank-1/") for k in m["tensors"])
    code, out_json, _ = mx("verify", out, "--reference", ws / "gpt", "--json", "--tokens", "16")
    rep = json.loads(out_json)
    assert code == 0, rep
    assert all(layer["threshold"] == "mxfp4" for layer in rep["layers"])
    code, stdout, err = mx("inspect", out, "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["kind"] == "kernel" and doc["model"]["expert_format"] == "mxfp4" and doc["model"]["padded_hidden_size"] == 256


def test_save_and_reuse_reference_outputs(ws: Path, tmp_path: Path) -> None:
    ref = tmp_path / "ref.safetensors"
    code, _, err = mx("verify", ws / "qwen-q4", "--reference", ws / "qwen", "--save-reference", ref, "--quiet")
    assert code == 0, err
    assert ref.exists()
    code, out, _ = mx("verify", ws / "qwen-q4", "--reference-outputs", ref, "--json")
    rep = json.loads(out)
    assert code == 0 and all(layer["numerics"] == "ok" for layer in rep["layers"])
    code, _, err = mx("verify", ws / "qwen-q4", "--reference-outputs", ref, "--seed", "5")
    assert code == 2 and "--seed 0" in err


def test_dry_run_writes_nothing(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "dry"
    code, stdout, _ = mx("repack", ws / "gpt", out, "--backend", "aiter", "--dry-run", "--json")
    assert code == 0 and not out.exists()
    doc = json.loads(stdout)
    assert doc["dry_run"] and doc["sizes"]["padded_hidden_size"] == 256
    assert any(t["name"] == "model.layers.1.mlp.experts.w2_weight" for t in doc["tensors"])


def test_mxfp4_to_mxfp8_is_lossless(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "q8"
    code, stdout, err = mx("quantize", ws / "gpt-q4", out, "--format", "mxfp8", "--json")
    assert code == 0, err
    assert json.loads(stdout)["quantized_tensors"] == 0  # nothing re-quantized
    code, stdout, _ = mx("verify", out, "--reference", ws / "gpt-q4", "--json", "--tokens", "16")
    rep = json.loads(stdout)
    assert code == 0 and all(layer["threshold"] == "exact" and layer["comparison"]["rel_rms"] == 0 for layer in rep["layers"])


@pytest.mark.parametrize("fmt, rule", [("mxfp4", "even"), ("mxfp8", "rceil")])
def test_default_scale_rule_is_chosen_per_format(ws: Path, tmp_path: Path, fmt: str, rule: str) -> None:
    """--scale-rounding auto (the default) writes the same bytes as the format's measured-best rule."""
    outs = {}
    for name, extra in (("auto", ()), ("explicit", ("--scale-rounding", rule))):
        outs[name] = tmp_path / name
        code, _, err = mx("quantize", ws / "qwen", outs[name], "--format", fmt, "--quiet", "--device", "cpu", *extra)
        assert code == 0, err
    m = json.loads((outs["auto"] / "mxconv.json").read_text())
    assert m["scale_rounding"] == rule
    explicit = json.loads((outs["explicit"] / "mxconv.json").read_text())
    assert {k: v["sha256"] for k, v in m["tensors"].items()} == {k: v["sha256"] for k, v in explicit["tensors"].items()}
    other = "rceil" if rule == "even" else "even"
    code, _, err = mx("quantize", ws / "qwen", tmp_path / "other", "--format", fmt, "--quiet", "--device", "cpu", "--scale-rounding", other)
    assert code == 0, err
    differ = json.loads((tmp_path / "other" / "mxconv.json").read_text())
    assert any(v["sha256"] != m["tensors"][k]["sha256"] for k, v in differ["tensors"].items() if v["role"] == "expert")


def test_verify_device_flag(ws: Path) -> None:
    """--device cpu runs the reference on the CPU and passes; an unknown device is a usage error (2)."""
    code, out, err = mx("verify", ws / "qwen-trt", "--reference", ws / "qwen", "--device", "cpu", "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["layers"] and all(layer["numerics"] == "ok" and layer["passed"] for layer in rep["layers"])
    code, _, err = mx("verify", ws / "qwen-trt", "--device", "tpu9")
    assert code == 2 and "tpu9" in err


# ---- verify catches corruption ------------------------------------------------------------------

W13 = "model.layers.0.mlp.experts.w13_weight"


def test_verify_fails_on_flipped_byte(ws: Path, tmp_path: Path) -> None:
    k = copy_checkpoint(ws / "qwen-trt", tmp_path / "k")
    patch_tensor(k, W13, lambda t: t.flatten().index_put_((torch.tensor([5]),), t.flatten()[5] ^ 0x10).view_as(t), fix_manifest=False)
    code, _, err = mx("verify", k)
    assert code == 1 and "sha256 mismatch" in err


def test_verify_fails_on_swapped_experts(ws: Path, tmp_path: Path) -> None:
    k = copy_checkpoint(ws / "gpt-trt", tmp_path / "k")
    patch_tensor(k, W13, lambda t: t[[1, 0, 2, 3]], fix_manifest=True)
    code, out, _ = mx("verify", k, "--reference", ws / "gpt-q4", "--json")
    rep = json.loads(out)
    assert code == 1
    layer0 = rep["layers"][0]
    assert layer0["layout"] == "FAIL" and "first difference at expert 0" in " ".join(layer0["problems"])
    assert layer0["numerics"] == "FAIL"


def test_verify_says_what_a_pass_covers_and_strict_demands_numerics(ws: Path, tmp_path: Path) -> None:
    """Swapped experts with the manifest hashes recomputed are consistently wrong: integrity and
    layout cannot see it. Without a reference the verdict says numerics were not checked; --strict
    fails such a run; with the reference the numerics catch it."""
    k = copy_checkpoint(ws / "gpt-trt", tmp_path / "k")
    patch_tensor(k, W13, lambda t: t[[1, 0, 2, 3]], fix_manifest=True)
    code, out, err = mx("verify", k)
    assert code == 0, err
    verdict = "PASS (integrity, layout; numerics not checked: no --reference or --reference-outputs given)"
    assert out.strip().splitlines()[-1] == verdict
    code, out, err = mx("verify", k, "--json")
    rep = json.loads(out)
    assert code == 0 and rep["verdict"] == verdict
    assert rep["scope"]["checked"] == ["integrity", "layout"]
    assert rep["scope"]["not_checked"] == {"numerics": "no --reference or --reference-outputs given"}
    code, out, err = mx("verify", k, "--strict")
    assert code == 1
    assert out.strip().splitlines()[-1] == "FAIL " + verdict.removeprefix("PASS ")
    assert ("FAIL --strict: numerics not checked (no --reference or --reference-outputs given); --reference SOURCE "
            "(the checkpoint this one was converted from) or --reference-outputs FILE checks them") in err
    code, out, _ = mx("verify", k, "--strict", "--reference", ws / "gpt-q4", "--layers", "1")
    assert code == 0 and out.strip().splitlines()[-1] == (
        f"PASS (integrity, layout, bytes and numerics vs {ws / 'gpt-q4'}; layout, bytes, numerics of layers 1 only)")
    code, out, err = mx("verify", k, "--strict", "--reference", ws / "gpt-q4")
    assert code == 1 and out.strip().splitlines()[-1] == f"FAIL (integrity, layout, bytes and numerics vs {ws / 'gpt-q4'})"


def test_verify_help_teaches_strict() -> None:
    code, out, _ = mx("verify", "--help")
    assert code == 0 and "--strict" in out and "numerics not checked" in " ".join(out.split())


def test_verify_fails_on_swapped_gate_up(ws: Path, tmp_path: Path) -> None:
    # kernel row 32b + 16h + 8t + c holds up (t=0) / gate (t=1): swap the two 8-row groups everywhere
    def swap(t: torch.Tensor) -> torch.Tensor:
        v = t.view(t.shape[0], -1, 2, 2, 8, t.shape[-1])
        return v.flip(3).reshape(t.shape).contiguous()

    k = copy_checkpoint(ws / "qwen-trt", tmp_path / "k")
    patch_tensor(k, W13, swap, fix_manifest=True)
    code, out, _ = mx("verify", k, "--reference", ws / "qwen", "--json")
    rep = json.loads(out)
    assert code == 1 and rep["layers"][0]["numerics"] == "FAIL"
    assert rep["layers"][0]["comparison"]["rel_rms"] > 0.5


def test_verify_fails_on_nonzero_padding(ws: Path, tmp_path: Path) -> None:
    k = copy_checkpoint(ws / "qwen-trt", tmp_path / "k")  # H = 160 -> 256: w2 kernel rows 192..255 are padding

    def poke(t: torch.Tensor) -> torch.Tensor:
        t[0, 200, 3] = 0x11
        return t

    patch_tensor(k, "model.layers.0.mlp.experts.w2_weight", poke, fix_manifest=True)
    code, out, _ = mx("verify", k, "--json")
    rep = json.loads(out)
    assert code == 1 and rep["layers"][0]["layout"] == "FAIL"
    assert "padding of w2_weight" in " ".join(rep["layers"][0]["problems"])


def test_verify_fails_when_manifest_lies_about_backend(ws: Path, tmp_path: Path) -> None:
    k = copy_checkpoint(ws / "qwen-trt", tmp_path / "k")
    m = json.loads((k / "mxconv.json").read_text())
    m["backend"] = "marlin"
    (k / "mxconv.json").write_text(json.dumps(m))
    code, _, err = mx("verify", k)
    assert code == 1 and "not a valid marlin layout" in err


# ---- bad input: exit 2 with a clear message -----------------------------------------------------


def test_bad_inputs(ws: Path, tmp_path: Path) -> None:
    code, _, err = mx("quantize", ws / "gpt", ws / "gpt" / "out")
    assert code == 2 and "is the SOURCE or inside it" in err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    code, _, err = mx("quantize", ws / "gpt", busy)
    assert code == 2 and "--overwrite" in err
    code, _, err = mx("repack", ws / "gpt-q4", tmp_path / "o", "--backend", "tpu")
    assert code == 2 and "'tpu' is not one of" in err and all(f"'{b}'" in err for b in backend_names())
    code, _, err = mx("repack", ws / "gpt-trt", tmp_path / "o2", "--backend", "marlin")
    assert code == 2 and "already a kernel-layout checkpoint" in err
    code, _, err = mx("repack", ws / "gpt-q4", tmp_path / "o3", "--backend", "trtllm", "--activation", "fp8")
    assert code == 2 and "choose one of bf16, mxfp8" in err
    code, _, err = mx("inspect", tmp_path / "nothing-here")
    assert code == 2 and "no such directory" in err
    code, _, err = mx("verify", ws / "gpt")
    assert code == 2 and "no mxconv.json" in err
    code, _, err = mx("verify", ws / "gpt-trt", "--layers", ",")
    assert code == 2 and "names no layer" in err
    code, _, err = mx("verify", ws / "gpt-trt", "--reference", ws / "qwen")
    assert code == 2 and "a different model" in err
    code, _, err = mx("quantize", ws / "gpt", ws / "gpt" / "inside", "--dry-run")
    assert code == 2 and "is the SOURCE or inside it" in err
    code, _, err = mx("quantize", ws / "gpt", tmp_path / "o4", "--max-shard-size", "nan")
    assert code == 2 and "at least one byte" in err
    code, _, err = mx("repack", ws / "gpt-q4", tmp_path / "o5", "--backend", "trtllm", "--marlin-scale-layout", "legacy")
    assert code == 2 and "applies to --backend marlin only" in err
    assert "Traceback" not in err


def test_repack_refuses_a_rank_dir_of_a_kernel_output(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp"
    code, _, err = mx("repack", ws / "qwen-q4", out, "--backend", "aiter", "--tp", "2", "--quiet")
    assert code == 0, err
    code, _, err = mx("repack", out / "rank-0", tmp_path / "again", "--backend", "trtllm")
    assert code == 2 and "already a kernel-layout checkpoint (backend aiter)" in err


def test_unknown_family_lists_supported(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "m", "mixtral").path
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    code, _, err = mx("inspect", src)
    assert code == 2 and "unknown model family" in err and "gpt-oss" in err and "Mixtral" in err


def test_nonfinite_refused_then_allowed(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "s", "qwen3-moe").path
    name = "model.layers.1.mlp.experts.2.up_proj.weight"

    def nan(t: torch.Tensor) -> torch.Tensor:
        t[3, 7] = float("nan")
        return t

    patch_tensor(src, name, nan, fix_manifest=False)
    code, _, err = mx("quantize", src, tmp_path / "o")
    assert code == 2 and "non-finite value nan in model.layers.1.mlp.experts.2.up_proj.weight [3, 7]" in err
    assert not (tmp_path / "o" / "mxconv.json").exists()
    code, _, err = mx("quantize", src, tmp_path / "o", "--allow-nonfinite", "--quiet")
    assert code == 0, err


def test_nonfinite_named_in_gpt_oss_source_coordinates(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "s", "gpt-oss-bf16").path
    name = "model.layers.0.mlp.experts.down_proj"  # stored [E, I, H] (in x out)

    def inf(t: torch.Tensor) -> torch.Tensor:
        t[1, 5, 9] = float("inf")
        return t

    patch_tensor(src, name, inf, fix_manifest=False)
    code, _, err = mx("quantize", src, tmp_path / "o")
    assert code == 2 and "non-finite value inf in model.layers.0.mlp.experts.down_proj [1, 5, 9]" in err, err


def test_kill_mid_write_then_rerun(ws: Path, tmp_path: Path) -> None:
    """SIGKILL while a shard is being written: no manifest, temp names only; a rerun completes."""
    out = tmp_path / "killed"
    script = f"""
import os, signal, sys
import mxconv.output.writer as w
orig = w.ShardedWriter.write_tensor
count = [0]
def killer(self, name, tensor):
    count[0] += 1
    if count[0] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return orig(self, name, tensor)
w.ShardedWriter.write_tensor = killer
from mxconv.cli import app
sys.argv = ["mxconv", "quantize", {str(ws / 'qwen')!r}, {str(out)!r}, "--max-shard-size", "20kB", "--quiet"]
app()
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert r.returncode == -signal.SIGKILL
    names = {p.name for p in out.iterdir()}
    assert "mxconv.json" not in names and "model.safetensors.index.json" not in names
    assert ".mxconv-in-progress" in names
    assert any(n.endswith(".mxconv-tmp") for n in names)
    code, _, err = mx("quantize", ws / "qwen", out, "--max-shard-size", "20kB", "--quiet")
    assert code == 0, err
    assert not any(p.name.endswith(".mxconv-tmp") for p in out.iterdir())
    code, _, err = mx("verify", out, "--reference", ws / "qwen")
    assert code == 0, err


def test_hub_repo_id_from_local_cache(ws: Path, tmp_path: Path, monkeypatch) -> None:
    from support.hub import make_hub_cache

    cache = tmp_path / "hub"
    make_hub_cache(cache, "acme/tiny-moe", ws / "qwen")
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "mxconv.cli", "inspect", "acme/tiny-moe", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["family"] == "qwen-moe" and doc["source"]["repo_id"] == "acme/tiny-moe"
    r = subprocess.run([sys.executable, "-m", "mxconv.cli", "inspect", "acme/not-cached"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "acme/not-cached: cannot fetch" in r.stderr


def test_progress_label_names_family_and_formats(ws: Path, tmp_path: Path) -> None:
    """The progress bar says what the run does (family, source -> output format), not the family's
    title: "quantize gpt-oss (MXFP4 / BF16)" while writing MXFP8 read as a bug (issue 10 item 6)."""
    code, _, err = mx("quantize", ws / "gpt", tmp_path / "q8", "--format", "mxfp8", "--device", "cpu")
    assert code == 0, err
    assert "quantize gpt-oss: bf16 -> mxfp8" in err and "MXFP4 / BF16" not in err
    code, _, err = mx("repack", ws / "gpt", tmp_path / "k", "--backend", "marlin", "--device", "cpu")
    assert code == 0, err
    assert "repack gpt-oss: bf16 -> mxfp4 marlin" in err


@pytest.mark.parametrize("name", ["nope[/b]", "nope[bold]x[/bold]", "ckpt-[256, 32]"])
def test_messages_are_printed_verbatim_never_as_markup(tmp_path, name):
    """Paths, shapes and tensor names in a message reach the user exactly: no bracketed word dropped
    as a rich tag, no markup error turning a bad path into a crash."""
    for cmd in (("inspect",), ("verify",), ("quantize",)):
        args = [*cmd, tmp_path / name] + ([tmp_path / "out"] if cmd == ("quantize",) else [])
        code, out, err = mx(*args)
        assert code == 2, (cmd, code, out, err)
        assert name in err.replace("\n", ""), (cmd, err)
        assert "internal error" not in err


def test_verify_shows_progress_on_stderr_and_quiet_hides_it(ws: Path) -> None:
    code, out, err = mx("verify", ws / "qwen-trt", "--device", "cpu")
    assert code == 0, err
    assert "integrity (files" not in out and "layer 1 (" not in out  # results only on stdout, steps on stderr
    assert f"verify {ws / 'qwen-trt'}" in err.replace("\n", "")  # the bar, on stderr
    code, out, err = mx("verify", ws / "qwen-trt", "--device", "cpu", "--quiet")
    assert code == 0 and err == "", err


def test_verify_reports_each_step_in_order(ws: Path) -> None:
    from mxconv.verify import verify

    steps: list[tuple[str, int, int]] = []
    verify(ws / "qwen-trt", on_step=lambda what, done, total: steps.append((what, done, total)))
    assert steps[0] == ("integrity (files, headers)", 0, 3)
    assert [s[0] for s in steps[1:]] == ["layer 0", "layer 1", "done"] and steps[-1][1:] == (3, 3)


def test_verify_errors_name_the_setting_and_the_cli_its_flag(ws: Path) -> None:
    """The library says VerifyOptions' settings, never a flag; mxconv verify says the same in its flags."""
    from mxconv.errors import BadInput
    from mxconv.verify import VerifyOptions, VerifyPlan, verify

    cases = [  # (options, the library's words, the CLI's flags, the CLI's words)
        (dict(layers="0,x"), "VerifyOptions.layers '0,x': expected comma-separated", ["--layers", "0,x"],
         "--layers '0,x': expected comma-separated"),
        (dict(layers=[7]), "VerifyOptions.layers: [7] are not converted MoE layers", ["--layers", "7"],
         "--layers: [7] are not converted MoE layers"),
        (dict(reference=str(ws / "qwen")), f"VerifyOptions.reference {ws / 'qwen'}: a different model",
         ["--reference", str(ws / "qwen")], f"--reference {ws / 'qwen'}: a different model"),
        (dict(reference=str(ws / "gpt-q4"), reference_outputs="x.st"), "give either VerifyOptions.reference or "
         "VerifyOptions.reference_outputs, not both", None, None),
        (dict(save_reference="x.st"), "VerifyOptions.save_reference needs VerifyOptions.reference", None, None),
        (dict(tokens=0), "VerifyOptions.tokens must be >= 1", None, None),
    ]
    for settings, library, flags, cli in cases:
        with pytest.raises(BadInput) as caught:
            verify(ws / "gpt-trt", VerifyOptions(**settings))
        assert library in str(caught.value) and " --" not in str(caught.value), str(caught.value)
        if flags is not None:
            code, _, err = mx("verify", ws / "gpt-trt", *flags)
            assert code == 2 and cli in " ".join(err.split()), err
    with pytest.raises(dataclasses.FrozenInstanceError):
        VerifyOptions().tokens = 3  # type: ignore[misc]
    assert VerifyPlan.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_repack_says_when_no_vllm_backend_holds_the_bytes(ws: Path, tmp_path: Path) -> None:
    code, out, err = mx("repack", ws / "qwen-q4", tmp_path / "t", "--backend", "triton", "--device", "cpu", "--json")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any("no vLLM 0.33 MXFP4 MoE backend holds these bytes" in n and "TRITON runs swigluoai only" in n for n in notes), notes
    code, out, err = mx("repack", ws / "gpt-q4", tmp_path / "m", "--backend", "marlin", "--device", "cpu", "--json")
    assert code == 0 and not any("no vLLM" in n for n in json.loads(out)["notes"]), out  # MARLIN holds it


@pytest.mark.parametrize("act, vllm_backend", [("bf16", "FLASHINFER_TRTLLM_MXFP4_BF16"), ("mxfp8", "FLASHINFER_TRTLLM_MXFP4_MXFP8")])
def test_repack_trtllm_default_is_what_vllm_033_holds(ws: Path, tmp_path: Path, act: str, vllm_backend: str) -> None:
    code, out, err = mx("repack", ws / "gpt-q4", tmp_path / "d", "--backend", "trtllm", "--activation", act, "--device", "cpu", "--json")
    assert code == 0 and not any("no vLLM" in n for n in json.loads(out)["notes"]), out
    m = json.loads((tmp_path / "d" / "mxconv.json").read_text())
    assert m["served_vllm_backends"] == [vllm_backend] and m["quant_config"]["not_served"] == {}
    assert (m["layout"]["padded_intermediate_size"], m["layout"]["intermediate_align"]) == (128, 128)  # I = 64
    code, out, err = mx("repack", ws / "gpt-q4", tmp_path / "o", "--backend", "trtllm", "--activation", act, "--device", "cpu",
                        "--layout-option", "intermediate_align=256", "--json")
    assert code == 0, err
    notes = [n for n in json.loads(out)["notes"] if "no vLLM 0.33 MXFP4 MoE backend holds these bytes" in n]
    assert len(notes) == 1 and f"vLLM pads (H, I) = (96, 64) to (256, 128) for {vllm_backend}" in notes[0], out
    m = json.loads((tmp_path / "o" / "mxconv.json").read_text())
    assert m["served_vllm_backends"] == [] and m["layout"]["padded_intermediate_size"] == 256
    code, _, err = mx("verify", tmp_path / "o", "--reference", ws / "gpt-q4", "--device", "cpu")  # the old default still reads back
    assert code == 0, err
