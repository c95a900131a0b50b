#!/usr/bin/env python3
"""End-to-end benchmark: a synthetic gpt-oss-20b-sized checkpoint on local disk through
`mxconv quantize` (bf16 source) or `mxconv repack --backend trtllm` (MXFP4 source), against the
I/O floor measured in the same run on the same files: reading every source byte and writing as
many bytes as mxconv writes (fsync'd), with nothing else.

Before each timed phase the source files are evicted from the page cache (posix_fadvise
DONTNEED, no root needed), so both phases read from the disk the same way.

    PYTHONPATH=src python scripts/bench_e2e.py --mode repack   --dir /tmp/bench   # 24 layers, MXFP4
    PYTHONPATH=src python scripts/bench_e2e.py --mode quantize --dir /tmp/bench --layers 8
    PYTHONPATH=src python scripts/bench_e2e.py --mode quantize --model 120b --layers 3   # 128 experts
    PYTHONPATH=src python scripts/bench_e2e.py --mode repack --small              # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench_disk import evict  # scripts/ is sys.path[0] when a script runs

GPT_OSS = {
    "20b": dict(E=32, H=2880, I=2880, V=201088, layers=24),
    "120b": dict(E=128, H=2880, I=2880, V=201088, layers=36),
}


def _evict(paths: list[Path]) -> None:
    for p in paths:
        evict(p)


def generate(root: Path, mode: str, E: int, H: int, I: int, V: int, layers: int, device: torch.device) -> None:
    """gpt-oss HF layout: bf16 experts transposed [E, H, 2I] / [E, I, H] (quantize) or MXFP4 blocks."""
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    cfg = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": layers,
        "num_local_experts": E, "num_experts_per_tok": 4, "experts_per_token": 4, "hidden_size": H,
        "intermediate_size": I, "swiglu_limit": 7.0, "head_dim": 64, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": V, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
    }
    if mode == "repack":
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    weight_map: dict[str, str] = {}
    total = 0
    nshards = layers + 1

    def bf16(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=g) * std).to(torch.bfloat16).cpu()

    def save(idx: int, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        name = f"model-{idx:05d}-of-{nshards:05d}.safetensors"
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()

    save(1, {"model.embed_tokens.weight": bf16(V, H), "lm_head.weight": bf16(V, H), "model.norm.weight": bf16(H, std=1.0)})
    for L in range(layers):
        p = f"model.layers.{L}"
        t = {
            f"{p}.input_layernorm.weight": bf16(H, std=1.0),
            f"{p}.post_attention_layernorm.weight": bf16(H, std=1.0),
            f"{p}.self_attn.q_proj.weight": bf16(4096, H), f"{p}.self_attn.q_proj.bias": bf16(4096),
            f"{p}.self_attn.k_proj.weight": bf16(512, H), f"{p}.self_attn.k_proj.bias": bf16(512),
            f"{p}.self_attn.v_proj.weight": bf16(512, H), f"{p}.self_attn.v_proj.bias": bf16(512),
            f"{p}.self_attn.o_proj.weight": bf16(H, 4096), f"{p}.self_attn.o_proj.bias": bf16(H),
            f"{p}.self_attn.sinks": bf16(64, std=1.0),
            f"{p}.mlp.router.weight": bf16(E, H), f"{p}.mlp.router.bias": bf16(E),
            f"{p}.mlp.experts.gate_up_proj_bias": bf16(E, 2 * I), f"{p}.mlp.experts.down_proj_bias": bf16(E, H),
        }
        if mode == "repack":
            u8 = dict(dtype=torch.uint8, device=device, generator=g)
            t[f"{p}.mlp.experts.gate_up_proj_blocks"] = torch.randint(0, 256, (E, 2 * I, H // 32, 16), **u8).cpu()
            t[f"{p}.mlp.experts.gate_up_proj_scales"] = torch.randint(117, 125, (E, 2 * I, H // 32), **u8).cpu()
            t[f"{p}.mlp.experts.down_proj_blocks"] = torch.randint(0, 256, (E, H, I // 32, 16), **u8).cpu()
            t[f"{p}.mlp.experts.down_proj_scales"] = torch.randint(117, 125, (E, H, I // 32), **u8).cpu()
        else:
            t[f"{p}.mlp.experts.gate_up_proj"] = bf16(E, H, 2 * I)
            t[f"{p}.mlp.experts.down_proj"] = bf16(E, I, H)
        save(L + 2, t)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (root / "tokenizer.json").write_text("{}")


def io_floor(src: Path, out_bytes: int, scratch: Path, writeback: bool) -> float:
    """Seconds to read every source shard and write ``out_bytes`` (fsync'd) with nothing else:
    one reader thread, the main thread writing in step with what has been read (64 MiB chunks).
    ``writeback``: start each chunk's write-out at once, as mxconv's writer does (mxconv.source.diskio)."""
    from mxconv.source.diskio import start_writeback

    import queue
    import threading

    shards = sorted(src.glob("*.safetensors"))
    total_in = sum(f.stat().st_size for f in shards)
    _evict(shards)
    q: queue.Queue = queue.Queue(maxsize=4)

    def reader() -> None:
        for f in shards:
            with open(f, "rb", buffering=0) as fh:
                while b := fh.read(64 << 20):
                    q.put(len(b))
        q.put(None)

    chunk = memoryview(bytes(64 << 20))
    t0 = time.perf_counter()
    th = threading.Thread(target=reader)
    th.start()
    read = written = 0
    with open(scratch, "wb", buffering=0) as out:
        while (n := q.get()) is not None:
            read += n
            due = out_bytes * read // total_in
            while written < due:
                k = min(len(chunk), due - written)
                out.write(chunk[:k])
                if writeback:
                    start_writeback(out.fileno(), written, k)
                written += k
        os.fsync(out.fileno())
    th.join()
    dt = time.perf_counter() - t0
    scratch.unlink()
    return dt


def _busy(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``spans``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def timeline(trace: dict, launched_epoch: float | None = None, wall: float | None = None) -> dict:
    """Where the run's time went, from its --trace file (seconds since mxconv's timer started):
    how long each stage kept at least one thread busy, when writing began and reading ended, and
    the setup before the pipeline (with the CLI: importing torch, starting CUDA) and the finish after
    it (last fsyncs, config, manifest)."""
    ev = trace["events"]
    spans = lambda *stages: [(a, b) for s, _, a, b in ev if s in stages]  # noqa: E731
    one = lambda stage: next(((a, b) for s, _, a, b in ev if s == stage), (0.0, 0.0))  # noqa: E731
    writes = spans("write", "copy")
    return {
        "items": len(trace["items"]),
        "setup_s": one("setup")[1],
        "first_write_at_s": min((a for a, _ in writes), default=None),
        "last_load_end_at_s": max((b for _, b in spans("load")), default=None),
        "pipeline_end_at_s": one("finish")[0],
        "finish_s": one("finish")[1] - one("finish")[0],
        "busy_load_s": _busy(spans("load")),
        "busy_compute_s": _busy(spans("compute")),
        "busy_write_s": _busy(writes),
        "busy_copy_s": _busy(spans("copy")),
        # process start -> mxconv's timer (interpreter, CLI imports, planning) and its finish -> exit
        "before_timer_s": (trace["origin_epoch"] - launched_epoch) if launched_epoch and "origin_epoch" in trace else None,
        "after_finish_s": (launched_epoch + wall - trace["origin_epoch"] - one("finish")[1])
        if launched_epoch and wall and "origin_epoch" in trace else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("quantize", "repack"), default="repack")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mxconv-bench"))
    ap.add_argument("--model", choices=tuple(GPT_OSS), default="20b", help="gpt-oss shape (experts per layer, sizes)")
    ap.add_argument("--backend", default="trtllm", help="repack backend")
    ap.add_argument("--layers", type=int, default=None,
                    help="MoE layers (default: all for a 20b repack, 8 for a 20b quantize, 4 for 120b)")
    ap.add_argument("--small", action="store_true", help="tiny sizes: a CPU smoke test")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace-out", type=Path, default=None, help="also keep mxconv's raw --trace timeline here")
    ap.add_argument("--warm-triton", action="store_true",
                    help="let mxconv use the default Triton cache (default: an empty one, as on a fresh machine)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = dict(GPT_OSS[args.model])
    if args.small:
        shape.update(E=4, H=256, I=256, V=512, layers=2)
    if args.layers:
        shape["layers"] = args.layers
    elif args.model == "120b" and not args.small:
        shape["layers"] = 4
    elif args.mode == "quantize" and not args.small:
        shape["layers"] = 8
    src, out = args.dir / f"src-{args.mode}", args.dir / f"out-{args.mode}"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    generate(src, args.mode, shape["E"], shape["H"], shape["I"], shape["V"], shape["layers"], dev)
    gen_s = time.perf_counter() - t0
    src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))

    cmd = [sys.executable, "-m", "mxconv.cli", args.mode, str(src), str(out), "--json", "--quiet", "--overwrite"]
    cmd += ["--backend", args.backend] if args.mode == "repack" else ["--format", "mxfp4"]
    # dry run first to learn the output size for the floor
    plan = json.loads(subprocess.run(cmd + ["--dry-run"], capture_output=True, text=True, check=True).stdout)
    # the floor is the faster of plain writes (flushed at the end) and writes streamed out as they go
    floors = {wb: io_floor(src, plan["bytes_out"], args.dir / "floor.scratch", wb) for wb in (False, True)}
    floor_s = min(floors.values())
    _evict(sorted(src.glob("*.safetensors")))
    trace_file = args.dir / "trace.json"
    out_file, err_file = args.dir / "run.out", args.dir / "run.err"
    with open(out_file, "w") as fo, open(err_file, "w") as fe:
        env = dict(os.environ)
        if not args.warm_triton:  # compile every kernel, as the first run on a fresh machine does
            env["TRITON_CACHE_DIR"] = cold_cache = tempfile.mkdtemp(prefix="mxconv-triton-", dir=args.dir)
        t0, t0_epoch = time.perf_counter(), time.time()
        proc = subprocess.Popen(cmd + ["--trace", str(trace_file)], stdout=fo, stderr=fe, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    if not args.warm_triton:
        shutil.rmtree(cold_cache, ignore_errors=True)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"mxconv failed ({os.waitstatus_to_exitcode(status)}): {err_file.read_text()}")
    summary = json.loads(out_file.read_text())
    # mxconv's own VmHWM; ru_maxrss would start at this script's peak (exec keeps the high-water mark
    # of the address space it replaces, and this script held the generated layers)
    peak_rss = summary.get("peak_host_rss_bytes") or usage.ru_maxrss * 1024
    doc = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "mode": args.mode,
        "model": args.model,
        "backend": args.backend if args.mode == "repack" else None,
        "shape": shape,
        "source_bytes": src_bytes,
        "output_bytes": summary["bytes_out"],
        "generate_s": gen_s,
        "io_floor_s": floor_s,
        "io_floor_plain_s": floors[False],
        "io_floor_streamed_s": floors[True],
        "mxconv_wall_s": wall,
        "mxconv_internal_s": summary["seconds"],
        "ratio_to_floor": wall / floor_s,  # includes interpreter + torch start-up (~2-5 s)
        "ratio_internal_to_floor": summary["seconds"] / floor_s,  # Conversion.run(): OUTPUT prepared -> manifest
        "peak_host_rss_bytes": peak_rss,  # mxconv's process
        "peak_gpu_bytes": summary.get("peak_gpu_bytes"),
        "compute_s": summary.get("compute_seconds"),
        "stage_seconds": summary.get("stage_seconds"),
        "relative_rms_error": summary.get("relative_rms_error"),
        "triton_cache": "default" if args.warm_triton else "empty",
        "timeline": timeline(json.loads(trace_file.read_text()), t0_epoch, wall) if trace_file.is_file() else None,
    }
    if args.trace_out and trace_file.is_file():
        shutil.copyfile(trace_file, args.trace_out)
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        for k, v in doc.items():
            print(f"{k:22} {v}")


if __name__ == "__main__":
    main()
