#!/usr/bin/env python3
"""Byte digest of mxconv's conversion matrix, through the CLI only, to prove a refactor changes no output.

Using it in a refactor (before/after): keep a checkout of the code before the change, then

    python scripts/check_bytes.py --src-dir /path/to/old-checkout/src --out before.json
    python scripts/check_bytes.py --out after.json                # this checkout's src
    python scripts/check_bytes.py --compare before.json after.json   # exit 0: same bytes

Both runs generate the same tiny source checkpoints (with this checkout's generators, ``--gen-dir``)
and convert them with the ``--src-dir`` tree's ``python -m mxconv.cli``, so the script never imports
mxconv and works for any internal layout of the package. ``--compare`` prints every entry that
differs, is missing or is new, and exits 1 if any does. Run a tree twice and compare to check
determinism first: a difference between two runs of the same code is a flake, not the refactor.

The matrix: every source kind (INT4 included) x ``quantize --format mxfp4|mxfp8`` (gpt-oss-bf16 and
qwen3-moe also ``--format mxfp8 --targets linear``); every non-INT4 kind's MXFP4 output (and
gpt-oss-bf16 straight from bf16) x ``repack --backend B --activation A`` for every backend and its
activations x ``--tp 1|2``; the layout options (triton 3.6/3.8, marlin legacy) of two kinds; every MXFP8
output x ``repack --format mxfp8`` to humming and marlin, TP 1 and 2; the INT4 (Kimi-K2-Thinking)
source through the same repack grid (trtllm with bf16 activations gives MxInt4, humming its INT4
form; the rest are refusals). About 10 minutes on 2 CPU cores.
A refusal (exit 2) is recorded with its exit code and the first line of stderr, so a change in what
is refused shows too; any other failure is recorded the same way and reported.

Per output: for every ``.safetensors`` file the sha256 of the whole file and of each tensor's
(name, dtype, shape, raw bytes), read from the header with json + struct; sha256 of every other
file (config.json of each rank too), and of ``mxconv.json`` per top-level key without the keys that
change run to run (``VOLATILE``), with the work directory's path replaced by ``<work>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
KINDS = (
    "gpt-oss-mxfp4", "gpt-oss-bf16", "qwen3-moe", "qwen2-moe", "mixtral",
    "deepseek-v3-fp8", "deepseek-v3.1-fp8-ue8m0", "kimi-k2", "glm4-moe",
)
INT4_KINDS = ("kimi-k2-int4",)
LINEAR_KINDS = ("gpt-oss-bf16", "qwen3-moe")  # interleaved and halves w13 row order
BF16_REPACK_KINDS = ("gpt-oss-bf16",)  # repacked straight from bf16 as well
ACTIVATIONS = {
    "trtllm": ("bf16", "mxfp8"), "marlin": ("bf16", "fp8"), "aiter": ("bf16", "mxfp4"),
    "triton": ("bf16", "fp8"), "deepgemm": ("fp8",), "cutlass": ("mxfp4",), "humming": ("bf16",),
    "cpu": ("bf16",), "flashinfer-cutlass": ("bf16", "mxfp8"),
}
# Layout options and MXFP8 layouts, repacked from a few kinds only (the two w13 row orders).
OPTION_KINDS = ("gpt-oss-mxfp4", "qwen3-moe")
LAYOUT_OPTIONS = {
    "triton-3.6": ["--backend", "triton", "--layout-option", "triton_layout=3.6"],
    "triton-3.8": ["--backend", "triton", "--layout-option", "triton_layout=3.8"],
    "marlin-legacy": ["--backend", "marlin", "--layout-option", "marlin_scale_layout=legacy"],
}
MXFP8_BACKENDS = ("humming", "marlin")
TP_SIZES = (1, 2)
# mxconv.json keys that change from run to run (or with the output path), as paths of keys.
VOLATILE = (("tool_version",), ("command",), ("created",), ("source", "path"), ("source", "fingerprint"),
            ("numerics", "upstream", "fingerprint"))  # the upstream source's fingerprint: its files' times
# make_checkpoint options per kind (others: defaults). INT4 at I = 512: MxInt4 needs I per rank % 256 == 0 (TP 2).
SOURCE_OPTIONS: dict[str, dict[str, Any]] = {"kimi-k2-int4": {"intermediate_size": 512}}
# Writes each kind of the JSON {kind: options} argv[2] into argv[1]/<kind> with the test suite's
# generators (mxconv.examples' kinds plus DeepSeek/GLM/block-FP8/INT4). The size options go in a
# ModelSizes; a --gen-dir checkout from before ModelSizes takes them as keywords.
GENERATE = """
import json, sys
from pathlib import Path
import support.checkpoints as gen
SIZES = ("num_layers", "num_experts", "hidden_size", "intermediate_size", "top_k", "vocab_size")
for kind, options in json.loads(sys.argv[2]).items():
    if hasattr(gen, "ModelSizes"):
        options = {"sizes": gen.ModelSizes(**{k: options.pop(k) for k in SIZES if k in options}), **options}
    gen.make_checkpoint(Path(sys.argv[1]) / kind, kind, **options)
