"""The README's set-up commands are what CI runs (so a missing step fails CI, not a memory)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


def test_ci_runs_the_readme_test_command() -> None:
    demo_cmd, test_cmd = _readme_commands()[:2]
    assert "mxconv demo" in demo_cmd and demo_cmd.startswith("pip install torch==2.13.0")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "python -m pip install torch==2.13.0" in ci
    assert ci[-1] == test_cmd, "the last line of .ci/run must be the README's test command verbatim"
    assert "pytest" in test_cmd


def test_pyproject_declares_console_script_and_deps() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'mxconv = "mxconv.cli:main"' in text
    for dep in ("typer", "rich", "torch", "safetensors>=0.6", "huggingface-hub", "triton"):
        assert dep in text
