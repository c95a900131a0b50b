"""``quantize --format fp8-block`` outputs load in transformers' fine-grained FP8 loader (issue 22 item 5):
a tiny Qwen3-MoE built with transformers' own classes, saved as bf16, converted, and loaded with
``from_pretrained``. Without a GPU transformers dequantizes the FP8 experts on load (W = fp32(q) *
scale_inv); the expected model is the source with its routed experts put through this test's own
block quantizer (amax / 448 per 128x128 tile, round to nearest even), and the logits must match it
far more closely than the unquantized source does."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from support.cli import mx

transformers = pytest.importorskip("transformers", minversion="5.0")

TOKENS = torch.tensor([[3, 17, 42, 5, 77, 8, 61, 30, 12, 90, 1, 55]])


def _block_fake_quant(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] -> fp32 after E4M3 with one amax/448 scale per 128x128 tile of the last two dims."""
    out = w.float().clone()
    N, K = out.shape[-2:]
    for i in range(0, N, 128):
        for j in range(0, K, 128):
            t = out[..., i : i + 128, j : j + 128]
            s = t.abs().amax(dim=(-2, -1), keepdim=True) / 448
            s = torch.where(s > 0, s, torch.ones_like(s))
            t.copy_((t / s).to(torch.float8_e4m3fn).float() * s)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, tie_word_embeddings=False, intermediate_size=96, moe_intermediate_size=128,
        num_experts_per_tok=2, num_experts=4,
    )  # fmt: skip  (whole 128-tiles: transformers derives the block from the scale grid, see plan's warning)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.08 if "experts" in n else 0.05)
    root = tmp_path_factory.mktemp("fp8tf")
    model.to(torch.bfloat16).save_pretrained(root / "src")
    code, _, err = mx("quantize", root / "src", root / "fp8", "--format", "fp8-block", "--device", "cpu", "--quiet")
    assert code == 0, err
    code, _, err = mx("quantize", root / "src", root / "part", "--format", "fp8-block", "--ignore", "layers.1",
                      "--device", "cpu", "--quiet")
    assert code == 0, err
    code, _, err = mx("quantize", root / "src", root / "lin", "--format", "fp8-block", "--targets", "linear",
                      "--device", "cpu", "--quiet")
    assert code == 0, err
    return root / "src", root / "fp8"


def _load(path: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p in model.parameters():
        p.data = p.data.float()
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


def _expected(src: Path, layers: tuple[int, ...]) -> torch.nn.Module:
    """The source model with the routed experts of ``layers`` put through this test's block quantizer."""
    want = _load(src)
    with torch.no_grad():
        for n, p in want.named_parameters():
            if n.endswith(("experts.gate_up_proj", "experts.down_proj")) and int(n.split(".")[2]) in layers:
                p.copy_(_block_fake_quant(p) if not n.endswith("gate_up_proj") else torch.cat(
                    [_block_fake_quant(h) for h in p.chunk(2, dim=-2)], dim=-2))  # gate, up: tiles of their own
    return want


def test_transformers_loads_fp8_block_and_reproduces_the_reference(models: tuple[Path, Path]) -> None:
    src, out = models
    got = _load(out)
    a, b, s = _logits(got), _logits(_expected(src, (0, 1))), _logits(_load(src))
    err = (a - b).abs().max().item()
    # bf16 dequantization on load (transformers' CPU path) leaves a small rounding; the FP8 error itself is far larger
    assert err <= 2e-2 * b.abs().max().item(), f"logits differ from the expected model's by {err}"
    assert (s - b).abs().max().item() > 5 * max(err, 1e-6)


def test_transformers_reads_a_layer_left_in_float_as_float(models: tuple[Path, Path]) -> None:
    """``--ignore layers.1``: layer 1's experts are listed as not converted, so transformers takes the
    copied weights as they are, while layer 0's are FP8 (dequantized on load without a GPU)."""
    src, _ = models
    got, plain = _load(src.parent / "part"), _load(src)
    assert torch.equal(got.model.layers[1].mlp.experts.down_proj, plain.model.layers[1].mlp.experts.down_proj)
    fp8 = _expected(src, (0,)).model.layers[0].mlp.experts.down_proj
    assert torch.allclose(got.model.layers[0].mlp.experts.down_proj, fp8, rtol=1e-2, atol=1e-4)
    assert not torch.equal(got.model.layers[0].mlp.experts.down_proj, plain.model.layers[0].mlp.experts.down_proj)
    a, b, s = _logits(got), _logits(_expected(src, (0,))), _logits(_expected(src, (0, 1)))
    err = (a - b).abs().max().item()
    assert err <= 2e-2 * b.abs().max().item(), f"logits differ from the expected model's by {err}"
    assert (s - b).abs().max().item() > 5 * max(err, 1e-6)


def test_transformers_loads_block_fp8_linears(models: tuple[Path, Path]) -> None:
    """``--targets linear``: the attention projections are block FP8 as well (transformers'
    FP8Linear, dequantized on load without a GPU); routers, embeddings and lm_head stay as they are."""
    src, _ = models
    got = _load(src.parent / "lin")
    want = _expected(src, (0, 1))
    with torch.no_grad():
        for n, p in want.named_parameters():
            if ".self_attn." in n and n.endswith("_proj.weight"):
                p.copy_(_block_fake_quant(p))
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        assert torch.allclose(got.get_parameter(n).float(), want.get_parameter(n), rtol=1e-2, atol=1e-4), n
    assert torch.equal(got.model.layers[0].mlp.gate.weight, _load(src).model.layers[0].mlp.gate.weight)
    a, b, s = _logits(got), _logits(want), _logits(_expected(src, (0, 1)))
    err = (a - b).abs().max().item()
    assert err <= 2e-2 * b.abs().max().item(), f"logits differ from the expected model's by {err}"
    assert (s - b).abs().max().item() > 5 * max(err, 1e-6)
