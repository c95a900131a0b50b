"""Where a run's time went: seconds per pipeline stage (always, for the summary) and, with
``--trace FILE`` (``trace=`` in the Python API), every stage of every item on one timeline, written
to FILE as JSON (``scripts/bench_e2e.py`` reads it)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence


class TracedItem(Protocol):
    """What a trace records of a work item (:class:`mxconv.run.pipeline.WorkItem`)."""

    kind: str
    in_bytes: int
    experts: tuple[int, int] | None
    payload: Any


@dataclass
class StageTimes:
    """Seconds spent per stage (load summed over reader threads) and waiting between stages."""

    load_s: float = 0.0
    compute_s: float = 0.0
    write_s: float = 0.0
    wait_for_load_s: float = 0.0  # main thread idle, waiting for a reader
    wait_for_writer_s: float = 0.0  # main thread blocked on a full write queue
    # (stage, item index, start, end) in seconds since ``origin``, when tracing (``--trace``)
    events: list[tuple[str, int, float, float]] | None = field(default=None, repr=False)
    origin: float = field(default=0.0, repr=False)

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.__dict__.items() if k.endswith("_s")}

    def mark(self, stage: str, index: int, t0: float, t1: float) -> None:
        """Record one stage of item ``index`` (perf_counter times) when tracing."""
        if self.events is not None:
            self.events.append((stage, index, round(t0 - self.origin, 4), round(t1 - self.origin, 4)))


def write_trace(path: Path, items: Sequence[TracedItem], times: StageTimes) -> None:
    """Write the run's timeline as JSON: the items (kind, bytes read, layer, experts) and every
    traced stage as ``[stage, item index, start s, end s]`` (item -1: the run's setup and finish)."""
    doc = {
        "items": [
            {"kind": i.kind, "in_bytes": i.in_bytes, "experts": i.experts,
             "layer": getattr(i.payload, "layer", None)}
            for i in items
        ],
        "events": times.events or [],
        "stage_seconds": times.to_json(),
        # wall-clock time of the timer's start, to place the timeline within the whole process
        "origin_epoch": time.time() - (time.perf_counter() - times.origin),
    }
    path.write_text(json.dumps(doc))
