"""The README's set-up commands are what CI runs (so a missing step fails CI, not a memory)."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


def test_ci_runs_the_readme_set_up_commands_in_a_fresh_venv() -> None:
    demo_cmd, test_cmd = _readme_commands()[:2]
    assert "mxconv demo" in demo_cmd and demo_cmd.startswith("pip install torch==2.13.0")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "set -euo pipefail" in ci
    # a fresh environment: what the CI host's own Python has installed cannot hide a missing dependency
    assert 'python3 -m venv "$venv"' in ci, ".ci/run must make its own virtual environment"
    venv = ci.index('python3 -m venv "$venv"')
    assert ci.index('source "$venv/bin/activate"') > venv
    assert "--system-site-packages" not in "\n".join(ci)
    torch = ci.index("python -m pip install torch==2.13.0")
    # bash's errexit ignores a failure before an && list's last command: `|| exit` makes it count
    demo_line = f"{demo_cmd} || exit"
    assert demo_line in ci, "a line of .ci/run must be the README's demo command verbatim, then ` || exit`"
    assert venv < torch < ci.index(demo_line) < len(ci) - 1
    assert ci[-1] == test_cmd, "the last line of .ci/run must be the README's test command verbatim"
    assert "pytest" in test_cmd


def test_readme_test_command_installs_flashinfer_for_its_comparison_tests() -> None:
    test_cmd = _readme_commands()[1]
    assert '--no-deps "flashinfer-python==' in test_cmd
    assert '".[test]"' in test_cmd


def test_installed_flashinfer_imports() -> None:
    """flashinfer-python comes without its dependencies (README test command): what its import needs
    must come from the test extra, or its comparison tests skip and CI stays green without them."""
    try:
        fi_version = version("flashinfer-python")
    except PackageNotFoundError:
        pytest.skip("flashinfer-python is not installed (the README's test command installs it)")
    try:  # the modules the FlashInfer comparison tests take their helpers from
        import flashinfer.fused_moe.core  # noqa: F401
        import flashinfer.utils  # noqa: F401
        from flashinfer.fused_moe import convert_to_block_layout  # noqa: F401
        from flashinfer.quantization.fp4_quantization import shuffle_matrix_a  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure silently skips those tests
        pytest.fail(
            f"flashinfer-python {fi_version} is installed but cannot be imported: {exc!r}; "
            "declare what its import needs in the test extra of pyproject.toml"
        )


def test_pyproject_declares_console_script_and_deps() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'mxconv = "mxconv.cli:main"' in text
    for dep in ("typer", "rich", "torch", "safetensors>=0.6", "huggingface-hub", "triton"):
        assert dep in text
