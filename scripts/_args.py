"""Command-line pieces the benchmark scripts share (each script imports this from its own folder)."""

from __future__ import annotations

import argparse


def parser(doc: str | None, *, experts: int | None = None, hidden: int = 2880, intermediate: int = 2880) -> argparse.ArgumentParser:
    """An argument parser describing the script with ``doc`` (its module docstring), with
    ``--hidden`` / ``--intermediate`` and, where ``experts`` is given, ``--experts`` (those defaults)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if experts is not None:
        ap.add_argument("--experts", type=int, default=experts)
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--intermediate", type=int, default=intermediate)
    return ap
