"""The engines' own Hopper kernels on the bytes mxconv writes (mxconv.engines, mxconv.engines.loader).

(a) CPU: discovery errors (exit-2 BadInput naming what is missing and how to provide it), GPU
    check messages, manifest/rank resolution and reads of real repack outputs, the Marlin type id
    and block sizes, and the triton_kernels objects wrapped from stored buffers == the objects
    triton_kernels' own ``convert_layout`` builds (what vLLM's ``_swizzle_mxfp4`` does).
(b) GPU (``-m gpu``): tiny gpt-oss-style and Qwen-style layers, quantized and repacked for marlin
    and triton, loaded and run through vLLM's Marlin MoE GEMM / triton_kernels' matmul_ogs, against
    ``mxconv.verify.reference_moe.moe_forward`` on the canonical MXFP4 weights; planted layout bugs (swapped
    experts, swapped gate/up, permuted scale bytes, one flipped scale byte) must exceed the bound.
    Kernels come from ``MXCONV_TRITON_KERNELS`` / ``MXCONV_MARLIN_OPS``; absent -> skipped.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxconv import environment
from mxconv.engines import discover, marlin_moe, triton_moe
from mxconv.engines.runner import gated_activation, kernel_unavailable, softmax_topk
from mxconv.source.manifest import Manifest
from mxconv.errors import BadInput
from mxconv.engines.loader import build_engine_layer, read_layer_tensors, resolve_layer
from mxconv.examples import ModelSizes
from support.workspace import MadeCheckpoints, link_workspace

REPO = Path(__file__).resolve().parents[1]
KERN = REPO / ".kern"
HAS_CUDA = torch.cuda.is_available()


def _in_fresh_python(code: str, env: dict[str, str | None]) -> dict:
    """Run ``code`` (which prints one JSON line) in a clean interpreter with ``env`` changes;
    skip when that interpreter finds an installed triton_kernels / vLLM (the messages of a machine
    without them are what these tests check)."""
    full = dict(os.environ)
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    guard = (
        "import importlib.util, json, sys\n"
        "if importlib.util.find_spec('triton_kernels') or importlib.util.find_spec('vllm'):\n"
        "    print(json.dumps({'skip': 'an installed triton_kernels / vLLM is found'})); sys.exit(0)\n"
    )
    r = subprocess.run([sys.executable, "-c", guard + code], capture_output=True, text=True, env=full, cwd=str(REPO), timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(got["skip"])
    return got


_CATCH = """
import json
from mxconv.errors import BadInput
from mxconv.engines import discover
try:
    {call}
    print(json.dumps({{"ok": True}}))
except BadInput as e:
    print(json.dumps({{"ok": False, "exit": e.exit_code, "msg": str(e)}}))