"""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def safetensors_digest(path: Path) -> dict[str, Any]:
    """sha256 of the file and of (name, dtype, shape, bytes) of each tensor, plus the header metadata."""
    tensors: dict[str, str] = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        for name in sorted(k for k in header if k != "__metadata__"):
            info = header[name]
            start, end = info["data_offsets"]
            f.seek(base + start)
            h = hashlib.sha256(json.dumps([name, info["dtype"], info["shape"]]).encode())
            h.update(f.read(end - start))
            tensors[name] = h.hexdigest()
    meta = json.dumps(header.get("__metadata__"), sort_keys=True).encode()
    return {"file": sha256_file(path), "metadata": hashlib.sha256(meta).hexdigest(), "tensors": tensors}


def scrub(value: Any, work: str) -> Any:
    """``value`` with the work directory's path replaced by ``<work>`` in every string."""
    if isinstance(value, str):
        return value.replace(work, "<work>")
    if isinstance(value, list):
        return [scrub(v, work) for v in value]
    if isinstance(value, dict):
        return {k: scrub(v, work) for k, v in value.items()}
    return value


def manifest_digest(path: Path, work: str) -> dict[str, str]:
    """sha256 per top-level key of mxconv.json, the volatile keys left out."""
    doc = json.loads(path.read_text())
    for path_ in VOLATILE:
        where = doc
        for key in path_[:-1]:
            where = where.get(key) if isinstance(where, dict) else None
        if isinstance(where, dict):
            where.pop(path_[-1], None)
    doc = scrub(doc, work)
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest() for k, v in sorted(doc.items())}


def output_digest(out: Path, work: str) -> dict[str, Any]:
    """Digest of every file under ``out`` by its relative path."""
    files: dict[str, Any] = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        rel = path.relative_to(out).as_posix()
        if path.suffix == ".safetensors":
            files[rel] = safetensors_digest(path)
        elif path.name == "mxconv.json":
            files[rel] = manifest_digest(path, work)
        else:
            files[rel] = sha256_file(path)
    return files


def run_cli(args: list[str], src_dir: Path, work: Path, keep: bool) -> dict[str, Any]:
    """Run ``python -m mxconv.cli ARGS`` in ``work``: the output's digest (the output removed unless
    ``keep``: a later repack reads it), or the exit code and first stderr line."""
    env = dict(os.environ, PYTHONPATH=str(src_dir))
    cmd = [sys.executable, "-m", "mxconv.cli", *args, "--device", "cpu", "--quiet"]
    proc = subprocess.run(cmd, check=False, cwd=work, env=env, capture_output=True, text=True)
    entry: dict[str, Any] = {"args": " ".join(args), "exit": proc.returncode}
    if proc.returncode == 0:
        entry["files"] = output_digest(work / args[2], str(work))
        if not keep:
            shutil.rmtree(work / args[2])
    else:
        lines = proc.stderr.strip().splitlines()
        entry["stderr"] = scrub(lines[0] if lines else "", str(work))
    return entry


Job = tuple[str, list[str], bool]  # (entry id, CLI arguments, keep the output)


