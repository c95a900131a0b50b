"""Family readers against generated real-format checkpoints (tests/support/checkpoints.py) and the
compressed-tensors library as an oracle for the quantized-output convention."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mxconv.source.checkpoint import open_checkpoint
from mxconv.errors import BadInput
from mxconv.families import FAMILIES, detect_family, reader_class
from mxconv.families.base import FamilyReader, MoELayer, MoELayerRef, MXStack
from mxconv.families.quant_config import SUPPORTED_HINT
from support.checkpoints import KINDS, GroundTruth, ModelSizes, make_checkpoint, write_shards
from support.hub import make_hub_cache
from support.workspace import MadeCheckpoints

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

# kind -> (reader class, expert_format, routing fields, source_scale_scheme, moe layers with the defaults)
EXPECTED: dict[str, dict[str, Any]] = {
    "gpt-oss-mxfp4": dict(cls="GptOssReader", fmt="mxfp4", routing="topk_softmax", norm=True, n_group=1, topk_group=1, rsf=1.0, scheme="e8m0", moe=(0, 1)),
    "gpt-oss-bf16": dict(cls="GptOssReader", fmt="bf16", routing="topk_softmax", norm=True, n_group=1, topk_group=1, rsf=1.0, scheme=None, moe=(0, 1)),
    "qwen3-moe": dict(cls="QwenMoeReader", fmt="bf16", routing="softmax_topk", norm=True, n_group=1, topk_group=1, rsf=1.0, scheme=None, moe=(0, 1)),
    "qwen2-moe": dict(cls="QwenMoeReader", fmt="bf16", routing="softmax_topk", norm=False, n_group=1, topk_group=1, rsf=1.0, scheme=None, moe=(0, 1)),
    "mixtral": dict(cls="MixtralReader", fmt="bf16", routing="topk_softmax", norm=True, n_group=1, topk_group=1, rsf=1.0, scheme=None, moe=(0, 1)),
    "deepseek-v3-fp8": dict(cls="DeepseekV3Reader", fmt="fp8_block", routing="sigmoid_grouped", norm=True, n_group=2, topk_group=1, rsf=2.5, scheme="fp8_block_128x128", moe=(1, 2)),
    "deepseek-v3.1-fp8-ue8m0": dict(cls="DeepseekV3Reader", fmt="fp8_block", routing="sigmoid_grouped", norm=True, n_group=2, topk_group=1, rsf=2.5, scheme="fp8_block_128x128_ue8m0", moe=(1, 2)),
    "kimi-k2": dict(cls="DeepseekV3Reader", fmt="fp8_block", routing="sigmoid_grouped", norm=True, n_group=1, topk_group=1, rsf=2.827, scheme="fp8_block_128x128", moe=(1,)),
    "glm4-moe": dict(cls="Glm4MoeReader", fmt="bf16", routing="sigmoid_grouped", norm=True, n_group=1, topk_group=1, rsf=2.5, scheme=None, moe=(1, 2)),
}
FP8_KINDS = ("deepseek-v3-fp8", "deepseek-v3.1-fp8-ue8m0", "kimi-k2")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(made: MadeCheckpoints) -> Callable[[str], GroundTruth]:
    """Shared read-only checkpoints, one per kind (generated on first use)."""

    def get(kind: str) -> GroundTruth:
        return made.source(kind, shards=3)

    return get


def reader_for(path: Path | str) -> FamilyReader:
    return detect_family(open_checkpoint(path))


def raw(path: Path, name: str) -> torch.Tensor:
    """One tensor straight from the shard the index names (independent of mxconv's reader)."""
    index = path / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
    with safe_open(str(path / shard), framework="pt") as f:
        return f.get_tensor(name)


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def rewrite(path: Path, mutate: Callable[[dict[str, torch.Tensor]], None], shards: int = 2) -> None:
    """Apply ``mutate`` to every tensor of the checkpoint and write it back (new shards + index)."""
    tensors = all_tensors(path)
    mutate(tensors)
    for f in path.glob("*.safetensors"):
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    write_shards(path, tensors, shards)


def patch_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def refusal(
    path: Path,
    kind: str,
    call: str = "model_info",
    config: dict[str, Any] | None = None,
    mutate: Callable[[dict[str, torch.Tensor]], None] | None = None,
    sizes: ModelSizes = ModelSizes(),
    **gen: Any,
) -> str:
    """Generate ``kind`` with ``sizes`` into ``path`` (``gen``: make_checkpoint options), patch its config.json with
    ``config`` and/or rewrite its tensors with ``mutate``, then return the BadInput message the
    reader's ``call`` ("model_info" or "layer_refs") raises."""
    make_checkpoint(path, kind, sizes, **gen)
    if mutate is not None:
        rewrite(path, mutate, shards=gen.get("shards", 2))
    if config:
        patch_config(path, **config)
    with pytest.raises(BadInput) as ei:
        getattr(reader_for(path), call)()
    return str(ei.value)


def random_mx(g: torch.Generator, fmt: str, E: int, n: int, k: int) -> MXStack:
    """Random MX stack: any FP4 code; E4M3 codes without NaN (0x7F/0xFF); scale bytes 110..135."""
    data = torch.randint(0, 256, (E, n, k // 2 if fmt == "mxfp4" else k), generator=g, dtype=torch.uint8)
    if fmt == "mxfp8":
        data[(data & 0x7F) == 0x7F] = 0x7E
    return MXStack(fmt, data, torch.randint(110, 136, (E, n, k // 32), generator=g, dtype=torch.uint8))


def decode_mx(data: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """Independent float64 dequantization of [N, K/2 | K] codes + [N, K/32] E8M0 bytes -> [N, K]."""
    d = data.to(torch.int64)
    if fmt == "mxfp4":
        codes = torch.stack([d & 0xF, d >> 4], dim=-1).reshape(d.shape[0], -1)  # low nibble first
        mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
        vals = torch.where((codes & 8) != 0, -mag, mag)
    else:
        sign = torch.where((d >> 7) != 0, -1.0, 1.0).to(torch.float64)
        exp, man = (d >> 3) & 0xF, (d & 7).to(torch.float64)
        mag = torch.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * torch.pow(2.0, (exp - 7).to(torch.float64)))
        vals = sign * mag
    s = torch.pow(2.0, scales.to(torch.float64) - 127).repeat_interleave(32, dim=-1)
    return vals * s


def write_quantized(src: GroundTruth, reader: FamilyReader, layers: dict[int, MoELayer], fmt: str, out: Path) -> None:
    """What the quantize writer does: drop each layer's source tensors, add quantized_tensors,
    copy the rest, set quantization_config."""
    tensors = all_tensors(src.path)
    for ref in reader.layer_refs():
        for n in ref.source_names:
            del tensors[n]
        q = reader.quantized_tensors(layers[ref.layer])
        specs = reader.quantized_specs(ref, fmt)
        assert set(q) == set(specs)
        for n, t in q.items():
            assert tuple(t.shape) == specs[n].shape and t.dtype == specs[n].dtype, n
        tensors.update(q)
    out.mkdir(parents=True)
    write_shards(out, tensors, 2)
    cfg = dict(src.config)
    cfg["quantization_config"] = reader.quantization_config(fmt, "rceil")
    (out / "config.json").write_text(json.dumps(cfg))


def random_mx_layers(reader: FamilyReader, fmt: str, seed: int = 7) -> dict[int, MoELayer]:
    """Random MX canonical layers with the reader's row order (and its source biases, gpt-oss)."""
    g = torch.Generator().manual_seed(seed)
    info = reader.model_info()
    E, H, I = info.num_experts, info.hidden_size, info.intermediate_size
    out = {}
    for ref in reader.layer_refs():
        src = reader.read_layer(ref) if info.has_expert_bias else None
        out[ref.layer] = MoELayer(
            ref=ref,
            row_order=info.row_order,
            w13_mx=random_mx(g, fmt, E, 2 * I, H),
            w2_mx=random_mx(g, fmt, E, H, I),
            w13_bias=None if src is None else src.w13_bias,
            w2_bias=None if src is None else src.w2_bias,
        )
    return out


# ---------------------------------------------------------------------------------------------
# detection, model info, layer refs, canonical reads
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_detect_and_model_info(built: Callable[[str], GroundTruth], kind: str) -> None:
    gt = built(kind)
    exp = EXPECTED[kind]
    r = reader_for(gt.path)
    assert type(r).__name__ == exp["cls"]
    assert r.name == gt.family and r.name in FAMILIES
    info = r.model_info()
    assert info.family == gt.family
    assert info.num_layers == 2
    assert info.moe_layers == exp["moe"] == gt.moe_layers
    assert (info.num_experts, info.top_k) == (4, 2)
    assert (info.hidden_size, info.intermediate_size) == (gt.hidden_size, gt.intermediate_size)
    assert info.expert_format == exp["fmt"]
    assert info.routing == exp["routing"]
    assert info.norm_topk_prob is exp["norm"]
    assert (info.n_group, info.topk_group) == (exp["n_group"], exp["topk_group"])
    assert info.routed_scaling_factor == pytest.approx(exp["rsf"])
    assert info.source_scale_scheme == exp["scheme"]
    if gt.family == "gpt-oss":
        assert (info.row_order, info.has_expert_bias, info.activation) == ("interleaved", True, "swigluoai")
        assert (info.swiglu_alpha, info.swiglu_limit) == (1.702, 7.0)
    else:
        assert (info.row_order, info.has_expert_bias, info.activation) == ("halves", False, "silu")
        assert (info.swiglu_alpha, info.swiglu_limit) == (None, None)
    # sizes that need backend padding
    assert info.hidden_size % 32 == 0 and info.hidden_size % 128 != 0
    assert info.intermediate_size % 32 == 0 and info.intermediate_size % 128 != 0


def test_gpt_oss_swiglu_alpha_from_config(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "gpt-oss-bf16")
    patch_config(tmp_path, swiglu_alpha=1.5, swiglu_limit=5.0)
    info = reader_for(tmp_path).model_info()
    assert (info.swiglu_alpha, info.swiglu_limit) == (1.5, 5.0)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_refs(built: Callable[[str], GroundTruth], kind: str) -> None:
    gt = built(kind)
    refs = reader_for(gt.path).layer_refs()
    assert [r.layer for r in refs] == list(gt.moe_layers)
    moe = "block_sparse_moe" if kind == "mixtral" else "mlp"
    for ref in refs:
        truth = gt.layers[ref.layer]
        assert ref.module_prefix == f"model.layers.{ref.layer}.{moe}" == truth.module_prefix
        assert len(ref.source_names) == len(set(ref.source_names))
        assert set(ref.source_names) == set(truth.expert_names)
        assert ref.router_weight == truth.router_weight
        assert ref.router_bias == truth.router_bias
        assert ref.correction_bias == truth.correction_bias
        # nothing but routed experts: no router, shared expert or dense MLP tensor is consumed
        assert not any(re.search(r"router|\.gate\.|shared_expert|\.mlp\.(gate|up|down)_proj", n) for n in ref.source_names)


@pytest.mark.parametrize("kind", KINDS)
def test_read_layer_equals_ground_truth(built: Callable[[str], GroundTruth], kind: str) -> None:
    gt = built(kind)
    r = reader_for(gt.path)
    for ref in r.layer_refs():
        truth = gt.layers[ref.layer]
        layer = r.read_layer(ref)
        assert layer.row_order == truth.row_order
        if truth.w13_mx is not None:
            assert layer.w13 is None and layer.w2 is None
            assert layer.w13_mx.fmt == layer.w2_mx.fmt == "mxfp4"
            assert torch.equal(layer.w13_mx.data, truth.w13_mx[0])
            assert torch.equal(layer.w13_mx.scales, truth.w13_mx[1])
            assert torch.equal(layer.w2_mx.data, truth.w2_mx[0])
            assert torch.equal(layer.w2_mx.scales, truth.w2_mx[1])
        else:
            assert layer.w13_mx is None and layer.w2_mx is None
            if gt.kind in FP8_KINDS:  # kept as stored; dequantized (fp32) where it is computed
                assert layer.w13 is None and layer.w13_fp8 is not None and layer.w2_fp8 is not None
                assert layer.w13_fp8.parts[0][0].dtype == torch.float8_e4m3fn
            w13, w2 = layer.float_weights()
            assert w13.dtype == truth.w13.dtype and w2.dtype == truth.w2.dtype
            assert torch.equal(w13, truth.w13)
            assert torch.equal(w2, truth.w2)
            # gpt-oss BF16 comes back as transposed views (made contiguous where computed);
            # the canonical orientation is what matters: K (the input dim) last.
            assert w13.shape[-1] == truth.w13.shape[-1] and w2.shape[-1] == truth.w2.shape[-1]
        if truth.w13_bias is None:
            assert layer.w13_bias is None and layer.w2_bias is None
        else:
            assert torch.equal(layer.w13_bias, truth.w13_bias) and layer.w13_bias.dtype == torch.bfloat16
            assert torch.equal(layer.w2_bias, truth.w2_bias)


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen2-moe", "mixtral", "glm4-moe"])
def test_w13_is_gate_then_up_from_disk(built: Callable[[str], GroundTruth], kind: str) -> None:
    gt = built(kind)
    r = reader_for(gt.path)
    gate, up, down = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    I = gt.intermediate_size
    for ref in r.layer_refs():
        layer = r.read_layer(ref)
        for e in range(4):
            x = f"{ref.module_prefix}.experts.{e}"
            assert torch.equal(layer.w13[e, :I], raw(gt.path, f"{x}.{gate}.weight"))
            assert torch.equal(layer.w13[e, I:], raw(gt.path, f"{x}.{up}.weight"))
            assert torch.equal(layer.w2[e], raw(gt.path, f"{x}.{down}.weight"))


@pytest.mark.parametrize("dtype,name", [(torch.float16, "fp16"), (torch.float32, "fp32")])
def test_other_float_dtypes(tmp_path: Path, dtype: torch.dtype, name: str) -> None:
    gt = make_checkpoint(tmp_path, "mixtral", dtype=dtype, shards=1)
    r = reader_for(tmp_path)
    assert r.model_info().expert_format == name
    layer = r.read_layer(r.layer_refs()[1])
    assert layer.w13.dtype == dtype and torch.equal(layer.w13, gt.layers[1].w13)


def _gpt_oss_layers(gt: GroundTruth) -> Iterator[tuple[MoELayerRef, str, MoELayer]]:
    """(ref, experts module name, layer as read) of every MoE layer of a generated gpt-oss checkpoint."""
    r = reader_for(gt.path)
    for ref in r.layer_refs():
        yield ref, f"{ref.module_prefix}.experts", r.read_layer(ref)


def test_gpt_oss_bf16_is_transposed_and_interleaved(built: Callable[[str], GroundTruth]) -> None:
    gt = built("gpt-oss-bf16")
    E, H, I = 4, gt.hidden_size, gt.intermediate_size
    for ref, x, layer in _gpt_oss_layers(gt):
        disk13, disk2 = raw(gt.path, f"{x}.gate_up_proj"), raw(gt.path, f"{x}.down_proj")
        assert tuple(disk13.shape) == (E, H, 2 * I) and tuple(disk2.shape) == (E, I, H)  # in x out on disk
        assert tuple(layer.w13.shape) == (E, 2 * I, H) and tuple(layer.w2.shape) == (E, H, I)
        for e, n, k in ((0, 0, 0), (1, 5, 17), (3, 2 * I - 1, H - 1)):
            assert layer.w13[e, n, k] == disk13[e, k, n]
        assert torch.equal(layer.w2, disk2.transpose(1, 2))
        truth = gt.layers[ref.layer]
        assert torch.equal(layer.w13[:, 0::2], truth.gate)  # row 2j = gate j
        assert torch.equal(layer.w13[:, 1::2], truth.up)  # row 2j+1 = up j


def test_gpt_oss_mxfp4_keeps_source_bytes(built: Callable[[str], GroundTruth]) -> None:
    gt = built("gpt-oss-mxfp4")
    E, H, I = 4, gt.hidden_size, gt.intermediate_size
    for _ref, x, layer in _gpt_oss_layers(gt):
        blocks = raw(gt.path, f"{x}.gate_up_proj_blocks")
        assert tuple(blocks.shape) == (E, 2 * I, H // 32, 16)
        assert torch.equal(layer.w13_mx.data, blocks.reshape(E, 2 * I, H // 2))
        assert torch.equal(layer.w2_mx.scales, raw(gt.path, f"{x}.down_proj_scales"))


@pytest.mark.parametrize("kind", FP8_KINDS)
def test_block_fp8_dequantized_in_fp32(built: Callable[[str], GroundTruth], kind: str) -> None:
    gt = built(kind)
    r = reader_for(gt.path)
    H, I = gt.hidden_size, gt.intermediate_size
    ref = r.layer_refs()[-1]
    layer = r.read_layer(ref)
    w13, w2 = layer.float_weights()
    assert w13.dtype == torch.float32 and w2.dtype == torch.float32
    for e in range(4):
        for proj, n, k, got in (
            ("gate_proj", I, H, w13[e, :I]),
            ("up_proj", I, H, w13[e, I:]),
            ("down_proj", H, I, w2[e]),
        ):
            name = f"{ref.module_prefix}.experts.{e}.{proj}"
            w8, s = raw(gt.path, f"{name}.weight"), raw(gt.path, f"{name}.weight_scale_inv")
            assert w8.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            assert tuple(s.shape) == (math.ceil(n / 128), math.ceil(k / 128))
            want = torch.empty(n, k)
            for i in range(s.shape[0]):  # W[i, j] = fp32(W_fp8[i, j]) * scale_inv[i // 128, j // 128]
                for j in range(s.shape[1]):
                    tile = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
                    want[tile] = w8[tile].to(torch.float32) * s[i, j]
            assert torch.equal(got, want)
            if kind == "deepseek-v3.1-fp8-ue8m0":
                assert bool((torch.frexp(s).mantissa == 0.5).all())  # powers of two ...
                exact = w8.to(torch.float64) * s.to(torch.float64).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
                assert torch.equal(got.to(torch.float64), exact)  # ... so the fp32 product is exact
    # fp32, not rounded through bf16: arbitrary scales give values bf16 cannot hold
    if kind != "deepseek-v3.1-fp8-ue8m0":
        assert bool((w13 != w13.to(torch.bfloat16).to(torch.float32)).any())


def test_mtp_layer_is_a_moe_layer(built: Callable[[str], GroundTruth]) -> None:
    gt = built("deepseek-v3-fp8")
    assert gt.config["num_hidden_layers"] == 2 and gt.config["num_nextn_predict_layers"] == 1
    r = reader_for(gt.path)
    assert r.model_info().moe_layers == (1, 2)
    mtp = r.layer_refs()[-1]
    assert mtp.layer == 2 and mtp.module_prefix == "model.layers.2.mlp"
    assert "model.layers.2.eh_proj.weight" in gt.tensor_names
    assert not any("eh_proj" in n or "shared_head" in n for n in mtp.source_names)


def test_mtp_layer_absent_from_checkpoint_is_accepted(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "deepseek-v3-fp8", num_nextn_predict_layers=0)
    patch_config(tmp_path, num_nextn_predict_layers=1)  # config announces it, the release ships without it
    assert reader_for(tmp_path).model_info().moe_layers == (1,)


def test_mtp_layer_without_experts_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "glm4-moe")
    rewrite(tmp_path, lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.2.mlp.experts.")])
    with pytest.raises(BadInput) as ei:
        reader_for(tmp_path).model_info()
    assert str(ei.value) == (
        f"{tmp_path.resolve()}: layer 2 (multi-token-prediction layer 0 of num_nextn_predict_layers=1) "
        f"is in the checkpoint but has no routed-expert tensors"
    )


def test_qwen_mlp_only_layers(tmp_path: Path) -> None:
    gt = make_checkpoint(tmp_path, "qwen3-moe", ModelSizes(num_layers=3), mlp_only_layers=(1,))
    r = reader_for(tmp_path)
    assert r.model_info().moe_layers == (0, 2) == gt.moe_layers
    assert "model.layers.1.mlp.gate_proj.weight" in gt.tensor_names


# ---------------------------------------------------------------------------------------------
# quantized output convention
# ---------------------------------------------------------------------------------------------


def test_gpt_oss_quantized_tensors_reproduce_source_bytes(built: Callable[[str], GroundTruth]) -> None:
    gt = built("gpt-oss-mxfp4")
    r = reader_for(gt.path)
    for ref in r.layer_refs():
        q = r.quantized_tensors(r.read_layer(ref))
        specs = r.quantized_specs(ref, "mxfp4")
        assert set(q) == set(specs) == set(ref.source_names)
        for n, t in q.items():
            src = raw(gt.path, n)
            assert t.dtype == src.dtype == specs[n].dtype and tuple(t.shape) == tuple(src.shape) == specs[n].shape
            assert torch.equal(t, src), n
    assert r.quantization_config("mxfp4", "rceil") == gt.config["quantization_config"]
    assert r.quantization_config("mxfp8", "rceil") == {
        "quant_method": None,  # no loader misreads it (transformers refuses); mxconv's own key names it
        "mxconv_quant_method": "mxfp8",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }


@pytest.mark.parametrize(
    "kind,fmt",
    [
        ("qwen3-moe", "mxfp4"),
        ("qwen2-moe", "mxfp8"),
        ("mixtral", "mxfp4"),
        ("mixtral", "mxfp8"),
        ("deepseek-v3-fp8", "mxfp4"),
        ("glm4-moe", "mxfp8"),
        ("gpt-oss-bf16", "mxfp4"),
        ("gpt-oss-bf16", "mxfp8"),
    ],
)
def test_quantized_output_reads_back(built: Callable[[str], GroundTruth], tmp_path: Path, kind: str, fmt: str) -> None:
    gt = built(kind)
    r = reader_for(gt.path)
    layers = random_mx_layers(r, fmt)
    out = tmp_path / "q"
    write_quantized(gt, r, layers, fmt, out)
    back = reader_for(out)
    assert type(back) is type(r)
    info = back.model_info()
    assert (info.expert_format, info.source_scale_scheme) == (fmt, "e8m0")
    assert info.moe_layers == r.model_info().moe_layers
    assert [x.source_names for x in back.layer_refs()] == [tuple(back.quantized_specs(x, fmt)) for x in back.layer_refs()]
    for ref in back.layer_refs():
        got, want = back.read_layer(ref), layers[ref.layer]
        assert got.row_order == want.row_order
        for a, b in ((got.w13_mx, want.w13_mx), (got.w2_mx, want.w2_mx)):
            assert a.fmt == b.fmt == fmt
            assert a.data.dtype == torch.uint8 and torch.equal(a.data, b.data)
            assert torch.equal(a.scales, b.scales)
        if want.w13_bias is not None:
            assert torch.equal(got.w13_bias, want.w13_bias) and torch.equal(got.w2_bias, want.w2_bias)
    # every other tensor is untouched
    src, dst = all_tensors(gt.path), all_tensors(out)
    consumed = {n for ref in r.layer_refs() for n in ref.source_names}
    for n, t in src.items():
        if n not in consumed:
            assert torch.equal(dst[n].view(torch.uint8), t.view(torch.uint8)), n


def test_per_expert_quantized_names(built: Callable[[str], GroundTruth]) -> None:
    r = reader_for(built("mixtral").path)
    ref = r.layer_refs()[0]
    specs = r.quantized_specs(ref, "mxfp4")
    p = "model.layers.0.block_sparse_moe.experts.3"
    assert specs[f"{p}.w1.weight_packed"].shape == (96, 80) and specs[f"{p}.w1.weight_packed"].dtype == torch.uint8
    assert specs[f"{p}.w3.weight_scale"].shape == (96, 5)
    assert specs[f"{p}.w2.weight_packed"].shape == (160, 48) and specs[f"{p}.w2.weight_scale"].shape == (160, 3)
    specs8 = r.quantized_specs(ref, "mxfp8")
    assert specs8[f"{p}.w1.weight"].dtype == torch.float8_e4m3fn and specs8[f"{p}.w1.weight"].shape == (96, 160)
    assert len(specs) == len(specs8) == 4 * 3 * 2


def test_per_expert_quantization_config(built: Callable[[str], GroundTruth]) -> None:
    r = reader_for(built("mixtral").path)
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group", "dynamic": False,
               "scale_dtype": "torch.uint8"}  # fmt: skip
    assert r.quantization_config("mxfp8", "floor") == {
        "quant_method": "compressed-tensors",
        "format": "mxfp8-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.(w1|w3|w2)$", r"re:.*block_sparse_moe\.experts$"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "mxfp8-quantized",
            }
        },
        "ignore": ["lm_head", r"re:.*embed_tokens$", r"re:.*self_attn\..*", r"re:.*\.block_sparse_moe\.gate$"],
        "kv_cache_scheme": None,
        "mxconv_scale_rounding": "floor",
    }
    # DeepSeek: only the patterns that match something, covering MLA attention, shared experts,
    # the dense layer and the MTP layer's extra Linear modules.
    ds = reader_for(built("deepseek-v3-fp8").path).quantization_config("mxfp4", "rceil")
    assert ds["config_groups"]["group_0"]["weights"]["num_bits"] == 4 and ds["format"] == "mxfp4-pack-quantized"
    assert ds["ignore"] == [
        "lm_head",
        r"re:.*embed_tokens$",
        r"re:.*self_attn\..*",
        r"re:.*\.mlp\.gate$",
        r"re:.*\.shared_experts?\..*",
        r"re:.*\.mlp\.(gate_proj|up_proj|down_proj)$",
        r"re:.*\.eh_proj$",
        r"re:.*\.shared_head\..*",
    ]
    with pytest.raises(ValueError, match="unknown MX format 'nvfp4'"):
        r.quantization_config("nvfp4", "rceil")


def test_qwen_norm_topk_prob_defaults_to_false(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3-moe", shards=1)
    patch_config(tmp_path, norm_topk_prob=None)
    assert reader_for(tmp_path).model_info().norm_topk_prob is False


def test_quantized_tensors_refuse_float_layers(built: Callable[[str], GroundTruth]) -> None:
    r = reader_for(built("qwen3-moe").path)
    with pytest.raises(ValueError, match="needs an MX-quantized layer"):
        r.quantized_tensors(r.read_layer(r.layer_refs()[0]))


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral", "deepseek-v3-fp8"])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_compressed_tensors_decodes_our_output(built: Callable[[str], GroundTruth], tmp_path: Path, kind: str, fmt: str) -> None:
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.utils.match import match_name

    del ct
    gt = built(kind)
    r = reader_for(gt.path)
    layers = random_mx_layers(r, fmt, seed=11)
    out = tmp_path / "q"
    write_quantized(gt, r, layers, fmt, out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["mxconv_scale_rounding"] == "rceil"
    parsed = QuantizationConfig.model_validate(qc)  # extra key tolerated
    # the weights arguments are exactly the library's MXFP4A16 / MXFP8A16 preset, as it serializes them
    preset = preset_name_to_scheme({"mxfp4": "MXFP4A16", "mxfp8": "MXFP8A16"}[fmt], ["x"])
    assert qc["config_groups"]["group_0"]["weights"] == preset.model_dump(mode="json")["weights"]
    assert parsed.format == {"mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized"}[fmt]

    tensors = all_tensors(out)
    decoded = CompressedTensorsDequantizer(out, dtype=torch.float32).validate(dict(tensors))
    I = gt.intermediate_size
    projs = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for ref in r.layer_refs():
        lay = layers[ref.layer]
        for e in range(4):
            for proj, stack, rows in ((projs[0], lay.w13_mx, slice(0, I)), (projs[1], lay.w13_mx, slice(I, 2 * I)), (projs[2], lay.w2_mx, slice(None))):
                name = f"{ref.module_prefix}.experts.{e}.{proj}"
                want = decode_mx(stack.data[e, rows], stack.scales[e, rows], fmt)
                assert torch.equal(decoded[f"{name}.weight"].to(torch.float64), want), name
                assert f"{name}.weight_scale" not in decoded and f"{name}.weight_packed" not in decoded
    for n, t in tensors.items():  # everything else passes through the decompressor untouched
        if ".experts." not in n:
            assert torch.equal(decoded[n].view(torch.uint8), t.view(torch.uint8)), n

    # What vLLM matches: the fused-MoE module and every per-expert Linear are targeted and not ignored;
    # every other Linear of the checkpoint is ignored (older vLLM refuses unmatched Linear layers).
    group = qc["config_groups"]["group_0"]

    def hit(name: str, patterns: list[str]) -> bool:
        return any(match_name(name, p) for p in patterns)

    moe = "block_sparse_moe" if kind == "mixtral" else "mlp"
    for L in r.model_info().moe_layers:
        fused = f"model.layers.{L}.{moe}.experts"
        assert hit(fused, group["targets"]) and not hit(fused, qc["ignore"])
    for n, t in tensors.items():
        if n.endswith((".weight", ".weight_packed")) and t.dim() == 2:
            module = n.rsplit(".", 1)[0]
            expert = re.search(r"\.experts\.\d+\.", module) is not None
            assert hit(module, group["targets"]) is expert, module
            assert hit(module, qc["ignore"]) is not expert, module
    for fused in ("model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.q_proj"):
        assert hit(fused, qc["ignore"]) or not hit(fused, group["targets"])


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def test_unknown_family_lists_supported(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3-moe", shards=1)
    patch_config(tmp_path, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(BadInput) as ei:
        reader_for(tmp_path)
    titles = ", ".join(reader_class(n).title for n in FAMILIES)
    assert str(ei.value) == (
        f"{tmp_path.resolve()}: unknown model family (model_type 'llama', architectures ['LlamaForCausalLM']); "
        f"supported families: {titles}"
    )
    for t in ("gpt-oss", "DeepSeek-V3", "Kimi-K2", "GLM-4.5", "Qwen2/Qwen3-MoE", "Mixtral"):
        assert t in titles


# config.json edits the reader refuses at model_info, with the message after "<checkpoint dir>: "
CONFIG_REFUSALS = [
    pytest.param(
        "qwen3-moe", {"moe_intermediate_size": 128},
        "tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' has shape [96, 160], "
        "expected [128, 160] ([intermediate, hidden] = [128, 160] from config.json)",
        id="shape_contradicting_config",
    ),
    pytest.param(
        "glm4-moe", {"n_routed_experts": 5},
        "tensor 'model.layers.1.mlp.experts.4.gate_proj.weight' is missing "
        "(layer 1 is a MoE layer and config.json has 5 routed experts, each with three projections)",
        id="too_many_experts_in_config",
    ),
    pytest.param(
        "qwen2-moe", {"num_experts": 3},
        "tensor 'model.layers.0.mlp.experts.3.gate_proj.weight' has expert index 3, "
        "but config.json has 3 routed experts",
        id="too_few_experts_in_config",
    ),
    pytest.param(
        "qwen3-moe", {"mlp_only_layers": [1]},
        "layer 1 has routed-expert tensors (model.layers.1.mlp.experts.0.gate_proj...), but "
        "config.json makes it a dense layer (num_hidden_layers=2; mlp_only_layers=[1], decoder_sparse_step=1)",
        id="config_and_names_disagree_on_moe_layers",
    ),
    pytest.param(
        "deepseek-v3-fp8", {"first_k_dense_replace": 0},
        "config.json makes layer 0 a MoE layer (L >= first_k_dense_replace(0) and "
        "L % moe_layer_freq(1) == 0), but the checkpoint has no routed-expert tensors for it "
        "(e.g. 'model.layers.0.mlp.experts.0.gate_proj.weight' is missing)",
        id="config_expects_moe_where_layer_is_dense",
    ),
    pytest.param(
        "gpt-oss-bf16", {"num_local_experts": 8},
        "tensor 'model.layers.0.mlp.experts.gate_up_proj' has shape [4, 96, 128], expected "
        "[8, 96, 128] (num_local_experts=8, hidden_size=96, intermediate_size=64 from config.json, stored [in, out])",
        id="gpt_oss_expert_count",
    ),
]


@pytest.mark.parametrize("kind,config,message", CONFIG_REFUSALS)
def test_config_contradicting_tensors(tmp_path: Path, kind: str, config: dict[str, Any], message: str) -> None:
    assert refusal(tmp_path, kind, config=config) == f"{tmp_path.resolve()}: {message}"


def test_hidden_size_contradicting_router(tmp_path: Path) -> None:
    assert re.search(
        r"tensor 'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight' has shape \[96, 160\], expected \[96, 192\]",
        refusal(tmp_path, "mixtral", "layer_refs", config={"hidden_size": 192}),
    )


def test_missing_expert_tensor(tmp_path: Path) -> None:
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    assert refusal(tmp_path, "deepseek-v3-fp8", "layer_refs", mutate=lambda t: t.pop(name)) == (
        f"{tmp_path.resolve()}: tensor 'model.layers.1.mlp.experts.2.up_proj.weight_scale_inv' is missing "
        f"(layer 1 is a MoE layer and config.json has 4 routed experts, each with three projections)"
    )


def test_fp8_scale_shape_checked(tmp_path: Path) -> None:
    name = "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"

    def grow(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.ones(3, 3)

    assert refusal(tmp_path, "kimi-k2", mutate=grow) == (
        f"{tmp_path.resolve()}: tensor {name!r} has shape [3, 3], expected [3, 2] (one scale per 128x128 tile of [288, 160])"
    )


@pytest.mark.parametrize(
    "kind,qc,what",
    [
        ("qwen3-moe", {"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method 'awq'"),
        ("mixtral", {"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ("glm4-moe", {"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_method 'modelopt'"),
        (
            "deepseek-v3-fp8",
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 32, "strategy": "group", "symmetric": True}, "format": "pack-quantized"}},
            },
            "quant_method 'compressed-tensors', format 'pack-quantized'",
        ),
        ("gpt-oss-mxfp4", {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}, "quant_method 'compressed-tensors', format 'mxfp4-pack-quantized'"),
    ],
)
def test_unsupported_quantization(tmp_path: Path, kind: str, qc: dict[str, Any], what: str) -> None:
    make_checkpoint(tmp_path, kind, shards=1)
    patch_config(tmp_path, quantization_config=qc)
    r = reader_for(tmp_path)
    with pytest.raises(BadInput) as ei:
        r.model_info()
    assert str(ei.value) == f"{tmp_path.resolve() / 'config.json'}: unsupported quantization ({what}) for {r.title}: {SUPPORTED_HINT}"


def test_per_tensor_fp8_is_unsupported(tmp_path: Path) -> None:
    qc = {"quant_method": "fp8", "activation_scheme": "static"}
    assert re.search(
        r"unsupported quantization \(quant_method 'fp8' without a \[rows, cols\] weight_block_size",
        refusal(tmp_path, "deepseek-v3-fp8", config={"quantization_config": qc}, shards=1),
    )


def test_fp8_tensors_without_quantization_config(tmp_path: Path) -> None:
    assert re.search(
        r"are fp8_block, but config.json has no quantization_config",
        refusal(tmp_path, "deepseek-v3-fp8", config={"quantization_config": None}, shards=1),
    )


def _gpt_oss_edit(tmp_path: Path, mutate: Callable[[dict[str, torch.Tensor]], None]) -> str:
    return refusal(tmp_path, "gpt-oss-mxfp4", mutate=mutate, sizes=ModelSizes(hidden_size=128))


BLOCKS = "model.layers.0.mlp.experts.gate_up_proj_blocks"
SCALES = "model.layers.0.mlp.experts.gate_up_proj_scales"


def test_gpt_oss_blocks_last_dim(tmp_path: Path) -> None:
    def f(t: dict[str, torch.Tensor]) -> None:
        t[BLOCKS] = t[BLOCKS].reshape(4, 128, 2, 32).contiguous()

    assert _gpt_oss_edit(tmp_path, f) == (
        f"{tmp_path.resolve()}: tensor {BLOCKS!r} has shape [4, 128, 2, 32], expected last dim 16 "
        f"(mxfp4: 16 bytes per block of 32), i.e. [4, 128, 4, 16]"
    )


def test_gpt_oss_scales_shape(tmp_path: Path) -> None:
    def f(t: dict[str, torch.Tensor]) -> None:
        t[SCALES] = torch.full((4, 128, 5), 127, dtype=torch.uint8)

    assert _gpt_oss_edit(tmp_path, f) == (
        f"{tmp_path.resolve()}: tensor {SCALES!r} has shape [4, 128, 5], expected [4, 128, 4] "
        f"(the shape of {BLOCKS!r} without its last dim)"
    )


def test_gpt_oss_blocks_dtype(tmp_path: Path) -> None:
    def f(t: dict[str, torch.Tensor]) -> None:
        t[BLOCKS] = t[BLOCKS].view(torch.int8)

    assert _gpt_oss_edit(tmp_path, f) == f"{tmp_path.resolve()}: tensor {BLOCKS!r} has dtype I8, expected U8 (mxfp4 blocks)"


def test_gpt_oss_original_layout_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "gpt-oss-mxfp4", shards=1)
    rewrite(tmp_path, lambda t: t.update({"block.0.mlp.mlp1_weight.blocks": t[BLOCKS].clone()}), shards=1)
    patch_config(tmp_path, model_type=None, architectures=None)
    r = reader_for(tmp_path)
    assert r.name == "gpt-oss"
    with pytest.raises(BadInput, match="OpenAI's original gpt-oss layout"):
        r.layer_refs()


# ---------------------------------------------------------------------------------------------
# repo-id sources
# ---------------------------------------------------------------------------------------------


def test_repo_id_from_offline_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hub_constants

    gt = make_checkpoint(tmp_path / "src", "mixtral")
    cache = tmp_path / "hub"
    snap = make_hub_cache(cache, "acme/tiny-mixtral", tmp_path / "src")
    assert (cache / "models--acme--tiny-mixtral" / "refs" / "main").read_text() == snap.name
    assert re.fullmatch(r"[0-9a-f]{40}", snap.name)
    # huggingface_hub reads its environment at import time: patch the module constants too.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    ck = open_checkpoint("acme/tiny-mixtral")
    assert ck.root == snap.resolve()
    assert ck.source.repo_id == "acme/tiny-mixtral" and ck.source.fingerprint == f"hf:acme/tiny-mixtral@{snap.name}"
    r = detect_family(ck)
    layer = r.read_layer(r.layer_refs()[1])
    assert torch.equal(layer.w13, gt.layers[1].w13)
    with pytest.raises(BadInput, match="acme/other: cannot fetch"):
        open_checkpoint("acme/other")
