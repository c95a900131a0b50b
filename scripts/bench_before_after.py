#!/usr/bin/env python3
"""A refactor's speed, before against after, measured in one run on one machine.

Two mxconv checkouts (``--before``: the code before the change, e.g. unpacked from ``git
archive``; ``--after``: this checkout), each with its ``src/`` and ``scripts/``, run the same work, alternating
before/after ``--rounds`` times so drift in the machine hits both alike:

* **layout kernels**: each checkout's own ``scripts/bench_repack.py --json`` (every backend's batched
  ``to_kernel`` on a gpt-oss-120b-sized expert stack; on CUDA the Triton layout kernels), per
  backend the best time over the rounds;
* **end to end**: ``mxconv repack`` of one synthetic gpt-oss-20b-shaped MXFP4 checkpoint (written
  once by this checkout's ``bench_e2e.generate``) for each ``--backends`` entry, the source evicted
  from the page cache before each run; the best wall time over the rounds;
* ``mxconv quantize`` of the bf16 form of the same shape, the same way.

Prints and writes (``--out``) each time and the ratio after/before (1.00 = unchanged; above 1 =
slower after). Both trees' outputs are compared by sha256 too: a speed figure of different bytes
would mean nothing.

    python scripts/bench_before_after.py --before /tmp/before --layers 4 --out ba.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_disk import evict  # scripts/ is sys.path[0] when a script runs
from bench_e2e import GPT_OSS, generate

REPO = Path(__file__).resolve().parent.parent


def tree_env(src: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]))


def layout_kernels(tree: Path, reps: int, small: bool, experts: int) -> dict[str, float]:
    """{backend/activation: batched seconds} from ``tree``'s own bench_repack on its own mxconv."""
    cmd = [sys.executable, str(tree / "scripts" / "bench_repack.py"), "--json", "--reps", str(reps), "--experts", str(experts)]
    cmd += ["--small"] if small else []
    doc = json.loads(subprocess.run(cmd, env=tree_env(tree / "src"), capture_output=True, text=True, check=True).stdout)
    return {f"{r['backend']}/{r['activation']}": r["batched_s"] for r in doc["backends"]}


def digest(out: Path) -> str:
    """sha256 over every .safetensors file of ``out`` (names sorted)."""
    h = hashlib.sha256()
    for f in sorted(out.rglob("*.safetensors")):
        h.update(f.relative_to(out).as_posix().encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def convert(tree: Path, args: list[str], source: Path, out: Path) -> tuple[float, str]:
    """Wall seconds of ``mxconv ARGS`` run from ``tree`` (source evicted first) and the output digest."""
    for f in source.rglob("*"):
        if f.is_file():
            evict(f)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mxconv.cli", *args, "--quiet"]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=tree_env(tree / "src"), check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    return seconds, digest(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="checkout of the code before the change (src/, scripts/)")
    ap.add_argument("--after", type=Path, default=REPO, help="checkout of the code after (default: this one)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mxconv-before-after"))
    ap.add_argument("--layers", type=int, default=4, help="MoE layers of the synthetic gpt-oss-20b-shaped checkpoint")
    ap.add_argument("--backends", default="trtllm,marlin,humming,triton", help="repack backends timed end to end")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="bench_repack repetitions per round")
    ap.add_argument("--experts", type=int, default=128, help="bench_repack's expert stack (H = I = 2880)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test of the script")
    ap.add_argument("--kernels-only", action="store_true", help="time the layout kernels only (no sources, no end to end)")
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(GPT_OSS["20b"], layers=args.layers)
    if args.small:
        shape.update(E=4, H=256, I=256, V=512, layers=2)
    args.dir.mkdir(parents=True, exist_ok=True)
    sources = {}
    for mode in () if args.kernels_only else ("repack", "quantize"):  # repack: an MXFP4 source; quantize: bf16
        sources[mode] = args.dir / f"src-{mode}"
        if not (sources[mode] / "config.json").exists():
            generate(sources[mode], mode, shape["E"], shape["H"], shape["I"], shape["V"], shape["layers"], device)
    # job -> (the source it reads, the CLI arguments)
    jobs: dict[str, tuple[Path, list[str]]] = {}
    if not args.kernels_only:
        jobs = {f"repack {b}": (sources["repack"], ["repack", str(sources["repack"]), str(args.dir / "out"), "--backend", b,
                                                     "--overwrite"])
                for b in args.backends.split(",")}
        jobs["quantize mxfp4"] = (sources["quantize"], ["quantize", str(sources["quantize"]), str(args.dir / "out"),
                                                         "--overwrite"])
    kernels: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    e2e: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    digests: dict[str, dict[str, str]] = {"before": {}, "after": {}}
    for _ in range(args.rounds):
        for name, tree in trees.items():  # alternate: before, after, before, after
            for key, s in layout_kernels(tree, args.reps, args.small, args.experts).items():
                kernels[name][key] = min(s, kernels[name].get(key, float("inf")))
            print(f"[{name}] layout kernels: {len(kernels[name])} timed", file=sys.stderr, flush=True)
            for job, (source, cli) in jobs.items():
                s, d = convert(tree, cli, source, args.dir / "out")
                e2e[name][job] = min(s, e2e[name].get(job, float("inf")))
                digests[name][job] = d
                print(f"[{name}] {job}: {s:.2f} s", file=sys.stderr, flush=True)  # progress, kept if a time limit cuts the run
    rows = []
    for kind, table in (("layout kernel", kernels), ("end to end", e2e)):
        for key in table["before"]:
            b, a = table["before"][key], table["after"].get(key)
            rows.append({"kind": kind, "what": key, "before_s": b, "after_s": a, "ratio": a / b if a else None,
                         "same_bytes": digests["before"].get(key) == digests["after"].get(key) if kind == "end to end" else None})
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    doc = {"device": device_name, "date": time.strftime("%Y-%m-%d"), "shape": shape, "rounds": args.rounds, "rows": rows}
    for r in rows:
        same = "" if r["same_bytes"] is None else f"  same bytes: {r['same_bytes']}"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        print(f"{r['kind']:14} {r['what']:28} before {r['before_s'] * 1e3:10.2f} ms  after "
              f"{(r['after_s'] or 0) * 1e3:10.2f} ms  after/before {ratio}{same}")
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r["same_bytes"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
