#!/usr/bin/env python3
"""CPU side by side: ``mxconv quantize`` against llm-compressor's ``model_free_ptq`` on one checkpoint.

What a user picking a tool would run, on the same machine in the same session: a bf16 checkpoint with
Qwen3-30B-A3B's expert shapes (128 experts, hidden 2048, expert intermediate 768; ``--layers`` MoE
layers, small attention and vocabulary; ``bench_memory.generate``, one Linear per expert) is written
once into ``--dir`` (layer by layer, never held whole in memory), then for each format

* ``mxconv quantize SRC OUT --format F --device cpu --scale-rounding R`` and
* llm-compressor's ``model_free_ptq(SRC, OUT, scheme=..., device="cpu")`` (scheme ``MXFP4A16`` /
  ``MXFP8A16``: MX weights; routers, attention, embeddings and the head ignored, so both quantize
  exactly the routed experts)

each run in its own child process, alternating, ``--reps`` times. Source files are evicted from the
page cache (``posix_fadvise(DONTNEED)``) before every run. Reported per run: wall seconds (process
start to exit, imports included), the tool's own seconds (mxconv's ``seconds`` in ``--json``; for the peer
the ``model_free_ptq`` call alone), GB/s = (source + output bytes) / wall, peak RSS (each tool's own
VmHWM: mxconv's ``peak_host_rss_bytes``, the peer's read at the end of its child) and the
peer/mxconv time ratio (> 1: mxconv faster).

The output bytes are compared tensor by tensor over every routed expert (E4M3 / packed E2M1 data and
E8M0 scales) under the scale rule the peer computes. compressed-tensors' rule
(``generate_mx_scales``) rounds the block maximum to ONE mantissa bit, ties away, and takes
``floor(log2) - emax``: for MXFP4 that is mxconv's ``even``; for MXFP8 it bumps the exponent when the
block maximum's significand is >= 1.75, where mxconv's ``rceil`` bumps when it is > 1.75 — the two
differ exactly on blocks whose maximum has significand 1.75 (a tie, about 1 % of bf16 blocks). The
script therefore runs mxfp4 with ``even`` and mxfp8 with ``rceil`` by default, and for every block
whose bytes differ it checks that the block is such a tie (reported as ``explained``).

    python scripts/bench_cpu_peer.py                          # 2 layers, both formats, 2 reps
    python scripts/bench_cpu_peer.py --formats mxfp8 --reps 3
    python scripts/bench_cpu_peer.py --small                  # smoke test (seconds)

Needs llm-compressor (``pip install -e .[bench]``; not a runtime dependency of mxconv).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import _evict  # noqa: E402 - page-cache eviction, as the other end-to-end benchmarks do it
from bench_memory import generate  # noqa: E402 - the same Qwen3-MoE checkpoint the memory benchmark writes

QWEN3_30B_A3B = dict(E=128, H=2048, I=768)
SMALL = dict(E=8, H=256, I=128)
PEER_SCHEMES = {"mxfp4": "MXFP4A16", "mxfp8": "MXFP8A16"}
# The mxconv rule closest to compressed-tensors' (identical for mxfp4, equal except on 1.75 ties for mxfp8)
PEER_RULES = {"mxfp4": "even", "mxfp8": "rceil"}
# Everything but the routed experts stays as it is on both sides.
PEER_IGNORE = ["re:.*self_attn.*", "re:.*mlp\\.gate$", "lm_head", "re:.*embed_tokens$"]


# ---------------------------------------------------------------------------------------------------
# the checkpoint
# ---------------------------------------------------------------------------------------------------


def dir_bytes(root: Path, suffix: str = ".safetensors") -> int:
    return sum(p.stat().st_size for p in root.rglob(f"*{suffix}"))


def evict(root: Path) -> None:
    """Drop ``root``'s safetensors files from the page cache."""
    _evict(sorted(root.glob("*.safetensors")))


# ---------------------------------------------------------------------------------------------------
# the two tools, each in a child process
# ---------------------------------------------------------------------------------------------------


