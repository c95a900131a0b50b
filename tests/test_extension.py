"""A new backend and a new family are each one file plus one registry call.

The toy backend (a layout and its engine runner, tests/support/toy_backend.py) and the toy family
(tests/support/toy_family.py) live only on the test side: nothing in the package is edited for them
and nothing there names them, yet the CLI's repack (and its help), inspect (the backend table and
--engine), verify, verify --kernel and quantize handle them end to end, registered after the CLI was
imported, and the architecture checks take the toy backend in (the recipes of docs/architecture.md
rely on this).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mxconv.engines.runner import runner_backends

from mxconv.errors import BadInput, LayoutError
from mxconv.layouts.engine_report import undeclarable_backends
from mxconv.families import register_family, unregister_family
from mxconv.layouts import backend_names, get_layout, register_layout, unregister_layout
import support.cli
from support.architecture import backend_modules, backend_names_spelled, checked_backend_names, cross_backend_imports, \
    signature_mismatches
from support.checkpoints import ModelSizes, make_checkpoint
from support.toy_backend import ToyLayout
from support.toy_family import ToyReader, rename_to_toy


def mx(*args: object) -> tuple[int, str, str]:
    return support.cli.mx(*args, env={"COLUMNS": "200"})


@pytest.fixture
def toy_backend():
    register_layout("toy", ToyLayout())
    yield
    unregister_layout("toy")


@pytest.fixture
def toy_family():
    register_family("toy-moe", ToyReader)
    yield
    unregister_family("toy-moe")


def test_a_backend_from_one_file_goes_through_repack_inspect_and_verify(toy_backend, tmp_path: Path) -> None:
    assert "toy" in backend_names() and isinstance(get_layout("toy"), ToyLayout)
    src = make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4", ModelSizes(hidden_size=96, intermediate_size=96)).path
    out = tmp_path / "k"
    code, _, err = mx("repack", src, out, "--backend", "toy", "--tp", "2", "--layout-option", "reverse=false",
                      "--quiet", "--device", "cpu")  # fmt: skip
    assert code == 0, err
    m = json.loads((out / "mxconv.json").read_text())
    assert m["backend"] == "toy" and m["layout"]["options"] == {"reverse": False} and m["layout"]["reverse"] is False
    code, stdout, err = mx("inspect", src, "--json")
    assert code == 0, err
    rows = [b for b in json.loads(stdout)["backends"] if b["backend"] == "toy"]
    assert rows and rows[0]["padded_hidden_size"] == 128 and rows[0]["padded_intermediate_size"] == 128
    code, stdout, err = mx("inspect", out)
    assert code == 0 and "toy" in stdout, err
    code, stdout, err = mx("verify", out, "--reference", src, "--tokens", "8", "--json")
    assert code == 0, err
    assert all(r["layout"] == "bit-exact" for r in json.loads(stdout)["layers"])


def test_a_backend_from_one_file_runs_its_engine_under_verify_kernel(toy_backend, tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "qwen3-moe").path
    code, _, err = mx("quantize", src, tmp_path / "q4", "--quiet", "--device", "cpu")
    assert code == 0, err
    code, _, err = mx("repack", tmp_path / "q4", tmp_path / "k", "--backend", "toy", "--quiet", "--device", "cpu")
    assert code == 0, err
    code, stdout, err = mx("verify", tmp_path / "k", "--reference", tmp_path / "q4", "--tokens", "8", "--kernel", "--json")
    assert code == 0, err
    layers = json.loads(stdout)["layers"]
    assert layers and all(r["kernel"]["status"] == "ok" for r in layers)
    code, _, err = mx("verify", tmp_path / "q4", "--kernel")  # a canonical checkpoint: the message lists toy's runner
    assert code == 2 and "--backend " + " or ".join(runner_backends()) in err and runner_backends()[-1] == "toy"


def test_a_backend_from_one_file_is_in_inspects_tables(toy_backend, tmp_path: Path) -> None:
    """The backend table, and ``inspect --engine``: the toy declares vLLM's TRITON, picked for gpt-oss on SM90."""
    src = make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4", ModelSizes(hidden_size=128, intermediate_size=128)).path
    code, stdout, err = mx("inspect", src)
    assert code == 0 and "toy" in stdout, err
    code, stdout, err = mx("inspect", src, "--engine", "vllm-0.33", "--gpu", "sm90", "--json")
    assert code == 0, err
    [row] = [r for g in json.loads(stdout)["engine"]["gpus"] for r in g["rows"] if r["form"] == "as is"]
    assert row["backend"] == "TRITON"
    toy = [h for h in row["held_by"] if h.get("backend") == "toy"]
    assert [h["output"] for h in toy] == ["repack --backend toy --activation bf16"] and toy[0]["padded"] == [128, 128]
    code, stdout, err = mx("inspect", src, "--engine", "vllm-0.33", "--gpu", "sm90")
    assert code == 0 and "--backend toy" in " ".join(stdout.split()), err


