"""In-memory conversion (mxconv.engines.in_memory) against the files ``repack`` writes, on CPU.

A gpt-oss bf16 source and its MXFP4 quantization are repacked with the CLI for every registered
backend and each of its activation formats; the same experts, read raw from the source files (not
through the family reader) and handed over in gpt-oss source names or in canonical names, must
convert to exactly the bytes of those files. A live layer of the toy backend (its engine runs on
CPU) is updated in place and its forward follows; an update is quantized as the layer's output was
(its manifest's scale rule), and one that does not fit the layer leaves every buffer as it was.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from support.registry_cases import activation_cases, case_id, takes_biases
from support.toy_backend import ToyLayout
from support.workspace import MadeCheckpoints

from mxconv.engines.in_memory import (
    ConvertOptions,
    canonical_experts,
    convert_layer,
    update_layer,
)
from mxconv.engines.model_load import load_model
from mxconv.engines.staged_read import byte_view
from mxconv.errors import BadInput
from mxconv.layouts import register_layout, unregister_layout
from mxconv.run.options import QuantOptions
from mxconv.source.checkpoint import open_checkpoint
from mxconv.source.st_format import read_tensor
from mxconv.examples import ModelSizes

H, I = 128, 96
EXPERTS = "model.layers.1.mlp.experts"


def _layer(directory, prefix: str = EXPERTS) -> dict[str, torch.Tensor]:
    ckpt = open_checkpoint(str(directory))
    return {n[len(prefix) + 1:]: read_tensor(i) for n, i in ckpt.tensors.items() if n.startswith(prefix + ".")}


def _canonical(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical names for a layer as the test checkpoints store it: gpt-oss names as they are,
    per-expert Qwen Linears (``{e}.gate_proj.weight`` or ``weight_packed``, ``weight_scale``) stacked, gate then up rows."""
    if "gate_up_proj" in raw or "gate_up_proj_blocks" in raw:
        return raw
    E = 1 + max(int(n.split(".")[0]) for n in raw)

    def stack(proj: str, suffix: str) -> torch.Tensor:
        return torch.stack([raw[f"{e}.{proj}.{suffix}"] for e in range(E)])

    w = "weight_packed" if "0.down_proj.weight_packed" in raw else "weight"  # MXFP4 pairs, else floats or MXFP8
    out = {"w13": torch.cat([stack("gate_proj", w), stack("up_proj", w)], dim=1), "w2": stack("down_proj", w)}
    if "0.down_proj.weight_scale" in raw:
        out["w13_scale"] = torch.cat([stack("gate_proj", "weight_scale"), stack("up_proj", "weight_scale")], dim=1)
        out["w2_scale"] = stack("down_proj", "weight_scale")
    return out


@pytest.fixture(scope="module")
def sources(made: MadeCheckpoints):
    bf16 = made.source("gpt-oss-bf16", ModelSizes(hidden_size=H, intermediate_size=I)).path
    return bf16, made.quantize(bf16)


# the sizes of the float sources per format: MXFP4 ones every MXFP4 form pads; MXFP8 forms pad nothing and
# take I % 64 == 0 only (aiter's, marlin's with interleaved rows)
FORMAT_SIZES = {"mxfp4": ModelSizes(hidden_size=H, intermediate_size=I), "mxfp8": ModelSizes(hidden_size=H, intermediate_size=128)}


def _float_source(made: MadeCheckpoints, kind: str, fmt: str) -> Path:
    """gpt-oss (expert biases, interleaved rows) or Qwen3-MoE (neither), in the sizes of ``fmt``."""
    return made.source(kind, FORMAT_SIZES[fmt]).path


