"""``--backend humming`` against humming-kernels 0.1.19 itself, on an SM90 GPU (``-m gpu``).

1. Bytes: the canonical stack laid out the way vLLM 0.33 holds it before the conversion (Ip =
   roundup(I, 64), halves padded per half, zeros) goes through humming's own ``Mxfp4WeightSchema``
   / ``GptOssMxfp4WeightSchema.convert_humming`` and ``prepare_and_transform_humming_tensors``
   (pad N to 256, K to 128, bf16, default input schema); mxconv's CPU and CUDA bytes must equal it,
   and its LayerConfig must equal the one the manifest records.
2. Kernel: outputs repacked from the quantized test checkpoints (TP 1 and 2) run through humming's
   GEMMs (``mxconv.engines.humming_moe``) within the kernel bound of the reference; ``verify
   --kernel --reference`` passes; planted layout bugs fail the bound.
3. The same for MXFP8 experts (vLLM's Fp8MoeBackend.HUMMING: nothing padded by vLLM, humming's
   ``ModeloptMxfp8WeightSchema``, which ``_humming_fp8_weight_schema`` picks for E8M0 scales) and
   compressed-tensors INT4.
"""

from __future__ import annotations

import pytest
import torch
from support.checkpoints import make_checkpoint
from support.gpu_outputs import KINDS, Case, repacked_cases
from test_engines_gpu import _check, _reference, mx, run_planted_bugs

from mxconv.engines.loader import resolve_layer, run_kernel_layer
from mxconv.experts.stack import CanonicalExperts
from mxconv.layouts import get_layout
from mxconv.layouts.humming import layer_configs
from mxconv.source.manifest import load_manifest

pytestmark = pytest.mark.gpu


def _humming():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("humming's layout here is SM90's; needs an H100/H200")
    try:
        import humming.transform
    except ImportError as exc:
        pytest.skip(f"humming-kernels not importable: {exc}")
    import humming

    return humming


