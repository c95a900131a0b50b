"""Outputs never load silently wrong (issue 10 item 6): what a user's loader does with each output.

A tiny random model of every family transformers has a config class for (gpt-oss, Qwen3-MoE, Mixtral,
DeepSeek-V3, GLM-4.5) is built with transformers' own classes, saved as bf16 safetensors and
converted by ``mxconv quantize`` (MXFP4 and MXFP8). The expected weights come from an independent
OCP MX quantize-dequantize written here in plain torch (the scale rule the manifest records, RNE
elements), applied to the source's routed-expert weights; everything else is the source's.

* transformers ``from_pretrained`` either reproduces the expected model's logits or raises: MXFP4 of
  every family loads and matches (gpt-oss through its MXFP4 dequantizer, the others through
  compressed-tensors); MXFP8 must never load with random or misread experts (gpt-oss's config has
  ``quant_method: null`` so transformers refuses it; compressed-tensors MXFP8 experts either match or
  raise, as transformers 5.24's expert path does).
* compressed-tensors' own decompressor turns every per-expert output back into exactly the expected
  weights, and a model holding them reproduces the expected logits.
* mxconv reads the gpt-oss MXFP8 output and the ``quant_method: mxfp8`` of its older outputs.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from support.cli import mx

transformers = pytest.importorskip("transformers", minversion="5.0")  # fused experts, the loaders below

FAMILIES = ("gpt-oss", "qwen3-moe", "mixtral", "deepseek-v3", "glm4-moe")
FORMATS = ("mxfp4", "mxfp8")
TOKENS = torch.tensor([[3, 17, 42, 5, 77, 8, 61, 30, 12, 90, 1, 55]])
# Per-expert families: the MoE module and the (gate, up, down) projection names on disk.
_PER_EXPERT = {
    "qwen3-moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek-v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "glm4-moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


# ---------------------------------------------------------------------------------------------
# an independent OCP MX quantize-dequantize (docs/mx-numerics.md sections 2-3)
# ---------------------------------------------------------------------------------------------


def _scale_exponent(amax: torch.Tensor, fmt: str, mode: str) -> torch.Tensor:
    """e of the shared scale 2^e of each block (amax: fp32 block maxima), clamped to [-127, 127]."""
    max_elem, emax, mbits = (6.0, 2, 1) if fmt == "mxfp4" else (448.0, 8, 3)
    if mode == "rceil":  # ceil(log2(A / max_elem)), exactly: frexp gives A/max = m 2^x, m in [0.5, 1)
        m, x = torch.frexp(amax / max_elem)
        e = torch.where(m == 0.5, x - 1, x)
    else:
        m, x = torch.frexp(amax)  # A = (2m) 2^(x-1), 2m in [1, 2)
        e = x - 1 - emax
        if mode == "even":  # the mantissa rounded to the element's width (ties away) may carry
            steps = 2.0**mbits
            e = e + (torch.floor(2 * m * steps + 0.5) / steps >= 2).to(e.dtype)
        elif mode != "floor":
            raise ValueError(mode)
    return torch.where(amax == 0, torch.full_like(e, -127), e).clamp(-127, 127)


def _round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """y to the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to even, saturating."""
    a = y.abs().clamp(max=6.0)
    q = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(q, y)


def mx_fake_quant(w: torch.Tensor, fmt: str, mode: str, dim: int = -1) -> torch.Tensor:
    """``w`` quantized to MX (blocks of 32 along ``dim``) and back, in fp32."""
    x = w.float().movedim(dim, -1)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    e = _scale_exponent(blocks.abs().amax(-1, keepdim=True), fmt, mode)
    scale = torch.ldexp(torch.ones_like(blocks[..., :1]), e)
    y = blocks / scale
    q = _round_e2m1(y) if fmt == "mxfp4" else y.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape).movedim(-1, dim)


def test_mx_fake_quant_worked_examples() -> None:
    """The test's own quantizer on hand-computed blocks (mx-numerics.md section 2's rules)."""
    block = torch.tensor([[7.0, 1.0, -0.3, 0.0] + [0.0] * 28])
    # A = 7: rceil e = ceil(log2(7/6)) = 1; floor e = 2 - 2 = 0; even: 7 = 1.75 * 4 rounds to 2 * 4, e = 1
    assert torch.equal(mx_fake_quant(block, "mxfp4", "rceil")[0, :3], torch.tensor([8.0, 1.0, -0.0]))
    assert torch.equal(mx_fake_quant(block, "mxfp4", "floor")[0, :3], torch.tensor([6.0, 1.0, -0.5]))
    assert torch.equal(mx_fake_quant(block, "mxfp4", "even")[0, :3], torch.tensor([8.0, 1.0, -0.0]))
    # E4M3: A = 7, rceil e = ceil(log2(7/448)) = -6: 7 * 64 = 448 exactly; 0.3 * 64 = 19.2 -> 20 (step 2 in [16, 32))
    assert torch.equal(mx_fake_quant(block, "mxfp8", "rceil")[0, :3], torch.tensor([7.0, 1.0, -20.0 / 64]))
    assert torch.equal(mx_fake_quant(torch.zeros(2, 64), "mxfp8", "rceil"), torch.zeros(2, 64))


# ---------------------------------------------------------------------------------------------
# tiny models
# ---------------------------------------------------------------------------------------------


def _model_class(family: str) -> tuple[Any, Any]:
    t = transformers
    common: dict[str, Any] = dict(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    moe: dict[str, Any] = dict(intermediate_size=96, moe_intermediate_size=32, num_experts_per_tok=2)
    deepseek_like = dict(moe, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
    if family == "gpt-oss":
        return t.GptOssConfig(**common, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8), t.GptOssForCausalLM
    if family == "qwen3-moe":
        return t.Qwen3MoeConfig(**common, **moe, num_experts=4), t.Qwen3MoeForCausalLM
    if family == "mixtral":
        return t.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2), t.MixtralForCausalLM
    if family == "deepseek-v3":  # MLA: as many key/value heads as heads
        mla = dict(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
        return t.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, **deepseek_like, **mla), t.DeepseekV3ForCausalLM
    if family == "glm4-moe":
        return t.Glm4MoeConfig(**common, **deepseek_like), t.Glm4MoeForCausalLM
    raise ValueError(family)


def _expert_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The routed experts' fused weights of a transformers model (``...mlp.experts.gate_up_proj`` /
    ``down_proj``; gpt-oss stores them in x out, the others out x in)."""
    return {n: p for n, p in model.named_parameters() if re.search(r"\.experts\.(gate_up_proj|down_proj)$", n)}


