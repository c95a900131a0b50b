"""Start reading a local source while the process is still starting.

A conversion spends its first seconds importing torch (4-5 s on the GPU machine), starting CUDA
and planning; the disk sits idle meanwhile, and on a checkpoint of a few tens of GB that is 10-25 %
of the whole run. :class:`Readahead` reads the source shards in the order the pipeline will want
them (layer by layer, files holding only global tensors last, as :mod:`mxconv.plan` orders its
work) into the kernel's page cache, so the pipeline's first reads come from memory. It touches
nothing but the page cache, stops at ``limit`` bytes or when told to, and never raises: it only
ever saves time.

The reading runs in a small child process (plain Python, no imports beyond ``os``/``signal``/
``sys``), not in a thread: importing torch holds the GIL through long stretches of C code, and a
reader thread measured on the H100 machine got 0.25-0.4 GB through in 5-6 s of start-up, a
fraction of what the disk gives. Where no child can be started, a thread does the same work.
(``posix_fadvise(WILLNEED)`` would need neither, but on the Firecracker kernels here it leaves
the page cache cold.)

This module imports no torch, on purpose: it must start before torch does.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

_LAYER = re.compile(r"\.layers\.(\d+)\.")  # same rule as mxconv.checkpoint.layer_index
_CHUNK = 8 << 20
_GLOBAL = 1 << 30


def shard_order(root: Path) -> list[Path]:
    """The source's shard files, in the order the pipeline reads them: by the lowest decoder layer
    each holds, files of only global tensors (embeddings, head) last. [] where it cannot tell."""
    index = root / "model.safetensors.index.json"
    first: dict[str, int] = {}
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            for name, fname in weight_map.items():
                m = _LAYER.search(name)
                key = int(m.group(1)) if m else _GLOBAL
                first[fname] = min(first.get(fname, _GLOBAL), key)
        else:
            first = {f.name: 0 for f in root.glob("*.safetensors")}
    except (OSError, ValueError, AttributeError):
        return []
    files = [root / f for f in first if (root / f).is_file()]
    return sorted(files, key=lambda f: (first[f.name], f.name))


def default_limit() -> int:
    """A quarter of the memory the machine has available (page cache it can spare), at most 16 GiB."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return min(int(line.split()[1]) * 1024 // 4, 16 << 30)
    except (OSError, ValueError, IndexError):
        pass
    return 2 << 30


# The child: read the files given, front to back, until the limit or until its parent is gone; on
# SIGTERM (or at the end) print the bytes read and exit. SIGINT is the parent's to handle (Ctrl-C
# reaches the whole process group).
_CHILD = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
done = 0
def report(*_):
    try:
        os.write(1, b"%d\n" % done)
    except OSError:
        pass
    os._exit(0)
signal.signal(signal.SIGTERM, report)
parent, limit, chunk = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
view = memoryview(bytearray(chunk))
for name in sys.argv[4:]:
    try:
        with open(name, "rb", buffering=0) as fh:
            while done < limit and os.getppid() == parent:
                n = fh.readinto(view)
                if not n:
                    break
                done += n
    except OSError:
        pass
    if done >= limit or os.getppid() != parent:
        break
report()
"""


class Readahead:
    """Read ``files`` front to back, at most ``limit`` bytes in all (whole chunks), in a child
    process (a daemon thread where none can be started)."""

    def __init__(self, files: list[Path], limit: int) -> None:
        self.files = files
        self.limit = limit
        self.bytes_read = 0
        self._stop = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._run, name="mxconv-readahead", daemon=True)

    @classmethod
    def for_source(cls, source: str, limit: int | None = None) -> "Readahead | None":
        """A started readahead of a local checkpoint directory, None for anything else (a Hub id is
        downloaded first, and the download is the read)."""
        root = Path(source).expanduser()
        if not root.is_dir():
            return None
        files = shard_order(root)
        if not files:
            return None
        ra = cls(files, default_limit() if limit is None else limit)
        ra.start()
        return ra

    def start(self) -> None:
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-S", "-c", _CHILD, str(os.getpid()), str(self.limit), str(_CHUNK), *map(str, self.files)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            )
            atexit.register(self.stop)  # a run that fails before stop() leaves no reader behind
        except OSError:
            self._thread.start()

    def wait(self, timeout: float | None = None) -> int:
        """Wait until everything up to the limit is read (tests); returns the bytes read."""
        if self._proc is not None:
            out, _ = self._proc.communicate(timeout=timeout)
            self.bytes_read = _parse(out)
            self._proc = None
            atexit.unregister(self.stop)
        else:
            self._thread.join(timeout)
        return self.bytes_read

    def _run(self) -> None:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        try:
            for f in self.files:
                with open(f, "rb", buffering=0) as fh:
                    while not self._stop.is_set() and self.bytes_read < self.limit:
                        n = fh.readinto(view)  # the GIL is released while the disk works
                        if not n:
                            break
                        self.bytes_read += n
                if self._stop.is_set() or self.bytes_read >= self.limit:
                    return
        except OSError:
            return  # the real read will report it, with the file's name

    def stop(self) -> int:
        """Stop reading (within one chunk); returns the bytes read ahead."""
        self._stop.set()
        proc, self._proc = self._proc, None
        if proc is not None:
            atexit.unregister(self.stop)
            if proc.poll() is None:
                proc.terminate()
            try:
                out, _ = proc.communicate(timeout=5)
                self.bytes_read = _parse(out)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        return self.bytes_read


def _parse(out: bytes | None) -> int:
    try:
        return int((out or b"0").split()[-1])
    except (ValueError, IndexError):
        return 0
