"""The mxconv CLI in-process (Typer's CliRunner), for tests."""

from __future__ import annotations

from typer.testing import CliRunner

from mxconv.cli import app

runner = CliRunner()


def mx(*args: object, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``mxconv ARGS...`` (each argument str()-ed): (exit code, stdout, stderr)."""
    r = runner.invoke(app, [str(a) for a in args], env=env)
    return r.exit_code, r.stdout, r.stderr
