"""MXFP8 outputs through the loader and the in-memory conversion on the GPU (``-m gpu``; vLLM 0.33's
Fp8MoeBackend.HUMMING on SM90 and Fp8MoeBackend.MARLIN): a Qwen-style layer (H 256, I 192, E 8,
top-2) quantized to MXFP8 and repacked for humming and marlin on the CPU, then

* ``load_layer`` / ``load_model`` on CUDA wrap each layer for the engine (humming's GEMMs, vLLM's
  Marlin MoE GEMM with float8_e4m3fn weights) and compute the fp32 reference on the MXFP8 weights
  within the kernel bound;
* ``convert_layer`` on CUDA (bf16 -> MXFP8, and MXFP8 bytes kept) gives exactly the bytes of
  ``repack``'s files (no kernel needed, only a CUDA device);
* ``update_layer`` on a live MXFP8 layer (the RL weight sync of docs/loader.md) rewrites its buffers
  and the forward follows: w2 doubled doubles the output.

humming needs an SM90 GPU and humming-kernels; marlin vLLM's MoE ops (``MXCONV_MARLIN_OPS``).
Absent -> skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.checkpoints import ModelSizes, make_checkpoint
from support.gpu_outputs import need_kernels
from test_engines_gpu import _check, _reference, mx
from test_in_memory import _assert_equal_files, _layer
from test_in_memory_mxfp8 import _raw

from mxconv.engines.in_memory import ConvertOptions, convert_layer, update_layer
from mxconv.engines.loader import load_layer
from mxconv.engines.model_load import load_model
from mxconv.run.options import QuantOptions

pytestmark = pytest.mark.gpu
H, I, E = 256, 192, 8
BACKENDS = ["humming", "marlin"]


def _need(backend: str) -> None:
    """Skip unless ``backend``'s engine kernel runs here (humming: SM90 + humming-kernels)."""
    if backend == "marlin":
        need_kernels("marlin")
        return
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("humming's MXFP8 layout here is SM90's; needs an H100/H200")
    try:
        import humming.forward  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"humming-kernels not importable: {exc}")


@pytest.fixture(scope="module")
def made8(tmp_path_factory) -> dict[str, Path]:
    """src (bf16), q8 (its MXFP8 quantization), {backend} (repack of q8), {backend}-bf16 (repack of
    src with --format mxfp8)."""
    root = tmp_path_factory.mktemp("loader-mxfp8")
    make_checkpoint(root / "src", "qwen3-moe", ModelSizes(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2))
    runs = {"q8": ("quantize", "src", "--format", "mxfp8")}
    for b in BACKENDS:
        runs[b] = ("repack", "q8", "--backend", b)
        runs[f"{b}-bf16"] = ("repack", "src", "--backend", b, "--format", "mxfp8")
    for name, (command, src, *args) in runs.items():
        code, text = mx(command, root / src, root / name, *args, "--quiet", "--device", "cpu")
        assert code == 0, text
    return {name: root / name for name in ("src", *runs)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_layer_computes_the_reference(made8: dict[str, Path], backend: str) -> None:
    """load_layer on CUDA (the MXFP8 form's runner: humming's GEMMs / Marlin with float8_e4m3fn) within
    the kernel bound of the fp32 reference on the MXFP8 weights, layers 0 and 1; load_model wraps
    every layer and gives the same output."""
    _need(backend)
    model = load_model(made8[backend], device="cuda", check_hashes=True)
    assert model.wrapped
    for layer in (0, 1):
        x, r, ref, _, _ = _reference(made8["q8"], layer)
        one = load_layer(made8[backend], layer)
        assert one.weight_format == "mxfp8"
        y = one.forward(x, r.ids, r.weights)
        _check(f"qwen/{backend}-mxfp8/load_layer/layer{layer}", y, ref, r, True)
        assert torch.equal(model.layers[layer].forward(x, r.ids, r.weights), y)  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", BACKENDS)
def test_convert_layer_on_cuda_equals_repack(made8: dict[str, Path], backend: str) -> None:
    """The in-memory conversion run on CUDA tensors: bf16 -> MXFP8 and MXFP8 bytes kept, the bytes of
    repack's files (written on the CPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    bf16 = {k: v.cuda() for k, v in _raw(made8["src"]).items()}
    got = convert_layer(bf16, ConvertOptions(backend, quant=QuantOptions("mxfp8")))
    assert all(t.device.type == "cuda" for t in got.values())
    _assert_equal_files({k: v.cpu() for k, v in got.items()}, _layer(made8[f"{backend}-bf16"]))
    q8 = {k: v.cuda() for k, v in _raw(made8["q8"]).items()}
    kept = convert_layer(q8, ConvertOptions(backend))
    _assert_equal_files({k: v.cpu() for k, v in kept.items()}, _layer(made8[backend]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rl_weight_sync_on_an_mxfp8_layer(made8: dict[str, Path], backend: str) -> None:
    """update_layer with bf16 weights on a live MXFP8 layer: the same buffers, quantized to MXFP8 as the
    output was (its files' bytes), and the forward follows the weights (w2 doubled: MXFP8 scales + 1,
    same codes; the model has no biases, so the output doubles)."""
    _need(backend)
    layer = load_layer(made8[f"{backend}-bf16"], 1)
    held = {k: t.data_ptr() for k, t in layer.tensors.items()}
    x = torch.randn(32, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(32, E, device="cuda")
    weights = {k: v.cuda() for k, v in _raw(made8["src"]).items()}
    for t in layer.tensors.values():
        t.zero_()
    update_layer(layer, weights)
    assert {k: t.data_ptr() for k, t in layer.tensors.items()} == held
    _assert_equal_files({k: v.cpu() for k, v in layer.tensors.items()}, _layer(made8[f"{backend}-bf16"]))
    y1 = layer.forward(x, logits=logits).float()
    weights["w2"] = weights["w2"] * 2
    update_layer(layer, weights)
    y2 = layer.forward(x, logits=logits).float()
    assert y1.abs().max() > 0
    torch.testing.assert_close(y2, 2 * y1, rtol=2e-2, atol=2e-2 * float(y1.abs().max()))
