"""Every switch explicit: the environment is read in ``mxconv.environment`` only, the kernel
locations are also options (``verify --triton-kernels/--marlin-ops``, ``KernelLocations``) that win
over their variables, and the layout kernels are picked by argument (``KernelChoice``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mxconv import environment
from mxconv.cli import app
from mxconv.engines import discover, loader
from mxconv.errors import BadInput
from mxconv.experts.kernel_settings import KernelChoice, KernelLocations
from mxconv.layouts import get_layout
from mxconv.layouts.gathers import layout_kernels
from mxconv.run.options import RepackOptions
from support.checkpoints import ModelSizes, make_checkpoint
from support.registry_cases import case_id, format_cases, small_stack

# Read elsewhere until their own items of issue 19 land (the trace option, the write-delay hook).
cli = CliRunner()


def test_environment_reads_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(environment.TRITON_KERNELS_ENV, str(tmp_path / "kern"))
    monkeypatch.setenv(environment.MARLIN_OPS_ENV, "  ")
    monkeypatch.setenv(environment.TRITON_INTERPRET_ENV, "0")
    assert environment.triton_kernels_dir() == (tmp_path / "kern").resolve()
    assert environment.marlin_ops_file() is None
    assert not environment.triton_interpreter_on()
    monkeypatch.setenv(environment.TRITON_INTERPRET_ENV, "1")
    assert environment.triton_interpreter_on()


def test_triton_kernels_path_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(environment.TRITON_KERNELS_ENV, "/nonexistent/from-env")
    with pytest.raises(BadInput) as err:
        discover.find_triton_kernels(tmp_path / "from-option")
    assert str(tmp_path / "from-option") in str(err.value) and "from-env" not in str(err.value)


def test_marlin_ops_path_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(environment.MARLIN_OPS_ENV, "/nonexistent/from-env.so")
    with pytest.raises(BadInput) as err:
        discover.find_marlin_ops(tmp_path / "from-option.so")
    msg = str(err.value)
    assert str(tmp_path / "from-option.so") in msg and "no such file" in msg and "from-env" not in msg
    assert "--marlin-ops" in msg and environment.MARLIN_OPS_ENV in msg


def test_environment_wins_over_installed_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable is used even where an installed copy could be found (it is looked at first)."""
    monkeypatch.setenv(environment.TRITON_KERNELS_ENV, "/nonexistent/from-env")
    monkeypatch.setenv(environment.MARLIN_OPS_ENV, "/nonexistent/from-env.so")
    for find in (discover.find_triton_kernels, discover.find_marlin_ops):
        with pytest.raises(BadInput) as err:
            find()
        assert "/nonexistent/from-env" in str(err.value)


def test_verify_kernel_location_options_need_kernel(tmp_path: Path) -> None:
    r = cli.invoke(app, ["verify", str(tmp_path), "--triton-kernels", str(tmp_path)])
    assert r.exit_code == 2
    assert "add --kernel" in r.stdout + r.stderr


@pytest.fixture(scope="module")
def triton_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small gpt-oss output repacked for the triton_kernels engine (CPU)."""
    root = tmp_path_factory.mktemp("envswitch")
    make_checkpoint(root / "src", "gpt-oss-bf16", ModelSizes(hidden_size=128, intermediate_size=96))
    for args in (["quantize", root / "src", root / "q4"], ["repack", root / "q4", root / "out", "--backend", "triton"]):
        r = cli.invoke(app, [str(a) for a in args] + ["--quiet", "--device", "cpu"])
        assert r.exit_code == 0, r.stdout + r.stderr
    return root / "out"


def test_verify_triton_kernels_option_reaches_discovery(triton_output: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``verify --kernel --triton-kernels DIR`` looks in DIR (the GPU check passed as if on an H100)."""
    monkeypatch.setattr(discover, "check_gpu", lambda *a, **k: None)
    monkeypatch.setenv(environment.TRITON_KERNELS_ENV, "/nonexistent/from-env")
    r = cli.invoke(app, ["verify", str(triton_output), "--kernel", "--triton-kernels", str(tmp_path / "opt"), "--device", "cpu", "--json"])
    assert r.exit_code == 2, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert str(tmp_path / "opt") in out and "no triton_kernels/ package" in out and "from-env" not in out


def test_loader_takes_kernel_locations(triton_output: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mxconv.engines import triton_moe

    monkeypatch.setattr(triton_moe.TritonRunner, "check_device", lambda self, device: None)  # no GPU here
    monkeypatch.setenv(environment.TRITON_KERNELS_ENV, "/nonexistent/from-env")
    src = loader.resolve_layer(triton_output, 0)
    with pytest.raises(BadInput) as err:
        loader.build_engine_layer(src, loader.read_layer_tensors(src, "cpu"), KernelLocations(triton_kernels=tmp_path / "opt"))
    assert str(tmp_path / "opt") in str(err.value) and "from-env" not in str(err.value)


@pytest.mark.parametrize("case", format_cases(), ids=case_id)
def test_kernel_choice_is_an_argument_with_the_same_bytes(case: tuple[str, str]) -> None:
    backend, fmt = case
    layout = get_layout(backend)
    act = layout.default_activation(fmt)
    c = small_stack(backend, fmt, seed=3)
    opts = layout.resolve_options()
    auto = layout.to_kernel(c, act, opts)
    forced = layout.to_kernel(c, act, opts, KernelChoice.TORCH)
    assert auto.keys() == forced.keys()
    assert all(torch.equal(auto[k].view(torch.uint8), forced[k].view(torch.uint8)) for k in auto)


def test_kernel_choice_defaults_and_dispatch() -> None:
    assert RepackOptions("marlin", "bf16").kernel_choice is KernelChoice.AUTO
    cpu = torch.zeros(1, dtype=torch.uint8)
    assert layout_kernels(cpu, KernelChoice.AUTO) is None and layout_kernels(cpu, KernelChoice.TORCH) is None
    if torch.cuda.is_available():
        assert layout_kernels(cpu.cuda(), KernelChoice.TORCH) is None