def quantize_jobs(kinds: tuple[str, ...]) -> list[Job]:
    """Every kind x MXFP4 / MXFP8 (and MXFP8 of every linear for LINEAR_KINDS); MXFP4 outputs kept."""
    jobs: list[Job] = []
    for kind in kinds:
        variants = [("mxfp4", []), ("mxfp8", [])] + ([("mxfp8-linear", ["--targets", "linear"])] if kind in LINEAR_KINDS else [])
        for name, extra in variants:
            fmt = name.split("-")[0]
            args = ["quantize", f"src/{kind}", f"out/q.{kind}.{name}", "--format", fmt, *extra]
            jobs.append((f"quantize/{kind}/{name}", args, name in ("mxfp4", "mxfp8")))
    return jobs


def repack_jobs(source: str, label: str) -> list[Job]:
    """``source`` (a directory under the work directory) x every backend, activation and TP size."""
    jobs: list[Job] = []
    for backend, activations in ACTIVATIONS.items():
        for act in activations:
            for tp in TP_SIZES:
                out = f"out/r.{label}.{backend}.{act}.tp{tp}"
                args = ["repack", source, out, "--backend", backend, "--activation", act, "--tp", str(tp)]
                jobs.append((f"repack/{label}/{backend}-{act}/tp{tp}", args, False))
    return jobs


def option_jobs(source: str, label: str) -> list[Job]:
    """``source`` (an MXFP4 output) x every entry of LAYOUT_OPTIONS x TP 1 and 2."""
    return [(f"repack/{label}/{name}/tp{tp}", ["repack", source, f"out/r.{label}.{name}.tp{tp}", *args, "--tp", str(tp)], False)
            for name, args in LAYOUT_OPTIONS.items() for tp in TP_SIZES]


def mxfp8_jobs(source: str, label: str) -> list[Job]:
    """``source`` (an MXFP8 output) x every MXFP8 backend layout x TP 1 and 2."""
    return [(f"repack/{label}/{backend}-mxfp8/tp{tp}",
             ["repack", source, f"out/r.{label}.{backend}.mxfp8.tp{tp}", "--backend", backend, "--format", "mxfp8", "--tp", str(tp)], False)
            for backend in MXFP8_BACKENDS for tp in TP_SIZES]


def generate_sources(work: Path, gen_dir: Path, kinds: tuple[str, ...]) -> None:
    """Write every source kind under ``work/src`` with ``gen_dir``'s src and tests/support generators."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(gen_dir / "src"), str(gen_dir / "tests")]))
    options = json.dumps({kind: SOURCE_OPTIONS.get(kind, {}) for kind in kinds})
    subprocess.run([sys.executable, "-c", GENERATE, str(work / "src"), options], env=env, check=True)


def run_matrix(src_dir: Path, gen_dir: Path, work: Path, jobs_n: int) -> dict[str, Any]:
    """Sources, then quantize and the repacks of bf16/INT4 sources, then the repacks of MXFP4 outputs."""
    kinds = KINDS + INT4_KINDS
    generate_sources(work, gen_dir, kinds)
    entries: dict[str, Any] = {f"source/{k}": {"files": output_digest(work / "src" / k, str(work))} for k in kinds}
    first = quantize_jobs(kinds)
    for kind in BF16_REPACK_KINDS + INT4_KINDS:
        first += repack_jobs(f"src/{kind}", kind)

    def run(job: Job) -> tuple[str, dict[str, Any]]:
        print(f"  {job[0]}", file=sys.stderr, flush=True)
        return job[0], run_cli(job[1], src_dir, work, job[2])

    with ThreadPoolExecutor(jobs_n) as pool:
        entries.update(pool.map(run, first))
        second: list[Job] = []
        for kind in KINDS:
            if entries[f"quantize/{kind}/mxfp4"]["exit"] == 0:
                second += repack_jobs(f"out/q.{kind}.mxfp4", f"{kind}.mxfp4")
            else:
                entries[f"repack/{kind}.mxfp4"] = {"skipped": "quantize --format mxfp4 failed"}
            if kind in OPTION_KINDS and entries[f"quantize/{kind}/mxfp4"]["exit"] == 0:
                second += option_jobs(f"out/q.{kind}.mxfp4", f"{kind}.mxfp4")
            if entries[f"quantize/{kind}/mxfp8"]["exit"] == 0:
                second += mxfp8_jobs(f"out/q.{kind}.mxfp8", f"{kind}.mxfp8")
        entries.update(pool.map(run, second))
    return dict(sorted(entries.items()))


def summary(entries: dict[str, Any]) -> str:
    outputs = sum(1 for k, e in entries.items() if not k.startswith("source/") and e.get("exit") == 0)
    refused = sum(1 for e in entries.values() if e.get("exit") == 2)
    failed = sorted(k for k, e in entries.items() if e.get("exit") not in (None, 0, 2))
    text = f"{outputs} outputs, {refused} refusals (exit 2), {len(failed)} other failures"
    return text + "".join(f"\n  FAILED {k}: {entries[k]['stderr']}" for k in failed)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a/b/c": leaf}."""
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, sub in value.items():
        flat.update(flatten(sub, f"{prefix}/{key}" if prefix else str(key)))
    return flat


