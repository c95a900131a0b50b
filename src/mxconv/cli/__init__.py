"""The ``mxconv`` command line (Typer + rich), one module per command in the huggingface_hub style.

:mod:`mxconv.cli.common` holds the app, the shared option declarations and the error handling
(exit codes 0/1/2/3), :mod:`mxconv.cli.output` the consoles and progress; each command module
registers one command on the app. Importing the package imports neither torch nor triton:
commands import them when they compute.
"""

from __future__ import annotations

import os
import sys

from mxconv.interrupt import process_signals

# A Ctrl-C while the CLI's modules load exits 2 with one line, not a KeyboardInterrupt traceback
# (docs/reliability.md): the handler is in place before typer, rich and the commands are imported.
with process_signals():
    from mxconv.cli import demo, inspect, quantize, repack, verify  # noqa: F401 - each registers its command
    from mxconv.cli.common import app


def main() -> None:
    """Console-script entry point (``mxconv``).

    Once a command that imported torch has finished (its output complete, or cleaned up after a
    failure, and every helper thread and child process joined), the process leaves with
    ``os._exit`` after flushing its streams: the interpreter's teardown of torch and CUDA takes
    0.5 s on the CI machine and more with a CUDA context, and has nothing left to do.

    SIGINT and SIGTERM are handled for the whole run (:func:`mxconv.interrupt.process_signals`):
    before the command starts they exit 2, inside it they stop it cleanly, after it they are ignored.
    """
    with process_signals():
        _run()


def _run() -> None:
    try:
        app()
    except SystemExit as exc:
        if "torch" not in sys.modules:
            raise
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe (mxconv ... | head -c 10): output was lost
                code = code or 120  # what Python's own exit says when its final flush fails
        os._exit(code)


__all__ = ["app", "main"]