def _assert_equal_files(got: dict[str, torch.Tensor], files: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(files)
    for key, want in files.items():
        assert got[key].shape == want.shape and got[key].element_size() == want.element_size(), key
        assert torch.equal(byte_view(got[key].contiguous()), byte_view(want)), key


# every backend with each MX format it takes (convert_layer takes MX and float experts) and each activation of
# that format, all on CPU; activations that need the source's FP8 input scales (W4A8) have no source here
EVERY_BACKEND = activation_cases(("mxfp4", "mxfp8"))


@pytest.mark.parametrize(("backend", "fmt", "activation"), EVERY_BACKEND, ids=[case_id(c) for c in EVERY_BACKEND])
@pytest.mark.parametrize("source", ["float", "quantized"])
def test_bytes_equal_repack(made: MadeCheckpoints, backend: str, fmt: str, activation: str, source: str) -> None:
    """The float source quantized to ``fmt`` on the way, or its ``fmt`` output moved as it is: exactly the
    files ``repack`` writes. gpt-oss's layer (biases) where the backend's ``fmt`` bytes hold biases, else Qwen's."""
    kind = "gpt-oss-bf16" if takes_biases(backend, fmt) else "qwen3-moe"
    bf16 = _float_source(made, kind, fmt)
    src = bf16 if source == "float" else made.quantize(bf16, "--format", fmt)
    files = _layer(made.repack(src, backend, "--activation", activation, "--format", fmt))
    raw = _layer(src)
    options = ConvertOptions(backend, activation=activation, quant=QuantOptions(fmt) if source == "float" else None)
    _assert_equal_files(convert_layer(_canonical(raw), options), files)  # gpt-oss source names: interleaved rows implied
    if source == "float" and kind == "gpt-oss-bf16":  # the same experts under canonical names
        canon = {"w13": raw["gate_up_proj"].transpose(1, 2), "w2": raw["down_proj"].transpose(1, 2),
                 "w13_bias": raw["gate_up_proj_bias"], "w2_bias": raw["down_proj_bias"]}  # fmt: skip
        _assert_equal_files(convert_layer(canon, options, row_order="interleaved"), files)


def test_mxfp4_bytes_move_untouched(sources) -> None:
    _, q4 = sources
    raw = _layer(q4)
    c = canonical_experts(raw)
    assert c.row_order == "interleaved"
    assert torch.equal(c.w13, raw["gate_up_proj_blocks"].reshape(4, 2 * I, H // 2))
    assert torch.equal(c.w2_scale, raw["down_proj_scales"])


def test_refusals() -> None:
    w = torch.zeros(2, 64, 64)
    with pytest.raises(BadInput, match="unknown expert tensor 'up'"):
        convert_layer({"w13": w, "up": w}, ConvertOptions("triton"))
    with pytest.raises(BadInput, match="no w2"):
        convert_layer({"w13": w}, ConvertOptions("triton"))
    with pytest.raises(BadInput, match="w2 is torch.int32"):
        convert_layer({"w13": w, "w2": torch.zeros(2, 64, 32, dtype=torch.int32)}, ConvertOptions("triton"))


def test_update_layer_in_place(made: MadeCheckpoints, sources) -> None:
    register_layout("toy", ToyLayout())
    try:
        bf16, _ = sources
        layer = load_model(made.repack(bf16, "toy"), device="cpu", layers=[1]).layers[1]
        held = {k: t.data_ptr() for k, t in layer.tensors.items()}
        x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
        ids, weights = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]]), torch.full((5, 2), 0.5)
        before = layer.forward(x, ids, weights)
        raw = _layer(bf16)
        update_layer(layer, raw)  # the same weights: same output
        assert torch.equal(layer.forward(x, ids, weights), before)
        raw["down_proj"] = raw["down_proj"] * 2  # w2 doubled, biases kept: the output moves
        update_layer(layer, raw)
        after = layer.forward(x, ids, weights)
        assert {k: t.data_ptr() for k, t in layer.tensors.items()} == held  # the same buffers, rewritten
        assert not torch.equal(after, before)
        with pytest.raises(BadInput, match="w13_weight converts to"):
            update_layer(layer, {**raw, "gate_up_proj": raw["gate_up_proj"][:, :, :64], "down_proj": raw["down_proj"][:, :32],
                                 "gate_up_proj_bias": raw["gate_up_proj_bias"][:, :64]})  # fmt: skip
    finally:
        unregister_layout("toy")


@pytest.fixture
def toy():
    register_layout("toy", ToyLayout())
    yield
    unregister_layout("toy")


def _copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in tensors.items()}


def test_update_is_quantized_as_the_output_was(made: MadeCheckpoints, sources, toy) -> None:
    bf16, _ = sources
    out = made.repack(bf16, "toy", "--scale-rounding", "floor")
    default = _layer(made.repack(bf16, "toy"))
    files = _layer(out)
    assert any(not torch.equal(files[k], default[k]) for k in files)  # the rule shows in the bytes
    layer = load_model(out, device="cpu", layers=[1]).layers[1]
    for t in layer.tensors.values():
        t.zero_()
    update_layer(layer, _layer(bf16))
    _assert_equal_files(layer.tensors, files)
    assert (layer.weight_format, layer.scale_rounding) == ("mxfp4", "floor")  # from the manifest
    with pytest.raises(BadInput, match="holds int4 experts"):
        update_layer(dataclasses.replace(layer, weight_format="int4"), _layer(bf16))


def test_update_that_does_not_fit_writes_nothing(made: MadeCheckpoints, sources, toy) -> None:
    bf16, _ = sources
    layer = load_model(made.repack(bf16, "toy"), device="cpu", layers=[1]).layers[1]
    before = _copies(layer.tensors)
    raw = _layer(bf16)
    new = {"gate_up_proj": raw["gate_up_proj"] * 2, "down_proj": raw["down_proj"] * 2}  # w13, w2 fit; no biases
    with pytest.raises(BadInput, match="w13_bias converts to absent"):
        update_layer(layer, new)
    _assert_equal_files(layer.tensors, before)  # w13_weight (checked before w13_bias) untouched too
    w2 = layer.tensors["w2_weight"]
    layer.tensors["w2_weight"] = narrow = w2[:, :, : w2.shape[2] // 2].clone()  # a layer whose w2 only is smaller
    with pytest.raises(BadInput, match=r"w2_weight converts to torch.uint8\[4, 128, 64\], the layer holds torch.uint8\[4, 128, 32\]"):
        update_layer(layer, {**raw, **new})
    _assert_equal_files(layer.tensors, {**before, "w2_weight": narrow})


def test_update_with_tensors_the_layer_does_not_hold(made: MadeCheckpoints, toy) -> None:
    src = made.source("qwen3-moe", ModelSizes(hidden_size=H, intermediate_size=I)).path  # no biases
    layer = load_model(made.repack(src, "toy"), device="cpu", layers=[1]).layers[1]
    assert "w13_bias" not in layer.tensors
    before = _copies(layer.tensors)
    g = torch.Generator().manual_seed(2)
    E = layer.info.num_experts
    new = {"w13": torch.randn(E, 2 * I, H, generator=g), "w2": torch.randn(E, H, I, generator=g),
           "w13_bias": torch.zeros(E, 2 * I), "w2_bias": torch.zeros(E, H)}  # fmt: skip
    with pytest.raises(BadInput, match="gives w13_bias, w2_bias, which the layer does not hold"):
        update_layer(layer, new)
    _assert_equal_files(layer.tensors, before)
    update_layer(layer, {"w13": new["w13"], "w2": new["w2"]})  # without them it fits
    assert not torch.equal(layer.tensors["w2_weight"], before["w2_weight"])