def test_a_backend_from_one_file_passes_the_architecture_checks(toy_backend) -> None:
    """The checks of tests/test_architecture.py take their backends from the registry: the toy is in them."""
    from test_architecture import BACKEND_PACKAGES, SIGNATURE_DEBT

    assert backend_modules()["toy"] == {"support.toy_backend"}  # layout and engine runner, one file
    assert cross_backend_imports() == []
    assert "toy" in checked_backend_names() and backend_names_spelled(BACKEND_PACKAGES) == []
    assert signature_mismatches(SIGNATURE_DEBT) == [] and undeclarable_backends() == []


def test_the_cli_lists_a_backend_registered_after_it_was_imported(toy_backend, tmp_path: Path) -> None:
    code, stdout, _ = mx("repack", "--help")
    stdout = " ".join(stdout.split())  # the help wraps where the backend list makes it
    assert code == 0 and "| toy." in stdout and "toy: bf16" in stdout and "reverse=bool" in stdout
    code, stdout, _ = mx("verify", "--help")
    assert code == 0 and "or toy" in stdout
    code, _, err = mx("repack", "s", tmp_path / "o", "--backend", "tpu")
    assert code == 2 and "'tpu' is not one of" in err and "'toy'" in err


def test_layout_options_are_typed_and_validated(toy_backend) -> None:
    toy = get_layout("toy")
    assert toy.resolve_options().to_json() == {"reverse": True}
    assert toy.resolve_options({"reverse": "no"}).to_json() == {"reverse": False}
    with pytest.raises(LayoutError, match="expected true or false"):
        toy.resolve_options({"reverse": "maybe"})
    with pytest.raises(LayoutError, match="has no option colour"):
        toy.resolve_options({"colour": "red"})
    trt = get_layout("trtllm")
    assert trt.resolve_options({"intermediate_align": "128"}).to_json() == {"intermediate_align": 128}
    with pytest.raises(LayoutError, match="positive multiple of 128"):
        trt.resolve_options({"intermediate_align": "96"})
    with pytest.raises(LayoutError, match="expected a whole number"):
        trt.resolve_options({"intermediate_align": "lots"})


