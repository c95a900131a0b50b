"""Error types that map onto the CLI's exit codes (see ../shared/docs/contract.md).

A failed verification is not an exception: ``verify`` returns a report and the CLI exits 1.
"""

from __future__ import annotations


class MxconvError(Exception):
    """Base class: an expected failure the CLI reports without a traceback. The message speaks the
    library: it names settings as a Python caller writes them (``QuantOptions.fmt``,
    ``RunSettings.overwrite``); the CLI names them by their flags (:mod:`mxconv.cli.flags`)."""

    exit_code = 2


class BadInput(MxconvError):
    """Bad usage or bad input (exit 2). The message names the file, tensor and reason."""

    exit_code = 2


class Unsupported(BadInput):
    """Input that may well be sound but that this mxconv cannot read (a manifest format newer than it
    knows, a backend not registered in this process): exit 2, never "verification failed", since
    nothing says the files are damaged."""


class OutputDamaged(BadInput):
    """An mxconv output's own files are not what its manifest says: a malformed ``mxconv.json``, a
    file name in it that leaves the output's directory, a tensor missing from the file named for it or
    stored there with another shape or dtype. Exit 2 where the output is read as an input (the loader,
    ``inspect``, a ``repack`` SOURCE); ``verify`` reports it as a failed verification (exit 1)."""


class LayoutError(BadInput):
    """A tensor cannot be put into (or taken out of) a backend layout: wrong shape, size rule, padding."""

