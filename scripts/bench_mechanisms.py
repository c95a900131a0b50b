#!/usr/bin/env python3
"""Did each start-up mechanism pay on a real-sized run? Whole-process wall time of
``mxconv repack`` / ``mxconv quantize`` on a gpt-oss-120b-shaped checkpoint, with every mechanism on
and with each one turned off in turn, same machine, same files, runs interleaved.

The mechanisms, as they were at commit 7dfe7d7 (run this script from that commit: none of them
paid 5 % of wall time on the H200, docs/benchmarks.md "start-up mechanisms", and all were removed
after it; this script is kept as the record of how they were measured):

* ``readahead``  a child process reads the source into the page cache while torch imports
* ``early_copy`` a child process writes the byte-copied tensors while torch imports
* ``cpu_layout`` layers that only need a layout are laid out on the CPU while the GPU kernels compile
* ``warmup``     a thread compiles every Triton kernel the run needs before the first item
                 (off: kernels compile at their first launch; the CPU layout is off with it)
* ``os_exit``    the process leaves with ``os._exit`` instead of the interpreter's teardown

A mechanism is turned off from outside the product: a small bootstrap in the child process
replaces its entry point before the CLI runs (nothing in mxconv reads a switch for it). Every
variant, "all on" included, goes through the same bootstrap. Before each run the source is evicted
from the page cache and mxconv gets an empty Triton cache, as on a fresh machine.

    PYTHONPATH=src python scripts/bench_mechanisms.py --mode repack --model 120b --layers 8 --reps 2 --json
    PYTHONPATH=src python scripts/bench_mechanisms.py --mode quantize --model 120b --layers 3 --reps 2
    PYTHONPATH=src python scripts/bench_mechanisms.py --mode repack --small     # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_e2e import GPT_OSS, _evict, generate  # scripts/ is sys.path[0] when a script runs

MECHANISMS = ("readahead", "early_copy", "cpu_layout", "warmup", "os_exit")

# Runs in the child: turns off the mechanisms named in argv[1] (comma-separated), then runs the CLI
# with argv[2:]. It names the modules of commit 7dfe7d7 (mxconv.convert, mxconv.readahead): later
# trees have none of these mechanisms, and the script fails there on its first import.
BOOTSTRAP = r"""
import os, sys, threading
off = set(filter(None, sys.argv[1].split(",")))
import mxconv.convert as convert, mxconv.readahead as readahead
if "readahead" in off:
    readahead.Readahead.for_source = classmethod(lambda cls, *a, **k: None)
if "early_copy" in off:
    _execute = convert.execute
    convert.execute = lambda *a, **k: _execute(*a, **{**k, "early_copy": False})
if "cpu_layout" in off:
    os.environ["MXCONV_WARMUP_CPU"] = "0"
if "warmup" in off:
    def _no_warmup(plan, device):
        t = threading.Thread(target=lambda: None)
        t.start()
        return t
    convert._start_warmup = _no_warmup
sys.argv = ["mxconv", *sys.argv[2:]]
from mxconv.cli import app, main
if "os_exit" in off:
    app()
else:
    main()
"""


def run_variant(off: tuple[str, ...], cmd: list[str], src: Path, out: Path, scratch: Path) -> dict:
    """One whole-process run with the mechanisms in ``off`` turned off: wall seconds and its summary."""
    shutil.rmtree(out, ignore_errors=True)
    _evict(sorted(src.glob("*.safetensors")))
    env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="mxconv-triton-", dir=scratch)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", BOOTSTRAP, ",".join(off), *cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    shutil.rmtree(env["TRITON_CACHE_DIR"], ignore_errors=True)
    if proc.returncode != 0:
        sys.exit(f"mxconv failed ({proc.returncode}) with {off or 'all on'}: {proc.stderr[-2000:]}")
    summary = json.loads(proc.stdout)
    return {"wall_s": wall, "internal_s": summary["seconds"], "bytes_read_ahead": summary.get("bytes_read_ahead"),
            "early_copy_bytes": summary.get("early_copy_bytes"), "items_computed_on_cpu": summary.get("items_computed_on_cpu")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("quantize", "repack"), default="repack")
    ap.add_argument("--model", choices=tuple(GPT_OSS), default="120b")
    ap.add_argument("--layers", type=int, default=None, help="MoE layers (default: 8 for repack, 3 for quantize)")
    ap.add_argument("--backend", default="trtllm")
    ap.add_argument("--reps", type=int, default=2, help="rounds; each round runs every variant once, interleaved")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mxconv-mech"))
    ap.add_argument("--small", action="store_true", help="tiny sizes: a CPU smoke test")
    ap.add_argument("--only", default=None, help="comma-separated mechanisms to measure (default: all of them)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(GPT_OSS[args.model])
    shape["layers"] = args.layers or (8 if args.mode == "repack" else 3)
    if args.small:
        shape.update(E=4, H=256, I=256, V=512, layers=2)
    args.dir.mkdir(parents=True, exist_ok=True)
    src, out = args.dir / f"src-{args.mode}", args.dir / f"out-{args.mode}"
    shutil.rmtree(src, ignore_errors=True)
    generate(src, args.mode, shape["E"], shape["H"], shape["I"], shape["V"], shape["layers"], dev)
    cmd = [args.mode, str(src), str(out), "--json", "--quiet"]
    cmd += ["--backend", args.backend] if args.mode == "repack" else ["--format", "mxfp4"]
    variants = [()] + [(m,) for m in (args.only.split(",") if args.only else MECHANISMS)]
    runs: dict[str, list[dict]] = {",".join(v) or "all on": [] for v in variants}
    for _ in range(args.reps):
        for v in variants:
            runs[",".join(v) or "all on"].append(run_variant(v, cmd, src, out, args.dir))
    base = statistics.median(r["wall_s"] for r in runs["all on"])
    table = []
    for name, rs in runs.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        table.append({"off": name, "wall_s": [round(r["wall_s"], 2) for r in rs], "median_wall_s": round(wall, 2),
                      "saves_pct": None if name == "all on" else round(100 * (wall - base) / wall, 1), "runs": rs})
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    doc = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "mode": args.mode,
           "model": args.model, "shape": shape, "reps": args.reps, "date": time.strftime("%Y-%m-%d"), "table": table}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{doc['device']} {args.mode} {args.model} {shape['layers']} layers, {args.reps} rounds")
        for row in table:
            print(f"  {row['off']:12} median {row['median_wall_s']:7.2f} s  runs {row['wall_s']}  "
                  f"saves {row['saves_pct'] if row['saves_pct'] is not None else '-'} %")


if __name__ == "__main__":
    main()
