"""A generated checkpoint laid out as a Hugging Face hub cache entry, so repo-id sources can be
tested offline (``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` pointing at it)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def make_hub_cache(cache_dir: str | Path, repo_id: str, src_dir: str | Path, revision: str = "main") -> Path:
    """Lay ``src_dir``'s files out as a hub cache entry; return the snapshot directory.

    ``{cache_dir}/models--{org}--{name}/blobs/<sha256>``, ``snapshots/<commit>/<file>`` (relative
    symlinks to the blobs, copies where symlinks are not available) and ``refs/{revision}``
    holding the 40-hex commit id (a sha1 over the file names and contents). Point
    ``HF_HUB_CACHE`` at ``cache_dir`` and set ``HF_HUB_OFFLINE=1`` to resolve ``repo_id`` from it.
    """
    cache_dir, src_dir = Path(cache_dir), Path(src_dir)
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    files = sorted(f for f in src_dir.rglob("*") if f.is_file())
    commit = hashlib.sha1()
    digests = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        digests[f] = h.hexdigest()
        commit.update(f"{f.relative_to(src_dir).as_posix()}\0{digests[f]}\n".encode())
    commit_id = commit.hexdigest()
    snap = repo / "snapshots" / commit_id
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for f in files:
        blob = repo / "blobs" / digests[f]
        if not blob.exists():
            shutil.copyfile(f, blob)
        dst = snap / f.relative_to(src_dir)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists() or dst.is_symlink():
            dst.unlink()
        try:
            os.symlink(os.path.relpath(blob, dst.parent), dst)
        except OSError:
            shutil.copyfile(blob, dst)
    ref = repo / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit_id)
    return snap
