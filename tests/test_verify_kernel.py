"""``mxconv verify --kernel``: the engines' own kernels fed the files on disk (GPU tests run on an
SM90 device with the kernels found through MXCONV_TRITON_KERNELS / MXCONV_MARLIN_OPS), and the CPU
behaviour: exit 2 naming what is missing, FAIL for sizes the kernel computes wrongly.

Planted layout bugs are written into a correct output as a broken converter would write them: the
canonical experts are recovered, mutated, laid out again and stored (the manifest's sha256 is
updated too, so only the numbers can tell).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mxconv.experts.stack import CanonicalExperts
from mxconv.source.checkpoint import open_checkpoint
from mxconv.cli import app
from mxconv.engines import discover
from mxconv.layouts import get_layout
from mxconv.source.manifest import load_manifest
from support.checkpoints import ModelSizes, make_checkpoint
from mxconv.verify import VerifyOptions, verify
from mxconv.verify.layout import kernel_layer_canonical

cli = CliRunner()


def mx(*args: object) -> tuple[int, str]:
    r = cli.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    return r.exit_code, r.stdout + r.stderr


# ---- CPU: what --kernel says where it cannot run -------------------------------------------------


def test_kernel_without_a_gpu_exits_2_naming_what_is_missing(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    src = make_checkpoint(tmp_path / "src", "qwen3-moe", ModelSizes(hidden_size=256)).path
    for backend, needle in (("marlin", "capability >= 8.0"), ("triton", "capability 9.0"), ("trtllm", "SM100"), ("aiter", "ROCm")):
        out = tmp_path / backend
        code, text = mx("repack", src, out, "--backend", backend, "--quiet", "--device", "cpu")
        assert code == 0, text
        code, text = mx("verify", out, "--kernel")
        assert code == 2 and "--kernel" in text and needle in text and "Traceback" not in text, (backend, text)


def test_kernel_on_a_canonical_checkpoint_is_bad_usage(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    code, text = mx("quantize", src, tmp_path / "q", "--quiet", "--device", "cpu")
    assert code == 0, text
    code, text = mx("verify", tmp_path / "q", "--kernel")
    assert code == 2 and "canonical checkpoint has no backend kernel" in text


def test_triton_hidden_not_multiple_of_64_warns_and_fails_the_kernel_check(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4", ModelSizes(hidden_size=96)).path
    code, text = mx("repack", src, tmp_path / "k", "--backend", "triton", "--quiet", "--device", "cpu")
    assert code == 0 and "warning: hidden size 96 is not a multiple of 64" in text and "pad_hidden=true" in text
    code, text = mx("verify", tmp_path / "k", "--kernel")
    assert code == 1 and "kernel" in text and "computes wrong results" in text
    code, text = mx("repack", src, tmp_path / "p", "--backend", "triton", "--quiet", "--device", "cpu",
                    "--layout-option", "pad_hidden=true")
    assert code == 0 and "warning" not in text
    assert json.loads((tmp_path / "p" / "mxconv.json").read_text())["layout"]["padded_hidden_size"] == 128


# ---- GPU: the real kernels ----------------------------------------------------------------------

TOKENS = 64


# what finds the GPU and the engine's kernels, per runner backend (engines/discover): only these may skip a test
# (triton: the kernels found and of the generation the layout's default storage needs)
DISCOVERY = {"triton": lambda: discover.require_triton_generation(discover.find_triton_kernels(), "3.5"),
             "marlin": lambda: discover.find_marlin_ops()}


def _kernels_or_skip(backend: str) -> None:
    """Skip when the GPU or the engine's kernels are missing (the runner's device check and
    engines/discover); anything else the runner raises or answers, e.g. a TritonDescription or
    MarlinDescription that no longer reads a manifest's layout part, fails the test."""
    from mxconv.engines.runner import require_runner
    from mxconv.errors import BadInput
    from mxconv.source.manifest import LayoutPart

    runner = require_runner(backend)
    try:
        runner.check_device("cuda")
        DISCOVERY[backend]()
    except BadInput as exc:
        pytest.skip(str(exc))
    # the runner's own check on an output's layout part of these padded sizes (its own keys absent: their defaults)
    layout = LayoutPart(name=backend, version=1, engine_compat={}, hidden_size=256, intermediate_size=256, padded_hidden_size=256,
                        padded_intermediate_size=256, w13_row_order="interleaved", kernel_params=None)  # fmt: skip
    assert runner.kernel_unavailable(layout, "cuda") is None


