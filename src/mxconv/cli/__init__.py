"""The ``mxconv`` command line (Typer + rich), one module per command in the huggingface_hub style.

:mod:`mxconv.cli.common` holds the app, the consoles, the shared option declarations and the error
handling (exit codes 0/1/2/3); each command module registers one command on the app. Importing the
package imports neither torch nor triton: commands import them when they compute.
"""

from __future__ import annotations

from mxconv.cli import demo, inspect, quantize, repack, verify  # noqa: F401 - each registers its command
from mxconv.cli.common import app


def main() -> None:
    """Console-script entry point (``mxconv``)."""
    app()


__all__ = ["app", "main"]
