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

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from mxconv.interrupt import deferred_signals
from mxconv.source.st_format import TensorInfo
from mxconv.output.writer import ShardedWriter, WriteCancelled, copy_tensor_to
from mxconv.run.trace import StageTimes

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


@dataclass(frozen=True)
class PipelineDepth:
    """How much the stages overlap: ``read_threads`` reading, ``prefetch`` computed items read ahead,
    ``queue_depth`` results queued for the writer (:mod:`mxconv.run.memory` plans the last two)."""

    read_threads: int = 2
    prefetch: int = 2
    queue_depth: int = 2


LoadFn = Callable[[WorkItem], Any]
ComputeFn = Callable[[WorkItem, Any], "list[dict[str, torch.Tensor]]"]


class _Stages:
    """The threads and queues of one :func:`run_pipeline` call: reader pool, this thread's compute
    loop (:meth:`feed`), the writer thread (:meth:`writer_loop`)."""

    def __init__(self, items: list[WorkItem], writers: list[ShardedWriter], load: LoadFn, compute: ComputeFn,
                 on_progress: Callable[[int], None] | None, times: StageTimes,
                 check_copy: Callable[[TensorInfo, int, bytes], None] | None, depth: PipelineDepth):
        self.items, self.writers, self.load, self.compute = items, writers, load, compute
        self.on_progress, self.times, self.check_copy = on_progress, times, check_copy
        self.q: queue.Queue = queue.Queue(maxsize=depth.queue_depth)
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.pending: list[tuple[int, WorkItem, Future | None]] = []
        self.load_lock = threading.Lock()
        self.writer = threading.Thread(target=self.writer_loop, name="mxconv-writer", daemon=True)
        self.writer.start()
        self.pool = ThreadPoolExecutor(max_workers=max(1, depth.read_threads), thread_name_prefix="mxconv-read")

    def write(self, item: WorkItem, results: list[dict[str, torch.Tensor]]) -> None:
        """Write one item's results (a byte copy: its tensors, read and hashed once for all ranks)."""
        if item.kind == "copy":
            for name in item.copy_names:
                copy_tensor_to(self.writers, name, self.check_copy)
        elif item.experts is None:
            for w, names, res in zip(self.writers, item.out_names, results):
                for name in names:
                    w.write_tensor(name, res[name])
        else:  # a group of experts: its per-expert tensors whole, its rows of the stacks
            for w, names, res in zip(self.writers, item.out_names, results):
                unplanned = set(res).difference(names)
                if unplanned:
                    raise RuntimeError(f"compute returned tensors the plan does not hold: {sorted(unplanned)[:3]}")
                for name in names:
                    if name in res:
                        w.write_part(name, res[name])

    def writer_loop(self) -> None:
        while True:
            got = self.q.get()
            if got is None:
                return
            if self.stop.is_set():  # a failure elsewhere: keep draining so nobody blocks on the queue
                continue
            index, item, results = got
            t0 = time.perf_counter()
            try:
                self.write(item, results)
                t1 = time.perf_counter()
                self.times.write_s += t1 - t0
                self.times.mark(item.kind if item.kind == "copy" else "write", index, t0, t1)
                if self.on_progress:
                    self.on_progress(item.in_bytes)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                if not isinstance(exc, WriteCancelled):
                    self.errors.append(exc)
                self.stop.set()
            del got, results

    def timed_load(self, i: int, item: WorkItem) -> Any:
        t0 = time.perf_counter()
        try:
            return self.load(item)
        finally:
            t1 = time.perf_counter()
            with self.load_lock:  # several reader threads add to the same total
                self.times.load_s += t1 - t0
                self.times.mark("load", i, t0, t1)

    def submit(self, i: int) -> None:
        item = self.items[i]
        self.pending.append((i, item, self.pool.submit(self.timed_load, i, item) if item.kind != "copy" else None))

    def feed(self, prefetch: int) -> None:
        """This thread's loop: keep ``prefetch`` computed items read ahead, compute each in order and
        queue its results for the writer."""
        items, times = self.items, self.times
        nxt = 0
        loaded_ahead = 0
        while nxt < len(items) and loaded_ahead < prefetch:
            if items[nxt].kind != "copy":
                loaded_ahead += 1
            self.submit(nxt)
            nxt += 1
        while self.pending:
            if self.stop.is_set():
                break
            index, item, fut = self.pending.pop(0)
            if fut is not None:
                t0 = time.perf_counter()
                data = fut.result()
                t1 = time.perf_counter()
                results = self.compute(item, data)
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
                self.submit(nxt)
                nxt += 1
            t0 = time.perf_counter()
            self.q.put((index, item, results))
            times.wait_for_writer_s += time.perf_counter() - t0
            del results

    def cancel(self) -> None:
        """A failure in this thread: the writer thread stops within one chunk, pending reads are dropped."""
        self.stop.set()
        for w in self.writers:
            w.cancel()
        for _index, _item, fut in self.pending:
            if fut is not None:
                fut.cancel()

    def join(self, failed: bool) -> None:
        """Stop and join every thread; raise the writer's failure when this thread had none.

        A signal is held until the threads are joined, so a Ctrl-C here cannot leave a thread
        writing; on a failure it is dropped, as the run is stopping already."""
        with deferred_signals(raise_held=not failed):
            self.q.put(None)
            self.writer.join()
            self.pool.shutdown(wait=True, cancel_futures=True)
            if self.stop.is_set():
                for w in self.writers:
                    w.abort()
        if self.errors and not failed:
            raise self.errors[0]


def run_pipeline(
    items: list[WorkItem],
    writers: list[ShardedWriter],
    load: LoadFn,
    compute: ComputeFn,
    *,
    depth: PipelineDepth = PipelineDepth(),
    on_progress: Callable[[int], None] | None = None,
    times: StageTimes | None = None,
    check_copy: Callable[[TensorInfo, int, bytes], None] | None = None,
) -> StageTimes:
    """Run ``items`` through load (threads) -> compute (this thread) -> write (one thread), as deep
    as ``depth``; ``check_copy`` sees each byte-copied tensor's chunks, ``on_progress`` each item's
    input bytes once written.

    Raises the first failure (of this thread, else of the writer) after every thread has stopped."""
    times = times if times is not None else StageTimes()
    stages = _Stages(items, writers, load, compute, on_progress, times, check_copy, depth)
    try:
        stages.feed(depth.prefetch)
    except BaseException:
        failed = True
        stages.cancel()
        raise
    else:
        failed = False
    finally:
        stages.join(failed)
    return times
