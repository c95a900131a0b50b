"""``mxconv --help`` and ``mxconv inspect`` import no torch (nor triton): they start in well under a
second. Each check runs in a fresh interpreter, since this one has torch loaded already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.workspace import MadeCheckpoints, link_workspace

SRC = str(Path(__file__).resolve().parents[1] / "src")

# Runs ``mxconv ARGS`` in-process for each argument list of argv[1] (JSON), then fails naming the
# heavy modules it imported.
_PROBE = """
import json, sys
from typer.testing import CliRunner
from mxconv.cli import app
want = int(sys.argv[2]) if len(sys.argv) > 2 else 0
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == want, (args, r.exit_code, r.output, r.exception)
heavy = sorted(m for m in ("torch", "triton") if m in sys.modules)
assert not heavy, f"imported {heavy}"
"""


def _probe(*commands: list[str], exit_code: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(commands)), str(exit_code)], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def outputs(made: MadeCheckpoints, tmp_path_factory) -> Path:
    """Two sources (per-expert bf16, gpt-oss MXFP4), a kernel layout, a TP=2 kernel output and an
    MXFP8-linears output."""
    qwen, gpt = made.source("qwen3-moe").path, made.source("gpt-oss-mxfp4").path
    return link_workspace(tmp_path_factory.mktemp("startup"), {
        "qwen": qwen, "gpt": gpt, "gpt-triton": made.repack(gpt, "triton"),
        "qwen-marlin-tp2": made.repack(qwen, "marlin", "--tp", "2"),
        "qwen-mxfp8": made.quantize(qwen, "--format", "mxfp8", "--targets", "linear")})


def test_help_imports_no_torch() -> None:
    r = _probe(["--help"], *([command, "--help"] for command in ("quantize", "repack", "inspect", "verify", "demo")))
    assert r.returncode == 0, r.stderr


def test_inspect_imports_no_torch(outputs: Path) -> None:
    dirs = ("qwen", "gpt", "gpt-triton", "qwen-marlin-tp2", "qwen-marlin-tp2/rank-1", "qwen-mxfp8")
    r = _probe(*(["inspect", str(outputs / d), *extra] for d in dirs for extra in ([], ["--json"])))
    assert r.returncode == 0, r.stderr


def test_bad_arguments_are_refused_before_torch_is_imported(outputs: Path, tmp_path: Path) -> None:
    """A typo costs no torch import (seconds) in any command: each of these exits 2 with torch never loaded."""
    out = str(outputs / "gpt-triton")
    bad = [
        ["verify", "/no/such"], ["verify", str(outputs / "qwen")], ["verify", out, "--reference", "/no/such"],
        ["verify", out, "--reference-outputs", "/no/such"], ["verify", out, "--tokens", "0"],
        ["inspect", "/no/such"], ["quantize", "/no/such", str(tmp_path / "q")], ["quantize", out, str(tmp_path / "q")],
        ["repack", "/no/such", str(tmp_path / "r"), "--backend", "marlin"],
        ["repack", str(outputs / "qwen"), str(tmp_path / "r"), "--backend", "no-such-backend"],
        ["demo", "--workdir", "/proc/no-such/dir"],
    ]
    r = _probe(*bad, exit_code=2)
    assert r.returncode == 0, r.stderr


def test_the_console_entry_point_keeps_output_and_exit_codes(outputs: Path, tmp_path: Path) -> None:
    """``mxconv`` (cli.main) in a real process: the JSON summary is complete on stdout, errors on
    stderr, and the exit codes are the commands' own."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    run = lambda *a: subprocess.run([sys.executable, "-m", "mxconv.cli", *map(str, a)], env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    r = run("quantize", outputs / "qwen", tmp_path / "out", "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tensors_out"] > 0 and (tmp_path / "out" / "mxconv.json").is_file()
    r = run("verify", tmp_path / "out")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].startswith("PASS (integrity, layout;"), r.stdout + r.stderr
    (tmp_path / "out" / "model.safetensors").write_bytes(b"")  # a stray weight file: verify fails (exit 1)
    r = run("verify", tmp_path / "out")
    assert r.returncode == 1 and "FAIL" in r.stdout, r.stdout + r.stderr
    r = run("quantize", outputs / "qwen", tmp_path / "out", "--device", "cpu")  # OUTPUT exists: exit 2
    assert r.returncode == 2 and "error:" in r.stderr, r.stderr
