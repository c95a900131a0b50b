"""Overlapped read -> compute -> write over an ordered list of work items.

    reader threads (safetensors reads, CPU)  --bounded window-->  main thread (H2D, kernels, D2H)
        --bounded queue-->  writer thread (shard files, sha256)

Host memory is bounded by ``prefetch`` items being read, one being computed and ``queue_depth``
waiting to be written (plus the one the writer holds and the one waiting to be queued); the GPU
holds one item at a time. :mod:`mxconv.run.memory` plans both numbers and the items themselves from the
``--max-memory`` budget: an item is a whole MoE layer, or a group of its experts whose results are
runs of dim-0 rows of the layer's ``[E, ...]`` tensors (or whole per-expert tensors), written with
:meth:`~mxconv.output.writer.ShardedWriter.write_part`. Items keep their order end to end, which is what
lets every shard header be written before its data.

On any failure (an error in a stage, or SIGINT/SIGTERM raised in the main thread as
:class:`mxconv.interrupt.Interrupted`) the writers are cancelled between chunks, pending reads are
dropped, every thread is joined and the writers' temporary files are deleted before the exception
leaves :func:`run_pipeline`; the caller's :class:`mxconv.output.directory.OutputTarget` removes the rest.

torch is named in type annotations only (imported under TYPE_CHECKING), so ``mxconv inspect`` stays torch-free.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from mxconv.interrupt import deferred_signals
from mxconv.source.st_format import TensorInfo
from mxconv.output.writer import ShardedWriter, WriteCancelled, copy_tensor_to

if TYPE_CHECKING:
    import torch


@dataclass
class WorkItem:
    """One unit of work: a group of tensors copied byte for byte, or one MoE layer (or a group of
    its experts)."""

    kind: str  # "copy" | "layer" | "linear" (one layer's linears, mxconv.run.linears): all but "copy" are loaded and computed
    in_bytes: int
    copy_names: list[str] = field(default_factory=list)  # for "copy": tensor names, in plan order
    payload: Any = None  # for "layer": whatever load/compute need (e.g. a MoELayerRef)
    # for "layer": per destination writer, the tensor names this item writes, in plan order (a group
    # of experts: the layer's names; it writes its own experts' tensors and its part of the stacks)
    out_names: list[list[str]] = field(default_factory=list)
    experts: tuple[int, int] | None = None  # for "layer": experts [e0, e1) only (None: all)


TRACE_ENV = "MXCONV_TRACE"  # a file path: the run writes its timeline there (scripts/bench_e2e.py reads it)

LoadFn = Callable[[WorkItem], Any]
ComputeFn = Callable[[WorkItem, Any], "list[dict[str, torch.Tensor]]"]


@dataclass
class StageTimes:
    """Seconds spent per stage (load summed over reader threads) and waiting between stages."""

    load_s: float = 0.0
    compute_s: float = 0.0
    write_s: float = 0.0
    wait_for_load_s: float = 0.0  # main thread idle, waiting for a reader
    wait_for_writer_s: float = 0.0  # main thread blocked on a full write queue
    # (stage, item index, start, end) in seconds since ``origin``, when tracing (``MXCONV_TRACE``)
    events: list[tuple[str, int, float, float]] | None = field(default=None, repr=False)
    origin: float = field(default=0.0, repr=False)

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.__dict__.items() if k.endswith("_s")}

    def mark(self, stage: str, index: int, t0: float, t1: float) -> None:
        """Record one stage of item ``index`` (perf_counter times) when tracing."""
        if self.events is not None:
            self.events.append((stage, index, round(t0 - self.origin, 4), round(t1 - self.origin, 4)))


def run_pipeline(
    items: list[WorkItem],
    writers: list[ShardedWriter],
    load: LoadFn,
    compute: ComputeFn,
    on_progress: Callable[[int], None] | None = None,
    read_threads: int = 2,
    prefetch: int = 2,
    queue_depth: int = 2,
    times: StageTimes | None = None,
    check_copy: Callable[[TensorInfo, int, bytes], None] | None = None,
) -> StageTimes:
    """Run ``items`` through load (threads) -> compute (this thread) -> write (one thread);

    Raises the first failure (of this thread, else of the writer) after every thread has stopped."""
    times = times if times is not None else StageTimes()
    q: queue.Queue = queue.Queue(maxsize=queue_depth)
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer_loop() -> None:
        while True:
            got = q.get()
            if got is None:
                return
            if stop.is_set():  # a failure elsewhere: keep draining so nobody blocks on the queue
                continue
            index, item, results = got
            t0 = time.perf_counter()
            try:
                if item.kind == "copy":
                    for name in item.copy_names:
                        copy_tensor_to(writers, name, check_copy)  # read and hashed once for all ranks
                elif item.experts is None:
                    for w, names, res in zip(writers, item.out_names, results):
                        for name in names:
                            w.write_tensor(name, res[name])
                else:  # a group of experts: its per-expert tensors whole, its rows of the stacks
                    for w, names, res in zip(writers, item.out_names, results):
                        unplanned = set(res).difference(names)
                        if unplanned:
                            raise RuntimeError(f"compute returned tensors the plan does not hold: {sorted(unplanned)[:3]}")
                        for name in names:
                            if name in res:
                                w.write_part(name, res[name])
                t1 = time.perf_counter()
                times.write_s += t1 - t0
                times.mark(item.kind if item.kind == "copy" else "write", index, t0, t1)
                if on_progress:
                    on_progress(item.in_bytes)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                if not isinstance(exc, WriteCancelled):
                    errors.append(exc)
                stop.set()
            del got, results

    wt = threading.Thread(target=writer_loop, name="mxconv-writer", daemon=True)
    wt.start()
    pending: list[tuple[int, WorkItem, Future | None]] = []
    pool = ThreadPoolExecutor(max_workers=max(1, read_threads), thread_name_prefix="mxconv-read")

    load_lock = threading.Lock()

    def timed_load(i: int, item: WorkItem) -> Any:
        t0 = time.perf_counter()
        try:
            return load(item)
        finally:
            t1 = time.perf_counter()
            with load_lock:  # several reader threads add to the same total
                times.load_s += t1 - t0
                times.mark("load", i, t0, t1)

    def submit(i: int) -> None:
        item = items[i]
        pending.append((i, item, pool.submit(timed_load, i, item) if item.kind != "copy" else None))

    try:
        nxt = 0
        loaded_ahead = 0
        while nxt < len(items) and loaded_ahead < prefetch:
            if items[nxt].kind != "copy":
                loaded_ahead += 1
            submit(nxt)
            nxt += 1
        while pending:
            if stop.is_set():
                break
            index, item, fut = pending.pop(0)
            if fut is not None:
                t0 = time.perf_counter()
                data = fut.result()
                t1 = time.perf_counter()
                results = compute(item, data)
                t2 = time.perf_counter()
                times.wait_for_load_s += t1 - t0
                times.compute_s += t2 - t1
                times.mark("compute", index, t1, t2)
                del data
                loaded_ahead -= 1
            else:
                results = []
            while nxt < len(items) and (items[nxt].kind == "copy" or loaded_ahead < prefetch):
                if items[nxt].kind != "copy":
                    loaded_ahead += 1
                submit(nxt)
                nxt += 1
            t0 = time.perf_counter()
            q.put((index, item, results))
            times.wait_for_writer_s += time.perf_counter() - t0
            del results
    except BaseException:
        failed = True
        stop.set()
        for w in writers:
            w.cancel()  # the writer thread stops within one chunk instead of finishing its item
        for _index, _item, fut in pending:
            if fut is not None:
                fut.cancel()
        raise
    else:
        failed = False
    finally:
        # A signal is held until the threads are joined, so a Ctrl-C here cannot leave a thread
        # writing; on a failure it is dropped, as the run is stopping already.
        with deferred_signals(raise_held=not failed):
            q.put(None)
            wt.join()
            pool.shutdown(wait=True, cancel_futures=True)
            if stop.is_set():
                for w in writers:
                    w.abort()
        if errors and not failed:
            raise errors[0]
    return times


def write_trace(path: Path, items: list[WorkItem], times: StageTimes) -> None:
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
