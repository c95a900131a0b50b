"""Error types that map onto the CLI's exit codes (see ../shared/docs/contract.md)."""

from __future__ import annotations


class MxconvError(Exception):
    """Base class: an expected failure the CLI reports without a traceback."""

    exit_code = 2


class BadInput(MxconvError):
    """Bad usage or bad input (exit 2). The message names the file, tensor and reason."""

    exit_code = 2


class LayoutError(BadInput):
    """A tensor cannot be put into (or taken out of) a backend layout: wrong shape, size rule, padding."""


class VerificationFailed(MxconvError):
    """A converted checkpoint does not match what it claims (exit 1)."""

    exit_code = 1
