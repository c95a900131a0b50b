"""The tensors a conversion copies byte for byte, written by a child process while the parent
starts.

A conversion spends its first seconds importing torch (4.5-5 s on the GPU machine) and starting
CUDA. Reading ahead (:mod:`mxconv.readahead`) keeps the disk busy meanwhile, but a run that is
bound by writes (a repack writes more than it reads: 15.2 GB out of 13.8 GB in for gpt-oss-20b to
trtllm) cannot catch up by reading. Every tensor mxconv copies as is (embeddings, head,
attention, norms, routers) is known from the headers alone and needs no torch, so a small child
process writes them while the parent imports torch, then goes on beside the parent's pipeline.

Output shape: the copied tensors fill the first shards (``model-00001-of-N`` ...), in plan order,
and the converted tensors the shards after them, with or without this child (the in-process path
copies first too), so the output is the same bytes either way. The child runs the same
:class:`~mxconv.writer.ShardedWriter` and :func:`~mxconv.writer.copy_tensor_to` (temporary names,
fsync, rename; sha256 of every tensor; NaN/Inf refused by :mod:`mxconv.copy_check` unless
``--allow-nonfinite``), on its own shards only, and reports each tensor's entry back; the parent
writes the index and the manifest once both are done.

Protocol: the job is one JSON document on the child's stdin; the child writes JSON lines on
stdout: ``{"progress": bytes}`` per tensor, then ``{"written": [...]}`` (one table per TP rank) or
``{"error": kind, "message": ...}``. SIGTERM (the parent stopping: failure, Ctrl-C) makes it stop
within one 64 MiB chunk and delete its unfinished files; it also stops when its parent is gone.
SIGINT is the parent's to handle.

This module imports no torch, on purpose.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from mxconv.errors import BadInput
from mxconv.layouts.base import TensorSpec
from mxconv.memory import process_peak_rss
from mxconv.output_dir import OutputWriteError
from mxconv.st_format import TensorInfo
from mxconv.writer import PlannedTensor, ShardPlan, ShardedWriter, WriteCancelled, WrittenTensor, copy_tensor_to

STOP_TIMEOUT_S = 30.0  # a stopped child deletes its unfinished shards within one chunk; then it is killed


# ---- the job, as JSON -------------------------------------------------------------------------

def _tensor_json(t: PlannedTensor) -> dict[str, Any]:
    src = t.source
    assert src is not None, f"{t.name} is not a byte copy"
    return {"name": t.name, "shape": list(t.spec.shape), "dtype": t.spec.st_dtype, "role": t.role,
            "source": {"name": src.name, "file": str(src.file), "dtype": src.dtype, "shape": list(src.shape),
                       "begin": src.begin, "end": src.end}}


def _tensor_from_json(d: dict[str, Any]) -> PlannedTensor:
    s = d["source"]
    src = TensorInfo(s["name"], Path(s["file"]), s["dtype"], tuple(s["shape"]), s["begin"], s["end"])
    return PlannedTensor(d["name"], TensorSpec(tuple(d["shape"]), d["dtype"]), d["role"], src)


def job_json(ranks: list[tuple[Path, Path, list[ShardPlan]]], names: list[str], check: bool) -> dict[str, Any]:
    """The child's job: per rank (directory, directory shown in messages, its copy shards), the
    tensors to copy in order, and whether NaN/Inf are refused."""
    return {
        "parent": os.getpid(),
        "check_nonfinite": check,
        "names": names,
        "ranks": [{"dir": str(d), "display_dir": str(shown),
                   "shards": [{"file": s.file, "tensors": [_tensor_json(t) for t in s.tensors]} for s in shards]}
                  for d, shown, shards in ranks],
    }


# ---- the child --------------------------------------------------------------------------------

def _emit(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def run_job(job: dict[str, Any], on_tensor: Callable[[int], None] = lambda n: None,
            writers: list[ShardedWriter] | None = None,
            stopping: threading.Event | None = None) -> list[dict[str, WrittenTensor]]:
    """Copy the job's tensors into its shards (what the child does; also callable in process).
    Fills ``writers`` as it creates them (the caller cancels or aborts them); ``stopping`` set
    stops it before the next tensor (writers already cancelled stop within a chunk). Returns one
    table per rank. Raises BadInput (NaN/Inf, truncated source), OutputWriteError, OSError (reading
    the source), WriteCancelled."""
    from mxconv.copy_check import refuse_nonfinite_copy

    stopping = stopping or threading.Event()
    writers = writers if writers is not None else []
    for r in job["ranks"]:
        shards = [ShardPlan(s["file"], [_tensor_from_json(t) for t in s["tensors"]]) for s in r["shards"]]
        writers.append(ShardedWriter(Path(r["dir"]), shards, display_dir=Path(r["display_dir"])))
    check = refuse_nonfinite_copy if job["check_nonfinite"] else None
    for name in job["names"]:
        if stopping.is_set():  # a stop that came before the writers existed (or between tensors)
            raise WriteCancelled()
        on_tensor(copy_tensor_to(writers, name, check))
    return [w.finish(write_index=False) for w in writers]


def child_main() -> None:
    """Entry point of the child process (``python -c 'from mxconv.early_copy import child_main; child_main()'``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the parent decides
    job = json.load(sys.stdin)
    writers: list[ShardedWriter] = []
    stopping = threading.Event()

    def stop(*_: Any) -> None:
        stopping.set()
        for w in list(writers):
            w.cancel()

    signal.signal(signal.SIGTERM, stop)

    def watch_parent() -> None:  # a parent killed outright (SIGKILL) must not leave us writing
        while not stopping.wait(0.5):
            if os.getppid() != job["parent"]:
                stop()

    threading.Thread(target=watch_parent, name="mxconv-early-copy-watch", daemon=True).start()
    code = 1
    try:
        written = run_job(job, lambda n: _emit({"progress": n}), writers, stopping)
        _emit({"written": [{k: asdict(v) for k, v in table.items()} for table in written],
               "peak_rss": process_peak_rss() or 0})  # its own (ru_maxrss would start at the parent's)
        code = 0
    except WriteCancelled:
        code = 3
    except OutputWriteError as exc:
        _emit({"error": "output", "message": str(exc), "disk_full": exc.disk_full})
    except BadInput as exc:
        _emit({"error": "input", "message": str(exc)})
    except OSError as exc:  # reading the source (EIO, a file gone): the parent raises it as in process
        _emit({"error": "os", "errno": exc.errno, "strerror": exc.strerror, "filename": exc.filename,
               "message": str(exc)})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        _emit({"error": "internal", "message": f"{type(exc).__name__}: {exc}"})
    finally:
        stopping.set()
        if code:
            for w in writers:
                w.abort()  # unfinished shards deleted; finished ones are the parent's OutputTarget's
    sys.stdout.flush()
    os._exit(code)


# ---- the parent's handle ----------------------------------------------------------------------

class EarlyCopy:
    """A running child copying ``job``'s tensors. :meth:`result` waits for its tables (raising what
    it reported); :meth:`stop` ends it early. Progress (bytes per tensor) goes to ``on_progress``,
    set now or later (what came before is passed on when it is set); ``on_failure`` is called
    once, from a helper thread, as soon as the child reports an error or ends without its tables
    (the parent cancels its own writing then, instead of converting on to the end; called at once
    when set after the failure)."""

    def __init__(self, proc: subprocess.Popen, nbytes: int) -> None:
        self.nbytes = nbytes
        self._proc = proc
        self._final: dict[str, Any] | None = None
        self._pending = 0
        self._on_progress: Callable[[int], None] | None = None
        self._on_failure: Callable[[], None] | None = None
        self.failed = False
        self.peak_rss = 0  # the child's peak RSS in bytes, once result() has returned
        self._lock = threading.Lock()
        self._stderr: list[str] = []
        self._out = threading.Thread(target=self._read_stdout, name="mxconv-early-copy-out", daemon=True)
        self._err = threading.Thread(target=self._read_stderr, name="mxconv-early-copy-err", daemon=True)
        self._out.start()
        self._err.start()

    @classmethod
    def start(cls, job: dict[str, Any], nbytes: int) -> "EarlyCopy | None":
        """Start the child on ``job`` (:func:`job_json`); None where no child can be started (the
        parent then copies in process)."""
        code = "from mxconv.early_copy import child_main; child_main()"
        try:
            proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except OSError:
            return None
        text = json.dumps(job)

        def send() -> None:  # on a thread: the child reads its job only once its imports are done
            try:
                assert proc.stdin is not None
                proc.stdin.write(text)
                proc.stdin.close()
            except OSError:  # it died at once; result() says why
                pass

        threading.Thread(target=send, name="mxconv-early-copy-job", daemon=True).start()
        return cls(proc, nbytes)

    @property
    def on_failure(self) -> Callable[[], None] | None:
        return self._on_failure

    @on_failure.setter
    def on_failure(self, fn: Callable[[], None] | None) -> None:
        with self._lock:
            self._on_failure = fn
            now = self.failed
        if fn is not None and now:
            fn()

    def _fail(self) -> None:
        with self._lock:
            self.failed = True
            fn = self._on_failure
        if fn is not None:
            fn()

    @property
    def on_progress(self) -> Callable[[int], None] | None:
        return self._on_progress

    @on_progress.setter
    def on_progress(self, fn: Callable[[int], None] | None) -> None:
        with self._lock:
            self._on_progress = fn
            pending, self._pending = self._pending, 0
        if fn is not None and pending:
            fn(pending)

    def _read_stdout(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "progress" in msg:
                with self._lock:
                    fn = self._on_progress
                    if fn is None:
                        self._pending += int(msg["progress"])
                if fn is not None:
                    fn(int(msg["progress"]))
            else:
                self._final = msg
        if not (self._final and "written" in self._final):  # an error reported, or no tables: it died
            self._fail()

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self._stderr = (self._stderr + [line])[-20:]

    def result(self) -> list[dict[str, WrittenTensor]]:
        """Wait for the child; its tables (one per rank), or the error it reported, raised here."""
        code = self._proc.wait()
        self._out.join()
        self._err.join()
        msg = self._final or {}
        if code == 0 and "written" in msg:
            self.peak_rss = int(msg.get("peak_rss") or 0)
            return [{k: WrittenTensor(**v) for k, v in table.items()} for table in msg["written"]]
        if msg.get("error") == "output":
            err = OutputWriteError(msg["message"])
            err.disk_full = bool(msg.get("disk_full"))
            raise err
        if msg.get("error") == "input":
            raise BadInput(msg["message"])
        if msg.get("error") == "os":
            if msg.get("errno") is None:
                raise OSError(msg["message"])
            raise OSError(msg["errno"], msg.get("strerror") or msg["message"], msg.get("filename"))
        detail = msg.get("message") or "".join(self._stderr).strip()[-2000:] or "no message"
        raise RuntimeError(f"the process copying tensors as they are failed (exit {code}): {detail}")

    def stop(self) -> None:
        """End the child (it deletes its unfinished shards first); returns once it is gone."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._out.join()
        self._err.join()