def test_layout_option_flag_on_the_cli(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", "gpt-oss-mxfp4", ModelSizes(hidden_size=96, intermediate_size=96)).path
    code, _, err = mx("repack", src, tmp_path / "a", "--backend", "trtllm", "--layout-option", "intermediate_align=96")
    assert code == 2 and "intermediate_align=96" in err and "multiple of 128" in err
    code, _, err = mx("repack", src, tmp_path / "b", "--backend", "trtllm", "--layout-option", "colour")
    assert code == 2 and "expected NAME=VALUE" in err
    code, _, err = mx("repack", src, tmp_path / "c", "--backend", "marlin", "--layout-option", "intermediate_align=128")
    assert code == 2 and "has no option intermediate_align" in err and "marlin_scale_layout" in err
    code, _, err = mx("repack", src, tmp_path / "d", "--backend", "trtllm", "--layout-option", "intermediate_align=256", "--quiet")
    assert code == 0, err
    m = json.loads((tmp_path / "d" / "mxconv.json").read_text())  # I = 96: 256 here, 128 by default
    assert m["layout"]["options"] == {"intermediate_align": 256} and m["layout"]["padded_intermediate_size"] == 256
    code, stdout, _ = mx("repack", "--help")
    assert code == 0 and "intermediate_align" in stdout and "marlin_scale_layout" in stdout


def test_a_family_from_one_file_goes_through_quantize_and_repack(toy_family, toy_backend, tmp_path: Path) -> None:
    qwen = make_checkpoint(tmp_path / "qwen", "qwen3-moe").path
    toy = tmp_path / "toy"
    rename_to_toy(qwen, toy)
    code, stdout, err = mx("inspect", toy, "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["family"] == "toy-moe" and doc["model"]["num_experts"] == 4 and doc["model"]["routing"] == "softmax_topk"
    code, _, err = mx("quantize", toy, tmp_path / "q4", "--quiet", "--device", "cpu")
    assert code == 0, err
    code, _, err = mx("verify", tmp_path / "q4", "--reference", toy, "--tokens", "16")
    assert code == 0, err
    code, _, err = mx("repack", tmp_path / "q4", tmp_path / "k", "--backend", "marlin", "--quiet", "--device", "cpu")
    assert code == 0, err
    code, _, err = mx("verify", tmp_path / "k", "--reference", tmp_path / "q4", "--tokens", "16")
    assert code == 0, err
    code, _, err = mx("repack", toy, tmp_path / "t", "--backend", "toy", "--quiet", "--device", "cpu")  # bf16 source
    assert code == 0, err
    code, _, err = mx("verify", tmp_path / "t", "--reference", toy, "--tokens", "16", "--kernel")
    assert code == 0, err


def test_without_its_registry_line_the_toy_family_is_unknown(tmp_path: Path) -> None:
    qwen = make_checkpoint(tmp_path / "qwen", "qwen3-moe").path
    rename_to_toy(qwen, tmp_path / "toy")
    code, _, err = mx("inspect", tmp_path / "toy")
    assert code == 2 and "unknown model family" in err and "toy_moe" in err


def test_make_checkpoint_refuses_sizes_given_as_options(tmp_path: Path) -> None:
    """A size passed where the kind's options go would be ignored by its generator: refused, naming ModelSizes."""
    with pytest.raises(TypeError, match=r"hidden_size belong in the sizes: .*ModelSizes\(hidden_size=128\)"):
        make_checkpoint(tmp_path / "x", "qwen3-moe", hidden_size=128)
    assert not (tmp_path / "x").exists()
    assert make_checkpoint(tmp_path / "y", "qwen3-moe", ModelSizes(hidden_size=128)).hidden_size == 128


def test_make_checkpoint_refuses_an_option_its_kind_does_not_take(tmp_path: Path) -> None:
    """A misspelled option, or one of another kind, used to be dropped by the kind's generator: now a BadInput
    naming the option, the kind and the options that kind takes, before anything is written."""
    from mxconv import examples

    with pytest.raises(BadInput, match=r"kind 'qwen3-moe' takes no option mlp_only_layer \(its options: dtype, mlp_only_layers\)"):
        examples.make_checkpoint(tmp_path / "x", "qwen3-moe", mlp_only_layer=(0,))
    with pytest.raises(BadInput, match=r"kind 'qwen3-moe' takes no option head_dim \(its options: dtype, mlp_only_layers\)"):
        examples.make_checkpoint(tmp_path / "x", "qwen3-moe", head_dim=32)  # a gpt-oss option
    with pytest.raises(BadInput, match=r"kind 'deepseek-v3-fp8' takes no option input_scales \(its options: num_nextn_predict_layers\)"):
        make_checkpoint(tmp_path / "x", "deepseek-v3-fp8", input_scales=False)  # the test suite's kinds too
    assert not (tmp_path / "x").exists()
    assert examples.make_checkpoint(tmp_path / "g", "gpt-oss-bf16", ModelSizes(num_layers=1), head_dim=32).config["head_dim"] == 32