def test_kernels_or_skip_fails_on_a_broken_description(monkeypatch: pytest.MonkeyPatch) -> None:
    """A description that cannot read the layout part is a failure, not a skip: with the GPU and the
    kernels found (stood in for, on a machine without them), the runner's BadInput reaches the test."""
    from mxconv.engines import triton_moe
    from mxconv.errors import BadInput

    def broken(part: object) -> None:
        raise BadInput("layout.arch: a description broken on purpose")

    monkeypatch.setattr(triton_moe.TritonRunner, "check_device", lambda self, device: None)
    monkeypatch.setitem(DISCOVERY, "triton", lambda: None)
    monkeypatch.setattr(triton_moe.TritonDescription, "from_layout", staticmethod(broken))
    with pytest.raises(BadInput, match="broken on purpose"):
        _kernels_or_skip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("backend", sorted(DISCOVERY))
def test_kernels_or_skip_skips_without_a_gpu(backend: str) -> None:
    with pytest.raises(pytest.skip.Exception, match="GPU|CUDA|cuda"):
        _kernels_or_skip(backend)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vk")
    out = {}
    for name, kind in (("gpt", "gpt-oss-bf16"), ("qwen", "qwen3-moe")):
        src = make_checkpoint(root / name, kind, ModelSizes(hidden_size=256, intermediate_size=192, num_experts=8)).path
        code, text = mx("quantize", src, root / f"{name}-q4", "--quiet")
        assert code == 0, text
        out[name], out[f"{name}-q4"] = src, root / f"{name}-q4"
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "marlin"])
@pytest.mark.parametrize("name", ["gpt", "qwen"])
@pytest.mark.parametrize("tp", [1, 2])
def test_verify_kernel_passes_on_converted_files(sources, tmp_path: Path, backend: str, name: str, tp: int) -> None:
    _kernels_or_skip(backend)
    out = tmp_path / "k"
    code, text = mx("repack", sources[f"{name}-q4"], out, "--backend", backend, "--tp", tp, "--quiet")
    assert code == 0, text
    rep = verify(out, VerifyOptions(reference=str(sources[f"{name}-q4"]), tokens=TOKENS, kernel=True))
    assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
    for r in rep.layers:
        assert r.kernel is not None and r.kernel.status == "ok"
        print("VERIFY-KERNEL", json.dumps({"backend": backend, "source": name, "tp": tp, "layer": r.layer,
                                            "vs_bytes": r.kernel.vs_converted.to_json(), "vs_ref": r.kernel.vs_reference.to_json()}))
    # against the bf16 source too (MXFP4 threshold widened by the kernel's rounding), through the CLI
    code, text = mx("verify", out, "--reference", sources[name], "--kernel", "--tokens", TOKENS)
    assert code == 0 and "PASS" in text, text



