"""The engines' own kernels on mxconv's bytes, on a Hopper GPU (``-m gpu``; see test_engines.py).

Tiny gpt-oss-style (interleaved gate/up, SwiGLU-OAI, biases; hidden 160, padded to 192 for triton with
``pad_hidden``) and Qwen-style (halves, SiLU, no biases) layers are quantized, repacked for marlin
and triton (TP 1 and 2), loaded with :mod:`mxconv.engines.loader` and run through vLLM's Marlin MoE GEMM /
triton_kernels' ``matmul_ogs``; the output must match :func:`mxconv.verify.reference_moe.moe_forward` on the
canonical MXFP4 weights within :data:`mxconv.engines.runner.KERNEL_THRESHOLDS`, and four planted layout
bugs must not. Figures go to stdout and, with ``MXCONV_ENGINE_REPORT=FILE``, to FILE (JSON lines).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.gpu_outputs import KINDS, Case, need_kernels, repacked_cases
from typer.testing import CliRunner

from mxconv.cli import app
from mxconv.engines.loader import (
    LayerSource,
    build_engine_layer,
    read_layer_tensors,
    resolve_layer,
    run_kernel_layer,
)
from mxconv.engines.runner import KERNEL_THRESHOLDS
from mxconv.examples import ModelSizes, make_checkpoint
from mxconv.experts.stack import CanonicalExperts
from mxconv.families import detect_family
from mxconv.source.checkpoint import open_checkpoint
from mxconv.source.manifest import load_manifest
from mxconv.verify.numerics import expert_fn
from mxconv.verify.reference_moe import (
    Routing,
    compare,
    hidden_states,
    moe_forward,
    route,
)

pytestmark = pytest.mark.gpu
TOKENS = 64
cli = CliRunner()


def mx(*args: object) -> tuple[int, str]:
    r = cli.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout + r.stderr


def _report(record: dict) -> None:
    print("ENGINE", json.dumps(record))
    path = os.environ.get("MXCONV_ENGINE_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    repacks = {"marlin": ["--backend", "marlin"], "marlin-tp2": ["--backend", "marlin", "--tp", "2"],
               "triton": ["--backend", "triton"], "triton-tp2": ["--backend", "triton", "--tp", "2"]}  # fmt: skip
    return repacked_cases(tmp_path_factory.mktemp("engines-gpu"), repacks, required=False)


def _reference(q4: Path, layer: int) -> tuple[torch.Tensor, Routing, torch.Tensor, CanonicalExperts, torch.Tensor]:
    """(x [T, H] fp32, routing, fp32 reference output, canonical experts, router logits fp32)."""
    ck = open_checkpoint(q4)
    reader = detect_family(ck)
    info = reader.model_info()
    ref = {r.layer: r for r in reader.layer_refs()}[layer]
    lay = reader.read_layer(ref)
    x = hidden_states(TOKENS, info.hidden_size, 0, layer)
    rw = ck.read(ref.router_weight).float()
    rb = ck.read(ref.router_bias).float() if ref.router_bias else None
    r = route(x, rw, info, rb)
    fn = expert_fn(lay.w13_mx, lay.w2_mx, lay.w13_bias, lay.w2_bias)
    canon = CanonicalExperts(lay.w13_mx.data, lay.w13_mx.scales, lay.w2_mx.data, lay.w2_mx.scales, lay.w13_bias, lay.w2_bias,
                             lay.row_order, lay.w13_mx.fmt)  # fmt: skip
    logits = x @ rw.t() + (rb if rb is not None else 0)
    return x, r, moe_forward(x, r, fn, info.num_experts, info, lay.row_order), canon, logits


def _check(tag: str, out: torch.Tensor, ref: torch.Tensor, r: Routing, expect_ok: bool, **extra: object) -> None:
    c = compare(out.float().cpu(), ref, r.ids, r.ids)
    ok = c.rel_rms <= KERNEL_THRESHOLDS["rel_rms"] and c.cosine >= KERNEL_THRESHOLDS["cosine"]
    _report({"case": tag, "rel_rms": c.rel_rms, "cosine": c.cosine, "max_abs": c.max_abs, "within_bound": ok,
             "device": torch.cuda.get_device_name(), **extra})  # fmt: skip
    if expect_ok:
        assert ok, f"{tag}: rel RMS {c.rel_rms:.3g}, cosine {c.cosine:.6f} vs bound {KERNEL_THRESHOLDS}"
    else:
        assert not ok and not c.rel_rms <= KERNEL_THRESHOLDS["rel_rms"], f"{tag}: planted bug not caught ({c.rel_rms:.3g})"


def _output(case: Case, name: str) -> Path:
    if name not in case.outputs:
        pytest.skip(f"repack {case.family} {name} failed (see the fixture's output)")
    return case.outputs[name]


@pytest.mark.parametrize("family", list(KINDS))
@pytest.mark.parametrize("name", ["marlin", "marlin-tp2", "triton", "triton-tp2"])
def test_kernel_matches_reference(cases: dict[str, Case], family: str, name: str) -> None:
    need_kernels(name.split("-")[0])
    case = cases[family]
    out_dir = _output(case, name)
    manifest = load_manifest(out_dir)
    for layer in (0, 1):
        x, r, ref, _, _ = _reference(case.q4, layer)
        got = run_kernel_layer(out_dir, manifest, layer, x, r)
        assert got.dtype == torch.float32 and got.shape == x.shape and got.device == x.device
        _check(f"{family}/{name}/layer{layer}", got, ref, r, True)


def _layer0(cases: dict[str, Case], family: str, backend: str) -> tuple[Case, LayerSource]:
    """(the family's case, layer 0 of its ``backend`` output); skips where the kernels are missing."""
    need_kernels(backend)
    case = cases[family]
    return case, resolve_layer(_output(case, backend), 0)


@pytest.mark.parametrize("family", list(KINDS))
@pytest.mark.parametrize("backend", ["marlin", "triton"])
def test_forward_from_router_logits(cases: dict[str, Case], family: str, backend: str) -> None:
    """The engine's own routing from bf16 logits (triton_kernels' routing kernel / top-k in torch)."""
    case, src = _layer0(cases, family, backend)
    eng = build_engine_layer(src, read_layer_tensors(src, "cuda"))
    x, _, _, canon, logits = _reference(case.q4, 0)
    logits = logits.to(torch.bfloat16)
    info = eng.info
    lf = logits.float()
    if info.routing == "topk_softmax":
        vals, ids = torch.topk(lf, info.top_k, dim=-1)
        r = Routing(ids, torch.softmax(vals, dim=-1))
    else:
        w, ids = torch.topk(torch.softmax(lf, dim=-1), info.top_k, dim=-1)
        r = Routing(ids, w / w.sum(dim=-1, keepdim=True) if info.norm_topk_prob else w)
    from mxconv.mx.numerics import dequantize_mx

    fn = lambda e: (dequantize_mx(canon.w13[e], canon.w13_scale[e], "mxfp4"), dequantize_mx(canon.w2[e], canon.w2_scale[e], "mxfp4"),
                    None if canon.w13_bias is None else canon.w13_bias[e].float(), None if canon.w2_bias is None else canon.w2_bias[e].float())  # fmt: skip
    ref = moe_forward(x, r, fn, info.num_experts, info, canon.row_order)
    got = eng.forward(x.cuda().to(torch.bfloat16), logits=logits.cuda())
    _check(f"{family}/{backend}/logits", got, ref, r, True)


# ---------------------------------------------------------------------------------------------
# planted bugs: stored tensors changed after the read, before the engine wraps them
# ---------------------------------------------------------------------------------------------


def _swap_gate_up(c: CanonicalExperts) -> CanonicalExperts:
    if c.row_order == "interleaved":
        perm = torch.arange(c.w13.shape[1]).view(-1, 2).flip(1).reshape(-1)
    else:
        I = c.w13.shape[1] // 2
        perm = torch.cat([torch.arange(I, 2 * I), torch.arange(I)])
    rows = lambda t: None if t is None else t[:, perm].contiguous()
    return CanonicalExperts(rows(c.w13), rows(c.w13_scale), c.w2, c.w2_scale, rows(c.w13_bias), c.w2_bias, c.row_order,
                            c.weight_format)  # fmt: skip


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A view with an integer dtype of the same width (float8 index ops are not everywhere)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _flip_up(b: int) -> int:
    """``b`` with one bit flipped from 0 to 1: the lowest clear one among 0x04..0x20, so the scale
    grows by 2^4 .. 2^32 (a finite error; a flip that shrinks one block can hide in the noise)."""
    for bit in (0x04, 0x08, 0x10, 0x20):
        if not b & bit:
            return b | bit
    return b ^ 0x40


def _bugs(src, canon: CanonicalExperts, hot: tuple[int, int]) -> dict[str, Callable[[dict[str, torch.Tensor]], None]]:
    from mxconv.layouts import get_layout

    layout = get_layout(src.backend)
    opts = layout.resolve_options(src.manifest.layout.option_values)
    e0, e1 = hot

    def swap_experts(t: dict[str, torch.Tensor]) -> None:
        for k in ("w13_weight", "w13_weight_scale", "w13_bias"):
            if k in t:
                u = _raw(t[k])
                u[[e0, e1]] = u[[e1, e0]].clone()

    def swap_gate_up(t: dict[str, torch.Tensor]) -> None:
        bad = layout.to_kernel(_swap_gate_up(canon), src.manifest.activation, opts)
        for k in ("w13_weight", "w13_weight_scale", "w13_bias"):
            if k in bad:
                t[k] = bad[k].to(t[k].device).contiguous()

    def permute_scales(t: dict[str, torch.Tensor]) -> None:
        s = t["w2_weight_scale"]
        t["w2_weight_scale"] = torch.roll(_raw(s), 1, dims=-1).contiguous().view(s.dtype)

    def flip_scale_byte(t: dict[str, torch.Tensor]) -> None:
        s = _raw(t["w2_weight_scale"])
        s[e0, 0, 0] = _flip_up(int(s[e0, 0, 0]))

    return {"swapped_experts": swap_experts, "swapped_gate_up": swap_gate_up,
            "permuted_w2_scale_bytes": permute_scales, "flipped_w2_scale_byte": flip_scale_byte}  # fmt: skip


@pytest.mark.parametrize("family", list(KINDS))
@pytest.mark.parametrize("backend", ["marlin", "triton"])
def test_planted_bugs_exceed_the_bound(cases: dict[str, Case], family: str, backend: str) -> None:
    case, src = _layer0(cases, family, backend)
    run_planted_bugs(case, src, f"{family}/{backend}")


def run_planted_bugs(case: Case, src: LayerSource, tag: str) -> None:
    """Layer 0 of ``src`` clean within the bound, each planted bug of :func:`_bugs` outside it."""
    x, r, ref, canon, _ = _reference(case.q4, 0)
    counts = torch.bincount(r.ids.flatten(), minlength=canon.num_experts)
    hot = tuple(int(e) for e in counts.argsort(descending=True)[:2])
    clean = build_engine_layer(src, read_layer_tensors(src, "cuda"))
    _check(f"{tag}/clean", clean.forward(x.cuda(), r.ids, r.weights), ref, r, True)
    for bug, plant in _bugs(src, canon, hot).items():
        tensors = read_layer_tensors(src, "cuda")
        plant(tensors)
        eng = build_engine_layer(src, tensors)
        _check(f"{tag}/{bug}", eng.forward(x.cuda(), r.ids, r.weights), ref, r, False, experts=list(hot))


# ---------------------------------------------------------------------------------------------
# MXFP8 experts through vLLM's Marlin MoE GEMM (Fp8MoeBackend.MARLIN; layouts/marlin_mxfp8.py)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mxfp8_marlin(tmp_path_factory) -> Case:
    """A Qwen-style layer (H 256, I 192) quantized to MXFP8 and repacked for marlin at TP 1 (I as is)
    and TP 2 (96 per rank: vLLM's per-half padding to 128 inside the tensors)."""
    root = tmp_path_factory.mktemp("marlin-mxfp8")
    make_checkpoint(root / "src", "qwen3-moe", ModelSizes(hidden_size=256, intermediate_size=192, num_experts=8, top_k=2))
    code, text = mx("quantize", root / "src", root / "q8", "--format", "mxfp8", "--quiet", "--device", "cpu")
    assert code == 0, text
    outputs = {}
    for name, tp in (("marlin", "1"), ("marlin-tp2", "2")):
        code, text = mx("repack", root / "q8", root / name, "--backend", "marlin", "--tp", tp, "--quiet", "--device", "cpu")
        assert code == 0, text
        outputs[name] = root / name
    return Case("qwen", root / "q8", outputs)


@pytest.mark.parametrize("name", ["marlin", "marlin-tp2"])
def test_mxfp8_marlin_kernel_matches_reference(mxfp8_marlin: Case, name: str) -> None:
    """vLLM's moe_wna16_marlin_gemm (float8_e4m3fn weights, E8M0 group-32 scales, bf16 activations) on
    the files, layers 0 and 1, within the kernel bound of the fp32 reference on the MXFP8 weights;
    ``verify --kernel --reference`` passes."""
    need_kernels("marlin")
    out_dir = mxfp8_marlin.outputs[name]
    manifest = load_manifest(out_dir)
    assert manifest.weight_format == "mxfp8" and manifest.layout.json_value("variant") == "mxfp8"
    for layer in (0, 1):
        x, r, ref, _, _ = _reference(mxfp8_marlin.q4, layer)
        _check(f"qwen/mxfp8-{name}/layer{layer}", run_kernel_layer(out_dir, manifest, layer, x, r), ref, r, True)
    code, text = mx("verify", out_dir, "--kernel", "--reference", mxfp8_marlin.q4)
    assert code == 0, text


def test_mxfp8_marlin_planted_bugs_exceed_the_bound(mxfp8_marlin: Case) -> None:
    """Swapped experts, swapped gate/up, permuted and flipped w2 scale bytes each leave the bound."""
    need_kernels("marlin")
    run_planted_bugs(mxfp8_marlin, resolve_layer(mxfp8_marlin.outputs["marlin"], 0), "qwen/marlin-mxfp8")