@pytest.fixture(scope="module")
def quiet_transformers() -> Any:
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    logging.getLogger("compressed_tensors").setLevel(logging.ERROR)
    yield
    transformers.logging.set_verbosity(level)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, quiet_transformers: Any) -> dict[str, Path]:
    """family -> a saved tiny bf16 model (every weight random, biases and sinks included)."""
    out = {}
    for family in FAMILIES:
        cfg, cls = _model_class(family)
        torch.manual_seed(0)
        model = cls(cfg)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" not in n:
                    p.normal_(0, 0.08 if "experts" in n else 0.05)
        path = tmp_path_factory.mktemp(family) / "src"
        model.to(torch.bfloat16).save_pretrained(path)
        out[family] = path
    return out


@pytest.fixture(scope="module")
def outputs(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(family, format) -> ``mxconv quantize`` output of the source."""
    out = {}
    for family, src in sources.items():
        for fmt in FORMATS:
            dst = tmp_path_factory.mktemp(f"{family}-{fmt}") / "out"
            code, _, err = mx("quantize", src, dst, "--format", fmt, "--device", "cpu", "--quiet")
            assert code == 0, err
            out[family, fmt] = dst
    return out


def _load(path: Path) -> torch.nn.Module:
    """``from_pretrained`` as a user calls it, then fp32 throughout (compressed-tensors decompresses the
    experts to bf16, which holds every MX value exactly), so that logits compare at fp32 precision."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p in model.parameters():  # (a quantized model refuses .float())
        p.data = p.data.float()
    return model


def _expected(family: str, src: Path, out: Path) -> torch.nn.Module:
    """The source model with its routed-expert weights quantized and dequantized by this test's
    quantizer, under the scale rule the output's manifest records."""
    manifest = json.loads((out / "mxconv.json").read_text())
    fmt, mode = manifest["weight_format"], manifest["scale_rounding"]
    model = _load(src)
    with torch.no_grad():
        for p in _expert_params(model).values():
            p.copy_(mx_fake_quant(p, fmt, mode, dim=-2 if family == "gpt-oss" else -1))
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


def _assert_same_model(got: torch.nn.Module, want: torch.nn.Module, src: Path) -> None:
    """Every weight of ``got`` equals ``want``'s bit for bit, and so do (nearly) the logits."""
    want_params = dict(want.named_parameters())
    for name, p in got.named_parameters():
        assert torch.equal(p, want_params[name]), name
    a, b = _logits(got), _logits(want)
    err = (a - b).abs().max().item()
    assert err <= 1e-4 * b.abs().max().item(), f"logits differ from the expected model's by {err}"
    # the check has teeth: the unquantized source is much further away
    assert (_logits(_load(src)) - b).abs().max().item() > 50 * max(err, 1e-6)


# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_mxfp4_and_reproduces_the_reference(
    family: str, sources: dict[str, Path], outputs: dict[tuple[str, str], Path]
) -> None:
    if family == "gpt-oss":
        pytest.importorskip("accelerate")  # transformers' MXFP4 loader wants it (dequantizes on CPU)
    else:
        pytest.importorskip("compressed_tensors")
    out = outputs[family, "mxfp4"]
    got = _load(out)
    _assert_same_model(got, _expected(family, sources[family], out), sources[family])


