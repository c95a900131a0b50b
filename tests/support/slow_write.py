"""Run the mxconv CLI with a slow writer: ``python slow_write.py SECONDS ARGS...``.

The writer pauses SECONDS after every tensor it completes, so that a test can signal a run while it
is writing, at a predictable point however fast the machine (tests/test_interrupt.py). Cancelling
the writer (:meth:`ShardedWriter.cancel`, :meth:`ShardedWriter.abort`) cuts a pause short with
:class:`WriteCancelled`, as a write would. The pause is patched in here, on the test side:
production code has no hook for it.
"""

from __future__ import annotations

import sys
import threading

from mxconv.cli import main
from mxconv.output.writer import ShardedWriter, WriteCancelled


def _pause_cut_short(writer: ShardedWriter) -> threading.Event:
    """The event that ends ``writer``'s pauses, set once the writer is cancelled or aborted."""
    return vars(writer).setdefault("pause_cut_short", threading.Event())


def slow_down_writer(seconds: float) -> None:
    """Make every :class:`ShardedWriter` wait ``seconds`` after each tensor it completes."""
    complete_tensor, cancel, abort = ShardedWriter._end, ShardedWriter.cancel, ShardedWriter.abort

    def complete_then_pause(self: ShardedWriter, planned, digest: str) -> None:
        complete_tensor(self, planned, digest)
        if _pause_cut_short(self).wait(seconds):
            raise WriteCancelled()

    def cancel_and_cut_pause(self: ShardedWriter) -> None:
        _pause_cut_short(self).set()
        cancel(self)

    def abort_and_cut_pause(self: ShardedWriter) -> None:
        _pause_cut_short(self).set()
        abort(self)

    ShardedWriter._end = complete_then_pause  # type: ignore[method-assign]
    ShardedWriter.cancel = cancel_and_cut_pause  # type: ignore[method-assign]
    ShardedWriter.abort = abort_and_cut_pause  # type: ignore[method-assign]


if __name__ == "__main__":
    slow_down_writer(float(sys.argv[1]))
    sys.argv = ["mxconv", *sys.argv[2:]]
    main()