def _canonical(E: int, H: int, I: int, order: str, bias: bool, seed: int) -> CanonicalExperts:
    g = torch.Generator().manual_seed(seed)
    u8 = lambda *s, lo=0, hi=256: torch.randint(lo, hi, s, dtype=torch.uint8, generator=g)
    return CanonicalExperts(
        u8(E, 2 * I, H // 2), u8(E, 2 * I, H // 32, lo=112, hi=136), u8(E, H, I // 2), u8(E, H, I // 32, lo=112, hi=136),
        torch.randn(E, 2 * I, generator=g).to(torch.bfloat16) if bias else None,
        torch.randn(E, H, generator=g).to(torch.bfloat16) if bias else None, order,
    )  # fmt: skip


def _vllm_layer(c: CanonicalExperts, Ip: int) -> dict[str, dict[str, torch.Tensor]]:
    """What vLLM's Mxfp4 quant method holds before the conversion: zero-initialised [E, 2Ip, ...]
    parameters the checkpoint was copied into (halves: each half at its own offset)."""
    E, H, I = c.num_experts, c.hidden_size, c.intermediate_size

    def rows13(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((E, 2 * Ip, *t.shape[2:]), dtype=t.dtype)
        if c.row_order == "halves":
            out[:, :I], out[:, Ip : Ip + I] = t[:, :I], t[:, I:]
        else:
            out[:, : 2 * I] = t
        return out

    def cols2(t: torch.Tensor, per: int) -> torch.Tensor:
        out = torch.zeros((E, H, Ip // per), dtype=t.dtype)
        out[..., : I // per] = t
        return out

    w13 = {"weight": rows13(c.w13), "weight_scale": rows13(c.w13_scale)}
    w2 = {"weight": cols2(c.w2, 2), "weight_scale": cols2(c.w2_scale, 32)}
    if c.w13_bias is not None:
        w13["bias"], w2["bias"] = rows13(c.w13_bias), c.w2_bias.clone()
    return {"w13": w13, "w2": w2}


def _humming_transform(tensors: dict[str, torch.Tensor], w: str, n: int, k: int, E: int, quant_method, bias: bool):
    from humming.schema import BaseWeightSchema, HummingInputSchema
    from humming.transform import prepare_and_transform_humming_tensors

    schema = BaseWeightSchema.from_config(quant_method if isinstance(quant_method, dict) else {"quant_method": quant_method})
    gated = [n // 2, n // 2] if w == "w13" else [n]
    wschema, conv = schema.convert_humming(tensors={k_: v.cuda() for k_, v in tensors.items()}, shape_n_stacks=gated,
                                           shape_k_stacks=[k], param_dtype=torch.bfloat16, num_experts=E)  # fmt: skip
    return prepare_and_transform_humming_tensors(
        tensors=conv, shape_n=n, shape_k=k, pad_n_to_multiple=256, pad_k_to_multiple=128,
        input_schema=HummingInputSchema().to_humming_schema(torch.bfloat16), weight_schema=wschema, has_bias=bias,
        num_experts=E, torch_dtype=torch.bfloat16, device=torch.device("cuda"),
    )  # fmt: skip


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().view(torch.uint8)


def _same_bytes(w: str, theirs: dict[str, torch.Tensor], cpu: dict[str, torch.Tensor], gpu: dict[str, torch.Tensor]) -> None:
    """humming's tensors of GEMM ``w`` equal mxconv's CPU and CUDA ones: shape, dtype and bytes."""
    for name, t in theirs.items():
        ours = cpu[f"{w}_{name}"]
        assert tuple(t.shape) == tuple(ours.shape) and t.dtype == ours.dtype, (w, name, t.shape, t.dtype, ours.shape)
        assert torch.equal(_bytes(t), _bytes(ours)), f"{w}_{name}: bytes differ from humming's transform"
        assert torch.equal(_bytes(gpu[f"{w}_{name}"]), _bytes(ours)), f"{w}_{name}: CUDA path differs"


@pytest.mark.parametrize("order,bias,H,I", [("halves", False, 192, 96), ("interleaved", True, 160, 224),
                                            ("halves", True, 1440, 352)])  # fmt: skip
def test_bytes_equal_hummings_own_transform(order: str, bias: bool, H: int, I: int) -> None:
    _humming()
    from humming.config import LayerConfig

    layout = get_layout("humming")
    c = _canonical(4, H, I, order, bias, seed=H + I)
    opts = layout.resolve_options()
    Hp, Ip = layout.padded_sizes(H, I, order, "bf16")
    sizes = c.sizes(Hp, Ip)
    cpu = layout.to_kernel(c, "bf16", opts)
    gpu = layout.to_kernel(c.to("cuda"), "bf16", opts)
    configs = layout.describe(sizes, "bf16", opts)["layer_configs"]
    method = "gpt_oss_mxfp4" if order == "interleaved" else "mxfp4"
    for w, tensors in _vllm_layer(c, Ip).items():
        n, k = (2 * Ip, H) if w == "w13" else (H, Ip)
        config, theirs = _humming_transform(tensors, w, n, k, c.num_experts, method, bias)
        assert config == LayerConfig(**configs[w]), (config, configs[w])
        assert sorted(theirs) == sorted(x.removeprefix(f"{w}_") for x in cpu if x.startswith(f"{w}_"))
        _same_bytes(w, theirs, cpu, gpu)


@pytest.fixture(scope="module")
def humming_cases(tmp_path_factory) -> dict[str, Case]:
    repacks = {"humming": ["--backend", "humming", "--tp", "1"], "humming-tp2": ["--backend", "humming", "--tp", "2"]}
    return repacked_cases(tmp_path_factory.mktemp("humming-gpu"), repacks, required=True)


@pytest.fixture(scope="module")
def humming_mxfp8_cases(tmp_path_factory) -> dict[str, Case]:
    """The same repacks of the test checkpoints quantized to MXFP8 (vLLM's Fp8MoeBackend.HUMMING form)."""
    repacks = {"humming": ["--backend", "humming"], "humming-tp2": ["--backend", "humming", "--tp", "2"]}
    return repacked_cases(tmp_path_factory.mktemp("humming-mxfp8-gpu"), repacks, required=True, fmt="mxfp8")


def _cases(request: pytest.FixtureRequest, fmt: str) -> dict[str, Case]:
    return request.getfixturevalue("humming_cases" if fmt == "mxfp4" else "humming_mxfp8_cases")


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("family", list(KINDS))
@pytest.mark.parametrize("name", ["humming", "humming-tp2"])
def test_kernel_matches_reference(request: pytest.FixtureRequest, fmt: str, family: str, name: str) -> None:
    _humming()
    case = _cases(request, fmt)[family]
    out_dir = case.outputs[name]
    manifest = load_manifest(out_dir)
    assert manifest.weight_format == fmt
    for layer in (0, 1):
        x, r, ref, _, _ = _reference(case.q4, layer)
        got = run_kernel_layer(out_dir, manifest, layer, x, r)
        _check(f"{family}/{fmt}-{name}/layer{layer}", got, ref, r, True)
    code, text = mx("verify", out_dir, "--kernel", "--reference", case.q4)
    assert code == 0, text


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("family", list(KINDS))
def test_planted_bugs_exceed_the_bound(request: pytest.FixtureRequest, fmt: str, family: str) -> None:
    _humming()
    case = _cases(request, fmt)[family]
    run_planted_bugs(case, resolve_layer(case.outputs["humming"], 0), f"{family}/humming-{fmt}")


# --- compressed-tensors INT4 (vLLM WNA16 -> HUMMING): layouts/humming_int4.py -------------------

CT_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "type": "int", "num_bits": 4,
           "strategy": "group", "group_size": 32, "symmetric": True}  # _humming_wna16_weight_schema's dict


@pytest.mark.parametrize("codes,low,H,I", [("uint4", -8, 192, 96), ("e0m3", -7, 160, 224), ("uint4", -8, 1440, 352),
                                           ("auto", -7, 160, 224), ("auto", -8, 192, 96)])
def test_int4_bytes_equal_hummings_own_transform(codes: str, low: int, H: int, I: int) -> None:
    """The CT WNA16 layer as vLLM holds it (weight_packed int32 [E, N, K/8], bf16 scales, no padding)
    through humming's compressed-tensors schema (convert_symmetric_integer_weight included)."""
    _humming()
    from humming.config import LayerConfig

    from mxconv.mx.int4 import pack_int4

    g = torch.Generator().manual_seed(H + I)
    q = lambda *s: torch.randint(low, 8, s, generator=g)
    sc = lambda *s: (torch.rand(s, generator=g) + 0.25).to(torch.bfloat16)
    E = 4
    c = CanonicalExperts(pack_int4(q(E, 2 * I, H)), sc(E, 2 * I, H // 32), pack_int4(q(E, H, I)), sc(E, H, I // 32),
                         row_order="halves", weight_format="int4")  # fmt: skip
    layout = get_layout("humming")
    opts = layout.resolve_options({"int4_codes": codes})
    cpu = layout.to_kernel(c, "bf16", opts)
    gpu = layout.to_kernel(c.to("cuda"), "bf16", opts)
    configs = layer_configs(c.sizes(H, I), layout.stack_choices(c, opts))  # auto: each stack's own b_dtype
    for w, n, k in (("w13", 2 * I, H), ("w2", H, I)):
        vllm = {"weight_packed": getattr(c, w).view(torch.int32), "weight_scale": getattr(c, f"{w}_scale"),
                "weight_shape": torch.tensor([[n, k]] * E, dtype=torch.int64)}  # fmt: skip
        config, theirs = _humming_transform(vllm, w, n, k, E, CT_INT4, False)
        assert config == LayerConfig(**configs[w]), (config, configs[w])
        assert sorted(theirs) == ["weight", "weight_scale"]
        _same_bytes(w, theirs, cpu, gpu)


@pytest.mark.parametrize("tp,codes", [("1", "e0m3"), ("2", "e0m3"), ("1", "auto"), ("2", "auto")])
def test_int4_kernel_verify_passes_and_a_planted_swap_fails(tmp_path, tp: str, codes: str) -> None:
    _humming()
    import json

    from support.tamper import patch_tensor

    src = tmp_path / "kimi"
    make_checkpoint(src, "kimi-k2-int4")
    out = tmp_path / "hum"
    code, text = mx("repack", src, out, "--backend", "humming", "--tp", tp, "--layout-option", f"int4_codes={codes}",
                    "--quiet", "--device", "cpu")  # fmt: skip  (auto: the loader gives the runner each layer's recorded codes)
    assert code == 0, text
    code, text = mx("verify", out, "--kernel", "--reference", src)
    assert code == 0, text
    if tp != "1":
        return  # a TP-2 output keeps its tensors under rank folders; the planted swap runs on the TP-1 one
    # swapped experts in w13's words (manifest sha fixed): only the kernel comparison can catch it
    index = json.loads((out / "model.safetensors.index.json").read_text())
    name = next(n for n in index["weight_map"] if n.endswith("experts.w13_weight"))
    patch_tensor(out, name, lambda t: t[[1, 0, *range(2, t.shape[0])]].contiguous(), fix_manifest=True)
    code, text = mx("verify", out, "--kernel", "--reference", src)
    assert code != 0, text


# --- MXFP8 experts (vLLM Fp8MoeBackend.HUMMING): layouts/humming_mx.py ------------------------------

MXFP8_SCHEMA = {"quant_method": "modelopt", "quant_algo": "mxfp8"}  # _humming_fp8_weight_schema for E8M0 scales


@pytest.mark.parametrize("order,bias,H,I", [("halves", False, 192, 96), ("interleaved", True, 160, 224),
                                            ("halves", True, 1440, 352)])  # fmt: skip
def test_mxfp8_bytes_equal_hummings_own_transform(order: str, bias: bool, H: int, I: int) -> None:
    """The MXFP8 layer as vLLM's MXFP8 methods hold it (float8_e4m3fn [E, N, K], uint8 E8M0 scales, nothing
    padded) through humming's ModeloptMxfp8WeightSchema and prepare_and_transform_humming_tensors."""
    _humming()
    from humming.config import LayerConfig

    g = torch.Generator().manual_seed(H + I)
    u8 = lambda *s, lo=0, hi=256: torch.randint(lo, hi, s, dtype=torch.uint8, generator=g)  # noqa: E731
    E = 4
    c = CanonicalExperts(u8(E, 2 * I, H, hi=0x7F), u8(E, 2 * I, H // 32, lo=112, hi=136), u8(E, H, I, hi=0x7F),
                         u8(E, H, I // 32, lo=112, hi=136),
                         torch.randn(E, 2 * I, generator=g).to(torch.bfloat16) if bias else None,
                         torch.randn(E, H, generator=g).to(torch.bfloat16) if bias else None, order, "mxfp8")  # fmt: skip
    layout = get_layout("humming")
    opts = layout.resolve_options()
    cpu = layout.to_kernel(c, "bf16", opts)
    gpu = layout.to_kernel(c.to("cuda"), "bf16", opts)
    configs = layout.describe(c.sizes(H, I), "bf16", opts)["layer_configs"]
    for w, n, k in (("w13", 2 * I, H), ("w2", H, I)):
        vllm = {"weight": getattr(c, w).view(torch.float8_e4m3fn), "weight_scale": getattr(c, f"{w}_scale")}
        if bias:
            vllm["bias"] = getattr(c, f"{w}_bias")
        config, theirs = _humming_transform(vllm, w, n, k, E, MXFP8_SCHEMA, bias)
        assert config == LayerConfig(**configs[w]), (config, configs[w])
        assert sorted(theirs) == sorted(x.removeprefix(f"{w}_") for x in cpu if x.startswith(f"{w}_"))
        _same_bytes(w, theirs, cpu, gpu)