@pytest.mark.parametrize("family", ["gpt-oss", "qwen3-moe"])
def test_transformers_names_the_unknown_mxconv_method(family: str, outputs: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    """repack outputs hold the engine's kernel tensors (w13_weight, ...), which from_pretrained cannot
    read. Their quant_method is "mxconv": vLLM's plugin loads them, vLLM without it stops naming mxconv.
    transformers refuses only a missing or null quant_method, which stock vLLM crashes on (AttributeError
    in _normalize_quantization_config); for "mxconv" it warns that it knows no such method and reports
    the expert tensors as unexpected and missing (docs/vllm-plugin.md, "transformers")."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    dst = tmp_path / "trt"
    code, _, err = mx("repack", outputs[family, "mxfp4"], dst, "--backend", "trtllm", "--device", "cpu", "--quiet")
    assert code == 0, err
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"] == "mxconv"
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # the module's fixtures keep transformers quiet otherwise
    try:
        with CaptureLogger(hf_logging.get_logger("transformers.quantizers.auto")) as cl:
            _load(dst)
    finally:
        hf_logging.set_verbosity(level)
    assert "Unknown quantization type, got mxconv" in cl.out


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_never_loads_mxfp8_wrong(family: str, sources: dict[str, Path], outputs: dict[tuple[str, str], Path]) -> None:
    """MXFP8 experts: transformers reads them right or raises, never random or misread experts."""
    out = outputs[family, "mxfp8"]
    if family == "gpt-oss":
        assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] is None
        with pytest.raises(ValueError, match="quant_method"):
            _load(out)
        return
    pytest.importorskip("compressed_tensors")
    try:
        got = _load(out)
    except RuntimeError as e:  # transformers 5.24: its compressed-tensors expert path takes no group scales
        assert "conversion" in str(e).lower() or "size" in str(e).lower(), e
        return
    _assert_same_model(got, _expected(family, sources[family], out), sources[family])


def test_why_gpt_oss_mxfp8_says_quant_method_null(
    sources: dict[str, Path], outputs: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    """Under "mxfp8" (mxconv's former convention) transformers' fine-grained FP8 loader takes the
    output and loads it without an error, its experts left at their random initial values."""
    pytest.importorskip("accelerate")
    out = outputs["gpt-oss", "mxfp8"]
    got, want = _load(_with_old_gpt_oss_config(out, tmp_path)), _expected("gpt-oss", sources["gpt-oss"], out)
    want_experts = _expert_params(want)
    for name, p in _expert_params(got).items():
        assert not torch.allclose(p, want_experts[name], atol=1e-2), name


# ---------------------------------------------------------------------------------------------
# compressed-tensors' own decompressor
# ---------------------------------------------------------------------------------------------


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            tensors.update({n: sf.get_tensor(n) for n in sf.keys()})
    return tensors


def _ct_decompress(out: Path, model: torch.nn.Module, family: str) -> dict[str, torch.Tensor]:
    """Fused expert weights (the names of ``_expert_params(model)``) rebuilt from the output's
    per-expert compressed-tensors tensors by compressed-tensors' own compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    tensors = _read_all(out)
    moe, (gate, up, down) = _PER_EXPERT[family]
    fused = {}
    for name, p in _expert_params(model).items():
        layer = int(re.search(r"layers\.(\d+)\.", name)[1])
        projs = (gate, up) if name.endswith("gate_up_proj") else (down,)
        experts = []
        for e in range(p.shape[0]):
            rows = []
            for proj in projs:
                prefix = f"model.layers.{layer}.{moe}.experts.{e}.{proj}."
                sd = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
                if "weight_packed" in sd:
                    sd["weight_shape"] = torch.tensor([sd["weight_packed"].shape[0], sd["weight_packed"].shape[1] * 2])
                rows.append(compressor.decompress(sd, scheme)["weight"].float())
            experts.append(torch.cat(rows))
        fused[name] = torch.stack(experts)
    return fused


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt-oss"])
def test_compressed_tensors_decompresses_the_expected_weights(
    family: str, fmt: str, sources: dict[str, Path], outputs: dict[tuple[str, str], Path]
) -> None:
    pytest.importorskip("compressed_tensors")
    out = outputs[family, fmt]
    want = _expected(family, sources[family], out)
    got = copy.deepcopy(want)
    fused = _ct_decompress(out, got, family)
    expected = _expert_params(want)
    with torch.no_grad():
        for name, p in _expert_params(got).items():
            assert torch.equal(fused[name], expected[name]), name  # bit for bit
            p.copy_(fused[name])
    _assert_same_model(got, want, sources[family])


# ---------------------------------------------------------------------------------------------
# gpt-oss MXFP8: mxconv's own variant
# ---------------------------------------------------------------------------------------------


def _with_old_gpt_oss_config(out: Path, tmp_path: Path) -> Path:
    """A copy of a gpt-oss MXFP8 output under mxconv's former ``quant_method: mxfp8``."""
    old = tmp_path / "old"
    old.mkdir()
    for f in out.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((old / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc.pop("mxconv_quant_method") == "mxfp8"
    qc["quant_method"] = "mxfp8"
    (old / "config.json").write_text(json.dumps(cfg))
    (old / "mxconv.json").unlink()  # the manifest's sha256 of config.json no longer holds
    return old


def test_gpt_oss_mxfp8_bytes_decode_to_the_expected_weights(
    sources: dict[str, Path], outputs: dict[tuple[str, str], Path]
) -> None:
    """Decoded here by hand (E4M3 elements times 2^(scale - 127)), the gpt-oss MXFP8 experts are
    the expected weights bit for bit, and a model holding them reproduces the expected logits."""
    out = outputs["gpt-oss", "mxfp8"]
    want = _expected("gpt-oss", sources["gpt-oss"], out)
    got = copy.deepcopy(want)
    tensors = _read_all(out)
    with torch.no_grad():
        for name, p in _expert_params(got).items():
            blocks, scales = tensors[name + "_blocks"], tensors[name + "_scales"]
            assert blocks.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
            w = blocks.float() * torch.ldexp(torch.ones(scales.shape), scales.long() - 127).unsqueeze(-1)
            w = w.reshape(*blocks.shape[:2], -1).transpose(1, 2)  # [E, N, K] -> gpt-oss's [E, K, N]
            assert torch.equal(w, _expert_params(want)[name]), name
            p.copy_(w)
    _assert_same_model(got, want, sources["gpt-oss"])


def test_mxconv_reads_gpt_oss_mxfp8_old_and_new(outputs: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    out = outputs["gpt-oss", "mxfp8"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] is None and qc["mxconv_quant_method"] == "mxfp8"
    for path in (out, _with_old_gpt_oss_config(out, tmp_path)):
        code, stdout, err = mx("inspect", path, "--json")
        assert code == 0, err
        assert json.loads(stdout)["model"]["expert_format"] == "mxfp8", stdout