def run_child(argv: list[str], env: dict[str, str]) -> dict:
    """Run ``argv``; wall seconds, peak RSS bytes (``ru_maxrss``: at least this script's own peak,
    since exec keeps the spawning address space's high-water mark; the callers replace it with the
    tool's own VmHWM), exit code, stdout, stderr tail."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    outs: dict[str, bytes] = {}

    def drain(name: str, stream) -> None:
        outs[name] = stream.read()

    readers = [threading.Thread(target=drain, args=(k, s)) for k, s in (("out", proc.stdout), ("err", proc.stderr))]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    for r in readers:
        r.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"wall": wall, "peak_rss": usage.ru_maxrss * 1024, "rc": proc.returncode,
            "stdout": outs["out"].decode(errors="replace"), "stderr": outs["err"].decode(errors="replace")[-3000:]}


MXCONV_SRC = REPO / "src"


def child_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(MXCONV_SRC) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_mxconv(src: Path, out: Path, fmt: str, rule: str, threads: int | None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-m", "mxconv.cli", "quantize", str(src), str(out), "--format", fmt,
            "--scale-rounding", rule, "--device", "cpu", "--json", "--quiet"]
    res = run_child(argv, child_env(threads))
    if res["rc"] != 0:
        raise SystemExit(f"mxconv failed ({res['rc']}):\n{res['stdout'][-2000:]}\n{res['stderr']}")
    summary = json.loads(res["stdout"])
    res["internal"] = summary["seconds"]
    res["summary"] = {k: summary.get(k) for k in ("seconds", "compute_seconds", "stage_seconds", "relative_rms_error")}
    res["peak_rss"] = summary.get("peak_host_rss_bytes") or res["peak_rss"]  # its own VmHWM (see run_child)
    return res


_PEER_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from llmcompressor import model_free_ptq
t1 = time.perf_counter()
model_free_ptq(sys.argv[1], sys.argv[2], scheme=sys.argv[3], ignore=json.loads(sys.argv[4]), device="cpu")
t2 = time.perf_counter()
hwm = next((int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")), None)
print(json.dumps({"import_seconds": t1 - t0, "call_seconds": t2 - t1, "peak_rss": hwm}))
"""


