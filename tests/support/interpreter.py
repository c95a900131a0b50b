"""Triton kernels checked on CPU: a test module's ``_interpreter_main()`` runs in a subprocess under
the Triton interpreter (``TRITON_INTERPRET=1`` must be set before triton is imported) and prints one
JSON report line, which the test reads back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

TESTS = Path(__file__).resolve().parents[1]


def print_report(report: Any) -> None:
    """What ``_interpreter_main()`` ends with (the line :func:`interpreter_report` reads)."""
    print("REPORT" + json.dumps(report))


def interpreter_report(test_module: str) -> Any:
    """Run ``<test_module>._interpreter_main()`` (a module of tests/) under the Triton interpreter
    in a subprocess and return its report; skips without triton."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import {test_module} as t; t._interpreter_main()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1]
    return json.loads(line[len("REPORT") :])


def torch_then_kernels(layout_module: Any, kernels: Any, run: Callable[[], Any]) -> tuple[Any, Any]:
    """``run()`` with ``layout_module.layout_kernels`` forced to the torch path, then to ``kernels``:
    (reference, kernel result)."""
    layout_module.layout_kernels = lambda t: None
    ref = run()
    layout_module.layout_kernels = lambda t: kernels
    return ref, run()