"""


# ---------------------------------------------------------------------------------------------
# (a) CPU: discovery
# ---------------------------------------------------------------------------------------------


def test_triton_kernels_explicit_path_missing(tmp_path: Path) -> None:
    with pytest.raises(BadInput) as err:
        discover.find_triton_kernels(tmp_path / "nowhere")
    assert err.value.exit_code == 2
    msg = str(err.value)
    assert "no triton_kernels/ package" in msg and str(tmp_path / "nowhere") in msg
    assert environment.TRITON_KERNELS_ENV in msg and "vLLM" in msg


@pytest.mark.parametrize("env_value", [None, "/nonexistent/kern"])
def test_triton_kernels_env(env_value: str | None) -> None:
    got = _in_fresh_python(_CATCH.format(call="discover.find_triton_kernels()"), {environment.TRITON_KERNELS_ENV: env_value})
    assert not got["ok"] and got["exit"] == 2
    assert environment.TRITON_KERNELS_ENV in got["msg"]
    if env_value is None:
        assert "not found" in got["msg"] and "unset" in got["msg"]
    else:
        assert env_value in got["msg"] and "no triton_kernels/ package" in got["msg"]


@pytest.mark.skipif(not (KERN / "triton_kernels").is_dir(), reason=".kern/triton_kernels (vLLM 0.33's vendored copy) not extracted")
def test_triton_kernels_vendored_copy_imports_on_cpu() -> None:
    got = _in_fresh_python(
        "import json; from mxconv.engines import discover\n"
        "tk = discover.find_triton_kernels()\n"
        "print(json.dumps({'origin': tk.origin, 'generation': tk.generation, 'location': tk.location}))",
        {environment.TRITON_KERNELS_ENV: str(KERN)},
    )
    assert got["origin"] == "env" and got["generation"] == "3.5" and got["location"].endswith("triton_kernels")


@pytest.mark.parametrize("env_value", [None, "/nonexistent/_moe_C.so"])
def test_marlin_ops_env(env_value: str | None) -> None:
    got = _in_fresh_python(_CATCH.format(call="discover.find_marlin_ops()"), {environment.MARLIN_OPS_ENV: env_value})
    assert not got["ok"] and got["exit"] == 2
    assert environment.MARLIN_OPS_ENV in got["msg"] and "install vLLM" in got["msg"]
    if env_value:
        assert env_value in got["msg"] and "no such file" in got["msg"]
    else:
        assert "moe_wna16_marlin_gemm" in got["msg"] and "unset" in got["msg"]


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
@pytest.mark.skipif(not (KERN / "_moe_C_stable_libtorch.abi3.so").is_file(), reason=".kern/_moe_C_stable_libtorch.abi3.so not extracted")
def test_marlin_ops_library_that_cannot_load() -> None:
    lib = KERN / "_moe_C_stable_libtorch.abi3.so"
    got = _in_fresh_python(_CATCH.format(call="discover.find_marlin_ops()"), {environment.MARLIN_OPS_ENV: str(lib)})
    assert not got["ok"] and got["exit"] == 2
    assert "cannot load" in got["msg"] and str(lib) in got["msg"] and "CUDA" in got["msg"]


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
def test_gpu_check_without_cuda() -> None:
    with pytest.raises(BadInput) as err:
        discover.check_gpu("cuda", exact=discover.HOPPER, what="X")
    assert err.value.exit_code == 2
    assert "capability 9.0" in str(err.value) and "found none" in str(err.value)


def test_gpu_check_names_the_device_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "FakeA100")
    with pytest.raises(BadInput) as err:
        discover.check_gpu("cuda", exact=discover.HOPPER, what="triton")
    assert "SM90" in str(err.value) and "FakeA100" in str(err.value) and "8.0" in str(err.value)
    info = discover.check_gpu("cuda:0", exact=None, minimum=discover.MARLIN_MIN_CAPABILITY)
    assert info.capability == (8, 0) and info.name == "FakeA100"
    with pytest.raises(BadInput, match="runs on a CUDA device"):
        discover.check_gpu("cpu", exact=None)


def test_marlin_type_id_and_block_sizes() -> None:
    # float4_e2m1f: exponent 2 (bits 0-7), mantissa 1 (8-15), signed (16), bias 0 (17-48),
    # finite values only (49), NaN representation NONE = 0 (50-57)
    assert marlin_moe.FLOAT4_E2M1F_ID == 2 | (1 << 8) | (1 << 16) | (1 << 49)
    assert marlin_moe.moe_block_size(1, 4, 128) == 8
    assert marlin_moe.moe_block_size(64, 2, 8) == 32
    assert marlin_moe.moe_block_size(100000, 4, 32) == 64
    assert marlin_moe.align_buffer_sizes(128, 8, 16) == (128 + 8 * 15, -(-(128 + 8 * 15) // 16))
    assert marlin_moe.align_buffer_sizes(2, 8, 16) == (32, 2)


# ---------------------------------------------------------------------------------------------
# (a) CPU: the torch routing and activation the Marlin and humming runners share (engines.runner)
# ---------------------------------------------------------------------------------------------


def _loop_route(logits: torch.Tensor, k: int, renormalize: bool, routing: str) -> list[tuple[list[int], list[float]]]:
    """Token by token in float64 Python: the expected ids (best first) and weights."""
    out = []
    for row in logits.double().tolist():
        if routing == "topk_softmax":
            ids = sorted(range(len(row)), key=lambda e: -row[e])[:k]
            ex = [math.exp(row[e] - row[ids[0]]) for e in ids]
            out.append((ids, [v / sum(ex) for v in ex]))
            continue
        ex = [math.exp(v - max(row)) for v in row]
        p = [v / sum(ex) for v in ex]
        ids = sorted(range(len(row)), key=lambda e: -p[e])[:k]
        ws = [p[e] for e in ids]
        out.append((ids, [w / sum(ws) for w in ws] if renormalize else ws))
    return out


@pytest.mark.parametrize("routing,renormalize", [("topk_softmax", False), ("softmax_topk", True), ("softmax_topk", False)])
def test_softmax_topk_matches_a_per_token_loop(routing: str, renormalize: bool) -> None:
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ids, weights = softmax_topk(logits, 3, renormalize, routing)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and tuple(ids.shape) == (9, 3)
    for t, (want_ids, want_w) in enumerate(_loop_route(logits, 3, renormalize, routing)):
        assert ids[t].tolist() == want_ids
        assert weights[t].tolist() == pytest.approx(want_w, rel=1e-6)


@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_gated_activation_matches_the_formulas(row_order: str, activation: str) -> None:
    h = (torch.randn(5, 2 * 6, generator=torch.Generator().manual_seed(2)) * 6).to(torch.bfloat16)
    got = gated_activation(h, row_order, activation, 6, "x", swiglu_alpha=1.5, swiglu_limit=4.0)
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == (5, 6)
    for t in range(5):
        row = h[t].double().tolist()
        for j in range(6):
            g, u = (row[2 * j], row[2 * j + 1]) if row_order == "interleaved" else (row[j], row[6 + j])
            if activation == "swigluoai":
                g, u = min(g, 4.0), max(min(u, 4.0), -4.0)
                want = g / (1 + math.exp(-1.5 * g)) * (u + 1)
            else:
                want = g / (1 + math.exp(-g)) * u
            assert float(got[t, j]) == pytest.approx(want, rel=2**-7, abs=1e-6), (t, j)


def test_marlin_and_humming_experts_activate_through_the_shared_helper() -> None:
    from mxconv.engines.humming_moe import HummingExperts

    h = torch.randn(4, 2 * 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for row_order, activation in (("interleaved", "swigluoai"), ("halves", "silu")):
        want = gated_activation(h, row_order, activation, 128, "x")
        marlin = marlin_moe.MarlinExperts(*[None] * 7, 2, 64, 256, 128, row_order, activation)
        humming = HummingExperts({}, {}, {}, None, 2, 64, 128, row_order, activation)
        assert torch.equal(marlin.activate(h), want) and torch.equal(humming.activate(h), want)
    for experts, engine in ((marlin_moe.MarlinExperts(*[None] * 7, 2, 64, 256, 128, "halves", "gelu"), "marlin"),
                            (HummingExperts({}, {}, {}, None, 2, 64, 128, "halves", "gelu"), "humming")):  # fmt: skip
        with pytest.raises(BadInput, match=f"{engine} engine: no activation 'gelu'"):
            experts.activate(h)


# ---------------------------------------------------------------------------------------------
# (a) CPU: manifest / rank resolution on real repack outputs
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_outputs(made: MadeCheckpoints, tmp_path_factory) -> Path:
    q4 = made.quantize(made.source("gpt-oss-bf16", ModelSizes(hidden_size=128, intermediate_size=96)).path)
    return link_workspace(tmp_path_factory.mktemp("engines-cpu"), {
        "q4": q4, "marlin": made.repack(q4, "marlin"), "marlin-tp2": made.repack(q4, "marlin", "--tp", "2")})


def test_resolve_layer_root_and_rank_dirs(cpu_outputs: Path) -> None:
    src = resolve_layer(cpu_outputs / "marlin", 1)
    assert src.rank == 0 and src.tp_size == 1 and src.intermediate_size == 96
    assert set(src.files) == {"w13_weight", "w13_weight_scale", "w13_bias", "w2_weight", "w2_weight_scale", "w2_bias"}
    assert all(n.startswith("model.layers.1.mlp.experts.") for n in src.names.values())
    tensors = read_layer_tensors(src, "cpu")
    assert tensors["w13_weight"].dtype == torch.int32 and tuple(tensors["w13_weight"].shape) == (4, 256 // 16, 4 * 128)
    assert tensors["w13_weight_scale"].dtype == torch.float8_e8m0fnu and tensors["w2_bias"].dtype == torch.bfloat16

    r1 = resolve_layer(cpu_outputs / "marlin-tp2" / "rank-1", 0)
    assert r1.rank == 1 and r1.root == (cpu_outputs / "marlin-tp2").resolve() and r1.intermediate_size == 32
    assert all(f.parent.name == "rank-1" for f in r1.files.values())
    assert resolve_layer(cpu_outputs / "marlin-tp2", 0, rank=0).intermediate_size == 64
    t1 = read_layer_tensors(r1, "cpu")
    assert not bool(t1["w2_bias"].float().any())  # the w2 bias lives on rank 0 only


@pytest.mark.parametrize(
    "where, layer, kwargs, needle",
    [
        ("marlin-tp2", 0, {}, "pass rank=0..1"),
        ("marlin-tp2", 0, {"rank": 2}, "rank 2 does not exist"),
        ("marlin-tp2/rank-1", 0, {"rank": 0}, "is the directory of rank 1"),
        ("q4", 0, {}, "canonical checkpoint"),
        ("marlin", 7, {}, "no MoE layer 7"),
        ("src", 0, {}, "no mxconv.json"),
    ],
)
def test_resolve_layer_errors(cpu_outputs: Path, where: str, layer: int, kwargs: dict, needle: str) -> None:
    with pytest.raises(BadInput) as err:
        resolve_layer(cpu_outputs / where, layer, **kwargs)
    assert needle in str(err.value) and err.value.exit_code == 2


def test_kernel_unavailable_says_why(cpu_outputs: Path) -> None:
    m = json.loads((cpu_outputs / "marlin" / "mxconv.json").read_text())
    assert "no engine kernel runner" in kernel_unavailable(Manifest.parse({**m, "backend": "trtllm"}, "mxconv.json"))
    if not HAS_CUDA:
        assert "CUDA" in kernel_unavailable(Manifest.parse(m, "mxconv.json"))


# ---------------------------------------------------------------------------------------------
# (a) CPU: wrapped buffers == triton_kernels' own convert_layout (vLLM's _swizzle_mxfp4)
# ---------------------------------------------------------------------------------------------


def _triton_layout():
    from mxconv.layouts import get_layout

    try:
        return get_layout("triton")
    except (BadInput, ImportError, AttributeError) as exc:
        pytest.skip(f"mxconv.layouts.triton not available: {exc}")


def _vendored_triton_kernels() -> discover.TritonKernels:
    try:
        return discover.find_triton_kernels(os.environ.get(environment.TRITON_KERNELS_ENV) or (KERN if (KERN / "triton_kernels").is_dir() else None))
    except BadInput as exc:
        pytest.skip(f"triton_kernels not available: {exc}")


@pytest.mark.parametrize("row_order", ["interleaved", "halves"])
def test_wrapped_buffers_equal_convert_layout(row_order: str) -> None:
    from mxconv.experts.stack import CanonicalExperts, round_up
    from mxconv.experts.padding import pad_canonical

    layout, tk = _triton_layout(), _vendored_triton_kernels()
    tensor_mod = triton_moe._tk(tk, "tensor")
    lay_mod = triton_moe._tk(tk, "tensor_details.layout")
    g = torch.Generator().manual_seed(1)
    E, H, I = 3, 128, 96
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.int32).to(torch.uint8)  # noqa: E731
    c = CanonicalExperts(u8(E, 2 * I, H // 2), u8(E, 2 * I, H // 32), u8(E, H, I // 2), u8(E, H, I // 32), None, None, row_order)
    stored = layout.to_kernel(c, "bf16", layout.resolve_options({}))
    if row_order == "halves":  # kernel rows are gate/up pairs
        il = lambda t: torch.stack([t[:, :I], t[:, I:]], dim=2).reshape(E, 2 * I, -1)  # noqa: E731
        c = CanonicalExperts(il(c.w13), il(c.w13_scale), c.w2, c.w2_scale, None, None, "interleaved")
    Ip = round_up(I, 64)
    p = pad_canonical(c, H, Ip)
    for name, w, s, geo in (
        ("w13", p.w13, p.w13_scale, triton_moe.MatrixGeometry(E, 2 * Ip, H, "3.5", 8, 4)),
        ("w2", p.w2, p.w2_scale, triton_moe.MatrixGeometry(E, H, Ip, "3.5", 8, 4)),
    ):
        s4 = torch.nn.functional.pad(s, (0, round_up(s.shape[-1], 4) - s.shape[-1]))  # vLLM 0.33's K/32 pad
        want_w = tensor_mod.convert_layout(tensor_mod.wrap_torch_tensor(w.transpose(-2, -1), tensor_mod.FP4), lay_mod.HopperMXValueLayout, mx_axis=1)
        want_s = tensor_mod.convert_layout(tensor_mod.wrap_torch_tensor(s4.transpose(-2, -1)), lay_mod.HopperMXScaleLayout, mx_axis=1, num_warps=8)
        got_w, pc = triton_moe.wrap_matrix(tk, stored[f"{name}_weight"], stored[f"{name}_weight_scale"], geo, name)
        for want, got in ((want_w, got_w), (want_s, pc.weight_scale)):
            a, b = want.storage.data, got.storage.data
            assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b), name
            assert list(want.shape) == list(got.shape) and list(want.shape_max) == list(got.shape_max) and want.dtype == got.dtype
            la, lb = want.storage.layout, got.storage.layout
            assert type(la) is type(lb)
            norm = lambda d: {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in vars(d).items()}  # noqa: E731
            assert norm(la) == norm(lb)
            assert b.data_ptr() == stored[f"{name}_weight" if got is got_w else f"{name}_weight_scale"].data_ptr()  # a view


def test_wrap_refuses_wrong_buffer_shape() -> None:
    tk = _vendored_triton_kernels()
    geo = triton_moe.MatrixGeometry(2, 128, 128, "3.5", 8, 4)
    w = torch.zeros(geo.value_buffer_shape, dtype=torch.uint8)
    s = torch.zeros(geo.scale_buffer_shape, dtype=torch.uint8)
    with pytest.raises(BadInput, match="w13_weight_scale"):
        triton_moe.wrap_matrix(tk, w, s[:, :-1], geo, "w13")
    with pytest.raises(BadInput, match="contiguous"):
        triton_moe.wrap_matrix(tk, w.transpose(1, 2).contiguous().transpose(1, 2), s, geo, "w13")


def test_triton_wrap_refuses_storage_of_another_gpu(made: MadeCheckpoints) -> None:
    """An arch=sm100 triton output read onto the CPU: wrapping it for the Hopper matmul is refused
    for its storage (manifest layout.arch) before any device or kernel question."""
    out = made.repack(made.quantize(made.source("gpt-oss-bf16", ModelSizes(hidden_size=128, intermediate_size=96)).path),
                      "triton", "--layout-option", "arch=sm100")  # fmt: skip
    src = resolve_layer(out, 1)
    assert src.manifest.layout.extra["arch"] == "sm100"
    with pytest.raises(BadInput, match=r"layer 1: the output holds the sm100 storage \(manifest layout.arch = 'sm100'\);"
                                       r" .* sm90 storage only: repack with RepackOptions.layout_options arch=sm90"):  # fmt: skip
        build_engine_layer(src, read_layer_tensors(src, "cpu"))
    assert "layout.arch = 'sm100'" in kernel_unavailable(src.manifest)
