#!/usr/bin/env python3
"""Load time: the engine's own load-time processing vs mxconv's loader on bytes already in layout.

For a gpt-oss-120b-sized MoE layer (E=128, H=I=2880; synthetic random MXFP4 bytes) and a whole
model of such layers (36), per backend:

* engine, triton: what vLLM does at load for its TRITON MXFP4 backend on SM90 — canonical MXFP4
  tensors on the host -> H2D -> ``_swizzle_mxfp4``: scale K/32 zero-padded to 4, then
  triton_kernels' own ``convert_layout`` to ``HopperMXValueLayout`` / ``HopperMXScaleLayout``
  (num_warps 8) of the transposed views (this script calls triton_kernels as a library);
* engine, marlin: vLLM repacks one expert at a time with ``gptq_marlin_repack`` from its ``_C``
  library, which the extracted ``_moe_C`` library does not hold; the **stand-in** is mxconv's own
  Marlin layout (``to_kernel``) called one expert at a time on the GPU (H2D first), so the
  marlin "engine" figures are mxconv's per-expert transform, not vLLM's op;
* mxconv: the loader on a kernel-layout output (``load_layer_from_manifest``: safetensors
  ``safe_open`` straight to the GPU + wrapping, no transform).

Single layer: both sides read their own safetensors file from local disk (just written, so the
page cache is warm for both). All layers: the same host tensors are reused for every layer (no
disk; one layer's bytes would need 36x the disk), engine = H2D + transform, mxconv = H2D; the
results stay resident when they fit in GPU memory (as in a real load).

    MXCONV_TRITON_KERNELS=.kern PYTHONPATH=src python scripts/bench_load.py --out load.json
    PYTHONPATH=src python scripts/bench_load.py --small --device cpu --out /tmp/load.json  # smoke test
"""

from __future__ import annotations

import hashlib
import json
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

import mxconv
from _args import parser
from mxconv.engines import discover, marlin_moe, triton_moe
from mxconv.engines.runner import LayerSpec
from mxconv.experts.stack import CanonicalExperts, LayoutSizes, round_up
from mxconv.families.base import ModelInfo
from mxconv.layouts import get_layout
from mxconv.engines.loader import load_layer_from_manifest, read_layer_tensors, resolve_layer
from mxconv.run.plan import kernel_params
from mxconv.source.manifest import FORMAT_VERSION, Manifest
from mxconv.source.st_format import TORCH_TO_ST

PREFIX = "model.layers.0.mlp.experts"


