"""Finding a checkpoint's routed-expert tensors by name, the first step of a reader's plan."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable


def expert_names(names: Iterable[str], pattern: re.Pattern[str]) -> tuple[set[str], dict[int, list[re.Match[str]]]]:
    """The names ``pattern`` matches (named groups ``root``, the prefix before ``layers.``, and ``layer``):
    (every root seen, {layer: its names' matches, in the order of ``names``}, layers in order of first
    appearance). The reader refuses more (or fewer) than one root in its own words."""
    roots: set[str] = set()
    by_layer: dict[int, list[re.Match[str]]] = defaultdict(list)
    for name in names:
        m = pattern.match(name)
        if m:
            roots.add(m["root"])
            by_layer[int(m["layer"])].append(m)
    return roots, dict(by_layer)
