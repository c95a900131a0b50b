"""The ``mxconv`` command line (Typer + rich), one module per command in the huggingface_hub style.

:mod:`mxconv.cli.common` holds the app, the shared option declarations and the error handling
(exit codes 0/1/2/3), :mod:`mxconv.cli.output` the consoles and progress; each command module
registers one command on the app. Importing the package imports neither torch nor triton:
commands import them when they compute.
"""

from __future__ import annotations

import signal

from mxconv.interrupt import STOP_SIGNALS, process_signals

# A Ctrl-C while the CLI's modules load exits 2 with one line, not a KeyboardInterrupt traceback
# (docs/reliability.md): the handler is in place before typer, rich and the commands are imported.
with process_signals():
    from mxconv.cli import demo, inspect, quantize, repack, verify  # noqa: F401 - each registers its command
    from mxconv.cli.common import app


def main() -> None:
    """Console-script entry point (``mxconv``).

    SIGINT and SIGTERM are handled for the whole run (:func:`mxconv.interrupt.process_signals`):
    before the command starts they exit 2, inside it they stop it cleanly, after it they are ignored.
    """
    try:
        with process_signals():
            app()
    finally:
        # The process is leaving with its result: a signal during the interpreter's exit (atexit
        # hooks, torch's library finalizers) must not print a KeyboardInterrupt traceback over it.
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


__all__ = ["app", "main"]