def run_peer(src: Path, out: Path, fmt: str, threads: int | None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-c", _PEER_CHILD, str(src), str(out), PEER_SCHEMES[fmt], json.dumps(PEER_IGNORE)]
    res = run_child(argv, child_env(threads))
    if res["rc"] != 0:
        raise SystemExit(f"model_free_ptq failed ({res['rc']}):\n{res['stdout'][-2000:]}\n{res['stderr']}")
    summary = json.loads(res["stdout"].strip().splitlines()[-1])
    res["internal"] = summary["call_seconds"]
    res["summary"] = summary
    res["peak_rss"] = summary.get("peak_rss") or res["peak_rss"]  # its own VmHWM (see run_child)
    return res


# ---------------------------------------------------------------------------------------------------
# byte comparison
# ---------------------------------------------------------------------------------------------------


def _tensor_index(root: Path) -> dict[str, Path]:
    idx = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    return {k: root / v for k, v in idx.items()}


def _sig_is_175(amax_bits):
    """True where the fp32 block maximum's significand is exactly 1.75 (mantissa field 0x600000)."""
    return (amax_bits & 0x7FFFFF) == 0x600000


def compare(src: Path, ours: Path, peer: Path, fmt: str) -> dict:
    """Byte comparison of every routed expert's data + scales; differing blocks classified."""
    import torch
    from safetensors import safe_open

    a_idx, b_idx, s_idx = _tensor_index(ours), _tensor_index(peer), _tensor_index(src)
    data_suffix = ".weight_packed" if fmt == "mxfp4" else ".weight"
    modules = sorted(k[: -len(".weight_scale")] for k in b_idx if k.endswith(".weight_scale") and ".experts." in k)
    handles: dict[Path, object] = {}

    def get(index: dict[str, Path], name: str) -> torch.Tensor:
        path = index[name]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        t = handles[path].get_tensor(name)
        return t.view(torch.uint8) if t.dtype != torch.uint8 else t

    res = {"modules": len(modules), "bytes": 0, "bytes_differ": 0, "data_bytes_differ": 0, "scale_bytes_differ": 0,
           "blocks": 0, "blocks_differ": 0, "blocks_differ_unexplained": 0, "missing": []}
    for m in modules:
        names = (m + data_suffix, m + ".weight_scale")
        if any(n not in a_idx for n in names):
            res["missing"].append(m)
            continue
        da, db = get(a_idx, names[0]), get(b_idx, names[0])
        sa, sb = get(a_idx, names[1]), get(b_idx, names[1])
        if da.shape != db.shape or sa.shape != sb.shape:
            raise SystemExit(f"{m}: shapes differ: {tuple(da.shape)}/{tuple(db.shape)}, {tuple(sa.shape)}/{tuple(sb.shape)}")
        dd, ds = int((da != db).sum()), int((sa != sb).sum())
        res["bytes"] += da.numel() + sa.numel()
        res["data_bytes_differ"] += dd
        res["scale_bytes_differ"] += ds
        res["blocks"] += sa.numel()
        if dd or ds:
            rows, nb = sa.shape
            per_block = da.shape[-1] // nb
            bad = (da != db).view(rows, nb, per_block).any(-1) | (sa != sb)
            x = get(s_idx, m + ".weight").view(torch.bfloat16).float().view(rows, nb, 32)
            amax_bits = x.abs().amax(-1).view(torch.int32)
            res["blocks_differ"] += int(bad.sum())
            res["blocks_differ_unexplained"] += int((bad & ~_sig_is_175(amax_bits)).sum())
    res["bytes_differ"] = res["data_bytes_differ"] + res["scale_bytes_differ"]
    return res


def count_ties(src: Path) -> dict:
    """Blocks of the routed experts whose maximum has significand 1.75 (where the peer's MXFP8 rule and rceil differ)."""
    import torch
    from safetensors import safe_open

    blocks = ties = 0
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if ".experts." not in k:
                    continue
                x = h.get_tensor(k).float()
                a = x.view(*x.shape[:-1], -1, 32).abs().amax(-1).view(torch.int32)
                blocks += a.numel()
                ties += int(_sig_is_175(a).sum())
    return {"blocks": blocks, "ties_1_75": ties}


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------


def _fmt_gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mxconv-bench-peer"), help="work directory (source + outputs)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--formats", default="mxfp4,mxfp8")
    ap.add_argument("--rule", action="append", default=[], metavar="FMT=RULE",
                    help="mxconv --scale-rounding per format (default mxfp4=even, mxfp8=rceil: the peer's rule)")
    ap.add_argument("--reps", type=int, default=2, help="runs of each tool per format, alternating")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both children (default: unset)")
    ap.add_argument("--mxconv-src", type=Path, default=None,
                    help="the mxconv package folder to run (default: this checkout's src/; e.g. an older copy)")
    ap.add_argument("--only", choices=("mxconv", "peer"), default=None, help="time one tool only (no byte check)")
    ap.add_argument("--no-compare", action="store_true")
    ap.add_argument("--no-evict", action="store_true", help="keep the source in the page cache between runs")
    ap.add_argument("--small", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--keep", action="store_true", help="keep the outputs")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args(argv)

    global MXCONV_SRC
    if args.mxconv_src is not None:
        MXCONV_SRC = args.mxconv_src.resolve()
    shape = dict(SMALL if args.small else QWEN3_30B_A3B)
    for key, opt in (("E", args.experts), ("H", args.hidden), ("I", args.intermediate)):
        if opt:
            shape[key] = opt
    layers = 1 if args.small and args.layers == 2 else args.layers
    rules = dict(PEER_RULES)
    for item in args.rule:
        fmt, _, rule = item.partition("=")
        rules[fmt] = rule
    formats = [f for f in args.formats.split(",") if f]

    src = args.dir / "src"
    want = {**shape, "layers": layers, "seed": 0}
    if not (src / "bench.json").exists() or json.loads((src / "bench.json").read_text()) != want:
        shutil.rmtree(src, ignore_errors=True)
        t0 = time.perf_counter()
        generate(src, shape["E"], shape["H"], shape["I"], layers)
        (src / "bench.json").write_text(json.dumps(want))
        print(f"generated {src} ({_fmt_gb(dir_bytes(src))}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    src_bytes = dir_bytes(src)
    expert_elems = layers * shape["E"] * 3 * shape["H"] * shape["I"]

    import torch

    report: dict = {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "shape": want,
        "mxconv_src": str(MXCONV_SRC), "source_bytes": src_bytes, "expert_bf16_bytes": 2 * expert_elems, "rules": rules, "formats": {},
    }
    try:  # the version only: importing llm-compressor here would print its logging to stdout
        from importlib.metadata import version

        report["llmcompressor"] = version("llmcompressor")
    except Exception:  # noqa: BLE001
        report["llmcompressor"] = None
        if args.only != "mxconv":
            raise SystemExit("llm-compressor is not installed: pip install -e .[bench] (or --only mxconv)")

    for fmt in formats:
        entry: dict = {"rule": rules[fmt], "mxconv": [], "peer": []}
        tools = [t for t in ("mxconv", "peer") if args.only in (None, t)]
        for rep in range(args.reps):
            order = tools if rep % 2 == 0 else tools[::-1]
            for tool in order:
                if not args.no_evict:
                    evict(src)
                out = args.dir / f"out-{tool}-{fmt}"
                r = run_mxconv(src, out, fmt, rules[fmt], args.threads) if tool == "mxconv" else run_peer(src, out, fmt, args.threads)
                r["out_bytes"] = dir_bytes(out)
                r["gbps"] = (src_bytes + r["out_bytes"]) / r["wall"] / 1e9
                del r["stdout"], r["stderr"]
                entry[tool].append(r)
                print(f"{fmt} {tool:6s} rep {rep}: wall {r['wall']:.1f} s, internal {r['internal']:.1f} s, "
                      f"peak RSS {_fmt_gb(r['peak_rss'])}", file=sys.stderr)
        for tool in tools:
            runs = entry[tool]
            entry[f"{tool}_median"] = {k: statistics.median(r[k] for r in runs) for k in ("wall", "internal", "peak_rss", "gbps")}
        if len(tools) == 2:
            a, b = entry["mxconv_median"], entry["peer_median"]
            entry["ratio_wall"] = b["wall"] / a["wall"]
            entry["ratio_internal"] = b["internal"] / a["internal"]
            entry["ratio_per_rep"] = [p["wall"] / m["wall"] for m, p in zip(entry["mxconv"], entry["peer"])]
            if not args.no_compare:
                entry["compare"] = compare(src, args.dir / f"out-mxconv-{fmt}", args.dir / f"out-peer-{fmt}", fmt)
        report["formats"][fmt] = entry
        if not args.keep:
            for tool in tools:
                shutil.rmtree(args.dir / f"out-{tool}-{fmt}", ignore_errors=True)
    if "mxfp8" in formats and not args.no_compare and args.only is None:
        report["source_ties_1_75"] = count_ties(src)

    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0


def print_table(report: dict) -> None:
    s = report["shape"]
    print(f"{report['machine']}, torch {report['torch']}, llm-compressor {report['llmcompressor']}, {report['date']}")
    print(f"checkpoint: {s['layers']} MoE layers x {s['E']} experts, H {s['H']}, I {s['I']}, bf16; "
          f"{_fmt_gb(report['source_bytes'])} ({_fmt_gb(report['expert_bf16_bytes'])} of experts)")
    print("| format | rule | tool | wall s | internal s | GB/s | peak RSS | peer/mxconv (wall) | (internal) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt, e in report["formats"].items():
        for tool in ("mxconv", "peer"):
            m = e.get(f"{tool}_median")
            if m is None:
                continue
            ratio = f"**{e['ratio_wall']:.2f}x**" if tool == "mxconv" and "ratio_wall" in e else ""
            ratio_i = f"{e['ratio_internal']:.2f}x" if tool == "mxconv" and "ratio_internal" in e else ""
            print(f"| {fmt} | {e['rule']} | {tool} | {m['wall']:.1f} | {m['internal']:.1f} | {m['gbps']:.3f} | "
                  f"{_fmt_gb(m['peak_rss'])} | {ratio} | {ratio_i} |")
        if "ratio_per_rep" in e:
            print(f"  {fmt} per-rep wall ratios: {', '.join(f'{r:.2f}' for r in e['ratio_per_rep'])}")
        c = e.get("compare")
        if c:
            print(f"  {fmt} bytes: {c['bytes_differ']} of {c['bytes']} differ (data {c['data_bytes_differ']}, "
                  f"scales {c['scale_bytes_differ']}); blocks {c['blocks_differ']} of {c['blocks']} differ, "
                  f"{c['blocks_differ_unexplained']} not a 1.75 tie; {c['modules']} expert linears"
                  + (f", missing in mxconv: {len(c['missing'])}" if c["missing"] else ""))
    if "source_ties_1_75" in report:
        t = report["source_ties_1_75"]
        print(f"  source blocks whose max has significand 1.75: {t['ties_1_75']} of {t['blocks']}")


if __name__ == "__main__":
    sys.exit(main())