def canonical_stack(E: int, H: int, I: int, device: torch.device) -> CanonicalExperts:
    """Random MXFP4 expert stack (interleaved gpt-oss rows, benign scales, bf16 biases) on the host."""
    g = torch.Generator(device=device).manual_seed(0)
    u8 = dict(dtype=torch.uint8, device=device, generator=g)
    c = CanonicalExperts(
        torch.randint(0, 256, (E, 2 * I, H // 2), **u8), torch.randint(110, 130, (E, 2 * I, H // 32), **u8),
        torch.randint(0, 256, (E, H, I // 2), **u8), torch.randint(110, 130, (E, H, I // 32), **u8),
        torch.randn(E, 2 * I, device=device, generator=g).to(torch.bfloat16), torch.randn(E, H, device=device, generator=g).to(torch.bfloat16),
        "interleaved",
    )  # fmt: skip
    return c.to("cpu")


def nbytes(ts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Minimal safetensors writer (8-byte aligned header and tensors); returns the data bytes."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += round_up(n, 8)
    raw = json.dumps(header).encode()
    raw += b" " * (round_up(len(raw), 8) - len(raw))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            data = t.detach().cpu().contiguous().view(torch.uint8).numpy()
            f.write(memoryview(data))
            f.write(b"\0" * (round_up(data.nbytes, 8) - data.nbytes))
    return offset


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, dict[str, float]]:
    """(result, {seconds, peak_gb, transient_gb}) of ``fn`` (the result stays allocated)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    stats = {"seconds": time.perf_counter() - t0}
    if cuda:
        peak, held = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        stats.update(peak_gb=peak / 1e9, resident_gb=(held - base) / 1e9, transient_gb=(peak - held) / 1e9)
    return out, stats


# ---------------------------------------------------------------------------------------------
# the engine's load-time transforms
# ---------------------------------------------------------------------------------------------


def engine_triton(tk: discover.TritonKernels, c: CanonicalExperts, device: torch.device) -> list[Any]:
    """H2D + vLLM 0.33's ``_swizzle_mxfp4`` steps (via triton_kernels) for w13 and w2."""
    tensor, layout = triton_moe._tk(tk, "tensor"), triton_moe._tk(tk, "tensor_details.layout")
    out = []
    for w, s in ((c.w13, c.w13_scale), (c.w2, c.w2_scale)):
        w, s = w.to(device), s.to(device)
        s = torch.nn.functional.pad(s, (0, round_up(s.shape[-1], 4) - s.shape[-1]))
        wt = tensor.convert_layout(tensor.wrap_torch_tensor(w.transpose(-2, -1), tensor.FP4), layout.HopperMXValueLayout, mx_axis=1)
        st = tensor.convert_layout(tensor.wrap_torch_tensor(s.transpose(-2, -1)), layout.HopperMXScaleLayout, mx_axis=1, num_warps=8)
        del w, s
        out += [wt, st]
    out += [c.w13_bias.to(device).float(), c.w2_bias.to(device).float()]
    return out


def engine_marlin_standin(c: CanonicalExperts, device: torch.device) -> dict[str, torch.Tensor]:
    """H2D + mxconv's Marlin layout one expert at a time (stand-in for vLLM's per-expert repack)."""
    layout = get_layout("marlin")
    opts = layout.resolve_options({})
    g = c.to(device)
    outs: dict[str, list[torch.Tensor]] = {}
    for e in range(g.num_experts):
        one = CanonicalExperts(g.w13[e : e + 1], g.w13_scale[e : e + 1], g.w2[e : e + 1], g.w2_scale[e : e + 1],
                               g.w13_bias[e : e + 1], g.w2_bias[e : e + 1], g.row_order)  # fmt: skip
        for k, t in layout.to_kernel(one, "bf16", opts).items():
            outs.setdefault(k, []).append(t)
    del g
    return {k: torch.cat(v) for k, v in outs.items()}


# ---------------------------------------------------------------------------------------------
# an mxconv kernel-layout output of one synthetic layer (files + manifest)
# ---------------------------------------------------------------------------------------------


def write_output(root: Path, backend: str, c: CanonicalExperts, options: dict[str, Any], device: torch.device) -> tuple[Manifest, int]:
    """Lay out ``c`` on ``device`` with mxconv's backend layout and write a one-layer output; its manifest is
    a whole one (every key the schema requires, each tensor's shape, dtype and sha256), read back as the
    typed Manifest the loader takes."""
    layout = get_layout(backend)
    opts = layout.resolve_options(options)
    H, I, E = c.hidden_size, c.intermediate_size, c.num_experts
    Hp, Ip = layout.padded_sizes(H, I, c.row_order, "bf16", opts)
    sizes = LayoutSizes(E, H, I, Hp, Ip, c.row_order, True)
    kern = {f"{PREFIX}.{k}": t for k, t in layout.to_kernel(c.to(device), "bf16", opts).items()}
    root.mkdir(parents=True, exist_ok=True)
    data = write_safetensors(root / "model.safetensors", kern)
    tensors = {n: {"file": "model.safetensors", "shape": list(t.shape), "dtype": TORCH_TO_ST[t.dtype], "role": "expert",
                   "sha256": hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()}
               for n, t in kern.items()}  # fmt: skip
    del kern
    lay = dict(layout.describe(sizes, "bf16", opts))
    lay.update(hidden_size=H, intermediate_size=I, padded_hidden_size=Hp, padded_intermediate_size=Ip, tp_ranges=[[0, I]],
               options=opts.to_json(), w13_row_order=c.row_order)  # fmt: skip
    info = ModelInfo("gpt-oss", 1, (0,), E, 4, H, I, "mxfp4", c.row_order, True, "topk_softmax", activation="swigluoai",
                     swiglu_alpha=1.702, swiglu_limit=7.0)  # fmt: skip
    lay["kernel_params"] = kernel_params(info)
    module = PREFIX.rsplit(".", 1)[0]
    doc = {"format_version": FORMAT_VERSION, "tool_version": mxconv.__version__, "command": ["scripts/bench_load.py"],
           "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "source": {"revision": None, "fingerprint": "synthetic", "path": str(root)},
           "family": info.family, "kind": "kernel", "weight_format": "mxfp4", "scale_rounding": None, "backend": backend,
           "activation": "bf16", "tp_size": 1, "layout": lay, "model": info.to_json(),
           "layers": [{"layer": 0, "module_prefix": module, "router_weight": f"{module}.router.weight"}], "tensors": tensors}  # fmt: skip
    manifest = Manifest.parse(json.loads(json.dumps(doc)), root / "mxconv.json")
    (root / "mxconv.json").write_text(json.dumps(manifest.as_written(), indent=2))
    return manifest, data


def mxconv_load(root: Path, manifest: Manifest, device: torch.device) -> Any:
    """The loader: safe_open straight to ``device`` + wrapping (on CPU: the read alone)."""
    if device.type == "cuda":
        return load_layer_from_manifest(root, manifest, 0, device=device)
    return read_layer_tensors(resolve_layer(root, 0, manifest=manifest), device)


def read_canonical(path: Path) -> CanonicalExperts:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        t = {k.rsplit(".", 1)[1]: f.get_tensor(k) for k in f.keys()}
    return CanonicalExperts(t["w13"], t["w13_scale"], t["w2"], t["w2_scale"], t["w13_bias"], t["w2_bias"], "interleaved")


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = parser(__doc__, experts=128)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--backends", default="triton,marlin")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workdir", default=None, help="where the one-layer files go (default: a temp dir)")
    ap.add_argument("--small", action="store_true", help="E=4, H=I=256, 3 layers (smoke test)")
    ap.add_argument("--out", required=True, help="JSON results")
    args = ap.parse_args()
    if args.small:
        args.experts, args.hidden, args.intermediate, args.layers = 4, 256, 256, 3
    device = torch.device(args.device)
    E, H, I, L = args.experts, args.hidden, args.intermediate, args.layers
    backends = [b for b in args.backends.split(",") if b]
    tk = discover.find_triton_kernels() if "triton" in backends else None
    gpu = discover.check_gpu(device, exact=None).describe() if device.type == "cuda" else "cpu"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mxconv-bench-load-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": gpu, "experts": E, "hidden": H, "intermediate": I, "layers": L,
                              "torch": torch.__version__, "triton_kernels": None if tk is None else tk.location,
                              "marlin_engine": "stand-in: mxconv marlin layout one expert at a time (vLLM's gptq_marlin_repack is not in _moe_C)",
                              "single_layer": {}, "all_layers": {}}  # fmt: skip
    c = canonical_stack(E, H, I, device)
    canon_file = work / "canonical.safetensors"
    canon_bytes = write_safetensors(canon_file, {f"{PREFIX}.{k}": v for k, v in
                                                 (("w13", c.w13), ("w13_scale", c.w13_scale), ("w2", c.w2), ("w2_scale", c.w2_scale),
                                                  ("w13_bias", c.w13_bias), ("w2_bias", c.w2_bias))})  # fmt: skip
    print(f"{gpu}: E={E} H={H} I={I}; canonical layer {canon_bytes / 1e9:.3f} GB")
    for backend in backends:
        options = {"pad_hidden": H % 64 != 0} if backend == "triton" else {}
        manifest, kern_bytes = write_output(work / backend, backend, c, options, device)
        engine = (lambda cc: engine_triton(tk, cc, device)) if backend == "triton" else (lambda cc: engine_marlin_standin(cc, device))
        # warm-up: JIT compiles and index tables outside the timings (2 experts)
        small = CanonicalExperts(c.w13[:2], c.w13_scale[:2], c.w2[:2], c.w2_scale[:2], c.w13_bias[:2], c.w2_bias[:2], "interleaved")
        engine(small)
        mxconv_load(work / backend, manifest, device)
        # single layer from disk
        got, eng = timed(lambda: engine(read_canonical(canon_file)), device)
        del got
        got, mine = timed(lambda: mxconv_load(work / backend, manifest, device), device)
        del got
        eng["bytes_read"], mine["bytes_read"] = canon_bytes, kern_bytes
        one = {"engine": eng, "mxconv": mine, "seconds_ratio": eng["seconds"] / mine["seconds"]}
        result["single_layer"][backend] = one
        print(f"[1 layer] {backend:6s} engine {eng['seconds']:.3f}s ({canon_bytes / 1e9:.2f} GB read) | mxconv {mine['seconds']:.3f}s "
              f"({kern_bytes / 1e9:.2f} GB read) | x{one['seconds_ratio']:.1f}"
              + (f" | peak GPU {eng['peak_gb']:.2f} vs {mine['peak_gb']:.2f} GB" if device.type == "cuda" else ""))  # fmt: skip
        # all layers from host memory (the same host bytes for every layer)
        host_kern = read_layer_tensors(resolve_layer(work / backend, 0, manifest=manifest), "cpu")
        per_layer = nbytes(host_kern.values())
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
        keep = device.type != "cuda" or L * per_layer + 12e9 < total
        rows: dict[str, Any] = {"kept_resident": keep, "layout_bytes_per_layer": per_layer, "canonical_bytes_per_layer": canon_bytes}

        def run_all(fn: Callable[[], Any]) -> dict[str, float]:
            held: list[Any] = []

            def loop() -> None:
                for _ in range(L):
                    r = fn()
                    if keep:
                        held.append(r)
                    del r

            _, stats = timed(loop, device)
            held.clear()
            return stats

        rows["engine"] = run_all(lambda: engine(c))

        lay = manifest.layout
        spec = LayerSpec("experts", lay, E, H, lay.padded_hidden_size, I, 1, "swigluoai")

        def load_host() -> Any:
            t = {k: v.to(device) for k, v in host_kern.items()}
            if backend == "triton" and device.type == "cuda":
                return triton_moe.build_experts(tk, t, spec, lay.padded_intermediate_size)
            if device.type == "cuda":
                return marlin_moe.build_experts(t, spec, lay.padded_intermediate_size, "interleaved")
            return t

        rows["mxconv"] = run_all(load_host)
        rows["seconds_ratio"] = rows["engine"]["seconds"] / rows["mxconv"]["seconds"]
        rows["engine"]["h2d_bytes"], rows["mxconv"]["h2d_bytes"] = L * nbytes(
            (c.w13, c.w13_scale, c.w2, c.w2_scale, c.w13_bias, c.w2_bias)), L * per_layer  # fmt: skip
        result["all_layers"][backend] = rows
        print(f"[{L} layers] {backend:6s} engine {rows['engine']['seconds']:.2f}s | mxconv {rows['mxconv']['seconds']:.2f}s | "
              f"x{rows['seconds_ratio']:.1f} | kept resident: {keep}"
              + (f" | peak GPU {rows['engine']['peak_gb']:.1f} vs {rows['mxconv']['peak_gb']:.1f} GB" if device.type == "cuda" else ""))  # fmt: skip
        host_kern.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
