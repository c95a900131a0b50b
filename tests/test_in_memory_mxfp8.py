"""MXFP8 experts through the loader and the in-memory conversion, on CPU (vLLM 0.33's
Fp8MoeBackend.HUMMING and MARLIN forms: layouts/humming_mx.py, layouts/marlin_mxfp8.py).

``convert_layer`` of a bf16 layer with ``quant=QuantOptions("mxfp8")``, of an MXFP8 output's bytes
(kept MXFP8 when ``quant`` is left out) and of MXFP4 bytes asked for as MXFP8 must give exactly the
tensors ``repack`` writes from the same source; ``update_layer`` on a layer of an MXFP8 output
quantizes as that output did; the loader reads an MXFP8 output's layer (every rank of a TP output)
with the shapes and dtypes of the layout's kernel specs and the files' bytes. gpt-oss layers (biases,
interleaved rows) go to humming (marlin's MXFP8 form takes neither), Qwen layers (halves, no biases)
to both. tests/test_loader_gpu.py runs the same outputs through the engines' kernels.
"""

from __future__ import annotations

import pytest
import torch
from support.workspace import MadeCheckpoints
from test_in_memory import _assert_equal_files, _canonical, _layer

from mxconv.engines.in_memory import ConvertOptions, canonical_experts, convert_layer, update_layer
from mxconv.engines.loader import EngineLayer, model_info, read_layer_tensors, resolve_layer
from mxconv.engines.model_load import load_model
from mxconv.engines.runner import require_runner
from mxconv.engines.staged_read import byte_view
from mxconv.errors import BadInput
from mxconv.experts.stack import LayoutSizes
from mxconv.layouts import get_layout
from mxconv.run.options import QuantOptions
from mxconv.source.manifest import Manifest, load_manifest
from mxconv.examples import ModelSizes

H, I = 128, 192  # TP 2: 96 per rank, which marlin's MXFP8 form pads to 128 per half
MXFP8 = QuantOptions("mxfp8")
# (backend, source kind): marlin's MXFP8 form takes no biases and splits interleaved pairs at I % 64
CASES = [("humming", "gpt-oss-bf16"), ("humming", "qwen3-moe"), ("marlin", "qwen3-moe")]
IDS = [f"{b}-{k}" for b, k in CASES]
# the in-memory conversion alone (the loader needs an engine runner; xpu has none: no Intel GPU kernel here)
BYTE_CASES = [*CASES, ("xpu", "qwen3-moe")]
BYTE_IDS = [f"{b}-{k}" for b, k in BYTE_CASES]


def _raw(directory, kind: str = "") -> dict[str, torch.Tensor]:
    return _canonical(_layer(directory))


@pytest.fixture(scope="module")
def sources(made: MadeCheckpoints) -> dict[str, tuple]:
    """Per source kind: (bf16 source, its MXFP4 quantization, its MXFP8 quantization)."""
    out = {}
    for kind in ("gpt-oss-bf16", "qwen3-moe"):
        src = made.source(kind, ModelSizes(hidden_size=H, intermediate_size=I)).path
        out[kind] = (src, made.quantize(src), made.quantize(src, "--format", "mxfp8"))
    return out


@pytest.mark.parametrize(("backend", "kind"), BYTE_CASES, ids=BYTE_IDS)
def test_bf16_to_mxfp8_bytes_equal_repack(made: MadeCheckpoints, sources, backend: str, kind: str) -> None:
    bf16, _, _ = sources[kind]
    files = _layer(made.repack(bf16, backend, "--format", "mxfp8"))
    _assert_equal_files(convert_layer(_raw(bf16, kind), ConvertOptions(backend, quant=MXFP8)), files)


@pytest.mark.parametrize(("backend", "kind"), BYTE_CASES, ids=BYTE_IDS)
def test_mxfp8_bytes_move_untouched(made: MadeCheckpoints, sources, backend: str, kind: str) -> None:
    """An MXFP8 output's experts (float8_e4m3fn values + E8M0 bytes) stay MXFP8 with ``quant`` left
    out, bytes untouched: the layout equals ``repack`` of that output."""
    _, _, q8 = sources[kind]
    raw = _raw(q8, kind)
    canon = canonical_experts(raw)
    assert canon.weight_format == "mxfp8" and canon.w13.dtype == torch.uint8
    values = raw.get("w13", raw.get("gate_up_proj_blocks"))
    assert torch.equal(canon.w13.view(-1), values.reshape(-1).view(torch.uint8))
    _assert_equal_files(convert_layer(raw, ConvertOptions(backend)), _layer(made.repack(q8, backend)))


@pytest.mark.parametrize(("backend", "kind"), BYTE_CASES[1:], ids=BYTE_IDS[1:])
def test_mxfp4_bytes_asked_for_as_mxfp8(made: MadeCheckpoints, sources, backend: str, kind: str) -> None:
    """MXFP4 bytes re-coded losslessly to MXFP8, as ``repack --format mxfp8`` of an MXFP4 output does."""
    _, q4, _ = sources[kind]
    files = _layer(made.repack(q4, backend, "--format", "mxfp8"))
    _assert_equal_files(convert_layer(_raw(q4, kind), ConvertOptions(backend, quant=MXFP8)), files)