@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "marlin"])
@pytest.mark.parametrize("tp", [1, 2])
def test_verify_kernel_runs_the_engine_on_the_tensors_verify_read(sources, tmp_path: Path, backend: str, tp: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On the GPU (layers read onto it, one ahead) no layer is read a second time for the kernel, and
    the kernel's output from those tensors is the one it gives from the files (to the run-to-run
    spread of the kernel itself: none where it is deterministic)."""
    from mxconv.engines import loader
    from mxconv.verify.prefetch import LayerReads
    from mxconv.verify.reference_moe import Routing
    from mxconv.verify.plan import VerifyPlan, open_output
    from mxconv.verify.state import VerifyState

    _kernels_or_skip(backend)
    out = tmp_path / "k"
    code, text = mx("repack", sources["qwen-q4"], out, "--backend", backend, "--tp", tp, "--quiet")
    assert code == 0, text
    manifest = load_manifest(out)
    run = VerifyState(VerifyPlan.build(out, manifest, open_output(out, manifest), VerifyOptions(tokens=TOKENS, device="cuda")))
    L = manifest.layers[0].layer
    with LayerReads(run, {L: manifest.layers[0].module_prefix}) as reads:
        held = reads.get(L, []).held()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(TOKENS, run.plan.info.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(run.plan.info.num_experts, generator=g)[: run.plan.info.top_k] for _ in range(TOKENS)])
    routing = Routing(ids.int(), torch.softmax(torch.randn(TOKENS, run.plan.info.top_k, generator=g), -1))
    files = loader.run_kernel_layer(out, manifest, L, x, routing)
    again = loader.run_kernel_layer(out, manifest, L, x, routing)
    from_held = loader.run_kernel_layer(out, manifest, L, x, routing, held=held)
    assert (from_held - files).abs().max() <= (again - files).abs().max()

    def no_second_read(*args: object, **kwargs: object) -> object:
        raise AssertionError("verify --kernel read a layer from its files a second time")

    monkeypatch.setattr(loader, "read_layer_tensors", no_second_read)
    rep = verify(out, VerifyOptions(reference=str(sources["qwen-q4"]), tokens=TOKENS, kernel=True, device="cuda"))
    assert rep.passed and all(r.kernel is not None and r.kernel.status == "ok" for r in rep.layers), rep.to_json()

def _swap_experts(c: CanonicalExperts) -> None:
    for t in (c.w13, c.w13_scale, c.w2, c.w2_scale):
        t[[0, 1]] = t[[1, 0]]


def _swap_gate_up(c: CanonicalExperts) -> None:
    for t in (c.w13, c.w13_scale):
        if c.row_order == "interleaved":
            t[:, 0::2], t[:, 1::2] = t[:, 1::2].clone(), t[:, 0::2].clone()
        else:
            half = t.shape[1] // 2
            t[:, :half], t[:, half:] = t[:, half:].clone(), t[:, :half].clone()


def _permute_w2_scales(c: CanonicalExperts) -> None:
    c.w2_scale.copy_(c.w2_scale.roll(1, dims=1))


def _bump_one_scale(c: CanonicalExperts) -> None:
    c.w2_scale[:, :, 0] = (c.w2_scale[:, :, 0].int() + 4).clamp(max=254).to(torch.uint8)  # x16 on one block column


BUGS: dict[str, Callable[[CanonicalExperts], None]] = {
    "swapped experts": _swap_experts, "swapped gate/up": _swap_gate_up,
    "permuted w2 scales": _permute_w2_scales, "scale bytes x16": _bump_one_scale,
}


def _plant(out: Path, mutate: Callable[[CanonicalExperts], None]) -> None:
    """Rewrite every layer of the TP-1 kernel output at ``out`` with mutated canonical experts."""
    import hashlib

    manifest = load_manifest(out)
    layout = get_layout(str(manifest.backend))
    options = layout.resolve_options(manifest.layout.option_values)
    ckpt = open_checkpoint(out)
    new: dict[str, torch.Tensor] = {}
    for lay in manifest.layers:
        prefix = lay.module_prefix
        problems: list[str] = []
        canon = kernel_layer_canonical(manifest, [ckpt], prefix, problems)
        assert canon is not None, problems
        mutate(canon)
        for k, v in layout.to_kernel(canon, manifest.activation, options).items():
            new[f"{prefix}.experts.{k}"] = v.contiguous()
    for shard in sorted({ckpt.tensors[n].file for n in new}):
        tensors = load_file(shard)
        tensors.update({n: t for n, t in new.items() if n in tensors})
        save_file(tensors, shard, metadata={"format": "pt"})
    doc = manifest.as_written()
    for n, t in new.items():  # a broken converter records the hashes of what it wrote
        doc["tensors"][n]["sha256"] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    (out / "mxconv.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bugs_fail_verify_without_a_kernel_too(tmp_path: Path, bug: str) -> None:
    """On CPU the same planted files fail the layout check against the reference (bit-exact)."""
    src = make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4", ModelSizes(hidden_size=256, intermediate_size=192, num_experts=4)).path
    out = tmp_path / "k"
    code, text = mx("repack", src, out, "--backend", "marlin", "--quiet", "--device", "cpu")
    assert code == 0, text
    _plant(out, BUGS[bug])
    rep = verify(out, VerifyOptions(reference=str(src), tokens=16))
    assert not rep.passed and all(r.integrity == "ok" and r.layout == "FAIL" for r in rep.layers), bug


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "marlin"])
@pytest.mark.parametrize("bug", list(BUGS))
def test_verify_kernel_fails_on_planted_layout_bugs(sources, tmp_path: Path, backend: str, bug: str) -> None:
    _kernels_or_skip(backend)
    out = tmp_path / "k"
    code, text = mx("repack", sources["gpt-q4"], out, "--backend", backend, "--quiet")
    assert code == 0, text
    _plant(out, BUGS[bug])
    rep = verify(out, VerifyOptions(reference=str(sources["gpt-q4"]), tokens=TOKENS, kernel=True))
    assert not rep.passed
    for r in rep.layers:
        assert r.kernel is not None and r.kernel.status == "FAIL", (bug, r.problems)
        assert r.kernel.vs_reference.rel_rms > 0.05
        print("PLANTED", json.dumps({"backend": backend, "bug": bug, "layer": r.layer,
                                     "kernel_vs_ref_rel_rms": r.kernel.vs_reference.rel_rms,
                                     "kernel_vs_bytes_rel_rms": r.kernel.vs_converted.rel_rms}))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MXCONV_BIG_GPU_TESTS") != "1", reason="set MXCONV_BIG_GPU_TESTS=1 (one gpt-oss-120b-sized layer)")
@pytest.mark.parametrize("backend", ["triton", "marlin"])
def test_verify_kernel_on_a_gpt_oss_120b_sized_layer(tmp_path_factory, backend: str) -> None:
    _kernels_or_skip(backend)
    root = tmp_path_factory.mktemp("big")
    src = root / "src"
    if not (src / "config.json").exists():
        make_checkpoint(src, "gpt-oss-mxfp4", ModelSizes(num_layers=1, num_experts=128, hidden_size=2880, intermediate_size=2880, top_k=4))
    out = root / backend
    code, text = mx("repack", src, out, "--backend", backend, "--quiet")
    assert code == 0, text
    rep = verify(out, VerifyOptions(reference=str(src), tokens=32, kernel=True))
    assert rep.passed, [p for r in rep.layers for p in r.problems] + rep.problems
    r = rep.layers[0]
    print("VERIFY-KERNEL-120B", json.dumps({"backend": backend, "vs_bytes": r.kernel.vs_converted.to_json(),
                                            "vs_ref": r.kernel.vs_reference.to_json()}))


@pytest.mark.parametrize("broken", [False, True], ids=["absent", "broken-import"])
def test_trtllm_kernel_reason_tells_a_missing_flashinfer_from_a_broken_one(tmp_path: Path, monkeypatch, broken: bool) -> None:
    """"not installed" only when flashinfer itself is missing; an installed flashinfer whose import
    fails (a dependency its --no-deps install left out) is named with what its import raised."""
    from mxconv.layouts import get_layout

    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    if broken:
        pkg = tmp_path / "site" / "flashinfer"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("import mxconv_test_missing_dependency\n")
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
    else:
        monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ModuleNotFoundError('flashinfer')
    reason = get_layout("trtllm").kernel_unavailable({"weight_format": "mxfp4"})
    if broken:
        assert "installed but cannot be imported" in reason and "mxconv_test_missing_dependency" in reason, reason
    else:
        assert reason == "flashinfer is not installed (pip install 'mxconv[flashinfer]')", reason


def test_kernel_check_of_damaged_layout_options_is_a_failure_not_bad_usage(tmp_path: Path) -> None:
    """Invalid layout options in the verified output's own manifest fail it (exit 1), with or without --kernel."""
    src = make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4", ModelSizes(hidden_size=128)).path
    out = tmp_path / "k"
    code, text = mx("repack", src, out, "--backend", "triton", "--quiet", "--device", "cpu")
    assert code == 0, text
    manifest = json.loads((out / "mxconv.json").read_text())
    manifest["layout"]["options"]["triton_layout"] = "9.9"
    (out / "mxconv.json").write_text(json.dumps(manifest))
    for extra in ([], ["--kernel"]):
        code, text = mx("verify", out, *extra)
        assert code == 1 and "9.9" in text and "Traceback" not in text, (extra, text)
