#!/usr/bin/env python3
"""Peak memory against ``--max-memory``: a budget sweep of ``mxconv quantize`` (or ``repack``) on one
synthetic checkpoint, with time and the I/O floor beside it, and the output bytes checked equal.

The checkpoint has Qwen3-30B-A3B's expert shapes by default (128 experts, hidden 2048, expert
intermediate 768, bf16; 2 MoE layers = 2.4 GB of experts, small attention and vocabulary), written
layer by layer into ``--dir`` (never held whole in memory). Each budget runs in its own process;
its peak host RSS is the run's own high-water mark (``peak_host_rss_bytes`` of its summary, VmHWM;
``wait4``'s ``ru_maxrss`` would include this script's own peak), its GPU peak the run's own
``peak_gpu_bytes`` (CUDA). The I/O floor is measured in the same session on the same files: read
every source byte and write as many bytes as mxconv writes, fsync'd. Source files are evicted from
the page cache (``posix_fadvise(DONTNEED)``) before every timed phase, so every phase reads from the disk.

    PYTHONPATH=src python scripts/bench_memory.py                       # none, 8GB, 4GB, 2GB on the CPU
    PYTHONPATH=src python scripts/bench_memory.py --budgets none,3GB,none:2GB --device cuda
    PYTHONPATH=src python scripts/bench_memory.py --small               # smoke test (seconds)

Prints one row per budget: the plan (experts per group, pipeline depth), peak RSS, peak GPU, wall and
mxconv-internal seconds, GB/s (source + output bytes over internal time), the floor ratio
(internal time / floor time) and whether every output file and the manifest's tensor table equal the
first run's.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import _evict  # noqa: E402 - page-cache eviction, as the end-to-end benchmark does it

QWEN3_30B_A3B = dict(E=128, H=2048, I=768, layers=2)


def generate(root: Path, E: int, H: int, I: int, layers: int, seed: int = 0) -> None:
    """A Qwen3-MoE checkpoint, one shard per layer (+ one for embeddings and head), bf16."""
    import torch
    from safetensors.torch import save_file

    heads, kv_heads, head_dim, V = 32, 4, 128, 1024
    if H < 1024:
        heads, kv_heads, head_dim = 4, 2, 32
    root.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": layers,
        "hidden_size": H, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": V, "num_experts": E, "num_experts_per_tok": 8 if E >= 8 else 2, "moe_intermediate_size": I,
        "intermediate_size": 3 * H, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "max_position_embeddings": 32768,
    }
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    n = layers + 1
    weight_map: dict[str, str] = {}
    total = 0
    for li in range(layers + 1):
        p = f"model.layers.{li}"
        t: dict[str, torch.Tensor] = {}
        if li == layers:
            t["model.embed_tokens.weight"] = rnd(V, H, scale=1.0)
            t["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
            t["lm_head.weight"] = rnd(V, H)
        else:
            t[f"{p}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
            t[f"{p}.post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
            t[f"{p}.self_attn.q_proj.weight"] = rnd(heads * head_dim, H)
            t[f"{p}.self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, H)
            t[f"{p}.self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, H)
            t[f"{p}.self_attn.o_proj.weight"] = rnd(H, heads * head_dim)
            t[f"{p}.self_attn.q_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
            t[f"{p}.self_attn.k_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
            t[f"{p}.mlp.gate.weight"] = rnd(E, H)
            for e in range(E):
                q = f"{p}.mlp.experts.{e}"
                t[f"{q}.gate_proj.weight"] = rnd(I, H)
                t[f"{q}.up_proj.weight"] = rnd(I, H)
                t[f"{q}.down_proj.weight"] = rnd(H, I)
        fname = f"model-{li + 1:05d}-of-{n:05d}.safetensors"
        save_file(t, str(root / fname), metadata={"format": "pt"})
        for k, v in t.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
        del t
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(cfg, indent=2))


def io_floor(src_files: list[Path], out_bytes: int, scratch: Path) -> float:
    """Seconds to read every source byte and write ``out_bytes`` (fsync'd) with nothing else."""
    _evict(src_files)
    buf = bytearray(64 << 20)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    for f in src_files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(mv):
                pass
    scratch.mkdir(parents=True, exist_ok=True)
    with open(scratch / "floor.bin", "wb", buffering=0) as fh:
        left = out_bytes
        while left:
            n = min(left, len(buf))
            fh.write(mv[:n])
            left -= n
        os.fsync(fh.fileno())
    dt = time.perf_counter() - t0
    (scratch / "floor.bin").unlink()
    return dt


def run_one(argv: list[str], env: dict[str, str]) -> tuple[dict, int, float, str]:
    """Run mxconv in a child; (its --json summary, peak RSS bytes, wall seconds, stderr)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    # read the pipes on threads so a chatty child cannot block, then reap it with wait4 for its rusage
    import threading

    outs: dict[str, bytes] = {}

    def drain(name: str, stream) -> None:
        outs[name] = stream.read()

    threads = [threading.Thread(target=drain, args=(k, s)) for k, s in (("out", proc.stdout), ("err", proc.stderr))]
    for t in threads:
        t.start()
    _, status, usage = os.wait4(proc.pid, 0)
    for t in threads:
        t.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    err = outs["err"].decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{err}")
    return json.loads(outs["out"]), usage.ru_maxrss * 1024, wall, err


def digests(out: Path) -> dict[str, str]:
    """sha256 of every output file but the manifest (which holds the command line and the date)."""
    res = {}
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != "mxconv.json":
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(16 << 20), b""):
                    h.update(chunk)
            res[str(p.relative_to(out))] = h.hexdigest()
    return res


def gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mxconv-bench-memory"))
    ap.add_argument("--budgets", default="none,8GB,4GB,2GB",
                    help="comma-separated --max-memory values (none = no flag); HOST:GPU adds --max-gpu-memory GPU")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--format", default="mxfp4")
    ap.add_argument("--backend", default=None, help="repack --backend B instead of quantize")
    ap.add_argument("--experts", type=int, default=QWEN3_30B_A3B["E"])
    ap.add_argument("--hidden", type=int, default=QWEN3_30B_A3B["H"])
    ap.add_argument("--intermediate", type=int, default=QWEN3_30B_A3B["I"])
    ap.add_argument("--layers", type=int, default=QWEN3_30B_A3B["layers"])
    ap.add_argument("--small", action="store_true", help="tiny sizes: a smoke test of the script")
    ap.add_argument("--keep", action="store_true", help="keep the generated source (reused by the next run)")
    ap.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    args = ap.parse_args()
    if args.small:
        args.experts, args.hidden, args.intermediate = 8, 512, 256
        if args.budgets == ap.get_default("budgets"):
            args.budgets = "none,1GB"

    src = args.dir / f"src-E{args.experts}-H{args.hidden}-I{args.intermediate}-L{args.layers}"
    if not (src / "config.json").exists():
        t0 = time.perf_counter()
        generate(src, args.experts, args.hidden, args.intermediate, args.layers)
        print(f"generated {src} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    src_files = sorted(src.glob("*.safetensors"))
    src_bytes = sum(f.stat().st_size for f in src_files)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = []
    first: tuple[dict[str, str], dict] | None = None
    for budget in args.budgets.split(","):
        out = args.dir / "out"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "mxconv.cli"]
        cmd += ["repack", str(src), str(out), "--backend", args.backend] if args.backend else ["quantize", str(src), str(out), "--format", args.format]
        cmd += ["--device", args.device, "--json", "--quiet"]
        host, _, gpu = budget.partition(":")
        if host != "none":
            cmd += ["--max-memory", host]
        if gpu and gpu != "none":
            cmd += ["--max-gpu-memory", gpu]
        _evict(src_files)
        summary, maxrss, wall, _ = run_one(cmd, env)
        # mxconv's own VmHWM: wait4's ru_maxrss starts at this script's own peak (exec keeps the
        # spawning address space's high-water mark), which reading whole output files raises
        rss = summary.get("peak_host_rss_bytes") or maxrss
        out_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        floor = io_floor(src_files, out_bytes, args.dir / "scratch")
        manifest = json.loads((out / "mxconv.json").read_text())
        d = digests(out)
        if first is None:
            first = (d, manifest["tensors"])
        same = d == first[0] and manifest["tensors"] == first[1]
        mem = summary.get("memory", "")
        internal = summary["seconds"]
        rows.append({
            "budget": budget,
            "plan": mem,
            "peak_rss_bytes": rss,
            "peak_gpu_bytes": summary.get("peak_gpu_bytes"),
            "wall_s": round(wall, 2),
            "internal_s": round(internal, 2),
            "gb_per_s": round((src_bytes + out_bytes) / internal / 1e9, 3),
            "floor_s": round(floor, 2),
            "floor_ratio": round(internal / floor, 2),
            "same_bytes": same,
            "relative_rms_error": summary.get("relative_rms_error"),
            "stage_seconds": summary.get("stage_seconds"),
        })
        if not args.json:
            r = rows[-1]
            print(f"{budget:>12}  RSS {gb(rss):>8}  GPU {gb(r['peak_gpu_bytes']):>8}  wall {wall:6.1f} s  internal "
                  f"{internal:6.1f} s  {r['gb_per_s']:.3f} GB/s  floor {floor:5.1f} s  ratio {r['floor_ratio']:.2f}x  "
                  f"same bytes {same}  | {mem}", flush=True)
    doc = {
        "source": str(src), "source_bytes": src_bytes, "experts": args.experts, "hidden": args.hidden,
        "intermediate": args.intermediate, "layers": args.layers, "device": args.device,
        "command": "repack " + args.backend if args.backend else "quantize --format " + args.format, "runs": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    if not all(r["same_bytes"] for r in rows):
        raise SystemExit("output bytes differ between budgets")
    shutil.rmtree(args.dir / "out", ignore_errors=True)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    main()
