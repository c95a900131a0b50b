"""Where a conversion's start-up goes, each part timed in a fresh process: importing torch, starting
CUDA, and the kernels' warm-up (every Triton launch a run needs, recorded by
``mxconv.convert.warmup_launches`` on a one-layer checkpoint of the given shape), with an empty
Triton cache (a fresh machine: every kernel compiled) and again with the cache it filled.

    PYTHONPATH=src python scripts/bench_startup.py --kind gpt-oss-mxfp4 --command repack --backend trtllm
    PYTHONPATH=src python scripts/bench_startup.py --kind gpt-oss-bf16 --command quantize

Reports per launch: the kernel, its constexprs and the seconds of its first launch (compile +
launcher + run); then the warm-up as mxconv runs it (``run_collected``, one thread per kernel) and
one after another, each in its own fresh process with an empty cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t2 = time.perf_counter()
from mxconv.checkpoint import open_checkpoint
from mxconv.convert import QuantOptions, RepackOptions, build_plan, warmup_launches
from mxconv.families import detect_family
from mxconv.layouts import get_layout
from mxconv.kernels.triton_common import run_collected
t3 = time.perf_counter()
src, command, backend, mode = sys.argv[1:5]
ckpt = open_checkpoint(src)
repack = RepackOptions(backend, get_layout(backend).activations[0]) if command == "repack" else None
plan = build_plan(ckpt, detect_family(ckpt), command, QuantOptions(), repack)
dev = torch.device("cuda")
launches = warmup_launches(plan, dev)
t4 = time.perf_counter()
rows = []
if mode == "each":
    for k, grid, on, args, kw in launches:
        a = time.perf_counter()
        run_collected([(k, grid, on, args, kw)])
        torch.cuda.synchronize()
        rows.append({"kernel": getattr(k, "__name__", str(k)), "constexprs": {n: v for n, v in kw.items()},
                     "s": round(time.perf_counter() - a, 3)})
else:
    run_collected(launches, max_threads=8 if mode == "parallel" else 1)
    torch.cuda.synchronize()
t5 = time.perf_counter()
print(json.dumps({"import_torch_s": t1 - t0, "cuda_context_s": t2 - t1, "import_mxconv_s": t3 - t2,
                  "plan_and_record_s": t4 - t3, "launches": len(launches), "warmup_s": t5 - t4, "each": rows}))
"""


def child(src: Path, args: argparse.Namespace, mode: str, cache: str) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), args.command, args.backend, mode],
                         env=env, capture_output=True, text=True, check=True).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    doc["process_s"] = time.perf_counter() - t0
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="gpt-oss-mxfp4")
    ap.add_argument("--command", choices=("repack", "quantize"), default="repack")
    ap.add_argument("--backend", default="trtllm")
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--intermediate", type=int, default=2880)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from mxconv.examples import make_checkpoint

    with tempfile.TemporaryDirectory(prefix="mxconv-startup-") as tmp:
        src = Path(tmp) / "src"
        make_checkpoint(src, args.kind, num_layers=1, num_experts=2, hidden_size=args.hidden,
                        intermediate_size=args.intermediate)
        res = {}
        cold = tempfile.mkdtemp(dir=tmp)
        res["each_cold"] = child(src, args, "each", cold)
        res["each_warm"] = child(src, args, "each", cold)  # the cache the cold run filled
        res["parallel_cold"] = child(src, args, "parallel", tempfile.mkdtemp(dir=tmp))
        res["serial_cold"] = child(src, args, "serial", tempfile.mkdtemp(dir=tmp))
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        res["bare_import_torch_process_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import triton"], check=True)
        res["bare_import_triton_process_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(res, indent=1))
        return
    for k, v in res.items():
        if isinstance(v, dict):
            rows = v.pop("each")
            print(k, {a: round(b, 3) if isinstance(b, float) else b for a, b in v.items()})
            for r in rows:
                print("   ", r)
        else:
            print(k, round(v, 3))


if __name__ == "__main__":
    main()
