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
import torch

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


def report_fixture(test_module: str) -> Any:
    """A module-scoped ``interpreter_report`` fixture: :func:`interpreter_report` of ``test_module``."""

    @pytest.fixture(scope="module", name="interpreter_report")
    def fixture() -> Any:
        return interpreter_report(test_module)

    return fixture


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of tensors whose keys/shape/dtype/bytes differ (empty list = identical)."""
    if a.keys() != b.keys():
        return [f"keys {sorted(a)} != {sorted(b)}"]
    bad = []
    for name in a:
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            bad.append(f"{name}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(x.cpu().contiguous().view(torch.uint8), y.cpu().contiguous().view(torch.uint8)):
            bad.append(name)
    return bad


def kernels_match_torch(layout_module: Any, kernels: Any, run: Callable[[], dict[str, torch.Tensor]]) -> bool:
    """Whether ``run()`` gives the same bytes with ``layout_module.layout_kernels`` forced to the
    torch path and to ``kernels``."""
    layout_module.layout_kernels = lambda t, choice: None
    ref = run()
    layout_module.layout_kernels = lambda t, choice: kernels
    return not same_bytes(run(), ref)