def test_refusals(sources) -> None:
    raw = _raw(sources["qwen3-moe"][2], "qwen3-moe")
    with pytest.raises(BadInput, match="w13 holds MXFP8 values and mxfp4 was asked for; MX bytes are moved as they are"):
        convert_layer(raw, ConvertOptions("humming", quant=QuantOptions("mxfp4")))
    as_bytes = {**raw, "w13": raw["w13"].view(torch.uint8)}
    with pytest.raises(BadInput, match="w13 is uint8 with 32 bytes per w13_scale byte: give MXFP8 values as float8_e4m3fn"):
        convert_layer(as_bytes, ConvertOptions("humming"))
    with pytest.raises(BadInput, match=r"backend triton takes mxfp4 experts, not mxfp8 \(backends that take mxfp8: .*humming"):
        convert_layer(raw, ConvertOptions("triton"))
    with pytest.raises(BadInput, match="w13 is torch.float8_e4m3fn: give floats, or MX bytes with w13_scale"):
        convert_layer({"w13": raw["w13"], "w2": raw["w2"]}, ConvertOptions("humming"))


def _specs(manifest: Manifest, backend: str) -> dict:
    lay, model = manifest.layout, manifest.model
    start, end = manifest.rank_ranges[0]
    sizes = LayoutSizes(model.num_experts, lay.hidden_size, end - start, lay.padded_hidden_size,
                        lay.padded_intermediate_size, lay.w13_row_order, model.has_expert_bias, "mxfp8")  # fmt: skip
    layout = get_layout(backend)
    return layout.kernel_specs(sizes, manifest.activation, layout.resolve_options(lay.option_values))


@pytest.mark.parametrize("tp", ["1", "2"])
@pytest.mark.parametrize(("backend", "kind"), CASES, ids=IDS)
def test_loader_reads_an_mxfp8_layer(made: MadeCheckpoints, sources, backend: str, kind: str, tp: str) -> None:
    """resolve_layer / read_layer_tensors (sha256 checked) and load_model on CPU: every rank's tensors
    with the layout's shapes and dtypes and the files' bytes."""
    _, _, q8 = sources[kind]
    out = made.repack(q8, backend, "--tp", tp)
    manifest = load_manifest(out)
    assert manifest.weight_format == "mxfp8"
    specs = _specs(manifest, backend)
    for rank in range(int(tp)):
        where = out / f"rank-{rank}" if tp != "1" else out
        src = resolve_layer(where, 1)
        got = read_layer_tensors(src, "cpu", check_hashes=True)
        assert set(got) == set(specs)
        for key, spec in specs.items():
            assert (tuple(got[key].shape), str(got[key].dtype)) == (tuple(spec.shape), str(spec.dtype)), key
        _assert_equal_files(got, _layer(where))
        model = load_model(where, device="cpu", layers=[1], check_hashes=True)
        assert not model.wrapped and model.bytes_read == sum(t.numel() * t.element_size() for t in got.values())
        _assert_equal_files(model.layers[1], got)  # type: ignore[arg-type]


@pytest.mark.parametrize(("backend", "kind"), CASES, ids=IDS)
def test_update_layer_quantizes_as_the_mxfp8_output_did(made: MadeCheckpoints, sources, backend: str, kind: str) -> None:
    """A layer of an MXFP8 output (its stored tensors, held as the loader reads them) updated in place
    from bf16 weights: quantized to MXFP8 because its manifest says so, the bytes of its files."""
    bf16, _, _ = sources[kind]
    out = made.repack(bf16, backend, "--format", "mxfp8", "--scale-rounding", "floor")
    src = resolve_layer(out, 1)
    tensors = read_layer_tensors(src, "cpu")
    held = {k: t.data_ptr() for k, t in tensors.items()}
    for t in tensors.values():
        t.zero_()
    m = src.manifest
    layer = EngineLayer(backend, 1, 0, 1, model_info(m), None, tensors, require_runner(backend), m.layout,
                        None, m.weight_format, m.scale_rounding)  # fmt: skip
    update_layer(layer, _raw(bf16, kind))
    assert (layer.weight_format, layer.scale_rounding) == ("mxfp8", "floor")
    assert {k: t.data_ptr() for k, t in layer.tensors.items()} == held
    _assert_equal_files(layer.tensors, _layer(out))
    ours = convert_layer(_raw(bf16, kind), ConvertOptions(backend, quant=MXFP8))  # the default rule: other bytes
    assert any(not torch.equal(byte_view(ours[k]), byte_view(layer.tensors[k])) for k in ours)


def test_float_experts_for_xpu_default_to_mxfp8_as_repack_does(made: MadeCheckpoints, sources) -> None:
    """No ConvertOptions.quant: bf16 experts handed to xpu (MXFP8 only) become MXFP8, the bytes of ``repack
    --backend xpu`` (which defaults the same way); it was a refusal naming no way out (the second review)."""
    bf16, _, _ = sources["qwen3-moe"]
    _assert_equal_files(convert_layer(_raw(bf16, "qwen3-moe"), ConvertOptions("xpu")), _layer(made.repack(bf16, "xpu")))
    with pytest.raises(BadInput, match=r"takes mxfp8 experts, not mxfp4 .*set ConvertOptions.quant to QuantOptions\(fmt='mxfp8'\)"):
        convert_layer(_raw(bf16, "qwen3-moe"), ConvertOptions("xpu", quant=QuantOptions("mxfp4")))
