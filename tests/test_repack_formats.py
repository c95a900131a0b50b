"""Which expert format a repack writes when the backend does not take MXFP4 (xpu: MXFP8 only), and what its
refusals say for every kind of source (mxconv.run.repack_formats; review item 1): a float or block-FP8
source defaults to the layout's format and the summary says so, with bytes equal to ``--format mxfp8``;
an MXFP4 source is told to pass ``--format mxfp8`` (or that it would not help: gpt-oss's expert biases);
an INT4 source to quantize first, to the format the backend takes; an MXFP8 source for an MXFP4-only
backend to start from the float checkpoint. Library errors name settings, the CLI flags, and inspect's
per-backend rows quote the same words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.checkpoints import make_checkpoint
from support.cli import mx

from mxconv.errors import BadInput
from mxconv.families import detect_family
from mxconv.layouts import get_layout
from mxconv.run.options import QuantOptions, RepackOptions
from mxconv.run.plan import build_plan
from mxconv.run.repack_formats import default_weight_format, weight_format_hint
from mxconv.source.checkpoint import open_checkpoint
from mxconv.source.st_format import read_header, read_tensor

XPU_ONLY = "backend xpu takes mxfp8 experts only: "


@pytest.fixture(scope="module")
def srcs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rf")
    out = {kind: make_checkpoint(root / kind, kind).path for kind in ("qwen3-moe", "gpt-oss-mxfp4", "kimi-k2-int4")}
    for fmt in ("mxfp4", "mxfp8"):
        code, _, err = mx("quantize", out["qwen3-moe"], root / f"q-{fmt}", "--format", fmt, "--quiet", "--device", "cpu")
        assert code == 0, err
        out[fmt] = root / f"q-{fmt}"
    return out


def _dry_run(src: Path, out: Path, *args: str) -> tuple[int, dict, str]:
    code, text, err = mx("repack", src, out, *args, "--dry-run", "--json", "--device", "cpu")
    return code, (json.loads(text) if code == 0 else {}), err


def _expert_bytes(out: Path) -> dict[str, bytes]:
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        for name, info in read_header(f)[0].items():
            if ".experts." in name:
                got[name] = read_tensor(info).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return got


def test_a_bf16_source_defaults_to_the_format_xpu_takes(srcs: dict[str, Path], tmp_path: Path) -> None:
    """No --format: the bf16 experts become MXFP8 (xpu takes nothing else), the summary says so in CLI words,
    and the bytes and manifest are those of --format mxfp8."""
    code, text, err = mx("repack", srcs["qwen3-moe"], tmp_path / "d", "--backend", "xpu", "--json", "--device", "cpu")
    assert code == 0, err
    summary = json.loads(text)
    assert (summary["source_format"], summary["weight_format"]) == ("bf16", "mxfp8")
    assert summary["weight_format_note"] == ("bf16 experts quantized to mxfp8: backend xpu takes mxfp8 experts, not the "
                                             "default mxfp4 (pass --format to choose)")
    code, text, err = mx("repack", srcs["qwen3-moe"], tmp_path / "f", "--backend", "xpu", "--format", "mxfp8", "--json",
                         "--device", "cpu")  # fmt: skip
    assert code == 0, err
    assert "weight_format_note" not in json.loads(text)
    assert _expert_bytes(tmp_path / "d") == _expert_bytes(tmp_path / "f") != {}
    manifests = [json.loads((tmp_path / d / "mxconv.json").read_text()) for d in ("d", "f")]
    assert manifests[0]["weight_format"] == "mxfp8" and manifests[0]["served_vllm_backends"] == ["XPU"]
    keep = lambda m: {k: v for k, v in m.items() if k not in ("created", "command")}  # noqa: E731
    assert keep(manifests[0]) == keep(manifests[1])


def test_a_scale_rounding_asked_is_kept_when_the_format_is_chosen(srcs: dict[str, Path], tmp_path: Path) -> None:
    for asked, rule in (((), "rceil"), (("--scale-rounding", "even"), "even")):
        out = tmp_path / rule
        code, _, err = mx("repack", srcs["qwen3-moe"], out, "--backend", "xpu", *asked, "--quiet", "--device", "cpu")
        assert code == 0, err
        assert json.loads((out / "mxconv.json").read_text())["scale_rounding"] == rule


@pytest.mark.parametrize("dtype,name", [(torch.float16, "fp16"), (torch.float32, "fp32")])
def test_every_float_source_defaults_alike(tmp_path: Path, dtype: torch.dtype, name: str) -> None:
    src = make_checkpoint(tmp_path / "src", "qwen3-moe", dtype=dtype).path
    code, doc, err = _dry_run(src, tmp_path / "o", "--backend", "xpu")
    assert code == 0, err
    assert (doc["source_format"], doc["weight_format"]) == (name, "mxfp8") and doc["weight_format_note"].startswith(name)
    code, doc, err = _dry_run(src, tmp_path / "o", "--backend", "trtllm")  # a backend that takes MXFP4: the default
    assert code == 0 and doc["weight_format"] == "mxfp4" and "weight_format_note" not in doc, err


def test_a_block_fp8_source_defaults_alike(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "deepseek-v3-fp8").path
    code, doc, err = _dry_run(src, tmp_path / "o", "--backend", "xpu")
    assert code == 0, err
    assert (doc["source_format"], doc["weight_format"]) == ("fp8_block", "mxfp8")


def test_asking_mxfp4_of_xpu_is_refused_saying_what_works(srcs: dict[str, Path], tmp_path: Path) -> None:
    code, _, err = _dry_run(srcs["qwen3-moe"], tmp_path / "o", "--backend", "xpu", "--format", "mxfp4")
    assert code == 2 and err.startswith("error: --format mxfp4; " + XPU_ONLY)
    assert "Mxfp4MoeBackend.XPU runs MXFP4 experts on the checkpoint's tensors as loaded" in err
    assert "; pass --format mxfp8 (backends that take mxfp4: trtllm," in err and "RepackOptions" not in err
    ckpt = open_checkpoint(srcs["qwen3-moe"])
    with pytest.raises(BadInput, match=r"RepackOptions.weight_format mxfp4; backend xpu takes mxfp8 experts only: .*; "
                                       r"set RepackOptions.weight_format mxfp8 \(backends"):  # fmt: skip
        build_plan(ckpt, detect_family(ckpt), QuantOptions(), RepackOptions("xpu", weight_format="mxfp4"))


def test_an_mxfp4_source_is_told_to_recode_and_that_works(srcs: dict[str, Path], tmp_path: Path) -> None:
    code, _, err = _dry_run(srcs["mxfp4"], tmp_path / "o", "--backend", "xpu")
    assert code == 2 and err.startswith(f"error: {srcs['mxfp4']}: experts are mxfp4; " + XPU_ONLY)
    assert "pass --format mxfp8 (MXFP4 re-coded as MXFP8 without loss)" in err
    code, doc, err = _dry_run(srcs["mxfp4"], tmp_path / "o", "--backend", "xpu", "--format", "mxfp8")
    assert code == 0 and doc["weight_format"] == "mxfp8" and "weight_format_note" not in doc, err


def test_gpt_oss_mxfp4_is_told_nothing_helps(srcs: dict[str, Path], tmp_path: Path) -> None:
    """gpt-oss has expert biases, which no MXFP8 method creates: --format mxfp8 would be refused as well."""
    code, _, err = _dry_run(srcs["gpt-oss-mxfp4"], tmp_path / "o", "--backend", "xpu")
    assert code == 2 and "experts are mxfp4; " + XPU_ONLY in err
    assert "; --format mxfp8 would not help: xpu MXFP8 takes no expert biases" in err and "pass --format" not in err


@pytest.mark.parametrize("backend,fmt", [("xpu", "mxfp8"), ("triton", "mxfp4")])
def test_an_int4_source_is_told_to_quantize_to_what_the_backend_takes(srcs: dict[str, Path], tmp_path: Path,
                                                                       backend: str, fmt: str) -> None:  # fmt: skip
    code, _, err = _dry_run(srcs["kimi-k2-int4"], tmp_path / "o", "--backend", backend)
    takes = ", ".join(get_layout(backend).weight_formats)
    assert code == 2 and err.startswith(f"error: {srcs['kimi-k2-int4']}: experts are int4 (compressed-tensors INT4, bf16 "
                                        f"group scales); backend {backend} takes {takes} experts only: repack keeps INT4 "
                                        f"experts INT4; quantize the source first (--format {fmt}) and repack that output "
                                        "(backends that take int4: trtllm, humming)")  # fmt: skip


def test_the_int4_advice_works_for_xpu(srcs: dict[str, Path], tmp_path: Path) -> None:
    code, _, err = mx("quantize", srcs["kimi-k2-int4"], tmp_path / "q8", "--format", "mxfp8", "--quiet", "--device", "cpu")
    assert code == 0, err
    code, doc, err = _dry_run(tmp_path / "q8", tmp_path / "o", "--backend", "xpu")
    assert code == 0 and doc["weight_format"] == "mxfp8", err


def test_an_mxfp8_source_for_an_mxfp4_backend(srcs: dict[str, Path], tmp_path: Path) -> None:
    code, _, err = _dry_run(srcs["mxfp8"], tmp_path / "o", "--backend", "triton")
    assert code == 2 and err.startswith(f"error: {srcs['mxfp8']}: experts are mxfp8; backend triton takes mxfp4 experts "
                                        "only: repack never re-quantizes MXFP8 experts to mxfp4; repack the float "
                                        "source instead (backends that take mxfp8: ")  # fmt: skip


def test_inspect_rows_quote_the_same_hint(srcs: dict[str, Path], tmp_path: Path) -> None:
    """inspect's xpu row: an MXFP8 row for a bf16 source (what repack writes by default); for INT4 and MXFP4
    sources the refusal repack prints, from the same function."""
    code, text, err = mx("inspect", srcs["qwen3-moe"], "--json")
    assert code == 0, err
    rows = {(r["backend"], r["activation"]): r for r in json.loads(text)["backends"]}
    assert rows["xpu", "bf16"]["weight_format"] == "mxfp8" and rows["xpu", "bf16"]["vllm_backends"] == ["XPU"]
    assert rows["trtllm", "bf16"]["weight_format"] == "mxfp4"
    code, text, err = mx("inspect", srcs["qwen3-moe"])
    assert code == 0 and "xpu bf16 (mxfp8)" in text, err
    for src, fmt in ((srcs["kimi-k2-int4"], "int4"), (srcs["mxfp4"], "mxfp4")):
        code, text, err = mx("inspect", src, "--json")
        assert code == 0, err
        row = {(r["backend"], r["activation"]): r for r in json.loads(text)["backends"]}["xpu", "bf16"]
        _, _, refusal = _dry_run(src, tmp_path / "o", "--backend", "xpu")
        assert row["error"].startswith(f"takes mxfp8 experts, not {fmt}: ")
        assert refusal.rstrip("\n").endswith(row["error"].split(": ", 1)[1]), (row["error"], refusal)
        assert "RepackOptions" not in row["error"] and "QuantOptions" not in row["error"]


def test_default_weight_format_per_source() -> None:
    xpu, trtllm = get_layout("xpu"), get_layout("trtllm")
    for src in ("bf16", "fp16", "fp32", "fp8_block"):
        assert (default_weight_format(src, xpu), default_weight_format(src, trtllm)) == ("mxfp8", "mxfp4"), src
    for src in ("mxfp4", "mxfp8", "int4"):
        assert default_weight_format(src, xpu) == default_weight_format(src, trtllm) == src
    assert weight_format_hint("mxfp8", get_layout("triton"), "mxfp8").startswith("repack never re-quantizes MXFP8")


def test_experts_quantized_on_the_way_take_the_scale_rule_of_their_format(srcs: dict[str, Path], tmp_path: Path) -> None:
    """A library repack that names RepackOptions.weight_format mxfp8 with the default QuantOptions (fmt mxfp4)
    quantizes with MXFP8's own rule (rceil), as QuantOptions("mxfp8") does: before, it took MXFP4's (even) and
    recorded it. The rule as first given survives dataclasses.replace, and options asking different rules differ."""
    from dataclasses import replace

    from mxconv.run.conversion import Conversion, RunSettings

    ckpt = open_checkpoint(srcs["qwen3-moe"])
    runs = {}
    for name, quant in (("default", QuantOptions()), ("mxfp8", QuantOptions("mxfp8"))):
        plan = build_plan(ckpt, detect_family(ckpt), quant, RepackOptions("humming", weight_format="mxfp8"))
        assert plan.quant.scale_rounding == "rceil", name
        Conversion(plan).run(tmp_path / name, device=torch.device("cpu"), settings=RunSettings(overwrite=True))
        runs[name] = (_expert_bytes(tmp_path / name), json.loads((tmp_path / name / "mxconv.json").read_text())["scale_rounding"])
    assert runs["default"] == runs["mxfp8"] and runs["default"][1] == "rceil"
    assert replace(QuantOptions(), allow_nonfinite=True).for_format("mxfp8").scale_rounding == "rceil"
    assert replace(QuantOptions(scale_rounding="even"), allow_nonfinite=True).for_format("mxfp8").scale_rounding == "even"
    assert QuantOptions() != QuantOptions(scale_rounding="even")  # both resolve to even for MXFP4, but differ for MXFP8