def compare(path_a: Path, path_b: Path, most: int = 20) -> int:
    """Print the entries of two digests that differ (at most ``most`` leaves each); 1 if any do."""
    a = json.loads(path_a.read_text())["entries"]
    b = json.loads(path_b.read_text())["entries"]
    bad = 0
    for entry in sorted(set(a) | set(b)):
        if entry not in b or entry not in a:
            print(f"{entry}: only in {path_a if entry in a else path_b}")
            bad += 1
            continue
        fa, fb = flatten(a[entry]), flatten(b[entry])
        diffs = [k for k in sorted(set(fa) | set(fb)) if fa.get(k, "<absent>") != fb.get(k, "<absent>")]
        if fa.get("exit") != fb.get("exit"):  # converted in one, refused in the other: say only that
            diffs = [k for k in ("exit", "stderr") if k in diffs]
        if not diffs:
            continue
        bad += 1
        print(f"{entry}: {len(diffs)} differing values")
        for k in diffs[:most]:
            print(f"    {k}: {fa.get(k, '<absent>')!r} != {fb.get(k, '<absent>')!r}")
        if len(diffs) > most:
            print(f"    ... {len(diffs) - most} more")
    total = len(set(a) | set(b))
    print(f"{bad} of {total} entries differ" if bad else f"identical: {total} entries")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the digest here (JSON)")
    ap.add_argument("--src-dir", type=Path, default=REPO / "src", help="mxconv source tree the CLI runs from (default: this repo's src)")
    ap.add_argument("--gen-dir", type=Path, default=REPO, help="checkout whose src and tests/support generate the sources (default: this repo)")
    ap.add_argument("--jobs", type=int, default=2, help="conversions at a time (default 2)")
    ap.add_argument("--keep", type=Path, help="work in this (empty or new) directory and keep it, instead of a temporary one")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two digests; exit 1 if they differ")
    opts = ap.parse_args()
    if opts.compare:
        return compare(*opts.compare)
    if not opts.out:
        ap.error("--out or --compare is required")
    if not (opts.src_dir / "mxconv").is_dir():
        ap.error(f"--src-dir {opts.src_dir}: no mxconv package in it")
    work = opts.keep.resolve() if opts.keep else Path(tempfile.mkdtemp(prefix="check_bytes."))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        entries = run_matrix(opts.src_dir.resolve(), opts.gen_dir.resolve(), work, opts.jobs)
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)
    seconds = round(time.perf_counter() - t0, 1)
    run = {"src_dir": str(opts.src_dir.resolve()), "gen_dir": str(opts.gen_dir.resolve()), "seconds": seconds}
    opts.out.write_text(json.dumps({"schema": 1, "run": run, "entries": entries}, indent=1, sort_keys=True) + "\n")
    print(f"{summary(entries)}; {seconds} s -> {opts.out}")
    return 1 if any(e.get("exit") not in (None, 0, 2) for e in entries.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
