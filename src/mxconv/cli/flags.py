"""The one place where the library's setting names become the CLI's flags.

Library errors, warnings and reports name settings the way a Python caller writes them
(``QuantOptions.fmt``, ``RunSettings.overwrite``); a CLI user set flags, so :func:`in_cli_words`
rewrites the text with :data:`SETTING_FLAGS` where the CLI prints it (``cli.output.say``, the JSON
documents and summary tables through :func:`doc_in_cli_words`, inspect's notes). ``set X`` reads ``pass --flag`` on the command
line, ``unset X`` reads ``drop --flag``. ``tests/test_cli_flags.py`` checks that every setting a
library message names is in the table and that every flag in it is one the CLI declares.
"""

from __future__ import annotations

import re
from typing import Any

SETTING_FLAGS: dict[str, str] = {
    "QuantOptions.fmt": "--format",
    "QuantOptions.scale_rounding": "--scale-rounding",
    "QuantOptions.allow_nonfinite": "--allow-nonfinite",
    "QuantOptions.include": "--include",
    "QuantOptions.ignore": "--ignore",
    "QuantOptions.targets": "--targets",
    "QuantOptions.skip_unaligned": "--skip-unaligned",
    "QuantOptions.require_exact": "--require-exact",
    "RepackOptions.backend": "--backend",
    "RepackOptions.activation": "--activation",
    "RepackOptions.tp": "--tp",
    "RepackOptions.layout_options": "--layout-option",
    "RepackOptions.weight_format": "--format",
    "RunSettings.overwrite": "--overwrite",
    "RunSettings.max_shard_size": "--max-shard-size",
    "RunSettings.trace": "--trace",
    "MemoryBudget.host": "--max-memory",
    "MemoryBudget.gpu": "--max-gpu-memory",
    "VerifyOptions.reference": "--reference",
    "VerifyOptions.reference_outputs": "--reference-outputs",
    "VerifyOptions.save_reference": "--save-reference",
    "VerifyOptions.layers": "--layers",
    "VerifyOptions.tokens": "--tokens",
    "VerifyOptions.seed": "--seed",
    "VerifyOptions.kernel": "--kernel",
    "VerifyOptions.strict": "--strict",
    "KernelLocations.triton_kernels": "--triton-kernels",
    "KernelLocations.marlin_ops": "--marlin-ops",
}

_SETTING = re.compile(r"\b(?:(set|unset|Set|Unset) )?([A-Z][A-Za-z]+\.[a-z_]+)\b")
# "RepackOptions.layout_options NAME=VALUE" reads "--layout-option NAME=VALUE" as it is.
_VERBS = {"set": "pass", "Set": "Pass", "unset": "drop", "Unset": "Drop"}


def in_cli_words(message: str) -> str:
    """``message`` with every setting of :data:`SETTING_FLAGS` named by its flag (others unchanged)."""

    def flag(match: re.Match[str]) -> str:
        verb, setting = match.group(1), match.group(2)
        if setting not in SETTING_FLAGS:
            return match.group(0)
        return f"{_VERBS[verb]} {SETTING_FLAGS[setting]}" if verb else SETTING_FLAGS[setting]

    return _SETTING.sub(flag, message)


def doc_in_cli_words(value: Any) -> Any:
    """A JSON-like document (dicts, lists, strings) with every string put through :func:`in_cli_words`:
    the summaries, reports and notes the CLI prints or writes as ``--json``."""
    if isinstance(value, str):
        return in_cli_words(value)
    if isinstance(value, dict):
        return {k: doc_in_cli_words(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [doc_in_cli_words(v) for v in value]
    return value
